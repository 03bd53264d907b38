"""`gpu-trace ui`: serves the dashboard on 127.0.0.1, read-only, and stops on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("dash")


def test_ui_serves_on_loopback_and_stops_on_sigint(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpu_trace", "ui", "--store", f"chdb://{tmp_path / 's'}",
         "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "dashboard on http://127.0.0.1:" in line, line
        url = line.split("dashboard on ")[1].split()[0]
        page = urllib.request.urlopen(url, timeout=30).read().decode()
        assert "<title>gpu-trace</title>" in page
        layout = urllib.request.urlopen(url.rstrip("/") + "/_dash-layout", timeout=30).read()
        assert b"panel-timeline" in layout
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        proc.stderr.close()
    assert proc.returncode == 0


def test_ui_on_a_busy_port_is_a_usage_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "gpu_trace", "ui", "--store", f"chdb://{tmp_path / 's'}",
             "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert out.returncode == 2 and "cannot listen on 127.0.0.1" in out.stderr
