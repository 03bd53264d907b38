"""Timeline windows: a run's tracks, the visible window at a level of detail, and its flows.

Everything here is a plain function of a :class:`~gpu_trace.query.source.Source` and integer
nanoseconds on the run's clock; the figures are built from what they return
(:mod:`gpu_trace.plots.figures`). What a run's windows are answered from (its overview,
:mod:`gpu_trace.query.overview`, and its tracks) is read once and handed in: the dashboard keeps
it per run, ``Run.timeline`` reads it for the one figure.

Level of detail (docs/dashboard.md): the window ``[t0, t1)`` is cut into buckets of a few pixels.
A span at least one bucket wide is drawn as a bar, up to :data:`MAX_BARS` of them (the longest;
past that the threshold rises to the shortest one kept). Every other span in the window is
counted into a density cell of its track, depth and bucket (span count and busy time), so each
span is either a bar or part of a cell: none is dropped. What a window costs is bounded by the
screen, not the run: at most ``MAX_BARS`` bars plus ``rows x buckets`` cells.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.query import overview
from gpu_trace.query.source import Source
from gpu_trace.query.source import rows as query_rows
from gpu_trace.query.timeline_tracks import (
    OverviewRows,
    TrackInfo,
    Tracks,
    overview_rows,
    track_rows,
)

#: Bars drawn at most per window; narrower spans past this go into density cells.
MAX_BARS = 4000
#: Pixels per density bucket (and the narrowest bar).
BUCKET_PX = 3
#: Spans narrower than the bar threshold drawn as bars anyway (docs/dashboard.md, "Always
#: drawn"): the longest of each timeline row in each of this many equal parts of the window, so
#: every row shows what takes its time, named, at any zoom...
PINS_PER_ROW = 3
#: ...and every step and forwarded batch in the window, the longest this many.
MAX_PINNED_KINDS = 1000


class _BarMarks(TypedDict, total=False):
    pinned: bool  # narrower than the bar threshold, drawn anyway
    tenant: str  # a server span's: whose work it is
    session: str


class Bar(_BarMarks):
    """A span drawn as a bar (its id as a decimal string)."""

    span_id: str
    host: str
    pid: int
    tid: int
    lane: str
    category: str
    name: str
    depth: int
    start_ns: int
    end_ns: int


def _bars(rows: list[dict[str, Any]]) -> list[Bar]:
    """Span rows read as bars are (``id`` as text, ``toString(span_id)``) as bars."""
    return cast(list[Bar], text_ids(rows))


def _pinned(bar: Bar) -> Bar:
    return {**bar, "pinned": True}


@dataclass
class Window:
    """What one window query found."""

    t0: int
    t1: int
    bucket_ns: int
    bars: list[Bar] = field(default_factory=list)
    #: Density: spans counted per timeline row and bucket (rows x buckets), and their busy ns.
    count: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    busy_ns: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    bar_threshold_ns: int = 0  # spans at least this long are bars
    capped: bool = False  # MAX_BARS was reached and the threshold raised
    #: Bars narrower than the threshold, drawn anyway (they are last in ``bars``, ``pinned``).
    pinned: int = 0

    @property
    def density_spans(self) -> int:
        return int(self.count.sum())

    @property
    def density_cells(self) -> int:
        """Cells drawn (row and bucket with at least one span)."""
        return int(np.count_nonzero(self.count))

    @property
    def total_spans(self) -> int:
        return len(self.bars) + self.density_spans


#: A span's columns as a bar has them (its id as text: UInt64 does not fit a JavaScript number).
_BAR_COLUMNS = (
    "toString(span_id) AS id, host, pid, tid, lane, category, name, depth, start_ns, end_ns"
)
#: The tenant and session of server spans drawn as bars (found by their start: the primary key).
_BAR_OWNERS = """
SELECT toString(span_id) AS id, start_ns, attrs['tenant'] AS tenant, attrs['session'] AS session
FROM __db__.spans
WHERE run_id = {run:String} AND category = 'server' AND start_ns IN {starts:Array(Int64)}
"""


def bucket_size(t0: int, t1: int, width_px: int) -> int:
    """The density bucket (ns) of the window ``[t0, t1)`` on a plot ``width_px`` wide."""
    return max(1, -(-(int(t1) - int(t0)) // max(1, int(width_px) // BUCKET_PX)))


def steps_extent(source: Source, run_id: str) -> tuple[int, int, int] | None:
    """The first step's start, the last step's end and how many steps the run has (None: no
    step). A run's first view frames them (docs/dashboard.md, "First view")."""
    rows = query_rows(
        source,
        """
        SELECT count() AS n, min(start_ns) AS lo, max(end_ns) AS hi FROM __db__.spans
        WHERE run_id = {run:String} AND category = 'step' AND end_ns >= start_ns
        """,
        {"run": run_id},
    )
    if not rows or not int(rows[0]["n"]):
        return None
    return int(rows[0]["lo"]), int(rows[0]["hi"]), int(rows[0]["n"])


def window(
    source: Source,
    run_id: str,
    t0: int,
    t1: int,
    width_px: int,
    ov: overview.Overview,
    tracks: Tracks,
    rows: Callable[[], OverviewRows] | None = None,
) -> Window:
    """Spans overlapping ``[t0, t1)`` as bars and density cells (see the module docstring), of a
    run whose overview is ``ov`` and tracks ``tracks``; ``rows`` gives :func:`overview_rows`
    (asked only when the window is answered from the overview; a caller may keep them).

    Server spans drawn as bars carry their ``tenant`` and ``session`` (their hover names them:
    one server lane holds every tenant's work)."""
    if rows is None:
        rows = lambda: overview_rows(ov, tracks["tracks"])  # noqa: E731
    found = _window(source, run_id, t0, t1, width_px, ov, tracks, rows)
    served = [b for b in found.bars if b["category"] == "server"]
    if served:
        owners = {
            (r["id"], int(r["start_ns"])): r
            for r in query_rows(
                source,
                _BAR_OWNERS,
                {"run": run_id, "starts": sorted({int(b["start_ns"]) for b in served})},
            )
        }
        for b in served:
            r = owners.get((str(b["span_id"]), int(b["start_ns"]))) or {}
            b["tenant"], b["session"] = r.get("tenant", ""), r.get("session", "")
    return found


def _window(
    source: Source,
    run_id: str,
    t0: int,
    t1: int,
    width_px: int,
    ov: overview.Overview,
    tr: Tracks,
    rows: Callable[[], OverviewRows],
) -> Window:
    t0, t1 = int(t0), int(t1)
    if t1 <= t0:
        raise ValueError(f"empty window [{t0}, {t1})")
    bucket = bucket_size(t0, t1, width_px)
    nb = max(1, -(-(t1 - t0) // bucket))
    if bucket >= ov.cell_ns:  # zoomed out: answered from the overview in memory
        grid_row, long_row = rows()
        found = ov.window(
            t0, t1, bucket, MAX_BARS, grid_row, long_row, tr["rows"],
            (PINS_PER_ROW, MAX_PINNED_KINDS),
        )  # fmt: skip
        extra = _cell_pins(source, run_id, found["grid_pins"], found["bars"])
        for _, row, cell, dur in extra:  # drawn as bars: out of the cell that counted them
            found["count"][row, cell] -= 1
            found["busy_ns"][row, cell] -= dur
        return Window(
            t0=t0,
            t1=t1,
            bucket_ns=bucket,
            bars=found["bars"] + [b for b, *_ in extra],
            count=found["count"],
            busy_ns=found["busy_ns"],
            bar_threshold_ns=found["threshold"],
            capped=found["capped"],
            pinned=found["pinned"] + len(extra),
        )
    # The store is read from a little before t0 (the primary key prunes by start_ns): a span
    # that starts earlier than that and still reaches the window is a long one, in the
    # overview's long spans already (taken from memory), so a narrow window of a run with
    # second-long steps reads its own stretch of the run, not a step's length of it.
    lo = t0 - min(ov.split_ns, tr["max_dur"] + 1)
    early = _early(ov, lo, t0)
    base = {"run": run_id, "t0": t0, "t1": t1, "lo": lo}
    where = (
        "run_id = {run:String} AND start_ns < {t1:Int64} AND start_ns >= {lo:Int64}"
        " AND end_ns >= {t0:Int64}"
    )
    bars = _bars(
        query_rows(
            source,
            f"""
        SELECT {_BAR_COLUMNS}
        FROM __db__.spans WHERE {where} AND end_ns - start_ns >= {{min:Int64}}
        ORDER BY end_ns - start_ns DESC, start_ns LIMIT {{cap:UInt32}}
        """,
            {**base, "min": bucket, "cap": MAX_BARS + 1},
        )
    )
    e_dur = early["end_ns"].to_numpy() - early["start_ns"].to_numpy()
    if early.num_rows:
        wide_early = _bars(early.filter(pa.array(e_dur >= bucket)).to_pylist())
        bars = sorted(bars + wide_early, key=lambda b: (b["start_ns"] - b["end_ns"], b["start_ns"]))
        bars = bars[: MAX_BARS + 1]
    threshold, capped = bucket, False
    if len(bars) > MAX_BARS:
        # Keep the bars strictly longer than the first one left out; the rest become density.
        cut = bars[MAX_BARS]["end_ns"] - bars[MAX_BARS]["start_ns"]
        threshold, capped = cut + 1, True
        bars = [b for b in bars[:MAX_BARS] if b["end_ns"] - b["start_ns"] >= threshold]
    # The early spans narrower than the threshold: candidates to be drawn anyway, else density.
    early = early.filter(pa.array(e_dur < threshold))
    cells, pinned = _cells(source, where, base, bucket, threshold, tr["tracks"], early)
    # The pinned spans are bars: taken out of the cells they were counted in.
    taken = pa.Table.from_pylist(pinned) if pinned else None
    c_rows: list[np.ndarray] = []
    c_buckets: list[np.ndarray] = []
    c_spans: list[np.ndarray] = []
    c_busy: list[np.ndarray] = []
    if cells.num_rows:
        c_rows.append(track_rows(cells, tr["tracks"]))
        c_buckets.append(cells["bucket"].to_numpy().astype(np.int64))
        c_spans.append(cells["n"].to_numpy().astype(np.float64))
        c_busy.append(cells["busy_ns"].to_numpy().astype(np.float64))
    if early.num_rows:  # they start before t0: the first bucket
        c_rows.append(track_rows(early, tr["tracks"]))
        c_buckets.append(np.zeros(early.num_rows, np.int64))
        c_spans.append(np.ones(early.num_rows))
        c_busy.append((np.minimum(early["end_ns"].to_numpy(), t1) - t0).astype(np.float64))
    if taken is not None:
        s0 = np.maximum(taken["start_ns"].to_numpy(), t0)
        c_rows.append(track_rows(taken, tr["tracks"]))
        c_buckets.append((s0 - t0) // bucket)
        c_spans.append(-np.ones(taken.num_rows))
        c_busy.append(-(np.minimum(taken["end_ns"].to_numpy(), t1) - s0).astype(np.float64))
    if c_rows:
        count, busy_ns = overview.bin_cells(
            np.concatenate(c_rows), np.concatenate(c_buckets), np.concatenate(c_spans),
            np.concatenate(c_busy), tr["rows"], nb,
        )  # fmt: skip
    else:
        count, busy_ns = np.zeros((tr["rows"], nb), np.int64), np.zeros((tr["rows"], nb))
    return Window(
        t0=t0,
        t1=t1,
        bucket_ns=bucket,
        bars=bars + pinned,
        count=count,
        busy_ns=busy_ns,
        bar_threshold_ns=threshold,
        capped=capped,
        pinned=len(pinned),
    )


def _cell_pins(
    source: Source, run_id: str, wanted: overview.CellPins, drawn: list[Bar]
) -> list[tuple[Bar, int, int, int]]:
    """The overview cells' longest spans that a zoomed-out window draws anyway, read from the
    store by where they start (the primary key: a few granules), with the row and bucket of
    the density cell each was counted in and its length. One already drawn (a short step or batch) is left out."""
    if not len(wanted.start_ns):
        return []
    found = _spans_at(
        source, "run_id = {run:String}", {"run": run_id},
        list(zip(wanted.keys, wanted.start_ns, wanted.dur_ns)),
    )  # fmt: skip
    seen = {(b["span_id"], b["start_ns"]) for b in drawn}
    out: list[tuple[Bar, int, int, int]] = []
    for b, dur, row, cell in zip(found, wanted.dur_ns, wanted.row, wanted.bucket):
        if b is None or (b["span_id"], b["start_ns"]) in seen:
            continue
        seen.add((b["span_id"], b["start_ns"]))
        out.append((_pinned(b), int(row), int(cell), int(dur)))
    return out


def _spans_at(
    source: Source, where: str, params: Mapping[str, object],
    wanted: list[tuple[Mapping[str, object], object, object]],
) -> list[Bar | None]:  # fmt: skip
    """The spans ``where`` finds known by their track, depth, start and length (``wanted``: a
    row with host, pid, tid, lane and depth, a start, a length), read by where they start (the
    primary key: a few granules); each found span answers one of them, None where none is."""
    rows = _bars(
        query_rows(
            source,
            f"SELECT {_BAR_COLUMNS} FROM __db__.spans"
            f" WHERE {where} AND start_ns IN {{starts:Array(Int64)}}",
            {**params, "starts": sorted({int(str(start)) for _, start, _ in wanted})},
        )
    )
    by_key: dict[tuple[object, ...], list[Bar]] = {}
    for r in rows:
        key = _span_key(r, r["start_ns"], r["end_ns"] - r["start_ns"])
        by_key.setdefault(key, []).append(r)
    out: list[Bar | None] = []
    for row, start, dur in wanted:
        hit = by_key.get(_span_key(row, start, dur))
        out.append(hit.pop(0) if hit else None)
    return out


def _early(ov: overview.Overview, lo: int, t0: int) -> pa.Table:
    """The overview's long spans that start before ``lo`` and reach ``t0`` (id, host, pid,
    tid, lane, category, name, depth, start_ns, end_ns): every span of the run that does, since
    ``t0 - lo`` is at most the overview's split (shorter spans could not reach)."""
    start, end = ov.column("long", "start_ns"), ov.column("long", "end_ns")
    short = ov.column("long", "short").astype(bool)
    hit = np.flatnonzero((start < lo) & (end >= t0) & ~short)
    return ov.long.take(pa.array(hit, pa.int64())).drop_columns(["short"])


def _cells(
    source: Source, where: str, params: dict[str, object], bucket: int, threshold: int,
    tracks: list[TrackInfo], early: pa.Table,
) -> tuple[pa.Table, list[Bar]]:  # fmt: skip
    """A zoomed-in window's density cells (spans narrower than ``threshold`` per track, depth,
    bucket and part of the window: ``n``, ``busy_ns``, and ``top_dur`` / ``top_start``, the
    cell's longest span with an end, ``top_start`` >= t1 where none) and the narrower spans drawn
    as bars anyway: the longest of each row in each of :data:`PINS_PER_ROW` parts of the window
    and the :data:`MAX_PINNED_KINDS` longest steps and forwarded batches
    (:func:`overview.pick_pins`, the rule of zoomed-out windows), of the spans ``where`` finds
    and of ``early`` (the long spans, narrower than ``threshold`` too, that start before
    ``where``'s reach, from the overview).

    One grouped scan gives both: a cell's longest span is its largest ``length x m + (t1 -
    start)`` (the earliest of equally long ones), so the rows' longest per part are picked from
    the cells and only they are read again, by where they start (a tuple ``argMax`` per row and
    part read the window a second time and took as long as the cells)."""
    t0, t1 = int(str(params["t0"])), int(str(params["t1"]))
    query = {**params, "bucket": bucket, "thr": threshold, "cap": MAX_PINNED_KINDS,
             "part": max(1, -(-(t1 - t0) // PINS_PER_ROW)), "m": t1 - int(str(params["lo"])) + 1,
             "cats": list(overview.PIN_CATEGORIES), "lanes": list(overview.PIN_LANES)}  # fmt: skip
    top = "maxIf(toInt128(end_ns - start_ns) * {m:Int64} + ({t1:Int64} - start_ns), end_ns >= start_ns)"
    cells = source.query_arrow(
        f"""
        SELECT host, pid, tid, lane, depth,
               intDiv(greatest(start_ns, {{t0:Int64}}) - {{t0:Int64}}, {{bucket:Int64}}) AS bucket,
               count() AS n,
               sum(least(end_ns, {{t1:Int64}}) - greatest(start_ns, {{t0:Int64}})) AS busy_ns,
               toInt64(intDiv({top}, {{m:Int64}})) AS top_dur,
               toInt64({{t1:Int64}} - {top} % {{m:Int64}}) AS top_start
        FROM __db__.spans WHERE {where} AND end_ns - start_ns < {{thr:Int64}}
        GROUP BY host, pid, tid, lane, depth, bucket,
                 intDiv(greatest(start_ns, {{t0:Int64}}) - {{t0:Int64}}, {{part:Int64}})
        """,
        query,
    )
    narrow = f"{where} AND end_ns >= start_ns AND end_ns - start_ns < {{thr:Int64}}"
    kinds = source.query_arrow(
        f"""
        SELECT {_BAR_COLUMNS} FROM __db__.spans WHERE {narrow}
          AND (category IN {{cats:Array(String)}} OR lane IN {{lanes:Array(String)}})
        ORDER BY end_ns - start_ns DESC, start_ns LIMIT {{cap:UInt32}}
        """,
        query,
    )
    tables = [t.cast(overview.plain(t.schema)) for t in (kinds, early) if t.num_rows]
    found = pa.concat_tables([t.cast(tables[0].schema) for t in tables]) if tables else None
    # Candidates: the spans at hand (steps and batches, early ones), then each cell's longest.
    if found is not None:
        f_start, f_end = found["start_ns"].to_numpy(), found["end_ns"].to_numpy()
        f_kind = (
            pc.or_(
                pc.is_in(found["category"], pa.array(overview.PIN_CATEGORIES)),
                pc.is_in(found["lane"], pa.array(overview.PIN_LANES)),
            )
            .to_numpy(zero_copy_only=False)
            .astype(bool)
        )
        f_row = track_rows(found, tracks)
    else:
        f_start = f_end = f_row = np.zeros(0, np.int64)
        f_kind = np.zeros(0, bool)
    c_start = cells["top_start"].to_numpy() if cells.num_rows else np.zeros(0, np.int64)
    c_dur = cells["top_dur"].to_numpy() if cells.num_rows else np.zeros(0, np.int64)
    c_row = track_rows(cells, tracks) if cells.num_rows else np.zeros(0, np.int64)
    c_row = np.where(c_start < t1, c_row, -1)  # a cell of spans without an end has none
    start = np.r_[f_start, c_start]
    keep = overview.pick_pins(
        np.r_[f_row, c_row], overview.window_part(start, t0, t1, PINS_PER_ROW),
        np.r_[f_end - f_start, c_dur], np.r_[f_kind, np.zeros(len(c_start), bool)],
        MAX_PINNED_KINDS, start,
    )  # fmt: skip
    n = len(f_start)
    mine = keep[keep < n]
    chosen = _bars(found.take(pa.array(mine, pa.int64())).to_pylist()) if found is not None else []
    from_cells = keep[keep >= n] - n
    if len(from_cells):
        wanted = cells.take(pa.array(from_cells, pa.int64())).to_pylist()
        picked = [(w, w["top_start"], w["top_dur"]) for w in wanted]
        chosen += [b for b in _spans_at(source, narrow, query, picked) if b is not None]
    out: list[Bar] = []
    seen = set()
    for b in chosen:
        if (b["span_id"], b["start_ns"]) not in seen:  # a step or batch found twice
            seen.add((b["span_id"], b["start_ns"]))
            out.append(_pinned(b))
    return cells, out


def _span_key(row: Mapping[str, object], start: object, dur: object) -> tuple[object, ...]:
    """A span known by its track, depth, start and length (``row``: a span's or a cell's)."""
    pid, tid, depth = (int(str(row[k])) for k in ("pid", "tid", "depth"))
    return (row["host"], pid, tid, row["lane"], depth, int(str(start)), int(str(dur)))


def spans_in(source: Source, run_id: str, t0: int, t1: int) -> int:
    """How many spans of the run overlap ``[t0, t1)``."""
    found = query_rows(
        source,
        "SELECT count() AS n FROM __db__.spans WHERE run_id = {run:String}"
        " AND start_ns < {t1:Int64} AND end_ns >= {t0:Int64}",
        {"run": run_id, "t0": int(t0), "t1": int(t1)},
    )
    return int(found[0]["n"]) if found else 0


def text_ids(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Span ids travel as decimal strings (UInt64 does not fit a JavaScript number): a row's
    ``id`` and ``parent_id`` (read as ``toString``) become ``span_id`` and ``parent_span_id``."""
    for r in rows:
        r["span_id"] = r.pop("id")
        if "parent_id" in r:
            r["parent_span_id"] = r.pop("parent_id")
    return rows
