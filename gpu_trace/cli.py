"""The `gpu-trace` command line: record, serve, tenants, ingest, ls, show, export, sql, ui, demo.

Only this module prints or exits. Errors are one line on stderr, ``gpu-trace: ...``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from gpu_trace import __version__, config
from gpu_trace import _format as fmt

EPILOG = "Data lives under GPU_TRACE_HOME (default ~/.local/share/gpu-trace). See docs/cli.md."


class CLIError(Exception):
    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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
    _store_arg(p)
    p.add_argument(
        "--nvtx",
        choices=["native", "python", "off"],
        help="NVTX capture: native injection library (default), Python nvtx package only, or off",
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
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "tenants",
        help="list a shared server's sessions and usage per tenant; evict a session (admin)",
        description="List the live sessions of a `gpu-trace serve` server and what each tenant "
        "and session uses. A tenant's token shows its own sessions; an admin tenant's token "
        "shows all and may evict. See docs/sharing.md.",
    )
    p.add_argument("address", metavar="HOST:PORT", help="the server")
    p.add_argument(
        "--token",
        help="the tenant's token (default GPU_TRACE_REMOTE_TOKEN, else the token file "
        "GPU_TRACE_HOME/remote-token)",
    )
    p.add_argument(
        "--evict",
        type=int,
        metavar="SESSION_ID",
        help="close this session (an admin tenant's token only): its client gets an error at "
        "its next sync point and its memory is freed",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_tenants)

    p = sub.add_parser("ingest", help="load a run directory's spool into the store (idempotent)")
    p.add_argument("run_dir", type=Path, metavar="DIR")
    _store_arg(p)
    p.set_defaults(func=cmd_ingest)

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
        "export", help="write a run as Chrome trace JSON (Perfetto, chrome://tracing, HTA)"
    )
    p.add_argument("run", metavar="RUN", help="run id, unique prefix, or 'last'")
    p.add_argument(
        "-o", "--output", type=Path, required=True, metavar="FILE", help="FILE.json or FILE.json.gz"
    )
    p.add_argument("--rank", type=int, default=0, help="distributedInfo rank (default 0)")
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


def cmd_record(args: argparse.Namespace) -> int:
    from gpu_trace import launch

    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    dsn = config.store_dsn(args.store)
    if not args.no_ingest:
        problem = _store_module().check_writable(dsn)
        if problem:
            raise CLIError(f"store {dsn} is not usable: {problem}", 2)
    try:
        prepared = launch.prepare(
            argv,
            run_dir=args.run_dir,
            nvtx=args.nvtx,
            torch=args.torch,
            tf=args.tf,
            nvml_hz=0.0 if args.no_nvml else args.nvml_hz,
            host_hz=args.host_hz,
            nvml_replay=args.nvml_replay,
            remote=args.remote,
            remote_sync=args.sync,
        )
    except launch.LaunchError as exc:
        raise CLIError(str(exc), exc.exit_code) from None
    for note in prepared.notes:
        _err(note)
    try:
        code = launch.run(prepared)
    except launch.LaunchError as exc:
        raise CLIError(str(exc), exc.exit_code) from None
    _finish_run(prepared.run_dir, dsn, ingest=not args.no_ingest)
    return code


def cmd_serve(args: argparse.Namespace) -> int:
    import signal

    from gpu_trace.runtime import auth
    from gpu_trace.runtime.policies import make_policy
    from gpu_trace.runtime.scheduler import PolicyScheduler
    from gpu_trace.runtime.server import Server
    from gpu_trace.runtime.tenants import load_tenants, parse_size

    if args.tenants is not None and args.token:
        raise CLIError("give --tenants or --token, not both (tenants' tokens are in the file)", 2)
    try:
        tenants = token = token_path = None
        if args.tenants is not None:
            tenants = load_tenants(args.tenants)
        else:
            token, token_path = auth.server_token(args.token)
        device_memory = None
        if args.device_memory is not None:
            device_memory = parse_size(args.device_memory)
            if device_memory <= 0:
                raise ValueError("--device-memory must be more than 0 bytes")
        scheduler = PolicyScheduler(make_policy(args.policy))
        device = args.device
        if device is None:
            import torch

            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        sink = None
        if args.store:
            from gpu_trace.runtime.sink import StoreSink

            sink = StoreSink(args.store, config.home() / "serve-spool")
        server = Server(
            args.listen,
            device=device,
            token=token,
            tenants=tenants,
            device_memory=device_memory,
            scheduler=scheduler,
            max_sessions=args.max_sessions,
            sink=sink,
            idle_s=args.idle_s,
        )
        server.start()
    except (ValueError, OSError) as exc:
        raise CLIError(f"cannot serve: {exc}", 2) from None
    try:
        metrics = _serve_metrics(server, args.listen, args.metrics)
    except CLIError:
        server.close()
        raise
    if tenants is not None:
        where = f"{len(tenants)} tenants from {args.tenants}"
    elif token_path:
        where = f"token in {token_path}"
    else:
        where = "token from --token/GPU_TRACE_REMOTE_TOKEN"
    where += f"; policy {args.policy}"
    if sink is not None:
        where += f"; spans to {sink.display}"
    if metrics is not None:
        where += f"; metrics at {metrics.url}"
    _err(f"serving {server.device} on {server.address} ({where}); Ctrl-C stops")
    signal.signal(signal.SIGTERM, lambda *_: server.stop("SIGTERM"))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.stop("SIGINT")
    finally:
        if metrics is not None:
            metrics.close()
        server.close()
    why = f" ({server.stop_reason})" if server.stop_reason else ""
    _err(f"stopped{why}: served {server.executor.batches} batches")
    return 0


def _serve_metrics(server: Any, listen: str, spec: str | None) -> Any:
    """``--metrics``: the /metrics server, started; None if off. The default (the listen port
    + 1 on 127.0.0.1) gives way with a warning when taken; an explicit address must work."""
    from gpu_trace.runtime.metrics import MetricsServer
    from gpu_trace.runtime.server import parse_address

    if spec is not None and spec.lower() == "off":
        return None
    if spec is None:
        port = parse_address(listen)[1]
        spec = f"127.0.0.1:{port + 1 if port else 0}"
        explicit = False
    else:
        explicit = True
    try:
        return MetricsServer(server, spec).start()
    except (ValueError, OSError) as exc:
        if explicit:
            raise CLIError(f"cannot serve metrics on {spec}: {exc}", 2) from None
        _err(f"no /metrics: {spec}: {exc} (--metrics HOST:PORT picks another address)")
        return None


def cmd_tenants(args: argparse.Namespace) -> int:
    from gpu_trace.runtime import admin
    from gpu_trace.runtime.errors import RemoteError

    try:
        if args.evict is not None:
            admin.evict(args.address, args.evict, args.token)
            if args.json:
                _out(json.dumps({"evicted": args.evict}))
            else:
                _out(f"evicted session {args.evict}")
            return 0
        listing = admin.list_sessions(args.address, args.token)
    except RemoteError as exc:
        raise CLIError(str(exc)) from None
    except ValueError as exc:  # no token, a malformed address
        raise CLIError(str(exc), 2) from None
    listing.pop("ok", None)
    _out(json.dumps(listing, indent=2) if args.json else admin.format_listing(listing))
    return 0


def _finish_run(run_dir: Path, dsn: str, *, ingest: bool) -> None:
    from gpu_trace.tracer.run import RunInfo, read_stats

    info = RunInfo.load(run_dir)
    stats = read_stats(run_dir)
    events = sum(int(s.get("events", 0)) for s in stats)
    dropped = sum(int(s.get("dropped", 0)) for s in stats)
    if not ingest:
        _err(
            f"run {info.run_id}: {fmt.count(events)} events, {fmt.count(dropped)} dropped, spooled in {run_dir} (not ingested: gpu-trace ingest {run_dir})"
        )
        return
    store_mod = _store_module()
    try:
        with store_mod.Store(dsn) as store:
            report = store.ingest(run_dir)
    except store_mod.StoreError as exc:
        _err(
            f"run {info.run_id}: {fmt.count(events)} events, {fmt.count(dropped)} dropped, NOT stored: {exc}"
        )
        _err(f"the spool is kept in {run_dir}; load it later with: gpu-trace ingest {run_dir}")
        return
    for problem in report.problems:
        _err(problem)
    _err(
        f"run {info.run_id}: {fmt.count(report.rows_total)} events, {fmt.count(dropped)} dropped, stored in {dsn}"
    )


def cmd_ingest(args: argparse.Namespace) -> int:
    from gpu_trace.tracer.run import RunInfo

    run_dir: Path = args.run_dir
    if not RunInfo.exists(run_dir):
        raise CLIError(f"{run_dir} is not a run directory (no run.json)", 2)
    dsn = config.store_dsn(args.store)
    store_mod = _store_module()
    try:
        with store_mod.Store(dsn) as store:
            report = store.ingest(run_dir)
    except store_mod.StoreError as exc:
        raise CLIError(f"ingest failed, spool kept: {exc}") from None
    for problem in report.problems:
        _err(problem)
    _out(
        f"{report.run_id}: {fmt.count(report.rows_total)} rows from {report.files_ingested} files ({report.files_skipped} already ingested) into {dsn}"
    )
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        runs = store.runs(limit=args.limit, search=args.search)
    if args.json:
        _out(json.dumps(runs, default=str, indent=2))
        return 0
    if not runs:
        _out("no runs yet: gpu-trace record -- python your_script.py")
        return 0
    rows = []
    for r in runs:
        rows.append(
            [
                r["run_id"],
                fmt.wall_time(_wall_ns(r)),
                fmt.duration(max(0, r["ended_ns"] - r["started_ns"])) if r.get("ended_ns") else "-",
                fmt.count(int(r.get("spans", 0)) + int(r.get("counters", 0))),
                r.get("status", ""),
                ",".join(r.get("hosts") or []),
                _clip(r.get("command", ""), 60),
            ]
        )
    _out(
        fmt.table(
            ["RUN", "STARTED", "DURATION", "EVENTS", "STATUS", "HOSTS", "COMMAND"],
            rows,
            right={2, 3},
        )
    )
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        run_id = _resolve(store, args.run)
        run = store.run(run_id)
        summary = store.summary(run_id, top=args.top)
        forwarding = store.forwarding(run_id, top=args.top)
    if args.json:
        out = {"run": run, "summary": summary, "forwarding": forwarding}
        _out(json.dumps(out, default=str, indent=2))
        return 0
    _out(_render_summary(run, summary))
    if forwarding["ops"]:
        _out(_render_forwarding(forwarding))
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


def cmd_export(args: argparse.Namespace) -> int:
    from gpu_trace._progress import TerminalProgress
    from gpu_trace.tracer import chrome

    out: Path = args.output
    if out.suffix not in (".json", ".gz"):
        raise CLIError(f"output must end in .json or .json.gz, got {out}", 2)
    with _open_store(args) as store:
        run_id = _resolve(store, args.run)
        run = store.run(run_id)
        counts = store.counts(run_id)
        progress = TerminalProgress(sys.stderr)
        stats = chrome.write_chrome_trace(
            out,
            run,
            store.threads(run_id),
            store.iter_spans(run_id),
            store.iter_counters(run_id),
            total_spans=counts.get("spans"),
            progress=progress,
            rank=args.rank,
        )
    _err(f"wrote {out}: {fmt.count(stats.get('events', 0))} events")
    return 0


def cmd_sql(args: argparse.Namespace) -> int:
    params: dict[str, str] = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CLIError(f"--param takes NAME=VALUE, got {item!r}", 2)
        params[name] = value
    with _open_store(args) as store:
        store_mod = _store_module()
        try:
            columns, rows = store.sql(args.query, parameters=params or None)
        except store_mod.StoreError as exc:
            raise CLIError(str(exc)) from None
    if args.json:
        for row in rows:
            _out(json.dumps(dict(zip(columns, row)), default=str))
        return 0
    _out(fmt.table(list(columns), [[_cell(v) for v in row] for row in rows]))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gpu_trace import launch
    from gpu_trace.tracer import chrome

    workload = Path(__file__).resolve().parent / "_demo_workload.py"
    dsn = config.store_dsn(args.store)
    problem = _store_module().check_writable(dsn)
    if problem:
        raise CLIError(f"store {dsn} is not usable: {problem}", 2)
    # Without NVML the demo plays back the repository's (synthetic) NVML sample file, if present.
    sample = Path(__file__).resolve().parents[1] / "sample_traces" / "nvml-synthetic-h100.jsonl"
    prepared = launch.prepare(
        [sys.executable, str(workload)], nvml_fallback=sample if sample.is_file() else None
    )
    for note in prepared.notes:
        _err(note)
    code = launch.run(prepared)
    _finish_run(prepared.run_dir, dsn, ingest=True)
    if code != 0:
        raise CLIError(f"the demo workload failed with status {code}")
    out = args.output or prepared.run_dir / "trace.json.gz"
    with _store_module().Store(dsn) as store:
        run_id = prepared.info.run_id
        _out(_render_summary(store.run(run_id), store.summary(run_id, top=5)))
        chrome.write_chrome_trace(
            out,
            store.run(run_id),
            store.threads(run_id),
            store.iter_spans(run_id),
            store.iter_counters(run_id),
        )
    _out(f"\nChrome trace: {out}  (open it in https://ui.perfetto.dev or chrome://tracing)")
    _out(
        f'Next: gpu-trace show {run_id} · gpu-trace sql "SELECT lane, count() FROM gpu_trace.spans GROUP BY lane"'
    )
    _load_samples(dsn)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if args.ui or (args.ui is None and interactive):
        return _serve_ui(dsn, "127.0.0.1", args.port, "forwarded-two-tenants", browser=interactive)
    _out("Dashboard: gpu-trace ui  (then open http://127.0.0.1:8050)")
    return 0


def _load_samples(dsn: str) -> None:
    """Ingest the repository's sample runs (sample_traces/runs) into the store; idempotent."""
    from gpu_trace.dashboard import samples

    store_mod = _store_module()
    try:
        with store_mod.Store(dsn) as store:
            reports = samples.load_samples(store)
    except store_mod.StoreError as exc:
        _err(f"sample traces not loaded: {exc}")
        return
    for report in reports:
        _err(f"sample run {report.run_id} loaded ({report.files_skipped} files already there)")


def cmd_ui(args: argparse.Namespace) -> int:
    return _serve_ui(config.store_dsn(args.store), args.host, args.port, args.run)


def _serve_ui(dsn: str, host: str, port: int, run: str | None, browser: bool = False) -> int:
    try:
        from gpu_trace.dashboard.app import Server
        from gpu_trace.dashboard.source import Source
    except ImportError as exc:
        raise CLIError(
            f"{exc} (the dashboard needs the ui extra: pip install 'gpu-trace[ui]')"
        ) from None
    source = Source(dsn, enforce_readonly=True)
    try:
        server = Server(source, host, port)
    except (OSError, OverflowError) as exc:
        raise CLIError(
            f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}", 2
        ) from None
    try:
        source.store()
    except _store_module().StoreError as exc:
        _err(f"the store is not usable yet ({exc}); the page says so and retries")
    if host not in ("127.0.0.1", "localhost", "::1"):
        _err(f"listening on {host}: anyone who can reach this port can read every run (no login)")
    url = server.url + "/" + (f"?run={run}" if run else "")
    _err(f"dashboard on {url} (store {dsn}); Ctrl-C stops")
    import threading

    from gpu_trace.dashboard.app import warm

    threading.Thread(target=warm, args=(source, run), name="gpu-trace-ui-warm", daemon=True).start()
    if browser:
        import webbrowser

        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        source.close()
    return 0


# ---- helpers ----------------------------------------------------------------------------------


def _store_module() -> Any:
    from gpu_trace.tracer import store

    return store


def _open_store(args: argparse.Namespace) -> Any:
    store_mod = _store_module()
    dsn = config.store_dsn(getattr(args, "store", None))
    try:
        return store_mod.Store(dsn)
    except store_mod.StoreError as exc:
        raise CLIError(f"cannot open store {dsn}: {exc}") from None


def _resolve(store: Any, ref: str) -> str:
    store_mod = _store_module()
    try:
        return store.resolve_run(ref)
    except store_mod.UnknownRunError as exc:
        raise CLIError(str(exc)) from None


def _wall_ns(run: dict) -> int | None:
    attrs = run.get("attrs") or {}
    try:
        return int(run["started_ns"]) - int(attrs["anchor_mono_ns"]) + int(attrs["anchor_wall_ns"])
    except (KeyError, ValueError, TypeError):
        return None


def _render_summary(run: dict, summary: dict) -> str:
    lines = []
    dur = (run.get("ended_ns") or 0) - (run.get("started_ns") or 0)
    lines.append(
        f"run {run['run_id']}  {run.get('status', '')}  {fmt.wall_time(_wall_ns(run))}  {fmt.duration(dur) if dur > 0 else ''}"
    )
    lines.append(f"command: {run.get('command', '')}")
    lines.append(f"trace id: {run.get('trace_id', '')}  hosts: {','.join(run.get('hosts') or [])}")
    for lane in summary.get("lanes", []):
        lines.append("")
        lines.append(
            f"{lane['lane']}  ({fmt.count(lane['count'])} spans, {fmt.duration(lane['total_ns'])} total)"
        )
        rows = [
            [
                _clip(r["name"], 48),
                fmt.count(r["count"]),
                fmt.duration(r["total_ns"]),
                fmt.duration(r["self_ns"]),
                fmt.duration(r["mean_ns"]),
                fmt.duration(r["max_ns"]),
            ]
            for r in lane["ranges"]
        ]
        lines.append(
            fmt.table(
                ["NAME", "COUNT", "TOTAL", "SELF", "MEAN", "MAX"], rows, right={1, 2, 3, 4, 5}
            )
        )
    counters = summary.get("counters") or []
    if counters:
        lines.append("")
        rows = [
            [
                c["source"],
                c["device"] or "-",
                c["metric"],
                fmt.count(c["count"]),
                f"{c['min']:.4g}",
                f"{c['mean']:.4g}",
                f"{c['max']:.4g}",
            ]
            for c in counters
        ]
        lines.append(
            fmt.table(
                ["SOURCE", "DEVICE", "METRIC", "SAMPLES", "MIN", "MEAN", "MAX"],
                rows,
                right={3, 4, 5, 6},
            )
        )
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _cell(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _out(text: str) -> None:
    print(text)


def _err(text: str) -> None:
    print(f"gpu-trace: {text}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="gpu-trace: %(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        _err(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
