"""Runs and what they hold, read from a :class:`~gpu_trace.query.source.Source`: the run list,
a run from its reference (an id, a unique prefix or ``last``), its counts, threads, clock samples,
forwarded ops' time, the summary (``summary.py``) and spans and counters streamed in pages.

Every query is a template with ``{name:Type}`` parameters and ``__db__`` for the (validated)
database name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from gpu_trace.query.source import Source
from gpu_trace.query.source import rows as read_rows
from gpu_trace.query.summary import RunSummary, event_count, run_summary

if TYPE_CHECKING:
    pass

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

_RUN_COLUMNS = (
    "run_id, trace_id, started_ns, ended_ns, started_wall_ns, command, hosts, status, attrs,"
    " stored_ns"
)

SPAN_COLUMNS = "trace_id, span_id, parent_span_id, host, pid, tid, lane, category, name, start_ns, end_ns, depth, attrs"
COUNTER_COLUMNS = "host, source, device, metric, ts_ns, value, labels"

# Forwarded ops (runtime/): per op name, where the time went. Each client op span (lane
# forward/op) is a child of its batch span (lane forward/batch, or forward/batch/N for a batch sent
# while others were in flight), whose attrs hold the batch's send, wire and queue time;
# those are shared equally by the batch's ops. Execute time is the server's own op spans.
_FORWARDING = """
WITH batches AS (
    SELECT span_id,
           toInt64OrZero(attrs['send_ns']) AS send, toInt64OrZero(attrs['wire_ns']) AS wire,
           toInt64OrZero(attrs['queue_ns']) AS queue, greatest(toInt64OrZero(attrs['ops']), 1) AS n
    FROM __db__.spans
    WHERE run_id = {run_id:String} AND category = 'forward'
      AND (lane = 'forward/batch' OR startsWith(lane, 'forward/batch/'))
),
client AS (
    SELECT o.name AS name, count() AS count,
           sum(o.end_ns - o.start_ns) + sum(intDiv(b.send, b.n)) AS client_ns,
           sum(intDiv(b.wire, b.n)) AS wire_ns, sum(intDiv(b.queue, b.n)) AS queue_ns
    FROM __db__.spans AS o INNER JOIN batches AS b ON o.parent_span_id = b.span_id
    WHERE o.run_id = {run_id:String} AND o.lane = 'forward/op'
    GROUP BY name
),
server AS (
    SELECT name, sum(end_ns - start_ns) AS execute_ns
    FROM __db__.spans WHERE run_id = {run_id:String} AND lane = 'server/op'
    GROUP BY name
)
SELECT c.name AS name, c.count AS count, c.client_ns AS client_ns, c.wire_ns AS wire_ns,
       c.queue_ns AS queue_ns, s.execute_ns AS execute_ns
FROM client AS c LEFT JOIN server AS s ON s.name = c.name
ORDER BY c.client_ns + c.wire_ns + c.queue_ns + s.execute_ns DESC, name
"""


class UnknownRunError(LookupError):
    """No run matches a reference; the message lists the most recent runs."""

    def __init__(self, message: str, recent: list[str] | None = None) -> None:
        super().__init__(message)
        self.recent = recent or []


# ---- runs -------------------------------------------------------------------------------------


def runs(source: Source, limit: int = 50, search: str | None = None) -> list[dict[str, Any]]:
    """Runs newest first (by wall-clock start), each with ``spans``, ``counters``, ``events``
    (:func:`~gpu_trace.query.summary.event_count`) and ``duration_ns``.

    ``search`` keeps runs whose id, command, status or a host contains it (case-insensitive).
    """
    rows = read_rows(
        source,
        f"""
        SELECT {_RUN_COLUMNS} FROM __db__.runs FINAL
        WHERE {{search:String}} = ''
           OR positionCaseInsensitive(run_id, {{search:String}}) > 0
           OR positionCaseInsensitive(command, {{search:String}}) > 0
           OR positionCaseInsensitive(status, {{search:String}}) > 0
           OR arrayExists(h -> positionCaseInsensitive(h, {{search:String}}) > 0, hosts)
        ORDER BY started_wall_ns DESC, run_id DESC
        LIMIT {{limit:UInt32}}
        """,
        {"search": search or "", "limit": max(0, int(limit))},
    )
    if not rows:
        return []
    ids = [r["run_id"] for r in rows]
    per_run: dict[str, dict[str, int]] = {i: {"spans": 0, "counters": 0} for i in ids}
    for kind in ("spans", "counters"):
        result = source.query(
            f"SELECT run_id, count() FROM __db__.{kind} WHERE run_id IN {{ids:Array(String)}} GROUP BY run_id",
            {"ids": ids},
        )
        for run_id, n in result.result_rows:
            per_run[run_id][kind] = int(n)
    return [_run_dict(r, per_run[r["run_id"]]) for r in rows]


def runs_started_before(source: Source, wall_ns: int) -> list[tuple[str, str, dict[str, str]]]:
    """``(run_id, status, attrs)`` of the runs whose wall-clock start is known and before
    ``wall_ns``, oldest first (``gpu-trace gc``)."""
    result = source.query(
        """
        SELECT run_id, status, attrs FROM __db__.runs FINAL
        WHERE started_wall_ns > 0 AND started_wall_ns < {before:Int64}
        ORDER BY started_wall_ns, run_id
        """,
        {"before": int(wall_ns)},
    )
    return [
        (str(run_id), str(status), {str(k): str(v) for k, v in dict(attrs).items()})
        for run_id, status, attrs in result.result_rows
    ]


def has_runs(source: Source, run_ids: list[str]) -> set[str]:
    """Which of ``run_ids`` have a ``runs`` row."""
    if not run_ids:
        return set()
    result = source.query(
        "SELECT DISTINCT run_id FROM __db__.runs WHERE run_id IN {ids:Array(String)}",
        {"ids": list(run_ids)},
    )
    return {str(r[0]) for r in result.result_rows}


def _recent_ids(source: Source, n: int = 5) -> list[str]:
    return [r["run_id"] for r in runs(source, limit=n)]


def last_run(source: Source) -> str | None:
    """The run stored most recently (recorded, imported or ingested; ``stored_ns``), None
    when there is none. Not the newest start: an imported old trace is ``last`` once stored."""
    rows = source.query(
        "SELECT run_id FROM __db__.runs FINAL"
        " ORDER BY stored_ns DESC, started_wall_ns DESC, run_id DESC LIMIT 1"
    ).result_rows
    return str(rows[0][0]) if rows else None


def runs_stamp(source: Source) -> str:
    """A short text that changes whenever a run is stored, updated or removed (the
    dashboard's run list asks it before reading the list again)."""
    count, updated, stored = source.query(
        "SELECT count(), max(updated_ns), max(stored_ns) FROM __db__.runs FINAL"
    ).result_rows[0]
    return f"{int(count)}:{int(updated)}:{int(stored)}"


def resolve_run(source: Source, ref: str) -> str:
    """A run id from a full id, a unique prefix of one, or ``last`` (the run stored most
    recently: :meth:`last_run`)."""
    ref = (ref or "").strip()
    if ref == "last":
        last = last_run(source)
        if last is None:
            raise UnknownRunError("there are no runs in the store yet")
        return last
    if ref:
        exact = source.query(
            "SELECT run_id FROM __db__.runs WHERE run_id = {ref:String} LIMIT 1", {"ref": ref}
        )
        if exact.result_rows:
            return ref
        matches: list[str] = sorted(
            {
                r[0]
                for r in source.query(
                    "SELECT DISTINCT run_id FROM __db__.runs WHERE startsWith(run_id, {ref:String}) LIMIT 11",
                    {"ref": ref},
                ).result_rows
            }
        )
        if len(matches) == 1:
            return matches[0]
        if matches:
            shown = ", ".join(matches[:10]) + (", ..." if len(matches) > 10 else "")
            raise UnknownRunError(f"run prefix {ref!r} is ambiguous: {shown}", matches)
    recent = _recent_ids(source, 5)
    listing = ", ".join(recent) if recent else "none yet"
    raise UnknownRunError(f"no run {ref!r} in the store; recent runs: {listing}", recent)


def run(source: Source, run_id: str) -> dict[str, Any]:
    """The ``runs`` row of one run with its counts and duration."""
    rows = read_rows(
        source,
        f"SELECT {_RUN_COLUMNS} FROM __db__.runs FINAL WHERE run_id = {{run_id:String}}",
        {"run_id": run_id},
    )
    if not rows:
        recent = _recent_ids(source, 5)
        raise UnknownRunError(
            f"no run {run_id!r} in the store; recent runs: {', '.join(recent) or 'none yet'}",
            recent,
        )
    return _run_dict(rows[0], counts(source, run_id))


def counts(source: Source, run_id: str) -> dict[str, int]:
    """Rows of a run per table: spans, counters, clock_sync, threads."""
    out = {}
    for table in ("spans", "counters", "clock_sync"):
        result = source.query(
            f"SELECT count() FROM __db__.{table} WHERE run_id = {{run_id:String}}",
            {"run_id": run_id},
        )
        out[table] = int(result.result_rows[0][0])
    result = source.query(
        "SELECT count() FROM __db__.threads FINAL WHERE run_id = {run_id:String}",
        {"run_id": run_id},
    )
    out["threads"] = int(result.result_rows[0][0])
    return out


def threads(source: Source, run_id: str) -> list[dict[str, Any]]:
    """Threads of a run (from the recorders' stats files): host, pid, tid, process and thread name."""
    return read_rows(
        source,
        """
        SELECT host, pid, tid, process_name, thread_name FROM __db__.threads FINAL
        WHERE run_id = {run_id:String} ORDER BY host, pid, tid
        """,
        {"run_id": run_id},
    )


def forwarding(source: Source, run_id: str, top: int = 20) -> dict[str, Any]:
    """Forwarded time per op name, broken down into client, wire, queue and execute (ns).

    Returns ``{"ops": [...], "totals": {...}, "wait_ns", "batches"}``: ``ops`` holds the top
    ``top`` op names by total time, each ``name, count, client_ns, wire_ns, queue_ns,
    execute_ns``; ``totals`` sums every op; ``wait_ns`` is the time the program blocked at
    sync points. Empty when the run forwarded nothing.
    """
    rows = read_rows(source, _FORWARDING, {"run_id": run_id})
    keys = ("count", "client_ns", "wire_ns", "queue_ns", "execute_ns")
    totals = {k: sum(int(r[k]) for r in rows) for k in keys}
    extra = source.query(
        """
        SELECT countIf(lane = 'forward/batch' OR startsWith(lane, 'forward/batch/')),
               sumIf(end_ns - start_ns, lane = 'forward/wait')
        FROM __db__.spans WHERE run_id = {run_id:String} AND category = 'forward'
        """,
        {"run_id": run_id},
    ).result_rows[0]
    ops = [{"name": r["name"], **{k: int(r[k]) for k in keys}} for r in rows[: max(1, top)]]
    return {"ops": ops, "totals": totals, "batches": int(extra[0]), "wait_ns": int(extra[1])}


def clock_sync(source: Source, run_id: str) -> list[dict[str, Any]]:
    """Every clock-offset measurement of a run, oldest first."""
    return read_rows(
        source,
        """
        SELECT host, peer, ts_ns, offset_ns, rtt_ns, uncertainty_ns FROM __db__.clock_sync
        WHERE run_id = {run_id:String} ORDER BY ts_ns, host, peer
        """,
        {"run_id": run_id},
    )


# ---- summary ----------------------------------------------------------------------------------


def summary(source: Source, run_id: str, top: int = 20) -> RunSummary:
    """The run's summary (:func:`gpu_trace.query.summary.run_summary`): lanes with their busy
    time and top range names, step-time distributions, counters, the samplers' own metrics."""
    return run_summary(source, run_id, top)


# ---- streaming --------------------------------------------------------------------------------


def iter_spans(
    source: Source,
    run_id: str,
    batch_rows: int = 200_000,
    start_ns: int | None = None,
    end_ns: int | None = None,
) -> Iterator[pa.Table]:
    """Spans of a run as Arrow tables of about ``batch_rows`` rows, ordered by ``start_ns``.

    With ``start_ns``/``end_ns``, only spans overlapping ``[start_ns, end_ns)``. Memory stays
    bounded by one batch: pages are fetched by keyset (``start_ns`` after the last page's),
    each page extended with ties so no start time is split between pages. Within a page, rows
    with equal ``start_ns`` come parents first (by depth).
    """
    yield from _iter_ordered(
        source,
        "spans",
        SPAN_COLUMNS,
        "start_ns",
        "end_ns",
        "depth, span_id",
        run_id,
        batch_rows,
        start_ns,
        end_ns,
    )


def iter_counters(
    source: Source,
    run_id: str,
    batch_rows: int = 200_000,
    start_ns: int | None = None,
    end_ns: int | None = None,
) -> Iterator[pa.Table]:
    """Counter samples of a run as Arrow tables, ordered by ``ts_ns``, within ``[start_ns, end_ns)``."""
    yield from _iter_ordered(
        source,
        "counters",
        COUNTER_COLUMNS,
        "ts_ns",
        "ts_ns",
        "metric, device, host",
        run_id,
        batch_rows,
        start_ns,
        end_ns,
    )


def _iter_ordered(
    source: Source,
    table: str,
    columns: str,
    key: str,
    end_key: str,
    tie_order: str,
    run_id: str,
    batch_rows: int,
    start_ns: int | None,
    end_ns: int | None,
) -> Iterator[pa.Table]:
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be positive, got {batch_rows}")
    template = f"""
        SELECT {columns} FROM (
            SELECT {columns} FROM __db__.{table}
            WHERE run_id = {{run_id:String}} AND {key} >= {{lo:Int64}} AND {key} < {{hi:Int64}}
              AND {end_key} >= {{window_start:Int64}}
            ORDER BY {key} LIMIT {{n:UInt64}} WITH TIES
        ) ORDER BY {key}, {tie_order}
    """
    params: dict[str, Any] = {
        "run_id": run_id,
        "lo": INT64_MIN,
        "hi": INT64_MAX if end_ns is None else int(end_ns),
        "window_start": INT64_MIN if start_ns is None else int(start_ns),
        "n": int(batch_rows),
    }
    while True:
        page = source.query_arrow(template, params)
        if page.num_rows == 0:
            return
        yield page
        if page.num_rows < batch_rows:
            return
        last = page.column(key)[-1].as_py()
        if last >= INT64_MAX:
            return
        params["lo"] = last + 1


def _run_dict(row: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    out = dict(row)
    out["hosts"] = list(row.get("hosts") or [])
    out["attrs"] = dict(row.get("attrs") or {})
    out["duration_ns"] = row["ended_ns"] - row["started_ns"] if row["ended_ns"] else None
    out.update(counts)
    out["events"] = event_count(counts)
    return out
