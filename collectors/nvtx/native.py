"""Draining the NVTX injection library into the recorder: a :class:`~gpu_trace.tracer.recorder.Source`.

Events arrive from C as 64-byte records (``gt_event`` in ``inject.c``), copied in whole
arrays into numpy; strings arrive as ids into a table drained incrementally. Start/end ranges come
as two records (possibly from two threads, possibly in two drains) matched here by range id.
Columns are built with numpy and Arrow compute, never a Python loop per event.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.tracer.columns import columns_to_table
from gpu_trace.tracer.records import (
    ATTRS,
    MARK,
    NVTX,
    numeric_column,
    nvtx_lane,
    string_column,
)

log = logging.getLogger(__name__)

RANGE, MARK_KIND, START, END = 1, 2, 3, 4
HAS_COLOR = 1

EVENT = np.dtype(
    [
        ("span_id", "<u8"),
        ("parent", "<u8"),
        ("start_ns", "<i8"),
        ("end_ns", "<i8"),
        ("payload", "<u8"),
        ("domain", "<u4"),
        ("name", "<u4"),
        ("category", "<u4"),
        ("color", "<u4"),
        ("depth", "<u2"),
        ("kind", "u1"),
        ("flags", "u1"),
        ("tid", "<u4"),
    ]
)
assert EVENT.itemsize == 64

CHUNK = 1 << 16  # events per gt_drain call
STRING_BUF = 1 << 20
MAX_PENDING_ENDS = 1 << 16

# NVTX payload types (nvToolsExt.h) to the numpy view of the 64 raw bits.
_PAYLOAD_VIEWS = {1: "<u8", 2: "<i8", 3: "<f8", 4: "<u4", 5: "<i4", 6: "<f4"}


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the C signatures of the library's drain API."""
    c = ctypes
    lib.gt_abi_version.restype = c.c_int
    lib.gt_record_size.restype = c.c_size_t
    lib.gt_init_count.restype = c.c_int
    lib.gt_configure.argtypes = [c.c_uint64]
    lib.gt_configure.restype = None
    lib.gt_set_clock.argtypes = [c.c_int]
    lib.gt_set_clock.restype = c.c_int
    lib.gt_set_enabled.argtypes = [c.c_int]
    lib.gt_set_enabled.restype = None
    lib.gt_drain.argtypes = [c.c_void_p, c.c_size_t]
    lib.gt_drain.restype = c.c_size_t
    lib.gt_dropped.restype = c.c_uint64
    lib.gt_string_count.restype = c.c_uint32
    lib.gt_strings.argtypes = [c.c_uint32, c.c_uint32, c.c_void_p, c.c_size_t, c.c_void_p]
    lib.gt_strings.restype = c.c_uint32
    lib.gt_categories.argtypes = [c.c_size_t, c.c_void_p, c.c_size_t]
    lib.gt_categories.restype = c.c_size_t
    lib.gt_thread_names.argtypes = [c.c_size_t, c.c_void_p, c.c_size_t]
    lib.gt_thread_names.restype = c.c_size_t
    if lib.gt_record_size() != EVENT.itemsize:
        raise RuntimeError("NVTX injection library and collector disagree on the record layout")
    return lib


def format_payload(ptype: int, values: np.ndarray) -> list[str]:
    """Payload raw bits of one NVTX payload type as the strings ``str(value)`` gives in Python."""
    view = values.astype("<u8").view("<u8")
    if ptype in (4, 5, 6):
        view = (view & 0xFFFFFFFF).astype("<u4")
    typed = view.view(_PAYLOAD_VIEWS[ptype])
    return [str(v) for v in typed.tolist()]


class NativeSource:
    """The recorder's view of the injection library loaded in this process."""

    name = "nvtx"

    def __init__(self, lib: ctypes.CDLL, capacity: int, *, tsc: bool = False) -> None:
        self._lib = lib
        self._strings: list[str] = []
        self._lanes: dict[int, str] = {}
        self._categories: dict[int, str] = {}  # domain id << 32 | category -> name id
        self._thread_names: dict[int, int] = {}  # tid -> name id
        self._ncats = 0
        self._ntnames = 0
        self._pending_starts = np.empty(0, dtype=EVENT)
        self._pending_ends = np.empty(0, dtype=EVENT)
        self._chunk = np.empty(CHUNK, dtype=EVENT)
        self._strbuf = ctypes.create_string_buffer(STRING_BUF)
        self._lens = (ctypes.c_uint32 * 4096)()
        lib.gt_configure(capacity)
        #: "tsc" or "monotonic": what the hot path reads (the drained times are CLOCK_MONOTONIC
        #: ns either way). The first recorder in a process decides; it can't change afterwards.
        self.clock = "tsc" if lib.gt_set_clock(1 if tsc else 0) else "monotonic"
        lib.gt_set_enabled(1)

    # ---- Source protocol ----------------------------------------------------------------------

    def drain(self) -> Iterable[tuple[str, pa.Table]]:
        events = self._take_events()
        self._take_strings()
        self._take_tables()
        spans = self._complete(events)
        if len(spans):
            yield "spans", self._table(spans)

    def dropped(self) -> int:
        return int(self._lib.gt_dropped())

    def after_fork_in_child(self) -> None:
        # The C library's own fork handler already dropped the parent's buffered events.
        self._pending_starts = np.empty(0, dtype=EVENT)
        self._pending_ends = np.empty(0, dtype=EVENT)

    def close(self) -> None:
        self._lib.gt_set_enabled(0)

    # ---- draining -----------------------------------------------------------------------------

    def _take_events(self) -> np.ndarray:
        parts = []
        ptr = self._chunk.ctypes.data
        while True:
            n = self._lib.gt_drain(ptr, CHUNK)
            if n:
                parts.append(self._chunk[:n].copy())
            if n < CHUNK:
                break
        if not parts:
            return np.empty(0, dtype=EVENT)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _take_strings(self) -> None:
        total = self._lib.gt_string_count()
        lens = self._lens
        while len(self._strings) < total:
            first = len(self._strings)
            got = self._lib.gt_strings(
                first, min(total - first, len(lens)), self._strbuf, STRING_BUF, lens
            )
            if got == 0:  # one string larger than the buffer: grow it
                self._strbuf = ctypes.create_string_buffer(len(self._strbuf) * 4)
                continue
            raw = self._strbuf.raw
            pos = 0
            for i in range(got):
                n = lens[i]
                self._strings.append(raw[pos : pos + n].decode("utf-8", "replace"))
                pos += n

    def _take_tables(self) -> None:
        buf = (ctypes.c_uint32 * (3 * 1024))()
        while True:
            n = self._lib.gt_categories(self._ncats, buf, 1024)
            for i in range(n):
                domain, cat, name = buf[3 * i], buf[3 * i + 1], buf[3 * i + 2]
                self._categories[(domain << 32) | cat] = self._string(name)
            self._ncats += n
            if n < 1024:
                break
        while True:
            n = self._lib.gt_thread_names(self._ntnames, buf, 1024)
            for i in range(n):
                self._thread_names[buf[2 * i]] = buf[2 * i + 1]
            self._ntnames += n
            if n < 1024:
                break

    def _string(self, sid: int) -> str:
        return self._strings[sid] if sid < len(self._strings) else ""

    def _complete(self, events: np.ndarray) -> np.ndarray:
        """Finished spans: ranges and marks as they are, starts joined with their ends."""
        kind = events["kind"]
        done = events[(kind == RANGE) | (kind == MARK_KIND)]
        starts = np.concatenate([self._pending_starts, events[kind == START]])
        ends = np.concatenate([self._pending_ends, events[kind == END]])
        if not len(starts) or not len(ends):
            self._pending_starts, self._pending_ends = starts, ends[-MAX_PENDING_ENDS:]
            return done
        order = np.argsort(ends["span_id"], kind="stable")
        end_ids = ends["span_id"][order]
        pos = np.searchsorted(end_ids, starts["span_id"])
        pos_c = np.minimum(pos, len(end_ids) - 1)
        hit = end_ids[pos_c] == starts["span_id"]
        matched = starts[hit].copy()
        matched["end_ns"] = ends["start_ns"][order[pos_c[hit]]]
        matched["kind"] = RANGE
        used = np.zeros(len(ends), dtype=bool)
        used[order[pos_c[hit]]] = True
        self._pending_starts = starts[~hit]
        self._pending_ends = ends[~used][-MAX_PENDING_ENDS:]
        return np.concatenate([done, matched]) if len(matched) else done

    # ---- building the table -------------------------------------------------------------------

    def _dict_from_ids(self, ids: np.ndarray, label) -> pa.Array:
        uniq, inverse = np.unique(ids, return_inverse=True)
        values = [label(int(u)) for u in uniq]
        return pa.DictionaryArray.from_arrays(
            numeric_column(inverse, pa.int32()), string_column(values)
        )

    def _lane(self, domain: int) -> str:
        lane = self._lanes.get(domain)
        if lane is None:
            lane = self._lanes[domain] = nvtx_lane(self._string(domain) if domain else None)
        return lane

    def _table(self, ev: np.ndarray) -> pa.Table:
        category = pa.DictionaryArray.from_arrays(
            numeric_column((ev["kind"] == MARK_KIND).astype(np.int32), pa.int32()),
            string_column([NVTX, MARK]),
        )
        return columns_to_table(
            {
                "span_id": ev["span_id"],
                "parent_span_id": ev["parent"],
                "tid": ev["tid"],
                "lane": self._dict_from_ids(ev["domain"], self._lane),
                "category": category,
                "name": self._dict_from_ids(ev["name"], self._string),
                "start_ns": ev["start_ns"],
                "end_ns": ev["end_ns"],
                "depth": ev["depth"],
                "attrs": self._attrs(ev),
            },
            os.getpid(),
        )

    def _attrs(self, ev: np.ndarray) -> pa.Array:
        """The attrs map column (category, color, payload, thread name), built column-wise."""
        n = len(ev)
        keys: list[str] = []
        masks: list[np.ndarray] = []
        codes: list[np.ndarray] = []
        values: list[str] = []

        def add(key: str, mask: np.ndarray, local: np.ndarray, strings: list[str]) -> None:
            full = np.zeros(n, dtype=np.int32)
            full[mask] = local + len(values)
            values.extend(strings)
            keys.append(key)
            masks.append(mask)
            codes.append(full)

        cat_mask = ev["category"] != 0
        if cat_mask.any():
            key = (ev["domain"][cat_mask].astype(np.uint64) << np.uint64(32)) | ev["category"][
                cat_mask
            ]
            uniq, inv = np.unique(key, return_inverse=True)
            add(
                "category",
                cat_mask,
                inv,
                [self._categories.get(int(k), str(int(k) & 0xFFFFFFFF)) for k in uniq],
            )
        color_mask = (ev["flags"] & HAS_COLOR) != 0
        if color_mask.any():
            uniq, inv = np.unique(ev["color"][color_mask], return_inverse=True)
            add("color", color_mask, inv, [f"#{int(c):08x}" for c in uniq])
        ptype = ev["flags"] >> 4
        if ptype.any():
            local = np.zeros(n, dtype=np.int64)
            strings: list[str] = []
            for t in np.unique(ptype[ptype != 0]).tolist():
                if t not in _PAYLOAD_VIEWS:
                    continue
                m = ptype == t
                uniq, inv = np.unique(ev["payload"][m], return_inverse=True)
                local[m] = inv + len(strings)
                strings.extend(format_payload(t, uniq))
            pmask = np.isin(ptype, list(_PAYLOAD_VIEWS))
            add("payload", pmask, local[pmask], strings)
        if self._thread_names:
            named = np.fromiter(self._thread_names, dtype=np.uint32, count=len(self._thread_names))
            tmask = np.isin(ev["tid"], named)
            if tmask.any():
                uniq, inv = np.unique(ev["tid"][tmask], return_inverse=True)
                add(
                    "thread_name",
                    tmask,
                    inv,
                    [self._string(self._thread_names[int(t)]) for t in uniq],
                )

        offsets = np.zeros(n + 1, dtype=np.int32)
        if not keys:
            empty = string_column([])
            return pa.MapArray.from_arrays(
                numeric_column(offsets, pa.int32()), empty, empty, type=ATTRS
            )
        mask2 = np.stack(masks, axis=1)
        np.cumsum(mask2.sum(axis=1), out=offsets[1:])
        key_codes = np.broadcast_to(np.arange(len(keys), dtype=np.int32), mask2.shape)[mask2]
        value_codes = np.stack(codes, axis=1)[mask2]
        key_arr = pc.take(string_column(keys), numeric_column(key_codes, pa.int32()))
        value_arr = pc.take(string_column(values), numeric_column(value_codes, pa.int32()))
        return pa.MapArray.from_arrays(
            numeric_column(offsets, pa.int32()), key_arr, value_arr, type=ATTRS
        )
