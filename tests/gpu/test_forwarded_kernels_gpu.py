"""A forwarded model on a CUDA server (skipped without a GPU): its kernels under its ops in the
client's run, as many as torch.profiler counts for the same steps run locally, and its tenant's
GPU busy time measured.

The client's run is read from its spool (``record --no-ingest``; the server's spans, counters and
GPU activity are written there by the client as they come back), not from a store: the GPU
machines have no chDB (shared/gpu-box/README.md)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from gpu_trace.store.ingest import convert_spool
from tests.conftest import recorded

TOKEN = "gpu-remote-activity-token-01"

PROGRAM = textwrap.dedent(
    """
    import json, sys, torch, torch.nn as nn
    mode = sys.argv[1]
    def program():  # all of it, so both sides count the same work (set-up's fill kernels too)
        device = torch.device("cuda")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=False)
        x = torch.ones(32, 256, device=device)
        for _ in range(10):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
        return loss.item()
    out = {}
    if mode == "profiler":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            program()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"
                   and "Memcpy" not in e.name and "Memset" not in e.name]
        out = {"kernels": len(kernels)}
    else:
        out = {"loss": program()}
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def kernels_under_ops(spans: list[dict]) -> tuple[int, int]:
    """The server's kernels (lanes ``gpu<d>/stream<s>``), and how many of them are under an op
    (``server/op``, through their launch) under an execute (``server/execute``)."""
    by_id = {s["span_id"]: s for s in spans}

    def up(span: dict | None) -> dict | None:
        return None if span is None else by_id.get(span["parent_span_id"])

    kernels = [
        s for s in spans if s["category"] == "kernel" and re.match(r"gpu\d+/stream", s["lane"])
    ]
    under = 0
    for k in kernels:
        op = up(up(k))  # kernel -> its launch (a CUDA call) -> the op
        execute = up(op)
        if op and op["lane"] == "server/op" and execute and execute["lane"] == "server/execute":
            under += 1
    return len(kernels), under


def test_forwarded_kernels_under_their_ops_match_a_local_profile(tmp_path: Path) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    env = {**os.environ, "GPU_TRACE_HOME": str(tmp_path / "home"), "GPU_TRACE_REMOTE_TOKEN": TOKEN}
    local = subprocess.run(
        [sys.executable, str(prog), "profiler"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert local.returncode == 0, local.stderr
    profiled = json.loads(next(x for x in local.stdout.splitlines() if x.startswith("RESULT "))[7:])

    server = subprocess.Popen(
        [sys.executable, "-m", "gpu_trace", "serve", "--listen", "127.0.0.1:0", "--device", "cuda:0",
         "--gpu-activity", "on", "--metrics", "off"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert server.stderr is not None
    try:
        serving = server.stderr.readline()
        assert "GPU activity on" in serving, serving + server.stderr.readline()
        address = serving.split(" on ")[1].split()[0]
        run_dir = tmp_path / "run"
        out = subprocess.run(
            [sys.executable, "-m", "gpu_trace", "record", "--no-ingest", "--run-dir", str(run_dir),
             "--remote", address, "--", sys.executable, str(prog), "plain"],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
    finally:
        server.send_signal(signal.SIGINT)
        closing = server.communicate(timeout=60)[1]
    assert "GPU activity spans sent (0 records dropped by CUPTI" in closing, closing
    assert convert_spool(run_dir) == []
    total, under_ops = kernels_under_ops(recorded(run_dir))
    busy = max(c["value"] for c in recorded(run_dir, "counters") if c["metric"] == "gpu_busy_ns")
    assert total > 0 and under_ops == total  # every kernel: op -> execute
    assert abs(total - profiled["kernels"]) <= max(1, 0.01 * profiled["kernels"])
    assert busy > 0
