"""A run's spans as OpenTelemetry (OTLP) spans, for a team's tracing backend.

Teams that run services already have a tracing backend (Jaeger, Tempo, Honeycomb, any
OpenTelemetry collector). This module turns a run's spans, as the store or the spool holds them,
into ``ExportTraceServiceRequest`` messages (opentelemetry-proto's generated classes, the ``otlp``
extra), so a forwarded GPU call shows up in the same trace as the request that caused it:

- every span keeps the run's W3C trace id and its own 64-bit span id (a span recorded without
  one, a server op, gets a stable id hashed from what it is);
- a span's parent is the one it names, else the innermost span enclosing it on its thread
  (:mod:`gpu_trace.query.nesting`: a step holds its ranges, a range its modules, a module its
  ops); only spans with neither hang under the run's root span;
- only the kinds asked for are sent (:data:`~gpu_trace.export.span_mapping.KINDS`; by default steps, forwarded batches, user
  ranges and top-level modules), and a sent span's parent is its nearest *sent* ancestor, so the
  tree stays whole at any depth; the server's spans of a forwarded call hang under the client's
  batch span as the store relates them (``parent_span_id`` across hosts);
- one synthesized root span stands for the run (its ``root_span_id`` from run.json, named after
  the run: its name, else its command); it is the child of the span that started the run when
  ``TRACEPARENT`` named one;
- times are Unix-epoch nanoseconds, from the run's anchor pair.

Spans come in start order from the store (``order="start"``: a span's enclosing span has come
before it) or about as they end from the spool (``order="end"``, the stream: a child before its
parent). :class:`SpanMapper` holds a span whose parent it has not seen until the parent comes or
:meth:`SpanMapper.finish`; in end order a span naming no parent also waits for a span that
encloses it, until :meth:`SpanMapper.release` gives up on it (it is top-level then). At most
:data:`~gpu_trace.export.span_mapping.MAX_HELD` spans wait (the mapping is
:mod:`gpu_trace.export.span_mapping`).

The transport is :mod:`gpu_trace.export.endpoint`; :class:`OtlpExporter` is the exporter seam's
OTLP exporter (``get_exporter("otlp", ...)``), used by ``gpu-trace export RUN --otlp URL``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import TYPE_CHECKING

import pyarrow as pa

from gpu_trace.export.exporter import ExportResult
from gpu_trace.export.span_mapping import (
    BATCH_SPANS,
    DEFAULT_KINDS,
    Row,
    RunFacts,
    SpanMapper,
    rows,
)
from gpu_trace.tracer.records import (
    SERVER,
)

if TYPE_CHECKING:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan

    from gpu_trace.export.endpoint import Endpoint

log = logging.getLogger(__name__)

# ---- requests -------------------------------------------------------------------------------------


def _version() -> str:
    try:
        return metadata.version("gpu-trace")
    except metadata.PackageNotFoundError:
        return ""


class RequestBuilder:
    """Groups mapped spans by process into one ``ExportTraceServiceRequest``.

    Resource attributes (OpenTelemetry semantic conventions where there is one): ``service.name``
    (``gpu-trace`` for the program's processes, ``gpu-trace serve`` for a forwarding server's),
    ``host.name``, ``process.pid``, ``process.command_line`` (the recorded command), and
    ``gpu_trace.run_id``, ``gpu_trace.gpus`` (the run's GPUs, ``gpu0=NAME,...``) when known.
    """

    def __init__(self, run: RunFacts) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
        from opentelemetry.proto.common.v1 import common_pb2
        from opentelemetry.proto.resource.v1 import resource_pb2
        from opentelemetry.proto.trace.v1 import trace_pb2

        self._service = trace_service_pb2
        self._common = common_pb2
        self._resource = resource_pb2
        self._trace = trace_pb2
        self.run = run
        self.version = _version()
        self.main_host = run.attrs.get("recorder_host", "")

    def request(self, spans: Iterable[tuple[Row, OtlpSpan]]) -> ExportTraceServiceRequest:
        groups: dict[tuple[str, int, bool], list[OtlpSpan]] = {}
        for row, span in spans:
            server = row.category == SERVER
            groups.setdefault((row.host or self.main_host, row.pid, server), []).append(span)
        req = self._service.ExportTraceServiceRequest()
        for (host, pid, server), group in groups.items():
            rs = req.resource_spans.add()
            self._fill_resource(rs.resource, host, pid, server)
            scope = rs.scope_spans.add(spans=group)
            scope.scope.name = "gpu-trace"
            scope.scope.version = self.version
        return req

    def _fill_resource(self, resource: object, host: str, pid: int, server: bool) -> None:
        run = self.run
        attrs: list[tuple[str, str | int]] = [
            ("service.name", "gpu-trace serve" if server else "gpu-trace"),
            ("gpu_trace.run_id", run.run_id),
        ]
        if host:
            attrs.append(("host.name", host))
        if pid:
            attrs.append(("process.pid", pid))
        if not server and run.command:
            attrs.append(("process.command_line", run.command))
        if not server and run.attrs.get("gpus"):
            attrs.append(("gpu_trace.gpus", run.attrs["gpus"]))
        if server and run.attrs.get("remote"):
            attrs.append(("server.address", run.attrs["remote"]))
        kv = resource.attributes  # type: ignore[attr-defined]
        for key, value in attrs:
            item = kv.add(key=key)
            if isinstance(value, int):
                item.value.int_value = value
            else:
                item.value.string_value = value


# ---- the exporter ---------------------------------------------------------------------------------


class OtlpExporter:
    """The exporter seam's OTLP exporter: ``export(batch)``, ``force_flush``, ``shutdown``.

    Spans are mapped as they come, sent :data:`BATCH_SPANS` to a request; ``shutdown`` sends what
    is held and the run's root span. A failed request stops it: ``error`` says why, ``stats``
    counts what went (``sent``, ``requests``).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        run: Mapping[str, object],
        kinds: frozenset[str] = DEFAULT_KINDS,
        batch_spans: int = BATCH_SPANS,
    ) -> None:
        if batch_spans < 1:
            raise ValueError(f"batch_spans must be positive, got {batch_spans}")
        facts = RunFacts.of(run)
        self.endpoint = endpoint
        self.mapper = SpanMapper(facts, kinds)
        self.builder = RequestBuilder(facts)
        self.batch_spans = batch_spans
        self.error: str | None = None
        self.stats = {"sent": 0, "requests": 0}
        self._pending: list[tuple[Row, OtlpSpan]] = []
        self._closed = False

    def export(self, batch: pa.Table) -> ExportResult:
        if self._closed or self.error is not None:
            return ExportResult.FAILURE
        try:
            self._pending.extend(self.mapper.add(rows(batch)))
        except ValueError as exc:
            self.error = str(exc)
            return ExportResult.FAILURE
        while len(self._pending) >= self.batch_spans:
            if not self._send(self.batch_spans):
                return ExportResult.FAILURE
        return ExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        while self._pending and self.error is None:
            self._send(self.batch_spans)
        return self.error is None

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.error is None:
            self._pending.extend(self.mapper.finish())
            self._pending.append(self.mapper.root_span())
            self.force_flush()
        self.endpoint.close()

    def _send(self, n: int) -> bool:
        chunk, self._pending = self._pending[:n], self._pending[n:]
        problem = self.endpoint.send(self.builder.request(chunk))
        if problem is not None:
            self.error = problem
            return False
        self.stats["sent"] += len(chunk)
        self.stats["requests"] += 1
        return True
