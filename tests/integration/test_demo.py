"""`gpu-trace demo`: the README's first command records, summarizes and exports a real run."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_demo_end_to_end(tmp_path: Path) -> None:
    trace = tmp_path / "demo.json.gz"
    samples = REPO / "sample_traces" / "runs"
    before = _tree(samples)
    out = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "demo", "-o", str(trace)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "0 dropped, stored in chdb://" in out.stderr
    # real GPU data: the H100 recording plays back where there is no NVML, and the H100 run loads
    assert "nvml-h100.jsonl" in out.stderr or "NVML sampling is off" not in out.stderr
    assert "sample run 20261124-174647-9ad8eb loaded" in out.stderr
    assert "sample run 20261124-174702-6a22f9 loaded" in out.stderr, "the packed op-level run"
    assert "?run=20261124-174647-9ad8eb: a real H100 training run" in out.stdout
    assert _tree(samples) == before, "loading the sample runs must leave them as they are"
    for lane in ("nvtx/gpu_trace", "nvtx/model", "nvtx/dataloader", "steps"):
        assert lane in out.stdout, lane
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"forward", "linear1", "load_batch", "evaluate", "ProfilerStep#19", "loss"} <= names
    pids = {e["pid"] for e in events if e.get("ph") == "X"}
    assert len(pids) >= 2, "the worker process is on the timeline too"
