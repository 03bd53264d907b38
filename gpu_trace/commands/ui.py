"""`gpu-trace ui` and `gpu-trace demo`: the web timeline on a store, and on the sample runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gpu_trace import _format as fmt
from gpu_trace.commands import CLIError, echo, err
from gpu_trace.commands.record import NOT_STORED, finish_run
from gpu_trace.commands.runs import checked_dsn, render_summary, store_module
from gpu_trace.query import reads

#: The sample run the demo's dashboard opens on: a real GPU run (an H100 training a GPT-style
#: model, module ranges, real NVML counters; sample_traces/README.md).
H100_RUN = "20261124-174647-9ad8eb"
#: The same program recorded at ``--torch op`` (a packed sample, see dashboard/samples.py).
H100_OP_RUN = "20261124-174702-6a22f9"


def cmd_demo(args: argparse.Namespace) -> int:
    from gpu_trace import launch
    from gpu_trace.export.exporter import export_run, get_exporter
    from gpu_trace.store.embedded import check_writable

    workload = Path(__file__).resolve().parents[1] / "_demo_workload.py"
    dsn = checked_dsn(args.store)
    _check_port(args.port)
    problem = check_writable(dsn)
    if problem:
        raise CLIError(f"store {dsn} is not usable: {problem}", 2)
    # Without NVML the demo plays back a real H100 recording from the repository, if present.
    sample = Path(__file__).resolve().parents[2] / "sample_traces" / "nvml-h100.jsonl"
    try:  # a bad setting, a full disk: one line, as `record` says it
        prepared = launch.prepare(
            [sys.executable, str(workload)], nvml_fallback=sample if sample.is_file() else None
        )
        for note in prepared.notes:
            err(note)
        code = launch.run(prepared)
    except launch.LaunchError as exc:
        raise CLIError(str(exc), exc.exit_code) from None
    stored = finish_run(prepared.run_dir, dsn, ingest=True, save_error=prepared.save_error)
    if code != 0:
        raise CLIError(f"the demo workload failed with status {code}")
    if not stored:
        raise CLIError("the demo's run could not be stored (above)", NOT_STORED)
    out = args.output or prepared.run_dir / "trace.json.gz"
    with store_module().Store(dsn) as store:
        run_id = prepared.info.run_id
        echo(render_summary(reads.run(store, run_id), reads.summary(store, run_id, top=5)))
        exporter = get_exporter(
            "chrome", path=out, run=reads.run(store, run_id), threads=reads.threads(store, run_id)
        )
        if not export_run(
            exporter, reads.iter_spans(store, run_id), reads.iter_counters(store, run_id)
        ):
            raise CLIError(f"cannot write {out}: {getattr(exporter, 'error', None)}")
    echo(f"\nChrome trace: {out}  (open it in https://ui.perfetto.dev or chrome://tracing)")
    echo(
        f'Next: gpu-trace show {run_id} · gpu-trace sql "SELECT lane, count() FROM gpu_trace.spans GROUP BY lane"'
    )
    _load_samples(dsn)
    kernels = _import_trace_samples(dsn)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    if args.ui or (args.ui is None and interactive):
        if kernels:
            echo(_kernel_view_line(kernels, "the dashboard below opens on it"))
        return _serve_ui(dsn, "127.0.0.1", args.port, kernels or H100_RUN, browser=interactive)
    echo(
        f"Dashboard: gpu-trace ui  (then open http://127.0.0.1:8050/?run={H100_RUN}: a real H100"
        f" training run; ?run={H100_OP_RUN}: the same at op level;"
        " ?run=forwarded-two-tenants: two tenants sharing one device)"
    )
    if kernels:
        echo(
            _kernel_view_line(kernels, f"http://127.0.0.1:8050/?run={kernels} (after gpu-trace ui)")
        )
    return 0


def _kernel_view_line(run_id: str, where: str) -> str:
    """The line that points at the imported H100 profiler trace: the product's GPU kernel view."""
    return (
        f"GPU kernels: {where}: the H100 PyTorch profiler trace, each kernel and memcpy on its"
        f" GPU stream under the CPU call that launched it; gpu-trace show {run_id}: its kernel"
        " table"
    )


def _import_trace_samples(dsn: str) -> str | None:
    """Import the sample PyTorch profiler trace (dashboard/samples.py); the run id of the first
    sample trace (imported now or before), None if there is none or it failed (said why)."""
    from gpu_trace._progress import PhaseProgress
    from gpu_trace.dashboard import samples
    from gpu_trace.store.trace_file import TraceImportError

    store_mod = store_module()
    progress = PhaseProgress(sys.stderr, prefix="demo: importing the H100 trace")
    try:
        with store_mod.Store(dsn) as store:
            reports = samples.import_samples(store, progress=progress)
    except (TraceImportError, store_mod.StoreError) as exc:
        progress.close()
        err(f"sample trace not imported: {exc}")
        return None
    progress.close()
    for report in reports:
        if report.existing:
            err(f"sample trace already imported as run {report.run_id}")
        else:
            err(f"sample trace imported: {report.summary()}")
    return reports[0].run_id if reports else None


def _load_samples(dsn: str) -> None:
    """Ingest the repository's sample runs (sample_traces/runs) into the store; idempotent."""
    from gpu_trace.dashboard import samples

    store_mod = store_module()
    try:
        with store_mod.Store(dsn) as store:
            reports = samples.load_samples(store, packed=True)
    except store_mod.StoreError as exc:
        err(f"sample traces not loaded: {exc}")
        return
    for report in reports:
        if not report.files_ingested:
            err(f"sample run {report.run_id} already loaded")
            continue
        there = f"; {report.files_skipped} already there" if report.files_skipped else ""
        err(
            f"sample run {report.run_id} loaded ({fmt.counted(report.files_ingested, 'file')}{there})"
        )


def cmd_ui(args: argparse.Namespace) -> int:
    _check_port(args.port)
    return _serve_ui(checked_dsn(args.store), args.host, args.port, args.run)


def _check_port(port: int) -> None:
    """A TCP port is 0-65535 (0 picks a free one); anything else would be wrapped or refused
    by the socket layer, serving somewhere the user did not ask for."""
    if not 0 <= port <= 65535:
        raise CLIError(f"--port must be 0-65535 (0 picks a free port), got {port}", 2)


def _serve_ui(dsn: str, host: str, port: int, run: str | None, browser: bool = False) -> int:
    try:
        from gpu_trace.dashboard.app import Server
        from gpu_trace.dashboard.readonly_store import ReadOnlyStore
    except ImportError as exc:
        raise CLIError(
            f"{exc} (the dashboard needs the ui extra: pip install 'gpu-trace[ui]')"
        ) from None
    # A request waits for a store another process holds (record's ingest, ls, import...) as
    # long as a command would; the dashboard gives an embedded store up to any of them.
    source = ReadOnlyStore(dsn, enforce_readonly=True, lock_timeout_s=10.0)
    try:
        server = Server(source, host, port)
    except (OSError, OverflowError) as exc:
        raise CLIError(
            f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}", 2
        ) from None
    try:
        source.store(timeout_s=2.0)
    except store_module().StoreError as exc:
        err(f"the store is not usable yet ({exc}); the page says so and retries")
    if host not in ("127.0.0.1", "localhost", "::1"):
        err(f"listening on {host}: anyone who can reach this port can read every run (no login)")
    url = server.url + "/" + (f"?run={run}" if run else "")
    err(f"dashboard on {url} (store {dsn}); Ctrl-C stops")
    server.app.warmer.want(run, zoom=True)  # the run the page opens on, read ahead
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
