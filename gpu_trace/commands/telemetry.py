"""OpenTelemetry out: the ``--otlp`` options of `gpu-trace export` and `gpu-trace record`.

`export RUN --otlp URL` sends a stored run's spans to a collector; `record --otlp URL -- CMD`
streams them while the program runs, from the record process (docs/otlp.md). The mapping, the
transport and the stream live in ``tracer/`` (``otlp.py``, ``endpoint.py``, ``streaming.py``);
this module turns the flags into them and prints the one closing line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from gpu_trace import _format as fmt
from gpu_trace.commands import CLIError, err
from gpu_trace.query import reads

if TYPE_CHECKING:
    from gpu_trace.export.endpoint import Collector, Target
    from gpu_trace.export.streaming import RunStream
    from gpu_trace.store.client import Store


def add_arguments(p: argparse.ArgumentParser, *, streaming: bool) -> None:
    """``--otlp [URL]``, ``--otlp-spans KINDS``, ``--otlp-header K=V`` on a subcommand."""
    what = "stream the run's spans while it runs" if streaming else "send the run's spans"
    p.add_argument(
        "--otlp",
        nargs="?",
        const="",
        metavar="URL",
        help=f"{what} to an OpenTelemetry collector: http(s)://HOST:PORT[/PATH] (OTLP/HTTP "
        "protobuf; /v1/traces when no path) or grpc://HOST:PORT; no URL: "
        "OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT (docs/otlp.md)",
    )
    p.add_argument(
        "--otlp-spans",
        default="default",
        metavar="KINDS",
        help="with --otlp: which spans, comma-separated: steps, forward, ranges, modules, "
        "submodules, ops, kernels, otel, other; default (steps,forward,ranges,modules) or all",
    )
    p.add_argument(
        "--otlp-header",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --otlp: a header for every request (repeatable; adds to "
        "OTEL_EXPORTER_OTLP_HEADERS)",
    )


def wanted(args: argparse.Namespace) -> bool:
    return getattr(args, "otlp", None) is not None


def _collector(args: argparse.Namespace) -> tuple[Collector, Target, frozenset[str]]:
    from gpu_trace.export.endpoint import Collector, from_settings
    from gpu_trace.export.span_mapping import parse_kinds

    try:
        kinds = parse_kinds(args.otlp_spans)
        target, headers = from_settings(args.otlp, args.otlp_header)
    except ValueError as exc:
        raise CLIError(str(exc), 2) from None
    return Collector(target, headers), target, kinds


def check(args: argparse.Namespace) -> None:
    """Refuse bad ``--otlp`` flags before anything runs (exit 2). A namespace built without
    them (a caller of the command functions) has none."""
    if wanted(args):
        _collector(args)
    elif getattr(args, "otlp_header", None) or getattr(args, "otlp_spans", "default") != "default":
        raise CLIError("--otlp-spans and --otlp-header need --otlp", 2)


def export(args: argparse.Namespace, store: Store, run_id: str) -> int:
    """`gpu-trace export RUN --otlp URL`: every selected span of a stored run, then its root."""
    from gpu_trace.export.exporter import export_run
    from gpu_trace.export.otlp import OtlpExporter

    collector, target, kinds = _collector(args)
    run = reads.run(store, run_id)
    exporter = OtlpExporter(collector, run, kinds)
    # The last requests go at shutdown, whose failure export_run cannot see: the exporter's error.
    ok = export_run(exporter, reads.iter_spans(store, run_id)) and exporter.error is None
    sent = exporter.stats["sent"]
    if not ok:
        reason = exporter.error or "the exporter failed"
        raise CLIError(
            f"OTLP export of {run_id} to {target.display()} failed after {fmt.count(sent)} spans: "
            f"{reason}"
        )
    err(
        f"sent {fmt.count(sent)} spans of run {run_id} (trace {run['trace_id']}) to "
        f"{target.display()} in {fmt.counted(exporter.stats['requests'], 'request')}"
    )
    return 0


def start_stream(args: argparse.Namespace, run_dir: Path) -> RunStream | None:
    """`record --otlp`: a stream that follows the run's spool, or None without ``--otlp``.

    A stream that cannot start is reported and the program runs anyway (a recording is never
    refused over its OTLP copy once the flags were good).
    """
    if not wanted(args):
        return None
    from gpu_trace.export.streaming import RunStream

    collector, target, kinds = _collector(args)
    try:
        return RunStream(run_dir, collector, kinds, target=target.display()).start()
    except Exception as exc:
        err(f"OTLP streaming is off: {exc}")
        return None


def finish_stream(stream: RunStream | None) -> None:
    """Send the rest and print one line: spans sent and dropped."""
    if stream is None:
        return
    report = stream.close()
    text = f"OTLP {stream.target}: {fmt.count(report.sent)} spans sent, {fmt.count(report.dropped)} dropped"
    err(f"{text} ({report.error})" if report.error else text)
