"""The tracks of a Chrome trace export: which Chrome pid and tid each recorded ``(host, pid,
tid, lane)`` is drawn on, announced by metadata events (process and thread names and sort
orders) the first time one is used, and what each Chrome pid and tid stands for (the trailer's
``processes`` and ``tracks``, which ``gpu-trace import`` reads back).

Each ``(host, pid)`` is one process, named ``"host process_name"``; a pid already used by another
host is renumbered, and its name then ends ``(pid N)``. Each ``(host, pid, tid, lane)`` is one
thread track: every lane but ``steps`` gets a synthetic tid (from :data:`SYNTHETIC_BASE` up),
since lanes of one OS thread overlap without nesting, which Chrome events on one tid must not. In
the Kineto dialect device work sits where Kineto puts it: pid the device, tid the stream. A host's
counters sit under its first process (:meth:`Tracks.counter_pid`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, MutableMapping

import numpy as np
import pyarrow as pa

from gpu_trace.export.json_fragments import dictionary, dictionary_codes, dumps, int64, uint64
from gpu_trace.tracer.records import STEP_LANE

__all__ = ["SYNTHETIC_BASE", "GPU_LANE", "DEVICE_TRACK", "Tracks"]

#: First synthetic tid (lane tracks) and pid (counter processes, renumbered pids). Linux pids and
#: tids stay below 2**22, so these never meet a real one; both stay below 2**31 for old viewers.
SYNTHETIC_BASE = 1 << 30
#: A GPU stream's lane: its spans carry ``device`` and ``stream`` from it.
GPU_LANE = re.compile(r"^gpu(\d+)/stream(\d+)$")
#: A device lane, or the lane of a GPU annotation on one stream (imported traces).
DEVICE_TRACK = re.compile(r"^gpu(\d+)/stream(\d+)(/annotations)?$")


class Tracks:
    """The Chrome pids and tids of one file being written (see the module's docstring).

    ``thread_names`` (``(host, pid, tid)``) and ``process_names`` (``(host, pid)``) name the
    tracks; ``thread_rows`` are the run's threads rows, whose processes a host's counters may sit
    under. Metadata events go out through ``put_meta(text, events)`` as each track is first
    used; ``stats`` counts ``processes`` and ``tracks``.
    """

    def __init__(
        self,
        *,
        kineto: bool,
        thread_names: dict[tuple[str, int, int], str],
        process_names: dict[tuple[str, int], str],
        thread_rows: list[dict[str, str | int]],
        stats: MutableMapping[str, int],
        put_meta: Callable[[str, int], None],
    ) -> None:
        self._kineto = kineto
        self._thread_names = thread_names
        self._process_names = process_names
        self._thread_rows = thread_rows
        self.stats = stats
        self._put_meta = put_meta
        self._hosts: dict[str, int] = {}
        self._lanes: dict[str, int] = {}
        self._lane_names: list[str] = []
        self._pids: dict[tuple[str, int], int] = {}
        self._used_pids: set[int] = set()
        self._used_tids: set[int] = set()
        self._threads: dict[tuple[int, int], tuple[int, int]] = {}  # (cpid, tid) -> (rank, lanes)
        self._known: dict[tuple[int, int, int, int], tuple[int, int, str, str]] = {}
        self._counter_pids: dict[str, int] = {}
        self._device_pids: dict[tuple[str, int], int] = {}
        self._device_streams: set[tuple[int, int]] = set()
        self._next_pid = SYNTHETIC_BASE
        self._next_tid = SYNTHETIC_BASE
        #: What each Chrome process and thread track stands for, for the trailer: the recorded
        #: host, pid and tid behind renumbered pids and synthetic tids (``gpu-trace import``).
        self.process_rows: list[dict[str, str | int | bool]] = []
        self.track_rows: list[dict[str, int]] = []

    def _meta(self, name: str, pid: int, tid: int | None, args: dict[str, object]) -> str:
        # Process-wide events carry tid 0 as Kineto's do: a missing tid turns HTA's tid column
        # into floats.
        return f',\n{{"ph":"M","name":"{name}","pid":{pid},"tid":{tid or 0},"args":{dumps(args)}}}'

    def process(self, host: str, pid: int) -> int:
        key = (host, pid)
        cpid = self._pids.get(key)
        if cpid is not None:
            return cpid
        cpid = pid
        if cpid in self._used_pids or not 0 < cpid < SYNTHETIC_BASE:
            cpid = self._new_pid()
        self._used_pids.add(cpid)
        self._pids[key] = cpid
        self.process_rows.append({"chrome_pid": cpid, "host": host, "pid": pid})
        meta = self._meta(
            "process_name", cpid, None, {"name": self._process_label(host, pid, cpid)}
        )
        meta += self._meta("process_sort_index", cpid, None, {"sort_index": len(self._pids)})
        self._put_meta(meta, 2)
        self.stats["processes"] += 1
        return cpid

    def _process_label(self, host: str, pid: int, cpid: int) -> str:
        """A process's name as a viewer shows it: Perfetto and chrome://tracing put the Chrome
        pid after it themselves, so the recorded pid is in the name only where the Chrome pid is
        not it (a pid another host took first)."""
        parts = [host, self._process_names.get((host, pid), "")]
        if cpid != pid:
            parts.append(f"(pid {pid})")
        return " ".join(p for p in parts if p) or "process"

    def _new_pid(self) -> int:
        while self._next_pid in self._used_pids:
            self._next_pid += 1
        self._next_pid += 1
        return self._next_pid - 1

    def counter_pid(self, host: str) -> int:
        """The Chrome process a host's counters sit under (Perfetto and chrome://tracing draw a
        counter event as a track of its pid's process): the host's first process in this file,
        else its first in the threads rows; only a host without either gets a process of its
        own, ``<host> counters`` on a synthetic pid."""
        cpid = self._counter_pids.get(host)
        if cpid is not None:
            return cpid
        pid = next((p for h, p in self._pids if h == host), None)
        if pid is None:
            pid = next((int(t["pid"]) for t in self._thread_rows if t["host"] == host), None)
        if pid is not None:
            cpid = self._counter_pids[host] = self.process(host, pid)
            return cpid
        cpid = self._counter_pids[host] = self._new_pid()
        self._used_pids.add(cpid)
        self.process_rows.append({"chrome_pid": cpid, "host": host, "counters": True})
        label = f"{host} counters" if host else "counters"
        meta = self._meta("process_name", cpid, None, {"name": label})
        meta += self._meta("process_sort_index", cpid, None, {"sort_index": 1 << 20})
        self._put_meta(meta, 2)
        self.stats["processes"] += 1
        return cpid

    def _track(self, host: int, pid: int, tid: int, lane: int) -> tuple[int, int, str, str]:
        """Chrome pid and tid of one lane of one thread, announcing it the first time."""
        key = (host, pid, tid, lane)
        found = self._known.get(key)
        if found is not None:
            return found
        host_name = next(h for h, i in self._hosts.items() if i == host)
        lane_name = self._lane_names[lane]
        device = DEVICE_TRACK.match(lane_name) if self._kineto else None
        if device is not None:
            found = self._known[key] = self._device_track(host_name, device)
            return found
        cpid = self.process(host_name, pid)
        rank, lanes = self._threads.get(
            (cpid, tid), (sum(1 for c, _ in self._threads if c == cpid), 0)
        )
        self._threads[(cpid, tid)] = (rank, lanes + 1)
        if lane_name == STEP_LANE and 0 < tid < SYNTHETIC_BASE and tid not in self._used_tids:
            ctid, order = tid, 0
        else:
            while self._next_tid in self._used_tids:
                self._next_tid += 1
            ctid, order = self._next_tid, lanes + 1
        self._used_tids.add(ctid)
        self.track_rows.append({"chrome_pid": cpid, "chrome_tid": ctid, "tid": tid})
        base = self._thread_names.get((host_name, pid, tid)) or f"thread {tid}"
        meta = self._meta("thread_name", cpid, ctid, {"name": f"{base} · {lane_name}"})
        meta += self._meta("thread_sort_index", cpid, ctid, {"sort_index": rank * 1024 + order})
        self._put_meta(meta, 2)
        self.stats["tracks"] += 1
        lane_args = f',"lane":{dumps(lane_name)}'
        m = GPU_LANE.match(lane_name)
        if m:
            lane_args += f',"device":{int(m.group(1))},"stream":{int(m.group(2))}'
        found = self._known[key] = (cpid, ctid, f'"pid":{cpid},"tid":{ctid}', lane_args)
        return found

    def _device_track(self, host: str, m: re.Match[str]) -> tuple[int, int, str, str]:
        """Kineto's place for device work: pid the device, tid the stream (a renumbered pid when
        the device's number is taken), one process per device and host."""
        dev, stream = int(m.group(1)), int(m.group(2))
        cpid = self._device_pids.get((host, dev))
        if cpid is None:
            cpid = dev if dev not in self._used_pids and dev < SYNTHETIC_BASE else self._new_pid()
            self._used_pids.add(cpid)
            self._device_pids[(host, dev)] = cpid
            self.process_rows.append({"chrome_pid": cpid, "host": host, "device": dev})
            label = f"{host} GPU {dev}" if host else f"GPU {dev}"
            meta = self._meta("process_name", cpid, None, {"name": label})
            meta += self._meta("process_sort_index", cpid, None, {"sort_index": 1 << 19})
            self._put_meta(meta, 2)
            self.stats["processes"] += 1
        if (cpid, stream) not in self._device_streams:
            self._device_streams.add((cpid, stream))
            meta = self._meta("thread_name", cpid, stream, {"name": f"stream {stream}"})
            meta += self._meta("thread_sort_index", cpid, stream, {"sort_index": stream})
            self._put_meta(meta, 2)
            self.stats["tracks"] += 1
        lane_args = f',"lane":{dumps(m.string)}'
        if not m.group(3):  # Kineto's GPU annotations carry neither
            lane_args += f',"device":{dev},"stream":{stream}'
        return cpid, stream, f'"pid":{cpid},"tid":{stream}', lane_args

    def columns(self, batch: pa.Table) -> tuple[np.ndarray, np.ndarray, pa.Array, pa.Array]:
        """Per row: Chrome pid, Chrome tid, the ``"pid":..,"tid":..`` and lane args fragments."""
        host_codes, host_dict = dictionary(batch["host"])
        host_map = np.array(
            [self._hosts.setdefault(h or "", len(self._hosts)) for h in host_dict.to_pylist()]
            or [0],
            dtype=np.int64,
        )
        lane_codes, lane_dict = dictionary(batch["lane"])
        lane_ids = []
        for lane in lane_dict.to_pylist():
            lane = lane or ""
            if lane not in self._lanes:
                self._lanes[lane] = len(self._lane_names)
                self._lane_names.append(lane)
            lane_ids.append(self._lanes[lane])
        lane_map = np.array(lane_ids or [0], dtype=np.int64)
        # Distinct (host, pid, tid, lane) by hashing, not sorting: one mixed-radix code per row.
        parts = [host_map[host_codes], lane_map[lane_codes]]
        values = []
        for col in (int64(batch["pid"]), uint64(batch["tid"]).view(np.int64)):
            codes, uniq = dictionary_codes(col)
            parts.append(codes)
            values.append(uniq)
        radix = [len(self._hosts), len(self._lane_names), len(values[0]), len(values[1])]
        code = np.zeros(batch.num_rows, dtype=np.int64)
        for part, r in zip(parts, radix, strict=True):
            code = code * r + part
        inverse, combos = dictionary_codes(code)
        tracks = []
        for c in combos.tolist():
            c, t = divmod(c, radix[3])
            c, p = divmod(c, radix[2])
            h, ln = divmod(c, radix[1])
            tid = int(np.int64(values[1][t]).view(np.uint64))
            tracks.append(self._track(int(h), int(values[0][p]), tid, int(ln)))
        cpid = np.array([t[0] for t in tracks], dtype=np.int64)[inverse]
        ctid = np.array([t[1] for t in tracks], dtype=np.int64)[inverse]
        idx = pa.array(inverse.astype(np.int32))
        track_frag = pa.array([t[2] for t in tracks], pa.string()).take(idx)
        lane_frag = pa.array([t[3] for t in tracks], pa.string()).take(idx)
        return cpid, ctid, track_frag, lane_frag
