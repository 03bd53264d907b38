"""Span search: the spans of a run whose name matches a term, counted and walked in time order.

A term is matched against span names ignoring case: as a substring (``mm`` finds ``aten::mm``
and ``aten::addmm``), or, when it holds ``*`` or ``?``, as a glob over the whole name
(``aten::*`` finds the names starting with ``aten::``; ``*`` any run of characters, ``?`` one).
Each is one ``ILIKE`` pattern, sent as a query parameter: the term is never part of the SQL.

Matches are ordered by start, then span id (how the dashboard names a span: id and start), so
"next" and "previous" are well defined however many spans share a start.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_trace.query.source import Source
from gpu_trace.query.source import rows as query_rows

#: The largest span id: an anchor before every span starting at the same time.
_LAST_ID = 2**64 - 1


def is_glob(term: str) -> bool:
    """Whether ``term`` is matched as a glob (it holds ``*`` or ``?``)."""
    return "*" in term or "?" in term


def pattern(term: str) -> str:
    """The ``ILIKE`` pattern of ``term``: LIKE's own ``%``, ``_`` and ``\\`` taken literally."""
    literal = term.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    if is_glob(term):
        return literal.replace("*", "%").replace("?", "_")
    return f"%{literal}%"


def describe(term: str) -> str:
    """How ``term`` is matched, in words (the page shows it beside the count)."""
    return "glob, any case" if is_glob(term) else "name contains, any case"


@dataclass(frozen=True)
class Hit:
    """One matching span: its id (decimal, as the page carries ids), start and end, and its
    place among the run's matches (0 for the first)."""

    span_id: str
    start_ns: int
    end_ns: int
    index: int


_MATCH = "run_id = {run:String} AND name ILIKE {pattern:String}"
#: One match next to an anchor (``{anchored}``: one of the two below, or none), in ``{order}``.
_NEIGHBOUR = (
    "SELECT toString(span_id) AS id, span_id AS n, start_ns, end_ns FROM __db__.spans"
    " WHERE run_id = {{run:String}} AND name ILIKE {{pattern:String}}{anchored}"
    " ORDER BY {order} LIMIT 1"
)
_AFTER = " AND start_ns >= {start:Int64} AND (start_ns > {start:Int64} OR span_id > {id:UInt64})"
_BEFORE = " AND start_ns <= {start:Int64} AND (start_ns < {start:Int64} OR span_id < {id:UInt64})"


def count(source: Source, run_id: str, term: str) -> int:
    """How many spans of the run match ``term``."""
    rows = query_rows(
        source,
        f"SELECT count() AS n FROM __db__.spans WHERE {_MATCH}",
        {"run": run_id, "pattern": pattern(term)},
    )
    return int(rows[0]["n"]) if rows else 0


def _index(source: Source, run_id: str, term: str, start_ns: int, span_id: int) -> int:
    """How many matches come before the span (``start_ns``, ``span_id``)."""
    rows = query_rows(
        source,
        f"""
        SELECT count() AS n FROM __db__.spans
        WHERE {_MATCH} AND start_ns <= {{start:Int64}}
          AND (start_ns < {{start:Int64}} OR span_id < {{id:UInt64}})
        """,
        {"run": run_id, "pattern": pattern(term), "start": start_ns, "id": span_id},
    )
    return int(rows[0]["n"]) if rows else 0


def neighbour(
    source: Source,
    run_id: str,
    term: str,
    after: tuple[int, int] | None = None,
    before: tuple[int, int] | None = None,
) -> Hit | None:
    """The first match after ``after`` or the last before ``before`` (each ``(start_ns,
    span_id)``, itself left out), going round the run's ends: past the last match comes the
    first. None when nothing matches. With neither anchor: the first match."""
    params: dict[str, object] = {"run": run_id, "pattern": pattern(term)}
    order, anchored = "start_ns, span_id", ""
    if before is not None:
        order, anchored = "start_ns DESC, span_id DESC", _BEFORE
        params.update(start=int(before[0]), id=int(before[1]))
    elif after is not None:
        anchored = _AFTER
        params.update(start=int(after[0]), id=int(after[1]))
    rows = query_rows(source, _NEIGHBOUR.format(anchored=anchored, order=order), params)
    if not rows and anchored:  # round the end of the run
        rows = query_rows(source, _NEIGHBOUR.format(anchored="", order=order), params)
    if not rows:
        return None
    r = rows[0]
    start, n = int(r["start_ns"]), int(r["n"])
    return Hit(str(r["id"]), start, int(r["end_ns"]), _index(source, run_id, term, start, n))


def from_window(
    source: Source, run_id: str, term: str, t0: int, t1: int, forward: bool
) -> Hit | None:
    """Where a search starts when no match is selected: forward, the first match starting in or
    after the window ``[t0, t1)``; backward, the last one starting before its end."""
    if forward:
        return neighbour(source, run_id, term, after=(int(t0) - 1, _LAST_ID))
    return neighbour(source, run_id, term, before=(int(t1), 0))
