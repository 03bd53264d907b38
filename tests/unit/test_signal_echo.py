"""The pipe on which a Python program tells `gpu-trace record` which signals it got
(gpu_trace/signal_echo.py): taken up only by the process record started, only if it is the pipe
record made; record's side reads what is said, and only what is recent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from gpu_trace.signal_echo import ENV, Echo

# Prints whether the program's start-up took the pipe, then raises SIGUSR1 at itself (a Python
# handler: Python's C handler writes its number to the wakeup fd).
PROGRAM = textwrap.dedent(
    """
    import signal, sys
    from gpu_trace.signal_echo import echo_from_env
    took = echo_from_env()
    signal.signal(signal.SIGUSR1, lambda *_: None)
    print(took, signal.set_wakeup_fd(-1), flush=True)
    """
)


def _run(env: dict[str, str], echo: Echo | None) -> str:
    fds = (echo.write_fd,) if echo is not None else ()
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env={**os.environ, **env}, pass_fds=fds,
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def test_the_program_record_started_takes_the_pipe() -> None:
    echo = Echo()
    try:
        took, fd = _run(echo.env, echo).split()
        assert took == "True" and int(fd) == echo.write_fd
    finally:
        echo.close()


@pytest.mark.parametrize("wrong", ["parent", "inode", "garbage"])
def test_anything_else_is_left_alone(wrong: str) -> None:
    echo = Echo()
    try:
        fd, parent, ino = echo.env[ENV].split(":")
        spec = {
            "parent": f"{fd}:{int(parent) + 1}:{ino}",  # a grandchild: the number may be any file
            "inode": f"{fd}:{parent}:{int(ino) + 1}",
            "garbage": "x:y",
        }[wrong]
        assert _run({ENV: spec}, echo) == "False -1"
    finally:
        echo.close()


def test_an_echo_answers_one_recent_signal() -> None:
    echo = Echo()
    try:
        os.write(echo.write_fd, bytes([signal.SIGINT]))
        assert echo.program_got(signal.SIGINT, grace_s=0)
        assert not echo.program_got(signal.SIGINT, grace_s=0)  # used up
        assert not echo.program_got(signal.SIGTERM, grace_s=0)
        os.write(echo.write_fd, bytes([signal.SIGTERM]))
        echo.read()
        assert not echo.program_got(signal.SIGTERM, grace_s=-1)  # said too long before
    finally:
        echo.close()


def test_record_waits_for_the_echo() -> None:
    """What the program says within the grace counts (a program scheduled a little later)."""
    echo = Echo()
    try:
        late = "import os, sys, time; time.sleep(0.05); os.write(int(sys.argv[1]), bytes([2]))"
        child = subprocess.Popen(
            [sys.executable, "-c", late, str(echo.write_fd)], pass_fds=(echo.write_fd,)
        )
        assert echo.program_got(signal.SIGINT, grace_s=30)
        child.wait(60)
    finally:
        echo.close()
