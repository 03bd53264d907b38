"""Bringing a paged-out session back: its storages copied to the device, pipelined with its ops.

The pager (:mod:`gpu_trace.runtime.sharing.pager`) starts a :class:`Restore` at the session's next
batch, with the storages in the order the batch's ops name them, then the rest. Pipelined
(PipeSwitch's idea), every copy starts at once and each op waits for its own inputs only
(:class:`Gate`): on a GPU the copies run on a side stream from pinned memory with an event per
storage, and the op's stream waits on its inputs' events (the executor's thread never blocks); on
the CPU device a background thread copies (torch's copies release the GIL) and the op waits for its
inputs' copies. Not pipelined, everything is copied before the first op, for comparison.

A storage "lands" on the executor's thread: its tensor objects are re-pointed at the device copy
(``t.data = view``, which keeps each object, its version counter and its ``_base``) and the
session's memory account moves it back from host memory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpu_trace.runtime.protocol.errors import OpError

if TYPE_CHECKING:
    from gpu_trace.runtime.sharing.sessions import Session

log = logging.getLogger(__name__)

now_ns = time.perf_counter_ns

#: How deep :func:`handle_refs` looks into an op's arguments.
_MAX_SCAN_DEPTH = 8


@dataclass
class RestoreStats:
    """One restore: ``first_op_ns`` from its start until the batch's first op could run (its
    inputs back), ``all_ns`` until every storage was back (CUDA event times on a GPU)."""

    session: int
    bytes: int
    storages: int
    pipelined: bool
    device: str
    start_ns: int
    first_op_ns: int = 0
    all_ns: int = 0

    @property
    def bytes_per_s(self) -> float:
        """The restore's bandwidth (its bytes over ``all_ns``)."""
        return self.bytes * 1e9 / self.all_ns if self.all_ns else 0.0


class PagedStorage:
    """One paged-out storage: its host copy and every tensor object that points into it."""

    __slots__ = (
        "key",
        "size",
        "counted",
        "tensors",
        "handles",
        "host",
        "device",
        "ready",
        "event",
        "error",
        "done_ns",
        "final",
    )

    def __init__(self, size: int, tensors: list[Any], handles: list[int]) -> None:
        self.key = 0  # the account's key while paged out (the host buffer's address)
        self.size = size  # bytes of the storage
        self.counted = 0  # bytes the account counts for it (rounded to the allocator's blocks)
        self.tensors = tensors
        self.handles = handles
        self.host: Any = None  # uint8 host tensor (pinned on CUDA)
        self.device: Any = None  # uint8 device tensor, once copied back
        self.ready: threading.Event | None = None  # CPU device: the copier finished it
        self.event: Any = None  # CUDA: the side stream finished it
        self.error: BaseException | None = None
        self.done_ns = 0
        self.final = False  # its tensors point at the device again


def restore_order(
    storages: list[PagedStorage], by_handle: dict[int, PagedStorage], ops: list[Any]
) -> list[PagedStorage]:
    """``storages`` in the order ``ops`` name their handles, then the rest in their order."""
    refs: list[int] = []
    for op in ops:
        if type(op) is list and len(op) >= 3:
            handle_refs(op[1], refs)
            handle_refs(op[2], refs)
    order: list[PagedStorage] = []
    seen: set[int] = set()
    for h in refs:
        st = by_handle.get(h)
        if st is not None and id(st) not in seen:
            seen.add(id(st))
            order.append(st)
    order.extend(st for st in storages if id(st) not in seen)
    return order


class Restore:
    """One session's storages coming back to ``device`` (see the module's docstring).

    ``hook(event, index)``: the test seam of :class:`~gpu_trace.runtime.sharing.pager.Pager`.
    ``stream``: the side CUDA stream (None on the CPU device).
    """

    def __init__(
        self,
        session: Session,
        order: list[PagedStorage],
        by_handle: dict[int, PagedStorage],
        stats: RestoreStats,
        *,
        torch: Any,
        device: Any,
        pipelined: bool,
        hook: Callable[[str, int], None] | None = None,
        stream: Any = None,
    ) -> None:
        self.session = session
        self.order = order
        self.by_handle = by_handle
        self.stats = stats
        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        self.pipelined = pipelined
        self.hook = hook
        self.stream = stream
        self.pending = len(order)
        self.cancelled = False
        self.thread: threading.Thread | None = None
        self.start_event: Any = None
        self.end_event: Any = None
        self.first_event: Any = None

    # ---- starting --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the copies (pipelined), or bring everything back now (not)."""
        if not self.pipelined:
            self._all_now()
        elif self.cuda:
            self._issue_cuda()
        else:
            for st in self.order:
                st.ready = threading.Event()
            self.thread = threading.Thread(
                target=self._copy_loop, name="gpu-trace-restore", daemon=True
            )
            self.thread.start()

    def _all_now(self) -> None:
        hook = self.hook
        if self.cuda:
            self.start_event = _timing_event(self.torch)
            self.start_event.record()
        for i, st in enumerate(self.order):
            if hook is not None:
                hook("copy", i)
            try:
                self.land(st)
            except OpError as exc:  # its ops will fail, the session goes on
                log.info("gpu-trace serve: session %d: %s", self.session.id, exc)
                break
            if hook is not None:
                hook("copied", i)
        if self.cuda:
            self.end_event = _timing_event(self.torch)
            self.end_event.record()

    def _issue_cuda(self) -> None:
        """Start every copy on the side stream, in order, with an event per storage."""
        torch, side = self.torch, self.stream
        # Allocated on the stream the session's ops run on (the executor's current one), so the
        # allocator ties the blocks to it; the side stream is told it writes them.
        issued: list[tuple[PagedStorage, Any]] = []
        for st in self.order:
            try:
                issued.append((st, torch.empty(st.size, dtype=torch.uint8, device=self.device)))
            except Exception as exc:  # out of memory: the rest come back one by one
                log.info("gpu-trace serve: pipelined restore stopped: %s", exc)
                break
        side.wait_stream(torch.cuda.current_stream(self.device))  # blocks reused from its work
        self.start_event = _timing_event(torch)
        self.start_event.record(side)
        with torch.cuda.stream(side):
            for i, (st, dev) in enumerate(issued):
                if self.hook is not None:
                    self.hook("copy", i)
                dev.copy_(st.host, non_blocking=True)
                dev.record_stream(side)
                st.device = dev
                st.event = torch.cuda.Event()
                st.event.record(side)
        self.end_event = _timing_event(torch)
        self.end_event.record(side)

    def _copy_loop(self) -> None:
        """CPU device: copy the storages back in order, on this thread."""
        torch, hook = self.torch, self.hook
        for i, st in enumerate(self.order):
            if self.cancelled:
                break
            if hook is not None:
                hook("copy", i)
            try:
                dev = torch.empty(st.size, dtype=torch.uint8, device=self.device)
                dev.copy_(st.host)
                st.device = dev
            except BaseException as exc:  # the executor copies it itself when an op needs it
                st.error = exc
            st.done_ns = now_ns()
            assert st.ready is not None
            st.ready.set()
            if hook is not None:
                hook("copied", i)
        for st in self.order:  # cancelled: let no waiter hang
            if st.ready is not None and not st.ready.is_set():
                st.ready.set()

    # ---- landing (the executor's thread) ---------------------------------------------------------

    def ready_for(self, op: Any) -> None:
        """Wait until ``op``'s inputs are back (everything, for ``rt::backward``)."""
        if type(op) is not list or len(op) < 3:
            return
        if op[0] == "rt::backward":  # its graph may hold the session's tensors
            for st in self.order:
                if not st.final:
                    self.land(st)
            return
        refs: list[int] = []
        handle_refs(op[1], refs)
        handle_refs(op[2], refs)
        for h in refs:
            found = self.by_handle.get(h)
            if found is not None and not found.final:
                self.land(found)

    def land(self, st: PagedStorage, in_batch: bool = True) -> None:
        """Point ``st``'s tensors at its device copy (waiting for it, or making it).

        ``in_batch``: on the session's stream, which then waits for the copy; else (between
        batches, on a GPU) the host waits for it.
        """
        torch = self.torch
        if st.ready is not None:
            st.ready.wait()
        if st.event is not None:
            if in_batch:
                torch.cuda.current_stream(self.device).wait_event(st.event)
            else:
                st.event.synchronize()
        if st.device is None:  # not started, or failed: copy it here
            try:
                dev = torch.empty(st.size, dtype=torch.uint8, device=self.device)
                dev.copy_(st.host, non_blocking=self.cuda)
            except Exception as exc:
                raise OpError(
                    f"could not page {st.size} bytes of this session's tensors back in: {exc}"
                ) from None
            if self.cuda and not in_batch:
                torch.cuda.current_stream(self.device).synchronize()
            st.device = dev
            st.done_ns = now_ns()
        storage = st.device.untyped_storage()
        for t in st.tensors:
            t.data = view_on(torch, t, storage)
        session = self.session
        account = session.account
        notify, account.on_change = account.on_change, None
        try:
            session.handles.moved(st.key, storage.data_ptr(), st.handles, paged=False)
        finally:
            account.on_change = notify
        session.usage.evicted_bytes = account.paged_bytes
        if notify is not None:
            notify(account)
        st.final = True
        st.host = st.device = st.event = None
        st.tensors = []
        self.pending -= 1

    def first_op(self) -> None:
        if self.cuda and self.start_event is not None:
            self.first_event = _timing_event(self.torch)
            self.first_event.record()
        self.stats.first_op_ns = max(1, now_ns() - self.stats.start_ns)

    def settle(self, wait: bool = False, in_batch: bool = False) -> bool:
        """Land the storages whose copies are done (all of them, waiting, if ``wait``); True
        when everything is back and every copy has finished."""
        if wait and self.thread is not None:
            # Land after the copier is done: landing while it copies takes the GIL from it
            # between its copies (it waits for the GIL after each one).
            self.thread.join()
        for st in self.order:
            if st.final:
                continue
            if st.event is not None and not in_batch and not wait and not st.event.query():
                continue
            if wait or st.ready is None or st.ready.is_set():
                self.land(st, in_batch)
        if self.pending:
            return False
        if self.thread is not None:
            self.thread.join()
        if self.end_event is not None:
            if not wait and not self.end_event.query():
                return False
            self.end_event.synchronize()
        return True

    def finish(self) -> RestoreStats:
        """The restore's figures, once :meth:`settle` said it is done."""
        stats = self.stats
        if self.end_event is not None and self.start_event is not None:
            self.end_event.synchronize()
            stats.all_ns = max(1, int(self.start_event.elapsed_time(self.end_event) * 1e6))
            if self.first_event is not None:
                self.first_event.synchronize()
                first = self.start_event.elapsed_time(self.first_event) * 1e6
                stats.first_op_ns = max(1, int(first))
        else:
            done = max((st.done_ns for st in self.order), default=0)
            stats.all_ns = max(1, (done or now_ns()) - stats.start_ns)
        if not stats.first_op_ns:  # not pipelined: the first op ran after everything
            stats.first_op_ns = stats.all_ns
        return stats


class Gate:
    """What the executor calls before each op of a batch that runs while a restore is on."""

    __slots__ = ("restore", "index")

    def __init__(self, restore: Restore) -> None:
        self.restore = restore
        self.index = 0

    def __call__(self, op: Any) -> None:
        restore = self.restore
        if restore.pending:
            restore.ready_for(op)
        if not restore.stats.first_op_ns:
            restore.first_op()
        if restore.hook is not None:
            restore.hook("op", self.index)
        self.index += 1


# ---- helpers -------------------------------------------------------------------------------------


def handle_refs(value: Any, out: list[int], depth: int = 0) -> None:
    """Append the tensor handles ``{"h": n}`` in an op's arguments to ``out``, in order."""
    t = type(value)
    if t is list:
        if depth < _MAX_SCAN_DEPTH:
            for v in value:
                if type(v) in (list, dict):
                    handle_refs(v, out, depth + 1)
    elif t is dict:
        if len(value) == 1 and "h" in value:
            if type(value["h"]) is int:
                out.append(value["h"])
        elif depth < _MAX_SCAN_DEPTH:
            for v in value.values():
                if type(v) in (list, dict):
                    handle_refs(v, out, depth + 1)


def view_on(torch: Any, t: Any, storage: Any) -> Any:
    """A tensor like ``t`` (dtype, offset, sizes, strides, conj and neg bits) on ``storage``."""
    v = torch.empty(0, dtype=t.dtype, device=storage.device)
    v.set_(storage, t.storage_offset(), t.size(), t.stride())
    if t.is_conj():
        v = v.conj()
    if t.is_neg():
        v = torch._neg_view(v)
    return v


def _timing_event(torch: Any) -> Any:
    return torch.cuda.Event(enable_timing=True)


__all__ = ["Gate", "PagedStorage", "Restore", "RestoreStats", "handle_refs", "restore_order"]
