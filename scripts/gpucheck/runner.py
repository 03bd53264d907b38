"""Children of the GPU check: each in a session (process group) of its own, its output to a log
file, a deadline, and its whole group ended when it ends or reaches the deadline (SIGTERM, then
SIGKILL after a grace period). Nothing is read through a pipe a grandchild could hold open.
Standard library only."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpucheck import report as gpu_report

ROOT = Path(__file__).resolve().parents[2]
#: Seconds between SIGTERM and SIGKILL for a child's process group.
GRACE_S = 5.0


@dataclass
class Step:
    """One child process: its command, its deadline, and where its stdout goes (the log, or
    ``stdout`` for a bench that prints its JSON there)."""

    name: str
    argv: list[str]
    limit_s: float
    stdout: Path | None = None


@dataclass
class StepResult:
    name: str
    argv: list[str]
    log: Path
    rc: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    not_run: str = ""
    strays: bool = False  # processes of its group outlived it (ended with it)

    def as_dict(self, work: Path) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "command": shlex.join(self.argv),
            "rc": self.rc,
            "seconds": round(self.seconds, 1),
            "timed_out": self.timed_out,
            "log": self.log.relative_to(work).as_posix(),
            "tail": gpu_report.tail(self.log),
        }
        if self.not_run:
            d["not_run"] = self.not_run
        if self.strays:
            d["strays"] = "processes of its group outlived it; ended with it"
        return d


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def end_group(proc: subprocess.Popen, grace_s: float = GRACE_S) -> bool:
    """End ``proc``'s process group (it leads one: ``start_new_session``): SIGTERM, then
    SIGKILL after ``grace_s``; reap ``proc``. True if anything of the group was still there."""
    pgid = proc.pid
    proc.poll()  # a finished leader reaped, so that only live members keep the group
    found = _group_alive(pgid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not _group_alive(pgid):
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 10.0)
        while time.monotonic() < deadline:
            proc.poll()
            if not _group_alive(pgid):
                break
            time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    return found


def run_step(step: Step, log: Path, deadline_s: float, grace_s: float = GRACE_S) -> StepResult:
    """Run ``step`` in a session of its own, output to ``log``, for at most ``deadline_s``."""
    res = StepResult(step.name, step.argv, log)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    with open(log, "wb") as out, contextlib.ExitStack() as stack:
        stdout = stack.enter_context(open(step.stdout, "wb")) if step.stdout else out
        try:
            proc = subprocess.Popen(
                step.argv,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=out,
                start_new_session=True,
            )
        except OSError as exc:
            out.write(f"could not start {step.argv[0]}: {exc}\n".encode())
            res.rc = 127
            return res
        try:
            res.rc = proc.wait(timeout=max(0.1, deadline_s))
        except subprocess.TimeoutExpired:
            res.timed_out = True
        finally:  # on a deadline, an exception (Stopped) or a normal end: nothing stays
            res.strays = end_group(proc, grace_s) and not res.timed_out
            res.seconds = time.monotonic() - t0
        if res.timed_out:
            msg = f"\n[gpu_check: no end within {deadline_s:.0f} s: process group killed]\n"
            out.write(msg.encode())
    return res
