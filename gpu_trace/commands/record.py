"""`gpu-trace record`: run a program recorded, then load its run into the store."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpu_trace import _format as fmt
from gpu_trace import config
from gpu_trace.commands import CLIError, check_settings, err, telemetry
from gpu_trace.commands.runs import release_line, store_module
from gpu_trace.query import reads

#: record's exit status when the program succeeded but its run could not be stored (sysexits'
#: EX_TEMPFAIL: the spool is kept, and `gpu-trace ingest DIR` stores it later). A program's own
#: non-zero status wins over it.
NOT_STORED = 75


def cmd_record(args: argparse.Namespace) -> int:
    from gpu_trace import launch
    from gpu_trace.store.embedded import check_writable

    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    check_settings()  # every setting, before anything is created or the program runs
    telemetry.check(args)
    try:
        config.nvml_replay(args.nvml_replay)  # so is a replay file named on the command line
    except ValueError as exc:
        raise CLIError(str(exc), 2) from None
    dsn = config.store_dsn(args.store)
    if not args.no_ingest:
        problem = check_writable(dsn)
        if problem:
            raise CLIError(f"cannot record: {problem} (--no-ingest records into a spool only)", 2)
    try:
        prepared = launch.prepare(
            argv,
            run_dir=args.run_dir,
            job=args.job,
            nvtx=args.nvtx,
            torch=args.torch,
            tf=args.tf,
            nvml_hz=0.0 if args.no_nvml else args.nvml_hz,
            host_hz=args.host_hz,
            nvml_replay=args.nvml_replay,
            remote=args.remote,
            remote_sync=args.sync,
            fallback_local=args.fallback_local,
            gpu_activity=args.gpu_activity,
        )
    except launch.LaunchError as exc:
        raise CLIError(str(exc), exc.exit_code) from None
    for note in prepared.notes:
        err(note)
    stream = telemetry.start_stream(args, prepared.run_dir)  # --otlp: before the spool may go
    try:
        code = launch.run(prepared)
    except launch.LaunchError as exc:
        raise CLIError(str(exc), exc.exit_code) from None
    finally:
        telemetry.finish_stream(stream)
    stored = finish_run(
        prepared.run_dir,
        dsn,
        ingest=not args.no_ingest,
        save_error=prepared.save_error,
        keep_spool=args.keep_spool,
    )
    return code if code != 0 or stored else NOT_STORED


def finish_run(
    run_dir: Path, dsn: str, *, ingest: bool, save_error: str = "", keep_spool: bool | None = None
) -> bool:
    """Ingest the run, remove its spool once the store is checked to hold it (unless
    ``keep_spool`` or GPU_TRACE_KEEP_SPOOL), and print the closing line. False when the run was
    to be stored and could not be (the line says so, and how to store it later)."""
    from gpu_trace._progress import PhaseProgress
    from gpu_trace.query.summary import event_count
    from gpu_trace.store.ingest import ingest as ingest_run
    from gpu_trace.store.retention import release_spool
    from gpu_trace.tracer.run import RunInfo, read_stats

    info = RunInfo.load(run_dir)
    stats = read_stats(run_dir)
    events = sum(int(s.get("events", 0)) for s in stats)
    dropped = sum(int(s.get("dropped", 0)) for s in stats)
    disk = _write_trouble(run_dir, stats, save_error)
    if not ingest:
        err(
            f"run {info.run_id}: {fmt.count(events)} events, {fmt.count(dropped)} dropped, spooled in {run_dir} (not ingested: gpu-trace ingest {run_dir}){disk}"
        )
        return True
    store_mod = store_module()
    try:
        with store_mod.Store(dsn) as store:
            progress = PhaseProgress(sys.stderr, prefix="record")  # on a terminal only
            try:
                report = ingest_run(store, run_dir, progress)
            finally:
                progress.close()
            stored = event_count(reads.counts(store, report.run_id))
            try:
                spool = release_line(release_spool(store, run_dir, keep=keep_spool))
            except store_mod.StoreError as exc:
                spool = f"; spool kept: its ingest could not be checked ({exc})"
    except store_mod.StoreError as exc:
        err(
            f"run {info.run_id}: {fmt.count(events)} events, {fmt.count(dropped)} dropped, NOT stored: {exc}{disk}; the spool is kept: load it later with gpu-trace ingest {run_dir}"
        )
        return False
    for problem in report.problems:
        err(problem)
    err(
        f"run {info.run_id}: {fmt.count(stored)} events, {fmt.count(dropped)} dropped, stored in {dsn}{disk}{spool}"
    )
    return True


def _write_trouble(run_dir: Path, stats: list[dict], save_error: str) -> str:
    """The closing line's clause on spool writes that failed (a full disk), or ""."""
    failures = sum(int(s.get("write_failures", 0)) for s in stats)
    if not failures and not save_error:
        return ""
    lost = sum(int(s.get("not_written", 0)) for s in stats)
    errors = {str(s.get("write_error") or "") for s in stats} - {""}
    full = save_error.endswith("the disk is full") or "the disk is full" in errors
    text = f"; the disk under {run_dir} filled up" if full else f"; writing to {run_dir} failed"
    if errors and not full:
        text += f" ({', '.join(sorted(errors))})"
    if failures:
        text += (
            f": {fmt.count(lost)} events not written (counted as dropped)"
            if lost
            else ": every event was written once there was room"
        )
    if save_error:
        text += f"; {save_error}"
    return text
