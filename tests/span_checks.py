"""Whether a run's spans nest as they ran: no partial overlap on a thread, no negative self time.

A trace viewer draws one thread's ranges as a stack, and ``gpu-trace show`` subtracts a span's
direct children from it to get its self time. Both rely on the spans of one thread nesting: a
span that starts inside another and ends after it (a partial overlap) is drawn across its
neighbour's boundary, and a parent whose children overrun it or overlap each other gets a
negative self time. Recording must never produce either; :func:`problems` lists every case in a
run's spans (from the spool, the store or an export), :func:`check_stored` reads a stored run
through the store's public API and also checks what ``gpu-trace show`` would print.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from gpu_trace.query import reads

Row = Mapping[str, Any]


def _thread(r: Row) -> tuple:
    return (r.get("host", ""), r.get("pid", 0), r.get("tid", 0))


def _label(r: Row) -> str:
    return f"{r['name']!r} [{r['start_ns']}, {r['end_ns']}]"


def overlaps(rows: Iterable[Row]) -> list[str]:
    """Partial overlaps between spans of one lane on one thread (marks, zero-length, left out)."""
    lanes: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        if r["end_ns"] > r["start_ns"]:
            lanes[(*_thread(r), r["lane"])].append(r)
    out = []
    for key, spans in lanes.items():
        spans.sort(key=lambda r: (r["start_ns"], -r["end_ns"]))
        open_: list[Row] = []
        for r in spans:
            while open_ and open_[-1]["end_ns"] <= r["start_ns"]:
                open_.pop()
            if open_ and r["end_ns"] > open_[-1]["end_ns"]:
                o = open_[-1]
                out.append(
                    f"{key}: {_label(r)} starts inside {_label(o)} and ends "
                    f"{r['end_ns'] - o['end_ns']} ns after it"
                )
            open_.append(r)
    return out


def self_times(rows: Iterable[Row]) -> list[str]:
    """Spans whose self time (duration minus their direct children's on the same thread, as
    ``gpu-trace show`` computes it) is negative, and children that lie outside their parent."""
    rows = list(rows)
    by_id = {(*_thread(r), r["span_id"]): r for r in rows}
    child_ns: dict[tuple, int] = defaultdict(int)
    out = []
    for r in rows:
        if not r["parent_span_id"]:
            continue
        key = (*_thread(r), r["parent_span_id"])
        child_ns[key] += r["end_ns"] - r["start_ns"]
        p = by_id.get(key)
        if p is not None and not p["start_ns"] <= r["start_ns"] <= r["end_ns"] <= p["end_ns"]:
            out.append(f"{_label(r)} lies outside its parent {_label(p)}")
    for key, ns in child_ns.items():
        p = by_id.get(key)
        if p is not None and p["end_ns"] - p["start_ns"] < ns:
            out.append(
                f"{_label(p)} has a negative self time: {p['end_ns'] - p['start_ns'] - ns} ns"
            )
    return out


def siblings(rows: Iterable[Row]) -> list[str]:
    """Children of one parent on one thread that overlap in time, on any lanes: the parent's
    self time counts the overlap twice (negative only when it is large enough)."""
    kids: dict[tuple, list[Row]] = defaultdict(list)
    for r in rows:
        if r["parent_span_id"] and r["end_ns"] > r["start_ns"]:
            kids[(*_thread(r), r["parent_span_id"])].append(r)
    out = []
    for spans in kids.values():
        spans.sort(key=lambda r: (r["start_ns"], -r["end_ns"]))
        last = None
        for r in spans:
            if last is not None and r["start_ns"] < last["end_ns"]:
                out.append(f"{_label(r)} overlaps its sibling {_label(last)}")
            if last is None or r["end_ns"] > last["end_ns"]:
                last = r
    return out


def problems(rows: Iterable[Row]) -> list[str]:
    """Every partial overlap, negative self time, child outside its parent and overlapping
    siblings in ``rows`` (span dicts with ``span_id, parent_span_id, tid, lane, name, start_ns,
    end_ns`` and optionally ``host, pid``)."""
    rows = list(rows)
    return overlaps(rows) + self_times(rows) + siblings(rows)


def stored_spans(store: Any, run_id: str) -> list[dict]:
    """A stored run's spans, through the store's public API."""
    return [r for t in reads.iter_spans(store, run_id) for r in t.to_pylist()]


def check_stored(store: Any, ref: str = "last") -> list[dict]:
    """Fail (AssertionError listing them) if the stored run ``ref`` has any of :func:`problems`,
    or a negative self time in its summary (what ``gpu-trace show`` prints); returns its spans."""
    run_id = reads.resolve_run(store, ref)
    rows = stored_spans(store, run_id)
    found = problems(rows)
    for lane in reads.summary(store, run_id, top=1000).lanes:
        for r in lane.ranges:
            if r.self_ns < 0:
                found.append(f"show: {lane.lane} {r.name!r} self time {r.self_ns} ns")
    assert not found, f"{len(found)} spans do not nest in run {run_id}:\n" + "\n".join(found[:20])
    return rows
