"""NVML sample files: record what the real source reads, play it back as a source.

A sample file is JSON lines. The first line is a header::

    {"format": "gpu-trace-nvml-samples", "version": 1, "synthetic": false, "hz": 10,
     "made_by": "...", "devices": [{"index": 0, "name": "...", "uuid": "..."}]}

and each further line is one poll of one device, exactly what the source returned::

    {"t_ns": 100000000, "device": 0, "values": {"power_w": 312.5, ...},
     "samples": {"gpu_util_pct": [[-83000000, 97.0], ...]}, "errors": {"pcie_tx_bytes_per_s":
     "NotSupported"}, "processes": [["root", 8589934592], [4194400, 1048576]],
     "events": [["xid", "79"]]}

``t_ns`` is since the recording started; sample timestamps are relative to their poll. A process
recorded as ``"root"`` is the traced program's root process: on playback it becomes the run's
root pid, so attribution can be exercised; numeric pids are played back as they are (a recorded
pid is nobody's in a later run). Errors are played back too, which makes a sample file the
fault-injecting source as well. A line polled by the slow lane says so (``"lane": "slow"``).

Playback follows the sampler's two lanes (``families.py``): each new tick (a new ``now``) of the
tick families reads the next line that holds any of them; each slow poll reads, merged, every
line up to where the tick lane is (or the next one, where no tick lane runs). A line may hold
both (files recorded before the lanes) or one lane's families (files recorded since).

A header may also give calls a latency, to play a slow or hung NVML back:
``"latency_s": {"pcie": 0.041, "utilization": 0.000002, "open": 0}``, by family name (or
``open``); ``"forever"`` never returns, and then ``close()`` waits for it too, as a driver lock
would (the sampler's watchdog must cope).

Record one on a machine with a GPU: ``python -m gpu_trace.collectors.nvml record FILE``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TextIO

from gpu_trace.collectors.nvml import (
    DeviceInfo,
    NvmlSampler,
    NvmlSource,
    NvmlUnavailable,
    Reading,
)
from gpu_trace.collectors.nvml.families import ALL, EVENTS, FAMILY_OF, PROCESSES, TICK, lane_of
from gpu_trace.tracer.buffer import ThreadBuffer
from gpu_trace.tracer.clock import now_ns

#: One parsed line of a sample file (JSON: its shape is the module docstring's).
Line = dict[str, Any]

FORMAT = "gpu-trace-nvml-samples"
VERSION = 1
ROOT = "root"


class ReplaySource:
    """Plays a sample file back, by lane (see the module docstring).

    ``root_pid`` gives the pid that recorded ``"root"`` processes become (the run's root, known
    only once the program started). With ``loop`` the file starts over when it runs out;
    without, an exhausted device reads nothing.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        root_pid: Callable[[], int | None] | None = None,
        loop: bool = True,
    ) -> None:
        self.path = Path(path)
        self.description = f"replay:{self.path.name}"
        self.root_pid = root_pid or (lambda: None)
        self.loop = loop
        self.header: Line = {}
        self.latency_s: dict[str, float | None] = {}  # None: forever
        self._records: dict[int, list[Line]] = {}
        # (device, lane) -> (the poll's now, first line, end line): absolute line numbers
        self._cursor: dict[tuple[int, str], tuple[int, int, int]] = {}
        self._driver = threading.Lock()  # held by a call that never returns, as a driver's
        self._never = threading.Event()

    def open(self) -> Sequence[DeviceInfo]:
        try:
            lines = self.path.read_text().splitlines()
            self.header = json.loads(lines[0]) if lines else {}
        except (OSError, ValueError) as exc:
            raise NvmlUnavailable(f"cannot read NVML sample file {self.path}: {exc}") from None
        if not isinstance(self.header, dict) or self.header.get("format") != FORMAT:
            raise NvmlUnavailable(f"{self.path} is not a gpu-trace NVML sample file")
        n = 1
        try:
            self.latency_s = _latencies(self.header.get("latency_s") or {})
            devices = [
                DeviceInfo(int(d["index"]), str(d["name"]), str(d["uuid"]))
                for d in self.header["devices"]
            ]
            for line in lines[1:]:
                n += 1
                if line.strip():
                    rec = json.loads(line)
                    self._records.setdefault(int(rec["device"]), []).append(rec)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise NvmlUnavailable(f"{self.path}: malformed at line {n}: {exc}") from None
        self._delay("open")
        return devices

    def _delay(self, family: str) -> None:
        if family not in self.latency_s:
            return
        seconds = self.latency_s[family]
        if seconds is None:
            with self._driver:
                self._never.wait()
        elif seconds > 0:
            time.sleep(seconds)

    def poll(self, index: int, metrics: Collection[str], now: int) -> Reading:
        family = next((FAMILY_OF[m].name for m in metrics if m in FAMILY_OF), "")
        self._delay(family)
        records = self._records.get(index) or []
        if not records:
            return Reading()
        lane = lane_of(metrics)
        first, end = self._lines(index, lane, records, now)
        n = len(records)
        chosen = [records[i % n] for i in range(first, end) if self.loop or i < n]
        return self._reading(chosen, metrics, now)

    def _lines(self, index: int, lane: str, records: list[Line], now: int) -> tuple[int, int]:
        key = (index, lane)
        cursor = self._cursor.get(key)
        if cursor is not None and cursor[0] == now:  # another family of the same poll
            return cursor[1], cursor[2]
        start = cursor[2] if cursor is not None else 0
        n = len(records)
        if lane == TICK:
            first = start
            for _ in range(n):  # the next line with any tick family in it
                if _has_lane(records[first % n], TICK):
                    break
                first += 1
            end = first + 1
        else:  # up to where the tick lane is, and the slow lines recorded right after it
            tick = self._cursor.get((index, TICK))
            first, end = start, max(start + 1, tick[2] if tick is not None else 0)
            while (self.loop or end < n) and records[end % n].get("lane") == lane:
                end += 1
                if end - first >= n:
                    break
        self._cursor[key] = (now, first, end)
        return first, end

    def _reading(self, chosen: list[Line], metrics: Collection[str], now: int) -> Reading:
        out = Reading()
        for rec in chosen:
            for m, v in rec.get("values", {}).items():
                if m in metrics:
                    out.values[m] = float(v)
            for m, s in rec.get("samples", {}).items():
                if m in metrics:
                    out.samples.setdefault(m, []).extend((now + int(dt), float(v)) for dt, v in s)
            for m, e in rec.get("errors", {}).items():
                if m in metrics:
                    out.errors[m] = str(e)
            if PROCESSES in metrics and "processes" in rec:
                root = self.root_pid()
                processes: list[tuple[int, int]] = []
                for pid, used in rec["processes"]:
                    if pid != ROOT:
                        processes.append((int(pid), int(used)))
                    elif root is not None:
                        processes.append((root, int(used)))
                out.processes = processes
            if EVENTS in metrics:
                out.events.extend((str(k), str(d)) for k, d in rec.get("events", []))
        return out

    def close(self) -> None:
        with self._driver:  # waits for a call that never returns, as closing a hung driver does
            pass


def _has_lane(rec: Line, lane: str) -> bool:
    """Whether a line is for ``lane``: lines recorded since the lanes say which (``"lane"``,
    absent for the tick lane); older lines are for both."""
    return rec.get("lane", lane) == lane


def _latencies(given: dict[str, object]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, value in dict(given).items():
        if name not in ALL and name != "open":
            raise ValueError(f"latency_s: unknown family {name!r}")
        out[name] = None if value == "forever" else float(value)  # type: ignore[arg-type]
    return out


class RecordingSource:
    """Wraps a source and writes everything it reads to a sample file (the recording mode)."""

    def __init__(
        self,
        inner: NvmlSource,
        out: TextIO,
        *,
        hz: float,
        made_by: str,
        synthetic: bool = False,
        note: str = "",
        root_pid: int | None = None,
        clock: Callable[[], int] = now_ns,
    ) -> None:
        self.inner = inner
        self.out = out
        self.description = inner.description
        self.hz = hz
        self.made_by = made_by
        self.synthetic = synthetic
        self.note = note
        self.root = root_pid
        self.clock = clock
        self.polls = 0
        self._t0 = 0
        self._lock = threading.Lock()  # the two lanes poll from two threads
        self._pending: dict[tuple[int, str], tuple[int, Reading]] = {}

    def open(self) -> Sequence[DeviceInfo]:
        devices = self.inner.open()
        self._t0 = self.clock()
        header = {
            "format": FORMAT,
            "version": VERSION,
            "synthetic": self.synthetic,
            "hz": self.hz,
            "made_by": self.made_by,
            **({"note": self.note} if self.note else {}),
            "devices": [{"index": d.index, "name": d.name, "uuid": d.uuid} for d in devices],
        }
        self.out.write(json.dumps(header) + "\n")
        return devices

    def poll(self, index: int, metrics: Collection[str], now: int) -> Reading:
        """Read through; the families of one lane's poll (same ``now``) become one line."""
        reading = self.inner.poll(index, metrics, now)
        key = (index, lane_of(metrics))
        with self._lock:
            # a poll of a later tick closes this device's lines of earlier ones, in time order
            done = [k for k, (t, _) in self._pending.items() if k[0] == index and t != now]
            for k in sorted(done, key=lambda k: (self._pending[k][0], k[1] != TICK)):
                self._write(k, *self._pending.pop(k))
            pending = self._pending.get(key)
            if pending is None:
                self._pending[key] = (now, _copy(reading))
            else:
                _merge(pending[1], reading)
        return reading

    def _write(self, key: tuple[int, str], now: int, reading: Reading) -> None:
        rec = to_record(reading, key[0], now - self._t0, now, self.root)
        if key[1] != TICK:
            rec["lane"] = key[1]
        self.out.write(json.dumps(rec) + "\n")
        self.polls += 1

    def close(self) -> None:
        with self._lock:
            for key, (now, reading) in sorted(
                self._pending.items(), key=lambda kv: (kv[1][0], kv[0][1] != TICK)
            ):
                self._write(key, now, reading)
            self._pending.clear()
        self.inner.close()
        self.out.flush()


def _copy(reading: Reading) -> Reading:
    out = Reading()
    _merge(out, reading)
    return out


def _merge(into: Reading, reading: Reading) -> None:
    into.values.update(reading.values)
    for m, s in reading.samples.items():
        into.samples.setdefault(m, []).extend(s)
    into.errors.update(reading.errors)
    if reading.processes is not None:
        into.processes = list(reading.processes)
    into.events.extend(reading.events)


def to_record(reading: Reading, index: int, t_ns: int, now: int, root: int | None) -> dict:
    """One line of a sample file from one reading (sample times made relative to ``now``)."""
    rec: Line = {"t_ns": t_ns, "device": index, "values": reading.values}
    if reading.samples:
        rec["samples"] = {m: [[ts - now, v] for ts, v in s] for m, s in reading.samples.items()}
    if reading.errors:
        rec["errors"] = reading.errors
    if reading.processes is not None:
        rec["processes"] = [[ROOT if pid == root else pid, used] for pid, used in reading.processes]
    if reading.events:
        rec["events"] = [list(e) for e in reading.events]
    return rec


class _Discard:
    """A sink that keeps nothing: recording mode wants the file, not the counters."""

    def __init__(self) -> None:
        self._local = threading.local()

    def buffer(self) -> ThreadBuffer:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = ThreadBuffer(0)
        return buf


def main(argv: list[str]) -> int:
    """``record FILE [--hz N] [--seconds S] [--pid PID]``: record this machine's GPUs."""
    parser = argparse.ArgumentParser(prog="python -m gpu_trace.collectors.nvml")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("record", help="record an NVML sample file from this machine's GPUs")
    p.add_argument("file", type=Path)
    p.add_argument("--hz", type=float, default=10.0, help="polls per second (default 10)")
    p.add_argument("--seconds", type=float, default=10.0, help="how long (default 10)")
    p.add_argument("--pid", type=int, help="a process whose GPU memory is recorded as 'root'")
    p.add_argument(
        "--families",
        default="all",
        help="NVML families to record, as GPU_TRACE_NVML_FAMILIES takes them (default: all)",
    )
    args = parser.parse_args(argv)
    from gpu_trace.collectors.nvml import wants_buffers
    from gpu_trace.collectors.nvml.families import parse
    from gpu_trace.collectors.nvml.live import PynvmlSource

    try:
        families = parse(args.families)
    except ValueError as exc:
        parser.error(str(exc))
    with args.file.open("w") as out:
        made_by = "python -m gpu_trace.collectors.nvml record " + " ".join(argv[1:])
        source = RecordingSource(
            PynvmlSource(buffers=wants_buffers(families)),
            out,
            hz=args.hz,
            made_by=made_by,
            root_pid=args.pid,
        )
        try:
            sampler = NvmlSampler(_Discard(), source, args.hz, families=families)
        except NvmlUnavailable as exc:
            print(f"gpu-trace: cannot record: {exc}", file=sys.stderr)
            return 1
        sampler.start()
        try:
            time.sleep(args.seconds)
        except KeyboardInterrupt:
            pass
        finally:
            sampler.stop()
    names = ", ".join(d.info.name for d in sampler.devices)
    print(f"gpu-trace: recorded {source.polls} polls of {names} into {args.file}", file=sys.stderr)
    for name, st in sorted(sampler.call_stats().items()):  # what each family's calls cost here
        figures = " ".join(f"{k} {v:.1f}" for k, v in st.items() if k != "n")
        print(f"  {name:24} {int(st['n']):6d} calls  {figures}", file=sys.stderr)
    return 0
