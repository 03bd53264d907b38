"""A run's timeline tracks: one per host, process, thread and lane, with the rows it takes.

What the tracks are comes from the run's overview (:mod:`gpu_trace.query.overview`: spans,
depths and the longest span per track, in its one scan), who they belong to from the store (a
server track's tenants and clock uncertainty, a client process's sessions, thread names). Their
order is the timeline's, top to bottom (:func:`tracks`); :func:`track_rows` places any table of
spans or cells on those rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np
import pyarrow as pa

from gpu_trace.query import overview, reads
from gpu_trace.query.gpu_work import device_lane
from gpu_trace.query.source import Source
from gpu_trace.query.source import rows as query_rows

#: Nesting levels drawn per track; deeper spans share the last level.
MAX_LEVELS = 4

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


class Tracks(TypedDict):
    """A run's tracks (:func:`tracks`)."""

    tracks: list[TrackInfo]
    rows: int  # timeline rows of all tracks
    max_dur: int  # the longest span's length
    unended: int  # spans that end before they start (never closed): not drawn
    server_tracks: int  # tracks holding spans of category ``server``


#: The timeline rows of an overview's grid cells and of its long spans (:func:`overview_rows`).
OverviewRows = tuple[np.ndarray, np.ndarray]


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
_LANE_ORDER = (
    "steps", "nvtx/", "torch/", "cuda_api", "cpu/", "forward/", "server/", "gpu", "nvml/",
)  # fmt: skip


def _lane_rank(track: dict[str, Any], servers: set[tuple[str, int]]) -> tuple[Any, ...]:
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


def track_rows(table: pa.Table, tracks: list[TrackInfo]) -> np.ndarray:
    """The timeline row of each row of ``table`` (columns host, pid, tid, lane, depth): its
    track's first row plus its level; -1 where the track is not drawn."""
    if not table.num_rows:
        return np.zeros(0, np.int64)
    code, first_of = overview.track_codes(table)
    keys = table.select(["host", "pid", "tid", "lane"]).take(pa.array(first_of, pa.int64()))
    by_key = {t.key: t for t in tracks}
    found = [by_key.get((str(k["host"]), int(k["pid"]), int(k["tid"]), str(k["lane"])))
             for k in keys.to_pylist()]  # fmt: skip
    first = np.array([t.row if t else -1 for t in found], np.int64)
    lowest = np.array([t.min_depth if t else 0 for t in found], np.int64)
    levels = np.array([t.levels if t else 1 for t in found], np.int64)
    depth = table["depth"].to_numpy().astype(np.int64)
    row = first[code] + np.clip(depth - lowest[code], 0, levels[code] - 1)
    return np.where(first[code] >= 0, row, -1)


def overview_rows(ov: overview.Overview, tracks: list[TrackInfo]) -> OverviewRows:
    """Timeline rows of the overview's grid cells and long spans."""
    return track_rows(ov.grid, tracks), track_rows(ov.long, tracks)


def tracks(source: Source, run_id: str, ov: overview.Overview) -> Tracks:
    """Tracks of a run (``ov``: its overview), grouped host > process > thread > lane (remote
    server tracks last).

    Returns ``{"tracks": [TrackInfo], "rows": N, "max_dur": ns, "unended": N, "server_tracks": N}``
    (tracks holding spans of category ``server``).
    ``unended`` counts spans that end before they start (never closed): they can't be drawn, and
    the page says how many there are.
    """

    found = overview.track_totals(ov)
    server = {
        (c["host"], int(c["pid"]), int(c["tid"]), c["lane"]): c
        for c in query_rows(source, _SERVER_TRACKS, {"run": run_id})
    }
    names = {(t["host"], t["pid"], t["tid"]): t for t in reads.threads(source, run_id)}
    clients = (
        {(c["host"], int(c["pid"])): c for c in query_rows(source, _CLIENT_OWNERS, {"run": run_id})}
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


__all__ = [
    "MAX_LEVELS",
    "OverviewRows",
    "Track",
    "TrackInfo",
    "Tracks",
    "overview_rows",
    "track_rows",
    "tracks",
]
