"""What the GPU did: device lanes, short kernel names, top kernels, busy and idle per step, the
launch chain of a kernel, and the GPU time of each forwarded op.

GPU activity (issue 15: ``collectors/gpu_activity/`` recording through CUPTI, ``gpu-trace import``
of a PyTorch profiler trace) is spans like any other: categories ``kernel``, ``memcpy`` and
``memset`` on lanes ``gpu<device>/stream<stream>``, each the child of the ``cuda_api`` span that
issued it, whose parent is the op, module, NVTX range or step open on the launching thread. So
everything here follows ``parent_span_id``; nothing matches names across lanes.

Busy time is the union of a device's kernel, copy and memset intervals (concurrent kernels on
two streams count once), cut to the window asked for: it is what the GPU was doing, not the sum
of what it was asked to do. Plain functions of a :class:`~gpu_trace.query.source.Source`; the
dashboard draws the tables (``dashboard/panels.py``) and keeps what it reads once per run.
"""

from __future__ import annotations

import re
from typing import TypedDict

import numpy as np

from gpu_trace.query.gpu import gpu_summary
from gpu_trace.query.source import Source
from gpu_trace.query.source import rows as query_rows

#: Span categories of work the device ran (the rest of GPU activity, ``cuda_api`` and
#: ``cuda_sync``, is on the CPU threads that called CUDA).
DEVICE_CATEGORIES = ("kernel", "memcpy", "memset")
#: Ancestors followed at most from a kernel (API call, op, modules, ranges, step).
MAX_CHAIN = 32
#: Longest short kernel name drawn on a bar (the full name is in the hover and the details).
SHORT_NAME_CHARS = 60


class SpanRef(TypedDict):
    """A span of a launch chain."""

    span_id: str
    parent_span_id: str
    host: str
    pid: int
    tid: int
    lane: str
    category: str
    name: str
    depth: int
    start_ns: int
    end_ns: int


class StepBusy(TypedDict):
    """One step's busy and idle time on one GPU."""

    step: str
    pid: int
    index: int
    start_ns: int
    dur_ns: int
    device: int
    busy_ns: int
    idle_ns: int
    busy_share: float


class KernelTotal(TypedDict):
    """One kernel name's GPU time on one device."""

    name: str
    short: str
    count: int
    total_ns: int
    mean_ns: int
    share: float


class DeviceKernels(TypedDict):
    """A device's kernel totals, busy time and top kernels."""

    device: int
    busy_ns: int
    window_ns: int  # first work's start to last work's end
    kernels: int
    kernel_ns: int
    top: list[KernelTotal]


_DEVICE_LANE = re.compile(r"gpu(\d+)/(?:stream(\d+)|sync)(/.*)?$")


def device_lane(lane: str) -> tuple[int, int] | None:
    """``(device, stream)`` of a lane ``gpu<device>/stream<stream>`` (and its ``/annotations``
    sub-lane), ``(device, -1)`` for ``gpu<device>/sync`` (context-wide synchronizations), else
    None."""
    m = _DEVICE_LANE.match(lane)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)) if m.group(2) is not None else -1


def _top_level(text: str, open_: str, close: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each outermost ``open_ ... close`` group in ``text``."""
    out: list[tuple[int, int]] = []
    depth = start = 0
    for i, ch in enumerate(text):
        if ch == open_:
            if depth == 0:
                start = i
            depth += 1
        elif ch == close and depth:
            depth -= 1
            if depth == 0:
                out.append((start, i + 1))
    return out


def _base(name: str) -> str:
    """The last identifier of a qualified C++ name without its template arguments."""
    if "{lambda" in name:
        return "lambda"
    bare = name
    for open_, close in (("<", ">"), ("(", ")")):
        for a, b in reversed(_top_level(bare, open_, close)):
            bare = bare[:a] + bare[b:]
    bare = bare.strip().split("::")[-1].strip()
    return bare.split(" ")[-1].lstrip("*&") if bare else bare


def short_kernel_name(name: str) -> str:
    """A readable short form of a demangled kernel name, for the bars.

    ``void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, ...>(int,
    ...)`` is ``vectorized_elementwise_kernel<4, FillFunctor, Array>``: the return type, the
    parameter list and namespaces go, and each template argument is cut to its own base name.
    Names without C++ decoration (``ampere_sgemm_128x64_nn``, ``Memcpy HtoD``) stay as they are.
    """
    text = name.strip()
    if "<" not in text and "::" not in text:
        return text[:SHORT_NAME_CHARS]
    parens = _top_level(text, "(", ")")
    if parens and text.endswith(")") and parens[-1][1] == len(text):
        text = text[: parens[-1][0]]  # the parameter list
    angles = _top_level(text, "<", ">")
    head = text
    args: list[str] = []
    if angles and angles[-1][1] == len(text.rstrip()):
        a, b = angles[-1]
        head = text[:a]
        inner, depth, part = text[a + 1 : b - 1], 0, ""
        for ch in inner + ",":
            if ch == "," and depth == 0:
                args.append(_base(part) or part.strip())
                part = ""
                continue
            depth += (ch in "<(") - (ch in ">)")
            part += ch
    short = _base(head) or head.strip()
    if args:
        short += "<" + ", ".join(a for a in args if a) + ">"
    if len(short) > SHORT_NAME_CHARS:
        short = short[: SHORT_NAME_CHARS - 1] + "…"
    return short or name[:SHORT_NAME_CHARS]


def intervals(source: Source, run_id: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per device, its busy intervals: the union of its kernel, copy and memset spans as sorted,
    disjoint ``(starts, ends)``."""
    table = source.query_arrow(
        """
        SELECT toUInt32OrZero(extract(lane, '^gpu([0-9]+)/')) AS device, start_ns, end_ns
        FROM __db__.spans
        WHERE run_id = {run:String} AND category IN {cats:Array(String)}
          AND match(lane, '^gpu[0-9]+/stream[0-9]+$') AND end_ns > start_ns
        """,
        {"run": run_id, "cats": list(DEVICE_CATEGORIES)},
    )
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    if not table.num_rows:
        return out
    device = table["device"].to_numpy().astype(np.int64)
    start = table["start_ns"].to_numpy().astype(np.int64)
    end = table["end_ns"].to_numpy().astype(np.int64)
    for d in np.unique(device):
        mine = device == d
        out[int(d)] = union(start[mine], end[mine])
    return out


def union(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals ``[start, end)`` as sorted, disjoint ``(starts, ends)``."""
    if not len(start):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)
    first = np.flatnonzero(np.r_[True, s[1:] > reach[:-1]])
    return s[first], np.maximum.reduceat(e, first)


def covered(starts: np.ndarray, ends: np.ndarray, w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    """Nanoseconds of the disjoint sorted intervals ``(starts, ends)`` inside each window
    ``[w0, w1)`` (arrays of windows)."""
    w0, w1 = np.asarray(w0, np.int64), np.asarray(w1, np.int64)
    if not len(starts):
        return np.zeros(len(w0), np.int64)
    cum = np.r_[0, np.cumsum(ends - starts)]
    i0 = np.searchsorted(ends, w0, side="right")  # first interval ending after w0
    i1 = np.searchsorted(starts, w1, side="left")  # intervals starting before w1
    total = cum[np.maximum(i1, i0)] - cum[i0]
    some = i1 > i0
    head = np.where(some, np.maximum(0, w0 - starts[np.minimum(i0, len(starts) - 1)]), 0)
    tail = np.where(some, np.maximum(0, ends[np.maximum(i1 - 1, 0)] - w1), 0)
    return np.where(some, total - head - tail, 0)


def busy_per_step(
    source: Source,
    run_id: str,
    devices: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
) -> list[StepBusy]:
    """Each step's GPU busy and idle time on each device that ran anything in the run.

    A step's window is its span on the CPU clock; busy is the union of the device's kernel, copy
    and memset intervals inside it, idle the rest. Rows ``step, pid, index, start_ns, dur_ns,
    device, busy_ns, idle_ns, busy_share`` in step order, then device. ``devices``: what
    :func:`intervals` gives, when the caller has it already.
    """
    if devices is None:
        devices = intervals(source, run_id)
    if not devices:
        return []
    steps = query_rows(
        source,
        """
        SELECT name, pid, start_ns, end_ns FROM __db__.spans
        WHERE run_id = {run:String} AND category = 'step' AND end_ns > start_ns
        ORDER BY start_ns, pid LIMIT 100000
        """,
        {"run": run_id},
    )
    if not steps:
        return []
    w0 = np.array([int(s["start_ns"]) for s in steps], np.int64)
    w1 = np.array([int(s["end_ns"]) for s in steps], np.int64)
    busy = {d: covered(s, e, w0, w1) for d, (s, e) in devices.items()}
    seen: dict[int, int] = {}
    out: list[StepBusy] = []
    for i, st in enumerate(steps):
        index = seen.get(int(st["pid"]), 0)
        seen[int(st["pid"])] = index + 1
        dur = int(w1[i] - w0[i])
        for d in sorted(devices):
            b = int(busy[d][i])
            out.append(StepBusy(step=str(st["name"]), pid=int(st["pid"]), index=index,
                                start_ns=int(w0[i]), dur_ns=dur, device=d, busy_ns=b,
                                idle_ns=dur - b, busy_share=b / dur))  # fmt: skip
    return out


def top_kernels(source: Source, run_id: str, top: int = 20) -> list[DeviceKernels]:
    """The kernels that took the most GPU time, per device, as ``gpu-trace show`` reads them
    (:func:`gpu_trace.query.gpu.gpu_summary`), with each name's short form. A kernel's
    ``share`` is its total over the device's busy time (kernels that ran at once on two streams
    both count, so shares can add up past 1)."""
    devices: list[DeviceKernels] = []
    for d in gpu_summary(source, run_id, top)["devices"]:
        kernels = [
            KernelTotal(name=str(k["name"]), short=short_kernel_name(str(k["name"])),
                        count=int(k["count"]), total_ns=int(k["total_ns"]),
                        mean_ns=int(k["mean_ns"]), share=float(k["share"]))
            for k in d["top"]
        ]  # fmt: skip
        devices.append(
            DeviceKernels(device=int(d["device"]), busy_ns=int(d["busy_ns"]),
                          window_ns=int(d["window_ns"]), kernels=int(d["kernels"]),
                          kernel_ns=int(d["kernel_ns"]), top=kernels)
        )  # fmt: skip
    return devices


def _span_by_id(source: Source, run_id: str, span_id: int) -> SpanRef | None:
    rows = query_rows(
        source,
        """
        SELECT toString(span_id) AS id, toString(parent_span_id) AS parent_id, host,
               pid, tid, lane, category, name, depth, start_ns, end_ns
        FROM __db__.spans WHERE run_id = {run:String} AND span_id = {id:UInt64} LIMIT 1
        """,
        {"run": run_id, "id": int(span_id)},
    )
    if not rows:
        return None
    r = rows[0]
    return SpanRef(span_id=str(r["id"]), parent_span_id=str(r["parent_id"]), host=str(r["host"]),
                   pid=int(r["pid"]), tid=int(r["tid"]), lane=str(r["lane"]),
                   category=str(r["category"]), name=str(r["name"]), depth=int(r["depth"]),
                   start_ns=int(r["start_ns"]), end_ns=int(r["end_ns"]))  # fmt: skip


def launch_chain(
    source: Source, run_id: str, span_id: str, parent_span_id: str | int
) -> list[SpanRef]:
    """The spans a span was launched from, innermost first: for a kernel, its API call, then the
    op, modules and ranges open on the launching thread, up to the step (or the root).

    Follows ``parent_span_id`` (at most :data:`MAX_CHAIN` spans). Stops at a step, at a parent
    not in the run, or at a loop.
    """
    out: list[SpanRef] = []
    seen = {str(span_id)}
    parent = int(parent_span_id or 0)
    while parent and len(out) < MAX_CHAIN and str(parent) not in seen:
        found = _span_by_id(source, run_id, parent)
        if found is None:
            break
        out.append(found)
        seen.add(found["span_id"])
        if found["category"] == "step":
            break
        parent = int(found["parent_span_id"] or 0)
    return out


def op_gpu_time(source: Source, run_id: str) -> dict[str, int]:
    """GPU time (ns) of each forwarded op on the server, by the op's name as the forwarding
    breakdown groups it: the device work (kernels, copies, memsets) under each ``server/op``
    span, found by following parent links up from the work (through its API call and any
    range in between), never by matching names. Empty when the run has no server op with GPU
    work under it."""
    has = query_rows(
        source,
        """
        SELECT count() AS n FROM __db__.spans
        WHERE run_id = {run:String} AND lane = 'server/op'
        """,
        {"run": run_id},
    )
    if not has or not int(has[0]["n"]):
        return {}
    work = query_rows(
        source,
        """
        SELECT parent_span_id AS parent, sum(end_ns - start_ns) AS ns FROM __db__.spans
        WHERE run_id = {run:String} AND category IN {cats:Array(String)}
          AND parent_span_id != 0 AND end_ns >= start_ns
        GROUP BY parent
        """,
        {"run": run_id, "cats": list(DEVICE_CATEGORIES)},
    )
    # Climb level by level: {span id: ns of device work under it still unattributed}.
    pending: dict[int, int] = {}
    for r in work:
        pending[int(r["parent"])] = pending.get(int(r["parent"]), 0) + int(r["ns"])
    out: dict[str, int] = {}
    for _ in range(MAX_CHAIN):
        if not pending:
            break
        rows = query_rows(
            source,
            """
            SELECT span_id, parent_span_id, lane, name FROM __db__.spans
            WHERE run_id = {run:String} AND span_id IN {ids:Array(UInt64)}
            """,
            {"run": run_id, "ids": sorted(pending)},
        )
        nxt: dict[int, int] = {}
        for r in rows:
            ns = pending.pop(int(r["span_id"]), 0)
            if not ns:
                continue
            if r["lane"] == "server/op":
                out[r["name"]] = out.get(r["name"], 0) + ns
            elif int(r["parent_span_id"]) and r["lane"] != "server/execute":
                # A batch's execute span is above its ops: work there is no op's.
                nxt[int(r["parent_span_id"])] = nxt.get(int(r["parent_span_id"]), 0) + ns
        pending = nxt
    return out
