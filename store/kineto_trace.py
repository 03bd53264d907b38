"""A PyTorch profiler (Kineto) Chrome trace as the store's rows, mapped to the categories, lanes
and attributes gpu-trace's own recording gives (docs/import.md has the mapping):

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
"""

from __future__ import annotations

import json
from collections import Counter

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
from gpu_trace.tracer.run import RunInfo, new_run_id
from gpu_trace.tracer.trace_format import BACKWARD_CATEGORY, FORWARD_SPAN

__all__ = ["convert_kineto", "CPU_CATEGORIES", "DEVICE_CATEGORIES", "META_KEYS"]

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


def convert_kineto(
    data: dict[str, object], *, name: str, command: str, progress: Progress | None = None
) -> Converted:
    events = data["traceEvents"]
    assert isinstance(events, list)
    tell = teller(progress, len(events))
    every = trace_file.EVENTS_CHUNK - 1  # read at each conversion: a test makes it smaller
    cols = _Columns()
    skipped: Counter[str] = Counter()
    process_names: dict[int, str] = {}
    thread_names: dict[tuple[int, int], str] = {}
    corr_row: dict[int, int] = {}  # correlation -> row of its CUDA call
    device_rows: list[tuple[int, int]] = []  # (row, correlation)
    backward: dict[str, dict[object, tuple[int, int, int]]] = {"s": {}, "f": {}}  # id -> where
    for index, ev in enumerate(events):
        if tell is not None and not index & every:
            tell(index)
        if not isinstance(ev, dict):
            raise TraceImportError(f"event {index} is a {type(ev).__name__}, not an object")
        ph = ev.get("ph")
        if ph == "M":
            take_names(ev, process_names, thread_names)
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
        pid = event_int(ev["pid"], "pid", index)
        tid = event_int(ev["tid"], "tid", index)
        args = ev.get("args")
        attrs = (
            {
                k: v if type(v) is str else str(v) if type(v) is int else value_text(v)
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
        device = (
            event_int(args.get("device", pid), "device", index) if isinstance(args, dict) else pid
        )
        stream = (
            event_int(args.get("stream", tid), "stream", index) if isinstance(args, dict) else tid
        )
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
        trace_id=w3c_trace_id(data.get("trace_id")),
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


def _run_attrs(data: dict[str, object], name: str) -> dict[str, str]:
    attrs = {"source": "kineto", "source_file": name}
    for key in META_KEYS:
        if key in data:
            attrs[f"kineto.{key}"] = value_text(data[key])
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
                attrs[key] = value_text(info[key])
    return attrs
