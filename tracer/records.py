"""The plain record types every layer shares: spans, counters and clock-sync samples.

In memory a record is a tuple laid out as :class:`Span` or :class:`Counter` (the hot path appends
tuples through ``buffer.py``); on disk and between layers it is a row of an Arrow table with one of
the schemas below, built in one place, ``columns.py``. The store adds
``run_id``, ``trace_id`` and ``host`` from the spool file's metadata at ingest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

# Categories of spans (docs/schema.md, the `spans` table's `category`).
NVTX = "nvtx"
OP = "op"
MODULE = "module"
FORWARD = "forward"
SERVER = "server"
KERNEL = "kernel"
MEMCPY = "memcpy"
MEMSET = "memset"
CUDA_API = "cuda_api"  # a CUDA runtime or driver call (collectors/gpu_activity)
CUDA_SYNC = "cuda_sync"  # a CUPTI synchronization record: the CPU waiting on the GPU
STEP = "step"
MARK = "mark"
OTEL = "otel"  # the program's own OpenTelemetry spans (tracer/otel.py)
COLLECTIVE = "collective"  # a c10d collective call or its backend's work (torch/collectives.py)
CATEGORIES = (
    NVTX,
    OP,
    MODULE,
    FORWARD,
    SERVER,
    KERNEL,
    MEMCPY,
    MEMSET,
    CUDA_API,
    CUDA_SYNC,
    STEP,
    MARK,
    OTEL,
    COLLECTIVE,
)

#: Lane of `gpu_trace.range` and `gpu_trace.mark`: they are NVTX ranges in the domain "gpu_trace".
API_DOMAIN = "gpu_trace"
STEP_LANE = "steps"


def nvtx_lane(domain: str | None) -> str:
    """The lane of an NVTX range: ``nvtx/<domain>``, ``nvtx/default`` for the default domain."""
    return f"nvtx/{domain or 'default'}"


ATTRS = pa.map_(pa.string(), pa.string())
#: Low-cardinality strings (lane, category, name, metric) are dictionary-encoded in spool files.
NAME = pa.dictionary(pa.int32(), pa.string())

SPAN_SCHEMA = pa.schema(
    [
        ("span_id", pa.uint64()),
        ("parent_span_id", pa.uint64()),
        ("pid", pa.uint32()),
        ("tid", pa.uint64()),
        ("lane", NAME),
        ("category", NAME),
        ("name", NAME),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("depth", pa.uint16()),
        ("attrs", ATTRS),
    ]
)

COUNTER_SCHEMA = pa.schema(
    [
        ("source", NAME),
        ("device", NAME),
        ("metric", NAME),
        ("ts_ns", pa.int64()),
        ("value", pa.float64()),
        ("labels", ATTRS),
    ]
)

CLOCK_SYNC_SCHEMA = pa.schema(
    [
        ("peer", NAME),
        ("ts_ns", pa.int64()),
        ("offset_ns", pa.int64()),
        ("rtt_ns", pa.int64()),
        ("uncertainty_ns", pa.int64()),
    ]
)

#: Spool kinds: the file name prefix and the schema of each.
SCHEMAS: dict[str, pa.Schema] = {
    "spans": SPAN_SCHEMA,
    "counters": COUNTER_SCHEMA,
    "clock_sync": CLOCK_SYNC_SCHEMA,
}


class Span(NamedTuple):
    """One span as every producer records it: the layout of the per-thread buffer.

    The hot path appends a plain tuple in this order (building a ``Span`` costs more than the
    append itself); ``Span(*t)`` names its fields, and ``SPAN_FIELDS`` is the order that
    ``tracer/_fastpath.c`` mirrors in its ``SPAN_*`` indices (a test holds them together). ``pid``
    and ``tid`` are not in the record: the buffer is one thread's of one process, and
    :func:`gpu_trace.tracer.columns.span_table` adds them for a whole batch.
    """

    span_id: int
    parent_span_id: int
    lane: str
    category: str
    name: str
    start_ns: int
    end_ns: int
    depth: int
    attrs: dict[str, str] | None


#: Field order of a span record (see :class:`Span`).
SPAN_FIELDS = Span._fields


class Counter(NamedTuple):
    source: str
    device: str
    metric: str
    ts_ns: int
    value: float
    labels: dict[str, str] | None


class ClockSample(NamedTuple):
    peer: str
    ts_ns: int
    offset_ns: int
    rtt_ns: int
    uncertainty_ns: int


# Columns are built from buffers, never with ``pa.array`` on Python objects: that call asks whether
# pandas is installed and imports it, a side effect in the traced program (and an error at
# interpreter shutdown). It is also slower than these paths.


def numeric_column(values: Sequence[object] | np.ndarray, type: pa.DataType) -> pa.Array:
    """A fixed-width Arrow column from numbers."""
    a = np.ascontiguousarray(values, dtype=_NUMPY[type])
    return pa.Array.from_buffers(type, len(a), [None, pa.py_buffer(a)])


def string_column(values: Sequence[str]) -> pa.Array:
    """A plain Arrow string column."""
    encoded = [v.encode("utf-8", "surrogateescape") for v in values]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
    np.cumsum(np.fromiter(map(len, encoded), dtype=np.int32, count=len(encoded)), out=offsets[1:])
    return pa.Array.from_buffers(
        pa.string(), len(encoded), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))]
    )


def dict_column(values: Sequence[str]) -> pa.Array:
    """A dictionary-encoded string column (names, lanes: few distinct values)."""
    index: dict[str, int] = {}
    codes = np.fromiter(
        (index.setdefault(v, len(index)) for v in values), dtype=np.int32, count=len(values)
    )
    return pa.DictionaryArray.from_arrays(
        numeric_column(codes, pa.int32()), string_column(list(index))
    )


def attrs_column(values: Sequence[dict[str, str] | None]) -> pa.Array:
    """Arrow map column from attribute dicts (``None`` is an empty map)."""
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    keys: list[str] = []
    items: list[str] = []
    if any(values):
        for i, v in enumerate(values):
            if v:
                keys.extend(v.keys())
                items.extend(v.values())
            offsets[i + 1] = len(keys)
    return pa.MapArray.from_arrays(
        numeric_column(offsets, pa.int32()), string_column(keys), string_column(items), type=ATTRS
    )


def impossible_rows(kind: str, batch: pa.RecordBatch) -> tuple[np.ndarray, str] | None:
    """Rows of ``batch`` (spool ``kind``) that cannot be true, as a mask, with the first reason;
    None when there are none. Impossible: a time before the clock's zero, a span ending before it
    starts, a category no recorder writes, a negative round trip or uncertainty.

    A checksum proves a batch is what the writer wrote; this catches what no writer should write,
    and damage in a spool from before checksums.
    """
    names = batch.schema.names
    bad = np.zeros(batch.num_rows, dtype=bool)
    reasons: list[str] = []

    def mark(mask: np.ndarray, reason: str) -> None:
        if mask.any():
            bad[:] |= mask
            reasons.append(reason)

    for column in ("start_ns", "end_ns", "ts_ns", "rtt_ns", "uncertainty_ns"):
        if column in names:
            mark(_ints(batch, column) < 0, f"negative {column}")
    if kind == "spans":
        if "start_ns" in names and "end_ns" in names:
            ends_first = _ints(batch, "end_ns") < _ints(batch, "start_ns")
            mark(ends_first, "a span ends before it starts")
        if "category" in names:
            category = batch.column("category")
            if pa.types.is_dictionary(category.type):
                known = pc.is_in(category.dictionary, value_set=pa.array(CATEGORIES))
                ok = pc.fill_null(pc.take(known, category.indices), True)
            else:
                ok = pc.fill_null(pc.is_in(category, value_set=pa.array(CATEGORIES)), True)
            unknown = ~ok.to_numpy(zero_copy_only=False)
            if unknown.any():
                first = category[int(np.argmax(unknown))].as_py()
                mark(unknown, f"unknown category {first!r}")
    return (bad, reasons[0]) if reasons else None


def _ints(batch: pa.RecordBatch, column: str) -> np.ndarray:
    col = batch.column(column)
    if col.null_count:
        col = col.fill_null(0)
    values: np.ndarray = col.to_numpy(zero_copy_only=False)
    return values


_NUMPY = {
    pa.int64(): np.int64,
    pa.uint64(): np.uint64,
    pa.int32(): np.int32,
    pa.uint32(): np.uint32,
    pa.uint16(): np.uint16,
    pa.float64(): np.float64,
}
