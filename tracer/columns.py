"""Span records to Arrow: the one place a span table is built, and the flusher's transposition.

Every producer of spans makes its table here: the recorder from its threads' buffers, the torch
op-level session, the server's spans (:mod:`gpu_trace.runtime.protocol.span_tables`) and the
native NVTX reader (columns it already has, :func:`columns_to_table`). So the schema is filled in
one way, and a column is never built with ``pa.array`` on Python objects (see ``records.py``).

Threads append spans as tuples (:mod:`gpu_trace.tracer.buffer`); the flusher turns each batch
into columns. That costs about as much per span as emitting it did, and both need the GIL: a
thread emitting ranges as fast as it can (about 2-3 M/s with the C ``gpu_trace.range``) outran a
flusher that transposed with ``zip(*spans)`` and dropped up to 70% of its ranges. The C twin in
``tracer/_fastpath.c`` (``span_columns``) makes the transposition one pass, several times faster;
:func:`span_columns_py` is its pure-Python twin (a parity test holds them together), used where
the extension is not loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import Any, cast

import numpy as np
import pyarrow as pa

from gpu_trace.tracer.records import (
    SPAN_SCHEMA,
    attrs_column,
    dict_column,
    numeric_column,
    string_column,
)

#: What ``span_columns`` (C) and ``span_columns_py`` return: the five integer columns as one
#: int64 block, then codes and distinct values of lane, category and name, then the attrs.
SpanBuffers = tuple[
    bytes, bytes, list[str], bytes, list[str], bytes, list[str], list[dict[str, str] | None]
]

#: ``span_columns(spans)`` of the C extension, once ``gpu_trace._api`` has loaded it.
_native: Callable[[list[tuple[object, ...]]], SpanBuffers] | None = None


def use_native(fn: Callable[[list[tuple[object, ...]]], SpanBuffers] | None) -> None:
    """Transpose with ``fn`` (the C ``span_columns``; None: the Python twin)."""
    global _native
    _native = fn


def spans_to_table(
    spans: list[tuple[object, ...]], pid: int, tids: Sequence[int] | np.ndarray
) -> pa.Table:
    """Span records (:class:`~gpu_trace.tracer.records.Span` layout) of process ``pid`` as a
    ``spans`` table; ``tids[i]`` is the thread of ``spans[i]``."""
    return columns_to_table({**span_columns(spans), "tid": tids}, pid)


def columns_to_table(columns: Mapping[str, Any], pid: int | None = None) -> pa.Table:
    """A ``spans`` table from columns a producer already has: of process ``pid``, or with a
    ``pid`` column of its own when it holds spans of several processes (an imported trace,
    GPU activity of a process tree).

    Each column is an Arrow array of the schema's type, or values to build one from: numbers
    (a sequence or numpy array), strings for lane, category and name, attribute dicts for attrs.
    """
    n = len(columns["span_id"])
    arrays: dict[str, pa.Array] = {}
    for field in SPAN_SCHEMA:
        if field.name == "pid" and pid is not None:
            arrays[field.name] = numeric_column(np.full(n, pid), field.type)
            continue
        values = columns[field.name]
        if isinstance(values, pa.Array):
            arrays[field.name] = values
        elif field.name == "attrs":
            arrays[field.name] = attrs_column(list(values))
        elif pa.types.is_dictionary(field.type):
            arrays[field.name] = dict_column(values)
        else:
            arrays[field.name] = numeric_column(values, field.type)
    return pa.table(arrays, schema=SPAN_SCHEMA)


def empty_table() -> pa.Table:
    """A ``spans`` table with no rows (a producer that made none)."""
    return SPAN_SCHEMA.empty_table()


def is_spans_table(table: pa.Table) -> bool:
    """Whether ``table`` has the ``spans`` layout (a table that came over a wire or from a file)."""
    return bool(table.schema.equals(SPAN_SCHEMA))


def span_columns(spans: list[tuple[object, ...]]) -> dict[str, pa.Array]:
    """The columns of ``spans`` (span tuples, see :mod:`.buffer`) but ``pid`` and ``tid``."""
    raw = _native(spans) if _native is not None else span_columns_py(spans)
    return _arrays(len(spans), *raw)


def span_columns_py(spans: list[tuple[object, ...]]) -> SpanBuffers:
    """The Python twin of the C ``span_columns``: the same tuple of buffers and lists."""
    n = len(spans)

    def ints(k: int, dtype: Any) -> np.ndarray:
        return np.fromiter(map(itemgetter(k), spans), dtype=dtype, count=n)

    ids = [ints(k, np.uint64).view(np.int64) for k in (0, 1)]
    depth = ints(7, np.uint16).astype(np.int64)
    block = np.concatenate([*ids, ints(5, np.int64), ints(6, np.int64), depth]).tobytes()
    out: list[Any] = [block]
    for k in (2, 3, 4):
        codes, values = _encode(list(map(itemgetter(k), spans)))
        out += [codes.tobytes(), values]
    out.append(list(map(itemgetter(8), spans)))
    return cast(SpanBuffers, tuple(out))


def _encode(values: list[str]) -> tuple[np.ndarray, list[str]]:
    """Dictionary codes of ``values`` and the distinct values, in order of first appearance."""
    index = dict.fromkeys(values)
    for code, key in enumerate(index):
        index[key] = code
    codes = np.fromiter(map(index.__getitem__, values), dtype=np.int32, count=len(values))
    return codes, list(index)


def _arrays(
    n: int,
    ints: bytes,
    lane_codes: bytes,
    lanes: list[str],
    category_codes: bytes,
    categories: list[str],
    name_codes: bytes,
    names: list[str],
    attrs: list[dict[str, str] | None],
) -> dict[str, pa.Array]:
    block = np.frombuffer(ints, dtype=np.int64).reshape(5, n) if n else np.zeros((5, 0), np.int64)

    def dictionary(codes: bytes, values: list[str]) -> pa.Array:
        return pa.DictionaryArray.from_arrays(
            numeric_column(np.frombuffer(codes, dtype=np.int32), pa.int32()), string_column(values)
        )

    return {
        "span_id": numeric_column(block[0].view(np.uint64), pa.uint64()),
        "parent_span_id": numeric_column(block[1].view(np.uint64), pa.uint64()),
        "lane": dictionary(lane_codes, lanes),
        "category": dictionary(category_codes, categories),
        "name": dictionary(name_codes, names),
        "start_ns": numeric_column(block[2], pa.int64()),
        "end_ns": numeric_column(block[3], pa.int64()),
        "depth": numeric_column(block[4].astype(np.uint16), pa.uint16()),
        "attrs": attrs_column(attrs),
    }


__all__ = ["columns_to_table", "span_columns", "span_columns_py", "spans_to_table", "use_native"]
