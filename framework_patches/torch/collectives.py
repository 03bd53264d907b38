"""Collectives as spans on every rank, and each rank's place in its job.

Why: a distributed program spends its time waiting for the slowest rank, and that waiting is in
its collectives (all-reduce, all-gather, ...), which no module or op range shows as such. What
PyTorch 2.13 records for a collective, and what is read here, from the native observer
(``observer.cpp``, "collectives"):

- the **c10d call**: every collective (``torch.distributed.all_reduce``, DDP's reducer from C++,
  FSDP) goes through a dispatcher op ``c10d::allreduce_``, ``c10d::_allgather_base_``, ... on the
  thread that issues it; its start is when the rank *entered* the collective. Inside it, NCCL
  records ``record_param_comms`` with the process group, sequence number, sizes, dtype and group
  ranks in the thread's debug info, read there; gloo (CPU) records none of it in 2.13.
- the **backend's work**: ``gloo:all_reduce``, ``nccl:all_reduce`` ranges (record_function
  scope) with the input tensors, from when the backend runs the work to when it completes, on the
  backend's thread: the bytes and dtype where ``record_param_comms`` gave none, and when the
  collective was done.

Each call becomes one span, category ``collective``, lane ``torch/collectives`` (the program's
thread), named by its kind (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``,
``barrier``, ``all_to_all``, ``send``, ``recv``...), from its enter to its work's end (the k-th
call of a kind matched to the k-th work of that kind: backends run a group's work in order), with
attrs ``op``, ``seq``, ``pg``, ``pg_desc``, ``bytes_in``, ``bytes_out``, ``dtype``,
``group_size``, ``group_rank``, ``ranks``, ``backend``, ``rank``. Each work is a span too, on lane
``torch/collectives/<backend>``. ``seq`` is the group's sequence number where the backend gives it
(NCCL), else the process's count of its collective calls (gloo): the same on every rank of a job
with one process group, which is what links one collective's spans across ranks (tracer/ranks.py).

The observer's collective callbacks start only once a process group exists
(``init_process_group``, patched here, or one already made when torch is patched): the c10d call
is a FUNCTION-scope RecordFunction, and such a callback makes every op of the process pay a call
and a one-byte name check, which a program with no process group never pays. Where the observer
is not built, collectives are not captured (one log line says so).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from types import ModuleType

import numpy as np
import pyarrow as pa

from gpu_trace.framework_patches.torch import ops_native
from gpu_trace.tracer import ranks
from gpu_trace.tracer import recorder as _recorder
from gpu_trace.tracer.buffer import private_bits
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.columns import spans_to_table
from gpu_trace.tracer.recorder import Recorder
from gpu_trace.tracer.records import COLLECTIVE

log = logging.getLogger(__name__)

LANE = ranks.COLLECTIVE_LANE
#: One record of observer.cpp (struct CommRec), field for field.
COMM_RECORD = np.dtype(
    [
        ("start", "<i8"),
        ("end", "<i8"),
        ("seq", "<i8"),
        ("in_elems", "<i8"),
        ("out_elems", "<i8"),
        ("bytes", "<i8"),
        ("name", "<i4"),
        ("pg", "<i4"),
        ("pg_desc", "<i4"),
        ("ranks", "<i4"),
        ("dtype", "<i4"),
        ("tid", "<i4"),
        ("kind", "<i4"),
        ("rank", "<i4"),
        ("world", "<i4"),
        ("depth", "<i4"),
    ]
)
CALL, WORK = 0, 1
#: A call whose work has not ended after this long is written without it.
MAX_WAIT_S = 30.0
CHUNK = 4096

#: c10d op and backend work names (prefix, ``_``, ``_base``, ``_coalesced`` taken off) -> kind.
_KINDS = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "allgather_into_tensor": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoallv": "all_to_all",
    "recv_any_source": "recv",
    "monitored_barrier": "barrier",
}


def kind_of(name: str) -> str:
    """A collective's kind from a c10d op name (``c10d::_allgather_base_``) or a backend work
    name (``gloo:all_reduce``, ``nccl:send 0->1``): ``all_gather``, ``all_reduce``, ``send``."""
    base = name.split("::", 1)[1] if "::" in name else name.split(":", 1)[-1]
    base = (base.split() or [""])[0].strip("_")
    for suffix in ("_coalesced", "_base"):
        base = base.removesuffix(suffix).strip("_")
    return _KINDS.get(base, base)


class CommSource:
    """The recorder's source of collective spans: drains the observer's collective records."""

    name = "torch-collectives"

    def __init__(self, lib: ctypes.CDLL, facts: dict[str, str]) -> None:
        self._lib = lib
        self.facts = facts
        self._on = False
        self._lock = threading.Lock()
        self._calls: dict[str, deque[np.void]] = {}  # kind -> calls waiting for their work
        self._works: dict[str, deque[np.void]] = {}  # kind -> works waiting for their call
        self._seq = 0  # the process's collective calls so far (gloo's seq)
        self._names: list[str] = []
        self._dropped0 = 0
        self._prefix = (private_bits(31) | 1) << 32
        self._next = 0

    def start(self) -> bool:
        if self._on:
            return True
        if self._lib.gt_comms_start() != 0:
            log.warning("gpu-trace: collectives are not captured: the observer did not start")
            return False
        self._dropped0 = int(self._lib.gt_comms_dropped())
        self._on = True
        return True

    def stop(self) -> None:
        if self._on:
            self._on = False
            self._lib.gt_comms_stop()

    # ---- Source protocol ----------------------------------------------------------------------

    def drain(self) -> Iterable[tuple[str, pa.Table]]:
        closing = _recorder.active is None
        if closing:
            self.stop()
        with self._lock:
            rows, tids = self._spans(self._take(), closing)
        if rows:
            yield "spans", spans_to_table(rows, os.getpid(), np.asarray(tids, dtype=np.uint64))

    def dropped(self) -> int:
        return int(self._lib.gt_comms_dropped()) - self._dropped0

    def after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._calls, self._works = {}, {}
        self._prefix = (private_bits(31) | 1) << 32

    def close(self) -> None:
        self.stop()
        buf = np.empty(CHUNK, dtype=COMM_RECORD)
        while self._lib.gt_comms_drain(buf.ctypes.data_as(ctypes.c_void_p), CHUNK) == CHUNK:
            pass

    # ---- records to spans ---------------------------------------------------------------------

    def _take(self) -> np.ndarray:
        got = []
        while True:
            buf = np.empty(CHUNK, dtype=COMM_RECORD)
            n = int(self._lib.gt_comms_drain(buf.ctypes.data_as(ctypes.c_void_p), CHUNK))
            if n:
                got.append(buf[:n])
            if n < CHUNK:
                break
        if not got:
            return np.empty(0, dtype=COMM_RECORD)
        out = np.concatenate(got)
        return out[np.argsort(out["start"], kind="stable")]

    def _text(self, i: int) -> str:
        names = ops_native.name_list(self._lib, self._names)
        return names[i] if 0 <= i < len(names) else ""

    def _spans(self, recs: np.ndarray, closing: bool) -> tuple[list[tuple[object, ...]], list[int]]:
        rows: list[tuple[object, ...]] = []
        tids: list[int] = []
        for r in recs:
            if int(r["kind"]) == CALL and int(r["depth"]) > 0:
                continue  # a c10d op inside another (coalesced): the outer one is the collective
            kind = kind_of(self._text(int(r["name"])))
            if int(r["kind"]) == CALL:
                if int(r["seq"]) < 0:
                    r = r.copy()
                    self._seq += 1
                    r["seq"] = self._seq
                self._calls.setdefault(kind, deque()).append(r)
            else:
                self._works.setdefault(kind, deque()).append(r)
                rows.append(self._work_span(r, kind))
                tids.append(int(r["tid"]))
        limit = now_ns() - int(MAX_WAIT_S * 1e9)
        for kind, calls in self._calls.items():
            works = self._works.get(kind, deque())
            while calls:
                if works:
                    call, work = calls.popleft(), works.popleft()
                elif closing or int(calls[0]["end"]) < limit:
                    call, work = calls.popleft(), None
                else:
                    break
                rows.append(self._call_span(call, work, kind))
                tids.append(int(call["tid"]))
        for works in self._works.values():  # a work no call came for (issued before the start)
            while works and (closing or int(works[0]["end"]) < limit):
                works.popleft()
        return rows, tids

    def _id(self) -> int:
        self._next += 1
        return self._prefix + self._next

    def _work_span(self, r: np.void, kind: str) -> tuple[object, ...]:
        name = self._text(int(r["name"]))
        attrs = {"op": kind, "backend": name.split(":", 1)[0]}
        if int(r["bytes"]) >= 0:
            attrs["bytes_in"] = str(int(r["bytes"]))
        if int(r["dtype"]) >= 0:
            attrs["dtype"] = self._text(int(r["dtype"]))
        lane = f"{LANE}/{attrs['backend']}"
        return (self._id(), 0, lane, COLLECTIVE, name, int(r["start"]), int(r["end"]), 0, attrs)

    def _call_span(self, call: np.void, work: np.void | None, kind: str) -> tuple[object, ...]:
        attrs = {"op": kind, "seq": str(int(call["seq"]))}
        if "rank" in self.facts:
            attrs["rank"] = self.facts["rank"]
        for key, field in (
            ("pg", "pg"),
            ("pg_desc", "pg_desc"),
            ("dtype", "dtype"),
            ("ranks", "ranks"),
        ):
            if int(call[field]) >= 0:
                attrs[key] = self._text(int(call[field]))
        attrs.setdefault("pg", self.facts.get("pg", ""))
        elem = 0
        if int(call["bytes"]) >= 0 and int(call["in_elems"]) > 0:
            elem = int(call["bytes"]) // int(call["in_elems"])
            attrs["bytes_in"] = str(int(call["bytes"]))
            if int(call["out_elems"]) >= 0:
                attrs["bytes_out"] = str(int(call["out_elems"]) * elem)
        if int(call["world"]) >= 0:
            attrs["group_size"] = str(int(call["world"]))
            attrs["group_rank"] = str(int(call["rank"]))
        elif "world_size" in self.facts:
            attrs["group_size"] = self.facts["world_size"]
        end = int(call["end"])
        if work is not None:
            backend = self._text(int(work["name"])).split(":", 1)[0]
            attrs["backend"] = backend
            end = max(end, int(work["end"]))
            if "bytes_in" not in attrs and int(work["bytes"]) >= 0:
                attrs["bytes_in"] = str(int(work["bytes"]))
            if "dtype" not in attrs and int(work["dtype"]) >= 0:
                attrs["dtype"] = self._text(int(work["dtype"]))
        elif self.facts.get("backend"):
            attrs["backend"] = self.facts["backend"]
        return (self._id(), 0, LANE, COLLECTIVE, kind, int(call["start"]), end, 0, attrs)


# ---- the patch -------------------------------------------------------------------------------------

_source: CommSource | None = None
_rec: Recorder | None = None
_originals: list[tuple[ModuleType, str, Callable[..., object]]] = []


def library() -> ctypes.CDLL | None:
    """The observer library with its collective functions declared, or None."""
    lib = ops_native.library()
    if lib is None:
        return None
    try:
        lib.gt_comm_record_size.restype = ctypes.c_size_t
        if lib.gt_comm_record_size() != COMM_RECORD.itemsize:
            log.warning("gpu-trace: collectives are not captured: the record layout differs")
            return None
        lib.gt_comms_drain.restype = ctypes.c_size_t
        lib.gt_comms_drain.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.gt_comms_dropped.restype = ctypes.c_uint64
    except AttributeError:
        return None
    return lib


def facts_from_torch(dist: ModuleType) -> dict[str, str]:
    """The process's facts from the launcher's environment, completed by ``torch.distributed``
    (rank, world size, backend) once it is initialized; never raises."""
    facts = ranks.from_env()
    try:
        if dist.is_available() and dist.is_initialized():
            facts.update(
                rank=str(dist.get_rank()),
                world_size=str(dist.get_world_size()),
                backend=str(dist.get_backend()),
                source="torch",
            )
            facts.setdefault("launcher", "torch")
            import socket

            facts.setdefault("host", socket.gethostname())
    except Exception:
        log.debug("gpu-trace: reading torch.distributed's rank failed", exc_info=True)
    return facts


def on_group(dist: ModuleType) -> None:
    """A process group exists: note the process's rank and start the collective callbacks."""
    global _source
    rec = _rec
    if rec is None:
        return
    facts = facts_from_torch(dist)
    ranks.write(rec.run_dir, facts)
    if _source is not None:
        _source.facts = facts
        return
    lib = library()
    if lib is None:
        log.info("gpu-trace: collectives are not captured: the native observer is not built")
        return
    source = CommSource(lib, facts)
    if source.start():
        _source = source
        rec.add_source(source)


def patch(torch: ModuleType, rec: Recorder | None) -> None:
    """Start collectives when the program makes its process group (now, if it has one)."""
    global _rec
    unpatch()
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or rec is None:
        return
    _rec = rec
    c10d: ModuleType = dist.distributed_c10d
    original: Callable[..., object] = c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: object, **kwargs: object) -> object:
        try:
            return original(*args, **kwargs)
        finally:
            try:
                if dist.is_initialized():
                    on_group(dist)
            except Exception:  # never break the traced program
                log.debug("gpu-trace: starting collectives failed", exc_info=True)

    modules: tuple[ModuleType, ...] = (c10d, dist)
    for module in modules:
        if getattr(module, "init_process_group", None) is original:
            _originals.append((module, "init_process_group", original))
            setattr(module, "init_process_group", init_process_group)  # noqa: B010
    if dist.is_initialized():
        on_group(dist)


def unpatch() -> None:
    """Undo :func:`patch` and stop the collective callbacks. Idempotent."""
    global _source, _rec
    while _originals:
        module, name, original = _originals.pop()
        setattr(module, name, original)
    if _source is not None:
        _source.close()
        _source = None
    _rec = None


def is_patched() -> bool:
    return bool(_originals) or _source is not None
