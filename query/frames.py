"""A run's spans and counter samples as Arrow tables, filtered as ``Run.spans()`` and
``Run.counters()`` are asked (the notebook API turns them into DataFrames).

Filters by name are globs (``*``, ``?``) sent as ``LIKE`` patterns in query parameters; without
wildcards a glob matches the text exactly. Plain functions of a
:class:`~gpu_trace.query.source.Source`.
"""

from __future__ import annotations

import pyarrow as pa

from gpu_trace.query.source import Source

_SPAN_COLUMNS = (
    "span_id, parent_span_id, host, pid, tid, lane, category, name, start_ns, end_ns, depth, attrs"
)


def like(pattern: str) -> str:
    """A glob (``*``, ``?``) as a LIKE pattern; without wildcards it matches the text exactly."""
    out = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return out.replace("*", "%").replace("?", "_")


def spans(
    source: Source,
    run_id: str,
    *,
    lane: str | None = None,
    name: str | None = None,
    category: str | None = None,
    start: int | None = None,
    end: int | None = None,
    limit: int | None = None,
) -> pa.Table:
    """Spans overlapping ``[start, end)`` in start order (then depth, span id): ``lane`` and
    ``name`` globs, ``category`` exact; at most ``limit`` rows (None: all). Columns
    ``span_id, parent_span_id, host, pid, tid, lane, category, name, start_ns, end_ns, depth,
    attrs``."""
    where = ["run_id = {run_id:String}"]
    params: dict[str, object] = {"run_id": run_id}
    for col, value in (("lane", lane), ("name", name)):
        if value is not None:
            where.append(f"{col} LIKE {{{col}:String}}")
            params[col] = like(value)
    if category is not None:
        where.append("category = {category:String}")
        params["category"] = category
    if start is not None:
        where.append("end_ns >= {start:Int64}")
        params["start"] = int(start)
    if end is not None:
        where.append("start_ns < {end:Int64}")
        params["end"] = int(end)
    if limit is not None:
        params["limit"] = int(limit)
    query = (
        f"SELECT {_SPAN_COLUMNS} FROM __db__.spans WHERE {' AND '.join(where)}"
        " ORDER BY start_ns, depth, span_id"
        + (" LIMIT {limit:UInt64}" if limit is not None else "")
    )
    return source.query_arrow(query, params)


def counters(
    source: Source,
    run_id: str,
    *,
    name: str | None = None,
    start: int | None = None,
    end: int | None = None,
) -> pa.Table:
    """Counter samples in ``[start, end)`` in time order; ``name`` a glob of ``source/metric``
    or of the metric alone. Columns ``host, source, device, metric, ts_ns, value, labels``."""
    where = ["run_id = {run_id:String}"]
    params: dict[str, object] = {"run_id": run_id}
    if name is not None:
        where.append(
            "(concat(source, '/', metric) LIKE {name:String} OR metric LIKE {name:String})"
        )
        params["name"] = like(name)
    if start is not None:
        where.append("ts_ns >= {start:Int64}")
        params["start"] = int(start)
    if end is not None:
        where.append("ts_ns < {end:Int64}")
        params["end"] = int(end)
    return source.query_arrow(
        "SELECT host, source, device, metric, ts_ns, value, labels FROM __db__.counters"
        f" WHERE {' AND '.join(where)} ORDER BY ts_ns, source, metric, device, host",
        params,
    )
