"""Raw GPU activity records to spans: clock, threads, names, lanes, attributes and correlation.

Every record, live or replayed, arrives here as a :data:`~.activity.RECORD` array, and leaves as
rows of the ``spans`` table (``tracer/records.py``), built column by column with numpy and Arrow
compute: no per-record Python on this path (``bench/gpu_activity.py`` measures it).

- **Device work** (kernels, copies, memsets) goes on lane ``gpu<device>/stream<stream>``, with
  PyTorch's profiler's argument names as attributes (``correlation``, ``device``, ``context``,
  ``stream``, ``grid`` as ``[x, y, z]``, ``registers per thread``, ``shared memory``, ``bytes``,
  ``memory bandwidth (GB/s)``...), so an exporter in that dialect maps them one to one.
- **API calls** (CUDA runtime and driver) go on lane ``cuda_api`` of the calling thread, named by
  their function (``cbid_names.py``), with ``correlation``, ``cbid`` and ``api``
  (``runtime``/``driver``).
- **Synchronizations** (``cuda_sync``): the CPU waiting on a stream, event or context.

Correlation: an API call's span id is a hash of its process and CUPTI correlation id, so the
device work it issued names it as parent without a join, even from another buffer or file. The
API call's own parent is the innermost span open on its thread when it was made (an op, module,
NVTX range or step, from the recorder's spans, :func:`innermost`), a driver call's possibly the
runtime call around it. Device records whose API call is missing keep ``parent_span_id = 0`` and
are counted (``Conversion.unmatched``).

This decides what each record becomes; the Arrow columns of its rows (strings, dictionaries,
attribute maps, the API and device tables) are built in
:mod:`gpu_trace.collectors.gpu_activity.span_columns`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.collectors.gpu_activity import activity as act
from gpu_trace.collectors.gpu_activity.span_columns import api_table, device_table
from gpu_trace.tracer.columns import empty_table
from gpu_trace.tracer.records import (
    CUDA_API,
    CUDA_SYNC,
    KERNEL,
    MEMCPY,
    MEMSET,
)

#: Categories of recorder spans an API call can be the child of.
PARENT_CATEGORIES = ("op", "module", "nvtx", "forward", "step", "otel")
_SALT_API = np.uint64(0x9E3779B97F4A7C15)
_SALT_DEVICE = np.uint64(0xC2B2AE3D27D4EB4F)
_SALT_SYNC = np.uint64(0x165667B19E3779F9)


@dataclass
class Parents:
    """Spans an API call can be nested in (the recorder's), as columns."""

    pid: np.ndarray
    tid: np.ndarray
    lane: np.ndarray  # lane codes (any integer per lane)
    span_id: np.ndarray
    parent_span_id: np.ndarray
    start: np.ndarray
    end: np.ndarray
    depth: np.ndarray

    @staticmethod
    def none() -> Parents:
        z = np.zeros(0, np.int64)
        u = np.zeros(0, np.uint64)
        return Parents(z, u, z, u, u, z, z, z)

    @staticmethod
    def from_table(table: pa.Table) -> Parents:
        """The recorder's spans of ``table`` (a ``spans`` table) that can hold an API call."""
        cats = table.column("category")
        if pa.types.is_dictionary(cats.type):
            cats = cats.cast(pa.string())
        t = table.filter(pc.is_in(cats, value_set=pa.array(PARENT_CATEGORIES)))
        lane = t.column("lane")
        if pa.types.is_dictionary(lane.type):
            lane = lane.cast(pa.string())
        lane_codes = pc.dictionary_encode(lane.combine_chunks()).indices

        def col(name: str, dtype: type) -> np.ndarray:
            return np.asarray(t.column(name).to_numpy(), dtype=dtype)

        return Parents(
            col("pid", np.int64),
            col("tid", np.uint64),
            np.asarray(lane_codes.to_numpy(zero_copy_only=False), np.int64),
            col("span_id", np.uint64),
            col("parent_span_id", np.uint64),
            col("start_ns", np.int64),
            col("end_ns", np.int64),
            col("depth", np.int64),
        )


@dataclass
class Conversion:
    """The spans made from a set of records, and what could not be tied together."""

    table: pa.Table
    counts: dict[str, int] = field(default_factory=dict)
    unmatched: int = 0  # device or sync records whose API call is not among the records
    api_without_parent: int = 0  # API calls outside every recorder span of their thread


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 values: stable, well-spread span ids."""
    z = np.asarray(x, np.uint64).copy()
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    z[z == 0] = 1  # 0 means "no parent"
    return z


def api_span_ids(pid: np.ndarray, correlation: np.ndarray) -> np.ndarray:
    """The span id of the API call ``correlation`` of process ``pid``."""
    key = (np.asarray(pid, np.uint64) << np.uint64(32)) | np.asarray(correlation, np.uint64)
    return mix(key ^ _SALT_API)


def to_monotonic(t: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """CUPTI times to ``CLOCK_MONOTONIC`` ns through anchor pairs ``(cupti_ns, monotonic_ns)``.

    One pair: a constant offset. Several: the offset interpolated linearly between the pairs
    around each time (constant beyond the first and last), computed relative to the first pair
    so that float64 never holds an absolute nanosecond time. No pairs: the times are taken as
    monotonic already.
    """
    t = np.asarray(t, np.int64)
    if len(anchors) == 0:
        return t.copy()
    a = anchors[np.argsort(anchors[:, 0], kind="stable")]
    off = a[:, 1] - a[:, 0]
    if len(a) == 1 or np.all(off == off[0]):
        return t + off[0]
    rel_t = (t - a[0, 0]).astype(np.float64)
    rel_off = np.interp(
        rel_t, (a[:, 0] - a[0, 0]).astype(np.float64), (off - off[0]).astype(np.float64)
    )
    return t + off[0] + np.rint(rel_off).astype(np.int64)


def map_threads(tid: np.ndarray, thread_map: dict[int, int] | None) -> np.ndarray:
    """CUPTI's thread ids to the OS thread ids the recorder stores (unmapped ones kept)."""
    tid = np.asarray(tid, np.uint64)
    if not thread_map:
        return tid
    keys = np.fromiter(thread_map.keys(), np.uint64, len(thread_map))
    values = np.fromiter(thread_map.values(), np.uint64, len(thread_map))
    order = np.argsort(keys)
    keys, values = keys[order], values[order]
    pos = np.clip(np.searchsorted(keys, tid), 0, len(keys) - 1)
    hit = keys[pos] == tid
    return np.where(hit, values[pos], tid)


def convert(
    records: np.ndarray,
    names: dict[int, str],
    *,
    anchors: np.ndarray | None = None,
    thread_map: dict[int, int] | None = None,
    parents: Parents | None = None,
) -> Conversion:
    """Spans from raw records (see the module docstring)."""
    records = np.asarray(records, act.RECORD)
    anchors = np.zeros((0, 2), np.int64) if anchors is None else np.asarray(anchors, np.int64)
    parents = parents or Parents.none()
    kind = records["kind"]
    start = to_monotonic(records["start"], anchors)
    end = np.maximum(to_monotonic(records["end"], anchors), start)
    pid = records["pid"].astype(np.uint64)
    tid = map_threads(records["tid"], thread_map)
    corr = records["correlation"]
    device = _devices(records)

    is_api = (kind == act.DRIVER) | (kind == act.RUNTIME)
    at = np.flatnonzero(is_api)  # a record is 104 bytes: select columns, never whole records
    a_pid, a_tid, a_start, a_end = pid[at], tid[at], start[at], end[at]
    api_ids = api_span_ids(a_pid, corr[at])
    known = np.sort(api_ids)
    conv_counts: dict[str, int] = {}
    tables: list[pa.Table] = []

    a_kind = kind[at]
    api_parent, api_depth, missing = _api_parents(
        a_kind, a_pid, a_tid, a_start, a_end, api_ids, parents
    )
    a_cols = {f: records[f][at] for f in ("kind", "correlation", "code", "ret")}
    tables.append(api_table(a_cols, a_pid, a_tid, a_start, a_end, api_ids, api_parent, api_depth))
    conv_counts[CUDA_API] = len(at)

    unmatched = 0
    for category, kinds in (
        (KERNEL, (act.CONCURRENT_KERNEL,)),
        (MEMCPY, (act.MEMCPY,)),
        (MEMSET, (act.MEMSET,)),
        (CUDA_SYNC, (act.SYNCHRONIZATION,)),
    ):
        sel = np.isin(kind, kinds)
        if not sel.any():
            continue
        r = records[sel]
        parent = api_span_ids(pid[sel], corr[sel])
        matched = _isin_sorted(parent, known)
        unmatched += int((~matched).sum())
        parent = np.where(matched, parent, np.uint64(0))
        salt = _SALT_SYNC if category == CUDA_SYNC else _SALT_DEVICE
        if category == CUDA_SYNC and len(api_ids):  # CUPTI names no thread for a sync: its call's
            by_id = np.argsort(api_ids)
            pos = np.clip(np.searchsorted(api_ids, parent, sorter=by_id), 0, len(by_id) - 1)
            tid[sel] = np.where(matched, a_tid[by_id[pos]], tid[sel])
        # one id per device record: its call, kind, stream and start (serial on a stream)
        key = parent ^ salt ^ (r["kind"].astype(np.uint64) << np.uint64(56))
        key ^= start[sel].view(np.uint64) * np.uint64(31) ^ r["stream"].astype(np.uint64)
        ids = mix(key)
        tables.append(
            device_table(
                category,
                r,
                pid[sel],
                tid[sel],
                device[sel],
                start[sel],
                end[sel],
                ids,
                parent,
                names,
            )
        )
        conv_counts[category] = int(sel.sum())
    table = pa.concat_tables(tables) if tables else empty_table()
    return Conversion(table, conv_counts, unmatched, missing)


def _devices(records: np.ndarray) -> np.ndarray:
    """Each record's device; synchronization records name only a context, so theirs comes from
    the device records of the same context (``NONE_U32`` when none is known)."""
    device = records["device"].copy()
    sync = records["kind"] == act.SYNCHRONIZATION
    if sync.any():
        dev = np.isin(records["kind"], act.DEVICE_KINDS)
        ctx, first = np.unique(records["context"][dev], return_index=True)
        if len(ctx):
            pos = np.clip(np.searchsorted(ctx, records["context"][sync]), 0, len(ctx) - 1)
            hit = ctx[pos] == records["context"][sync]
            device[sync] = np.where(hit, records["device"][dev][first][pos], act.NONE_U32)
        else:
            device[sync] = act.NONE_U32
    return device


def _isin_sorted(values: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
    if len(sorted_keys) == 0:
        return np.zeros(len(values), bool)
    pos = np.clip(np.searchsorted(sorted_keys, values), 0, len(sorted_keys) - 1)
    return sorted_keys[pos] == values


# ---- API calls and their parents -------------------------------------------------------------


def innermost(
    c_start: np.ndarray,
    c_end: np.ndarray,
    c_parent: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
) -> np.ndarray:
    """For each interval ``[start, end]``, the index of the innermost candidate containing it
    (-1: none). Candidates are one lane of one thread, sorted by start (ties: outer first), with
    ``c_parent`` the index of each one's parent (-1: a root): properly nested ranges.

    The innermost container of an interval is the last candidate to start before it, or an
    ancestor of that one (a container that started earlier and still contains it contains that
    candidate too), so a walk up the parent links, all intervals at once, finds it in at most
    the nesting depth's number of steps.
    """
    k = np.searchsorted(c_start, start, side="right") - 1
    while True:
        valid = k >= 0
        bad = valid.copy()
        bad[valid] = c_end[k[valid]] < end[valid]
        if not bad.any():
            return k
        k[bad] = c_parent[k[bad]]


def _api_parents(
    kind: np.ndarray,
    pid: np.ndarray,
    tid: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    ids: np.ndarray,
    parents: Parents,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Parent span id and depth of each API call, and how many have no parent."""
    n = len(kind)
    best_start = np.full(n, np.iinfo(np.int64).min)
    parent = np.zeros(n, np.uint64)
    depth = np.zeros(n, np.int64)
    thread = mix(pid.astype(np.uint64) << np.uint64(32) ^ tid)
    by_thread = np.argsort(thread, kind="stable")
    cuts = np.flatnonzero(np.diff(thread[by_thread])) + 1
    for mine in np.split(by_thread, cuts) if n else []:
        p, t = pid[mine[0]].astype(np.uint64), tid[mine[0]]
        cand = (parents.pid.astype(np.uint64) == p) & (parents.tid == t)
        for lane in np.unique(parents.lane[cand]):
            _nest(
                mine, cand & (parents.lane == lane), parents, start, end, best_start, parent, depth
            )
        # A driver call made inside a runtime call (cudaLaunchKernel -> cuLaunchKernel) is its child.
        runtime = mine[kind[mine] == act.RUNTIME]
        driver = mine[kind[mine] == act.DRIVER]
        if len(runtime) and len(driver):
            order = runtime[np.argsort(start[runtime], kind="stable")]
            k = innermost(
                start[order], end[order], np.full(len(order), -1), start[driver], end[driver]
            )
            hit = k >= 0
            if hit.any():
                outer = order[k[hit]]
                later = start[outer] >= best_start[driver[hit]]
                take, outer = driver[hit][later], outer[later]
                parent[take] = ids[outer]
                depth[take] = 1
                best_start[take] = start[outer]
    return parent, depth, int((parent == 0).sum())


def _nest(
    mine: np.ndarray,
    cand: np.ndarray,
    parents: Parents,
    start: np.ndarray,
    end: np.ndarray,
    best_start: np.ndarray,
    parent: np.ndarray,
    depth: np.ndarray,
) -> None:
    """Take each API call's innermost container in one lane of its thread if it started later
    than the best one found so far (in another lane)."""
    idx = np.flatnonzero(cand)
    order = idx[np.lexsort((parents.depth[idx], parents.start[idx]))]
    c_start, c_end = parents.start[order], parents.end[order]
    ids = parents.span_id[order]
    wanted = parents.parent_span_id[order]
    if not wanted.any():  # all roots (a flat lane): nothing to look up
        c_parent = np.full(len(order), -1)
    else:
        by_id = np.argsort(ids)
        sorted_ids = ids[by_id]
        pos = np.clip(np.searchsorted(sorted_ids, wanted), 0, len(ids) - 1)
        c_parent = np.where(sorted_ids[pos] == wanted, by_id[pos], -1)
    k = innermost(c_start, c_end, c_parent, start[mine], end[mine])
    hit = k >= 0
    if not hit.any():
        return
    rows = mine[hit]
    found = k[hit]
    better = c_start[found] > best_start[rows]
    rows, found = rows[better], found[better]
    parent[rows] = ids[found]
    best_start[rows] = c_start[found]
    depth[rows] = 0
