"""GPU activity on a real GPU (skipped elsewhere): the live injection library against
torch.profiler on the same program, correlation, nesting, clock, and coexistence.

The runs are read from their spool (``record --no-ingest``, then the spool converters ingest
runs first), not from a store: the GPU machines have no chDB (shared/gpu-box/README.md), and
ingest is tested without a GPU (tests/integration/test_gpu_activity_replay.py)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

from gpu_trace.store.ingest import convert_spool
from tests.conftest import recorded
from tests.gpu import children

#: One recorded run's limit: under the GPU check's deadline for this file (scripts/gpucheck/
#: parts.py), so that a run that hangs fails with its stacks (tests/gpu/children.py).
RECORD_TIMEOUT_S = 30

PROGRAM = textwrap.dedent(
    """
    import json, sys, time, torch, torch.nn as nn
    mode = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 512, device="cuda")
    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    out = {}
    if mode == "profiler":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and "Memcpy" not in e.name and "Memset" not in e.name]
        out = {"kernels": len(kernels)}
    else:
        t0 = time.perf_counter_ns()
        for _ in range(20):
            step()
        torch.cuda.synchronize()
        out = {"t0": t0, "t1": time.perf_counter_ns()}
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def _record(tmp_path: Path, mode: str) -> tuple[dict, list[dict]]:
    """The program recorded with GPU activity at op level: its RESULT line, and its run's spans
    (GPU activity converted to spans as ingest would, read from the spool)."""
    prog = tmp_path / "prog.py"
    prog.parent.mkdir(parents=True, exist_ok=True)
    prog.write_text(PROGRAM)
    run_dir = tmp_path / "run"
    env = {**os.environ, "GPU_TRACE_HOME": str(tmp_path / "home")}
    out = children.run(
        [sys.executable, "-m", "gpu_trace", "record", "--no-ingest", "--run-dir", str(run_dir),
         "--gpu-activity", "on", "--torch", "op", "--", sys.executable, str(prog), mode],
        env, RECORD_TIMEOUT_S,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert convert_spool(run_dir) == []
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:]), recorded(run_dir)


def _within(spans: list[dict], category: str, t0: int, t1: int) -> list[dict]:
    return [
        s for s in spans if s["category"] == category and s["start_ns"] >= t0 and s["end_ns"] <= t1
    ]


def test_kernels_match_torch_profiler_and_all_are_correlated(tmp_path: Path) -> None:
    plain, spans = _record(tmp_path / "a", "plain")
    kernels = _within(spans, "kernel", plain["t0"], plain["t1"])
    assert sum(k["parent_span_id"] == 0 for k in kernels) == 0  # every kernel under its launch
    # every launch inside the timed steps is nested in an op (op level records every ATen op)
    launches = [
        s
        for s in _within(spans, "cuda_api", plain["t0"], plain["t1"])
        if s["name"].startswith("cudaLaunchKernel")
    ]
    nested = sum(s["parent_span_id"] != 0 for s in launches)
    assert launches and nested / len(launches) > 0.95
    profiled, _ = _record(tmp_path / "b", "profiler")
    assert abs(len(kernels) - profiled["kernels"]) <= 0.01 * profiled["kernels"]


def test_device_times_lie_within_the_programs_own_clock_readings(tmp_path: Path) -> None:
    plain, spans = _record(tmp_path, "plain")
    kernels = [
        s for s in spans if s["category"] == "kernel" and s["start_ns"] >= plain["t0"] - 1_000_000
    ]
    first, last = min(k["start_ns"] for k in kernels), max(k["end_ns"] for k in kernels)
    assert plain["t0"] <= first and last <= plain["t1"]


def test_the_programs_own_profiler_keeps_working(tmp_path: Path) -> None:
    """torch.profiler (Kineto) started by the program under gpu-trace: its kernels are all there
    and the run completes."""
    profiled, spans = _record(tmp_path, "profiler")
    assert profiled["kernels"] > 0
    assert (tmp_path / "run" / "run.json").is_file() and spans
