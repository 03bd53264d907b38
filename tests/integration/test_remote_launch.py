"""`gpu-trace record --remote` never runs a program locally by itself: a server it cannot reach is
one line and exit status 69 before the program starts; ``--fallback-local`` runs it locally,
says so loudly and records the run as local; a session refused later is an error in the
program, not a quiet local run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import serving

TOKEN = "launch-test-token-0123"

PROGRAM = """
import torch
device = "cuda" if torch.cuda.is_available() else "cpu"
x = torch.ones(3, device=device)
print("RAN on", x.device, float(x.sum()))
"""


def record(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", "record", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "GPU_TRACE_NVML_HZ": "0", **(env or {})},
    )


def gpu_trace(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpu_trace", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def program(tmp_path: Path) -> Path:
    prog = tmp_path / "train.py"
    prog.write_text(PROGRAM)
    return prog


def test_an_unreachable_server_is_one_line_and_a_non_zero_exit(
    closed_port: int, program: Path
) -> None:
    """Before: the program ran on the CPU, exited 0 after one error line, and ``ls`` listed the
    run as remote."""
    address = f"127.0.0.1:{closed_port}"
    out = record("--remote", address, "--", sys.executable, str(program))
    assert out.returncode == 69, out.stderr
    assert "RAN" not in out.stdout
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"gpu-trace: cannot reach the forwarding server at {address}: ")
    assert "--fallback-local" in lines[0]
    listed = gpu_trace("ls", "--json")
    assert listed.returncode == 0 and listed.stdout.strip() in ("", "[]"), listed.stdout


def test_fallback_local_runs_the_program_locally_and_says_so(
    closed_port: int, program: Path
) -> None:
    address = f"127.0.0.1:{closed_port}"
    out = record("--remote", address, "--fallback-local", "--", sys.executable, str(program))
    assert out.returncode == 0, out.stderr
    assert "RAN on cpu 3.0" in out.stdout
    warning = next(line for line in out.stderr.splitlines() if "WARNING" in line)
    assert f"cannot reach the forwarding server at {address}" in warning
    assert "LOCALLY" in warning and "recorded as local" in warning
    listed = gpu_trace("ls")
    assert listed.returncode == 0 and "remote=" not in listed.stdout, listed.stdout
    shown = json.loads(gpu_trace("show", "last", "--json").stdout)
    attrs = shown["run"]["attrs"]
    assert "remote" not in attrs and attrs["remote_fallback"].startswith(address)
    text = gpu_trace("show", "last").stdout
    assert f"remote=off (ran locally: cannot reach the server at {address}" in text


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving.served(tmp_path_factory.mktemp("home"), TOKEN, device="cpu") as (address, _):
        yield address


def test_a_session_refused_after_the_check_fails_the_program(served: str, program: Path) -> None:
    """The server is there, but refuses the session (a wrong token): the program's first use of
    the device raises, and the program fails. Before, it ran on the CPU and exited 0."""
    out = record(
        "--no-ingest",
        "--remote",
        served,
        "--",
        sys.executable,
        str(program),
        env={"GPU_TRACE_REMOTE_TOKEN": "not-the-token-0123456"},
    )
    assert out.returncode != 0
    assert "RAN" not in out.stdout
    assert "refused the session: authentication failed" in out.stderr
