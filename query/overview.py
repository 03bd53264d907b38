"""The run overview: every span of a run counted once into a fixed grid, kept in memory.

A whole-run scan of a 10-million-span run takes about a second on a small machine, and a grouped
one more, so zooming out must not scan again. On first use a run is read once:

- spans shorter than the grid's cell (the run's duration / :data:`CELLS`) are counted and their
  time summed per track, depth and cell;
- longer spans (at most a few per cell per track and depth) are kept as they are.

A window at least one cell per bucket wide is then answered from memory: long spans become bars or
density, short cells are re-binned into the window's buckets (a cell lies in the bucket its start
falls in, so positions are good to one bucket). Every span is in exactly one cell or the long
list, so nothing is dropped. Narrower windows go to the store, which then reads a small part of
the run (:func:`gpu_trace.query.windows.window`).

The same scan gives the tracks (spans, depths, longest span per track).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.query.source import Source

#: Cells across a run in the overview grid; spans shorter than one of them are counted in it.
CELLS = 4096
#: Cells across a run in the coarse grid a run's first figure is drawn from (four of the fine
#: grid's in each, the same spans counted: a fifth of the groups to make, as many as a plain
#: query at the first window's level of detail for plots up to 3000 px wide). Windows whose
#: buckets are at least one of these wide are answered from it.
COARSE_CELLS = CELLS // 4

_GRID = """
SELECT host, pid, tid, lane, depth, intDiv(start_ns - {o:Int64}, {cell:Int64}) AS cell,
       countIf(end_ns >= start_ns AND end_ns - start_ns < {split:Int64}) AS n,
       sumIf(end_ns - start_ns, end_ns >= start_ns AND end_ns - start_ns < {split:Int64}) AS busy_ns,
       count() AS spans, countIf(end_ns < start_ns) AS unended, max(end_ns - start_ns) AS max_dur,
       maxIf(end_ns - start_ns, end_ns >= start_ns AND end_ns - start_ns < {split:Int64}) AS top_dur,
       argMaxIf(start_ns, end_ns - start_ns,
                end_ns >= start_ns AND end_ns - start_ns < {split:Int64}) AS top_start,
       groupArrayIf(start_ns, end_ns - start_ns >= {split:Int64}) AS long_starts
FROM __db__.spans WHERE run_id = {run:String}
GROUP BY host, pid, tid, lane, depth, cell
ORDER BY cell
"""

#: The spans at least a cell long (``short`` 0), then the steps and forwarded batches shorter
#: than a cell (``short`` 1): always drawn, so kept by name too (the longest
#: :data:`MAX_SHORT_PINS`; they are counted in the grid as well). One round trip. ``{where}``:
#: where the long ones start (the grid's scan noted it), so the primary key reads their granules
#: only, or nothing where they are too many to name.
_LONG = """
SELECT toString(span_id) AS id, host, pid, tid, lane, category, name, depth, start_ns, end_ns,
       0 AS short
FROM __db__.spans
WHERE run_id = {{run:String}} AND end_ns - start_ns >= {{split:Int64}}{where}
UNION ALL
SELECT * FROM (
    SELECT toString(span_id) AS id, host, pid, tid, lane, category, name, depth, start_ns,
           end_ns, 1 AS short
    FROM __db__.spans
    WHERE run_id = {{run:String}} AND end_ns >= start_ns AND end_ns - start_ns < {{split:Int64}}
      AND (category = 'step' OR lane IN {{lanes:Array(String)}})
    ORDER BY end_ns - start_ns DESC LIMIT {{cap:UInt32}}
)
"""
#: Short steps and forwarded batches kept per run at most.
MAX_SHORT_PINS = 20_000
#: Starts of long spans named in the long spans' query at most (past this it reads every start).
#: A ClickHouse server takes query parameters in the URL (``http_max_uri_size``, 1 MiB by
#: default): 10,000 starts are about 200 kB of it.
MAX_LONG_STARTS = 10_000
#: Grid cells' longest spans drawn anyway per window at most (the longest of them).
MAX_CELL_PINS = 120
#: Kinds of span always drawn as bars (up to a cap): steps and forwarded batches.
PIN_CATEGORIES = ("step",)
#: (A batch sent while others are in flight has a lane of its own: ``forward/batch/N``.)
PIN_LANES = ("forward/batch", *(f"forward/batch/{n}" for n in range(1, 65)))


@dataclass
class CellPins:
    """Grid cells' longest spans a window draws anyway, known by their track (``keys``: host,
    pid, tid, lane, depth), start and length; ``row`` and ``bucket``: the density cell of the
    window each was counted in."""

    keys: list[dict[str, object]]
    start_ns: np.ndarray
    dur_ns: np.ndarray
    row: np.ndarray
    bucket: np.ndarray


@dataclass
class Overview:
    """One run's grid (short spans, ordered by cell) and long spans."""

    origin: int
    cell_ns: int
    #: host, pid, tid, lane, depth, cell, n, busy_ns (of its spans shorter than ``split_ns``),
    #: spans, unended, max_dur (of all its spans), top_dur, top_start (the length and start of
    #: its longest span shorter than ``split_ns``: found by its start when it is drawn anyway)
    grid: pa.Table
    #: id, host, pid, tid, lane, category, name, depth, start_ns, end_ns, short: the spans at
    #: least a cell long, then short steps and forwarded batches (``short``: also in the grid).
    long: pa.Table
    #: Columns as numpy arrays, made once (a chunked column is copied by each ``to_numpy``).
    arrays: dict[tuple[str, str], np.ndarray] = field(default_factory=dict, repr=False)
    #: Spans at least this long are in ``long`` (0: ``cell_ns``); the coarse grid's is the fine
    #: grid's cell, so both keep the same spans apart.
    split_ns: int = 0

    def __post_init__(self) -> None:
        self.split_ns = self.split_ns or self.cell_ns

    def column(self, table: str, name: str) -> np.ndarray:
        """A column of ``grid`` or ``long`` as numpy (``kind`` of ``long``: a step or a
        forwarded batch), made on first use."""
        key = (table, name)
        if key not in self.arrays:
            t = self.grid if table == "grid" else self.long
            if key == ("long", "kind"):
                col = pc.or_(
                    pc.is_in(t["category"], pa.array(PIN_CATEGORIES)),
                    pc.is_in(t["lane"], pa.array(PIN_LANES)),
                )
            else:
                col = t[name]
            self.arrays[key] = col.to_numpy(zero_copy_only=False)
        return self.arrays[key]

    def window(
        self,
        t0: int,
        t1: int,
        bucket: int,
        max_bars: int,
        grid_row: np.ndarray,
        long_row: np.ndarray,
        n_rows: int,
        pins: tuple[int, int] = (0, 0),
    ) -> dict[str, Any]:
        """Bars, density (span count and busy ns per timeline row and bucket) and the bar
        threshold for ``[t0, t1)`` in ``bucket`` ns buckets; ``bucket`` must be at least
        ``cell_ns``. ``grid_row`` and ``long_row`` give the timeline row of each grid cell and
        long span (-1: not drawn). ``pins`` is (parts, cap): the longest span of each row in
        each of ``parts`` parts of the window and the steps and forwarded batches (up to cap)
        are bars however narrow (:func:`pick_pins`)."""
        nb = max(1, -(-(t1 - t0) // bucket))
        start, end = self.column("long", "start_ns"), self.column("long", "end_ns")
        short = self.column("long", "short").astype(bool)
        inside = np.flatnonzero((start < t1) & (end >= t0))
        dur = end[inside] - start[inside]
        threshold, capped = bucket, False
        wide = inside[(dur >= bucket) & ~short[inside]]
        if len(wide) > max_bars:
            order = np.argsort(-(end[wide] - start[wide]), kind="stable")
            cut = int(end[wide[order[max_bars]]] - start[wide[order[max_bars]]])
            threshold, capped = cut + 1, True
            wide = inside[(dur >= threshold) & ~short[inside]]
        rest = inside[(dur < threshold) | short[inside]]
        kind = self.column("long", "kind").astype(bool)
        # The grid is ordered by cell: the window's cells are one slice of it.
        cell = self.column("grid", "cell")
        lo = int(np.searchsorted(cell, (t0 - self.origin) // self.cell_ns, "left"))
        hi = int(np.searchsorted(cell, -(-(t1 - self.origin) // self.cell_ns), "left"))
        cstart = self.origin + cell[lo:hi] * self.cell_ns
        # Candidates drawn anyway: the long spans not drawn as bars, and each grid cell's
        # longest span where it is shorter than a cell (known by its length and start only).
        g_dur = self.column("grid", "top_dur")[lo:hi]
        g_start = self.column("grid", "top_start")[lo:hi]
        g_ok = (grid_row[lo:hi] >= 0) & (self.column("grid", "n")[lo:hi] > 0)
        g_ok &= (g_dur >= 0) & (g_dur < self.split_ns) & (g_start < t1) & (g_start + g_dur >= t0)
        cand = np.flatnonzero(g_ok) if pins[0] else np.zeros(0, np.int64)
        c_start = np.r_[start[rest], g_start[cand]]
        chosen = pick_pins(
            np.r_[long_row[rest], grid_row[lo:hi][cand]],
            window_part(c_start, t0, t1, pins[0]),
            np.r_[end[rest] - start[rest], g_dur[cand]],
            np.r_[kind[rest], np.zeros(len(cand), bool)],
            pins[1],
            c_start,
        )
        pinned = rest[chosen[chosen < len(rest)]]
        from_grid = cand[chosen[chosen >= len(rest)] - len(rest)]  # in the window's slice
        # Read from the store by their start: each costs a granule read, so the longest few.
        from_grid = from_grid[np.argsort(-g_dur[from_grid], kind="stable")[:MAX_CELL_PINS]]
        keys = self.grid.slice(lo, hi - lo).take(pa.array(from_grid, pa.int64()))
        grid_pins = CellPins(
            keys=keys.select(["host", "pid", "tid", "lane", "depth"]).to_pylist(),
            start_ns=g_start[from_grid],
            dur_ns=g_dur[from_grid],
            row=grid_row[lo:hi][from_grid],
            bucket=np.minimum((np.maximum(cstart[from_grid], t0) - t0) // bucket, nb - 1),
        )
        bars = self.long.take(pa.array(np.concatenate([wide, pinned]), pa.int64())).to_pylist()
        for b in bars[len(wide) :]:
            b["pinned"] = True
        for b in bars:
            b["span_id"] = b.pop("id")
            del b["short"]
        # Long spans not drawn as bars go into density; short ones are in the grid already,
        # from which the pinned short ones are taken out again.
        narrow = np.setdiff1d(rest[~short[rest]], pinned)
        s0 = np.maximum(start[narrow], t0)
        rows = [long_row[narrow]]
        buckets = [(s0 - t0) // bucket]
        counts = [np.ones(len(narrow), dtype=np.float64)]
        busy = [(np.minimum(end[narrow], t1) - s0).astype(np.float64)]
        rows.append(grid_row[lo:hi])
        buckets.append(np.minimum((np.maximum(cstart, t0) - t0) // bucket, nb - 1))
        counts.append(self.column("grid", "n")[lo:hi].astype(np.float64))
        busy.append(self.column("grid", "busy_ns")[lo:hi].astype(np.float64))
        taken = pinned[short[pinned]]
        if len(taken):  # where the grid counted them: their cell's bucket, their whole length
            pcell = (start[taken] - self.origin) // self.cell_ns
            pstart = self.origin + pcell * self.cell_ns
            in_grid = pcell >= (t0 - self.origin) // self.cell_ns  # the window's grid slice
            rows.append(np.where(in_grid, long_row[taken], -1))
            buckets.append(np.minimum((np.maximum(pstart, t0) - t0) // bucket, nb - 1))
            counts.append(-np.ones(len(taken), dtype=np.float64))
            busy.append(-(end[taken] - start[taken]).astype(np.float64))
        count, busy_ns = bin_cells(
            np.concatenate(rows), np.concatenate(buckets), np.concatenate(counts),
            np.concatenate(busy), n_rows, nb,
        )  # fmt: skip
        return {
            "bars": bars,
            "count": count,
            "busy_ns": busy_ns,
            "threshold": threshold,
            "capped": capped,
            "pinned": len(pinned),
            # Cells' longest spans drawn anyway, for the caller to find in the store (by
            # start) and take out of the density (row, bucket, length).
            "grid_pins": grid_pins,
        }


def pick_pins(
    row: np.ndarray, part: np.ndarray, dur: np.ndarray, kind: np.ndarray, cap: int,
    start: np.ndarray,
) -> np.ndarray:  # fmt: skip
    """Which of these spans (narrower than the bar threshold) are drawn as bars anyway: the
    longest of each timeline row in each part of the window (``part``), and steps and
    forwarded batches (``kind``), the longest ``cap`` of them; of equally long ones the
    earliest. Returns their indices; rows below 0 (not drawn) never count."""
    ok = row >= 0
    # The longest of each (row, part), then the earliest of equally long ones: two ufunc.at
    # passes, linear in the candidates (a sort of the 800,000 cells of a big run took 0.4 s).
    idx = np.flatnonzero(ok)
    top = idx[:0]
    if len(idx):
        parts = int(part[idx].max()) + 1
        key = row[idx].astype(np.int64) * parts + part[idx]
        best = np.full(int(key.max()) + 1, np.iinfo(np.int64).min)
        np.maximum.at(best, key, dur[idx])
        hit = dur[idx] == best[key]
        idx, key = idx[hit], key[hit]
        first = np.full(len(best), np.iinfo(np.int64).max)
        np.minimum.at(first, key, start[idx])
        hit = start[idx] == first[key]
        idx, key = idx[hit], key[hit]
        top = idx[np.unique(key, return_index=True)[1]]
    marked = np.flatnonzero(kind & ok)
    marked = marked[np.lexsort((start[marked], -dur[marked]))[:cap]]
    return np.union1d(top, marked).astype(np.int64)


def window_part(start: np.ndarray, t0: int, t1: int, parts: int) -> np.ndarray:
    """Which of ``parts`` equal parts of ``[t0, t1)`` each span starts in (or overlaps first)."""
    size = max(1, -(-(t1 - t0) // max(1, parts)))
    part: np.ndarray = (np.maximum(start, t0) - t0) // size
    return part


def bin_cells(
    row: np.ndarray, bucket: np.ndarray, n: np.ndarray, busy: np.ndarray, n_rows: int, nb: int
) -> tuple[np.ndarray, np.ndarray]:
    """Span counts and busy ns summed per (row, bucket): two ``n_rows x nb`` arrays. Cells of a
    row below 0 (a track not drawn) or outside the buckets are left out."""
    ok = (row >= 0) & (row < n_rows) & (bucket >= 0) & (bucket < nb)
    flat = row[ok].astype(np.int64) * nb + bucket[ok].astype(np.int64)
    size = max(0, n_rows) * nb
    count = np.bincount(flat, weights=n[ok], minlength=size).astype(np.int64)
    busy_ns = np.bincount(flat, weights=busy[ok], minlength=size)
    return count.reshape(n_rows, nb), busy_ns.reshape(n_rows, nb)


_KEYS = ("host", "pid", "tid", "lane", "depth")


def cell_size(started_ns: int, ended_ns: int, cells: int = CELLS) -> int:
    """The length of a cell of a run's grid of ``cells`` cells."""
    return max(1, -(-(max(ended_ns, started_ns + 1) - started_ns) // cells))


def overview(
    source: Source, run_id: str, started_ns: int, ended_ns: int, cells: int = CELLS
) -> Overview:
    """The run's overview in ``cells`` cells (:data:`CELLS`, or :data:`COARSE_CELLS` for a
    first figure): two round trips (the grid, ordered by cell by the store; the long spans with
    the short steps and batches) that a caller keeps (the dashboard once per run). Whatever
    ``cells``, spans as long as a cell of :data:`CELLS` are the long ones. The grid's scan notes
    where they start, so the second reads only their granules (a second whole scan took a
    fifth of a 10M-span run's first figure)."""
    cell = cell_size(started_ns, ended_ns, cells)
    split = cell_size(started_ns, ended_ns, CELLS)
    params = {"run": run_id, "o": int(started_ns), "cell": int(cell), "split": int(split)}
    grid = source.query_arrow(_GRID, params)
    starts = np.unique(pc.list_flatten(grid["long_starts"]).to_numpy(zero_copy_only=False))
    grid = grid.drop_columns(["long_starts"])
    grid = grid.cast(plain(grid.schema))
    named = len(starts) <= MAX_LONG_STARTS
    found = source.query_arrow(
        _LONG.format(where=" AND start_ns IN {starts:Array(Int64)}" if named else ""),
        {**params, "cap": MAX_SHORT_PINS, "lanes": list(PIN_LANES),
         **({"starts": starts.astype(np.int64).tolist()} if named else {})},
    )  # fmt: skip
    found = found.cast(plain(found.schema))
    # UNION ALL's parts come back in any order: the long spans first, then the short pins.
    short = found["short"].to_numpy(zero_copy_only=False).astype(bool)
    order = np.r_[np.flatnonzero(~short), np.flatnonzero(short)]
    long = found.drop_columns(["short"]).take(pa.array(order, pa.int64()))
    long = long.append_column("short", pa.array(short[order]))
    return Overview(origin=int(started_ns), cell_ns=int(cell), grid=grid, long=long, split_ns=split)


def track_totals(ov: Overview) -> list[dict[str, Any]]:
    """Per track: spans, min and max depth, longest span, spans without an end."""
    g = ov.grid
    if not g.num_rows:
        return []
    code, first = track_codes(g)
    n = len(first)
    spans = np.bincount(code, weights=ov.column("grid", "spans"), minlength=n)
    unended = np.bincount(code, weights=ov.column("grid", "unended"), minlength=n)
    depth = ov.column("grid", "depth").astype(np.int64)
    lo = np.full(n, np.iinfo(np.int64).max)
    hi = np.full(n, np.iinfo(np.int64).min)
    top = np.full(n, np.iinfo(np.int64).min)
    np.minimum.at(lo, code, depth)
    np.maximum.at(hi, code, depth)
    np.maximum.at(top, code, ov.column("grid", "max_dur").astype(np.int64))
    keys = g.select(["host", "pid", "tid", "lane"]).take(pa.array(first, pa.int64())).to_pylist()
    return [
        {**k, "spans": int(spans[i]), "min_depth": int(lo[i]), "max_depth": int(hi[i]),
         "max_dur": int(top[i]), "unended": int(unended[i])}
        for i, k in enumerate(keys)
    ]  # fmt: skip


def track_codes(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Each row's track (host, pid, tid, lane) as a number from 0, and the first row of each
    track: the four columns' codes combined, without joining 800,000 strings."""
    parts = []
    for name in ("host", "pid", "tid", "lane"):
        col = table[name]
        if pa.types.is_dictionary(col.type):  # chunks may each have their own dictionary
            col = col.cast(col.type.value_type)
        enc = pa.chunked_array(col).combine_chunks().dictionary_encode()
        parts.append((enc.indices.to_numpy(zero_copy_only=False).astype(np.int64),
                      len(enc.dictionary)))  # fmt: skip
    key = np.zeros(table.num_rows, np.int64)
    for codes, size in parts:
        key = key * max(1, size) + codes
    _, first, code = np.unique(key, return_index=True, return_inverse=True)
    return code.reshape(-1).astype(np.int64), first.astype(np.int64)


def plain(schema: pa.Schema) -> pa.Schema:
    """Dictionary strings as plain strings, so tables of one kind concatenate."""
    return pa.schema(
        [
            pa.field(f.name, pa.string() if pa.types.is_dictionary(f.type) else f.type)
            for f in schema
        ]
    )


__all__ = [
    "CELLS",
    "COARSE_CELLS",
    "cell_size",
    "Overview",
    "bin_cells",
    "overview",
    "pick_pins",
    "plain",
    "track_codes",
    "track_totals",
    "window_part",
]
