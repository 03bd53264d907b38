"""A run whose recorder died: `gpu-trace ingest` stores it as ``died`` with the reason, and `ls`
and `show` say so (a real `gpu-trace record` parent killed with SIGKILL, the real chDB store)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from gpu_trace.tracer.run import RunInfo, recorder_attrs, recorder_died


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=240,
    )


def _wait(predicate, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_run_whose_recorder_was_killed_is_stored_as_died(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    started = tmp_path / "started"
    release = tmp_path / "release"
    prog = tmp_path / "prog.py"
    prog.write_text(
        textwrap.dedent(
            f"""
            import os, pathlib, time
            import gpu_trace
            with gpu_trace.range("before-the-kill"):
                pass
            pathlib.Path({str(started)!r}).write_text(str(os.getpid()))
            while not pathlib.Path({str(release)!r}).exists():
                time.sleep(0.02)
            """
        )
    )
    parent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpu_trace",
            "record",
            "--run-dir",
            str(run_dir),
            "--",
            sys.executable,
            str(prog),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait(lambda: started.exists() and started.read_text(), "the program to start")
        child = int(started.read_text())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=60)
    finally:
        release.write_text("go")
    _wait(lambda: not Path(f"/proc/{child}").exists(), "the program to exit")
    assert RunInfo.load(run_dir).status == "running"  # nobody closed it

    out = cli("ingest", str(run_dir))
    assert out.returncode == 0, out.stderr
    reason = f"recorder exited before closing the run (pid {parent.pid})"
    assert reason in out.stderr
    shown = json.loads(cli("show", "last", "--json").stdout)
    assert shown["run"]["status"] == "died" and shown["run"]["attrs"]["reason"] == reason
    assert f"status: died: {reason}" in cli("show", "last").stdout
    (row,) = json.loads(cli("ls", "--json").stdout)
    assert row["status"] == "died"
    assert " died " in cli("ls").stdout.splitlines()[2]


def test_only_a_gone_recorder_makes_a_run_died() -> None:
    info = RunInfo("r", "t", 1, attrs=recorder_attrs())
    assert recorder_died(info) is None  # this process: alive
    info.attrs["recorder_start"] = "1"  # the pid now runs another program
    assert recorder_died(info) == f"recorder exited before closing the run (pid {os.getpid()})"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    info.attrs.update(recorder_pid=str(gone.pid), recorder_start="")
    assert "pid" in (recorder_died(info) or "")
    assert recorder_died(RunInfo("r", "t", 1, status="finished", attrs=info.attrs)) is None
    other = {**info.attrs, "recorder_host": socket.gethostname() + "-elsewhere"}
    assert recorder_died(RunInfo("r", "t", 1, attrs=other)) is None
    assert recorder_died(RunInfo("r", "t", 1)) is None  # an older run.json: unknown, left as is
