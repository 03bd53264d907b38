"""`gpu-trace demo`: the README's first command records, summarizes and exports a real run, loads
the sample runs and imports the real H100 PyTorch profiler trace, whose GPU kernel view its
closing line points at."""

from __future__ import annotations

import gzip
import json
import os
import re
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

    # The H100 profiler trace is imported beside the H100 runs, and the last line opens it.
    last = out.stdout.rstrip().splitlines()[-1]
    found = re.match(
        r"GPU kernels: http://127\.0\.0\.1:8050/\?run=(\S+) \(after gpu-trace ui\)", last
    )
    assert found, last
    kernels = found.group(1)
    assert f"gpu-trace show {kernels}: its kernel table" in last
    assert f"sample trace imported: run {kernels}: " in out.stderr
    listed = _cli("ls")
    assert kernels in listed and "import kineto-h100-lm.json.gz" in listed
    shown = _cli("show", kernels)
    assert "gpu0/stream7" in shown and "26,520 kernels" in shown, "its kernels, per GPU"

    # In a process of its own: chDB holds one store per process, and this one's may be
    # another test's (the suite runs in one process).
    again = subprocess.run(
        [sys.executable, "-c", IMPORT_AGAIN],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == kernels, "imported once only"
    assert len(re.findall("import kineto-h100-lm", _cli("ls"))) == 1


IMPORT_AGAIN = (
    "from gpu_trace import config\n"
    "from gpu_trace.commands import ui\n"
    "print(ui._import_trace_samples(config.store_dsn()))\n"
)


def _cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gpu_trace", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout
