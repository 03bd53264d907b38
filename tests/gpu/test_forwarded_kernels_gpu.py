"""A forwarded model on a CUDA server (skipped without a GPU): its kernels under its ops in the
client's run, as many as torch.profiler counts for the same steps run locally, and its tenant's
GPU busy time measured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from gpu_trace.tracer.store import Store

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

KERNELS = """
SELECT count(), countIf(o.lane = 'server/op' AND e.lane = 'server/execute')
FROM spans AS k
  LEFT JOIN (SELECT span_id, parent_span_id FROM spans) AS a ON k.parent_span_id = a.span_id
  LEFT JOIN (SELECT span_id, parent_span_id, lane FROM spans) AS o ON a.parent_span_id = o.span_id
  LEFT JOIN (SELECT span_id, lane FROM spans) AS e ON o.parent_span_id = e.span_id
WHERE k.category = 'kernel' AND k.lane LIKE 'gpu%/stream%'
"""


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
        dsn = f"chdb://{tmp_path / 'store'}"
        out = subprocess.run(
            [sys.executable, "-m", "gpu_trace", "record", "--store", dsn, "--remote", address,
             "--", sys.executable, str(prog), "plain"],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
    finally:
        server.send_signal(signal.SIGINT)
        closing = server.communicate(timeout=60)[1]
    assert "GPU activity spans sent (0 records dropped by CUPTI" in closing, closing
    with Store(dsn) as store:
        (total, under_ops), *_ = store.sql(KERNELS)[1]
        (busy,), *_ = store.sql("SELECT max(value) FROM counters WHERE metric = 'gpu_busy_ns'")[1]
    assert total > 0 and under_ops == total  # every kernel: op -> execute
    assert abs(total - profiled["kernels"]) <= max(1, 0.01 * profiled["kernels"])
    assert busy > 0
