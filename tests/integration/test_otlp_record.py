"""`gpu-trace record --otlp URL`: spans reach a real OTLP/HTTP endpoint while the program runs,
and a dead collector costs the program nothing (its output and exit status stand, the drops are
reported)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.otlp_receiver import otlp_receiver

#: Records two steps, then waits (a minute at most) for a file the
#: test writes once the endpoint has seen a span: spans arrive while the program still runs (the
#: steps some 13 s after they end: streaming.SETTLE_NS and HOLD_NS, the wait for a span that
#: could enclose them).
WAITS = """
import os, sys, time
import gpu_trace

for step in range(2):
    gpu_trace.step(step)
    with gpu_trace.range("work", step=step):
        pass
gpu_trace.step(2)
flag = sys.argv[1]
for _ in range(1200):
    if os.path.exists(flag):
        break
    time.sleep(0.05)
print("flag seen" if os.path.exists(flag) else "no flag")
sys.exit(3)
"""


#: The request that started the run (a CI job, a service handler running `gpu-trace record`).
INCOMING_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
INCOMING_SPAN = "00f067aa0ba902b7"


def record(tmp_path: Path, url: str, *extra: str) -> subprocess.Popen[str]:
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(WAITS))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpu_trace",
            "record",
            "--no-nvml",
            "--host-hz",
            "0",
            "--otlp",
            url,
            *extra,
            "--",
            sys.executable,
            str(prog),
            str(tmp_path / "flag"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TRACEPARENT": f"00-{INCOMING_TRACE}-{INCOMING_SPAN}-01"},
    )


def test_spans_arrive_while_the_program_runs(tmp_path: Path) -> None:
    with otlp_receiver() as receiver:
        proc = record(tmp_path, receiver.url)
        try:
            assert receiver.seen.wait(120), "no span arrived while the program ran"
            assert proc.poll() is None  # the program is still waiting for the flag
            early = {s.name for s in receiver.spans()}
        finally:
            (tmp_path / "flag").write_text("")
            out, err = proc.communicate(timeout=120)
        spans = receiver.spans()
    assert proc.returncode == 3, err
    assert "flag seen" in out
    assert early & {"ProfilerStep#0", "work"}
    names = sorted(s.name for s in spans)
    # The run joins the incoming trace, its root span under the span that started it.
    assert {s.trace_id for s in spans} == {INCOMING_TRACE}
    root = [s for s in spans if s.parent_span_id == INCOMING_SPAN]
    assert (
        len(root) == 1
        and root[0].name.startswith("python")
        and root[0].attrs["gpu_trace.exit_code"] == "3"
    )
    assert names.count("work") == 2 and names.count("ProfilerStep#0") == 1
    # Each range under its step (streamed: the range waited for the step that encloses it), the
    # steps under the run's root.
    by_id = {s.span_id: s for s in spans}
    assert all(s.parent_span_id == root[0].span_id for s in spans if s.name.startswith("Prof"))
    work = sorted(
        (s.attrs["step"], by_id[s.parent_span_id].name) for s in spans if s.name == "work"
    )
    assert work == [("0", "ProfilerStep#0"), ("1", "ProfilerStep#1")]
    assert f"OTLP {receiver.url}/v1/traces: {len(spans)} spans sent, 0 dropped" in err


def test_a_dead_collector_costs_the_program_nothing(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "flag").write_text("")
    proc = record(tmp_path, f"http://127.0.0.1:{port}")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3 and "flag seen" in out, err
    closing = [line for line in err.splitlines() if "spans sent" in line]
    assert len(closing) == 1, err
    assert ": 0 spans sent, " in closing[0] and "connection refused" in closing[0]
    dropped = int(closing[0].split(" spans sent, ")[1].split(" dropped")[0].replace(",", ""))
    assert dropped >= 6  # 3 steps, 2 ranges, the run's root
    assert "stored in" in err  # the run itself is recorded as always


@pytest.fixture(autouse=True)
def _no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OTEL_EXPORTER_OTLP"):
            monkeypatch.delenv(name)
