"""A file ``gpu-trace export`` wrote (its ``gpu_trace`` trailer says so), read as the run it was
(:func:`convert_export`): span ids, parents, hosts, pids, tids, lanes, depths, attributes, counters
and the run's metadata from what the exporter wrote, nothing mapped or nested again
(docs/import.md, "gpu-trace's own exports").
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import TypeVar

import numpy as np
import pyarrow as pa

from gpu_trace.store import trace_file
from gpu_trace.store.trace_file import (
    Converted,
    Progress,
    TraceImportError,
    event_int,
    take_names,
    teller,
    to_ns,
    value_text,
    w3c_trace_id,
)
from gpu_trace.tracer.columns import columns_to_table
from gpu_trace.tracer.records import attrs_column, dict_column, numeric_column
from gpu_trace.tracer.run import RunInfo, new_run_id
from gpu_trace.tracer.trace_format import RESERVED_ARGS

__all__ = ["EXPORT_KEY", "is_export", "convert_export"]


#: The trailer ``gpu-trace export`` writes (chrome.py): a file with it is read as the run it was.
EXPORT_KEY = "gpu_trace"
#: A lane whose spans the Kineto dialect writes with ``device`` and ``stream`` from the lane.
_GPU_LANE = re.compile(r"gpu[0-9]+/stream[0-9]+")
#: Lanes of device work (on a GPU's track in the Kineto dialect), in a file without a trailer map.
_DEVICE_LANE = re.compile(r"gpu[0-9]+/stream[0-9]+(/annotations)?")
_SPAN_ID = re.compile(r"[0-9a-f]{16}")
_T = TypeVar("_T", int, str)


def is_export(data: dict[str, object]) -> bool:
    """Whether ``data`` is a file that ``gpu-trace export`` wrote (it has our trailer)."""
    info = data.get(EXPORT_KEY)
    return isinstance(info, dict) and "time_base_ns" in info


def _field(entry: dict[str, object], key: str, kind: type[_T], where: str) -> _T:
    value = entry.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        noun = "an integer" if kind is int else "text"
        raise TraceImportError(f"{where}: {key} is {value!r}, not {noun}")
    return value


def _entries(info: dict[str, object], key: str) -> list[dict[str, object]]:
    value = info.get(key, [])
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise TraceImportError(f"{EXPORT_KEY}.{key} is not a list of objects")
    return value


def _attr_text(value: object) -> str:
    """An argument's value as the attribute's text: what the exporter wrote it from."""
    if type(value) is str:
        return value
    return str(value) if type(value) is int else value_text(value)


class _Tracks:
    """What the Chrome pids and tids of one of our exports stand for (the trailer's
    ``processes`` and ``tracks``): the recorded host, pid and tid of each track."""

    def __init__(self, info: dict[str, object]) -> None:
        self.kineto = info.get("categories", "kineto") != "native"
        hosts = info.get("hosts")
        self.hosts = [h for h in hosts if isinstance(h, str)] if isinstance(hosts, list) else []
        # A file written before the trailer had the map: its one host, its pids and tids.
        self.default_host = self.hosts[0] if len(self.hosts) == 1 else ""
        self.host: dict[int, str] = {}
        self.pid: dict[int, int] = {}
        self.devices: set[int] = set()
        for entry in _entries(info, "processes"):
            cpid = _field(entry, "chrome_pid", int, f"{EXPORT_KEY}.processes")
            self.host[cpid] = _field(entry, "host", str, f"{EXPORT_KEY}.processes")
            if "pid" in entry:
                self.pid[cpid] = _field(entry, "pid", int, f"{EXPORT_KEY}.processes")
            elif "device" in entry:
                self.devices.add(cpid)
        self.tid: dict[tuple[int, int], int] = {}
        for entry in _entries(info, "tracks"):
            where = f"{EXPORT_KEY}.tracks"
            key = (_field(entry, "chrome_pid", int, where), _field(entry, "chrome_tid", int, where))
            self.tid[key] = _field(entry, "tid", int, where)

    def where(self, cpid: int, ctid: int, lane: str) -> tuple[str, int | None, int]:
        """Host, pid and tid of a span on Chrome track ``(cpid, ctid)``; pid None for device
        work on a GPU's track (its process is its launching call's), whose tid is 0."""
        host = self.host.get(cpid, self.default_host)
        if cpid in self.devices or (not self.host and self.kineto and _DEVICE_LANE.fullmatch(lane)):
            return host, None, 0
        return host, self.pid.get(cpid, cpid), self.tid.get((cpid, ctid), ctid)

    def attrs(self, args: dict[str, object], lane: str) -> dict[str, str]:
        """A span's attributes from its ``args``: less what the exporter wrote itself, with the
        ``attr.`` it put before an attribute's name taken off. On a GPU stream's lane the Kineto
        dialect wrote ``device`` and ``stream`` once, as numbers, for the attributes too."""
        lane_attrs = ("device", "stream") if self.kineto and _GPU_LANE.fullmatch(lane) else ()
        out = {}
        for key, value in args.items():
            if key in RESERVED_ARGS:
                if key in lane_attrs:
                    out[key] = _attr_text(value)
                continue
            out[key.removeprefix("attr.")] = _attr_text(value)
        return out


class _Spans:
    """Growing columns of an export's spans, turned into a ``spans`` table at the end."""

    def __init__(self) -> None:
        self.span_id: list[int] = []
        self.parent: list[int] = []
        self.host: list[str] = []
        self.pid: list[int | None] = []
        self.tid: list[int] = []
        self.lane: list[str] = []
        self.category: list[str] = []
        self.name: list[str] = []
        self.start: list[int] = []
        self.end: list[int] = []
        self.depth: list[int] = []
        self.attrs: list[dict[str, str] | None] = []

    def add(self, ev: dict[str, object], index: int, base: int, tracks: _Tracks) -> None:
        args = ev.get("args")
        if not isinstance(args, dict):
            raise TraceImportError(f"event {index}: a span of a gpu-trace export without args")
        where = f"event {index}"
        sid, cat, lane = (_field(args, k, str, where) for k in ("span_id", "category", "lane"))
        parent = args.get("parent_span_id", "0" * 16)
        if not _SPAN_ID.fullmatch(sid) or not isinstance(parent, str):
            raise TraceImportError(f"{where}: span_id {sid!r} is not 16 hex digits")
        if not _SPAN_ID.fullmatch(parent):
            raise TraceImportError(f"{where}: parent_span_id {parent!r} is not 16 hex digits")
        for key in ("ts", "name", "pid", "tid", *(("dur",) if ev.get("ph") == "X" else ())):
            if key not in ev:
                raise TraceImportError(f"{where} ({cat}) has no {key!r}")
        try:
            start = base + to_ns(ev["ts"])
            dur = to_ns(ev["dur"]) if "dur" in ev else 0
        except ValueError as exc:
            raise TraceImportError(f"{where} ({cat}): ts/dur {exc} is not a number") from None
        if dur < 0:
            raise TraceImportError(f"{where} ({cat}): negative dur {ev['dur']}")
        depth = args.get("depth", 0)
        if not isinstance(depth, int) or isinstance(depth, bool) or not 0 <= depth < 1 << 16:
            raise TraceImportError(f"{where}: depth {depth!r} is not a span's depth")
        host, pid, tid = tracks.where(
            event_int(ev["pid"], "pid", index), event_int(ev["tid"], "tid", index), lane
        )
        if (pid is not None and not 0 <= pid < 1 << 32) or not 0 <= tid < 1 << 64:
            raise TraceImportError(
                f"{where}: pid {pid} or tid {tid} is not a process's or thread's"
            )
        self.span_id.append(int(sid, 16))
        self.parent.append(int(parent, 16))
        self.host.append(host)
        self.pid.append(pid)
        self.tid.append(tid)
        self.lane.append(lane)
        self.category.append(cat)
        self.name.append(str(ev["name"]))
        self.start.append(start)
        self.end.append(start + dur)
        self.depth.append(depth)
        self.attrs.append(tracks.attrs(args, lane) or None)

    def table(self, tracks: _Tracks) -> tuple[pa.Table, int]:
        """The ``spans`` table (host included), and how many device spans have their launching
        call in the file: a device span's process is that call's, else its host's busiest one."""
        known = {s: p for s, p in zip(self.span_id, self.pid, strict=True) if p is not None}
        busiest: dict[str, int] = {}
        for (host, pid), _ in Counter(
            (h, p) for h, p in zip(self.host, self.pid, strict=True) if p is not None
        ).most_common():
            busiest.setdefault(host, pid)
        pids: list[int] = []
        linked = 0
        for host, own, parent in zip(self.host, self.pid, self.parent, strict=True):
            if own is None:
                own = known.get(parent)
                linked += own is not None
            pids.append(own if own is not None else busiest.get(host, 0))
        table = columns_to_table(
            {
                "span_id": numeric_column(np.array(self.span_id, np.uint64), pa.uint64()),
                "parent_span_id": numeric_column(np.array(self.parent, np.uint64), pa.uint64()),
                "pid": numeric_column(np.array(pids, np.int64).astype(np.uint32), pa.uint32()),
                "tid": numeric_column(np.array(self.tid, np.uint64), pa.uint64()),
                "lane": self.lane,
                "category": self.category,
                "name": self.name,
                "start_ns": numeric_column(np.array(self.start, np.int64), pa.int64()),
                "end_ns": numeric_column(np.array(self.end, np.int64), pa.int64()),
                "depth": numeric_column(np.array(self.depth, np.uint16), pa.uint16()),
                "attrs": self.attrs,
            }
        ).append_column("host", dict_column(self.host))
        order = np.argsort(np.array(self.start, np.int64), kind="stable")
        return table.take(numeric_column(order, pa.int64())), linked


class _Samples:
    """Growing columns of an export's counter samples (``ph: C``: one per series)."""

    def __init__(self) -> None:
        self.host: list[str] = []
        self.source: list[str] = []
        self.device: list[str] = []
        self.metric: list[str] = []
        self.ts: list[int] = []
        self.value: list[float] = []
        self.labels: list[dict[str, str] | None] = []

    def add(self, ev: dict[str, object], index: int, base: int, tracks: _Tracks) -> None:
        where = f"event {index} (counter)"
        metric = _field(ev, "name", str, where)
        source = ev.get("cat", "")
        args, labels = ev.get("args"), ev.get("labels")
        if not isinstance(args, dict) or not isinstance(source, str) or "ts" not in ev:
            raise TraceImportError(f"{where}: no ts or args, or a cat that is not text")
        try:
            ts = base + to_ns(ev["ts"])
        except ValueError as exc:
            raise TraceImportError(f"{where}: ts {exc} is not a number") from None
        host = tracks.host.get(event_int(ev.get("pid"), "pid", index), tracks.default_host)
        sample_labels = (
            {str(k): _attr_text(v) for k, v in labels.items()} or None
            if isinstance(labels, dict)
            else None
        )
        for series, value in args.items():
            number = _number(value)
            if number is None:
                raise TraceImportError(f"{where}: {metric} {series} is {value!r}, not a number")
            self.host.append(host)
            self.source.append(source)
            # The exporter names a device's series by the device, "value" where there is none.
            self.device.append("" if series == "value" else series)
            self.metric.append(metric)
            self.ts.append(ts)
            self.value.append(number)
            self.labels.append(sample_labels)

    def table(self) -> pa.Table:
        return pa.table(
            {
                "host": dict_column(self.host),
                "source": dict_column(self.source),
                "device": dict_column(self.device),
                "metric": dict_column(self.metric),
                "ts_ns": numeric_column(np.array(self.ts, np.int64), pa.int64()),
                "value": numeric_column(np.array(self.value, np.float64), pa.float64()),
                "labels": attrs_column(self.labels),
            }
        )


def _number(value: object) -> float | None:
    """A counter's value: a JSON number (a float as its text, read exactly); None otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return None
    try:
        number = float(value)
    except (ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def convert_export(
    data: dict[str, object], *, name: str, command: str, progress: Progress | None = None
) -> Converted:
    """A file ``gpu-trace export`` wrote, as the run it was (docs/import.md, "gpu-trace's own
    exports"): span ids, parents, hosts, pids, tids, lanes, categories, depths, attributes and
    counters from what the exporter wrote, times exact to the nanosecond on the run's clock."""
    info = data[EXPORT_KEY]
    events = data["traceEvents"]
    assert isinstance(info, dict) and isinstance(events, list)
    base = _field(info, "time_base_ns", int, EXPORT_KEY)
    tracks = _Tracks(info)
    spans, samples = _Spans(), _Samples()
    skipped: Counter[str] = Counter()
    process_names: dict[int, str] = {}
    thread_names: dict[tuple[int, int], str] = {}
    tell = teller(progress, len(events))
    every = trace_file.EVENTS_CHUNK - 1  # read at each conversion: a test makes it smaller
    for index, ev in enumerate(events):
        if tell is not None and not index & every:
            tell(index)
        if not isinstance(ev, dict):
            raise TraceImportError(f"event {index} is a {type(ev).__name__}, not an object")
        ph = ev.get("ph")
        if ph in ("X", "i"):
            spans.add(ev, index, base, tracks)
        elif ph == "C":
            samples.add(ev, index, base, tracks)
        elif ph == "M":
            take_names(ev, process_names, thread_names)
        elif ph not in ("s", "f"):  # flow arrows are drawn from the parents: stored once
            skipped[f"'{ph}' events"] += 1
    if not spans.span_id and not samples.ts:
        raise TraceImportError("a gpu-trace export without spans or counters")
    table, linked = spans.table(tracks)
    counters = samples.table()
    started, ended = info.get("started_ns"), info.get("ended_ns")
    attrs = info.get("attrs")
    run_attrs = {str(k): _attr_text(v) for k, v in attrs.items()} if isinstance(attrs, dict) else {}
    wall = data.get("baseTimeNanoseconds")
    if not {"anchor_mono_ns", "anchor_wall_ns"} <= run_attrs.keys() and type(wall) is int:
        run_attrs.update(anchor_mono_ns=str(base), anchor_wall_ns=str(wall))
    run_attrs.update(source="gpu-trace", source_file=name)
    for key, attr in (("run_id", "source_run_id"), ("command", "source_command")):
        if isinstance(value := info.get(key), str) and value:
            run_attrs[attr] = value
    if info.get("complete") is False:
        run_attrs["source_complete"] = "false"  # the export stopped early: part of the run
    status = info.get("status")
    run = RunInfo(
        run_id=new_run_id(),
        trace_id=w3c_trace_id(info.get("trace_id")),
        # Without the run's own (an older export), its start is the time base, which it was.
        started_ns=started if type(started) is int and 0 < started < 1 << 63 else base,
        ended_ns=(
            ended if type(ended) is int and 0 < ended < 1 << 63 else max([*spans.end, *samples.ts])
        ),
        command=command,
        hosts=tracks.hosts,
        status=status if isinstance(status, str) and status else "finished",
        attrs=run_attrs,
    )
    if "threads" in info:
        where = f"{EXPORT_KEY}.threads"
        threads = [
            (
                _field(t, "host", str, where),
                _field(t, "pid", int, where),
                _field(t, "tid", int, where),
                _field(t, "process_name", str, where),
                _field(t, "thread_name", str, where),
            )
            for t in _entries(info, "threads")
        ]
    else:  # an older export: the names its tracks were given
        threads = [
            (tracks.default_host, p, t, process_names.get(p, ""), label)
            for (p, t), label in sorted(thread_names.items())
        ]
    converted = Converted(run, table, threads, dict(Counter(spans.category)), skipped, linked)
    converted.counters = counters
    return converted
