"""Device memory on a shared server: per-tenant quotas, the device's capacity, and who waits.

The server owns one :class:`Memory`. Every session's
:class:`~gpu_trace.runtime.sharing.sessions.MemoryAccount` reports its changes here, summed per
tenant, so several clients of one tenant share its quota. Two limits apply to an op that would
allocate:

- the tenant's **quota** (:meth:`Tenant.limit_bytes
<gpu_trace.runtime.sharing.tenants.Tenant.limit_bytes>`)
  bounds its *logical* bytes: what its sessions hold, on the device or paged out to host memory
  by the pager, plus uploads received and not yet used;
- the device's **capacity** bounds the *resident* bytes of all sessions (quotas may add up to more
  than the device: the pager pages idle sessions out to make room).

:meth:`Memory.refusal` says whether an allocation may go ahead; the executor acts on the answer
(the op fails with a :class:`QuotaError`, or its batch waits, per the tenant's ``on_quota``).
Waiting sessions are woken (``wake``) when their tenant's bytes, or the device's, go down, and when
their wait is due to end (:meth:`Memory.due`).

Nothing here touches torch or sockets: it is driven by the executor's thread, and read by others
through :meth:`Memory.snapshot`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from gpu_trace.runtime.protocol.errors import OpError

if TYPE_CHECKING:
    from gpu_trace.runtime.sharing.sessions import Session
    from gpu_trace.runtime.sharing.tenants import Tenant

#: The CUDA caching allocator hands out blocks in multiples of this many bytes.
CUDA_BLOCK_BYTES = 512


def allocator_bytes(nbytes: int, block: int) -> int:
    """``nbytes`` as the allocator holds it: rounded up to a multiple of ``block`` (0 stays 0)."""
    if block <= 1 or nbytes <= 0:
        return max(nbytes, 0)
    return -(-nbytes // block) * block


def device_capacity(device: Any, device_memory: int | None = None) -> int:
    """Bytes of memory the server shares on ``device``: ``device_memory`` if given, else a CUDA
    device's total memory, or the machine's physical memory for the CPU device."""
    if device_memory is not None:
        return int(device_memory)
    import torch

    d = torch.device(device)
    if d.type == "cuda":
        return int(torch.cuda.get_device_properties(d).total_memory)
    import psutil

    return int(psutil.virtual_memory().total)


class QuotaError(OpError):
    """An op's output would take its tenant over its memory quota (``kind = "quota"``), or the
    device over its capacity (``kind = "capacity"``). ``used``, ``asked`` and ``limit`` are bytes:
    what the tenant (or the device) held, what the op wanted, and the bound."""

    def __init__(
        self, tenant: str, used: int, asked: int, limit: int, kind: str = "quota", note: str = ""
    ) -> None:
        self.tenant = tenant
        self.used = used
        self.asked = asked
        self.limit = limit
        self.kind = kind
        if kind == "quota":
            text = (
                f"tenant {tenant!r} is over its memory quota: used {used} bytes + asked {asked} "
                f"bytes > limit {limit} bytes"
            )
        else:
            text = (
                f"device memory is full for tenant {tenant!r}: resident {used} bytes + asked "
                f"{asked} bytes > capacity {limit} bytes"
            )
        super().__init__(f"{text} ({note})" if note else text)

    def wire(self) -> dict[str, Any]:
        """What the client's ``QuotaExceeded`` is built from (in the batch's DONE)."""
        return {
            "tenant": self.tenant,
            "used": self.used,
            "asked": self.asked,
            "limit": self.limit,
            "kind": self.kind,
        }


@dataclass
class Refusal:
    """Why ``asked`` more bytes cannot be allocated now.

    ``hopeless`` is set when waiting cannot help (no other session could free enough), with why.
    """

    kind: str  # "quota" or "capacity"
    tenant: str
    used: int
    asked: int
    limit: int
    hopeless: str = ""

    def error(self, note: str = "") -> QuotaError:
        return QuotaError(self.tenant, self.used, self.asked, self.limit, self.kind, note)


class _Member:
    """An attached session: its tenant, and its account's bytes as last counted."""

    __slots__ = ("tm", "known")

    def __init__(self, tm: TenantMemory) -> None:
        self.tm = tm
        self.known = 0


@dataclass(eq=False)
class TenantMemory:
    """One tenant's bytes: the sum of its sessions' accounts."""

    name: str
    limit_bytes: int | None
    used_bytes: int = 0
    peak_bytes: int = 0
    sessions: dict[int, Session] = field(default_factory=dict)
    #: Sessions waiting for memory: session id -> (session, kind, deadline on ``Memory.clock``).
    waiting: dict[int, tuple[Session, str, int]] = field(default_factory=dict)


class Reclaim(Protocol):
    """Pages out ``need_bytes`` of sessions other than ``session`` (for ``reason``); bytes freed."""

    def __call__(self, need_bytes: int, session: Session, reason: str) -> int: ...


class Memory:
    """The device's memory as the server shares it among tenants.

    ``capacity_bytes`` is the device's memory; ``block_bytes`` the allocator's rounding (512 on
    CUDA, 1 on the CPU); ``wake(session)`` is called for a waiting session whose retry may now
    succeed (the scheduler's ``unpark``). ``reclaim`` is asked to page idle sessions out before
    the device is called full (the server's pager; built after this object, so it is a callback).
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        block_bytes: int = 1,
        wake: Callable[[Session], None] | None = None,
        reclaim: Reclaim | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError("device memory capacity must be a positive number of bytes")
        self.capacity_bytes = int(capacity_bytes)
        self.block_bytes = max(1, int(block_bytes))
        self.wake = wake
        self.clock = clock
        self._reclaim = reclaim
        #: Logical bytes of every session (resident and paged out).
        self.used_bytes = 0
        self.peak_bytes = 0
        #: By tenant name. This dict and each tenant's ``sessions`` and ``waiting`` are replaced,
        #: never changed in place, so the executor iterates them while a connection attaches.
        self.tenants: dict[str, TenantMemory] = {}
        self._members: dict[int, _Member] = {}  # session id -> its tenant and bytes last seen
        self._waiting = 0  # sessions waiting, all tenants
        self._lock = threading.Lock()  # writers of the dicts above

    # ---- sessions --------------------------------------------------------------------------------

    def add_tenants(self, tenants: list[Tenant]) -> None:
        """Know ``tenants`` before any of their sessions connects (they show in snapshots)."""
        for tenant in tenants:
            self._tenant(tenant)

    def _tenant(self, tenant: Tenant) -> TenantMemory:
        with self._lock:
            tm = self.tenants.get(tenant.name)
            if tm is None:
                tm = TenantMemory(tenant.name, tenant.limit_bytes(self.capacity_bytes))
                self.tenants = {**self.tenants, tenant.name: tm}
        return tm

    def attach(self, session: Session) -> None:
        """Count ``session``'s account under its tenant from now on."""
        tm = self._tenant(session.tenant)
        account = session.account
        account.block_bytes = self.block_bytes
        member = _Member(tm)
        with self._lock:
            tm.sessions = {**tm.sessions, session.id: session}
            self._members[session.id] = member
        account.on_change = lambda account, m=member: self._changed(m, account.bytes)
        if account.bytes:
            self._changed(member, account.bytes)

    def detach(self, session: Session) -> None:
        """``session`` is closed: its bytes leave its tenant, and waiters may retry."""
        tm = self.tenants.get(session.tenant.name)
        session.account.on_change = None
        with self._lock:
            member = self._members.pop(session.id, None)
            if tm is not None:
                tm.sessions = {k: v for k, v in tm.sessions.items() if k != session.id}
                self._unwait(tm, session)
        last = member.known if member is not None else 0
        if tm is not None and last:
            tm.used_bytes -= last
            self.used_bytes -= last
        self._wake(tm)

    def changed(self, session: Session) -> None:
        """``session``'s account (or what of it is paged out) changed: update the sums.

        The pager calls this after paging a session out or back in (``usage.evicted_bytes``), so
        that sessions waiting for device memory retry.
        """
        member = self._members.get(session.id)
        if member is not None:
            self._changed(member, session.account.bytes)

    def _changed(self, member: _Member, now: int) -> None:
        delta = now - member.known
        member.known = now
        tm = member.tm
        if delta > 0:
            tm.used_bytes += delta
            if tm.used_bytes > tm.peak_bytes:
                tm.peak_bytes = tm.used_bytes
            self.used_bytes += delta
            if self.used_bytes > self.peak_bytes:
                self.peak_bytes = self.used_bytes
        elif delta < 0:
            tm.used_bytes += delta
            self.used_bytes += delta
            self._wake(tm)
        else:
            self._wake(tm)  # paged out or in: device room may have changed

    def _wake(self, tm: TenantMemory | None) -> None:
        """Let waiters retry: ``tm``'s quota waiters and every capacity waiter."""
        if self.wake is None or not self._waiting:
            return
        woken = []
        for other in self.tenants.values():
            if not other.waiting:
                continue
            for session, kind, _deadline in other.waiting.values():
                if other is tm or kind == "capacity":
                    woken.append(session)
        for session in woken:
            self.wake(session)

    # ---- numbers ---------------------------------------------------------------------------------

    @staticmethod
    def resident(session: Session) -> int:
        """Bytes of ``session`` on the device (held, less what the pager has paged out)."""
        return max(0, session.account.bytes - session.usage.evicted_bytes)

    def resident_bytes(self) -> int:
        """Bytes of all sessions on the device."""
        if self.used_bytes <= 0:
            return 0
        return sum(self.resident(s) for tm in self.tenants.values() for s in tm.sessions.values())

    def tenant_of(self, session: Session) -> TenantMemory:
        return self.tenants[session.tenant.name]

    def over(self, session: Session) -> bool:
        """Is ``session``'s tenant over its quota, or might the device be over its capacity?
        (Cheap; :meth:`refusal` says for sure.)"""
        member = self._members.get(session.id)
        if member is None:
            return False
        tm = member.tm
        limit = tm.limit_bytes
        return (
            limit is not None and tm.used_bytes > limit
        ) or self.used_bytes > self.capacity_bytes

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per tenant: ``used_bytes`` (logical), ``resident_bytes``, ``limit_bytes`` (None: no
        quota), ``peak_bytes``, ``sessions`` and ``waiting`` (counts). Safe from any thread."""
        return {name: self._numbers(tm) for name, tm in self.tenants.items()}

    def tenant_numbers(self, name: str) -> dict[str, Any] | None:
        """One tenant's entry of :meth:`snapshot` (None: unknown tenant)."""
        tm = self.tenants.get(name)
        return None if tm is None else self._numbers(tm)

    def _numbers(self, tm: TenantMemory) -> dict[str, Any]:
        return {
            "used_bytes": tm.used_bytes,
            "resident_bytes": sum(self.resident(s) for s in tm.sessions.values()),
            "limit_bytes": tm.limit_bytes,
            "peak_bytes": tm.peak_bytes,
            "sessions": len(tm.sessions),
            "waiting": len(tm.waiting),
        }

    # ---- decisions -------------------------------------------------------------------------------

    def refusal(self, session: Session, asked: int, held: int = 0) -> Refusal | None:
        """Why ``session`` may not allocate ``asked`` more bytes now; None if it may.

        ``held``: bytes of ``asked`` already counted in the session's account (an op's output
        that is checked after it ran). Over the device's capacity, the pager is asked first to
        page out other sessions (:meth:`reclaim`).
        """
        tm = self.tenants.get(session.tenant.name)
        if tm is None:
            return None
        if tm.limit_bytes is not None and tm.used_bytes - held + asked > tm.limit_bytes:
            return self._quota_refusal(session, tm, asked, held)
        if self.used_bytes - held + asked <= self.capacity_bytes:
            return None  # even if every byte were resident, it fits
        resident = self.resident_bytes() - held
        if resident + asked <= self.capacity_bytes:
            return None
        freed = self.reclaim(resident + asked - self.capacity_bytes, session, "capacity")
        if freed > 0:
            resident = self.resident_bytes() - held
            if resident + asked <= self.capacity_bytes:
                return None
        refusal = Refusal("capacity", tm.name, resident, asked, self.capacity_bytes)
        own = self.resident(session) - held
        if own + asked > self.capacity_bytes:
            refusal.hopeless = f"this session alone would hold {own + asked} bytes"
        elif not any(
            self.resident(s) > 0 and not self._waits(s)
            for t in self.tenants.values()
            for s in t.sessions.values()
            if s is not session
        ):
            refusal.hopeless = "no other session holds device memory that it could free"
        return refusal

    def _quota_refusal(self, session: Session, tm: TenantMemory, asked: int, held: int) -> Refusal:
        limit = tm.limit_bytes if tm.limit_bytes is not None else 0
        used = tm.used_bytes - held
        refusal = Refusal("quota", tm.name, used, asked, limit)
        own = session.account.bytes - held
        if own + asked > limit:
            refusal.hopeless = f"this session alone would hold {own + asked} bytes"
        elif not any(
            s.account.bytes > 0 and not self._waits(s)
            for s in tm.sessions.values()
            if s is not session
        ):
            refusal.hopeless = (
                f"no other session of tenant {tm.name!r} holds memory that it could free"
            )
        return refusal

    def _waits(self, session: Session) -> bool:
        tm = self.tenants.get(session.tenant.name)
        return tm is not None and session.id in tm.waiting

    def make_room(self, session: Session, nbytes: int) -> None:
        """``session``'s ``nbytes`` paged out are coming back to the device: page out others if
        the device would be over its capacity (the pager's ``before_restore``)."""
        over = self.resident_bytes() + nbytes - self.capacity_bytes
        if over > 0:
            self.reclaim(over, session, "restore")

    def reclaim(self, need_bytes: int, session: Session, reason: str) -> int:
        """Ask the server's pager to page out ``need_bytes`` of other sessions; bytes freed."""
        if self._reclaim is None or need_bytes <= 0:
            return 0
        return int(self._reclaim(need_bytes, session, reason) or 0)

    # ---- waiting ---------------------------------------------------------------------------------

    def wait(self, session: Session, kind: str, deadline_ns: int) -> None:
        """``session`` waits for memory (``kind``: quota or capacity) until ``deadline_ns``."""
        tm = self.tenant_of(session)
        with self._lock:
            if session.id not in tm.waiting:
                self._waiting += 1
            tm.waiting = {**tm.waiting, session.id: (session, kind, deadline_ns)}

    def resumed(self, session: Session) -> None:
        """``session`` runs again (it retries; it waits again if still refused)."""
        tm = self.tenants.get(session.tenant.name)
        if tm is not None and session.id in tm.waiting:
            with self._lock:
                self._unwait(tm, session)

    def _unwait(self, tm: TenantMemory, session: Session) -> None:
        if session.id in tm.waiting:
            self._waiting -= 1
            tm.waiting = {k: v for k, v in tm.waiting.items() if k != session.id}

    def waiting(self) -> int:
        """Sessions waiting for memory now."""
        return self._waiting

    def due(self) -> None:
        """Wake the waiters whose wait has run out (their retry fails, saying it waited)."""
        if self.wake is None or not self.waiting():
            return
        now = self.clock()
        for tm in self.tenants.values():
            for session, _kind, deadline in tm.waiting.values():
                if now >= deadline:
                    self.wake(session)


__all__ = [
    "CUDA_BLOCK_BYTES",
    "Memory",
    "QuotaError",
    "Refusal",
    "TenantMemory",
    "allocator_bytes",
    "device_capacity",
]
