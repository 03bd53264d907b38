"""`gpu-trace record --remote` end to end: an unmodified CUDA script, a real server, the real store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

TOKEN = "record-test-token-0123"

PROGRAM = """
import torch

assert torch.cuda.is_available() and torch.cuda.device_count() == 1
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
model = model.cuda() if {use_cuda} else model
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 8).to(device if {use_cuda} else "cpu")
y = torch.zeros(32, 1, device=device if {use_cuda} else "cpu")
for step in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
torch.cuda.synchronize() if {use_cuda} else None
print("LOSS", repr(loss.item()))
if {use_cuda}:
    print("CUDA", x.is_cuda, torch.cuda.memory_allocated() > 0, x.device.type)
"""


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "GPU_TRACE_REMOTE_TOKEN": TOKEN, **(env or {})},
        timeout=240,
    )


@pytest.fixture
def server() -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpu_trace", "serve", "--listen", "127.0.0.1:0", "--device", "cpu"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GPU_TRACE_REMOTE_TOKEN": TOKEN},
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert "serving cpu on" in line, line
    yield line.split(" on ")[1].split()[0]
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=20)
    proc.stderr.close()


def sql(query: str, **params: str) -> list[dict]:
    args = ["sql", "--json", query]
    for k, v in params.items():
        args += ["-p", f"{k}={v}"]
    out = run(*args)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_record_remote_runs_cuda_script_on_server_and_traces_it(
    tmp_path: Path, server: str
) -> None:
    local = tmp_path / "local.py"
    local.write_text(
        textwrap.dedent(PROGRAM.format(use_cuda=False)).replace(
            "assert torch.cuda.is_available() and torch.cuda.device_count() == 1", ""
        )
    )
    expected = subprocess.run([sys.executable, str(local)], capture_output=True, text=True)
    assert expected.returncode == 0, expected.stderr

    prog = tmp_path / "train.py"
    prog.write_text(textwrap.dedent(PROGRAM.format(use_cuda=True)))
    out = run("record", "--remote", server, "--", sys.executable, str(prog))
    assert out.returncode == 0, out.stderr
    assert "LOSS" in out.stdout and "CUDA True True remote" in out.stdout
    loss_line = next(line for line in out.stdout.splitlines() if line.startswith("LOSS"))
    assert loss_line in expected.stdout  # bitwise the same loss as on the CPU

    show = run("show", "last", "--json")
    assert show.returncode == 0, show.stderr
    data = json.loads(show.stdout)
    run_id = data["run"]["run_id"]
    fwd = data["forwarding"]
    names = {op["name"] for op in fwd["ops"]}
    assert "aten::addmm.default" in names or "aten::mm.default" in names
    assert fwd["batches"] > 0 and fwd["totals"]["execute_ns"] > 0
    assert fwd["totals"]["wire_ns"] > 0 and fwd["wait_ns"] > 0

    # Server spans are children of the client's batch spans (W3C trace context in the header).
    linked = sql(
        """
        SELECT s.lane AS lane, count() AS n, any(s.host) AS host, any(s.pid) AS pid,
               any(c.pid) AS client_pid
        FROM gpu_trace.spans AS s INNER JOIN gpu_trace.spans AS c
          ON s.parent_span_id = c.span_id AND c.lane = 'forward/batch' AND c.run_id = s.run_id
        WHERE s.run_id = {run:String} AND s.category = 'server' GROUP BY lane ORDER BY lane
        """,
        run=run_id,
    )
    lanes = {r["lane"] for r in linked}
    assert {"server/receive", "server/queue", "server/execute", "server/reply"} <= lanes
    assert all(r["pid"] != r["client_pid"] for r in linked)

    # Server times are mapped onto the client's clock; the raw ones are kept.
    mapped = sql(
        """
        SELECT count() AS n, countIf(attrs['raw_start_ns'] != '') AS raw,
               countIf(attrs['clock_offset_ns'] != '') AS offset
        FROM gpu_trace.spans WHERE run_id = {run:String} AND category = 'server'
        """,
        run=run_id,
    )[0]
    assert mapped["n"] > 0 and mapped["raw"] == mapped["n"] == mapped["offset"]
    clock = sql(
        "SELECT count() AS n, min(rtt_ns) AS rtt FROM gpu_trace.clock_sync "
        "WHERE run_id = {run:String}",
        run=run_id,
    )[0]
    assert clock["n"] >= 8 and clock["rtt"] > 0

    text = run("show", run_id)
    assert text.returncode == 0
    assert "forwarded:" in text.stdout and "EXECUTE" in text.stdout and "WIRE" in text.stdout


def test_record_remote_with_a_bad_address_is_a_usage_error(tmp_path: Path) -> None:
    prog = tmp_path / "p.py"
    prog.write_text("print(1)\n")
    out = run("record", "--no-ingest", "--remote", "nohost", "--", sys.executable, str(prog))
    assert out.returncode == 2 and "HOST:PORT" in out.stderr
