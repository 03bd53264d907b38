"""HTA agrees with us on communication/computation overlap (issue 28 item 5): a two-rank run
with compute and NCCL kernels, exported one trace per rank (`export --ranks-dir`), read by
Holistic Trace Analysis' own `get_comm_comp_overlap`, gives each rank the share `show` gives
(`RankStats.kernel_overlap`, query/distributed.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from gpu_trace.store.client import Store
from tests.dashboard_data import add_run

hta = pytest.importorskip("hta.trace_analysis")

US = 1000


def kernel(pid: int, name: str, stream: int, t0: int, t1: int) -> dict:
    return {"name": name, "lane": f"gpu0/stream{stream}", "category": "kernel", "pid": pid,
            "tid": stream, "start_ns": t0 * US, "end_ns": t1 * US,
            "attrs": {"device": "0", "stream": str(stream), "correlation": str(t0)}}  # fmt: skip


def step(pid: int, i: int, t0: int, t1: int) -> dict:
    return {"name": f"ProfilerStep#{i}", "lane": "steps", "category": "step", "pid": pid,
            "tid": 1, "start_ns": t0 * US, "end_ns": t1 * US}  # fmt: skip


def test_hta_reads_the_same_overlap_as_show(tmp_path: Path) -> None:
    spans = [step(100, 0, 0, 1000), step(200, 0, 0, 1000)]
    # rank 0: compute [0, 400) and [500, 900), NCCL [300, 700): 300 of 400 µs beside computation
    spans += [kernel(100, "sgemm_128x64", 7, 0, 400), kernel(100, "sgemm_128x64", 7, 500, 900)]
    spans += [kernel(100, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 13, 300, 700)]
    # rank 1: NCCL [100, 300) and [350, 450), compute [250, 260) and [400, 500): 60 of 300 µs
    spans += [kernel(200, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 13, 100, 300)]
    spans += [kernel(200, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 13, 350, 450)]
    spans += [
        kernel(200, "elementwise_kernel", 7, 250, 260),
        kernel(200, "vectorized", 7, 400, 500),
    ]
    dsn = f"chdb://{tmp_path / 'store'}"
    with Store(dsn) as store:
        add_run(store, "overlap", spans, 0, 1000 * US)
        facts = {100: {"rank": "0", "world_size": "2", "backend": "nccl"},
                 200: {"rank": "1", "world_size": "2", "backend": "nccl"}}  # fmt: skip
        store.insert_rows(
            "threads",
            ["run_id", "host", "pid", "tid", "process_name", "thread_name", "updated_ns",
             "process_attrs"],
            [["overlap", "client", pid, 1, "python", "main", 1, facts[pid]] for pid in facts],
        )  # fmt: skip

    env = {**os.environ, "GPU_TRACE_STORE": dsn}

    def cli(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "gpu_trace", *args], capture_output=True,
                             text=True, env=env, timeout=240)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return out.stdout

    ours = {
        r["rank"]: r["kernel_overlap"]
        for r in json.loads(cli("show", "overlap", "--json"))["ranks"]["ranks"]
    }
    assert ours == {0: pytest.approx(300 / 400), 1: pytest.approx(60 / 300)}

    assert "NCCL OVERLAP" in cli("show", "overlap") and "75.0%" in cli("show", "overlap")

    traces = tmp_path / "traces"
    cli("export", "overlap", "--ranks-dir", str(traces))
    with warnings.catch_warnings():  # HTA's own pandas deprecations, not ours
        warnings.simplefilter("ignore")
        analysis = hta.TraceAnalysis(trace_dir=str(traces))
        theirs = analysis.get_comm_comp_overlap(visualize=False)
    got = dict(zip(theirs["rank"], theirs["comp_comm_overlap_pctg"]))
    # HTA reports a percentage rounded to two decimals
    assert {r: v / 100 for r, v in got.items()} == {
        0: pytest.approx(ours[0], abs=1e-4),
        1: pytest.approx(ours[1], abs=1e-4),
    }
