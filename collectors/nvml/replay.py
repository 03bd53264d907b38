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
fault-injecting source as well.

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
    EVENTS,
    PROCESSES,
    DeviceInfo,
    NvmlSampler,
    NvmlSource,
    NvmlUnavailable,
    Reading,
)
from gpu_trace.tracer.buffer import ThreadBuffer
from gpu_trace.tracer.clock import now_ns

FORMAT = "gpu-trace-nvml-samples"
VERSION = 1
ROOT = "root"


class ReplaySource:
    """Plays a sample file back: each poll of a device returns that device's next recorded poll.

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
        self.header: dict[str, Any] = {}
        self._records: dict[int, list[dict[str, Any]]] = {}
        self._next: dict[int, int] = {}

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
            devices = [
                DeviceInfo(int(d["index"]), str(d["name"]), str(d["uuid"]))
                for d in self.header["devices"]
            ]
            for line in lines[1:]:
                n += 1
                if line.strip():
                    rec = json.loads(line)
                    self._records.setdefault(int(rec["device"]), []).append(rec)
        except (KeyError, TypeError, ValueError) as exc:
            raise NvmlUnavailable(f"{self.path}: malformed at line {n}: {exc}") from None
        return devices

    def poll(self, index: int, metrics: Collection[str], now: int) -> Reading:
        records = self._records.get(index) or []
        i = self._next.get(index, 0)
        if i >= len(records):
            if not self.loop or not records:
                return Reading()
            i = 0
        self._next[index] = i + 1
        rec = records[i]
        out = Reading(
            values={m: float(v) for m, v in rec.get("values", {}).items() if m in metrics},
            samples={
                m: [(now + int(dt), float(v)) for dt, v in s]
                for m, s in rec.get("samples", {}).items()
                if m in metrics
            },
            errors={m: str(e) for m, e in rec.get("errors", {}).items() if m in metrics},
        )
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
            out.events = [(str(k), str(d)) for k, d in rec.get("events", [])]
        return out

    def close(self) -> None:
        pass


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
        reading = self.inner.poll(index, metrics, now)
        self.out.write(json.dumps(to_record(reading, index, now - self._t0, now, self.root)) + "\n")
        self.polls += 1
        return reading

    def close(self) -> None:
        self.inner.close()
        self.out.flush()


def to_record(reading: Reading, index: int, t_ns: int, now: int, root: int | None) -> dict:
    """One line of a sample file from one reading (sample times made relative to ``now``)."""
    rec: dict[str, Any] = {"t_ns": t_ns, "device": index, "values": reading.values}
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
    args = parser.parse_args(argv)
    from gpu_trace.collectors.nvml.live import PynvmlSource

    with args.file.open("w") as out:
        made_by = "python -m gpu_trace.collectors.nvml record " + " ".join(argv[1:])
        source = RecordingSource(
            PynvmlSource(), out, hz=args.hz, made_by=made_by, root_pid=args.pid
        )
        try:
            sampler = NvmlSampler(_Discard(), source, args.hz)
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
    return 0
