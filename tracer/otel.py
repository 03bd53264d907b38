"""The program's own OpenTelemetry spans, recorded into the run.

When `gpu-trace record` runs a program that uses the OpenTelemetry SDK, every ``TracerProvider`` it
creates gets a :class:`GpuTraceSpanProcessor`: each finished SDK span becomes one of our spans on
the lane ``otel/<instrumentation scope>``, category ``otel``, beside the NVTX ranges of the same
threads. The patch is installed by a post-import hook (``gpu_trace._imports``) registered when
recording starts, so a program that never imports ``opentelemetry.sdk.trace`` never loads it.

Times: OpenTelemetry stamps spans with ``time.time_ns()`` (wall clock); the recorder uses
CLOCK_MONOTONIC. The processor maps one onto the other with an anchor (a simultaneous reading of
both clocks, :func:`gpu_trace.tracer.clock.anchor`) and takes a new anchor if the wall clock is
stepped.

Identity: a span keeps its OpenTelemetry span id (64-bit) as our ``span_id`` and its parent's as
``parent_span_id``; the OpenTelemetry trace id goes into ``attrs["otel.trace_id"]``. When
``TRACEPARENT`` is in the environment (what `gpu-trace record` gives the program and its children),
providers created without an ``id_generator`` of their own start their root spans in the run's
trace, so the program's spans exported elsewhere (OTLP) join the same trace as the run. Every
root span of the process then shares that one trace id; a provider given its own
``id_generator`` keeps it.

Nothing here raises into the program (the ``SpanProcessor`` contract): failures are logged once.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
import weakref
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

from gpu_trace.tracer import context as trace_context
from gpu_trace.tracer import recorder as _recorder
from gpu_trace.tracer.clock import Anchor, anchor, now_ns
from gpu_trace.tracer.failure import WarnOnce
from gpu_trace.tracer.records import OTEL

log = logging.getLogger(__name__)

__all__ = ["GpuTraceSpanProcessor", "RunTraceIdGenerator", "install", "installed", "uninstall"]

#: A wall clock that disagrees with the anchor by more than this has been stepped: re-anchor.
STEP_NS = 1_000_000
#: Open spans whose depth is remembered; beyond it (spans never ended) new ones get depth 0.
MAX_OPEN_SPANS = 1 << 16


def _lane(span: ReadableSpan) -> str:
    scope = span.instrumentation_scope
    return f"otel/{(scope.name if scope is not None else '') or 'default'}"


def _value(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return json.dumps(list(value), default=str)
    return str(value)


class GpuTraceSpanProcessor(SpanProcessor):
    """Appends every finished span to the active recorder's buffer of the ending thread.

    With no active recorder it does nothing. It neither blocks nor raises.
    """

    def __init__(self) -> None:
        self._anchor: Anchor = anchor()
        self._depth: dict[int, int] = {}
        self._warn_once = WarnOnce(
            log, "gpu-trace: recording an OpenTelemetry %s failed; the program goes on"
        )

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if _recorder.active is None:
            return
        try:
            parent = span.parent
            depth = 0
            if parent is not None and not parent.is_remote:
                depth = self._depth.get(parent.span_id, -1) + 1
            if len(self._depth) < MAX_OPEN_SPANS:
                self._depth[span.context.span_id] = depth
        except Exception:
            self._warn_once("span")

    def on_end(self, span: ReadableSpan) -> None:
        rec = _recorder.active
        sc = span.context
        depth = self._depth.pop(sc.span_id, 0) if sc is not None else 0
        if rec is None or sc is None:
            return
        try:
            a = self._current_anchor()
            start_wall = span.start_time or 0
            end_wall = span.end_time or start_wall
            start = start_wall - a.wall_ns + a.mono_ns
            end = end_wall - a.wall_ns + a.mono_ns
            parent = span.parent
            attrs = {str(k): _value(v) for k, v in (span.attributes or {}).items()}
            attrs["otel.trace_id"] = f"{sc.trace_id:032x}"
            status = span.status
            attrs["otel.status"] = status.status_code.name
            if status.description:
                attrs["otel.status_description"] = status.description
            if span.kind is not trace_api.SpanKind.INTERNAL:
                attrs["otel.kind"] = span.kind.name
            if parent is not None and parent.is_remote:
                attrs["otel.parent_remote"] = "true"
            for event in span.events:
                if event.name == "exception" and event.attributes:
                    attrs.setdefault(
                        "exception.type", _value(event.attributes.get("exception.type", ""))
                    )
                    attrs.setdefault(
                        "exception.message", _value(event.attributes.get("exception.message", ""))
                    )
            rec.buffer().add_span(
                (
                    sc.span_id,
                    parent.span_id if parent is not None else 0,
                    _lane(span),
                    OTEL,
                    span.name,
                    start,
                    max(start, end),
                    depth,
                    attrs,
                )
            )
        except Exception:
            self._warn_once("span")

    def _current_anchor(self) -> Anchor:
        a = self._anchor
        mono, wall = now_ns(), time.time_ns()
        if abs((wall - a.wall_ns) - (mono - a.mono_ns)) > STEP_NS:
            a = self._anchor = anchor()
        return a

    def shutdown(self) -> None:
        self._depth.clear()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class RunTraceIdGenerator(RandomIdGenerator):
    """Random span ids; every new root span gets the run's trace id."""

    def __init__(self, trace_id: str) -> None:
        value = int(trace_id, 16)
        if len(trace_id) != 32 or not value:
            raise ValueError(f"trace id must be 32 hex digits, not all zero: {trace_id!r}")
        self.trace_id = value

    def generate_trace_id(self) -> int:
        return self.trace_id


# ---- installing into every TracerProvider --------------------------------------------------------

_lock = threading.Lock()
_patched: tuple[type, Any, Any] | None = None  # (class, original __init__, our wrapper)
_providers: weakref.WeakSet[Any] = weakref.WeakSet()


def _attach(provider: Any) -> None:
    try:
        processor = GpuTraceSpanProcessor()
        provider.add_span_processor(processor)
        _providers.add(provider)
    except Exception:
        log.exception("gpu-trace: could not add the span processor to %r", provider)


def _detach(provider: Any) -> None:
    # The SDK has no remove_span_processor; both multi-processors keep a tuple under a lock.
    multi = getattr(provider, "_active_span_processor", None)
    if multi is None or not hasattr(multi, "_span_processors"):
        return
    with multi._lock:
        multi._span_processors = tuple(
            p for p in multi._span_processors if not isinstance(p, GpuTraceSpanProcessor)
        )


def _has_processor(provider: Any) -> bool:
    multi = getattr(provider, "_active_span_processor", None)
    return any(isinstance(p, GpuTraceSpanProcessor) for p in getattr(multi, "_span_processors", ()))


def install(module: object = None) -> None:
    """Give every ``TracerProvider`` created from now on (and a global one already set) our processor.

    Idempotent: an earlier install is undone first. ``module`` is accepted (and ignored) so this
    can be a post-import hook. Never raises.
    """
    global _patched
    try:
        uninstall()
        cls = sdk_trace.TracerProvider
        original = cls.__init__

        @functools.wraps(original)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if _patched is None or _patched[2] is not __init__:  # uninstalled under someone's patch
                original(self, *args, **kwargs)
                return
            if len(args) < 5 and kwargs.get("id_generator") is None:
                try:
                    trace_id = trace_context.trace_id_from_env()
                    if trace_id:
                        kwargs["id_generator"] = RunTraceIdGenerator(trace_id)
                except Exception:
                    log.exception("gpu-trace: root spans keep their own trace ids")
            original(self, *args, **kwargs)
            _attach(self)

        with _lock:
            cls.__init__ = __init__  # type: ignore[method-assign]
            _patched = (cls, original, __init__)
        # A provider the program set before the SDK hook ran (possible when recording started late).
        current = getattr(trace_api, "_TRACER_PROVIDER", None)
        if isinstance(current, cls) and not _has_processor(current):
            _attach(current)
    except Exception:
        log.exception("gpu-trace: OpenTelemetry spans will not be recorded")


def uninstall() -> None:
    """Undo :func:`install`: restore ``TracerProvider.__init__`` and remove our processors."""
    global _patched
    with _lock:
        patched, _patched = _patched, None
    if patched is not None:
        cls, original, wrapper = patched
        if cls.__dict__.get("__init__") is wrapper:
            cls.__init__ = original  # type: ignore[misc]
        else:  # someone patched over us: leave theirs, ours is now a pass-through
            log.debug("gpu-trace: TracerProvider.__init__ was re-patched; leaving it")
    for provider in list(_providers):
        try:
            _detach(provider)
        except Exception:
            log.exception("gpu-trace: could not remove the span processor from %r", provider)
    _providers.clear()


def installed() -> bool:
    """Whether :func:`install` is in effect (for leak checks)."""
    return _patched is not None
