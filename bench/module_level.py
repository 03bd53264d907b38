"""What module level (``gpu-trace record --torch module``, the default) costs a launch-bound step,
per module call, and where it goes; op level and torch.profiler (CPU) as peers, in one run.

    python bench/module_level.py [--rounds 12] [--round-s 0.3] [--models lm,cells] [--parts]

Why these models: on a GPU whose step is launch-bound (the H100 language model of
``../shared/gpu/README.md``: about 20 ms, about 60 forward module calls a step) every
microsecond the training thread spends in gpu-trace is step time, so the budget of issue 17
(module level at most 3% of the step) is about 6 µs per module call, its backward included.
Here on the CPU the same shapes are made small, so the step is mostly per-call framework work:

- ``lm``: that language model at d=32 (embedding, 6 pre-norm ``nn.TransformerEncoderLayer``s,
  a linear head), batch 2 x 16 tokens, AdamW;
- ``cells``: PyTorch's time-sequence-prediction example, small: two ``nn.LSTMCell`` and a
  ``nn.Linear`` called per time step in a Python loop (20 steps: 61 module calls).

Each step is timed as wall time and CPU time of the training thread (``time.thread_time``, the
launch thread's time on a GPU); PyTorch runs on one intra-op thread, so the training thread's
CPU time is its whole work and the machine's other load does not count. ``process`` adds the
flusher's CPU. Configurations are interleaved in rounds (order rotated), each compared with the
unpatched steps of its round (the machinery of ``bench/patch_overhead.py``). Figures: median
step, ratio to unpatched [p25-p75 over rounds], µs per forward module call, % of the step.

``--parts`` adds configurations that switch parts of module level off (for this bench only) to
say where its time goes:

- ``module: hooks``: backward ranges from Python hooks on the autograd nodes, as before the
  native observer made them (``GPU_TRACE_TORCH_OPS=kineto``; forward ranges in C);
- ``module: python ranges``: forward ranges opened and closed in Python (``spans.begin``/``end``)
  instead of the tracer's C call;
- ``module: no observer``: no backward ranges (the observer stopped): the wrapper, its forward
  ranges and the two sequence-number reads per call;
- ``module: no ranges``: as ``no observer``, the ranges not recorded either: the wrapper, the name
  lookup and the sequence-number reads.

``process`` is the process's CPU time over the round divided by its steps (the flusher's
conversion and the backward ranges' matching, off the training thread, included), not a median.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def use_tree(root: str) -> None:
    """Import gpu_trace from the checkout at ``root`` (a ``git worktree`` of an earlier commit:
    "before"), not the installed one; its packages map as pyproject.toml's package-dir does."""
    import importlib.util

    folders = {
        "gpu_trace": "gpu_trace",
        "gpu_trace.tracer": "tracer",
        "gpu_trace.collectors": "collectors",
        "gpu_trace.dashboard": "dashboard",
        "gpu_trace.framework_patches": "framework_patches",
        "gpu_trace.runtime": "runtime",
    }

    class Finder:
        @classmethod
        def find_spec(cls, name: str, path: Any = None, target: Any = None) -> Any:
            if name not in folders:
                return None
            d = os.path.join(root, folders[name])
            init = os.path.join(d, "__init__.py")
            return importlib.util.spec_from_file_location(
                name, init, submodule_search_locations=[d]
            )

    sys.meta_path.insert(0, Finder)


if "--tree" in sys.argv[:-1]:  # before gpu_trace is imported (patch_overhead imports it)
    use_tree(os.path.abspath(sys.argv[sys.argv.index("--tree") + 1]))

import patch_overhead  # noqa: E402
from patch_overhead import METRICS, measure, quartiles, recording, steady_allocator  # noqa: E402

Step = Callable[[], None]


def cases() -> dict[str, Callable[[], tuple[Step, int]]]:
    """Name -> setup returning a training step and its forward module calls per step."""
    import torch
    from torch import nn

    torch.set_num_threads(1)

    def lm() -> tuple[nn.Module, Callable[[], Any]]:
        vocab, d = 256, 32

        class LM(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(vocab, d)
                layer = nn.TransformerEncoderLayer(
                    d, 2, 64, batch_first=True, norm_first=True, dropout=0.1
                )
                self.blocks = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
                self.head = nn.Linear(d, vocab)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(self.blocks(self.embed(x)))

        model = LM()
        x, y = torch.randint(0, vocab, (2, 16)), torch.randint(0, vocab, (2, 16))
        loss = nn.CrossEntropyLoss()
        return model, lambda: loss(model(x).reshape(-1, vocab), y.reshape(-1))

    def cells() -> tuple[nn.Module, Callable[[], Any]]:
        class Cells(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lstm1, self.lstm2 = nn.LSTMCell(1, 16), nn.LSTMCell(16, 16)
                self.linear = nn.Linear(16, 1)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                outs = []
                h1 = c1 = h2 = c2 = torch.zeros(x.size(0), 16)
                for t in x.split(1, dim=1):
                    h1, c1 = self.lstm1(t, (h1, c1))
                    h2, c2 = self.lstm2(h1, (h2, c2))
                    outs.append(self.linear(h2))
                return torch.cat(outs, 1)

        model = Cells()
        x = torch.randn(4, 21)
        return model, lambda: (model(x[:, :-1]) - x[:, 1:]).square().mean()

    def make(build: Callable[[], tuple[nn.Module, Callable[[], Any]]]) -> Callable:
        def setup() -> tuple[Step, int]:
            from torch.nn.modules import module as nn_module

            torch.manual_seed(0)
            model, loss_fn = build()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                loss_fn().backward()
                opt.step()

            calls = [0]
            handle = nn_module.register_module_forward_pre_hook(
                lambda m, a: calls.__setitem__(0, calls[0] + 1)
            )
            try:
                step()
            finally:
                handle.remove()
            return step, calls[0]

        return setup

    return {"lm": make(lm), "cells": make(cells)}


# ---- module level with parts switched off (--parts) -------------------------------------------


@contextlib.contextmanager
def module_part(part: str) -> Iterator[None]:
    """Module level with ``part`` switched off (see the docstring); restored on exit."""
    from gpu_trace.framework_patches import spans
    from gpu_trace.framework_patches import torch as pytorch
    from gpu_trace.framework_patches.torch import modules

    old = os.environ.get("GPU_TRACE_TORCH_OPS")
    if part == "hooks":
        os.environ["GPU_TRACE_TORCH_OPS"] = "kineto"
    try:
        with recording("GPU_TRACE_TORCH", "module"):
            saved = modules._in_range
            begin, end = spans.begin, spans.end
            try:
                if part in ("python ranges", "no ranges"):
                    modules._in_range = None
                if part in ("no observer", "no ranges") and pytorch._ops is not None:
                    pytorch._ops.stop()
                if part == "no ranges":
                    spans.begin = lambda *a, **k: None  # type: ignore[assignment]
                    spans.end = lambda *a, **k: None  # type: ignore[assignment]
                yield
            finally:
                spans.begin, spans.end = begin, end
                modules._in_range = saved
    finally:
        if old is None:
            os.environ.pop("GPU_TRACE_TORCH_OPS", None)
        else:
            os.environ["GPU_TRACE_TORCH_OPS"] = old


def configs(parts: bool) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    import torch

    out: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "unpatched": contextlib.nullcontext,
        "module": lambda: recording("GPU_TRACE_TORCH", "module"),
        "op": lambda: recording("GPU_TRACE_TORCH", "op"),
        "torch.profiler (CPU)": lambda: torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
        ),
    }
    if parts:
        for part in ("hooks", "python ranges", "no observer", "no ranges"):
            out[f"module: {part}"] = lambda part=part: module_part(part)
    return out


def run_round(step: Step, ctx: Any, steps: int) -> tuple[dict[str, float], float]:
    """Median wall and training-thread time per step inside ``ctx``, and the process's CPU time
    per step over the round and its exit (the flusher's work included); and the exit time."""
    wall, thread = [], []
    pc, tt, pt = time.perf_counter_ns, time.thread_time_ns, time.process_time_ns
    cm = ctx()
    cm.__enter__()
    try:
        step()  # the first steps after patching name modules, create buffers
        step()
        p0 = pt()
        for _ in range(steps):
            w, t = pc(), tt()
            step()
            t1, w1 = tt(), pc()
            wall.append(w1 - w)
            thread.append(t1 - t)
    finally:
        s = pc()
        cm.__exit__(None, None, None)
        stop_ns = pc() - s
        proc = (pt() - p0) / steps
    med = statistics.median
    return {"wall": med(wall), "thread": med(thread), "process": proc}, stop_ns


def report(title: str, results: dict, calls: int) -> None:
    base = results["unpatched"]
    print(f"\n{title}")
    head = f"  {'configuration':22}"
    for m in METRICS:
        head += f" | {m + ' ms':>9} {'ratio':>6} {'[p25-p75]':>13} {'µs/call':>7} {'%':>6}"
    print(head)
    for name, res in results.items():
        line = f"  {name:22}"
        for m in METRICS:
            ratios = [a / b for a, b in zip(res[m], base[m])]
            per_call = [(a - b) / calls / 1e3 for a, b in zip(res[m], base[m])]
            lo, mid, hi = quartiles(ratios)
            line += (
                f" | {statistics.median(res[m]) / 1e6:9.3f} {mid:6.3f} [{lo:5.3f}-{hi:5.3f}]"
                f" {statistics.median(per_call):7.1f} {100 * (mid - 1):6.1f}"
            )
        print(line)


# ---- another checkout (--tree), instructions (--instructions) ---------------------------------


def instructions(models: list[str], steps: int, chosen: list[str], tree: str | None) -> int:
    """Run this bench's models under callgrind (``bench/patch_instructions.py``'s way: the
    training thread, the measured steps only) and print instructions per step and per call."""
    import glob
    import re
    import shutil
    import subprocess
    import tempfile

    from patch_instructions import _ENV, _TOGGLE_C

    if shutil.which("valgrind") is None or shutil.which("cc") is None:
        print("valgrind and cc are needed", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        src, lib = os.path.join(d, "toggle.c"), os.path.join(d, "toggle.so")
        with open(src, "w") as f:
            f.write(_TOGGLE_C)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", lib, src], check=True)
        out = os.path.join(d, "cg.out")
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--separate-threads=yes"]
        cmd += [f"--callgrind-out-file={out}", sys.executable, os.path.abspath(__file__)]
        cmd += ["--models", ",".join(models), "--steps", str(steps)]
        cmd += ["--configs", ",".join(chosen)] + (["--tree", tree] if tree else [])
        cmd += ["--parts"] if any(c.startswith("module:") for c in chosen) else []
        run = subprocess.run(
            cmd,
            env=dict(os.environ, **{_ENV: lib}),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        if run.returncode != 0:
            print(run.stderr.decode(errors="replace")[-3000:], file=sys.stderr)
            return 1
        rows = []
        for path in glob.glob(out + ".*-01"):  # the training (main) thread's dumps
            with open(path, errors="replace") as f:
                text = f.read()
            label = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
            total = re.search(r"^(?:totals|summary): (\d+)", text, re.M)
            if label and total:
                rows.append((label.group(1).split("|"), int(total.group(1))))
    print(f"instructions per step, training thread only, {steps} steps, tree {tree or 'this'}")
    for name in models:
        got = {c: n for (m, c, _), n in rows if m == name}
        calls = next((int(k) for (m, _, k), _n in rows if m == name), 1)
        base = got.get("unpatched")
        print(f"\n{name}: {calls} module calls/step")
        for c, n in got.items():
            if base:
                print(
                    f"  {c:22} | {n / steps / 1e6:9.3f} M/step | {n / base:6.4f}"
                    f" | {(n - base) / steps / calls / 1e3:7.1f} k/call"
                )
    return 0


def inside_callgrind(models: list[str], steps: int, chosen: dict) -> None:
    import ctypes

    cg = ctypes.CDLL(os.environ["GPU_TRACE_BENCH_CALLGRIND_LIB"])
    table = cases()
    for name in models:
        step, calls = table[name]()
        for cname, ctx in chosen.items():
            with ctx():
                for _ in range(3):
                    step()
                cg.cg_zero()
                cg.cg_toggle()
                for _ in range(steps):
                    step()
                cg.cg_toggle()
                cg.cg_dump(f"{name}|{cname}|{calls}".encode())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--round-s", type=float, default=0.3, help="steps per round, in seconds")
    ap.add_argument("--models", default="lm,cells", help="comma-separated: lm, cells")
    ap.add_argument("--parts", action="store_true", help="module level with parts switched off")
    ap.add_argument("--configs", default="", help="comma-separated subset (unpatched always)")
    ap.add_argument("--tree", help="import gpu_trace from this checkout (a worktree: before)")
    ap.add_argument("--instructions", action="store_true", help="count under callgrind")
    ap.add_argument("--steps", type=int, default=4, help="--instructions: steps counted")
    args = ap.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.instructions:
        keep = ["unpatched", *(c.strip() for c in args.configs.split(",") if c.strip())]
        return instructions(models, args.steps, keep, args.tree)
    steady_allocator()
    patch_overhead.run_round = run_round  # measure()'s rounds: process CPU per step, flusher in
    logging.basicConfig(level=logging.ERROR)
    import torch

    from gpu_trace.framework_patches.torch import ops_native

    print(
        f"PyTorch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
        f"native op observer {'built' if ops_native.available() else 'not built'}, "
        f"gpu_trace from {os.path.dirname(os.path.dirname(ops_native.__file__))}"
    )
    table = cases()
    chosen = configs(args.parts)
    if args.configs:
        keep = {"unpatched", *(c.strip() for c in args.configs.split(","))}
        chosen = {k: v for k, v in chosen.items() if k in keep}
    if os.environ.get("GPU_TRACE_BENCH_CALLGRIND_LIB"):
        inside_callgrind(models, args.steps, chosen)
        return 0
    for name in models:
        if name not in table:
            print(f"unknown model {name!r}", file=sys.stderr)
            return 2
        step, calls = table[name]()
        results, stops, steps = measure(step, chosen, args.rounds, args.round_s)
        print(
            "\n  stop ms (median): "
            + ", ".join(f"{k} {statistics.median(v) / 1e6:.1f}" for k, v in stops.items())
        )
        report(
            f"{name}: {calls} forward module calls/step, {args.rounds} rounds x {steps} steps; "
            f"median, ratio to unpatched in the round [p25-p75], µs per module call, % of step",
            results,
            calls,
        )
    print(f"\nload at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
