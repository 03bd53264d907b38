"""Children of the GPU check: each in a session (process group) of its own, its output to a log
file, a deadline, and its whole group ended when it ends or reaches the deadline (SIGTERM, then
SIGKILL after a grace period). Nothing is read through a pipe a grandchild could hold open.
A part's steps run one at a time, or a few at once (:func:`run_steps`). Standard library only."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from gpucheck import report as gpu_report

ROOT = Path(__file__).resolve().parents[2]
#: Seconds between SIGTERM and SIGKILL for a child's process group.
GRACE_S = 5.0
#: Seconds kept back from a step's deadline when it is told its time (``Step.budget_flag``):
#: for its own closing output, and the SIGTERM grace.
BUDGET_MARGIN_S = 10.0
#: How often running children are looked at.
POLL_S = 0.05


@dataclass
class Step:
    """One child process: its command, its deadline, and where its stdout goes (the log, or
    ``stdout`` for a bench that prints its JSON there). ``expect_s``: its expected seconds (of
    steps run a few at once, the longest expected start first, so that they end soonest).
    ``budget_flag``: the option by which it is told the seconds it has (its deadline less
    :data:`BUDGET_MARGIN_S`), added to its command when it starts."""

    name: str
    argv: list[str]
    limit_s: float
    stdout: Path | None = None
    expect_s: float = 0.0
    budget_flag: str = ""


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


def end_groups(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> list[bool]:
    """End each of ``procs``' process groups (each leads one: ``start_new_session``), all
    together: SIGTERM, then SIGKILL after ``grace_s``; reap them. For each, True if anything of
    its group was still there."""
    for proc in procs:
        proc.poll()  # a finished leader reaped, so that only live members keep the group
    found = [_group_alive(proc.pid) for proc in procs]
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        alive = [proc for proc in procs if _group_alive(proc.pid)]
        if not alive:
            break
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for proc in alive:
                proc.poll()
            if not any(_group_alive(proc.pid) for proc in alive):
                break
            time.sleep(POLL_S)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
    return found


@dataclass
class _Child:
    """A started step: its process, its open files, when it started and must end."""

    res: StepResult
    proc: subprocess.Popen
    log: IO[bytes]
    files: contextlib.ExitStack
    t0: float
    deadline_s: float
    timed_out: bool = field(default=False)

    def due(self, now: float) -> bool:
        if self.proc.poll() is not None:
            return True
        self.timed_out = now - self.t0 >= self.deadline_s
        return self.timed_out


def _start(step: Step, log: Path, deadline_s: float) -> _Child | StepResult:
    """Start ``step`` in a session of its own, output to ``log`` (a result if it cannot)."""
    argv = list(step.argv)
    if step.budget_flag:
        argv += [step.budget_flag, f"{max(1.0, deadline_s - BUDGET_MARGIN_S):.0f}"]
    res = StepResult(step.name, argv, log)
    files = contextlib.ExitStack()  # open while the child runs: :func:`_finish` closes them
    out = files.enter_context(open(log, "wb"))  # noqa: SIM115
    stdout = files.enter_context(open(step.stdout, "wb")) if step.stdout else out  # noqa: SIM115
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=out,
            start_new_session=True,
        )
    except OSError as exc:
        out.write(f"could not start {argv[0]}: {exc}\n".encode())
        files.close()
        res.rc = 127
        return res
    return _Child(res, proc, out, files, t0, deadline_s)


def _finish(children: list[_Child], grace_s: float) -> None:
    """End the children's groups together and complete their results."""
    for child in children:
        child.res.rc = None if child.timed_out else child.proc.poll()
    found = end_groups([c.proc for c in children], grace_s)
    for child, strays in zip(children, found):
        res = child.res
        res.timed_out = child.timed_out
        res.strays = strays and not child.timed_out
        res.seconds = time.monotonic() - child.t0
        if child.timed_out:
            msg = f"\n[gpu_check: no end within {child.deadline_s:.0f} s: process group killed]\n"
            child.log.write(msg.encode())
        child.files.close()


def run_steps(
    jobs: list[tuple[Step, Path]],
    deadline_s: float,
    workers: int = 1,
    grace_s: float = GRACE_S,
) -> list[StepResult]:
    """Run each ``(step, log)``, at most ``workers`` at once, the longest expected first; each
    in a session of its own, output to its log, for at most its ``limit_s`` and never past
    ``deadline_s`` from now. A step that would start with less than a second left is not run.
    The results are in the jobs' order. Whatever ends this early (a stop: ``Stopped``), the
    running children's groups are ended first."""
    end = time.monotonic() + deadline_s
    results: list[StepResult | None] = [None] * len(jobs)
    queue = sorted(range(len(jobs)), key=lambda i: -jobs[i][0].expect_s)
    running: dict[int, _Child] = {}
    try:
        while queue or running:
            while queue and len(running) < max(1, workers):
                i = queue.pop(0)
                step, log = jobs[i]
                left = end - time.monotonic()
                if left < 1:
                    why = "the part's time ran out"
                    results[i] = StepResult(step.name, step.argv, log, not_run=why)
                    log.write_text(f"[gpu_check: not run: {why}]\n")
                    continue
                child = _start(step, log, min(step.limit_s, left))
                if isinstance(child, StepResult):
                    results[i] = child
                else:
                    running[i] = child
            now = time.monotonic()
            due = {i: c for i, c in running.items() if c.due(now)}
            if due:
                _finish(list(due.values()), grace_s)
                for i, child in due.items():
                    results[i] = child.res
                    del running[i]
            elif running:
                time.sleep(POLL_S)
    finally:  # a stop: nothing stays
        if running:
            _finish(list(running.values()), grace_s)
    return [r for r in results if r is not None]


def run_step(step: Step, log: Path, deadline_s: float, grace_s: float = GRACE_S) -> StepResult:
    """Run ``step`` alone, output to ``log``, for at most ``deadline_s`` (or its limit)."""
    return run_steps([(step, log)], max(1.0, deadline_s), 1, grace_s)[0]
