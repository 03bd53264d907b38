"""The commands over stored runs: `gpu-trace ingest`, `ls`, `show`, `export`, `sql`, and their rendering.

`ls`, `show`, `export` and `sql` only read: they open the store with ``reading=True``, so an
embedded store this user can't write is read read-only (docs/schema.md) instead of refused.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_trace import _format as fmt
from gpu_trace import config
from gpu_trace._summary_text import clip as _clip
from gpu_trace._summary_text import render_ranks, render_summary
from gpu_trace._summary_text import wall_ns as _wall_ns
from gpu_trace.commands import CLIError, echo, err, telemetry
from gpu_trace.query import reads

if TYPE_CHECKING:
    from gpu_trace.store.retention import SpoolRelease


def store_module() -> Any:
    from gpu_trace.store import client

    return client


def checked_dsn(explicit: str | None) -> str:
    """The store DSN to use (--store, GPU_TRACE_STORE or the default); a malformed one is a
    usage error (exit 2) naming the accepted forms, before anything is opened or created."""
    from gpu_trace.store.dsn import parse_dsn

    dsn = config.store_dsn(explicit)
    try:
        parse_dsn(dsn)
    except ValueError as exc:
        raise CLIError(f"--store {dsn!r}: {exc}", 2) from None
    return dsn


def _open_store(args: argparse.Namespace) -> Any:
    """The store, for a command that only reads it (a read-only one is read as it is)."""
    store_mod = store_module()
    dsn = checked_dsn(getattr(args, "store", None))
    try:
        return store_mod.Store(dsn, reading=True)
    except store_mod.StoreError as exc:
        raise CLIError(str(exc)) from None


def _resolve(store: Any, ref: str) -> str:
    try:
        return reads.resolve_run(store, ref)
    except reads.UnknownRunError as exc:
        raise CLIError(str(exc)) from None


def cmd_ingest(args: argparse.Namespace) -> int:
    from gpu_trace._progress import PhaseProgress
    from gpu_trace.store.ingest import ingest
    from gpu_trace.store.retention import release_spool
    from gpu_trace.tracer.run import RunInfo

    run_dir: Path = args.run_dir
    if not RunInfo.exists(run_dir):
        raise CLIError(f"{run_dir} is not a run directory (no run.json)", 2)
    released = _released(run_dir)
    if released:
        raise CLIError(released, 2)
    dsn = checked_dsn(args.store)
    store_mod = store_module()
    try:
        with store_mod.Store(dsn) as store:
            progress = PhaseProgress(sys.stderr, prefix="ingest")  # on a terminal only
            try:
                report = ingest(store, run_dir, progress)
            finally:
                progress.close()
            try:
                spool = release_line(release_spool(store, run_dir, keep=args.keep_spool))
            except store_mod.StoreError as exc:
                spool = f"; spool kept: its ingest could not be checked ({exc})"
    except store_mod.StoreError as exc:
        raise CLIError(f"ingest failed, spool kept: {exc}") from None
    for problem in report.problems:
        err(problem)
    echo(
        f"{report.run_id}: {fmt.count(report.rows_total)} rows from {report.files_ingested} files ({report.files_skipped} already ingested) into {dsn}{spool}"
    )
    return 0


def release_line(release: SpoolRelease) -> str:
    """The closing line's clause on the spool (a :class:`~gpu_trace.store.retention.
    SpoolRelease`): removed, with its size, or kept and why; "" when there was none."""
    if release.kept:
        return f"; spool kept: {release.kept}"
    if not release.removed_files:
        return ""
    return f"; spool removed ({release.removed_files} files, {fmt.size(release.removed_bytes)})"


def _released(run_dir: Path) -> str:
    """Why ``run_dir`` has nothing to ingest because its spool was removed after an ingest
    (``ingested.json`` and no spool files), or ""."""
    from gpu_trace.store.retention import INGESTED_FILE
    from gpu_trace.tracer.spool import list_spool

    marker = run_dir / INGESTED_FILE
    if not marker.is_file() or list_spool(run_dir):
        return ""
    try:
        store = json.loads(marker.read_text()).get("store", "the store")
    except (OSError, ValueError, AttributeError):
        store = "the store"
    return (
        f"{run_dir}: its spool was removed after it was ingested into {store}; "
        "there is nothing left to ingest"
    )


def cmd_ls(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise CLIError(f"--limit must be 1 or more, got {args.limit}", 2)
    with _open_store(args) as store:
        runs = reads.runs(store, limit=args.limit, search=args.search)
    if args.json:
        echo(json.dumps(runs, default=str, indent=2))
        return 0
    if not runs and args.search:
        echo(f"no run's id or command contains {args.search!r}")
        return 0
    if not runs:
        echo("no runs yet: gpu-trace record -- python your_script.py")
        return 0
    from gpu_trace.tracer.run import describe_recording

    rows = []
    for r in runs:
        rows.append(
            [
                r["run_id"],
                fmt.wall_time(_wall_ns(r)),
                fmt.duration(max(0, r["ended_ns"] - r["started_ns"])) if r.get("ended_ns") else "-",
                fmt.count(int(r["events"])),
                r.get("status", ""),
                ",".join(r.get("hosts") or []),
                describe_recording(r.get("attrs") or {}, compact=True),
                _clip(r.get("command", ""), 60),
            ]
        )
    echo(
        fmt.table(
            ["RUN", "STARTED", "DURATION", "EVENTS", "STATUS", "HOSTS", "RECORDING", "COMMAND"],
            rows,
            right={2, 3},
        )
    )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from gpu_trace.commands.kernels import render_kernels
    from gpu_trace.query.distributed import rank_summary
    from gpu_trace.query.gpu import gpu_summary

    with _open_store(args) as store:
        run_id = _resolve(store, args.run)
        run = reads.run(store, run_id)
        summary = reads.summary(store, run_id, top=args.top)
        forwarding = reads.forwarding(store, run_id, top=args.top)
        gpu = gpu_summary(store, run_id, top=args.top)
        ranks = rank_summary(store, run_id)
    if args.json:
        out: dict[str, object] = {
            "run": run,
            "summary": summary.as_dict(),
            "forwarding": forwarding,
            "gpu": gpu,
        }
        out["ranks"] = ranks.as_dict() if ranks is not None else None
        echo(json.dumps(out, default=str, indent=2))
        return 0
    echo(render_summary(run, summary))
    if ranks is not None:
        echo(render_ranks(ranks))
    if gpu["devices"]:
        echo(render_kernels(gpu))
    if forwarding["ops"]:
        echo(_render_forwarding(forwarding))
    return 0


def _render_forwarding(fwd: dict) -> str:
    """Where forwarded time went, per op: client, wire, queue, execute (docs/remote.md)."""

    def share(row: dict) -> list[str]:
        parts = [row["client_ns"], row["wire_ns"], row["queue_ns"], row["execute_ns"]]
        total = sum(parts) or 1
        return [fmt.duration(sum(parts))] + [
            f"{fmt.duration(p)} {100 * p / total:.0f}%" for p in parts
        ]

    rows = [[_clip(r["name"], 44), fmt.count(r["count"]), *share(r)] for r in fwd["ops"]]
    rows.append(["all ops", fmt.count(fwd["totals"]["count"]), *share(fwd["totals"])])
    head = (
        f"\nforwarded: {fmt.count(fwd['totals']['count'])} ops in {fmt.count(fwd['batches'])} "
        f"batches; the program waited {fmt.duration(fwd['wait_ns'])} at sync points"
    )
    table = fmt.table(
        ["OP", "COUNT", "TOTAL", "CLIENT", "WIRE", "QUEUE", "EXECUTE"],
        rows,
        right={1, 2, 3, 4, 5, 6},
    )
    return head + "\n" + table


def _export_ranks(args: argparse.Namespace) -> int:
    """`export RUN --ranks-dir DIR`: one Chrome trace per rank (docs/distributed.md)."""
    from gpu_trace.export.rank_traces import write_rank_traces
    from gpu_trace.query.rank_time import processes

    out: Path = args.ranks_dir
    if args.output is not None:
        raise CLIError("export takes -o FILE or --ranks-dir DIR, not both", 2)
    if out.exists() and not out.is_dir():
        raise CLIError(f"cannot write into {out}: it is not a directory", 2)
    if not out.parent.is_dir():
        raise CLIError(f"cannot write into {out}: there is no directory {out.parent}", 2)
    with _open_store(args) as store:
        run_id = _resolve(store, args.run)
        procs = processes(store, run_id)
        if not procs:
            raise CLIError(f"run {run_id} has no ranks: no process of it carries a rank", 1)
        rank_pids: dict[int, set[tuple[str, int]]] = {}
        for p in procs:
            rank_pids.setdefault(p.rank, set()).add((p.host, p.pid))
        world = max(p.number("world_size") or 0 for p in procs)
        backend = next((p.facts["backend"] for p in procs if p.facts.get("backend")), "")
        try:
            out.mkdir(exist_ok=True)
            stats = write_rank_traces(
                out,
                reads.run(store, run_id),
                reads.threads(store, run_id),
                rank_pids,
                reads.iter_spans(store, run_id),
                reads.iter_counters(store, run_id),
                world_size=max(world, max(rank_pids) + 1),
                backend=backend,
            )
        except OSError as exc:
            raise CLIError(f"cannot write into {out}: {exc.strerror or exc}") from None
    events = sum(int(str(s.get("events", 0))) for s in stats.values())
    echo(
        f"wrote {fmt.counted(len(stats), 'rank')} ({fmt.count(events)} events) to {out}: "
        + ", ".join(Path(str(s["path"])).name for s in stats.values())
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from gpu_trace._progress import TerminalProgress
    from gpu_trace.export.exporter import export_run, get_exporter

    if telemetry.wanted(args):
        if args.output is not None:
            raise CLIError("export takes -o FILE or --otlp URL, not both", 2)
        telemetry.check(args)
        with _open_store(args) as store:
            return telemetry.export(args, store, _resolve(store, args.run))
    telemetry.check(args)
    if getattr(args, "ranks_dir", None) is not None:
        return _export_ranks(args)
    out: Path | None = args.output
    if out is None:
        raise CLIError("export needs -o FILE (a Chrome trace) or --otlp URL", 2)
    if out.suffix not in (".json", ".gz"):
        raise CLIError(f"output must end in .json or .json.gz, got {out}", 2)
    if not out.parent.is_dir():
        raise CLIError(f"cannot write {out}: there is no directory {out.parent}", 2)
    if out.is_dir():
        raise CLIError(f"cannot write {out}: it is a directory", 2)
    if args.rank < 0:
        raise CLIError(f"--rank must be 0 or more, got {args.rank}", 2)
    world_size = args.rank + 1 if args.world_size is None else args.world_size
    if world_size <= args.rank:
        raise CLIError(f"--world-size must be more than --rank ({args.rank}), got {world_size}", 2)
    with _open_store(args) as store:
        run_id = _resolve(store, args.run)
        run = reads.run(store, run_id)
        counts = reads.counts(store, run_id)
        try:
            exporter = get_exporter(
                "chrome",
                path=out,
                run=run,
                threads=reads.threads(store, run_id),
                total_spans=counts.get("spans"),
                progress=TerminalProgress(sys.stderr),
                rank=args.rank,
                world_size=world_size,
            )
        except OSError as exc:
            raise CLIError(f"cannot write {out}: {exc.strerror or exc}") from None
        ok = export_run(
            exporter, reads.iter_spans(store, run_id), reads.iter_counters(store, run_id)
        )
    if not ok:
        reason = getattr(exporter, "error", None) or "the exporter failed"
        kept = (
            "the file holds what was written before (marked incomplete)"
            if out.exists()
            else "nothing was written"
        )
        raise CLIError(f"cannot write {out}: {reason}; {kept}")
    stats = getattr(exporter, "stats", {})
    err(f"wrote {out}: {fmt.count(stats.get('events', 0))} events")
    return 0


#: `gpu-trace sql`'s default limits (docs/cli.md): rows and bytes of the result, seconds, and
#: the engine's memory for the query.
SQL_MAX_ROWS = 100_000
SQL_MAX_BYTES = 100 << 20
SQL_TIMEOUT_S = 60.0
SQL_MAX_MEMORY = 4 << 30
#: Seconds past --timeout after which `sql` stops a query the engine has not stopped (one long
#: computation looks at no clock), exiting at once.
HARD_STOP_GRACE_S = 5.0

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)


def size_arg(text: str) -> int:
    """A byte count as --max-bytes and --max-memory take it: 1000000, 64K, 100M, 4G (powers of
    1024), 0 for no limit."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (give bytes, or 64K, 100M, 4G)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))


def count_arg(text: str) -> int:
    """A row count as --max-rows takes it: 0 (no limit) or more."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"not a count: {text!r} (0 for no limit, or more)")
    return n


def seconds_arg(text: str) -> float:
    """Seconds as --timeout takes them: 0 (no limit) or more, fractions allowed."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"not seconds: {text!r} (0 for no limit, or more)")
    return seconds


def _limit_line(what: str, limit: float) -> str:
    """The line `sql` ends with when a limit stops a query, naming the flag that raises it."""
    if what == "time":
        return (
            f"stopped after {limit:g} s: the query ran out of time; raise with --timeout SECONDS "
            "(0: none)"
        )
    if what == "rows":
        return (
            f"stopped at {int(limit):,} rows: the result has more; add a LIMIT, or raise with "
            "--max-rows N (0: none)"
        )
    if what == "bytes":
        return f"stopped at {fmt.size(int(limit))} of result: raise with --max-bytes SIZE (0: none)"
    return (
        f"stopped at {fmt.size(int(limit))} of memory: the query needs more; raise with "
        "--max-memory SIZE (0: the engine's own limit)"
    )


def _hard_stop(seconds: float, line: str) -> threading.Timer:
    """Exit with ``line`` on stderr after ``seconds`` unless cancelled first (nothing else has
    been printed then: `sql` prints its rows after the query)."""

    def stop() -> None:
        err(line)
        sys.stderr.flush()
        os._exit(1)

    timer = threading.Timer(seconds, stop)
    timer.daemon = True
    timer.start()
    return timer


def cmd_sql(args: argparse.Namespace) -> int:
    from gpu_trace.store.guard import Limits

    params: dict[str, str] = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CLIError(f"--param takes NAME=VALUE, got {item!r}", 2)
        params[name] = value
    limits = Limits(  # a namespace made without the flags (a caller's) gets the defaults
        max_rows=getattr(args, "max_rows", SQL_MAX_ROWS),
        max_bytes=getattr(args, "max_bytes", SQL_MAX_BYTES),
        timeout_s=getattr(args, "timeout", SQL_TIMEOUT_S),
        max_memory=getattr(args, "max_memory", SQL_MAX_MEMORY),
    )
    with _open_store(args) as store:
        store_mod = store_module()
        # The engine and the reader stop a query at the limit; this stops one that neither
        # could (a single long function call).
        timer = (
            _hard_stop(limits.timeout_s + HARD_STOP_GRACE_S, _limit_line("time", limits.timeout_s))
            if limits.timeout_s
            else None
        )
        try:
            columns, rows = store.sql(args.query, parameters=params or None, limits=limits)
        except store_mod.LimitExceeded as exc:
            raise CLIError(_limit_line(exc.what, exc.limit)) from None
        except store_mod.StoreError as exc:
            raise CLIError(str(exc)) from None
        finally:
            if timer is not None:
                timer.cancel()
    if args.json:
        for row in rows:
            echo(json.dumps(dict(zip(columns, row)), default=str))
        return 0
    echo(fmt.table(list(columns), [[_cell(v) for v in row] for row in rows]))
    return 0


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)
