"""Idle reclamation and fast switching: a session's tensors paged out to host memory and back.

The server's :class:`Pager` moves every storage a session's handles hold to host memory when the
session has been idle for its tenant's ``idle_s`` (or the server's default), when the device is
full and another session needs room (:meth:`Pager.reclaim`, called by
:mod:`gpu_trace.runtime.sharing.memory`), or when an admin asks. On a GPU the host copies are
pinned: the copies are then asynchronous DMA at the link's speed, on the pager's own stream, after
the session's stream (an event, not a device-wide synchronize, so other tenants' kernels are not
waited for). Pinned buffers come from PyTorch's caching host allocator, which keeps freed pinned
blocks for reuse: once a session has been paged out and back, paging out the same sizes again
allocates nothing new (a first page-out pays ``cudaHostAlloc``; see docs/sharing.md for the
figures). Where pinned memory cannot be had the copy goes to pageable memory, logged. On the CPU
device paging is a copy into new, unpinned host memory (the original allocation is freed), so it
saves nothing there but exercises the same code.

Each handle's tensor is re-pointed in place (``t.data = view``): the tensor object, its
autograd version counter and its ``_base`` stay, and tensors that shared a storage share one
host storage, so views still alias their base. A storage that something else holds too (a
graph kept for ``rt::backward``: its leaves and outputs, or tensors it saved) stays on the
device, since paging it out would free nothing.

The session's next batch brings it back, pipelined: each op runs as soon as its own inputs are
back (:mod:`gpu_trace.runtime.sharing.restore`).

Everything that touches a session's tables runs on the executor's thread or under
``executor.lock``, like the rest of the executor's work.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu_trace.runtime.sharing.host_copies import (
    PageOutStats,
    bytes_of,
    copy_out_cuda,
    storage_groups,
    use_count,
)
from gpu_trace.runtime.sharing.restore import (
    Gate,
    PagedStorage,
    Restore,
    RestoreStats,
    restore_order,
    view_on,
)

if TYPE_CHECKING:
    import torch

    from gpu_trace.runtime.sharing.scheduler import PolicyScheduler
    from gpu_trace.runtime.sharing.sessions import Session

log = logging.getLogger(__name__)

now_ns = time.perf_counter_ns

#: The server's default for how long a session may sit idle before it is paged out (seconds).
DEFAULT_IDLE_S = 300.0


class _Paged:
    """A session's paged-out state, and its restore once one has started."""

    def __init__(self, storages: list[PagedStorage]) -> None:
        self.storages = storages
        self.by_handle = {h: st for st in storages for h in st.handles}
        self.restore: Restore | None = None


class Pager:
    """Pages idle sessions' tensors out to host memory and back (see the module's docstring).

    ``lock`` is the executor's (held while work runs on the device); ``sessions()`` lists the
    server's live sessions; ``idle_s`` is the default idle time before a
    session is paged out (a tenant's ``idle_s`` wins; 0 or None: never). ``pipelined`` restores
    op by op (else everything before the first op). ``hook(event, index)`` is a test seam: it is
    called with ``"copy"``/``"copied"`` and a storage's position in the restore order, and with
    ``"op"`` and the op's position in its batch when the op's inputs are back.
    ``before_restore(session, bytes)`` is called before a restore allocates device memory (the
    memory's ``make_room``); its exceptions are logged, the restore goes on. ``stream_of(session)``
    is the CUDA stream the session's work runs on (the executor's
    :meth:`~gpu_trace.runtime.server.executor.Executor.session_stream`; None: none yet), which a
    page-out's copies wait for. ``pin``: whether host copies are pinned (None: on a CUDA device;
    a CPU build of torch cannot pin, so the CPU device never does).
    """

    def __init__(
        self,
        device: str,
        lock: threading.Lock,
        scheduler: PolicyScheduler,
        sessions: Callable[[], list[Session]],
        *,
        idle_s: float | None = DEFAULT_IDLE_S,
        pipelined: bool = True,
        hook: Callable[[str, int], None] | None = None,
        before_restore: Callable[[Session, int], None] | None = None,
        stream_of: Callable[[Session], torch.cuda.Stream | None] | None = None,
        pin: bool | None = None,
    ) -> None:
        import torch

        if idle_s is not None and idle_s < 0:
            raise ValueError("idle_s must be >= 0 (0 or None: never page idle sessions out)")
        self.lock = lock
        self.scheduler = scheduler
        self.sessions = sessions
        self.idle_s = idle_s
        self.pipelined = pipelined
        self.hook = hook
        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        #: Host copies are pinned (page-locked) memory.
        self.pin = self.cuda if pin is None else bool(pin)
        self.before_restore = before_restore
        self.stream_of = stream_of
        #: The latest restores' and page-outs' figures (the bench reads them).
        self.restores: collections.deque[RestoreStats] = collections.deque(maxlen=256)
        self.page_outs: collections.deque[PageOutStats] = collections.deque(maxlen=256)
        #: Host buffers that could not be pinned (pageable memory was used instead).
        self.pin_failures = 0
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
        groups = storage_groups(torch, self.device, session)
        if not groups:
            self._tried[session.id] = session.usage.last_active_ns
            return 0
        # Copy first, then re-point: nothing reads the host copies before a restore, and a
        # storage is freed only once no tensor points at it.
        copied = sum(st.size for st, _storage in groups)
        stats = PageOutStats(session.id, copied, len(groups), self.pin, str(self.device), t0)
        for st, _storage in groups:
            st.host, pinned = self._host_buffer(st.size)
            stats.pinned = stats.pinned and pinned
        stats.alloc_ns = now_ns() - t0
        if self.cuda:
            own = self.stream_of(session) if self.stream_of is not None else None
            copy_out_cuda(torch, self.device, self._side_stream(), own, groups, stats)
        else:
            c0 = now_ns()
            for st, storage in groups:
                st.host.copy_(bytes_of(torch, storage))
            stats.copy_ns = max(1, now_ns() - c0)
        account = session.account
        notify, account.on_change = account.on_change, None
        moved: list[PagedStorage] = []
        kept = 0
        try:
            for st, storage in groups:
                host_storage = st.host.untyped_storage()
                for t in st.tensors:
                    t.data = view_on(torch, t, host_storage)
                if use_count(torch, storage) > 1:  # held elsewhere: nothing would be freed
                    for t in st.tensors:
                        t.data = view_on(torch, t, storage)
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
        stats.all_ns = max(1, t1 - t0)
        self.page_outs.append(stats)
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
                "pinned": "1" if stats.pinned else "0",
                "bytes_per_s": str(int(stats.bytes_per_s)),
            }
            slog = session.log
            slog.span(slog.new_id(), 0, "server/evict", "evict", t0, t1, attrs)
            labels = {"session": str(session.id), "tenant": session.tenant.name}
            slog.counter("evictions", t1, float(usage.evictions), labels)
            slog.counter("session_paged_bytes", t1, float(account.paged_bytes), labels)
        return freed

    def _host_buffer(self, nbytes: int) -> tuple[torch.Tensor, bool]:
        """A host buffer of ``nbytes`` for a page-out, and whether it is pinned."""
        torch = self.torch
        if self.pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True
            except Exception as exc:  # no pinnable memory left (or none on this build)
                self.pin_failures += 1
                if self.pin_failures == 1:
                    log.warning(
                        "gpu-trace serve: could not pin %d bytes of host memory for a page-out "
                        "(%s); paging out to pageable memory (slower copies)",
                        nbytes,
                        str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__,
                    )
        return torch.empty(nbytes, dtype=torch.uint8), False

    def _side_stream(self) -> torch.cuda.Stream:
        """The pager's own CUDA stream: page-out and restore copies."""
        if self._stream is None:
            self._stream = self.torch.cuda.Stream(self.device)
        return self._stream

    def request_page_out(
        self, session: Session, reason: str = "admin", timeout_s: float = 30.0
    ) -> int:
        """:meth:`page_out` from any thread but the executor's (an admin's "page out").

        Waits up to ``timeout_s`` for the executor to be free; a session with work queued is
        left alone (it would come straight back). Returns the bytes freed.
        """
        if not self.lock.acquire(timeout=timeout_s):
            return 0
        try:
            if self.scheduler.queued(session):
                return 0
            return self.page_out(session, reason)
        finally:
            self.lock.release()

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

    def begin_batch(self, session: Session, ops: list[Any]) -> Gate | None:
        """A batch of ``session`` starts: restore it if it is paged out.

        Returns the gate the executor calls before each op (None: nothing to wait for). A
        batch without ops (frees only) does not bring the session back.
        """
        paged = self._paged.get(session.id)
        if paged is None or not ops:
            return None
        restore = paged.restore
        if restore is None:
            order = restore_order(paged.storages, paged.by_handle, ops)
            total = sum(st.counted for st in order)
            stats = RestoreStats(
                session.id, total, len(order), self.pipelined, str(self.device), now_ns()
            )
            restore = paged.restore = Restore(
                session,
                order,
                paged.by_handle,
                stats,
                torch=self.torch,
                device=self.device,
                pipelined=self.pipelined,
                hook=self.hook,
                stream=self._side_stream() if self.cuda else None,
            )
            session.usage.restores += 1
            if self.before_restore is not None:
                try:
                    self.before_restore(session, total)
                except Exception:
                    log.exception("gpu-trace serve: before_restore failed")
            restore.start()
            if not restore.pending and not self.cuda:  # on a GPU: when its copies are done
                self._complete(session, restore)
        return Gate(restore)

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

    def settle(self, session: Session, wait: bool = False, in_batch: bool = False) -> None:
        """Land ``session``'s storages whose copies are done (all of them, waiting, if
        ``wait``); finish its restore when everything is back. ``in_batch``: on the session's
        stream, in its batch (see :meth:`Restore.land`)."""
        paged = self._paged.get(session.id)
        restore = paged.restore if paged is not None else None
        if restore is not None and restore.settle(wait, in_batch):
            self._complete(session, restore)

    def _complete(self, session: Session, restore: Restore) -> None:
        stats = restore.finish()
        end = now_ns()
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
                "bytes_per_s": str(int(stats.bytes_per_s)),
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
        now = now_ns()  # the executor stamps last_active_ns with this clock
        count = 0
        for session in self.sessions():
            if session.closed or not len(session.handles):
                continue
            paged = self._paged.get(session.id)
            queued = self.scheduler.queued(session)
            if paged is not None:
                if paged.restore is not None and not queued:
                    self._under_lock(session, functools.partial(self.settle, session))
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
        lock = self.lock
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


def _held(session: Session, st: PagedStorage) -> bool:
    return any(session.handles.key(h) == st.key for h in st.handles)


__all__ = ["DEFAULT_IDLE_S", "Pager"]
