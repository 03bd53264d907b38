"""`gpu-trace serve`: the forwarding server. One process owns the device for every client.

The server holds the listening socket, the sessions and what runs their work. Each accepted
connection gets a thread of its own, bounded apart from sessions until it authenticates
(:mod:`gpu_trace.runtime.server.handshakes`); what is said on it, the handshake and then a
session's messages or an admin's requests, is :mod:`gpu_trace.runtime.server.conversation`'s. One
executor thread runs the work (:mod:`gpu_trace.runtime.server.executor`); with ``process``
isolation each session runs in a worker process of its own instead (:mod:`.front`). Traced
sessions' spans go to the sink (:mod:`gpu_trace.runtime.server.sink`): back to the client, or into
a shared store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpu_trace import config
from gpu_trace.runtime.protocol import auth
from gpu_trace.runtime.protocol.addresses import parse_address
from gpu_trace.runtime.protocol.wire import (
    ConnectionClosed,
    FrameReader,
    FrameWriter,
    MsgType,
    ProtocolError,
    json_frame,
    tune,
)
from gpu_trace.runtime.server import admin
from gpu_trace.runtime.server.conversation import Refused, handshake, read_loop
from gpu_trace.runtime.server.device_activity import Counts, DeviceActivity
from gpu_trace.runtime.server.executor import Executor
from gpu_trace.runtime.server.front import Front
from gpu_trace.runtime.server.handshakes import Handshakes
from gpu_trace.runtime.server.sink import ReturnSink, Sink
from gpu_trace.runtime.server.standby import Standby, WorkerFailed
from gpu_trace.runtime.sharing.memory import CUDA_BLOCK_BYTES, Memory, device_capacity
from gpu_trace.runtime.sharing.pager import DEFAULT_IDLE_S, Pager
from gpu_trace.runtime.sharing.scheduler import PolicyScheduler, Work
from gpu_trace.runtime.sharing.sessions import Session
from gpu_trace.runtime.sharing.tenants import Tenant, check_tenants, single_tenant

log = logging.getLogger(__name__)


#: Where sessions' work runs: ``process`` (a worker process each) or ``shared`` (this process).
ISOLATIONS = ("process", "shared")


class Server:
    """A forwarding server on ``host:port`` running ops on ``device`` (``cpu``, ``cuda:0``...).

    ``tenants`` are who may connect (:mod:`gpu_trace.runtime.sharing.tenants`): a client's token
    says which tenant it is. ``token`` alone is one tenant, ``default``, an admin (see
    :mod:`gpu_trace.runtime.protocol.auth`). ``device_memory`` is the capacity in bytes that
    tenants' memory fractions are taken of (None: the device's own); ``max_handshakes`` connections
    may wait to authenticate at once, for ``handshake_timeout_s`` each (:mod:`.handshakes`);
    ``scheduler`` is the scheduling policy (FIFO by default); ``delay_ms`` holds back every
    received frame (benchmarks simulate a longer network with it); ``sink`` is where traced
    sessions' spans go (:class:`~gpu_trace.runtime.server.sink.ReturnSink`, back to the client, by
    default; a :class:`~gpu_trace.runtime.server.sink.StoreSink` for ``--store``). A session idle
    for ``idle_s`` seconds (its tenant's ``idle_s`` wins; 0 or None: never) is paged out to host
    memory by :attr:`pager` (:mod:`gpu_trace.runtime.sharing.pager`) and paged back on its next
    batch.
    """

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        *,
        device: str = "cpu",
        token: str | None = None,
        tenants: Sequence[Tenant] | None = None,
        device_memory: int | None = None,
        scheduler: PolicyScheduler | None = None,
        max_sessions: int = 64,
        idle_timeout_s: float = 120.0,
        handshake_timeout_s: float | None = None,
        max_handshakes: int | None = None,
        delay_ms: float = 0.0,
        sink: Sink | None = None,
        idle_s: float | None = DEFAULT_IDLE_S,
        spin_us: float | None = None,
        gpu_activity: DeviceActivity | None = None,
        isolation: str = "shared",
        standby: int = 2,
        worker_env: Mapping[str, str] | None = None,
    ) -> None:
        self.host, self.port = parse_address(listen)
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation is one of {', '.join(ISOLATIONS)}, not {isolation!r}")
        if isolation == "process" and gpu_activity is not None:
            raise ValueError("the server's GPU activity capture runs with --isolation shared only")
        #: ``process``: each session in a worker process of its own (:mod:`.front`); ``shared``:
        #: every session's work in this process.
        self.isolation = isolation
        self._standby_size = standby
        self._worker_env = worker_env
        #: The front's side of the workers (None: ``shared``, or not started).
        self.front: Front | None = None
        if token is not None and tenants is not None:
            raise ValueError("a server takes a token or tenants, not both")
        if tenants is None:
            tenants = single_tenant(auth.check_token(token or ""))
        self.tenants = check_tenants(tenants)
        if device_memory is not None and device_memory <= 0:
            raise ValueError("device_memory must be a positive number of bytes")
        self.device_memory = device_memory
        self.device = _check_device(device)
        self.scheduler = scheduler if scheduler is not None else PolicyScheduler()
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        #: Connections not authenticated yet, bounded apart from sessions (:mod:`.handshakes`;
        #: ``GPU_TRACE_MAX_HANDSHAKES``, ``GPU_TRACE_HANDSHAKE_TIMEOUT``).
        self.handshakes = Handshakes(
            config.max_handshakes(max_handshakes), config.handshake_timeout(handshake_timeout_s)
        )
        self.delay_ns = int(delay_ms * 1e6)
        #: How long a connection polls for its client's next message while the device is idle
        #: (ns; ``GPU_TRACE_SPIN_US``), before sleeping.
        self.spin_ns = FrameReader.spin_budget(config.spin_us(spin_us))
        self.sink: Sink = sink if sink is not None else ReturnSink()
        self.sink.server_device = self.device
        #: Device memory by tenant: quotas, capacity, waiters
        #: (:mod:`gpu_trace.runtime.sharing.memory`).
        #: It asks the pager for room through :meth:`_reclaim` (each needs the other).
        self.memory = Memory(
            device_capacity(self.device, device_memory),
            block_bytes=CUDA_BLOCK_BYTES if self.device.startswith("cuda") else 1,
            wake=self.scheduler.unpark,
            reclaim=self._reclaim,
        )
        self.memory.add_tenants(list(self.tenants))
        # Held while work runs on the device: the executor's, and the pager's.
        lock = threading.Lock()
        #: Pages idle sessions out to host memory and back; makes room for :attr:`memory`.
        self.pager = Pager(
            self.device,
            lock,
            self.scheduler,
            self._live_sessions,
            idle_s=idle_s,
            before_restore=self.memory.make_room,
            stream_of=lambda session: self.executor.session_stream(session),
        )
        #: GPU activity capture: kernels under the ops that launched them, tenants' GPU busy
        #: time (:mod:`gpu_trace.runtime.server.device_activity`; None: off).
        self.gpu_activity = gpu_activity
        self.executor = Executor(
            self.device,
            self.scheduler,
            self.sink,
            memory=self.memory,
            pager=self.pager,
            lock=lock,
            activity=gpu_activity,
        )
        self.sessions: dict[int, Session] = {}
        #: Sessions' connection times and the usage of ended sessions
        #: (:mod:`gpu_trace.runtime.server.admin`).
        self.ledger = admin.Ledger()
        if gpu_activity is not None:  # kernels come after their session may have ended
            gpu_activity.add_busy = self.ledger.add_gpu_busy
        #: Why the server stops (``SIGTERM``...), said to its clients; see :meth:`stop`.
        self.stop_reason: str | None = None
        self._session_conns: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self.closing = threading.Event()
        self.protocol_errors = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> Server:
        sock = socket.create_server((self.host, self.port), reuse_port=False)
        self.port = sock.getsockname()[1]
        self._sock = sock
        if self.isolation == "process":
            standby = Standby(self.device, self._standby_size, self._worker_env).start()
            try:
                if self._standby_size:
                    standby.wait_first()
            except WorkerFailed as exc:
                standby.close()
                sock.close()
                raise ValueError(f"cannot start a worker process: {exc}") from None
            self.front = Front(self, standby)
        else:
            self.start_engine()
        t = threading.Thread(target=self._accept_loop, name="gpu-trace-accept", daemon=True)
        t.start()
        self._threads.append(t)
        log.info("gpu-trace serve: listening on %s, device %s", self.address, self.device)
        return self

    def tenant_sessions(self, tenant: Tenant) -> int:
        """The most sessions ``tenant`` may have at once: its ``max_sessions``, else the
        server's less one for each other tenant (so one tenant cannot take every slot)."""
        if tenant.max_sessions is not None:
            return min(tenant.max_sessions, self.max_sessions)
        return max(1, self.max_sessions - (len(self.tenants) - 1))

    def gpu_activity_state(self) -> str:
        """``on`` when the server's GPU activity capture runs (this process's, or its workers'),
        else ``off`` or why not, in one line."""
        if self.front is not None:
            first = self.front.standby.first
            return first.gpu_activity if first is not None else "off"
        return "on" if self.gpu_activity is not None else "off"

    def gpu_activity_counts(self) -> Counts | None:
        """What the server's GPU activity came to (this process's capture, or its workers' as
        they reported it); None when nothing captured any."""
        if self.front is not None:
            got = self.front.gpu_activity()
            if not got:
                return None
            names = {f.name for f in dataclasses.fields(Counts)}
            return Counts(**{k: v for k, v in got.items() if k in names})
        return self.gpu_activity.counts if self.gpu_activity is not None else None

    def batches_served(self) -> int:
        """Batches run so far (by this process's executor, or by the workers)."""
        return self.front.batches() if self.front is not None else self.executor.batches

    def start_engine(self) -> None:
        """Start what runs the work: the executor, the pager, GPU activity capture (a server
        with ``shared`` isolation, and each worker process for its one session)."""
        self.executor.start()
        self.pager.start()
        if self.gpu_activity is not None:
            self.gpu_activity.start()

    def serve_forever(self) -> None:
        if self._sock is None:
            self.start()
        self.closing.wait()

    def _reclaim(self, need_bytes: int, session: Session, reason: str) -> int:
        """Memory's :class:`~gpu_trace.runtime.sharing.memory.Reclaim`: the pager pages others
        out (memory is built before the pager, which makes room for it)."""
        return self.pager.reclaim(need_bytes, for_session=session, reason=reason)

    def _live_sessions(self) -> list[Session]:
        with self._lock:
            return list(self.sessions.values())

    def stop(self, reason: str | None = None) -> None:
        """Make :meth:`serve_forever` return (a signal handler may call it); ``reason`` (e.g.
        ``SIGTERM``) is what :meth:`close` tells the clients."""
        if reason and self.stop_reason is None:
            self.stop_reason = reason
        self.closing.set()

    def close(self) -> None:
        """Stop: the work running finishes, traced sessions' spans go to the sink, every client
        is told the server is shutting down (a ``ServerGone`` at its next sync point)."""
        self.closing.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept() (close alone does not)
            with contextlib.suppress(OSError):
                self._sock.close()
        if self.front is not None:  # each worker ends its session and flushes its spans
            why = f" ({self.stop_reason})" if self.stop_reason else ""
            self.front.close(f"shutting down{why}")
        self.pager.stop()
        self.executor.stop()
        locked = self.executor.lock.acquire(timeout=10)  # no inline work either
        try:
            with self._lock:  # with workers, each told its client and flushed its spans
                sessions = list(self.sessions.values()) if self.front is None else []
            why = f" ({self.stop_reason})" if self.stop_reason else ""
            if self.gpu_activity is not None:
                self.gpu_activity.close()  # its last spans join the sessions' logs first
            for session in sessions:
                if session.trace:
                    try:
                        self.sink.export(session, session.log.take())
                        self.sink.session_closed(session)
                    except Exception:  # one session's spans must not keep the others'
                        log.exception("gpu-trace serve: flushing session %d failed", session.id)
                self._end(session, f"shutting down{why}", "shutdown")
        finally:
            if locked:
                self.executor.lock.release()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in list(self._threads):
            t.join(timeout=5)
        self.handshakes.flush()
        self.sink.shutdown()

    def evict(self, session_id: int, by: str = "") -> bool:
        """Close session ``session_id``: its client is told "session evicted by an
        administrator" (a ``ServerGone`` at its next sync point) and its memory is freed.
        False if there is no such session."""
        with self._lock:
            session = self.sessions.get(session_id)
        if session is None:
            return False
        log.warning(
            "gpu-trace serve: session %d of tenant %s evicted by %s",
            session.id,
            session.tenant.name,
            by or "an administrator",
        )
        self._end(session, admin.EVICTED, "evicted")
        return True

    def page_out(self, session_id: int, by: str = "") -> int | None:
        """Page session ``session_id`` out to host memory now (an admin's request); the bytes
        moved, or None if there is no such session."""
        with self._lock:
            session = self.sessions.get(session_id)
        if session is None:
            return None
        log.info(
            "gpu-trace serve: session %d of tenant %s paged out by %s",
            session.id,
            session.tenant.name,
            by or "an administrator",
        )
        if self.front is not None:
            return self.front.page_out(session)
        return self.pager.request_page_out(session, reason="admin")

    def end_session(self, session: Session, message: str, reason: str) -> None:
        """End ``session``, its client told ``message`` (at its next sync point)."""
        self._end(session, message, reason)

    def _end(self, session: Session, message: str, reason: str) -> None:
        """Tell ``session``'s client why it ends, then end it: its connection's thread sees the
        socket shut and frees the session, as at a disconnect (with ``process`` isolation, its
        worker does so)."""
        if self.front is not None and self.front.end(session, message, reason):
            return
        with contextlib.suppress(ConnectionClosed):
            session.send(json_frame(MsgType.ERROR, {"message": message, "reason": reason}))
        session.closed = True
        with self._lock:
            conn = self._session_conns.get(session.id)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- connections -----------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self.closing.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError as exc:
                if self.closing.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                    return
                if exc.errno == errno.ECONNABORTED:  # the peer gave up before we took it
                    continue
                # Out of file descriptors or memory: not the end of the server. Counted and
                # logged like a refusal; the connections holding them end or time out.
                self.handshakes.failed("accept")
                time.sleep(0.05)
                continue
            host = peer[0] if isinstance(peer, tuple) and peer else str(peer)
            deadline = self.handshakes.begin(conn, host)  # may end a pending handshake
            with self._lock:
                self._conns.add(conn)
            t = threading.Thread(
                target=self._serve_conn,
                args=(conn, peer, deadline),
                name="gpu-trace-conn",
                daemon=True,
            )
            t.start()
            self._threads = [x for x in self._threads if x.is_alive()] + [t]

    def _serve_conn(self, conn: socket.socket, peer: Any, deadline: float) -> None:
        writer = FrameWriter(conn)
        session: Session | None = None
        try:
            tune(conn)
            session = handshake(self, conn, writer, deadline)
        except Exception as exc:
            self._conn_failed(exc, conn, writer, peer)
        if session is not None:
            if self.front is not None:  # its own worker process runs it
                try:
                    self.front.run(conn, session)
                except Exception:  # a bug must cost one connection, never the server
                    log.exception("gpu-trace serve: %s: session %d failed", peer, session.id)
                finally:
                    self._forget(session)
                    self.memory.detach(session)
                    session.closed = True
            else:
                self.serve_session(conn, session, writer, peer)
        self.handshakes.done(conn)
        with self._lock:
            self._conns.discard(conn)
        with contextlib.suppress(OSError):
            conn.close()

    def serve_session(
        self,
        conn: socket.socket,
        session: Session,
        writer: FrameWriter,
        peer: Any = None,
    ) -> None:
        """Run ``session``'s connection until it ends: its messages read and its work run here
        (the server of ``--isolation shared``, and a worker process's, which is handed one
        authenticated connection by the front)."""
        try:
            read_loop(self, conn, writer, session)
        except Exception as exc:
            self._conn_failed(exc, conn, writer, peer)
        finally:
            self._forget(session)
            session.closed = True
            self.scheduler.drop(session)
            self.scheduler.submit(session, Work("close"))

    def open_session(
        self,
        client: dict[str, str],
        send: Callable[..., None],
        tenant: Tenant,
        binary: bool,
        conn: socket.socket,
    ) -> Session:
        """A session for an authenticated client on ``conn``, or :class:`Refused` when the
        server, or ``tenant``'s share of it, is full."""
        with self._lock:
            if len(self.sessions) >= self.max_sessions:
                raise Refused(f"server full ({self.max_sessions} sessions)")
            cap = self.tenant_sessions(tenant)
            if sum(s.tenant.name == tenant.name for s in self.sessions.values()) >= cap:
                raise Refused(f"tenant {tenant.name!r} has its {cap} sessions open already")
            session = Session(client, send, tenant)
            session.trace = self.sink.accepts(client)
            session.binary = binary
            self.sessions[session.id] = session
            self.memory.attach(session)
            self._session_conns[session.id] = conn
        self.ledger.open(session)
        return session

    def adopt(self, conn: socket.socket, session: Session) -> FrameWriter:
        """Take on ``session``, authenticated elsewhere, on ``conn`` (a worker process's one
        session); :meth:`serve_session` then runs it."""
        writer = FrameWriter(conn)
        session.send = writer.send
        with self._lock:
            self.sessions[session.id] = session
            self.memory.attach(session)
            self._session_conns[session.id] = conn
        self.ledger.open(session)
        return writer

    def _forget(self, session: Session) -> None:
        with self._lock:
            self.sessions.pop(session.id, None)
            self._session_conns.pop(session.id, None)
        self.ledger.retire(session)

    def _conn_failed(
        self, exc: Exception, conn: socket.socket, writer: FrameWriter, peer: Any
    ) -> None:
        """How a connection's end by ``exc`` is counted, logged and told to its client."""
        if isinstance(exc, ProtocolError):
            self.protocol_errors += 1
            refused = isinstance(exc, Refused)
            if self.handshakes.done(conn) or refused:  # no session: counted, logged in bulk
                self.handshakes.failed("refused" if refused else "protocol")
                log.debug("gpu-trace serve: %s: handshake failed: %s", peer, exc)
            else:
                log.info("gpu-trace serve: %s: protocol error: %s", peer, exc)
            with contextlib.suppress(ConnectionClosed, OSError):
                writer.send(json_frame(MsgType.ERROR, {"message": str(exc)[:500]}))
        elif isinstance(exc, (ConnectionClosed, TimeoutError, OSError)):
            if self.handshakes.done(conn) and isinstance(exc, TimeoutError):
                self.handshakes.failed("timeout")
            log.debug("gpu-trace serve: %s: connection ended: %s", peer, exc)
        else:  # a bug must cost one connection, never the server
            log.error("gpu-trace serve: %s: connection failed", peer, exc_info=exc)


def _check_device(device: str) -> str:
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} is not available here (no CUDA)")
    if d.type not in ("cpu", "cuda"):
        raise ValueError(f"the server runs on cpu or cuda devices, not {device!r}")
    return str(d)


__all__ = ["Server"]
