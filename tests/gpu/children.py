"""Child processes of the GPU tests that say where they hung: each runs in a session of its own
with Python's faulthandler on (``PYTHONFAULTHANDLER``), and one still running at its timeout gets
SIGABRT (each Python process of its group then prints every thread's stack) before SIGKILL, so
the test fails with those stacks rather than with nothing (the GPU check kills a whole file at its
deadline: 2026-11-28's H200 run brought back ``FF`` from test_gpu_activity and no more)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Sequence

#: Seconds a child has after SIGABRT to print its stacks before SIGKILL.
DUMP_S = 5.0


def run(argv: Sequence[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``argv`` to its end, output captured, for at most ``timeout`` seconds; past that,
    fail with the stacks of every Python process of its group and the output so far."""
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONFAULTHANDLER": "1"},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=DUMP_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        _signal_group(proc.pid, signal.SIGKILL)  # whatever of its group outlived it
        raise AssertionError(
            f"{argv[:6]} still ran after {timeout:.0f} s; its stacks and output:\n"
            f"--- stderr (last 12000 characters) ---\n{(err or '')[-12000:]}\n"
            f"--- stdout (last 4000) ---\n{(out or '')[-4000:]}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
