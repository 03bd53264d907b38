"""PyTorch profiler (Kineto) Chrome traces, and our own exports, into the store as runs:
`gpu-trace import`.

Users already have traces that ``torch.profiler`` wrote; importing one makes ``show``, ``sql``,
``export`` and the dashboard work on it, with the same categories, lanes and attributes that
gpu-trace's own recording gives (docs/import.md has the mapping):

- ``cpu_op`` -> ``op`` on lane ``torch/ops``; ``user_annotation`` -> ``nvtx`` on lane
  ``torch/annotations``, ``ProfilerStep#N`` -> ``step`` on lane ``steps``; ``python_function`` ->
  ``module`` on lane ``torch/modules``. Each CPU event's parent is the innermost event that holds
  it on its thread (the profiler's own nesting), and its depth follows.
- ``kernel``, ``gpu_memcpy``, ``gpu_memset`` -> ``kernel``, ``memcpy``, ``memset`` on lane
  ``gpu<device>/stream<stream>``, each the child of the CUDA call that launched it (the same
  ``correlation``: what the trace's ``ac2g`` flows draw); ``gpu_user_annotation`` -> ``nvtx`` on
  ``gpu<device>/stream<stream>/annotations``.
- ``cuda_runtime``, ``cuda_driver`` -> ``cuda_api`` on lane ``cuda_api`` of the calling thread,
  attribute ``api`` ``runtime`` or ``driver``.
- Every ``args`` entry is kept as a string attribute, with its original text (floats are parsed
  as their text, not as binary floats).

Times: Kineto's ``ts`` and ``dur`` are microseconds with three decimals; they become integer
nanoseconds from their text, exactly. ``ts`` is relative to the trace's ``baseTimeNanoseconds``
(Unix ns), so the run's clock anchor is ``anchor_mono_ns = 0`` at ``anchor_wall_ns = base``: the
dashboard and exports show wall-clock time.

A file ``gpu-trace export`` wrote (its ``gpu_trace`` trailer says so) is read differently, as the
run it was (:func:`convert_export`): span ids, parents, hosts, pids, tids, lanes, depths,
attributes, counters and the run's metadata from what the exporter wrote, nothing mapped or
nested again.

A run appears whole or not at all: spans, counters and threads go in first, the ``runs`` row
last, and a failure in between removes what was written. A file already imported (same SHA-256)
is refused with the id of its run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import stat
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import pyarrow as pa

from gpu_trace.tracer.columns import columns_to_table
from gpu_trace.tracer.records import (
    CUDA_API,
    KERNEL,
    MEMCPY,
    MEMSET,
    MODULE,
    NVTX,
    OP,
    STEP,
    STEP_LANE,
    attrs_column,
    dict_column,
    numeric_column,
)
from gpu_trace.tracer.run import RunInfo, new_run_id, new_trace_id
from gpu_trace.tracer.trace_format import BACKWARD_CATEGORY, FORWARD_SPAN, RESERVED_ARGS

if TYPE_CHECKING:
    from gpu_trace.store.client import Store

log = logging.getLogger(__name__)

#: Lanes of imported CPU events (the thread's lanes, as gpu-trace names them when it records).
OPS_LANE = "torch/ops"
ANNOTATIONS_LANE = "torch/annotations"
MODULES_LANE = "torch/modules"
API_LANE = "cuda_api"
#: Kineto categories of CPU events: (our category, lane).
CPU_CATEGORIES = {
    "cpu_op": (OP, OPS_LANE),
    "user_annotation": (NVTX, ANNOTATIONS_LANE),
    "python_function": (MODULE, MODULES_LANE),
    "cuda_runtime": (CUDA_API, API_LANE),
    "cuda_driver": (CUDA_API, API_LANE),
}
#: Kineto categories of device events: our category.
DEVICE_CATEGORIES = {"kernel": KERNEL, "gpu_memcpy": MEMCPY, "gpu_memset": MEMSET}
GPU_ANNOTATION = "gpu_user_annotation"
#: Top-level keys kept as run attributes (``kineto.<key>``).
META_KEYS = (
    "schemaVersion",
    "trace_id",
    "cuda_driver_version",
    "cuda_runtime_version",
    "cupti_version",
    "traceName",
    "baseTimeNanoseconds",
    "host_name",
    "record_shapes",
)
#: Microseconds with three decimals: nanoseconds once the point is taken out.
_THREE_DECIMALS = re.compile(r"-?[0-9]+\.[0-9]{3}")
#: Run attribute holding the file's SHA-256 (a second import of the same file is refused).
SOURCE_SHA = "import_sha256"


class TraceImportError(ValueError):
    """The file cannot be imported; the message says why in one line. Nothing was stored."""


@dataclass
class Converted:
    """A trace as the store's rows: the run, its spans and threads, and what was left out."""

    info: RunInfo
    spans: pa.Table
    threads: list[tuple[str, int, int, str, str]]  # host, pid, tid, process name, thread name
    counts: dict[str, int]
    skipped: Counter[str] = field(default_factory=Counter)
    linked: int = 0  # device spans whose launching call is in the trace
    backward_pairs: int = 0  # backward ops marked with their forward op (fwdbwd flows)
    counters: pa.Table | None = None  # counter samples (a gpu-trace export's)


@dataclass
class ImportReport:
    """What one import did."""

    run_id: str
    counts: dict[str, int]
    skipped: dict[str, int]
    linked: int
    seconds: float
    existing: bool = False  # the file was imported before: run_id is that run
    backward_pairs: int = 0
    counters: int = 0  # counter samples

    def summary(self) -> str:
        """One line for the CLI."""
        if self.existing:
            return f"already imported as run {self.run_id} (gpu-trace rm it to import again)"
        parts = ", ".join(f"{n} {c}" for c, n in self.counts.items() if n)
        if self.counters:
            parts = f"{parts or 'no spans'}, {self.counters} counter samples"
        text = f"run {self.run_id}: {parts or 'no spans'}; {self.linked} launches linked"
        if self.backward_pairs:
            text += f", {self.backward_pairs} backward ops to their forward op"
        if self.skipped:
            text += "; left out: " + ", ".join(f"{k} ({n:,})" for k, n in self.skipped.items())
        return f"{text} ({self.seconds:.1f} s)"


#: ``progress(phase, done, total)``: what an import tells of its work (total None: unknown).
Progress = Callable[[str, int, "int | None"], None]


def _teller(progress: Progress | None, total: int) -> Callable[[int], None] | None:
    """``progress`` for the converting phase of ``total`` events (None: nothing to tell)."""
    if progress is None:
        return None
    return lambda done: progress("converting events", done, total)


# ---- reading ------------------------------------------------------------------------------------


#: Most a gzipped trace may grow by when decompressed (traces compress about 10x, Kineto's up to
#: about 30x); beyond it the file is refused as a likely gzip bomb, with what to do if it is real.
MAX_GZIP_RATIO = 100
#: ... though a small file may always grow to this much.
MIN_GZIP_LIMIT = 256 << 20


#: Bytes read (and decompressed) between two calls of an import's ``progress``.
READ_CHUNK = 8 << 20
#: Events converted between two calls of an import's ``progress``.
EVENTS_CHUNK = 1 << 16


def _read(path: Path, progress: Progress | None) -> bytes:
    """The file's bytes, read in :data:`READ_CHUNK` pieces with ``progress`` told (MiB)."""
    if progress is None:
        return path.read_bytes()
    size = path.stat().st_size
    out = bytearray()
    with path.open("rb") as f:
        while chunk := f.read(READ_CHUNK):
            out += chunk
            progress("reading MiB", _mib(len(out)), _mib(max(size, len(out))))
    return bytes(out)


def _mib(n: int) -> int:
    """``n`` bytes in MiB, rounded up (a last piece of a file counts: 0 only for nothing)."""
    return -(-n >> 20)


def _gunzip(path: Path, raw: bytes, progress: Progress | None = None) -> bytes:
    """``raw`` decompressed (every gzip member), at most :data:`MAX_GZIP_RATIO` times its size."""
    limit = max(MIN_GZIP_LIMIT, MAX_GZIP_RATIO * len(raw))
    out: list[bytes] = []
    total, rest = 0, raw
    told = 0
    try:
        while rest:
            d = zlib.decompressobj(wbits=31)  # one gzip member
            while True:
                chunk = d.decompress(rest, 1 << 20)
                total += len(chunk)
                if progress is not None and total - told >= READ_CHUNK:
                    told = total
                    done = len(raw) - len(d.unconsumed_tail)  # a suffix of raw is left
                    progress("decompressing MiB", _mib(done), _mib(len(raw)))
                if total > limit:
                    raise TraceImportError(
                        f"{path.name}: decompresses to more than {limit >> 20} MiB"
                        f" ({MAX_GZIP_RATIO}x its size): refused as a likely gzip bomb; if it is"
                        " a real trace, gunzip it and import the .json"
                    )
                out.append(chunk)
                rest = d.unconsumed_tail
                if d.eof or not rest:
                    break
            if not d.eof:
                raise TraceImportError(f"{path.name}: the gzip stream is truncated")
            rest = d.unused_data
            if rest.strip(b"\0") == b"":  # padding after the last member
                rest = b""
    except zlib.error as exc:
        raise TraceImportError(f"{path.name}: not a readable gzip file ({exc})") from None
    return b"".join(out)


def read_trace(path: str | Path, progress: Progress | None = None) -> tuple[dict[str, object], str]:
    """The parsed trace (a dict with ``traceEvents``) and the SHA-256 of the file's bytes.

    Floats are kept as their text so times convert to nanoseconds exactly. Raises
    :class:`TraceImportError` with one line for a file that is missing, not gzip or JSON, truncated,
    or not a Chrome trace. ``progress``: told of each phase (reading and decompressing in MiB).
    """
    path = Path(path)
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # /dev/zero, a FIFO: read until memory ends
            raise TraceImportError(f"{path}: not a regular file")
        raw = _read(path, progress)
    except OSError as exc:
        raise TraceImportError(f"cannot read {path}: {exc.strerror or exc}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if raw[:2] == b"\x1f\x8b":
        raw = _gunzip(path, raw, progress)
    if progress is not None:
        progress(f"parsing {len(raw) >> 20:,} MiB of JSON", 0, None)
    try:
        data = json.loads(raw, parse_float=str)
    except UnicodeDecodeError:
        raise TraceImportError(f"{path.name}: not JSON (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise TraceImportError(
            f"{path.name}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except RecursionError:
        raise TraceImportError(f"{path.name}: not a Chrome trace (nested too deeply)") from None
    except ValueError:  # an integer of more digits than Python converts
        limit = sys.get_int_max_str_digits()
        raise TraceImportError(
            f"{path.name}: not a Chrome trace (a number of more than {limit:,} digits)"
        ) from None
    if isinstance(data, list):  # the Trace Event Format's array form
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise TraceImportError(f"{path.name}: not a Chrome trace (no traceEvents list)")
    return data, digest


def to_ns(value: object) -> int:
    """Kineto microseconds (an int, or a float's text as parsed) as integer nanoseconds,
    exactly; ValueError for anything else."""
    if type(value) is str and _THREE_DECIMALS.fullmatch(value):  # what Kineto writes
        return int(value[:-4] + value[-3:])
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, int):
        return value * 1000
    if not isinstance(value, str):
        raise ValueError(value)
    whole, dot, frac = value.partition(".")
    if dot and len(frac) <= 3 and frac.isdigit() and whole.lstrip("-").isdigit():
        ns = int(whole) * 1000
        part = int(frac.ljust(3, "0"))
        return ns - part if whole.startswith("-") else ns + part
    try:  # exponents, more than three decimals: exact decimal arithmetic, rounded half-even
        return int((Decimal(value) * 1000).to_integral_value())
    except (InvalidOperation, ValueError):
        raise ValueError(value) from None


# ---- converting ---------------------------------------------------------------------------------


class _Columns:
    """Growing span columns (one list each), turned into a ``spans`` table at the end."""

    def __init__(self) -> None:
        self.pid: list[int] = []
        self.tid: list[int] = []
        self.lane: list[str] = []
        self.category: list[str] = []
        self.name: list[str] = []
        self.start: list[int] = []
        self.end: list[int] = []
        self.attrs: list[dict[str, str] | None] = []

    def add(
        self,
        pid: int,
        tid: int,
        lane: str,
        category: str,
        name: str,
        start: int,
        end: int,
        attrs: dict[str, str] | None,
    ) -> int:
        self.pid.append(pid)
        self.tid.append(tid)
        self.lane.append(lane)
        self.category.append(category)
        self.name.append(name)
        self.start.append(start)
        self.end.append(end)
        self.attrs.append(attrs)
        return len(self.pid) - 1


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, int):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


def _int(value: object, what: str, index: int) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    raise TraceImportError(f"event {index}: {what} is {value!r}, not an integer")


def convert(
    data: dict[str, object], *, name: str, command: str, progress: Progress | None = None
) -> Converted:
    """The trace as the store's rows (see the module docstring); TraceImportError for events that
    lack what they need (a ``ts``, a ``dur``, an integer ``pid``). A file ``gpu-trace export``
    wrote is read as the run it was (:func:`convert_export`). ``progress``: told every
    :data:`EVENTS_CHUNK` events."""
    try:
        if is_export(data):
            return convert_export(data, name=name, command=command, progress=progress)
        return _convert_kineto(data, name=name, command=command, progress=progress)
    except OverflowError:  # a column's numpy array: a time or id past 64 bits
        raise TraceImportError("a time, pid or tid too large for 64 bits") from None


def _convert_kineto(
    data: dict[str, object], *, name: str, command: str, progress: Progress | None = None
) -> Converted:
    events = data["traceEvents"]
    assert isinstance(events, list)
    tell = _teller(progress, len(events))
    cols = _Columns()
    skipped: Counter[str] = Counter()
    process_names: dict[int, str] = {}
    thread_names: dict[tuple[int, int], str] = {}
    corr_row: dict[int, int] = {}  # correlation -> row of its CUDA call
    device_rows: list[tuple[int, int]] = []  # (row, correlation)
    backward: dict[str, dict[object, tuple[int, int, int]]] = {"s": {}, "f": {}}  # id -> where
    for index, ev in enumerate(events):
        if tell is not None and not index & (EVENTS_CHUNK - 1):
            tell(index)
        if not isinstance(ev, dict):
            raise TraceImportError(f"event {index} is a {type(ev).__name__}, not an object")
        ph = ev.get("ph")
        if ph == "M":
            _metadata(ev, process_names, thread_names)
            continue
        if ph != "X":
            if ph in ("s", "f") and ev.get("cat") == BACKWARD_CATEGORY:
                _flow_end(ev, backward[ph], skipped)
            elif ph not in ("s", "f"):  # ac2g flows are the launch links, kept as parents
                skipped[f"'{ph}' events"] += 1
            continue
        cat = ev.get("cat")
        device_cat = DEVICE_CATEGORIES.get(cat) if isinstance(cat, str) else None
        cpu = CPU_CATEGORIES.get(cat) if isinstance(cat, str) else None
        if device_cat is None and cpu is None and cat != GPU_ANNOTATION:
            skipped[f"{cat} events"] += 1
            continue
        for key in ("ts", "dur", "name", "pid", "tid"):
            if key not in ev:
                raise TraceImportError(f"event {index} ({cat}) has no {key!r}")
        try:
            start = to_ns(ev["ts"])
            dur = to_ns(ev["dur"])
        except ValueError as exc:
            raise TraceImportError(f"event {index} ({cat}): ts/dur {exc} is not a number") from None
        if dur < 0:
            raise TraceImportError(f"event {index} ({cat}): negative dur {ev['dur']}")
        pid = _int(ev["pid"], "pid", index)
        tid = _int(ev["tid"], "tid", index)
        args = ev.get("args")
        attrs = (
            {
                k: v if type(v) is str else str(v) if type(v) is int else _text(v)
                for k, v in args.items()
            }
            if isinstance(args, dict)
            else {}
        )
        label = str(ev["name"])
        if cpu is not None:
            category, lane = cpu
            if category == NVTX and label.startswith("ProfilerStep#"):
                category, lane = STEP, STEP_LANE
            if category == CUDA_API:
                attrs["api"] = "runtime" if cat == "cuda_runtime" else "driver"
            row = cols.add(pid, tid, lane, category, label, start, start + dur, attrs or None)
            if category == CUDA_API and "correlation" in attrs:
                corr = _correlation(attrs)
                if corr:
                    corr_row.setdefault(corr, row)
            continue
        device = _int(args.get("device", pid), "device", index) if isinstance(args, dict) else pid
        stream = _int(args.get("stream", tid), "stream", index) if isinstance(args, dict) else tid
        if device_cat is None:  # a GPU user annotation: the range over its kernels
            lane = f"gpu{pid}/stream{tid}/annotations"
            row = cols.add(pid, tid, lane, NVTX, label, start, start + dur, attrs or None)
        else:
            lane = f"gpu{device}/stream{stream}"
            row = cols.add(pid, tid, lane, device_cat, label, start, start + dur, attrs or None)
        device_rows.append((row, _correlation(attrs)))
    if not cols.pid:
        raise TraceImportError("no events of a PyTorch profiler trace (cpu_op, kernel, ...)")
    pairs = _backward_pairs(cols, backward, skipped)
    converted = _finish(
        data, cols, skipped, process_names, thread_names, corr_row, device_rows, name, command
    )
    converted.backward_pairs = pairs
    return converted


def _flow_end(
    ev: dict[str, object], ends: dict[object, tuple[int, int, int]], skipped: Counter[str]
) -> None:
    try:
        pid, tid = ev["pid"], ev["tid"]
        if not isinstance(pid, int) or not isinstance(tid, int):
            raise ValueError(pid)
        ends[ev["id"]] = (pid, tid, to_ns(ev["ts"]))
    except (KeyError, ValueError, TypeError):
        skipped["fwdbwd flow events without pid, tid, ts or id"] += 1


def _backward_pairs(
    cols: _Columns, backward: dict[str, dict[object, tuple[int, int, int]]], skipped: Counter[str]
) -> int:
    """Mark each backward op with its forward op (attribute :data:`FORWARD_SPAN`) from the
    trace's ``fwdbwd`` flows: each end sits at the start of an op on its thread."""
    starts, ends = backward["s"], backward["f"]
    if not starts or not ends:
        return 0
    at: dict[tuple[int, int, int], int] = {}
    for row, category in enumerate(cols.category):
        if category == OP:
            at.setdefault((cols.pid[row], cols.tid[row], cols.start[row]), row)
    pairs = 0
    for flow, where in ends.items():
        source = starts.get(flow)
        fwd = at.get(source) if source is not None else None
        bwd = at.get(where)
        if fwd is None or bwd is None:
            skipped["fwdbwd flows not at an op"] += 1
            continue
        attrs = cols.attrs[bwd]
        if attrs is None:
            attrs = cols.attrs[bwd] = {}
        attrs[FORWARD_SPAN] = str(fwd + 1)  # span ids are row + 1
        pairs += 1
    return pairs


def _correlation(attrs: dict[str, str]) -> int:
    text = attrs.get("correlation", "")
    return int(text) if text.isdigit() else 0


def _metadata(
    ev: dict[str, object],
    process_names: dict[int, str],
    thread_names: dict[tuple[int, int], str],
) -> None:
    args = ev.get("args")
    label = args.get("name") if isinstance(args, dict) else None
    pid, tid = ev.get("pid"), ev.get("tid")
    if not isinstance(label, str) or not isinstance(pid, int):
        return
    if ev.get("name") == "process_name":
        process_names[pid] = label
    elif ev.get("name") == "thread_name" and isinstance(tid, int):
        thread_names[(pid, tid)] = label


def _finish(
    data: dict[str, object],
    cols: _Columns,
    skipped: Counter[str],
    process_names: dict[int, str],
    thread_names: dict[tuple[int, int], str],
    corr_row: dict[int, int],
    device_rows: list[tuple[int, int]],
    name: str,
    command: str,
) -> Converted:
    n = len(cols.pid)
    start = np.array(cols.start, np.int64)
    end = np.array(cols.end, np.int64)
    span_id = np.arange(1, n + 1, dtype=np.uint64)
    parent = np.zeros(n, np.uint64)
    depth = np.zeros(n, np.int64)
    pid = np.array(cols.pid, np.int64)
    tid = np.array(cols.tid, np.int64)

    # CPU events: the innermost event holding each one on its thread is its parent. Python
    # functions (with_stack) nest among themselves: they come from another tracer than the
    # ops, and its ends do not always fall inside the ops' (siblings would overlap).
    device = np.zeros(n, bool)
    device_idx = np.array([r for r, _ in device_rows], np.int64)
    device[device_idx] = True
    cpu = np.flatnonzero(~device)
    group = np.array([c == MODULE for c in cols.category], np.int64)
    order = cpu[np.lexsort((-end[cpu], start[cpu], group[cpu], tid[cpu], pid[cpu]))]
    _nest(order.tolist(), cols.start, cols.end, cols.pid, cols.tid, group.tolist(), parent, depth)

    # Device work: the CUDA call with the same correlation launched it (Kineto's ac2g flow).
    linked = 0
    pids, per_pid = np.unique(pid[cpu], return_counts=True)
    main_pid = int(pids[per_pid.argmax()]) if len(pids) else 0  # for work whose call is missing
    for row, corr in device_rows:
        call = corr_row.get(corr) if corr else None
        if call is not None:
            parent[row] = span_id[call]  # depth stays 0: the first level of its stream's lane
            cols.pid[row] = cols.pid[call]
            linked += 1
        else:
            cols.pid[row] = main_pid
        cols.tid[row] = 0

    table = columns_to_table(
        {
            "span_id": numeric_column(span_id, pa.uint64()),
            "parent_span_id": numeric_column(parent, pa.uint64()),
            "pid": numeric_column(np.array(cols.pid, np.int64).astype(np.uint32), pa.uint32()),
            "tid": numeric_column(np.array(cols.tid, np.int64).astype(np.uint64), pa.uint64()),
            "lane": dict_column(cols.lane),
            "category": dict_column(cols.category),
            "name": dict_column(cols.name),
            "start_ns": numeric_column(start, pa.int64()),
            "end_ns": numeric_column(end, pa.int64()),
            "depth": numeric_column(np.minimum(depth, 65535).astype(np.uint16), pa.uint16()),
            "attrs": attrs_column(cols.attrs),
        },
    )
    table = table.take(numeric_column(np.argsort(start, kind="stable"), pa.int64()))
    counts = Counter(cols.category)
    info = RunInfo(
        run_id=new_run_id(),
        trace_id=_trace_id(data.get("trace_id")),
        started_ns=int(start.min()),
        ended_ns=int(end.max()),
        command=command,
        hosts=[host] if isinstance(host := data.get("host_name"), str) and host else [],
        status="finished",
        attrs=_run_attrs(data, name),
    )
    host = info.hosts[0] if info.hosts else ""
    threads = [
        (host, p, t, process_names.get(p, ""), label)
        for (p, t), label in sorted(thread_names.items())
    ]
    named = {p for _, p, *_ in threads}
    threads += [
        (host, p, 0, label, "") for p, label in sorted(process_names.items()) if p not in named
    ]
    # Kineto names its device "processes" too; the store's threads are the program's.
    threads = [t for t in threads if t[1] in set(pids.tolist())]
    return Converted(info, table, threads, dict(counts), skipped, linked)


def _nest(
    order: list[int],
    starts: list[int],
    ends: list[int],
    pids: list[int],
    tids: list[int],
    groups: list[int],
    parent: np.ndarray,
    depth: np.ndarray,
) -> None:
    """Parent and depth of each row of ``order`` (rows sorted by thread, group, start, longest
    first): the innermost earlier row of its thread and group whose interval holds it."""
    stack: list[int] = []
    thread = None
    out_parent = [0] * len(order)
    out_depth = [0] * len(order)
    for i, row in enumerate(order):
        key = (pids[row], tids[row], groups[row])
        if key != thread:
            thread, stack = key, []
        s, e = starts[row], ends[row]
        while stack and not (starts[stack[-1]] <= s and e <= ends[stack[-1]]):
            stack.pop()
        if stack:
            out_parent[i] = stack[-1] + 1  # span ids are row + 1
            out_depth[i] = len(stack)
        stack.append(row)
    if order:
        idx = np.array(order, np.int64)
        parent[idx] = np.array(out_parent, np.uint64)
        depth[idx] = np.array(out_depth, np.int64)


def _trace_id(value: object) -> str:
    """Kineto's trace id as a W3C one (32 lower-case hex digits), a new one when it is not."""
    text = str(value or "").lower()
    if len(text) == 32 and all(c in "0123456789abcdef" for c in text) and int(text, 16):
        return text
    return new_trace_id()


def _run_attrs(data: dict[str, object], name: str) -> dict[str, str]:
    attrs = {"source": "kineto", "source_file": name}
    for key in META_KEYS:
        if key in data:
            attrs[f"kineto.{key}"] = _text(data[key])
    base = data.get("baseTimeNanoseconds")
    if isinstance(base, int) and not isinstance(base, bool):
        attrs["anchor_mono_ns"] = "0"
        attrs["anchor_wall_ns"] = str(base)
    props = data.get("deviceProperties")
    if isinstance(props, list) and props:
        attrs["device_properties"] = json.dumps(props, separators=(",", ":"))
    info = data.get("distributedInfo")
    if isinstance(info, dict):
        for key in ("rank", "world_size"):
            if key in info:
                attrs[key] = _text(info[key])
    return attrs


# ---- gpu-trace's own exports --------------------------------------------------------------------

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
    return str(value) if type(value) is int else _text(value)


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
            _int(ev["pid"], "pid", index), _int(ev["tid"], "tid", index), lane
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
        host = tracks.host.get(_int(ev.get("pid"), "pid", index), tracks.default_host)
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
    tell = _teller(progress, len(events))
    for index, ev in enumerate(events):
        if tell is not None and not index & (EVENTS_CHUNK - 1):
            tell(index)
        if not isinstance(ev, dict):
            raise TraceImportError(f"event {index} is a {type(ev).__name__}, not an object")
        ph = ev.get("ph")
        if ph in ("X", "i"):
            spans.add(ev, index, base, tracks)
        elif ph == "C":
            samples.add(ev, index, base, tracks)
        elif ph == "M":
            _metadata(ev, process_names, thread_names)
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
        trace_id=_trace_id(info.get("trace_id")),
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


# ---- storing ------------------------------------------------------------------------------------


def imported_run(store: Store, sha256: str) -> str | None:
    """The run a file with this SHA-256 was imported as, None if none was."""
    rows = store.query(
        "SELECT run_id FROM __db__.runs FINAL WHERE attrs[{key:String}] = {sha:String} LIMIT 1",
        {"key": SOURCE_SHA, "sha": sha256},
    ).result_rows
    return str(rows[0][0]) if rows else None


def import_trace(
    store: Store, path: str | Path, *, name: str | None = None, progress: Progress | None = None
) -> ImportReport:
    """Import a Kineto trace file into ``store`` as a new run (see the module docstring).

    TraceImportError (one line) for a file that cannot be imported; StoreError when the store fails,
    after removing what was written. A file imported before is not imported again: the report
    names its run, with ``existing`` set. ``progress(phase, done, total)`` is told what is being
    done (reading, decompressing, parsing, converting, storing), for a terminal's progress line.
    """
    t0 = time.perf_counter()
    path = Path(path)
    data, digest = read_trace(path, progress)
    existing = imported_run(store, digest)
    if existing is not None:
        return ImportReport(existing, {}, {}, 0, time.perf_counter() - t0, existing=True)
    converted = convert(
        data, name=path.name, command=name or f"import {path.name}", progress=progress
    )
    del data
    info = converted.info
    info.attrs[SOURCE_SHA] = digest
    counters = converted.counters
    if progress is not None:
        progress(f"storing {converted.spans.num_rows:,} spans", 0, None)
    store_spans(store, info, converted.spans, converted.threads, counters)
    report = ImportReport(
        info.run_id,
        converted.counts,
        dict(converted.skipped),
        converted.linked,
        time.perf_counter() - t0,
        backward_pairs=converted.backward_pairs,
        counters=counters.num_rows if counters is not None else 0,
    )
    log.info("gpu-trace: imported %s: %s", path, report.summary())
    return report


def store_spans(
    store: Store,
    info: RunInfo,
    spans: pa.Table,
    threads: list[tuple[str, int, int, str, str]],
    counters: pa.Table | None = None,
) -> None:
    """Spans, counters and threads, then the ``runs`` row that makes the run visible; on a
    failure what was written is removed again and the StoreError raised. Spans without a
    ``host`` column are the run's first host's."""
    added = {"run_id": info.run_id, "trace_id": info.trace_id}
    if "host" not in spans.column_names:
        added["host"] = info.hosts[0] if info.hosts else ""
    table = _with_columns(spans, added)
    now = time.time_ns()
    try:
        if table.num_rows:
            store.insert_arrow("spans", table)
        if counters is not None and counters.num_rows:
            store.insert_arrow("counters", _with_columns(counters, {"run_id": info.run_id}))
        store.insert_rows(
            "threads",
            ["run_id", "host", "pid", "tid", "process_name", "thread_name", "updated_ns"],
            [[info.run_id, h, p, t, pn, tn, now] for h, p, t, pn, tn in threads],
        )
        store.upsert_run(info)
    except Exception:
        try:
            store.delete_run(info.run_id)
        except Exception:
            log.warning("gpu-trace: could not remove the partly imported run %s", info.run_id)
        raise


def _with_columns(table: pa.Table, values: dict[str, str]) -> pa.Table:
    """``table`` with a column of one value added for each of ``values``."""
    n = table.num_rows
    for column, value in values.items():
        table = table.append_column(column, dict_column([value]).take(np.zeros(n, np.int64)))
    return table
