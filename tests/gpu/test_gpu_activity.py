"""GPU activity on a real GPU (skipped elsewhere): the live injection library against
torch.profiler on the same program, correlation, nesting, clock, and coexistence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from gpu_trace.tracer.store import Store

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


def _record(tmp_path: Path, mode: str) -> tuple[dict, Store]:
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    dsn = f"chdb://{tmp_path / 'store'}"
    env = {**os.environ, "GPU_TRACE_HOME": str(tmp_path / "home")}
    out = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "record", "--store", dsn, "--gpu-activity", "on",
         "--torch", "op", "--", sys.executable, str(prog), mode],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:]), Store(dsn)


def test_kernels_match_torch_profiler_and_all_are_correlated(tmp_path: Path) -> None:
    plain, store = _record(tmp_path / "a", "plain")
    window = {"t0": plain["t0"], "t1": plain["t1"]}
    with store:
        _, rows = store.sql(
            "SELECT count(), countIf(parent_span_id = 0) FROM spans WHERE category = 'kernel'"
            " AND start_ns >= {t0:Int64} AND end_ns <= {t1:Int64}",
            window,
        )
        kernels, unlinked = rows[0]
        assert unlinked == 0
        # every launch inside the timed steps is nested in an op (op level records every ATen op)
        _, rows = store.sql(
            "SELECT count(), countIf(parent_span_id != 0) FROM spans WHERE category = 'cuda_api'"
            " AND name LIKE 'cudaLaunchKernel%' AND start_ns >= {t0:Int64} AND end_ns <= {t1:Int64}",
            window,
        )
        launches, nested = rows[0]
        assert launches > 0 and nested / launches > 0.95
    profiled, _ = _record(tmp_path / "b", "profiler")
    assert abs(kernels - profiled["kernels"]) <= 0.01 * profiled["kernels"]


def test_device_times_lie_within_the_programs_own_clock_readings(tmp_path: Path) -> None:
    plain, store = _record(tmp_path, "plain")
    with store:
        _, rows = store.sql(
            "SELECT min(start_ns), max(end_ns) FROM spans WHERE category = 'kernel'"
            " AND start_ns >= {t0:Int64} - 1000000",
            {"t0": plain["t0"]},
        )
    first, last = rows[0]
    assert plain["t0"] <= first and last <= plain["t1"]


def test_the_programs_own_profiler_keeps_working(tmp_path: Path) -> None:
    """torch.profiler (Kineto) started by the program under gpu-trace: its kernels are all there
    and the run completes."""
    profiled, store = _record(tmp_path, "profiler")
    assert profiled["kernels"] > 0
    with store:
        _, rows = store.sql("SELECT count() FROM runs")
    assert rows == [(1,)]
