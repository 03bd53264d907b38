#!/usr/bin/env python3
"""One command that proves gpu-trace's GPU parts on a lent GPU machine, and a report of what it
showed (issue 24; docs/gpu-check.md).

    . .device/install.sh && timeout -k 10 540 python scripts/gpu_check.py --out $OUT/gpu-check
    python scripts/gpu_check.py --cpu-dry-run --out /tmp/gpu-check   # every part's CPU variant

Parts, in the order they run, each a child process (or a few) with a deadline: the machine
(versions, what is there, the C parts built), ``pytest tests/gpu`` one process per file, a few
files at once, the two-tenant check on CUDA where its test exists, then the figures: GPU
activity's capture cost and kernel count (bench/gpu_activity.py), NVML's default families,
module and op level on the launch-bound LM step (bench/gpu_overhead.py), the NVML sampler's CPU
(bench/collectors.py), paging (bench/paging.py, bench/sharing.py --part restore) and, last for
its time, a forwarded training step (bench/forward_gpu.py). A part whose expected time exceeds
what is left of ``--budget`` is skipped with one line saying so; the others run under
``min(their limit, what is left)``.

It never hangs: every child starts a session of its own (its own process group), writes to a
log file (no pipe a grandchild could hold open), and at its deadline, or when it ends, its whole
group gets SIGTERM and, 5 s later, SIGKILL. The report (``report.md`` and ``report.json`` from
one dict, and ``logs.tar.gz``: every log and bench output, each cut to its last 512 KiB) is
rewritten in ``--out`` after every part, so a run cut short still brings back what it did; on
SIGTERM the running part's group is ended and the report written before exiting.

Without a GPU it says so in one line and writes a report that says so (exit status 0).
``--cpu-dry-run`` runs each part's CPU variant with a small budget instead (the benches'
``--quick``/CPU variants, tests/gpu skipping), so that the check cannot rot where no GPU is:
tests/unit/test_gpu_check.py runs it. Standard library only at module level: torch is imported
by the children, whatever version the machine has.
"""

from __future__ import annotations

import argparse
import datetime
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpucheck import report as gpu_report
from gpucheck.parts import Outcome, Part, Run, default_parts
from gpucheck.runner import GRACE_S, ROOT, run_steps

GPU_BUDGET_S = 480.0
DRY_BUDGET_S = 240.0


class Stopped(Exception):
    """The check itself was told to stop (SIGTERM, SIGINT)."""


def git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here: pass --commit)"
    return head + ("+dirty" if dirty.strip() else "")


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def new_report(parts: list[Part], mode: str, budget_s: float, commit: str) -> dict[str, Any]:
    return {
        "schema": gpu_report.SCHEMA,
        "title": "CPU dry run" if mode == "cpu-dry-run" else "starting",
        "verdict": "running",
        "mode": mode,
        "commit": commit,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join(["python", *sys.argv]) if sys.argv[0] else "",
        "budget_s": budget_s,
        "elapsed_s": 0.0,
        "finished": False,
        "machine": {},
        "parts": [
            {
                "name": p.name,
                "title": p.title,
                "status": "pending",
                "expect_s": p.expect_s,
                "limit_s": p.limit_s,
                "summary": "",
                "figures": [],
                "steps": [],
            }
            for p in parts
        ],
    }


def run_part(part: Part, run: Run, deadline_s: float, grace_s: float) -> Outcome:
    """Run ``part``'s steps within ``deadline_s`` (``part.workers(run)`` at once) and collect
    its outcome (the steps' results are in ``Outcome.details['_steps']``)."""
    jobs = [(step, run.work / "logs" / f"{part.name}-{step.name}.log") for step in part.steps(run)]
    results = run_steps(jobs, deadline_s, part.workers(run), grace_s)
    try:
        outcome = part.collect(run, results)
    except Exception as exc:  # a reader's bug must not lose the other parts
        outcome = Outcome("failed", f"reading its results failed: {type(exc).__name__}: {exc}")
    outcome.details["_steps"] = results
    return outcome


def verdict(report: dict[str, Any]) -> str:
    parts = report["parts"]
    counts: dict[str, int] = {}
    for p in parts:
        counts[p["status"]] = counts.get(p["status"], 0) + 1
    figures = [f for p in parts for f in p["figures"] if f["target"] not in ("-", "peer")]
    line = "Parts: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + "."
    if report["mode"] == "cpu-dry-run":
        return "CPU dry run: each part's CPU variant, not GPU figures. " + line
    met = sum(f["verdict"] == "pass" for f in figures)
    miss = sum(f["verdict"] == "miss" for f in figures)
    line += f" Targets: {met} met, {miss} missed, {len(figures) - met - miss} not measured"
    single = sum(f["verdict"] in ("pass", "miss") and f.get("rounds") == 1 for f in figures)
    if single:
        line += f" ({single} of them on one round only: not settled)"
    return line + "."


def check(
    parts: list[Part],
    run: Run,
    out: Path,
    budget_s: float,
    report: dict[str, Any],
    only: set[str] | None = None,
    grace_s: float = GRACE_S,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run ``parts`` in order within ``budget_s``, rewriting the report after each."""
    t0 = time.monotonic()
    (run.work / "logs").mkdir(parents=True, exist_ok=True)
    (run.work / "data").mkdir(parents=True, exist_ok=True)

    def save() -> None:
        report["elapsed_s"] = round(time.monotonic() - t0, 1)
        report["machine"] = run.machine
        gpu_report.write(report, out, run.work)

    save()
    halted = ""
    current = None
    try:
        for part, entry in zip(parts, report["parts"]):
            current = entry
            left = budget_s - (time.monotonic() - t0)
            absent = part.absent(run)
            if halted:
                entry.update(status="not run", summary=halted)
            elif only is not None and part.name not in only and part.name != "machine":
                entry.update(status="not run", summary="not chosen (--only)")
            elif absent:
                entry.update(status="not present", summary=absent)
            elif part.expect_s > left:
                entry.update(
                    status="skipped",
                    summary=f"skipped: expected to take"
                    f" {part.expect_s:.0f} s, {max(0.0, left):.0f} s of the budget left",
                )
            else:
                entry["status"] = "running"
                save()
                started = time.monotonic()
                outcome = run_part(part, run, min(part.limit_s, left), grace_s)
                steps = outcome.details.pop("_steps")
                entry.update(
                    status=outcome.status,
                    summary=outcome.summary,
                    figures=outcome.figures,
                    details=outcome.details,
                    seconds=round(time.monotonic() - started, 1),
                    limit_s=round(min(part.limit_s, left), 1),
                    steps=[s.as_dict(run.work) for s in steps],
                )
                halted = outcome.halt
            if not halted:  # without a GPU, the one closing line is all it says
                say(
                    f"[{time.monotonic() - t0:5.0f} s] {part.name}: {entry['status']}"
                    + (f": {entry['summary']}" if entry["summary"] else "")
                )
            save()
        report["finished"] = True
    except Stopped as exc:
        if current is not None and current["status"] == "running":
            current.update(status="cut short", summary=f"the check was stopped ({exc})")
        report["verdict"] = f"Cut short ({exc}) after {time.monotonic() - t0:.0f} s."
        save()
        raise
    if halted.startswith("no GPU"):
        report["mode"] = "no-gpu"
        report["title"] = "no GPU"
        report["verdict"] = f"N{halted[1:]}: nothing GPU-specific ran."
    else:
        devices = (run.machine.get("torch") or {}).get("devices") or []
        if report["mode"] == "gpu" and devices:
            report["title"] = devices[0]["name"]
            date = report["started_utc"][:10]
            report["result_name"] = f"{date}-{slug(devices[0]['name'])}"
        report["verdict"] = verdict(report)
    save()
    return report


def _stop(signum: int, frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for report.md/.json, logs")
    ap.add_argument("--cpu-dry-run", action="store_true", help="each part's CPU variant")
    ap.add_argument(
        "--budget",
        type=float,
        help=f"seconds for all parts (default {GPU_BUDGET_S:g}, dry run {DRY_BUDGET_S:g})",
    )
    ap.add_argument("--only", help="comma-separated parts to run (the machine part always runs)")
    ap.add_argument(
        "--commit", help="the commit checked (default: git rev-parse HEAD, if git is there)"
    )
    args = ap.parse_args(argv)
    dry = args.cpu_dry_run
    parts = default_parts(dry)
    names = [p.name for p in parts]
    only = None
    if args.only:
        only = {n for n in args.only.split(",") if n}
        if only - set(names):
            unknown = ", ".join(sorted(only - set(names)))
            ap.error(f"unknown part(s) {unknown}; the parts: {', '.join(names)}")
    budget = args.budget or (DRY_BUDGET_S if dry else GPU_BUDGET_S)
    mode = "cpu-dry-run" if dry else "gpu"
    report = new_report(parts, mode, budget, args.commit or git_commit())
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    run = Run(mode, work)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop)
    try:
        check(parts, run, args.out, budget, report, only)
    except Stopped:
        print(f"gpu_check: stopped; wrote {args.out / 'report.md'}", flush=True)
        return 143
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"gpu_check: {report['verdict']} Wrote {args.out / 'report.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
