"""Per-op cost of the server's bounds checks (runtime/server/bounds.py), next to the op itself.

    python bench/bounds.py [--calls 20000] [--repeats 7]

For each op: the op's C++ callable alone, and its rule then the op, as the executor runs them
(``rule(args, kwargs)`` on fresh argument lists, then the call), interleaved repeat by repeat
so both see the same machine; medians in µs per call. An op with no rule costs nothing more
(the executor's ``if rule is not None``). The machine is shared and noisy: compare within a run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from gpu_trace.runtime.server import allowlist


def _cases() -> dict[str, tuple[str, list[Any], dict[str, Any]]]:
    x = torch.ones(16)
    idx = torch.tensor([0, 3, 1])
    p = [torch.ones(256) for _ in range(4)]
    return {
        "add.Tensor (no rule)": ("aten::add.Tensor", [x, x], {}),
        "_to_copy (dtype: enum rule)": ("aten::_to_copy.default", [x], {"dtype": torch.float64}),
        "sum (dtype: enum rule)": ("aten::sum.default", [x], {"dtype": None}),
        "as_strided (view rule)": ("aten::as_strided.default", [x, [4, 4], [4, 1]], {}),
        "_reshape_alias (view rule)": ("aten::_reshape_alias.default", [x, [4, 4], [4, 1]], {}),
        "embedding_dense_backward (indices)": (
            "aten::embedding_dense_backward.default",
            [torch.ones(3, 8), idx, 4, -1, False],
            {},
        ),
        "native_batch_norm (channels)": (
            "aten::native_batch_norm.default",
            [torch.ones(4, 3), None, None, torch.zeros(3), torch.ones(3), False, 0.1, 1e-5],
            {},
        ),
        "_foreach_add.List (lengths)": ("aten::_foreach_add.List", [p, p], {}),
    }


def _time(fn: Any, calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    ns = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'op':38} {'op alone':>10} {'rule + op':>10} {'rule':>8}  (µs, medians)")
    for label, (name, args, kwargs) in _cases().items():
        op = allowlist.resolve(name)
        call, rule = op._op, allowlist.rule(op)

        def bare(args: list[Any] = args, kwargs: dict[str, Any] = kwargs, call: Any = call) -> None:
            call(*list(args), **dict(kwargs))

        def ruled(
            args: list[Any] = args,
            kwargs: dict[str, Any] = kwargs,
            call: Any = call,
            rule: Any = rule,
        ) -> None:
            a, k = list(args), dict(kwargs)
            if rule is not None:
                rule(a, k)
            call(*a, **k)

        alone, both = [], []
        for _ in range(ns.repeats):
            alone.append(_time(bare, ns.calls))
            both.append(_time(ruled, ns.calls))
        a, b = statistics.median(alone), statistics.median(both)
        print(f"{label:38} {a:10.2f} {b:10.2f} {b - a:8.2f}")


if __name__ == "__main__":
    main()
