"""Idle reclamation and fast switching: a session's tensors paged out to host memory and back.

The server's :class:`Pager` moves every storage a session's handles hold to host memory when the
session has been idle for its tenant's ``idle_s`` (or the server's default), when the device is
full and another session needs room (:meth:`Pager.reclaim`, called by
:mod:`gpu_trace.runtime.memory`), or when an admin asks. On a GPU the host copies are pinned; on
the CPU device paging is a copy into new host memory (the original allocation is freed), so it
saves nothing there but exercises the same code.

Each handle's tensor is re-pointed in place (``t.data = view``): the tensor object, its
autograd version counter and its ``_base`` stay, and tensors that shared a storage share one
host storage, so views still alias their base. A storage that something else holds too (a
graph kept for ``rt::backward``: its leaves and outputs, or tensors it saved) stays on the
device, since paging it out would free nothing.

The session's next batch brings it back, pipelined (PipeSwitch's idea): copies start at once,
storages the batch's ops name first, in op order, then the rest; each op runs as soon as *its*
inputs are back. On a GPU the copies run on a side stream from pinned memory with an event per
storage, and an op's stream waits for its inputs' events (the executor thread never blocks); on
the CPU device a background thread copies (torch's copies release the GIL) and an op waits for
its inputs' copies. ``pipelined=False`` restores everything before the first op, for comparison.

Everything that touches a session's tables runs on the executor's thread or under
``executor.lock``, like the rest of the executor's work.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpu_trace.runtime.session import OpError

if TYPE_CHECKING:
    from gpu_trace.runtime.executor import Executor
    from gpu_trace.runtime.scheduler import PolicyScheduler
    from gpu_trace.runtime.session import Session

log = logging.getLogger(__name__)

now_ns = time.perf_counter_ns

#: The server's default for how long a session may sit idle before it is paged out (seconds).
DEFAULT_IDLE_S = 300.0
#: How deep :func:`handle_refs` looks into an op's arguments.
_MAX_SCAN_DEPTH = 8


@dataclass
class RestoreStats:
    """One restore: ``first_op_ns`` from its start until the batch's first op could run (its
    inputs back), ``all_ns`` until every storage was back."""

    session: int
    bytes: int
    storages: int
    pipelined: bool
    device: str
    start_ns: int
    first_op_ns: int = 0
    all_ns: int = 0


class _Storage:
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
        self.key = 0  # the account's key while paged out (the host storage's address)
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
        self.final = False  # tensors point at the device again


class _Restore:
    def __init__(self, order: list[_Storage], stats: RestoreStats) -> None:
        self.order = order
        self.pending = len(order)
        self.stats = stats
        self.cancelled = False
        self.thread: threading.Thread | None = None
        self.start_event: Any = None
        self.end_event: Any = None
        self.first_event: Any = None


class _Paged:
    """A session's paged-out state, and its restore once one has started."""

    def __init__(self, storages: list[_Storage]) -> None:
        self.storages = storages
        self.by_handle = {h: st for st in storages for h in st.handles}
        self.restore: _Restore | None = None


class _Gate:
    """Called by the executor before each op of a batch that runs while a restore is in flight."""

    __slots__ = ("pager", "session", "restore", "index")

    def __init__(self, pager: Pager, session: Session, restore: _Restore) -> None:
        self.pager = pager
        self.session = session
        self.restore = restore
        self.index = 0

    def __call__(self, op: Any) -> None:
        pager, restore = self.pager, self.restore
        if restore.pending:
            pager._ready_for(self.session, restore, op)
        if not restore.stats.first_op_ns:
            pager._first_op(restore)
        if pager.hook is not None:
            pager.hook("op", self.index)
        self.index += 1


class Pager:
    """Pages idle sessions' tensors out to host memory and back (see the module's docstring).

    ``sessions()`` lists the server's live sessions; ``idle_s`` is the default idle time before a
    session is paged out (a tenant's ``idle_s`` wins; 0 or None: never). ``pipelined`` restores
    op by op (else everything before the first op). ``hook(event, index)`` is a test seam: it is
    called with ``"copy"``/``"copied"`` and a storage's position in the restore order, and with
    ``"op"`` and the op's position in its batch when the op's inputs are back.
    """

    def __init__(
        self,
        executor: Executor,
        scheduler: PolicyScheduler,
        sessions: Callable[[], list[Session]],
        *,
        idle_s: float | None = DEFAULT_IDLE_S,
        pipelined: bool = True,
        hook: Callable[[str, int], None] | None = None,
    ) -> None:
        if idle_s is not None and idle_s < 0:
            raise ValueError("idle_s must be >= 0 (0 or None: never page idle sessions out)")
        self.executor = executor
        self.scheduler = scheduler
        self.sessions = sessions
        self.idle_s = idle_s
        self.pipelined = pipelined
        self.hook = hook
        self.torch = executor.torch
        self.device = executor.device
        self.cuda = self.device.type == "cuda"
        #: Called with ``(session, bytes)`` before a restore allocates device memory (the memory
        #: owner may make room); exceptions are logged, the restore goes on.
        self.before_restore: Callable[[Session, int], None] | None = None
        #: The latest restores' figures (the bench reads them).
        self.restores: collections.deque[RestoreStats] = collections.deque(maxlen=256)
        self.evictions = 0
        self._paged: dict[int, _Paged] = {}
        self._tried: dict[int, int] = {}  # session id -> last_active_ns when paging out did nothing
        self._stream: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- state -----------------------------------------------------------------------------------

    def is_paged(self, session: Session) -> bool:
        """``session``'s tensors are (at least partly) in host memory."""
        return session.id in self._paged

    def is_restoring(self, session: Session) -> bool:
        paged = self._paged.get(session.id)
        return paged is not None and paged.restore is not None

    def restore_order(self, session: Session) -> list[list[int]]:
        """The handles of each storage of ``session``'s restore in flight, in copy order."""
        paged = self._paged.get(session.id)
        if paged is None or paged.restore is None:
            return []
        return [list(st.handles) for st in paged.restore.order]

    def forget(self, session: Session) -> None:
        """``session`` is closing: drop its host copies, stop its restore."""
        self._tried.pop(session.id, None)
        paged = self._paged.pop(session.id, None)
        if paged is not None and paged.restore is not None:
            paged.restore.cancelled = True

    # ---- paging out ------------------------------------------------------------------------------

    def page_out(self, session: Session, reason: str = "idle") -> int:
        """Move ``session``'s storages to host memory; the bytes of device memory freed.

        The caller runs on the executor's thread or holds ``executor.lock``, between batches.
        A session already paged out frees nothing more; one being restored is restored first.
        """
        if session.closed:
            return 0
        paged = self._paged.get(session.id)
        if paged is not None:
            if paged.restore is None:
                return 0
            self.settle(session, wait=True)
        torch = self.torch
        t0 = now_ns()
        handles = session.handles
        groups = self._groups(session)
        if not groups:
            self._tried[session.id] = session.usage.last_active_ns
            return 0
        # Copy first, then re-point: nothing reads the host copies before a restore, and a
        # storage is freed only once no tensor points at it. On a GPU the session's own stream
        # may still be writing its tensors: wait for the device before and after.
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for st, storage in groups:
            st.host = torch.empty(st.size, dtype=torch.uint8, pin_memory=self.cuda)
            st.host.copy_(_bytes_of(torch, storage), non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        account = session.account
        notify, account.on_change = account.on_change, None
        moved: list[_Storage] = []
        kept = 0
        try:
            for st, storage in groups:
                host_storage = st.host.untyped_storage()
                for t in st.tensors:
                    t.data = _view(torch, t, host_storage)
                if _use_count(torch, storage) > 1:  # held elsewhere: nothing would be freed
                    for t in st.tensors:
                        t.data = _view(torch, t, storage)
                    st.host = None
                    kept += st.size
                    continue
                old_key = storage.data_ptr()
                st.key = host_storage.data_ptr()
                st.counted = handles.moved(old_key, st.key, st.handles, paged=True)
                moved.append(st)
            del groups, storage  # the last references to the device storages
        finally:
            account.on_change = notify
        usage = session.usage
        usage.evicted_bytes = account.paged_bytes
        if notify is not None:
            notify(account)
        if not moved:
            self._tried[session.id] = usage.last_active_ns
            return 0
        freed = sum(st.counted for st in moved)
        self._tried.pop(session.id, None)
        self._paged[session.id] = _Paged(moved)
        usage.evictions += 1
        self.evictions += 1
        t1 = now_ns()
        log.debug(
            "gpu-trace serve: session %d paged out (%s): %d bytes in %d storages",
            session.id,
            reason,
            freed,
            len(moved),
        )
        if session.trace:
            attrs = {
                "reason": str(reason)[:64],
                "bytes": str(freed),
                "storages": str(len(moved)),
                "kept_bytes": str(kept),
                "device": str(self.device),
            }
            slog = session.log
            slog.span(slog.new_id(), 0, "server/evict", "evict", t0, t1, attrs)
            labels = {"session": str(session.id), "tenant": session.tenant.name}
            slog.counter("evictions", t1, float(usage.evictions), labels)
            slog.counter("session_paged_bytes", t1, float(account.paged_bytes), labels)
        return freed

    def _groups(self, session: Session) -> list[tuple[_Storage, Any]]:
        """The session's device storages that paging out would free, with their tensors."""
        torch = self.torch
        kind = self.device.type  # "cuda" and "cuda:0" are one device here
        keep = _graph_keys(torch, session.graphs)
        groups: dict[int, tuple[_Storage, Any]] = {}
        seen: set[int] = set()
        for handle, t in session.handles.items():
            if (
                not isinstance(t, torch.Tensor)
                or t.layout != torch.strided
                or t.device.type != kind
                or t.is_quantized
            ):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if not key or key in keep or storage.nbytes() == 0:
                continue
            if session.handles.key(handle) != key:  # storage swapped under the account
                keep.add(key)
                groups.pop(key, None)
                continue
            entry = groups.get(key)
            if entry is None:
                entry = groups[key] = (_Storage(storage.nbytes(), [], []), storage)
            st = entry[0]
            st.handles.append(handle)
            for x in (t, t._base):
                if x is not None and id(x) not in seen:
                    seen.add(id(x))
                    st.tensors.append(x)
        return list(groups.values())

    def request_page_out(
        self, session: Session, reason: str = "admin", timeout_s: float = 30.0
    ) -> int:
        """:meth:`page_out` from any thread but the executor's (an admin's "page out").

        Waits up to ``timeout_s`` for the executor to be free; a session with work queued is
        left alone (it would come straight back). Returns the bytes freed.
        """
        if not self.executor.lock.acquire(timeout=timeout_s):
            return 0
        try:
            if self.scheduler.queued(session):
                return 0
            return self.page_out(session, reason)
        finally:
            self.executor.lock.release()

    def reclaim(
        self, need_bytes: int, for_session: Session | None = None, reason: str = "memory"
    ) -> int:
        """Page out idle sessions until ``need_bytes`` of device memory are free; bytes freed.

        Idle: not ``for_session``, nothing queued, holding device memory (one whose restore is
        still in flight is finished, then paged out again). Other tenants' sessions go first,
        then ``for_session``'s tenant's; least recently active first. Called on the executor's
        thread (by the memory owner, when the device is full).
        """
        tenant = for_session.tenant.name if for_session is not None else None
        paged = self._paged
        candidates = [
            s
            for s in self.sessions()
            if s is not for_session
            and not s.closed
            and (s.id not in paged or paged[s.id].restore is not None)
            and s.account.resident_bytes > 0
            and not self.scheduler.queued(s)
        ]
        candidates.sort(key=lambda s: (s.tenant.name == tenant, s.usage.last_active_ns, s.id))
        freed = 0
        for s in candidates:
            if freed >= need_bytes:
                break
            freed += self.page_out(s, reason)
        return freed

    # ---- restoring -------------------------------------------------------------------------------

    def begin_batch(self, session: Session, ops: list[Any]) -> _Gate | None:
        """A batch of ``session`` starts: restore it if it is paged out.

        Returns the gate the executor calls before each op (None: nothing to wait for). A
        batch without ops (frees only) does not bring the session back.
        """
        paged = self._paged.get(session.id)
        if paged is None or not ops:
            return None
        restore = paged.restore
        if restore is None:
            restore = self._start(session, paged, ops)
            if not restore.pending and not self.cuda:  # on a GPU: when its copies are done
                self._complete(session, restore)
        return _Gate(self, session, restore)

    def end_batch(self, session: Session) -> None:
        """A batch of ``session`` ended: land what is back, keep the accounts in step."""
        paged = self._paged.get(session.id)
        if paged is None:
            return
        if paged.restore is not None:
            self.settle(session, in_batch=True)
        elif session.handles:
            live = [st for st in paged.storages if _held(session, st)]
            if len(live) != len(paged.storages):  # freed while paged out: drop their copies
                if live:
                    paged.storages = live
                    paged.by_handle = {h: st for st in live for h in st.handles}
                else:
                    del self._paged[session.id]
        else:
            del self._paged[session.id]
        session.usage.evicted_bytes = session.account.paged_bytes

    def _start(self, session: Session, paged: _Paged, ops: list[Any]) -> _Restore:
        torch = self.torch
        order: list[_Storage] = []
        seen: set[int] = set()
        refs: list[int] = []
        for op in ops:
            if type(op) is list and len(op) >= 3:
                handle_refs(op[1], refs)
                handle_refs(op[2], refs)
        for h in refs:
            st = paged.by_handle.get(h)
            if st is not None and id(st) not in seen:
                seen.add(id(st))
                order.append(st)
        order.extend(st for st in paged.storages if id(st) not in seen)
        total = sum(st.counted for st in order)
        stats = RestoreStats(
            session.id, total, len(order), self.pipelined, str(self.device), now_ns()
        )
        restore = paged.restore = _Restore(order, stats)
        session.usage.restores += 1
        if self.before_restore is not None:
            try:
                self.before_restore(session, total)
            except Exception:
                log.exception("gpu-trace serve: before_restore failed")
        if not self.pipelined:
            if self.cuda:
                restore.start_event = _timing_event(torch)
                restore.start_event.record()
            for i, st in enumerate(order):
                if self.hook is not None:
                    self.hook("copy", i)
                try:
                    self._land(session, restore, st)
                except OpError as exc:  # its ops will fail, the session goes on
                    log.info("gpu-trace serve: session %d: %s", session.id, exc)
                    break
                if self.hook is not None:
                    self.hook("copied", i)
            if self.cuda and restore.start_event is not None:
                restore.end_event = _timing_event(torch)
                restore.end_event.record()
            return restore
        if self.cuda:
            self._issue_cuda(restore)
        else:
            for st in order:
                st.ready = threading.Event()
            restore.thread = threading.Thread(
                target=self._copy_loop, args=(restore,), name="gpu-trace-restore", daemon=True
            )
            restore.thread.start()
        return restore

    def _issue_cuda(self, restore: _Restore) -> None:
        """Start every copy on the side stream, in order, with an event per storage."""
        torch = self.torch
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        side = self._stream
        # Allocated on the stream the session's ops run on (the executor's current one), so the
        # allocator ties the blocks to it; the side stream is told it writes them.
        issued: list[tuple[_Storage, Any]] = []
        for st in restore.order:
            try:
                issued.append((st, torch.empty(st.size, dtype=torch.uint8, device=self.device)))
            except Exception as exc:  # out of memory: the rest come back one by one
                log.info("gpu-trace serve: pipelined restore stopped: %s", exc)
                break
        side.wait_stream(torch.cuda.current_stream(self.device))  # blocks reused from its work
        restore.start_event = _timing_event(torch)
        restore.start_event.record(side)
        with torch.cuda.stream(side):
            for i, (st, dev) in enumerate(issued):
                if self.hook is not None:
                    self.hook("copy", i)
                dev.copy_(st.host, non_blocking=True)
                dev.record_stream(side)
                st.device = dev
                st.event = torch.cuda.Event()
                st.event.record(side)
        restore.end_event = _timing_event(torch)
        restore.end_event.record(side)

    def _copy_loop(self, restore: _Restore) -> None:
        """CPU device: copy the storages back in order on this thread."""
        torch = self.torch
        hook = self.hook
        for i, st in enumerate(restore.order):
            if restore.cancelled:
                break
            if hook is not None:
                hook("copy", i)
            try:
                dev = torch.empty(st.size, dtype=torch.uint8, device=self.device)
                dev.copy_(st.host)
                st.device = dev
            except BaseException as exc:  # the executor retries it when an op needs it
                st.error = exc
            st.done_ns = now_ns()
            assert st.ready is not None
            st.ready.set()
            if hook is not None:
                hook("copied", i)
        for st in restore.order:  # cancelled: let no waiter hang
            if st.ready is not None and not st.ready.is_set():
                st.ready.set()

    def _ready_for(self, session: Session, restore: _Restore, op: Any) -> None:
        """Wait until ``op``'s inputs are back (all of them for ``rt::backward``)."""
        if type(op) is not list or len(op) < 3:
            return
        if op[0] == "rt::backward":  # its graph may hold the session's tensors
            for st in restore.order:
                if not st.final:
                    self._land(session, restore, st)
            return
        refs: list[int] = []
        handle_refs(op[1], refs)
        handle_refs(op[2], refs)
        paged = self._paged.get(session.id)
        if paged is None:
            return
        for h in refs:
            st = paged.by_handle.get(h)
            if st is not None and not st.final:
                self._land(session, restore, st)

    def _land(
        self, session: Session, restore: _Restore, st: _Storage, in_batch: bool = True
    ) -> None:
        """Point ``st``'s tensors at the device copy (waiting for it, or making it).

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
            t.data = _view(torch, t, storage)
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
        restore.pending -= 1

    def _first_op(self, restore: _Restore) -> None:
        stats = restore.stats
        if self.cuda and restore.start_event is not None:
            restore.first_event = _timing_event(self.torch)
            restore.first_event.record()
        stats.first_op_ns = max(1, now_ns() - stats.start_ns)

    def settle(self, session: Session, wait: bool = False, in_batch: bool = False) -> None:
        """Land the storages whose copies are done (all of them, waiting, if ``wait``); finish
        the restore when everything is back. ``in_batch``: see :meth:`_land`."""
        paged = self._paged.get(session.id)
        if paged is None or paged.restore is None:
            return
        restore = paged.restore
        for st in restore.order:
            if st.final:
                continue
            if st.event is not None and not in_batch and not wait and not st.event.query():
                continue
            if wait or st.ready is None or st.ready.is_set():
                self._land(session, restore, st, in_batch)
        if restore.pending:
            return
        if restore.thread is not None:
            restore.thread.join()
        if restore.end_event is not None:
            if not wait and not restore.end_event.query():
                return
            restore.end_event.synchronize()
        self._complete(session, restore)

    def _complete(self, session: Session, restore: _Restore) -> None:
        stats = restore.stats
        end = now_ns()
        if restore.end_event is not None and restore.start_event is not None:
            restore.end_event.synchronize()
            all_ns = int(restore.start_event.elapsed_time(restore.end_event) * 1e6)
            if restore.first_event is not None:
                restore.first_event.synchronize()
                first = restore.start_event.elapsed_time(restore.first_event) * 1e6
                stats.first_op_ns = max(1, int(first))
            stats.all_ns = max(1, all_ns)
        else:
            done = max((st.done_ns for st in restore.order), default=0)
            stats.all_ns = max(1, (done or end) - stats.start_ns)
        if not stats.first_op_ns:  # not pipelined: the first op ran after everything
            stats.first_op_ns = stats.all_ns
        self._paged.pop(session.id, None)
        session.usage.evicted_bytes = session.account.paged_bytes
        self.restores.append(stats)
        if session.trace:
            attrs = {
                "bytes": str(stats.bytes),
                "storages": str(stats.storages),
                "pipelined": "1" if stats.pipelined else "0",
                "first_op_ns": str(stats.first_op_ns),
                "device": stats.device,
            }
            slog = session.log
            slog.span(
                slog.new_id(),
                0,
                "server/restore",
                "restore",
                stats.start_ns,
                stats.start_ns + stats.all_ns,
                attrs,
            )
            labels = {"session": str(session.id), "tenant": session.tenant.name}
            slog.counter("restores", end, float(session.usage.restores), labels)
            slog.counter("session_paged_bytes", end, float(session.account.paged_bytes), labels)

    # ---- idle reclamation ------------------------------------------------------------------------

    def idle_limit_s(self, session: Session) -> float | None:
        """How long ``session`` may be idle before it is paged out (None: never)."""
        limit = getattr(session.tenant, "idle_s", None)
        if limit is None:
            limit = self.idle_s
        return limit if limit else None

    def sweep(self) -> int:
        """Page out every session idle for longer than its limit; sessions paged out."""
        now = time.monotonic_ns()
        count = 0
        for session in self.sessions():
            if session.closed or not len(session.handles):
                continue
            paged = self._paged.get(session.id)
            queued = self.scheduler.queued(session)
            if paged is not None:
                if paged.restore is not None and not queued:
                    self._under_lock(session, lambda s=session: self.settle(s))
                continue
            limit = self.idle_limit_s(session)
            last = session.usage.last_active_ns
            if (
                limit is None
                or queued
                or not last
                or now - last < limit * 1e9
                or self._tried.get(session.id) == last
            ):
                continue

            def idle_page_out(s: Session = session, last: int = last) -> None:
                nonlocal count
                if (
                    not self.scheduler.queued(s)
                    and s.usage.last_active_ns == last
                    and self.page_out(s, "idle")
                ):
                    count += 1

            self._under_lock(session, idle_page_out)
        return count

    def _under_lock(self, session: Session, fn: Callable[[], None]) -> None:
        lock = self.executor.lock
        if not lock.acquire(timeout=0.5):
            return
        try:
            if not session.closed:
                fn()
        except Exception:  # a bug here must not stop reclamation for everyone
            log.exception("gpu-trace serve: session %d: paging failed", session.id)
        finally:
            lock.release()

    def _tick_s(self) -> float:
        limits = [self.idle_s or 0.0]
        for session in self.sessions():
            limits.append(getattr(session.tenant, "idle_s", None) or 0.0)
        positive = [x for x in limits if x > 0]
        return min(1.0, max(0.005, min(positive) / 4)) if positive else 1.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gpu-trace-pager", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self._tick_s()):
            try:
                self.sweep()
            except Exception:
                log.exception("gpu-trace serve: idle sweep failed")


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


def _view(torch: Any, t: Any, storage: Any) -> Any:
    """A tensor like ``t`` (dtype, offset, sizes, strides, conj and neg bits) on ``storage``."""
    v = torch.empty(0, dtype=t.dtype, device=storage.device)
    v.set_(storage, t.storage_offset(), t.size(), t.stride())
    if t.is_conj():
        v = v.conj()
    if t.is_neg():
        v = torch._neg_view(v)
    return v


def _bytes_of(torch: Any, storage: Any) -> Any:
    """A storage's bytes as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _use_count(torch: Any, storage: Any) -> int:
    """References to ``storage`` from tensors (and this one Python object)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return int(count(storage._cdata)) if count is not None else 1


def _graph_keys(torch: Any, graphs: dict[int, Any]) -> set[int]:
    """Storages of the tensors kept graphs hold (``rt::fn`` leaves and outputs)."""
    keys: set[int] = set()
    stack = list(graphs.values())
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            keys.add(x.untyped_storage().data_ptr())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return keys


def _held(session: Session, st: _Storage) -> bool:
    return any(session.handles.key(h) == st.key for h in st.handles)


def _timing_event(torch: Any) -> Any:
    return torch.cuda.Event(enable_timing=True)


__all__ = ["DEFAULT_IDLE_S", "Pager", "RestoreStats", "handle_refs"]
