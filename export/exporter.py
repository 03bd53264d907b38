"""The exporter plugin contract: ``export(batch)``, ``force_flush(timeout_millis)``, ``shutdown()``.

An exporter receives spans as Arrow tables, in ``start_ns`` order, one table per call, and writes
them somewhere (a Chrome trace file, an OTLP endpoint, a list in memory). Exporters are found by
name through the entry point group ``gpu_trace.exporters``::

    exporter = get_exporter("chrome", path="trace.json", run=run, threads=threads)
    ok = export_run(exporter, reads.iter_spans(store, run_id), reads.iter_counters(store, run_id))

Every export in gpu-trace (``gpu-trace export``, ``gpu-trace demo``, the dashboard's) goes through
:func:`get_exporter` and :func:`export_run`, the one boundary where an exporter's exception is
logged and turned into a failed result, never raised (OpenTelemetry's
``SimpleSpanProcessor.on_end``). An exporter that also writes counter samples implements
:class:`CounterExporter`.

A batch is a :class:`pyarrow.Table` with the columns of :data:`SPAN_BATCH_SCHEMA` (what
``Store.iter_spans`` yields). String columns may be plain or dictionary-encoded; ``attrs`` may be a
map or a list of ``{key, value}`` structs. Extra columns are ignored. Like OpenTelemetry's
``SpanExporter``, ``export`` reports failure with its return value and never raises: one boundary
catches and logs.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from gpu_trace.tracer.records import ATTRS

log = logging.getLogger(__name__)

#: The entry point group exporters register under (see ``pyproject.toml``).
ENTRY_POINT_GROUP = "gpu_trace.exporters"

#: Columns of a span batch, as the store returns them. ``attrs`` values are strings.
SPAN_BATCH_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("trace_id", pa.string()),
        ("host", pa.string()),
        ("span_id", pa.uint64()),
        ("parent_span_id", pa.uint64()),
        ("pid", pa.uint32()),
        ("tid", pa.uint64()),
        ("lane", pa.string()),
        ("category", pa.string()),
        ("name", pa.string()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("depth", pa.uint16()),
        ("attrs", ATTRS),
    ]
)

#: Columns an exporter may rely on; ``run_id``, ``trace_id`` and ``depth`` are optional.
REQUIRED_COLUMNS = (
    "host",
    "span_id",
    "parent_span_id",
    "pid",
    "tid",
    "lane",
    "category",
    "name",
    "start_ns",
    "end_ns",
    "attrs",
)


class ExportResult(enum.Enum):
    SUCCESS = 0
    FAILURE = 1


@runtime_checkable
class Exporter(Protocol):
    """What every exporter implements (STYLE.md 5)."""

    def export(self, batch: pa.Table) -> ExportResult:
        """Write one batch of spans; never raises."""

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Push out whatever is buffered; True when everything was written in time."""

    def shutdown(self) -> None:
        """Flush and release resources; later ``export`` calls fail. Idempotent."""


@runtime_checkable
class CounterExporter(Exporter, Protocol):
    """An exporter that also takes counter samples (``host, device, metric, ts_ns, value``)."""

    def export_counters(self, batch: pa.Table) -> ExportResult:
        """Write one batch of counter samples; never raises."""


def export_run(
    exporter: Exporter,
    span_batches: Iterable[pa.Table],
    counter_batches: Iterable[pa.Table] = (),
) -> bool:
    """Every span batch, then every counter batch (when the exporter takes counters), then
    ``shutdown()``; True when every batch was exported.

    The exporter is the boundary: an exception from it is logged and counts as a failure, and the
    export stops there (the exporter is still shut down, so a file it writes is finished with what
    it got). Errors of the batches' source (a store that fails mid-way) propagate after the
    shutdown, as they are the caller's to report.
    """
    try:
        ok = _feed(exporter, span_batches, counter_batches)
    finally:
        closed = _exported(lambda _: exporter.shutdown(), None, "shut down")
    return ok and closed


def _feed(
    exporter: Exporter, span_batches: Iterable[pa.Table], counter_batches: Iterable[pa.Table]
) -> bool:
    for batch in span_batches:
        if not _exported(exporter.export, batch, "export spans"):
            return False
    if isinstance(exporter, CounterExporter):
        for batch in counter_batches:
            if not _exported(exporter.export_counters, batch, "export counters"):
                return False
    return True


def _exported(call: Callable[[Any], object], batch: Any, what: str) -> bool:
    """``call(batch)`` at the boundary: True on success (``shutdown``'s None counts as one)."""
    try:
        return call(batch) in (ExportResult.SUCCESS, None)
    except Exception:
        log.exception("gpu-trace: an exporter failed to %s; the export stops", what)
        return False


def check_batch(batch: pa.Table) -> None:
    """Raise ``ValueError`` naming the columns a span batch lacks."""
    if not isinstance(batch, (pa.Table, pa.RecordBatch)):
        raise ValueError(f"a span batch is a pyarrow Table, got {type(batch).__name__}")
    missing = [c for c in REQUIRED_COLUMNS if c not in batch.column_names]
    if missing:
        raise ValueError(f"span batch lacks columns {', '.join(missing)}")


class InMemoryExporter:
    """Keeps every batch it is given; for tests."""

    def __init__(self) -> None:
        self.batches: list[pa.Table] = []
        self.flushes = 0
        self.is_shutdown = False

    def export(self, batch: pa.Table) -> ExportResult:
        if self.is_shutdown:
            return ExportResult.FAILURE
        try:
            check_batch(batch)
        except ValueError:
            log.exception("gpu-trace: in-memory exporter got a malformed batch")
            return ExportResult.FAILURE
        self.batches.append(pa.table(batch) if isinstance(batch, pa.RecordBatch) else batch)
        return ExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.flushes += 1
        return True

    def shutdown(self) -> None:
        self.is_shutdown = True

    def spans(self) -> pa.Table:
        """Every batch exported so far as one table (empty with no columns if none)."""
        if not self.batches:
            return pa.table({})
        return pa.concat_tables(self.batches, promote_options="default")

    def clear(self) -> None:
        self.batches.clear()


def available_exporters() -> dict[str, EntryPoint]:
    """Registered exporters by name."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def get_exporter(name: str, **kwargs: Any) -> Exporter:
    """Construct the exporter registered as ``name`` with ``kwargs``.

    Raises ``ValueError`` for an unknown name, listing the registered ones.
    """
    found = available_exporters()
    if name not in found:
        known = ", ".join(sorted(found)) or "none (is gpu-trace installed?)"
        raise ValueError(f"unknown exporter {name!r}; available: {known}")
    factory = found[name].load()
    exporter: Exporter = factory(**kwargs)
    return exporter
