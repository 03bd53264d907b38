"""Timeline queries: tracks, the visible window at a level of detail, counters, flows, one span.

Everything here is a plain function of a :class:`~gpu_trace.dashboard.readonly_store.ReadOnlyStore` and integer
nanoseconds on the run's clock; the figures are built from what they return
(:mod:`gpu_trace.dashboard.figures`).

Level of detail (docs/dashboard.md): the window ``[t0, t1)`` is cut into buckets of a few pixels.
A span at least one bucket wide is drawn as a bar, up to :data:`MAX_BARS` of them (the longest;
past that the threshold rises to the shortest one kept). Every other span in the window is
counted into a density cell of its track, depth and bucket (span count and busy time), so each
span is either a bar or part of a cell: none is dropped. What a window costs is bounded by the
screen, not the run: at most ``MAX_BARS`` bars plus ``rows x buckets`` cells.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.dashboard import overview
from gpu_trace.dashboard.gpu_work import device_lane
from gpu_trace.dashboard.readonly_store import ReadOnlyStore
from gpu_trace.query import nesting, reads
from gpu_trace.query.source import rows as query_rows

#: Bars drawn at most per window; narrower spans past this go into density cells.
MAX_BARS = 4000
#: Pixels per density bucket (and the narrowest bar).
BUCKET_PX = 3
#: Nesting levels drawn per track; deeper spans share the last level.
MAX_LEVELS = 4
#: Flow lines drawn at most per window.
MAX_FLOWS = 1500
#: Spans narrower than the bar threshold drawn as bars anyway (docs/dashboard.md, "Always
#: drawn"): the longest of each timeline row in each of this many equal parts of the window, so
#: every row shows what takes its time, named, at any zoom...
PINS_PER_ROW = 3
#: ...and every step and forwarded batch in the window, the longest this many.
MAX_PINNED_KINDS = 1000

Track = tuple[str, int, int, str]  # host, pid, tid, lane


@dataclass
class TrackInfo:
    """One timeline track (host, pid, tid, lane) and the rows it takes."""

    host: str
    pid: int
    tid: int
    lane: str
    spans: int
    min_depth: int
    levels: int
    row: int = 0  # first row, top to bottom
    clock_uncertainty_ns: int = 0  # remote tracks: the largest uncertainty applied
    process: str = ""
    thread: str = ""
    #: A server track's tenants (its spans' ``tenant`` attrs; empty in a run stored before).
    tenants: tuple[str, ...] = ()
    #: Whose work the track holds, as (tenant, session) pairs: a server track's spans' own
    #: (``tenant`` and ``session`` attrs, stamped by the server), a client process's the
    #: sessions its forwarded batches ran in (empty where none is known).
    owners: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> Track:
        return (self.host, self.pid, self.tid, self.lane)

    @property
    def device(self) -> int | None:
        """The GPU of a device lane (``gpu<device>/stream<stream>``), else None."""
        found = device_lane(self.lane)
        return found[0] if found else None

    @property
    def remote(self) -> bool:
        return self.clock_uncertainty_ns > 0 or self.lane.startswith("server/")

    def level(self, depth: int) -> int:
        return min(max(0, depth - self.min_depth), self.levels - 1)


@dataclass
class Window:
    """What one window query found."""

    t0: int
    t1: int
    bucket_ns: int
    bars: list[dict[str, Any]] = field(default_factory=list)
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


#: Per server track: the largest clock uncertainty applied, and the tenants whose spans it holds
#: (each span's ``tenant`` attr, stamped by the server; none in a run stored before).
_SERVER_TRACKS = """
SELECT host, pid, tid, lane, max(toInt64OrZero(attrs['clock_uncertainty_ns'])) AS clock_unc,
       arraySort(groupUniqArray(9)(attrs['tenant'])) AS tenants,
       arraySort(groupUniqArray(16)((attrs['tenant'], attrs['session']))) AS owners
FROM __db__.spans WHERE run_id = {run:String} AND category = 'server'
GROUP BY host, pid, tid, lane
"""
#: Per client process of a forwarded run: the sessions (and their tenants) its batches ran in, as
#: the server stamped its ``server/execute`` spans (each the child of the client's batch).
_CLIENT_OWNERS = """
SELECT p.host AS host, p.pid AS pid,
       arraySort(groupUniqArray(16)((s.tenant, s.session))) AS owners
FROM (SELECT parent_span_id, attrs['tenant'] AS tenant, attrs['session'] AS session
      FROM __db__.spans
      WHERE run_id = {run:String} AND lane = 'server/execute' AND attrs['session'] != '') AS s
INNER JOIN (SELECT span_id, host, pid FROM __db__.spans
            WHERE run_id = {run:String} AND category = 'forward') AS p
  ON p.span_id = s.parent_span_id
GROUP BY host, pid
"""
#: The tenant and session of server spans drawn as bars (found by their start: the primary key).
_BAR_OWNERS = """
SELECT toString(span_id) AS id, start_ns, attrs['tenant'] AS tenant, attrs['session'] AS session
FROM __db__.spans
WHERE run_id = {run:String} AND category = 'server' AND start_ns IN {starts:Array(Int64)}
"""

_LANE_ORDER = (
    "steps", "nvtx/", "torch/", "cuda_api", "cpu/", "forward/", "server/", "gpu", "nvml/",
)  # fmt: skip


def _lane_rank(track: dict[str, Any], servers: set[tuple[str, int]]) -> tuple:
    """Host, then its processes' threads and their lanes, then its GPUs (each GPU's streams in
    order, whichever process launched on them: one group per GPU, next to the counter panels
    under the timeline); the forwarding server's tracks last, its GPU work (``servers``: the
    processes with ``server/`` lanes) after them, so a forwarded call reads down the page from
    the client's op to the server's execute and op spans, its CUDA calls and its kernels."""
    lane = track["lane"]
    in_server = (track["host"], int(track["pid"])) in servers
    server = 1 if lane.startswith("server/") or in_server else 0
    gpu = device_lane(lane)
    if gpu is not None:
        return (server, track["host"], 1, gpu[0], gpu[1], lane, track["pid"], track["tid"])
    kind = next((i for i, p in enumerate(_LANE_ORDER) if lane.startswith(p)), len(_LANE_ORDER))
    if in_server and lane == "cuda_api":  # a server thread's CUDA calls: under its op spans
        kind = len(_LANE_ORDER)
    return (server, track["host"], 0, track["pid"], track["tid"], kind, lane)


def run(source: ReadOnlyStore, run_id: str) -> dict[str, Any]:
    """The run's row with its counts (cached: an ingested run does not change)."""
    return source.cached(("run", run_id), lambda: reads.run(source, run_id))


def _overview(source: ReadOnlyStore, run_id: str) -> overview.Overview:
    r = run(source, run_id)
    return overview.overview(source, run_id, int(r["started_ns"]), int(r["ended_ns"] or 0))


def track_rows(table: pa.Table, tracks: list[TrackInfo]) -> np.ndarray:
    """The timeline row of each row of ``table`` (columns host, pid, tid, lane, depth): its
    track's first row plus its level; -1 where the track is not drawn."""
    if not table.num_rows:
        return np.zeros(0, np.int64)
    keys = (
        pc.binary_join_element_wise(
            table["host"].cast(pa.string()),
            pc.cast(table["pid"], pa.string()),
            pc.cast(table["tid"], pa.string()),
            table["lane"].cast(pa.string()),
            "|",
        )
        .combine_chunks()
        .dictionary_encode()
    )
    by_key = {f"{t.host}|{t.pid}|{t.tid}|{t.lane}": t for t in tracks}
    found = [by_key.get(k) for k in keys.dictionary.to_pylist()]
    first = np.array([t.row if t else -1 for t in found], np.int64)
    lowest = np.array([t.min_depth if t else 0 for t in found], np.int64)
    levels = np.array([t.levels if t else 1 for t in found], np.int64)
    code = keys.indices.to_numpy(zero_copy_only=False)
    depth = table["depth"].to_numpy().astype(np.int64)
    row = first[code] + np.clip(depth - lowest[code], 0, levels[code] - 1)
    return np.where(first[code] >= 0, row, -1)


def _overview_rows(source: ReadOnlyStore, run_id: str) -> tuple[np.ndarray, np.ndarray]:
    """Timeline rows of the overview's grid cells and long spans (once per run)."""

    def compute() -> tuple[np.ndarray, np.ndarray]:
        ov, info = _overview(source, run_id), tracks(source, run_id)["tracks"]
        return track_rows(ov.grid, info), track_rows(ov.long, info)

    return source.cached(("overview_rows", run_id), compute)


def steps_extent(source: ReadOnlyStore, run_id: str) -> tuple[int, int, int] | None:
    """The first step's start, the last step's end and how many steps the run has (None: no
    step); cached per run. A run's first view frames them (docs/dashboard.md, "First view")."""

    def compute() -> tuple[int, int, int] | None:
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

    return source.cached(("steps_extent", run_id), compute)


def prepare(source: ReadOnlyStore, run_id: str) -> dict[str, Any]:
    """Read what a run's zoomed-out windows are answered from, once: the overview (one scan), the
    tracks, and the timeline row of each overview cell. Returns the tracks."""
    found = tracks(source, run_id)
    _overview_rows(source, run_id)
    return found


def prepared(source: ReadOnlyStore, run_id: str) -> bool:
    """Whether :func:`prepare` has read this run (its windows are then quick)."""
    return ("overview_rows", run_id) in source.cache


def tracks(source: ReadOnlyStore, run_id: str) -> dict[str, Any]:
    """Tracks of a run, grouped host > process > thread > lane (remote server tracks last).

    Returns ``{"tracks": [TrackInfo], "rows": N, "max_dur": ns, "unended": N, "server_tracks": N}``
    (tracks holding spans of category ``server``); cached per run.
    ``unended`` counts spans that end before they start (never closed): they can't be drawn, and
    the page says how many there are.
    """

    def compute() -> dict[str, Any]:
        found = overview.track_totals(_overview(source, run_id))
        server = {
            (c["host"], int(c["pid"]), int(c["tid"]), c["lane"]): c
            for c in query_rows(source, _SERVER_TRACKS, {"run": run_id})
        }
        names = {(t["host"], t["pid"], t["tid"]): t for t in reads.threads(source, run_id)}
        clients = (
            {
                (c["host"], int(c["pid"])): c
                for c in query_rows(source, _CLIENT_OWNERS, {"run": run_id})
            }
            if server
            else {}
        )
        out: list[TrackInfo] = []
        row = 0
        servers = {(t["host"], int(t["pid"])) for t in found if t["lane"].startswith("server/")}
        for t in sorted(found, key=lambda t: _lane_rank(t, servers)):
            levels = min(MAX_LEVELS, int(t["max_depth"]) - int(t["min_depth"]) + 1)
            if device_lane(t["lane"]) is not None:
                # A stream runs its work in order: one row, whatever depth the launching
                # call had (an imported trace nests device work under its call's depth).
                levels = 1
            named = names.get((t["host"], int(t["pid"]), int(t["tid"]))) or {}
            served = server.get((t["host"], int(t["pid"]), int(t["tid"]), t["lane"])) or {}
            client = clients.get((t["host"], int(t["pid"]))) if not served else None
            owners = (served or client or {}).get("owners") or ()
            info = TrackInfo(
                host=t["host"],
                pid=int(t["pid"]),
                tid=int(t["tid"]),
                lane=t["lane"],
                spans=int(t["spans"]),
                min_depth=int(t["min_depth"]),
                levels=max(1, levels),
                row=row,
                clock_uncertainty_ns=int(served.get("clock_unc") or 0),
                tenants=tuple(x for x in served.get("tenants") or () if x),
                owners=tuple((str(a), str(b)) for a, b in owners if a or b),
                process=named.get("process_name", ""),
                thread=named.get("thread_name", ""),
            )
            row += info.levels
            out.append(info)
        max_dur = max((int(t["max_dur"]) for t in found), default=0)
        unended = sum(int(t["unended"]) for t in found)
        return {"tracks": out, "rows": row, "max_dur": max_dur, "unended": unended,
                "server_tracks": len(server)}  # fmt: skip

    return source.cached(("tracks", run_id), compute)


def window(source: ReadOnlyStore, run_id: str, t0: int, t1: int, width_px: int = 1600) -> Window:
    """Spans overlapping ``[t0, t1)`` as bars and density cells (see the module docstring).

    Server spans drawn as bars carry their ``tenant`` and ``session`` (their hover names them:
    one server lane holds every tenant's work)."""
    found = _window(source, run_id, t0, t1, width_px)
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


def _window(source: ReadOnlyStore, run_id: str, t0: int, t1: int, width_px: int) -> Window:
    t0, t1 = int(t0), int(t1)
    if t1 <= t0:
        raise ValueError(f"empty window [{t0}, {t1})")
    buckets = max(1, int(width_px) // BUCKET_PX)
    bucket = max(1, -(-(t1 - t0) // buckets))
    ov = _overview(source, run_id)
    tr = tracks(source, run_id)
    nb = max(1, -(-(t1 - t0) // bucket))
    if bucket >= ov.cell_ns:  # zoomed out: answered from the overview in memory
        grid_row, long_row = _overview_rows(source, run_id)
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
    lo = t0 - tr["max_dur"] - 1  # lets the primary key prune by start_ns
    base = {"run": run_id, "t0": t0, "t1": t1, "lo": lo}
    where = (
        "run_id = {run:String} AND start_ns < {t1:Int64} AND start_ns >= {lo:Int64}"
        " AND end_ns >= {t0:Int64}"
    )
    bars = _ids(
        query_rows(
            source,
            f"""
        SELECT toString(span_id) AS id, host, pid, tid, lane, category, name, depth,
               start_ns, end_ns
        FROM __db__.spans WHERE {where} AND end_ns - start_ns >= {{min:Int64}}
        ORDER BY end_ns - start_ns DESC, start_ns LIMIT {{cap:UInt32}}
        """,
            {**base, "min": bucket, "cap": MAX_BARS + 1},
        )
    )
    threshold, capped = bucket, False
    if len(bars) > MAX_BARS:
        # Keep the bars strictly longer than the first one left out; the rest become density.
        cut = bars[MAX_BARS]["end_ns"] - bars[MAX_BARS]["start_ns"]
        threshold, capped = cut + 1, True
        bars = [b for b in bars[:MAX_BARS] if b["end_ns"] - b["start_ns"] >= threshold]
    pinned = _pins(source, where, base, threshold, tr["tracks"])
    cells = source.query_arrow(
        f"""
        SELECT host, pid, tid, lane, depth,
               intDiv(greatest(start_ns, {{t0:Int64}}) - {{t0:Int64}}, {{bucket:Int64}}) AS bucket,
               count() AS n,
               sum(least(end_ns, {{t1:Int64}}) - greatest(start_ns, {{t0:Int64}})) AS busy_ns
        FROM __db__.spans WHERE {where} AND end_ns - start_ns < {{thr:Int64}}
        GROUP BY host, pid, tid, lane, depth, bucket
        """,
        {**base, "bucket": bucket, "thr": threshold},
    )
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
    source: ReadOnlyStore, run_id: str, wanted: overview.CellPins, drawn: list[dict[str, object]]
) -> list[tuple[dict[str, object], int, int, int]]:
    """The overview cells' longest spans that a zoomed-out window draws anyway, read from the
    store by where they start (the primary key: a few granules), with the row and bucket of
    the density cell each was counted in and its length. One already drawn (a short step or batch) is left out."""
    if not len(wanted.start_ns):
        return []
    rows = _ids(
        query_rows(
            source,
            """
            SELECT toString(span_id) AS id, host, pid, tid, lane, category, name, depth,
                   start_ns, end_ns
            FROM __db__.spans
            WHERE run_id = {run:String} AND start_ns IN {starts:Array(Int64)}
            """,
            {"run": run_id, "starts": sorted({int(x) for x in wanted.start_ns})},
        )
    )
    by_key: dict[tuple[object, ...], list[dict[str, object]]] = {}
    for r in rows:
        key = (r["host"], r["pid"], r["tid"], r["lane"], r["depth"], r["start_ns"],
               r["end_ns"] - r["start_ns"])  # fmt: skip
        by_key.setdefault(key, []).append(r)
    seen = {(b["span_id"], b["start_ns"]) for b in drawn}
    out = []
    for k, start, dur, row, cell in zip(
        wanted.keys, wanted.start_ns, wanted.dur_ns, wanted.row, wanted.bucket
    ):
        key = (k["host"], k["pid"], k["tid"], k["lane"], k["depth"], int(start), int(dur))
        found = by_key.get(key)
        if not found:
            continue
        b = found.pop(0)
        if (b["span_id"], b["start_ns"]) in seen:
            continue
        seen.add((b["span_id"], b["start_ns"]))
        out.append(({**b, "pinned": True}, int(row), int(cell), int(dur)))
    return out


def _pins(
    source: ReadOnlyStore, where: str, params: dict[str, object], threshold: int,
    tracks: list[TrackInfo],
) -> list[dict[str, object]]:  # fmt: skip
    """The spans of a zoomed-in window narrower than ``threshold`` that are drawn as bars
    anyway: the longest of each row in each of :data:`PINS_PER_ROW` parts of the window and
    the :data:`MAX_PINNED_KINDS` longest steps and forwarded batches (:func:`overview.pick_pins`,
    the rule of zoomed-out windows). One ``argMax`` per track, depth and part (a sort of the
    window's spans by length, ``LIMIT BY``, took ten times as long)."""
    t0, t1 = int(str(params["t0"])), int(str(params["t1"]))
    narrow = f"{where} AND end_ns >= start_ns AND end_ns - start_ns < {{thr:Int64}}"
    query = {**params, "thr": threshold, "cap": MAX_PINNED_KINDS,
             "part": max(1, -(-(t1 - t0) // PINS_PER_ROW)),
             "cats": list(overview.PIN_CATEGORIES), "lanes": list(overview.PIN_LANES)}  # fmt: skip
    longest = source.query_arrow(
        f"""
        SELECT toString(top.1) AS id, host, pid, tid, lane, top.2 AS category, top.3 AS name,
               depth, top.4 AS start_ns, top.5 AS end_ns
        FROM (
            SELECT host, pid, tid, lane, depth,
                   argMax((span_id, category, name, start_ns, end_ns),
                          (end_ns - start_ns, -start_ns)) AS top
            FROM __db__.spans WHERE {narrow}
            GROUP BY host, pid, tid, lane, depth,
                     intDiv(greatest(start_ns, {{t0:Int64}}) - {{t0:Int64}}, {{part:Int64}})
        )
        """,
        query,
    )
    kinds = source.query_arrow(
        f"""
        SELECT toString(span_id) AS id, host, pid, tid, lane, category, name, depth, start_ns,
               end_ns
        FROM __db__.spans WHERE {narrow}
          AND (category IN {{cats:Array(String)}} OR lane IN {{lanes:Array(String)}})
        ORDER BY end_ns - start_ns DESC, start_ns LIMIT {{cap:UInt32}}
        """,
        query,
    )
    tables = [t.cast(overview.plain(t.schema)) for t in (longest, kinds) if t.num_rows]
    if not tables:
        return []
    found = pa.concat_tables([t.cast(tables[0].schema) for t in tables])
    start, end = found["start_ns"].to_numpy(), found["end_ns"].to_numpy()
    kind = pc.or_(
        pc.is_in(found["category"], pa.array(overview.PIN_CATEGORIES)),
        pc.is_in(found["lane"], pa.array(overview.PIN_LANES)),
    ).to_numpy(zero_copy_only=False)
    keep = overview.pick_pins(
        track_rows(found, tracks), overview.window_part(start, t0, t1, PINS_PER_ROW),
        end - start, kind.astype(bool), MAX_PINNED_KINDS, start,
    )  # fmt: skip
    out: list[dict[str, object]] = []
    seen = set()
    for b in _ids(found.take(pa.array(keep, pa.int64())).to_pylist()):
        if (b["span_id"], b["start_ns"]) not in seen:  # a step or batch found twice
            seen.add((b["span_id"], b["start_ns"]))
            out.append({**b, "pinned": True})
    return out


def flows(source: ReadOnlyStore, run_id: str, t0: int, t1: int) -> dict[str, Any]:
    """Links from a span to its children in another process (forwarded calls to server spans)
    that overlap the window: ``{"links": [...], "total": N}`` (at most :data:`MAX_FLOWS` links)."""
    known = source.cache.get(("tracks", run_id))
    if known is not None and not known["server_tracks"]:
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
    return {"links": rows, "total": total}


def counter_series(source: ReadOnlyStore, run_id: str) -> list[dict[str, Any]]:
    """Counter metrics of a run: source, metric, samples (cached per run)."""
    return source.cached(
        ("counter_series", run_id),
        lambda: query_rows(
            source,
            """
            SELECT source, metric, count() AS samples FROM __db__.counters
            WHERE run_id = {run:String} GROUP BY source, metric ORDER BY source, metric
            """,
            {"run": run_id},
        ),
    )


#: A counter sample's series: its host, device, tenant and session (a tenant's sessions are lines
#: of their own: two sessions of one tenant were one line, their samples interleaved).
_SERIES = """concat(host, if(device = '', '', concat(' ', device)),
    if(labels['tenant'] != '', concat(' tenant ', labels['tenant']), ''),
    if(labels['session'] != '', concat(' session ', labels['session']), ''))"""


def counters(
    source: ReadOnlyStore, run_id: str, metrics: list[str], t0: int, t1: int, width_px: int = 1600
) -> dict[str, list[dict[str, Any]]]:
    """Samples of ``metrics`` (``source/metric``) in the window, averaged per bucket of two
    pixels: ``{"source/metric": [{"series", "ts_ns", "value", "max"}...]}``, ordered by time,
    with each series' last sample before the window and first after it (a counter's value
    holds until its next sample: the figure draws them as steps)."""
    wanted = [m.split("/", 1) for m in metrics if "/" in m]
    if not wanted:
        return {}
    bucket = max(1, -(-(int(t1) - int(t0)) // max(1, int(width_px) // 2)))
    rows = query_rows(
        source,
        f"""
        SELECT source, metric, {_SERIES} AS series,
               intDiv(ts_ns - {{t0:Int64}}, {{bucket:Int64}}) AS b,
               min(ts_ns) AS first_ns, avg(value) AS mean, max(value) AS max
        FROM __db__.counters
        WHERE run_id = {{run:String}} AND ts_ns >= {{t0:Int64}} AND ts_ns < {{t1:Int64}}
          AND concat(source, '/', metric) IN {{wanted:Array(String)}}
        GROUP BY source, metric, series, b ORDER BY source, metric, series, b
        """,
        {
            "run": run_id,
            "t0": int(t0),
            "t1": int(t1),
            "bucket": bucket,
            "wanted": [f"{s}/{m}" for s, m in wanted],
        },
    )
    # The last sample before the window and the first after it, per series: a counter holds
    # its value between samples, so a window narrower than the sampling interval still has one.
    edges = query_rows(
        source,
        f"""
        SELECT source, metric, {_SERIES} AS series, ts_ns >= {{t1:Int64}} AS after,
               if(after, min(ts_ns), max(ts_ns)) AS ts,
               if(after, argMin(value, ts_ns), argMax(value, ts_ns)) AS value
        FROM __db__.counters
        WHERE run_id = {{run:String}} AND (ts_ns < {{t0:Int64}} OR ts_ns >= {{t1:Int64}})
          AND concat(source, '/', metric) IN {{wanted:Array(String)}}
        GROUP BY source, metric, series, after
        """,
        {"run": run_id, "t0": int(t0), "t1": int(t1), "wanted": [f"{s}/{m}" for s, m in wanted]},
    )
    out: dict[str, list[dict[str, Any]]] = {f"{s}/{m}": [] for s, m in wanted}
    for r in sorted(edges, key=lambda r: r["after"]):
        if not r["after"]:
            out[f"{r['source']}/{r['metric']}"].append(
                {"series": r["series"], "ts_ns": r["ts"], "value": r["value"], "max": r["value"]}
            )
    for r in rows:
        out[f"{r['source']}/{r['metric']}"].append(
            {"series": r["series"], "ts_ns": r["first_ns"], "value": r["mean"], "max": r["max"]}
        )
    for r in edges:
        if r["after"]:
            out[f"{r['source']}/{r['metric']}"].append(
                {"series": r["series"], "ts_ns": r["ts"], "value": r["value"], "max": r["value"]}
            )
    return out


def clock_sync(source: ReadOnlyStore, run_id: str) -> list[dict[str, Any]]:
    """Clock-offset measurements of a run (remote hosts): ``peer, ts_ns, offset_ns,
    uncertainty_ns`` (cached per run)."""
    return source.cached(("clock", run_id), lambda: reads.clock_sync(source, run_id))


_SPAN_COLUMNS = (
    "toString(span_id) AS id, toString(parent_span_id) AS parent_id, host, pid, tid,"
    " lane, category, name, depth, start_ns, end_ns, attrs"
)


def _ids(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Span ids travel as decimal strings (UInt64 does not fit a JavaScript number)."""
    for r in rows:
        r["span_id"] = r.pop("id")
        if "parent_id" in r:
            r["parent_span_id"] = r.pop("parent_id")
    return rows


#: Spans of a thread read at most to find a span's children by time; past it the count is a floor.
MAX_NESTED_SCAN = 1_000_000


def span(
    source: ReadOnlyStore, run_id: str, span_id: str, start_ns: int | None = None
) -> dict | None:
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
    found = _ids(
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
        rows = _ids(
            query_rows(
                source,
                f"SELECT {_SPAN_COLUMNS} FROM __db__.spans WHERE run_id = {{run:String}}"
                " AND span_id = {id:UInt64} LIMIT 1",
                {"run": run_id, "id": parent},
            )
        )
        out["parent"] = rows[0] if rows else None
    elif nesting.nests(me.category):
        rows = _ids(
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
    children = _ids(
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
        children += _ids(
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
    return out


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


def _enclosed(source: ReadOnlyStore, run_id: str, me: _Selected) -> tuple[list[int], int, bool]:
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


def same_range_in_steps(
    source: ReadOnlyStore, run_id: str, s: dict[str, Any]
) -> list[dict[str, Any]]:
    """The same range (name, lane, process) at the same position in every other step.

    A span's position is its occurrence index within the step it starts in; each other step of
    the same process (all steps if that process has none) gives its occurrence with that index,
    or its last one. Empty if the span is not inside a step.
    """
    steps = _ids(
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
        return [{**st, "step": st["name"], "current": st is mine} for st in own]
    same = _ids(
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
    out = []
    for st, found in zip(own, by_step):
        if not found:
            continue
        r = found[min(k, len(found) - 1)]
        out.append({"step": st["name"], "current": st is mine, **r})
    return out
