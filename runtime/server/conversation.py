"""One connection's conversation with its client: the handshake, then a session's messages or an
admin's requests, until the connection ends.

The handshake (CHALLENGE/HELLO/WELCOME, by the deadline :mod:`gpu_trace.runtime.server.handshakes`
gives it) authenticates the client as one of the server's tenants and opens its session. A
session's reader answers heartbeats at once (their timestamps are clock-sync samples, so they never
wait behind work), validates every frame and hands uploads and batches to the scheduler, in order;
a lone small batch runs on the connection's thread when the device is idle (:func:`submitter`).
It polls for the client's next message for :attr:`ServerSide.spin_ns` while the device is idle,
then sleeps in ``recv``. Apart from :mod:`gpu_trace.runtime.server.server`, which owns the
sessions and the connections' threads: this is what is said on each, the server is what holds
them.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from gpu_trace.runtime.protocol import auth
from gpu_trace.runtime.protocol.templates import define, expand
from gpu_trace.runtime.protocol.values import tensor_from_bytes, tensor_meta
from gpu_trace.runtime.protocol.wire import (
    CALLS_SYNC,
    MAX_FRAME,
    MAX_HANDSHAKE_FRAME,
    PONG_BODY,
    PROTOCOL_VERSION,
    FrameReader,
    FrameWriter,
    MsgType,
    ProtocolError,
    decode_admin,
    decode_calls,
    decode_chunk,
    decode_clock,
    decode_json,
    decode_ping,
    decode_split,
    field_bool,
    field_int,
    field_list,
    frame,
    json_frame,
)
from gpu_trace.runtime.server import admin
from gpu_trace.runtime.sharing.scheduler import PolicyScheduler, Work

if TYPE_CHECKING:
    from gpu_trace.runtime.server.executor import Executor
    from gpu_trace.runtime.server.handshakes import Handshakes
    from gpu_trace.runtime.server.sink import Sink
    from gpu_trace.runtime.sharing.sessions import Session
    from gpu_trace.runtime.sharing.tenants import Tenant

now_ns = time.perf_counter_ns

#: Batches of at most this many ops may run on the connection's thread when the device is idle.
INLINE_OPS = 16


class Refused(ProtocolError):
    """A well-formed HELLO that is refused: a wrong token, a full server."""


class ServerSide(admin.ListedServer, Protocol):
    """What a connection's conversation reads of the server, besides the listing an admin asks
    for (:class:`~gpu_trace.runtime.server.server.Server`, which imports this module)."""

    @property
    def sink(self) -> Sink: ...

    @property
    def handshakes(self) -> Handshakes: ...

    @property
    def idle_timeout_s(self) -> float: ...

    @property
    def delay_ns(self) -> int: ...

    @property
    def spin_ns(self) -> int: ...

    @property
    def closing(self) -> threading.Event: ...

    def open_session(
        self,
        client: dict[str, str],
        send: Callable[..., None],
        tenant: Tenant,
        binary: bool,
        conn: socket.socket,
    ) -> Session: ...


def handshake(
    server: ServerSide, conn: socket.socket, writer: FrameWriter, deadline: float
) -> Session | None:
    """CHALLENGE, HELLO, WELCOME, all by ``deadline`` (:mod:`.handshakes`): the session opened,
    or None for an admin's connection (its requests answered here until it ends)."""
    conn.settimeout(max(0.001, deadline - time.monotonic()))
    nonce = auth.new_nonce()
    writer.send(
        json_frame(
            MsgType.CHALLENGE,
            {"v": PROTOCOL_VERSION, "nonce": nonce.hex(), "device": str(server.device)},
        )
    )
    reader = FrameReader(conn, MAX_HANDSHAKE_FRAME)
    mtype, body = reader.read_by(deadline)
    if mtype != MsgType.HELLO:
        raise ProtocolError("expected HELLO")
    hello = decode_json(body)
    if hello.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {str(hello.get('v'))[:10]} not supported")
    # Every tenant's token is tried, in constant time each, whatever the answer: a wrong
    # token gets the same refusal, after the same work, however many tenants there are.
    tenant = auth.match(server.tenants, nonce, hello.get("mac"))
    if tenant is None:
        time.sleep(0.05)  # slow down guessing
        raise Refused("authentication failed")
    client = hello.get("client")
    if not isinstance(client, dict):
        raise ProtocolError("HELLO needs a client object")
    client = {str(k)[:64]: str(v)[:256] for k, v in list(client.items())[:32]}
    mode = hello.get("mode", "session")
    if mode not in ("session", "admin"):
        raise ProtocolError("HELLO mode must be session or admin")
    binary = field_bool(hello, "binary")
    welcome = {
        "device": str(server.device),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "sink": server.sink.kind,
        "tenant": tenant.name,
        # Batches may carry an op stream and templates
        # (:mod:`gpu_trace.runtime.protocol.templates`).
        "templates": True,
        # CALLS frames are taken (:mod:`gpu_trace.runtime.protocol.wire`).
        "binary": True,
    }
    server.handshakes.done(conn)  # authenticated: out of the handshakes' bound and deadline
    if mode == "admin":
        writer.send(json_frame(MsgType.WELCOME, {**welcome, "session": 0, "admin": tenant.admin}))
        conn.settimeout(None)
        admin_loop(server, conn, writer, tenant)
        return None
    session = server.open_session(client, writer.send, tenant, binary, conn)
    writer.send(json_frame(MsgType.WELCOME, {**welcome, "session": session.id}))
    conn.settimeout(None)  # blocking, for polling; the read loop times out itself
    return session


def admin_loop(
    server: ServerSide, conn: socket.socket, writer: FrameWriter, tenant: Tenant
) -> None:
    """An admin client's requests (:mod:`gpu_trace.runtime.server.admin`); no session."""
    reader = FrameReader(conn, MAX_HANDSHAKE_FRAME)
    reader.set_timeout(server.idle_timeout_s)
    while not server.closing.is_set():
        mtype, body = reader.read()
        if mtype == MsgType.ADMIN:
            reply = admin.handle(server, tenant, decode_admin(body))
            writer.send(json_frame(MsgType.ADMIN_REPLY, reply))
        elif mtype == MsgType.PING:
            t1 = now_ns()
            writer.send(frame(MsgType.PONG, PONG_BODY.pack(decode_ping(body), t1, now_ns())))
        elif mtype == MsgType.BYE:
            writer.send(frame(MsgType.BYE))
            return
        else:
            raise ProtocolError(f"unexpected message {MsgType(mtype).name} from an admin")


def read_loop(
    server: ServerSide, conn: socket.socket, writer: FrameWriter, session: Session
) -> None:
    """A session's messages until it ends: heartbeats answered at once, uploads and batches
    validated and handed to the scheduler in order (or run here: :func:`submitter`)."""
    reader = FrameReader(conn, MAX_FRAME, delay_ns=server.delay_ns)
    reader.set_timeout(server.idle_timeout_s)
    submit = submitter(server.scheduler, server.executor)
    read = reader.read
    spin, busy, queued = server.spin_ns, server.executor.lock.locked, server.scheduler.depth

    def device_busy() -> bool:  # work runs or waits: the CPU is better left to it
        return busy() or queued() > 0

    # Not stopped by closing: close() tells each client why, then shuts its socket.
    while not session.closed:
        if spin and not device_busy():  # poll while the next batch would run at once
            reader.spin(spin, device_busy)
        mtype, body = read()
        if mtype == MsgType.CALLS:
            seq, span, flags, frees, stream = decode_calls(body)
            head = {"seq": seq, "ops": expand(session.templates, stream, []), "free": frees}
            if span:
                head["tp"] = span
            if flags & CALLS_SYNC:
                head["sync"] = True
            submit(session, Work("batch", head, None, reader.frame_started_ns, now_ns()))
        elif mtype == MsgType.BATCH:
            on_batch(session, reader.frame_started_ns, body, submit)
        elif mtype == MsgType.PING:
            t1 = now_ns()
            t0 = decode_ping(body)
            writer.send(frame(MsgType.PONG, PONG_BODY.pack(t0, t1, now_ns())))
        elif mtype == MsgType.PUT:
            head = decode_json(body)
            ident = field_int(head, "blob", 1)
            meta = tensor_meta(head.get("dtype"), head.get("shape"), head.get("nbytes"))
            submit(session, Work("put", ident, meta))
        elif mtype == MsgType.CHUNK:
            ident, offset, data = decode_chunk(body)
            submit(session, Work("chunk", None, (ident, offset, data)))
        elif mtype == MsgType.CLOCK:
            samples = decode_clock(body)
            if session.trace:
                server.sink.clock(session, samples)
        elif mtype == MsgType.BYE:
            done = threading.Event()
            server.scheduler.submit(session, Work("bye", done=done))
            deadline = time.monotonic() + server.idle_timeout_s
            # A stopping server's executor may never run it: don't hold close() up.
            while not done.wait(0.1) and not server.closing.is_set():
                if time.monotonic() > deadline:
                    break
            return
        else:
            raise ProtocolError(f"unexpected message {MsgType(mtype).name} from a client")


def submitter(scheduler: PolicyScheduler, executor: Executor) -> Callable[[Session, Work], None]:
    """``submit(session, work)``: a lone small batch runs at once on the calling thread
    when the device is idle (no hand-off to the executor's); anything else is queued."""

    def submit(session: Session, work: Work) -> None:
        if not (
            work.kind == "batch"
            and len(work.head["ops"]) <= INLINE_OPS
            and executor.try_inline(session, work)
        ):
            scheduler.submit(session, work)

    return submit


def on_batch(
    session: Session, start: int, body: bytes, submit: Callable[[Session, Work], None]
) -> None:
    """A BATCH frame: its inline uploads, then its ops (templates' calls expanded)."""
    head, data = decode_split(body)
    xb = head.get("xb")
    if xb is not None:  # the op stream (templates' calls) before the blobs
        if type(xb) is not int or not 0 <= xb <= len(data):
            raise ProtocolError("field 'xb' must be the op stream's length")
        if "defs" in head:
            define(session.templates, head["defs"])
        head["ops"] = expand(session.templates, data[:xb], head.get("ops"))
        data = data[xb:]
    elif type(head.setdefault("ops", [])) is not list:
        raise ProtocolError("field 'ops' must be a list")
    if "blobs" in head:
        off = 0
        for entry in field_list(head, "blobs", 1 << 16):  # [id, dtype, shape, nbytes]
            if type(entry) is not list or len(entry) != 4:
                raise ProtocolError("an inline blob is [id, dtype, shape, nbytes]")
            dtype, shape, nbytes = tensor_meta(entry[1], entry[2], entry[3])
            if off + nbytes > len(data):
                raise ProtocolError("inline blobs longer than the batch")
            tensor = tensor_from_bytes(dtype, shape, data[off : off + nbytes])
            off += nbytes
            submit(session, Work("put-inline", entry[0], (tensor, nbytes)))
    submit(session, Work("batch", head, None, start, now_ns()))
