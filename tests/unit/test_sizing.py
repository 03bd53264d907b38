"""The server's sizes of ops before they run (``runtime.server.sizing``), against what real ops on
the CPU allocate: exact for ops with meta kernels, upper bounds for ops sized by their data."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.server.sizing import BOUNDS, Sizing, signature, sizer

aten = torch.ops.aten


def _size(op, args: list, kwargs: dict | None = None, sizing: Sizing | None = None) -> int:
    sizing = sizing or Sizing()
    return sizing.op_bytes(sizer(op), op._op, args, kwargs or {})


def _storages(value) -> dict[int, int]:
    if isinstance(value, torch.Tensor):
        s = value.untyped_storage()
        return {s._cdata: s.nbytes()}  # the same through a resize, unlike data_ptr
    if isinstance(value, (list, tuple)):
        out: dict[int, int] = {}
        for v in value:
            out.update(_storages(v))
        return out
    return {}


def _allocated(op, args: list, kwargs: dict | None = None) -> int:
    """Bytes of the storages ``op`` returns that its inputs did not hold, plus input growth."""
    inputs = _storages([*args, *(kwargs or {}).values()])
    out = op(*args, **(kwargs or {}))
    after = _storages([*args, *(kwargs or {}).values()])
    grown = sum(max(0, after.get(k, 0) - n) for k, n in inputs.items())
    new = sum(n for k, n in _storages(out).items() if k not in inputs and k not in after)
    return new + grown


def test_a_repeated_op_is_sized_once_per_signature() -> None:
    sizing = Sizing()
    x, y = torch.ones(4, 3), torch.ones(4, 3)
    for _ in range(3):
        assert _size(aten.add.Tensor, [x, y], sizing=sizing) == 48
    assert sizing.cache.misses == 1
    # Other values of the same signature: the same size, no new meta computation.
    assert _size(aten.add.Tensor, [torch.zeros(4, 3), y], sizing=sizing) == 48
    assert sizing.cache.misses == 1
    # Another shape, another scalar type, other strides: each its own signature.
    assert _size(aten.add.Tensor, [torch.ones(8, 3), torch.ones(8, 3)], sizing=sizing) == 96
    assert _size(aten.add.Tensor, [x, y.t().contiguous().t()], sizing=sizing) == 48
    assert sizing.cache.misses == 3
    assert _size(aten.add.Tensor, [torch.ones(4, dtype=torch.int32), 1], sizing=sizing) == 16
    assert _size(aten.add.Tensor, [torch.ones(4, dtype=torch.int32), 1.0], sizing=sizing) == 16
    assert sizing.cache.misses == 5


def test_a_refusal_is_cached_too() -> None:
    sizing = Sizing()
    x = torch.ones(4, 2)
    for _ in range(2):
        with pytest.raises(OpError, match="cannot tell what this op would allocate"):
            _size(aten.histogramdd.default, [x, [2, 2]], sizing=sizing)
    assert sizing.cache.misses == 1


def test_signatures_tell_apart_what_changes_an_ops_output() -> None:
    assert signature([1]) != signature([1.0]) != signature([True])
    assert signature([float("nan")]) == signature([float("nan")])  # one entry, not one each
    x = torch.ones(4, 4)
    assert signature([x]) == signature([torch.zeros(4, 4)])
    assert signature([x]) != signature([x.t()]) != signature([x[1:]])
    assert signature([x]) != signature([x.double()])


CASES = [
    ("add", aten.add.Tensor, lambda: [torch.ones(16, 1), torch.ones(1, 16)], {}),
    ("mm", aten.mm.default, lambda: [torch.ones(32, 1), torch.ones(1, 32)], {}),
    ("clone of expand", aten.clone.default, lambda: [torch.ones(1).expand(1000)], {}),
    ("repeat", aten.repeat.default, lambda: [torch.ones(3), [5, 2]], {}),
    ("arange", aten.arange.default, lambda: [1000], {"dtype": torch.int64}),
    ("eye", aten.eye.default, lambda: [37], {}),
    ("randperm", aten.randperm.default, lambda: [77], {}),
    ("view", aten.view.default, lambda: [torch.ones(12), [3, 4]], {}),
    ("in place", aten.add_.Tensor, lambda: [torch.ones(12), 1], {}),
    ("split", aten.split.Tensor, lambda: [torch.ones(12), 5], {}),
    ("sort", aten.sort.default, lambda: [torch.rand(50)], {}),
    ("cat", aten.cat.default, lambda: [[torch.ones(3), torch.ones(9)]], {}),
    ("contiguous copy", aten.clone.default, lambda: [torch.ones(6, 4).t()], {}),
    ("as_strided", aten.as_strided.default, lambda: [torch.ones(20), [2, 2], [1, 2]], {}),
    ("new_zeros", aten.new_zeros.default, lambda: [torch.ones(1, dtype=torch.half), [9]], {}),
    (
        "out resized",
        aten.add.out,
        lambda: [torch.ones(100), torch.ones(100)],
        {"out": torch.empty(3)},
    ),
    ("resize_", aten.resize_.default, lambda: [torch.ones(3), [64]], {}),
]


@pytest.mark.parametrize(("name", "op", "args", "kwargs"), CASES, ids=[c[0] for c in CASES])
def test_a_size_is_what_the_op_allocates(name: str, op, args, kwargs) -> None:
    import warnings

    a = args()
    expected_size = _size(op, a, kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # add.out warns about resizing its output
        assert _allocated(op, args(), dict(kwargs)) == expected_size


def test_sizes_are_rounded_as_the_allocator_holds_storages() -> None:
    sizing = Sizing(block=512)
    assert _size(aten.ones.default, [[3]], {"dtype": torch.float32}, sizing=sizing) == 512
    got = _size(aten.sort.default, [torch.rand(200)], sizing=sizing)
    assert got == 1024 + 2048  # 800 and 1600 bytes, each rounded up
    assert _size(aten.view.default, [torch.ones(12), [3, 4]], sizing=sizing) == 0


def test_ops_that_return_no_tensor_are_not_sized() -> None:
    assert sizer(aten._local_scalar_dense.default) is None
    assert sizer(aten.equal.default) is None
    assert sizer(aten.nonzero.default) is BOUNDS["aten::nonzero"]
    assert sizer(aten.add.Tensor) == "aten::add.Tensor"


# ---- data-dependent ops: bounds ------------------------------------------------------------------


def _data_cases(values: list[int]) -> list[tuple]:
    x = torch.tensor(values, dtype=torch.int64)
    f = x.float()
    mask = x > 1
    counts = x.abs() % 4
    return [
        (aten.nonzero.default, [x], {}),
        (aten.nonzero.default, [x.reshape(1, -1)], {}),
        (aten.argwhere.default, [x], {}),
        (aten.nonzero_numpy.default, [x.reshape(1, -1)], {}),
        (aten.masked_select.default, [f, mask], {}),
        (aten.masked_select.default, [f.reshape(-1, 1), mask], {}),
        (aten._unique2.default, [x, True, True, True], {}),
        (aten.unique_consecutive.default, [x, True, True], {}),
        (aten.unique_dim.default, [x.reshape(1, -1), 1, True, True, True], {}),
        (aten.repeat_interleave.Tensor, [counts], {}),
        (aten.repeat_interleave.self_Tensor, [f, counts], {}),
        (aten.repeat_interleave.self_Tensor, [f.reshape(1, -1), counts[:1], 1], {}),
        (aten.bincount.default, [x.abs()], {}),
        (aten.bincount.default, [x.abs(), f], {"minlength": 40}),
        (aten.index.Tensor, [f, [mask]], {}),
        (aten.index.Tensor, [f.reshape(1, -1), [None, mask]], {}),
        (aten.histogram.bin_ct, [f], {"bins": 7}),
        (aten.binomial.default, [f.abs(), torch.full_like(f, 0.5)], {}),
        (aten._standard_gamma_grad.default, [f.abs() + 1, f.abs() + 1], {}),
        (aten._sample_dirichlet.default, [f.abs().reshape(1, -1) + 1], {}),
        (aten._masked_softmax.default, [f.reshape(1, -1), mask.reshape(1, -1), -1, None], {}),
    ]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-5, 60), min_size=1, max_size=40))
def test_a_data_dependent_bound_is_never_below_what_the_op_allocates(values: list[int]) -> None:
    for op, args, kwargs in _data_cases(values):
        bound = _size(op, args, kwargs)
        assert _allocated(op, args, kwargs) <= bound, op


def test_repeats_that_would_wrap_round_are_bounded_by_their_true_sum() -> None:
    # int64 sum of these wraps round to 0; the bound does not.
    repeats = torch.full((4,), 1 << 62, dtype=torch.int64)
    assert _size(aten.repeat_interleave.Tensor, [repeats]) >= 8 * 4 * (1 << 62)
    assert _size(aten.bincount.default, [torch.tensor([10**12])]) == 8 * (10**12 + 1)


def test_a_boolean_index_is_bounded_by_its_masks_size() -> None:
    x = torch.ones(1000, 3)
    mask = torch.zeros(1000, dtype=torch.bool)
    assert _size(aten.index.Tensor, [x, [mask]]) == 1000 * 3 * 4
    assert _size(aten.index.Tensor, [x, [torch.tensor([1, 2])]]) == 2 * 3 * 4
    grid = torch.zeros(10, 100, dtype=torch.bool)
    assert _size(aten.index.Tensor, [torch.ones(10, 100, 7), [grid]]) == math.prod((1000, 7)) * 4


def test_an_op_that_decomposes_counts_its_parts_temporaries() -> None:
    """``matmul`` of broadcast operands copies each, expanded, before a ``bmm``: a 40 KB result
    from 2 x 6.5 MB of temporaries. Ops with kernels of their own are sized by their results."""
    a, b = torch.ones(20, 1, 1, 4096), torch.ones(1, 20, 4096, 1)
    assert _size(aten.matmul.default, [a, b]) >= 2 * 20 * 20 * 4096 * 4
    assert _size(aten.bmm.default, [torch.ones(4, 2, 3), torch.ones(4, 3, 5)]) == 4 * 2 * 5 * 4
    assert _size(aten.to.dtype, [torch.ones(8), torch.float64]) == 64


def test_every_allowed_op_has_a_way_to_be_sized() -> None:
    """Working out how to size an op never fails, TorchScript-only builtins included (they are
    not in the dispatcher, so asking it whether they decompose raises): every op the allow-list
    may hold (its file is regenerated as programs need more), not only those it holds now."""
    from gpu_trace.runtime.server import allowlist

    ops, names = [], set()
    for name in sorted(allowlist.admissible()):
        base, _, overload = name[len("aten::") :].partition(".")
        op = getattr(getattr(torch.ops.aten, base, None), overload, None)
        if op is not None:
            ops.append(op)
            names.add(name)
    assert len(ops) > 1000 and names >= allowlist.allowed()
    kinds = {type(sizer(op)).__name__ for op in ops}
    assert kinds == {"NoneType", "str", "function"}


def test_factories_sent_without_a_device_are_sized_on_meta(tmp_path) -> None:
    """``eye(17000)`` and ``arange(1e8)`` with no device argument: sized without allocating the
    1.1 GB and 0.8 GB they ask for (they made real CPU tensors while being sized before). The
    child may allocate only 256 MiB more once its imports are done: a real allocation fails."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import resource, torch
        from gpu_trace.runtime.server.sizing import Sizing
        data = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                    if line.startswith("VmData:"))
        resource.setrlimit(resource.RLIMIT_DATA, (data + (256 << 20), resource.RLIM_INFINITY))
        s = Sizing(1)
        aten = torch.ops.aten
        print(s.op_bytes("eye", aten.eye.default, [17000], {}))
        print(s.op_bytes("arange", aten.arange.start_step, [0, 10**8, 1], {}))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TRACE_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    eye, arange = (int(v) for v in out.stdout.split())
    assert (eye, arange) == (17000 * 17000 * 4, 10**8 * 8)
