"""W3C trace context for runs: where a run's trace id comes from and how it reaches children."""

from __future__ import annotations

import os
import re

from gpu_trace.tracer.run import new_trace_id

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

__all__ = ["new_trace_id", "parse_traceparent", "trace_id_from_env", "format_traceparent"]


def parse_traceparent(value: str | None) -> tuple[str, str] | None:
    """``(trace_id, parent_span_id)`` from a ``traceparent`` header; None if malformed."""
    if not value:
        return None
    m = _TRACEPARENT.match(value.strip().lower())
    if not m or m.group(1) == "ff" or not int(m.group(2), 16) or not int(m.group(3), 16):
        return None
    return m.group(2), m.group(3)


def format_traceparent(trace_id: str, span_id: int, sampled: bool = True) -> str:
    return f"00-{trace_id}-{span_id & 0xFFFFFFFFFFFFFFFF:016x}-{'01' if sampled else '00'}"


def trace_id_from_env() -> str | None:
    """The trace id of an incoming ``TRACEPARENT`` (malformed values are ignored)."""
    parsed = parse_traceparent(os.environ.get("TRACEPARENT"))
    return parsed[0] if parsed else None
