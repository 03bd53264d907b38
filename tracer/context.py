"""W3C trace context for runs: where a run's trace id comes from and how it reaches others.

A run's trace id travels as a W3C ``traceparent`` (and optional ``tracestate``):

- in the environment of child processes, as ``TRACEPARENT`` / ``TRACESTATE`` (upper case, the
  convention for environment carriers): :func:`child_env`, read back by :func:`trace_id_from_env`;
- in the headers of forwarded calls, as ``traceparent`` / ``tracestate``: :func:`inject` and
  :func:`extract`.

Extraction and injection go through OpenTelemetry's ``TraceContextTextMapPropagator``, so we accept
and emit exactly what other OpenTelemetry services do. Malformed context is ignored, never raised.
:func:`trace_id_from_env` runs at every traced interpreter's start, where importing the
OpenTelemetry API would cost tens of milliseconds; it uses :func:`parse_traceparent`, which applies
the same rules as the propagator (a test keeps the two in step).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, MutableMapping
from typing import Any, NamedTuple

from gpu_trace.tracer.run import new_trace_id

log = logging.getLogger(__name__)

__all__ = [
    "TRACEPARENT",
    "TRACESTATE",
    "TraceParent",
    "child_env",
    "extract",
    "extract_tracestate",
    "format_traceparent",
    "inject",
    "new_trace_id",
    "parse_traceparent",
    "trace_id_from_env",
]

#: Header names; environment carriers use them upper-cased.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# The propagator's rules: lower-case hex only, version ff invalid, version 00 has no extra fields,
# later versions may append "-..." fields, surrounding blanks allowed, at most 512 characters.
_TRACEPARENT = re.compile(
    r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$"
)
_MAX_TRACEPARENT = 512


class TraceParent(NamedTuple):
    """The trace a carrier belongs to and the span (64-bit) its sender was in."""

    trace_id: str
    parent_span_id: int


def parse_traceparent(value: str | None) -> tuple[str, str] | None:
    """``(trace_id, parent_span_id)`` as hex from a ``traceparent`` value; None if malformed."""
    if not value or len(value) > _MAX_TRACEPARENT:
        return None
    m = _TRACEPARENT.match(value)
    if not m:
        return None
    version, trace_id, span_id = m.group(1), m.group(2), m.group(3)
    if version == "ff" or (version == "00" and m.group(5)):
        return None
    if not int(trace_id, 16) or not int(span_id, 16):
        return None
    return trace_id, span_id


def format_traceparent(trace_id: str, span_id: int, sampled: bool = True) -> str:
    """A version-00 ``traceparent`` value."""
    return f"00-{trace_id}-{span_id & 0xFFFFFFFFFFFFFFFF:016x}-{'01' if sampled else '00'}"


def trace_id_from_env() -> str | None:
    """The trace id of an incoming ``TRACEPARENT`` (malformed values are ignored)."""
    parsed = parse_traceparent(os.environ.get(TRACEPARENT.upper()))
    return parsed[0] if parsed else None


# ---- through OpenTelemetry's propagator ---------------------------------------------------------


class _Getter:
    """Reads ``traceparent``/``tracestate`` from a dict whatever the case of its keys."""

    def get(self, carrier: Mapping[str, Any], key: str) -> list[str] | None:
        value = carrier.get(key)
        if value is None:
            value = carrier.get(key.upper())
        if value is None:
            value = next(
                (v for k, v in carrier.items() if isinstance(k, str) and k.lower() == key), None
            )
        if value is None:
            return None
        if isinstance(value, str):
            return [value]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        return None

    def keys(self, carrier: Mapping[str, Any]) -> list[str]:
        return list(carrier.keys())


class _Setter:
    def __init__(self, upper: bool) -> None:
        self.upper = upper

    def set(self, carrier: MutableMapping[str, str], key: str, value: str) -> None:
        carrier[key.upper() if self.upper else key] = value


_propagator: Any = None


def _get_propagator() -> Any:
    global _propagator
    if _propagator is None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        _propagator = TraceContextTextMapPropagator()
    return _propagator


def _span_context(carrier: Mapping[str, Any] | None) -> Any:
    """The valid remote SpanContext in ``carrier``, or None. Never raises."""
    if not carrier:
        return None
    try:
        from opentelemetry import trace

        ctx = _get_propagator().extract(carrier, getter=_Getter())
        span_context = trace.get_current_span(ctx).get_span_context()
        return span_context if span_context.is_valid else None
    except Exception:  # malformed propagated context is ignored (STYLE.md 6)
        log.debug("gpu-trace: ignoring malformed trace context", exc_info=True)
        return None


def extract(carrier: Mapping[str, Any] | None) -> TraceParent | None:
    """The ``(trace_id, parent_span_id)`` a carrier holds, or None when absent or malformed.

    ``carrier`` is a dict of headers (``traceparent``) or an environment (``TRACEPARENT``).
    """
    span_context = _span_context(carrier)
    if span_context is None:
        return None
    return TraceParent(f"{span_context.trace_id:032x}", span_context.span_id)


def extract_tracestate(carrier: Mapping[str, Any] | None) -> str:
    """The carrier's ``tracestate``, normalised, if it has a valid ``traceparent``; else ``""``."""
    span_context = _span_context(carrier)
    if span_context is None or not span_context.trace_state:
        return ""
    header: str = span_context.trace_state.to_header()
    return header


def inject(
    carrier: MutableMapping[str, str],
    trace_id: str,
    span_id: int,
    *,
    sampled: bool = True,
    tracestate: str = "",
    env: bool = False,
) -> None:
    """Write ``traceparent`` (and ``tracestate`` if given) for ``span_id`` of ``trace_id``.

    Keys are lower case for message headers, upper case with ``env=True``. Invalid ids are a
    ``ValueError``: they come from our own code, not from outside.
    """
    from opentelemetry import trace
    from opentelemetry.trace.span import TraceState

    try:
        tid = int(trace_id, 16)
    except (TypeError, ValueError):
        tid = 0
    if len(trace_id or "") != 32 or not tid:
        raise ValueError(f"trace id must be 32 hex digits, not all zero: {trace_id!r}")
    if not 0 < span_id < 1 << 64:
        raise ValueError(f"span id must be a non-zero 64-bit integer: {span_id!r}")
    state = TraceState.from_header([tracestate]) if tracestate else None
    span_context = trace.SpanContext(
        trace_id=tid,
        span_id=span_id,
        is_remote=False,
        trace_flags=trace.TraceFlags(
            trace.TraceFlags.SAMPLED if sampled else trace.TraceFlags.DEFAULT
        ),
        trace_state=state,
    )
    ctx = trace.set_span_in_context(trace.NonRecordingSpan(span_context))
    _get_propagator().inject(carrier, context=ctx, setter=_Setter(upper=env))


def child_env(env: Mapping[str, str], trace_id: str, span_id: int) -> dict[str, str]:
    """A copy of ``env`` in which child processes join ``trace_id`` under ``span_id``.

    This is what `gpu-trace record` gives the program: ``TRACEPARENT`` carries the run's trace id
    (read back by :func:`trace_id_from_env` in every traced process). An incoming ``TRACESTATE``
    is passed through when the run continues the incoming trace, and dropped otherwise.
    """
    out = {
        k: v for k, v in env.items() if k.upper() not in (TRACEPARENT.upper(), TRACESTATE.upper())
    }
    incoming = extract(env)
    state = (
        extract_tracestate(env) if incoming is not None and incoming.trace_id == trace_id else ""
    )
    inject(out, trace_id, span_id, tracestate=state, env=True)
    return out
