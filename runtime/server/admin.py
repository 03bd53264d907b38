"""Who uses a shared server and how much: the listing behind ``gpu-trace tenants`` and ``/metrics``,
the ADMIN requests that carry it over the wire, and eviction.

:func:`snapshot` builds the listing from the server's state (its sessions'
:class:`~gpu_trace.runtime.sharing.usage.Usage` and memory accounts, the scheduler's queues, the
memory manager's per-tenant numbers where there is one); a :class:`Ledger` keeps the usage of
sessions that ended, so a tenant's totals never go down. What a caller sees depends on its tenant:
an admin tenant sees every tenant and session and may evict; any other tenant sees only its own
tenant's sessions.

Over the wire (:func:`gpu_trace.runtime.client.admin_requests.request`), an admin client does the
usual CHALLENGE/HELLO handshake with ``"mode": "admin"`` in its HELLO (it opens no session), then
sends ``ADMIN {op, ...}`` requests and gets ``ADMIN_REPLY {ok, ...}`` answers::

    ADMIN {"op": "list"}                  <- ADMIN_REPLY {ok, server, tenants, sessions}
    ADMIN {"op": "evict", "session": 7}   <- ADMIN_REPLY {ok, evicted} or {ok: false, error}
    ADMIN {"op": "page-out", "session": 7} <- ADMIN_REPLY {ok, paged_out, bytes}

It describes a running server (its executor, its front, its connections), so it lives in the
server's room; the server it lists is a :class:`ListedServer`, what it reads of
:class:`~gpu_trace.runtime.server.server.Server`, which imports this module.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gpu_trace.runtime.server.executor import Executor
    from gpu_trace.runtime.server.front import Front
    from gpu_trace.runtime.sharing.memory import Memory
    from gpu_trace.runtime.sharing.scheduler import PolicyScheduler
    from gpu_trace.runtime.sharing.sessions import Session
    from gpu_trace.runtime.sharing.tenants import Tenant

#: A session's state in the listing, most pressing first: its work runs now; it waits for
#: memory (parked); it has work queued; its tensors are paged out to host memory; nothing.
STATES = ("running", "waiting-for-memory", "queued", "paged-out", "idle")
#: Usage fields that only grow (counters); the rest of a session's numbers are gauges.
COUNTERS = (
    "busy_ns",
    "queue_ns",
    "batches",
    "ops",
    "bytes_in",
    "bytes_out",
    "evictions",
    "restores",
    "quota_waits",
    "quota_errors",
)
#: Counters that are None where not measured (GPU busy time: no GPU activity capture); a total
#: is None only when no session's is measured.
MEASURED = ("gpu_busy_ns",)
EVICTED = "session evicted by an administrator"


class ListedServer(Protocol):
    """What the listing reads of a running server, and the admin's requests it carries out
    (:class:`~gpu_trace.runtime.server.server.Server`)."""

    @property
    def address(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def device_memory(self) -> int | None: ...

    @property
    def tenants(self) -> Sequence[Tenant]: ...

    @property
    def sessions(self) -> dict[int, Session]: ...

    @property
    def _lock(self) -> threading.Lock: ...

    @property
    def memory(self) -> Memory: ...

    @property
    def scheduler(self) -> PolicyScheduler: ...

    @property
    def executor(self) -> Executor: ...

    @property
    def front(self) -> Front | None: ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def protocol_errors(self) -> int: ...

    def batches_served(self) -> int: ...

    def evict(self, session_id: int, by: str = "") -> bool: ...

    def page_out(self, session_id: int, by: str = "") -> int | None: ...


class Ledger:
    """When each live session connected, and the summed usage of ended sessions per tenant."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._connected: dict[int, int] = {}
        #: tenant -> counter -> total of its ended sessions.
        self.ended: dict[str, dict[str, int]] = {}
        #: tenant -> sessions it has opened since the server started.
        self.opened: dict[str, int] = {}
        #: tenant -> the most memory its live sessions held together at a snapshot.
        self.peak: dict[str, int] = {}
        self.started_ns = time.monotonic_ns()

    def open(self, session: Session) -> None:
        with self._lock:
            self._connected[session.id] = time.monotonic_ns()
            name = session.tenant.name
            self.opened[name] = self.opened.get(name, 0) + 1

    def connected_ns(self, session: Session) -> int:
        return self._connected.get(session.id, self.started_ns)

    def retire(self, session: Session) -> None:
        """``session`` ended: its counters join its tenant's totals (once)."""
        with self._lock:
            if self._connected.pop(session.id, None) is None:
                return
            usage = session.usage.snapshot()
            totals = self.ended.setdefault(session.tenant.name, dict.fromkeys(COUNTERS, 0))
            for key in COUNTERS:
                totals[key] += int(usage.get(key) or 0)
            for key in MEASURED:
                value = usage.get(key)
                if value is not None:
                    totals[key] = totals.get(key, 0) + int(value)

    def add_gpu_busy(self, session: Session, ns: int) -> None:
        """GPU busy time measured for ``session`` (its kernels arrive after they ran): into its
        usage, and into its tenant's total if it has already ended (and was retired)."""
        with self._lock:
            usage = session.usage
            usage.gpu_busy_ns = (usage.gpu_busy_ns or 0) + ns
            if session.id not in self._connected:
                totals = self.ended.setdefault(session.tenant.name, dict.fromkeys(COUNTERS, 0))
                totals["gpu_busy_ns"] = totals.get("gpu_busy_ns", 0) + ns


# ---- the listing ---------------------------------------------------------------------------------


def capacity(server: ListedServer) -> int | None:
    """The device memory quota fractions are taken of: the memory manager's, else
    ``--device-memory``, else (CUDA) the device's total memory; None if unknown."""
    memory = getattr(server, "memory", None)
    value = getattr(memory, "capacity_bytes", None) or getattr(server, "device_memory", None)
    if value:
        return int(value)
    if str(server.device).startswith("cuda"):
        import torch

        return int(torch.cuda.get_device_properties(server.device).total_memory)
    return None


def _state(session: Session, running: Any, parked: set[int], queued: int) -> str:
    if running is session:
        return "running"
    if session.id in parked:
        return "waiting-for-memory"
    if queued:
        return "queued"
    if session.usage.evicted_bytes > 0 or getattr(session, "paged_out", False):
        return "paged-out"
    return "idle"


def _front_state(server: ListedServer, session: Session) -> str | None:
    """A session's state as its worker last reported it (``--isolation process``)."""
    front = getattr(server, "front", None)
    return front.state(session) if front is not None else None


def session_row(
    server: ListedServer, session: Session, now_ns: int, parked: set[int], cap: int | None = None
) -> dict[str, Any]:
    """One session's line of the listing (``cap``: the device memory quotas are taken of)."""
    limit = session.tenant.limit_bytes(cap) if cap else session.tenant.memory_bytes
    usage = session.usage.snapshot()
    account = session.account
    queued = server.scheduler.queued(session)
    client = session.client
    return {
        "session": session.id,
        "tenant": session.tenant.name,
        "host": str(client.get("host", "")),
        "pid": str(client.get("pid", "")),
        "connected_ns": max(0, now_ns - server.ledger.connected_ns(session)),
        "memory_bytes": int(account.bytes),
        "memory_peak_bytes": int(account.peak_bytes),
        "memory_limit_bytes": account.limit_bytes if account.limit_bytes is not None else limit,
        "evicted_bytes": int(usage.get("evicted_bytes") or 0),
        "queued": queued,
        "state": _front_state(server, session)
        or _state(session, getattr(server.executor, "current", None), parked, queued),
        **{key: int(usage.get(key) or 0) for key in COUNTERS},
        **{key: usage.get(key) for key in MEASURED},
    }


def _tenant_rows(
    server: ListedServer, tenants: list[Tenant], rows: list[dict[str, Any]], cap: int | None
) -> list[dict[str, Any]]:
    memory = getattr(server, "memory", None)
    snapshot = getattr(memory, "snapshot", None)
    by_memory = snapshot() if snapshot is not None else {}
    ledger = server.ledger
    out = []
    for tenant in tenants:
        mine = [r for r in rows if r["tenant"] == tenant.name]
        used = sum(r["memory_bytes"] for r in mine)
        with ledger._lock:
            ledger.peak[tenant.name] = peak = max(ledger.peak.get(tenant.name, 0), used)
            ended = dict(ledger.ended.get(tenant.name, {}))
            opened = ledger.opened.get(tenant.name, 0)
        mem = by_memory.get(tenant.name) or {}
        evicted = sum(r["evicted_bytes"] for r in mine)
        if "used_bytes" in mem and "resident_bytes" in mem:
            evicted = max(0, int(mem["used_bytes"]) - int(mem["resident_bytes"]))
        limit = tenant.limit_bytes(cap) if cap else tenant.memory_bytes
        row: dict[str, Any] = {
            "tenant": tenant.name,
            "admin": tenant.admin,
            "weight": tenant.weight,
            "priority": tenant.priority,
            "sessions": len(mine),
            "sessions_opened": opened,
            "memory_bytes": int(mem.get("used_bytes", used)),
            "memory_limit_bytes": mem.get("limit_bytes", limit),
            "memory_peak_bytes": int(mem.get("peak_bytes", peak)),
            "evicted_bytes": evicted,
            "waiting": int(
                mem.get("waiting", sum(r["state"] == "waiting-for-memory" for r in mine))
            ),
        }
        for key in COUNTERS:
            row[key] = ended.get(key, 0) + sum(r[key] for r in mine)
        for key in MEASURED:
            values = [v for v in (ended.get(key), *(r[key] for r in mine)) if v is not None]
            row[key] = sum(values) if values else None
        out.append(row)
    return out


def snapshot(server: ListedServer, viewer: Tenant | None = None) -> dict[str, Any]:
    """The listing as ``viewer`` may see it (None or an admin tenant: everything).

    ``server``: device, policy, memory capacity, sessions, queue depth, batches run;
    ``tenants``: per tenant, live memory and the counters of its live and ended sessions;
    ``sessions``: one row per live session (:func:`session_row`).
    """
    everything = viewer is None or viewer.admin
    with server._lock:
        sessions = list(server.sessions.values())
    if not everything:
        assert viewer is not None
        sessions = [s for s in sessions if s.tenant.name == viewer.name]
    parked = {s.id for s in server.scheduler.parked()}
    now = time.monotonic_ns()
    cap = capacity(server)
    rows = [session_row(server, s, now, parked, cap) for s in sessions]
    rows.sort(key=lambda r: (r["tenant"], r["session"]))
    tenants = list(server.tenants) if everything else [viewer]
    info: dict[str, Any] = {
        "device": str(server.device),
        "policy": getattr(server.scheduler.policy, "name", "?"),
        "device_memory_bytes": cap,
    }
    if everything:
        info.update(
            {
                "address": server.address,
                "sessions": len(rows),
                "queue_depth": server.scheduler.depth(),
                "batches": server.batches_served(),
                "protocol_errors": server.protocol_errors,
                "worker_deaths": server.front.deaths if server.front is not None else 0,
                "uptime_ns": now - server.ledger.started_ns,
            }
        )
    return {
        "viewer": viewer.name if viewer is not None else None,
        "admin": everything,
        "server": info,
        "tenants": _tenant_rows(server, tenants, rows, cap),  # type: ignore[arg-type]
        "sessions": rows,
    }


def handle(server: ListedServer, tenant: Tenant, req: dict[str, Any]) -> dict[str, Any]:
    """The server's answer to one (validated) ADMIN request from ``tenant``."""
    if req["op"] == "list":
        return {"ok": True, **snapshot(server, tenant)}
    what = "evicting" if req["op"] == "evict" else "paging out"
    if not tenant.admin:
        return {"ok": False, "error": f"{what} a session needs an admin tenant's token"}
    ident = req["session"]
    if req["op"] == "page-out":
        freed = server.page_out(ident, by=tenant.name)
        if freed is None:
            return {"ok": False, "error": f"no session {ident} on this server"}
        return {"ok": True, "paged_out": ident, "bytes": freed}
    if not server.evict(ident, by=tenant.name):
        return {"ok": False, "error": f"no session {ident} on this server"}
    return {"ok": True, "evicted": ident}
