"""NCCL collectives recorded on a GPU (skipped without one): a one-rank job under torchrun on
NCCL, its all_reduce and broadcast calls as collective spans carrying what NCCL's
``record_param_comms`` gives (process group, sequence number, bytes, dtype), the path gloo on the
CPU never takes (tests/integration/test_multirank.py covers gloo).

Read from the spool (``record --no-ingest``): the GPU machines have no chDB."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_trace.tracer.ranks import COLLECTIVE_LANE
from gpu_trace.tracer.records import COLLECTIVE
from tests.conftest import recorded

PROGRAM = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    t = torch.ones(4, device="cuda")
    for _ in range(4):
        dist.all_reduce(t)
    dist.broadcast(t, 0)
    torch.cuda.synchronize()
    print("RESULT", t.sum().item(), flush=True)
    dist.destroy_process_group()
    """
)


def test_nccl_collectives_are_spans_with_their_group_and_sequence(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    prog = tmp_path / "nccl.py"
    prog.write_text(PROGRAM)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "gpu_trace", "record", "--no-ingest", "--run-dir", str(run_dir)]
    argv += ["--", sys.executable, "-m", "torch.distributed.run", "--standalone"]
    argv += ["--nproc-per-node", "1", str(prog)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "RESULT 4.0" in out.stdout, out.stdout
    spans = recorded(run_dir)
    calls = [s for s in spans if s["category"] == COLLECTIVE and s["lane"] == COLLECTIVE_LANE]
    names = sorted(s["name"] for s in calls)
    assert names == ["all_reduce"] * 4 + ["broadcast"], names
    attrs = [dict(s["attrs"] or []) for s in sorted(calls, key=lambda s: s["start_ns"])]
    for a in attrs:
        assert a.get("pg"), a  # NCCL names its process group
        assert a.get("bytes_in") == "16" and a.get("dtype", "").lower().startswith("float"), a
    seqs = [int(a["seq"]) for a in attrs]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
