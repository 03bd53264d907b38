"""The `gpu-trace` command line: record, serve, tenants, ingest, rm, gc, ls, show, export, sql,
ui, demo.

This module builds the parser and dispatches; each command lives in :mod:`gpu_trace.commands`
(record, remote, store, ui). Errors are one line on stderr, ``gpu-trace: ...``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gpu_trace import __version__, _format
from gpu_trace.commands import CLIError, err, runs, telemetry
from gpu_trace.commands.imports import cmd_import
from gpu_trace.commands.record import cmd_record
from gpu_trace.commands.remote import cmd_serve, cmd_tenants
from gpu_trace.commands.removal import cmd_gc, cmd_rm
from gpu_trace.commands.runs import cmd_export, cmd_ingest, cmd_ls, cmd_show, cmd_sql
from gpu_trace.commands.ui import cmd_demo, cmd_ui

EPILOG = "Data lives under GPU_TRACE_HOME (default ~/.local/share/gpu-trace). See docs/cli.md."


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        metavar="DSN",
        help="chdb:///path (embedded) or http(s)://user:pass@host:port (ClickHouse server); "
        "default GPU_TRACE_STORE or the embedded store under GPU_TRACE_HOME",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpu-trace",
        description="Profile local and forwarded GPU work: NVTX ranges, counters, one timeline.",
        epilog=EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"gpu-trace {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "record",
        help="run a command and record it",
        description="Run COMMAND with recording in place (Python programs and their Python "
        "children are instrumented before their first line), then ingest the run into the store.",
        usage="gpu-trace record [OPTIONS] -- COMMAND [ARGS...]",
    )
    p.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="spool directory (default: a new one under GPU_TRACE_HOME/runs)",
    )
    p.add_argument(
        "--job",
        metavar="ID",
        help="record this command as one part of job ID: every record of the job (each rank "
        "under its own record, on any host) lands in one run, job-ID (default: GPU_TRACE_JOB, "
        "or the launcher's job id when it started several records; docs/distributed.md)",
    )
    _store_arg(p)
    p.add_argument(
        "--nvtx",
        choices=["native", "python", "off"],
        help="NVTX capture: native injection library (default), Python nvtx package only, or off",
    )
    p.add_argument(
        "--gpu-activity",
        choices=["auto", "on", "off"],
        help="kernels, copies, memsets and CUDA calls through CUPTI: on where a driver is (auto)",
    )
    p.add_argument(
        "--torch",
        choices=["module", "op", "off"],
        help="PyTorch ranges: modules, optimizer, backward, steps (default); op adds every ATen op",
    )
    p.add_argument(
        "--tf",
        choices=["layer", "op", "off"],
        help="TensorFlow ranges: Keras layers, tf.function, gradients, steps (default); op adds "
        "eager ops",
    )
    p.add_argument(
        "--nvml-hz",
        type=float,
        metavar="HZ",
        help="NVML samples per second, taken by this process (default 10; 0 is off)",
    )
    p.add_argument("--no-nvml", action="store_true", help="no NVML sampling (--nvml-hz 0)")
    p.add_argument(
        "--host-hz",
        type=float,
        metavar="HZ",
        help="host CPU/memory/network/disk samples per second (default 2; 0 is off)",
    )
    p.add_argument(
        "--nvml-replay",
        type=Path,
        metavar="FILE",
        help="play back an NVML sample file instead of reading NVML (see docs/collectors.md)",
    )
    p.add_argument(
        "--no-ingest", action="store_true", help="leave the spool for `gpu-trace ingest`"
    )
    p.add_argument(
        "--keep-spool",
        action="store_true",
        default=None,
        help="keep the spool files after ingest (default: removed once the store is checked to "
        "hold them; GPU_TRACE_KEEP_SPOOL)",
    )
    p.add_argument(
        "--remote",
        metavar="HOST:PORT",
        help="forward the program's CUDA work to a `gpu-trace serve` server (docs/remote.md)",
    )
    p.add_argument(
        "--sync",
        action="store_true",
        help="with --remote: every forwarded op waits for the server (for comparison)",
    )
    p.add_argument(
        "--fallback-local",
        action="store_true",
        help="with --remote: if the server cannot be reached, run the program locally (said on "
        "stderr; the run is recorded as local) instead of failing with exit status 69",
    )
    telemetry.add_arguments(p, streaming=True)
    p.add_argument(
        "argv", nargs=argparse.REMAINDER, metavar="COMMAND", help="the command to run, after --"
    )
    p.set_defaults(func=cmd_record)

    p = sub.add_parser(
        "serve",
        help="run a forwarding server that owns a GPU (or the CPU) for remote clients",
        description="Serve forwarded PyTorch ops from `gpu-trace record --remote` and "
        "gpu_trace.runtime.connect() clients. See docs/remote.md.",
    )
    p.add_argument(
        "--listen",
        default="127.0.0.1:7070",
        metavar="HOST:PORT",
        help="address to listen on (default 127.0.0.1:7070; 0.0.0.0:PORT for other machines)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cuda:0, cpu, ... (default cuda:0 if there is a GPU, else cpu)",
    )
    p.add_argument(
        "--token",
        help="token clients must present (default GPU_TRACE_REMOTE_TOKEN, else a new one written "
        "to GPU_TRACE_HOME/remote-token)",
    )
    p.add_argument("--max-sessions", type=int, default=64, help="most clients at once (default 64)")
    p.add_argument(
        "--max-handshakes",
        metavar="N",
        type=int,
        default=None,
        help="most connections waiting to authenticate at once, apart from sessions; one more "
        "ends the oldest (default GPU_TRACE_MAX_HANDSHAKES, else 64)",
    )
    p.add_argument(
        "--handshake-timeout",
        metavar="SECONDS",
        type=float,
        default=None,
        help="seconds a new connection has to authenticate (default GPU_TRACE_HANDSHAKE_TIMEOUT, "
        "else 10)",
    )
    p.add_argument(
        "--gpu-activity",
        choices=["auto", "on", "off"],
        help="kernels, copies and CUDA calls of forwarded ops through CUPTI, under their ops in the "
        "clients' runs, and tenants' GPU busy time (default GPU_TRACE_GPU_ACTIVITY, else auto: "
        "on a CUDA device where a driver is)",
    )
    p.add_argument(
        "--store",
        metavar="DSN",
        help="write the server's spans of every traced session into this ClickHouse server "
        "(http(s)://...) under the client's run, instead of sending them back to the client",
    )
    p.add_argument(
        "--tenants",
        metavar="FILE",
        type=Path,
        help="share the device among the tenants of this TOML file (tokens, memory quotas, "
        "weights, priorities; docs/sharing.md); instead of --token",
    )
    p.add_argument(
        "--policy",
        choices=("fifo", "rr", "fair", "las"),
        default="fair",
        help="which session's work runs next: fifo, rr (round robin), fair (weighted fair share, "
        "the default) or las (least attained service)",
    )
    p.add_argument(
        "--las-thresholds",
        metavar="SECONDS,...",
        help="under --policy las, the device time a session attains before it sinks to each "
        "lower queue (default 1,10,100)",
    )
    p.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="device memory that tenants' memory fractions are taken of, in bytes or as 16GiB "
        "(default: a GPU's total memory; on the CPU device, the machine's)",
    )
    p.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus /metrics here (default 127.0.0.1 and the listen port + 1; off "
        "turns it off); a non-loopback address needs an admin tenant's token on requests",
    )
    p.add_argument(
        "--idle-s",
        metavar="SECONDS",
        type=float,
        default=300.0,
        help="page a session's tensors out to host memory after it has been idle this long (a "
        "tenant's idle_s wins; 0 never; default 300); they come back on its next batch",
    )
    p.add_argument(
        "--spin-us",
        metavar="US",
        type=float,
        default=None,
        help="poll for a client's next message this long while the device is idle, before "
        "sleeping (default GPU_TRACE_SPIN_US, else 200; 0 sleeps at once)",
    )
    p.add_argument(
        "--isolation",
        choices=("process", "shared"),
        default="process",
        help="process (the default): each session's work in a worker process of its own, so a "
        "crash, a broken CUDA context or a hostile op reaches no other session; shared: every "
        "session in this process, for sessions that trust each other (docs/sharing.md)",
    )
    p.add_argument(
        "--standby",
        metavar="N",
        type=int,
        default=2,
        help="with --isolation process: worker processes kept ready for new sessions (torch "
        "imported, device context made; default 2)",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "tenants",
        help="list a shared server's sessions and usage per tenant; evict or page out a session "
        "(admin)",
        description="List the live sessions of a `gpu-trace serve` server and what each tenant "
        "and session uses. A tenant's token shows its own sessions; an admin tenant's token "
        "shows all and may evict a session or page it out. See docs/sharing.md.",
    )
    p.add_argument("address", metavar="HOST:PORT", help="the server")
    p.add_argument(
        "--token",
        help="the tenant's token (default GPU_TRACE_REMOTE_TOKEN, else the token file "
        "GPU_TRACE_HOME/remote-token)",
    )
    act = p.add_mutually_exclusive_group()
    act.add_argument(
        "--evict",
        type=int,
        metavar="SESSION_ID",
        help="close this session (an admin tenant's token only): its client gets an error at "
        "its next sync point and its memory is freed",
    )
    act.add_argument(
        "--page-out",
        type=int,
        metavar="SESSION_ID",
        help="move this session's tensors to host memory now, as if it had been idle (an admin "
        "tenant's token only); its next op brings them back",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_tenants)

    p = sub.add_parser("ingest", help="load a run directory's spool into the store (idempotent)")
    p.add_argument(
        "run_dir",
        type=Path,
        metavar="DIR",
        help="a run directory (run.json and spool/), e.g. one `record --no-ingest` or a store that "
        "was down left, or one copied from another machine",
    )
    _store_arg(p)
    p.add_argument(
        "--keep-spool",
        action="store_true",
        default=None,
        help="keep the spool files (default: a run directory under GPU_TRACE_HOME/runs loses them "
        "once the store is checked to hold them; GPU_TRACE_KEEP_SPOOL)",
    )
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser(
        "import",
        help="load a PyTorch profiler (Kineto) trace, TRACE.json[.gz], into the store as a run",
        description="Load a Chrome trace written by torch.profiler (export_chrome_trace) into the "
        "store as a new run: CPU ops, annotations, steps, kernels, copies, memsets, CUDA calls and "
        "their launch links. A file imported before is not imported again (its run is named).",
    )
    p.add_argument(
        "trace",
        type=Path,
        metavar="TRACE",
        help="a Chrome trace file from torch.profiler, plain or gzipped (read by content)",
    )
    p.add_argument("--name", help="the run's command line in ls (default: import TRACE's name)")
    _store_arg(p)
    p.set_defaults(func=cmd_import)

    p = sub.add_parser(
        "rm",
        help="remove runs from the store and their run directories",
        description="Remove each RUN (id, unique prefix, or 'last') from the store and its run "
        "directory under GPU_TRACE_HOME/runs, printing what was removed and its size. Every RUN "
        "is checked first: one that does not exist, or is still recording, removes nothing.",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run id, unique prefix, or 'last'")
    _store_arg(p)
    p.add_argument(
        "--force", action="store_true", help="remove a run even if it may still be recording"
    )
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser(
        "gc",
        help="remove old runs and spools",
        description="Remove runs started longer ago than --older-than from the store with their "
        "run directories, spool files of stored runs, and run directories of runs that never "
        "reached the store. A run that may still be recording, or was written to since, stays.",
    )
    p.add_argument(
        "--older-than",
        default="7d",
        metavar="AGE",
        help="age: 30m, 12h, 7d, 2w; a bare number is days (default 7d)",
    )
    p.add_argument(
        "--spools-only",
        action="store_true",
        help="keep runs in the store; remove only spool files and directories of unstored runs",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="say what would be removed, remove nothing"
    )
    _store_arg(p)
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("ls", help="list recorded runs, newest first")
    _store_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--limit", type=int, default=20, help="at most this many runs (default 20)")
    p.add_argument("--search", metavar="TEXT", help="only runs whose id or command contains TEXT")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("show", help="summarize a run: top ranges by total and self time, per lane")
    p.add_argument("run", metavar="RUN", help="run id, unique prefix, or 'last'")
    _store_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--top", type=int, default=10, help="ranges per lane (default 10)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser(
        "export",
        help="write a run as Chrome trace JSON (Perfetto, chrome://tracing, HTA), or send it to an "
        "OpenTelemetry collector (--otlp)",
    )
    p.add_argument("run", metavar="RUN", help="run id, unique prefix, or 'last'")
    p.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="FILE.json or FILE.json.gz (or --otlp)"
    )
    p.add_argument("--rank", type=int, default=0, help="distributedInfo rank (default 0)")
    p.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="distributedInfo world size: how many ranks the job has (default: rank + 1)",
    )
    p.add_argument(
        "--ranks-dir",
        type=Path,
        metavar="DIR",
        help="a distributed run: one Chrome trace per rank, DIR/rank-N.json, as Holistic Trace "
        "Analysis reads a multi-rank trace (docs/distributed.md)",
    )
    telemetry.add_arguments(p, streaming=False)
    _store_arg(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("sql", help="run a read-only SQL query on the store's tables")
    p.add_argument(
        "query",
        metavar="QUERY",
        help='e.g. "SELECT name, count() FROM gpu_trace.spans GROUP BY name"',
    )
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument(
        "-p",
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a {NAME:Type} query parameter",
    )
    p.add_argument(
        "--max-rows",
        type=runs.count_arg,
        default=runs.SQL_MAX_ROWS,
        metavar="N",
        help=f"stop if the result has more rows (default {runs.SQL_MAX_ROWS:,}; 0: no limit)",
    )
    p.add_argument(
        "--max-bytes",
        type=runs.size_arg,
        default=runs.SQL_MAX_BYTES,
        metavar="SIZE",
        help="stop if the result is larger: bytes, or 64K, 100M, 4G (default 100M; 0: no limit)",
    )
    p.add_argument(
        "--timeout",
        type=runs.seconds_arg,
        default=runs.SQL_TIMEOUT_S,
        metavar="SECONDS",
        help=f"stop the query after this long (default {runs.SQL_TIMEOUT_S:g}; 0: no limit)",
    )
    p.add_argument(
        "--max-memory",
        type=runs.size_arg,
        default=runs.SQL_MAX_MEMORY,
        metavar="SIZE",
        help="stop the query if the engine needs more memory for it (default 4G; 0: the "
        "engine's own limit)",
    )
    _store_arg(p)
    p.set_defaults(func=cmd_sql)

    p = sub.add_parser(
        "ui",
        help="serve the web timeline viewer (Dash) on the store",
        description="Serve the dashboard: runs, one timeline of client, wire, server and counters, "
        "summary, tenants, compare, export. Read-only. See docs/dashboard.md.",
    )
    _store_arg(p)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only; there is no login)",
    )
    p.add_argument("--port", type=int, default=8050, help="port (default 8050; 0 picks one)")
    p.add_argument("--run", metavar="RUN", help="open this run first (default: the newest)")
    p.set_defaults(func=cmd_ui)

    p = sub.add_parser(
        "demo",
        help="record a small built-in workload, load the sample traces, open the dashboard",
    )
    _store_arg(p)
    p.add_argument(
        "--ui",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve the dashboard afterwards (default: when run from a terminal)",
    )
    p.add_argument("--port", type=int, default=8050, help="dashboard port with --ui (default 8050)")
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="FILE",
        help="Chrome trace to write (default: in the run directory)",
    )
    p.set_defaults(func=cmd_demo)
    return parser


# ---- commands ---------------------------------------------------------------------------------


class _Prefixed(logging.Formatter):
    """``gpu-trace: message``, once: library messages that already start so keep one prefix, and
    control characters from recorded names are shown escaped (like every line the CLI prints)."""

    def format(self, record: logging.LogRecord) -> str:
        text = _format.text(super().format(record), keep="\n")
        return text if text.startswith("gpu-trace: ") else f"gpu-trace: {text}"


def _unknown_command(parser: argparse.ArgumentParser, words: list[str]) -> str | None:
    """One line for a command that is not one of ours, with the closest one; None if it is."""
    import difflib

    commands = next(
        (list(a.choices) for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
        [],
    )
    word = next((w for w in words if not w.startswith("-")), None)  # global options take none
    if word is None or word in commands:
        return None
    close = difflib.get_close_matches(word, commands, n=1)
    hint = f": did you mean {close[0]!r}?" if close else f" (commands: {', '.join(commands)})"
    return f"unknown command {_format.text(word)!r}{hint}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    unknown = _unknown_command(parser, sys.argv[1:] if argv is None else argv)
    if unknown is not None:
        err(unknown)
        return 2
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_Prefixed())
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, handlers=[handler]
    )
    if not args.verbose:
        # The HTTP client's retries and driver notes repeat what the command's one line says (a
        # filter on the handler: clickhouse-connect sets urllib3's level when it is imported).
        handler.addFilter(lambda r: not r.name.startswith(("urllib3", "clickhouse_connect")))
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        err(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        err("interrupted")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
