"""The front of ``gpu-trace serve --isolation process``: each session in a worker of its own.

The front authenticates a client (:mod:`gpu_trace.runtime.server.conversation`), then hands its
connection to a standby worker (:mod:`gpu_trace.runtime.server.standby`) with an
:class:`~gpu_trace.runtime.channel.messages.Assign` and the socket itself (``SCM_RIGHTS``): from
then on the client talks to its worker alone, with no hop through the front. The connection's
thread in the front stays with the session until it ends:

- it keeps the session's row current from the worker's reports (usage, memory, state), for
  ``gpu-trace tenants``, ``/metrics`` and the tenants' memory sums, and tells the tenant's other
  workers how many bytes each may hold now (the tenant's quota less what its other sessions
  hold; the device's capacity less what the others keep resident);
- it carries an admin's evict and page-out to the worker; a worker that does not end within
  :data:`END_S` of being told is killed;
- when the worker dies (a signal, an abort, out of memory) it names the op that ran (the
  worker's :class:`~gpu_trace.runtime.channel.beacon.Beacon`), tells the client in one ERROR
  that its next sync point raises, logs one line, and releases the session's account. The other
  sessions, in processes of their own, run on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from gpu_trace.runtime.channel.messages import (
    REPORT_S,
    Assign,
    ChannelClosed,
    End,
    Ended,
    Limits,
    PagedOut,
    PageOut,
    Report,
)
from gpu_trace.runtime.protocol import backend_flags
from gpu_trace.runtime.protocol.wire import ConnectionClosed, FrameWriter, MsgType, json_frame
from gpu_trace.runtime.server.cpu_share import apply_nice, worker_nice
from gpu_trace.runtime.server.standby import Standby, Worker, WorkerFailed, exit_text

if TYPE_CHECKING:
    from gpu_trace.runtime.server.sink import Sink
    from gpu_trace.runtime.sharing.memory import Memory
    from gpu_trace.runtime.sharing.pager import Pager
    from gpu_trace.runtime.sharing.scheduler import PolicyScheduler
    from gpu_trace.runtime.sharing.sessions import Session
    from gpu_trace.runtime.sharing.tenants import Tenant

log = logging.getLogger(__name__)

#: Seconds a worker has to end its session after an End before it is killed.
END_S = 10.0
#: Seconds an admin's page-out waits for the worker's answer.
PAGE_OUT_S = 30.0
#: Limits are sent again when a worker's allowance moved by more than this many bytes.
LIMIT_SLACK = 1 << 20


class ServerParts(Protocol):
    """What the front reads of the server it fronts
    (:class:`~gpu_trace.runtime.server.server.Server`, which imports this module)."""

    @property
    def idle_timeout_s(self) -> float: ...

    @property
    def spin_ns(self) -> int: ...

    @property
    def delay_ns(self) -> int: ...

    @property
    def pager(self) -> Pager: ...

    @property
    def sink(self) -> Sink: ...

    @property
    def memory(self) -> Memory: ...

    @property
    def tenants(self) -> Sequence[Tenant]: ...

    @property
    def scheduler(self) -> PolicyScheduler: ...


@dataclasses.dataclass(eq=False)
class Link:
    """A session's worker, as the front holds it."""

    session: Session
    worker: Worker
    conn: socket.socket
    state: str = "idle"
    resident: int = 0
    sent: tuple[int | None, int] | None = None  # the Limits last sent
    ended: Ended | None = None
    paged: list[int | None] = dataclasses.field(default_factory=list)
    paged_event: threading.Event = dataclasses.field(default_factory=threading.Event)
    nice: int = 0  # what the front last set its threads to
    gpu_activity: dict[str, int] = dataclasses.field(default_factory=dict)  # as last reported


class Front:
    """Runs each of ``server``'s sessions in a worker from ``standby``."""

    def __init__(self, server: ServerParts, standby: Standby) -> None:
        self.server = server
        self.standby = standby
        self.links: dict[int, Link] = {}
        self._lock = threading.Lock()
        #: Workers that died under their session (a signal, an abort), and those the front
        #: killed (an evict not obeyed in time).
        self.deaths = 0
        self.killed = 0
        self._batches_ended = 0
        self._activity_ended: dict[str, int] = {}  # ended sessions' workers' GPU activity

    # ---- a session's life ------------------------------------------------------------------------

    def run(self, conn: socket.socket, session: Session) -> None:
        """Hand ``session`` (its WELCOME sent) to a worker and stay with it until it ends."""
        try:
            worker = self.standby.take()
        except WorkerFailed as exc:
            log.error("gpu-trace serve: session %d: %s", session.id, exc)
            self._tell(conn, f"the server could not start a worker for the session: {exc}")
            return
        link = Link(session, worker, conn)
        limit, capacity = self._allowance(session)
        link.sent = (limit, capacity)
        server = self.server
        tenant = {
            k: v for k, v in dataclasses.asdict(session.tenant).items() if k != "token"
        }  # a worker never learns a token
        assign = Assign(
            session=session.id,
            tenant=tenant,
            client=dict(session.client),
            trace=session.trace,
            binary=session.binary,
            limit_bytes=limit,
            capacity_bytes=capacity,
            idle_timeout_s=server.idle_timeout_s,
            idle_s=server.pager.idle_s,
            spin_us=server.spin_ns / 1000,
            delay_ms=server.delay_ns / 1e6,
            sink=server.sink.worker_sink if hasattr(server.sink, "worker_sink") else "return",
            flags=_own_flags(),
        )
        try:
            worker.channel.send(assign, fd=conn.fileno())
        except ChannelClosed:  # it died standing by, between take() and now
            self._died(link, worker.kill())
            worker.close()
            return
        with self._lock:
            self.links[session.id] = link
        self._renice(link)
        try:
            self._follow(link)
        finally:
            with self._lock:
                self.links.pop(session.id, None)
            rc = worker.wait(END_S)
            if rc is None:
                rc = worker.kill()
            if link.ended is None:
                self._died(link, rc)
            elif link.ended.reason in ("device-failed", "batch-limit"):
                self._ended_by_worker(link)
            worker.close()
            with self._lock:
                self._batches_ended += session.batches
                for key, n in link.gpu_activity.items():
                    self._activity_ended[key] = self._activity_ended.get(key, 0) + n
            self._rebalance(session.tenant.name)

    def _follow(self, link: Link) -> None:
        """The worker's messages until it ends (or dies)."""
        channel = link.worker.channel
        while True:
            try:
                msg, fd = channel.recv(max(1.0, 10 * REPORT_S))
            except TimeoutError:
                if link.worker.wait(0) is not None:
                    return
                continue
            except (ChannelClosed, ValueError):
                return  # a worker that speaks nonsense is treated as dead
            if fd is not None:
                os.close(fd)
            if isinstance(msg, Report):
                self._report(link, msg)
            elif isinstance(msg, PagedOut):
                link.paged.append(msg.bytes)
                link.paged_event.set()
            elif isinstance(msg, Ended):
                link.ended = msg
                return

    def _report(self, link: Link, report: Report) -> None:
        session = link.session
        usage = session.usage
        for key, value in report.usage.items():
            if hasattr(usage, key) and (value is None or type(value) is int):
                setattr(usage, key, value)
        account = session.account
        account.peak_bytes = max(account.peak_bytes, int(report.memory_peak_bytes))
        account.paged_bytes = int(report.paged_bytes)
        account.bytes = int(report.memory_bytes)
        link.state = report.state
        link.resident = max(0, int(report.memory_bytes) - int(report.paged_bytes))
        session.batches = int(report.batches)
        link.gpu_activity = {
            str(k): int(v) for k, v in report.gpu_activity.items() if type(v) is int
        }
        self.server.memory.changed(session)
        self._renice(link)  # under las, a session sinks as it attains service
        sink = self.server.sink
        if report.dirty and hasattr(sink, "mark_dirty"):
            for path in report.dirty:
                sink.mark_dirty(path)
        self._rebalance(session.tenant.name, but=session.id)

    # ---- the policy across workers ---------------------------------------------------------------

    def _renice(self, link: Link) -> None:
        """The worker's CPU share, from its tenant's place in the policy and (under ``las``)
        its session's attained service: :mod:`~gpu_trace.runtime.server.cpu_share`. Set on
        every thread of the worker, again at each report while it is not 0 (a thread started
        while the others were being set keeps its creator's)."""
        session = link.session
        nice = worker_nice(
            session.tenant, self.server.tenants, self.server.scheduler, session.usage.busy_ns
        )
        if nice or link.nice:
            apply_nice(link.worker.pid, nice)
            link.nice = nice

    # ---- memory across workers -------------------------------------------------------------------

    def _allowance(self, session: Session) -> tuple[int | None, int]:
        """What ``session``'s worker may hold: its tenant's quota less its other sessions'
        bytes, and the device's capacity less the other sessions' resident bytes."""
        memory = self.server.memory
        tm = memory.tenant_of(session)
        capacity = memory.capacity_bytes
        with self._lock:
            links = list(self.links.values())
        others = sum(
            lk.session.account.bytes
            for lk in links
            if lk.session.tenant.name == session.tenant.name and lk.session.id != session.id
        )
        resident = sum(lk.resident for lk in links if lk.session.id != session.id)
        # every worker's CUDA context takes device memory no tenant's quota counts
        contexts = sum(lk.worker.context_bytes for lk in links) + self.standby.context_bytes()
        limit = None if tm.limit_bytes is None else max(0, tm.limit_bytes - others)
        return limit, max(0, capacity - resident - contexts)

    def _rebalance(self, tenant: str, but: int = 0) -> None:
        """Send new Limits to the workers whose allowance moved (by more than the slack)."""
        with self._lock:
            links = [lk for lk in self.links.values() if lk.session.id != but]
        for lk in links:
            limit, capacity = self._allowance(lk.session)
            sent = lk.sent
            if (
                sent is not None
                and _near(sent[0], limit)
                and abs(sent[1] - capacity) <= LIMIT_SLACK
            ):
                continue
            lk.sent = (limit, capacity)
            with contextlib.suppress(ChannelClosed):
                lk.worker.channel.send(Limits(limit, capacity))

    # ---- an admin's requests ---------------------------------------------------------------------

    def end(self, session: Session, message: str, reason: str) -> bool:
        """Tell ``session``'s worker to end it (its client told ``message``); a worker that has
        not ended within :data:`END_S` (a batch that runs on) is killed. False: no such link."""
        with self._lock:
            link = self.links.get(session.id)
        if link is None:
            return False
        try:
            link.worker.channel.send(End(message, reason))
        except ChannelClosed:
            return True
        threading.Thread(
            target=self._end_by, args=(link, message, reason), name="gpu-trace-end", daemon=True
        ).start()
        return True

    def _end_by(self, link: Link, message: str, reason: str) -> None:
        if link.worker.wait(END_S) is None:
            log.warning(
                "gpu-trace serve: session %d: its worker %d did not end within %.0f s: killed",
                link.session.id,
                link.worker.pid,
                END_S,
            )
            self.killed += 1
            link.ended = Ended(reason, message)  # not a crash: the client gets this message
            link.worker.kill()
            self._tell(link.conn, message, reason)

    def page_out(self, session: Session) -> int | None:
        with self._lock:
            link = self.links.get(session.id)
        if link is None:
            return None
        link.paged_event.clear()
        try:
            link.worker.channel.send(PageOut())
        except ChannelClosed:
            return None
        if not link.paged_event.wait(PAGE_OUT_S) or not link.paged:
            return None
        return link.paged.pop(0)

    def batches(self) -> int:
        """Batches the workers ran, the live sessions' as last reported."""
        with self._lock:
            return self._batches_ended + sum(lk.session.batches for lk in self.links.values())

    def gpu_activity(self) -> dict[str, int]:
        """The workers' GPU activity summed (``device_activity.Counts``' fields), the live
        sessions' as last reported; empty when no worker captured any."""
        with self._lock:
            out = dict(self._activity_ended)
            for link in self.links.values():
                for key, n in link.gpu_activity.items():
                    out[key] = out.get(key, 0) + n
        return out

    def state(self, session: Session) -> str | None:
        link = self.links.get(session.id)
        return link.state if link is not None else None

    def close(self, message: str) -> None:
        """Tell every session's worker to end (the server stops); wait for them a while."""
        with self._lock:
            links = list(self.links.values())
        for link in links:
            with contextlib.suppress(ChannelClosed):
                link.worker.channel.send(End(message, "shutdown"))
        for link in links:
            if link.worker.wait(END_S) is None:
                link.worker.kill()
        self.standby.close()

    # ---- faults ----------------------------------------------------------------------------------

    def _died(self, link: Link, rc: int | None = None) -> None:
        """The worker ended without ending its session: a crash. One line, one ERROR."""
        self.deaths += 1
        session = link.session
        op = link.worker.beacon.read()
        how = exit_text(rc)
        running = f"while running {op}" if op else "between ops"
        log.warning(
            "gpu-trace serve: session %d of tenant %s: its worker %d died (%s) %s;"
            " the other sessions go on",
            session.id,
            session.tenant.name,
            link.worker.pid,
            how,
            running,
        )
        self._tell(
            link.conn,
            f"the session's worker process died ({how}) {running}; the server and the other"
            " sessions go on, this session's tensors are gone",
            "worker-died",
        )

    def _ended_by_worker(self, link: Link) -> None:
        """The worker ended its session itself (its CUDA context failed, a batch ran past its
        tenant's ``batch_s``) and said why: one line, one ERROR."""
        ended = link.ended
        assert ended is not None
        self.deaths += 1
        # what a worker says is not trusted: printable, bounded
        message = "".join(c if c.isprintable() else "?" for c in ended.message[:1000])
        log.warning(
            "gpu-trace serve: session %d of tenant %s: %s",
            link.session.id,
            link.session.tenant.name,
            message,
        )
        self._tell(link.conn, message, ended.reason[:40])

    @staticmethod
    def _tell(conn: socket.socket, message: str, reason: str = "") -> None:
        """An ERROR to the client, on the front's copy of its socket (the worker is gone)."""
        body = {"message": message[:2000]}
        if reason:
            body["reason"] = reason
        with contextlib.suppress(ConnectionClosed, OSError):
            FrameWriter(conn).send(json_frame(MsgType.ERROR, body))
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


def _near(a: int | None, b: int | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= LIMIT_SLACK


def _own_flags() -> dict[str, Any] | None:
    """This process's backend settings, for a worker to run its session under (None: torch's
    defaults, or unreadable). A server of one process runs sessions that set none under its
    own (:func:`~gpu_trace.runtime.server.device_ops.use_flags`); its workers start as fresh
    interpreters, with nothing the process that made the server set (a program that serves
    from Python, with TF32 or deterministic algorithms on) unless they are told."""
    torch = sys.modules.get("torch")
    if torch is None:  # never imported here: nothing set but torch's defaults
        return None
    try:
        return backend_flags.read(torch)
    except Exception:  # a torch that cannot say: the worker's own defaults
        log.warning("gpu-trace serve: the server's backend settings stay out of its workers",
                    exc_info=True)  # fmt: skip
        return None
