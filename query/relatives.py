"""A span's relatives: its parent and children, the same range in the other steps, and the
links from forwarded calls to the server spans they ran as (flows).

Parents and children are as the OTLP export has them (:mod:`gpu_trace.query.nesting`). Plain
functions of a :class:`~gpu_trace.query.source.Source`; span ids are decimal strings
(:func:`gpu_trace.query.windows.text_ids`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, TypedDict, cast

import numpy as np

from gpu_trace.query import nesting
from gpu_trace.query.gpu_work import SpanRef
from gpu_trace.query.source import Source
from gpu_trace.query.source import rows as query_rows
from gpu_trace.query.timeline_tracks import Tracks
from gpu_trace.query.windows import text_ids

#: Flow lines drawn at most per window.
MAX_FLOWS = 1500


class SpanRow(SpanRef):
    """A span as its details read it (ids as decimal strings): a launch chain's span, with its
    attributes."""

    attrs: dict[str, str]


class SpanDetail(SpanRow):
    """One span with its parent and children (:func:`span`)."""

    parent: SpanRow | None
    children: list[SpanRow]  # the first 100 by start
    children_total: int
    children_partial: bool  # its thread held too many spans inside it: the total is a floor


class StepCounterpart(TypedDict):
    """The same range in one step (:func:`same_range_in_steps`)."""

    step: str  # the step's name
    current: bool  # the step the span asked about is in
    span_id: str
    start_ns: int
    end_ns: int


class FlowLink(TypedDict):
    """A forwarded call (``p_``: its client span) to a server span (``c_``) in another process."""

    c_host: str
    c_pid: int
    c_tid: int
    c_lane: str
    c_depth: int
    c_start: int
    p_host: str
    p_pid: int
    p_tid: int
    p_lane: str
    p_depth: int
    p_start: int
    total: int


class Flows(TypedDict):
    links: list[FlowLink]
    total: int  # links overlapping the window, drawn or not


def flows(source: Source, run_id: str, t0: int, t1: int, tracks: Tracks | None = None) -> Flows:
    """Links from a span to its children in another process (forwarded calls to server spans)
    that overlap the window: ``{"links": [...], "total": N}`` (at most :data:`MAX_FLOWS` links).
    ``tracks``: the run's, where known."""
    if tracks is not None and not tracks["server_tracks"]:
        # No server spans in the run (most runs): the join would still read the whole run's
        # categories, a tenth of a second or more on ten million spans.
        return {"links": [], "total": 0}
    params = {"run": run_id, "t0": int(t0), "t1": int(t1), "cap": MAX_FLOWS}
    rows = query_rows(
        source,
        """
        SELECT c.host AS c_host, c.pid AS c_pid, c.tid AS c_tid, c.lane AS c_lane,
               c.depth AS c_depth, c.start_ns AS c_start,
               p.host AS p_host, p.pid AS p_pid, p.tid AS p_tid, p.lane AS p_lane,
               p.depth AS p_depth, p.start_ns AS p_start, count() OVER () AS total
        FROM __db__.spans AS c
        INNER JOIN (
            SELECT span_id, host, pid, tid, lane, depth, start_ns FROM __db__.spans
            WHERE run_id = {run:String} AND category = 'forward'
        ) AS p ON c.parent_span_id = p.span_id
        WHERE c.run_id = {run:String} AND c.category = 'server'
          AND c.start_ns < {t1:Int64} AND c.end_ns >= {t0:Int64} AND c.pid != p.pid
        ORDER BY c.start_ns LIMIT {cap:UInt32}
        """,
        params,
    )
    total = int(rows[0]["total"]) if rows else 0
    # The query's columns are FlowLink's keys.
    return {"links": cast(list[FlowLink], rows), "total": total}


_SPAN_COLUMNS = (
    "toString(span_id) AS id, toString(parent_span_id) AS parent_id, host, pid, tid,"
    " lane, category, name, depth, start_ns, end_ns, attrs"
)


#: Spans of a thread read at most to find a span's children by time; past it the count is a floor.
MAX_NESTED_SCAN = 1_000_000


def span(
    source: Source, run_id: str, span_id: str, start_ns: int | None = None
) -> SpanDetail | None:
    """One span with its parent (on any host) and children (first 100 and their count).

    Parents and children are as the OTLP export has them (:mod:`gpu_trace.query.nesting`): the
    parent a span names, else the innermost span of its thread enclosing it; the children are
    the spans naming it and those it is the innermost enclosing span of (``children_partial``:
    the thread held too many spans inside it to read them all, the count is a floor)."""
    where = "run_id = {run:String} AND span_id = {id:UInt64}"
    params: dict[str, Any] = {"run": run_id, "id": int(span_id)}
    if start_ns is not None:
        where += " AND start_ns = {start:Int64}"
        params["start"] = int(start_ns)
    found = text_ids(
        query_rows(
            source, f"SELECT {_SPAN_COLUMNS} FROM __db__.spans WHERE {where} LIMIT 1", params
        )
    )
    if not found:
        return None
    out = found[0]
    out["attrs"] = dict(out["attrs"] or {})
    me = _Selected(
        int(out["span_id"]),
        out["host"],
        int(out["pid"]),
        int(out["tid"]),
        out["category"],
        out["lane"],
        int(out["start_ns"]),
        int(out["end_ns"]),
    )
    parent = int(out["parent_span_id"])
    out["parent"] = None
    if parent:
        rows = text_ids(
            query_rows(
                source,
                f"SELECT {_SPAN_COLUMNS} FROM __db__.spans WHERE run_id = {{run:String}}"
                " AND span_id = {id:UInt64} LIMIT 1",
                {"run": run_id, "id": parent},
            )
        )
        out["parent"] = rows[0] if rows else None
    elif nesting.nests(me.category):
        rows = text_ids(
            query_rows(
                source,
                f"""
            SELECT {_SPAN_COLUMNS} FROM __db__.spans
            WHERE run_id = {{run:String}} AND {_SAME_THREAD}
              AND start_ns <= {{start:Int64}} AND end_ns >= {{end:Int64}}
              AND end_ns > start_ns AND span_id != 0
            ORDER BY start_ns DESC, end_ns, span_id DESC LIMIT 1000
            """,
                {"run": run_id, **me.thread(), "start": me.start_ns, "end": me.end_ns},
            )
        )
        candidates = [
            (int(r["start_ns"]), int(r["end_ns"]), int(r["span_id"]), r["category"], r["lane"])
            for r in rows
        ]
        innermost = nesting.innermost(me.start_ns, me.end_ns, candidates)
        out["parent"] = None if innermost is None else rows[innermost]
    children = text_ids(
        query_rows(
            source,
            f"""
        SELECT {_SPAN_COLUMNS}, count() OVER () AS total FROM __db__.spans
        WHERE run_id = {{run:String}} AND parent_span_id = {{id:UInt64}}
        ORDER BY start_ns LIMIT 100
        """,
            {"run": run_id, "id": int(span_id)},
        )
    )
    total = int(children[0]["total"]) if children else 0
    first, count, partial = _enclosed(source, run_id, me)
    if first:
        children += text_ids(
            query_rows(
                source,
                f"""
            SELECT {_SPAN_COLUMNS} FROM __db__.spans
            WHERE run_id = {{run:String}} AND {_SAME_THREAD} AND parent_span_id = 0
              AND span_id IN {{ids:Array(UInt64)}}
              AND start_ns >= {{start:Int64}} AND start_ns <= {{end:Int64}}
            ORDER BY start_ns LIMIT 100
            """,
                {
                    "run": run_id,
                    **me.thread(),
                    "ids": first,
                    "start": me.start_ns,
                    "end": me.end_ns,
                },
            )
        )
    out["children"] = sorted(children, key=lambda r: int(r["start_ns"]))[:100]
    out["children_total"] = total + count
    out["children_partial"] = partial
    return cast(SpanDetail, out)  # the row's columns and the keys set above


class _Selected(NamedTuple):
    """What finding a span's parent and children by time needs of it."""

    span_id: int
    host: str
    pid: int
    tid: int
    category: str
    lane: str
    start_ns: int
    end_ns: int

    def thread(self) -> dict[str, str | int]:
        return {"host": self.host, "pid": self.pid, "tid": self.tid}


_SAME_THREAD = "host = {host:String} AND pid = {pid:UInt32} AND tid = {tid:UInt64}"


def _enclosed(source: Source, run_id: str, me: _Selected) -> tuple[list[int], int, bool]:
    """The spans ``me`` is the innermost enclosing span of (naming no parent): the ids of the first
    100 by start, their count, and whether its thread had more than :data:`MAX_NESTED_SCAN` spans
    starting inside it (the count is then a floor)."""
    if me.end_ns <= me.start_ns or not me.span_id or not nesting.encloses(me.category, me.lane):
        return [], 0, False
    table = source.query_arrow(
        f"""
        SELECT span_id, parent_span_id, start_ns, end_ns, category, lane FROM __db__.spans
        WHERE run_id = {{run:String}} AND {_SAME_THREAD}
          AND start_ns >= {{start:Int64}} AND start_ns <= {{end:Int64}}
        ORDER BY start_ns LIMIT {{n:UInt64}}
        """,
        {
            "run": run_id,
            **me.thread(),
            "start": me.start_ns,
            "end": me.end_ns,
            "n": MAX_NESTED_SCAN,
        },
    )
    ids = table.column("span_id").to_numpy().astype(np.uint64)
    starts = table.column("start_ns").to_numpy().astype(np.int64)
    ends = table.column("end_ns").to_numpy().astype(np.int64)
    at = np.flatnonzero(
        (ids == np.uint64(me.span_id)) & (starts == me.start_ns) & (ends == me.end_ns)
    )
    if not len(at):
        return [], 0, False
    kinds = list(zip(table.column("category").to_pylist(), table.column("lane").to_pylist()))
    known = {k: (nesting.nests(k[0]), nesting.encloses(k[0], k[1])) for k in set(kinds)}
    nested = np.fromiter((known[k][0] for k in kinds), bool, len(kinds))
    holds = np.fromiter((known[k][1] for k in kinds), bool, len(kinds))
    parents = table.column("parent_span_id").to_numpy().astype(np.uint64)
    found = nesting.children(int(at[0]), starts, ends, ids, parents, nested, holds)
    first = [int(i) for i in ids[found[:100]]]
    return first, len(found), table.num_rows >= MAX_NESTED_SCAN


def same_range_in_steps(source: Source, run_id: str, s: Mapping[str, Any]) -> list[StepCounterpart]:
    """The same range (name, lane, process) at the same position in every other step.

    A span's position is its occurrence index within the step it starts in; each other step of
    the same process (all steps if that process has none) gives its occurrence with that index,
    or its last one. Empty if the span is not inside a step.
    """
    steps = text_ids(
        query_rows(
            source,
            """
            SELECT toString(span_id) AS id, name, pid, start_ns, end_ns FROM __db__.spans
            WHERE run_id = {run:String} AND category = 'step' ORDER BY start_ns LIMIT 100000
            """,
            {"run": run_id},
        )
    )
    own = [st for st in steps if st["pid"] == s["pid"]] or steps
    mine = next((st for st in own if st["start_ns"] <= s["start_ns"] < st["end_ns"]), None)
    if mine is None:
        return []
    if s["category"] == "step":  # a step's counterparts are the other steps
        return [
            StepCounterpart(step=st["name"], current=st is mine, span_id=st["span_id"],
                            start_ns=st["start_ns"], end_ns=st["end_ns"])
            for st in own
        ]  # fmt: skip
    same = text_ids(
        query_rows(
            source,
            """
        SELECT toString(span_id) AS id, start_ns, end_ns FROM __db__.spans
        WHERE run_id = {run:String} AND name = {name:String} AND lane = {lane:String}
          AND host = {host:String} AND pid = {pid:UInt32} AND depth = {depth:UInt16}
          AND start_ns >= {lo:Int64} AND start_ns < {hi:Int64}
        ORDER BY start_ns LIMIT 200000
        """,
            {
                "run": run_id,
                "name": s["name"],
                "lane": s["lane"],
                "host": s["host"],
                "pid": s["pid"],
                "depth": s["depth"],
                "lo": own[0]["start_ns"],
                "hi": own[-1]["end_ns"],
            },
        )
    )
    by_step: list[list[dict[str, Any]]] = [[] for _ in own]
    i = 0
    for r in same:
        while i < len(own) and r["start_ns"] >= own[i]["end_ns"]:
            i += 1
        if i < len(own) and r["start_ns"] >= own[i]["start_ns"]:
            by_step[i].append(r)
    index = own.index(mine)
    k = next((j for j, r in enumerate(by_step[index]) if r["span_id"] == s["span_id"]), 0)
    out: list[StepCounterpart] = []
    for st, found in zip(own, by_step):
        if not found:
            continue
        r = found[min(k, len(found) - 1)]
        out.append(
            StepCounterpart(step=st["name"], current=st is mine, span_id=r["span_id"],
                            start_ns=r["start_ns"], end_ns=r["end_ns"])
        )  # fmt: skip
    return out
