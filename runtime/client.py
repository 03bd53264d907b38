"""The forwarding client's connection: batching, sync points, errors, heartbeats, clock sync.

Ops are appended to the pending batch; the batch is sent when nothing is in flight (the server
would otherwise sit idle), when it reaches ``max_batch_ops``, or at a sync point. While one batch
is in flight the next one fills, so batches grow exactly as large as the network and the server
make them. At most ``max_in_flight`` batches are outstanding; past that, issuing waits (like
CUDA's launch queue). In ``sync`` mode every op is sent alone and waited for.

Three threads besides the program's: the receiver (DONE, DATA, PONG, TRACE), the heartbeat
(pings every ``heartbeat_s``, which are also clock-sync exchanges, and a backstop flush), and the
autograd engine's device thread, which issues backward ops like any other.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import select
import socket
import threading
import time
from typing import Any

from gpu_trace import config
from gpu_trace.runtime import auth
from gpu_trace.runtime.errors import ProtocolMismatch, RemoteOpError, ServerGone, user_frames
from gpu_trace.runtime.server import parse_address
from gpu_trace.runtime.tracing import ClientTrace
from gpu_trace.runtime.values import DTYPES, tensor_from_bytes
from gpu_trace.runtime.wire import (
    INLINE_BYTES,
    MAX_FRAME,
    MAX_HANDSHAKE_FRAME,
    PING_BODY,
    PROTOCOL_VERSION,
    ConnectionClosed,
    FrameReader,
    FrameWriter,
    MsgType,
    ProtocolError,
    chunk_frames,
    decode_chunk,
    decode_json,
    decode_pong,
    decode_split,
    frame,
    json_frame,
    split_frame,
    tune,
)

log = logging.getLogger(__name__)

now_ns = time.perf_counter_ns


class OpRecord:
    """What the client keeps about one issued op until its batch is done."""

    __slots__ = ("name", "stack", "t0", "t1", "result", "fetch")

    def __init__(self, name: str, stack: list, t0: int) -> None:
        self.name = name
        self.stack = stack
        self.t0 = t0
        self.t1 = t0
        self.result: Any = None
        self.fetch: int = 0


class Batch:
    __slots__ = (
        "seq",
        "span_id",
        "records",
        "t_first",
        "t_serialize",
        "t_send",
        "t_sent",
        "nbytes",
    )

    def __init__(self, seq: int, span_id: int, records: list[OpRecord], t_first: int) -> None:
        self.seq = seq
        self.span_id = span_id
        self.records = records
        self.t_first = t_first
        self.t_serialize = self.t_send = self.t_sent = 0
        self.nbytes = 0


class Connection:
    """A session with a `gpu-trace serve` server."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        sync: bool | None = None,
        timeout_s: float | None = None,
        heartbeat_s: float = 2.0,
        delay_ms: float = 0.0,
        max_batch_ops: int = 512,
        min_batch_ops: int = 8,
        linger_us: float = 300.0,
        max_in_flight: int = 16,
        trace: bool | None = None,
    ) -> None:
        if max_batch_ops < 1 or max_in_flight < 1 or heartbeat_s <= 0:
            raise ValueError("max_batch_ops, max_in_flight and heartbeat_s must be positive")
        self.address = address
        self.sync = config.remote_sync(sync)
        self.timeout_s = config.remote_timeout(timeout_s)
        self.heartbeat_s = heartbeat_s
        self.max_batch_ops = 1 if self.sync else max_batch_ops
        self.min_batch_ops = max(1, min(min_batch_ops, self.max_batch_ops))
        self.linger_s = linger_us / 1e6
        self.max_in_flight = max_in_flight
        host, port = parse_address(address)
        token = auth.client_token(token)
        self.trace = ClientTrace(self, trace)
        try:
            sock = socket.create_connection((host, port), timeout=self.timeout_s)
        except OSError as exc:
            raise ServerGone(f"cannot connect to {address}: {exc}") from None
        tune(sock)
        self.sock = sock
        self.writer = FrameWriter(sock)
        self._handshake(token)
        sock.settimeout(0.25)
        self._reader = FrameReader(sock, MAX_FRAME, delay_ns=int(delay_ms * 1e6))

        self._lock = threading.RLock()  # pending batch and sending
        self._cond = threading.Condition(threading.Lock())  # completion
        self._pending: list[list[Any]] = []
        self._records: list[OpRecord] = []
        self._inline: list[list[Any]] = []
        self._inline_data: list[memoryview | bytes] = []
        self._large: list[bytes | memoryview] = []
        self._first_ns = 0
        self._span_id = 0
        self.frees: collections.deque[int] = collections.deque()
        self._in_flight: dict[int, Batch] = {}
        self.sent_seq = 0
        self.done_seq = 0
        self._error: RemoteOpError | None = None
        self.broken: str | None = None
        self.closed = False
        self._ids = itertools.count(1)
        self._fetches: dict[int, list[Any]] = {}
        self._ping_lock = threading.Lock()
        self._rx_lock = threading.Lock()  # whoever holds it reads the socket
        self._pong: tuple[int, int, int, int] | None = None
        self._pong_event = threading.Event()
        self._bye = threading.Event()
        self._kick = threading.Event()
        self._closing = False
        self.last_recv_ns = now_ns()
        self.ops_issued = 0
        self.batches_sent = 0
        self._stop = threading.Event()
        self._receiver = threading.Thread(
            target=self._receive_loop, name="gpu-trace-remote-rx", daemon=True
        )
        self._receiver.start()
        self.trace.start_clock()
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name="gpu-trace-remote-hb", daemon=True
        )
        self._heartbeat.start()

    # ---- handshake -------------------------------------------------------------------------------

    def _handshake(self, token: str) -> None:
        reader = FrameReader(self.sock, MAX_HANDSHAKE_FRAME)
        try:
            mtype, body = reader.read()
            if mtype != MsgType.CHALLENGE:
                raise ProtocolMismatch(f"{self.address} is not a gpu-trace server")
            challenge = decode_json(body)
            if challenge.get("v") != PROTOCOL_VERSION:
                raise ProtocolMismatch(
                    f"server protocol version {challenge.get('v')}, client {PROTOCOL_VERSION}"
                )
            nonce = bytes.fromhex(str(challenge.get("nonce", "")))
            client = {
                "host": socket.gethostname(),
                "pid": str(os.getpid()),
                "trace": "1" if self.trace.enabled else "0",
                **self.trace.identity(),
            }
            hello = {"v": PROTOCOL_VERSION, "mac": auth.mac(token, nonce), "client": client}
            self.writer.send(json_frame(MsgType.HELLO, hello))
            reader.max_frame = MAX_FRAME
            mtype, body = reader.read()
            msg = decode_json(body)
        except (ConnectionClosed, ProtocolError, TimeoutError, OSError, ValueError) as exc:
            self.sock.close()
            if isinstance(exc, ProtocolMismatch):
                raise
            raise ServerGone(f"handshake with {self.address} failed: {exc}") from None
        if mtype == MsgType.ERROR:
            self.sock.close()
            raise ProtocolMismatch(f"{self.address} refused the session: {msg.get('message')}")
        if mtype != MsgType.WELCOME:
            self.sock.close()
            raise ProtocolMismatch(f"unexpected {MsgType(mtype).name} from {self.address}")
        self.session_id = int(msg.get("session", 0))
        self.server_device = str(msg.get("device", ""))
        self.server_host = str(msg.get("host", ""))
        self.server_pid = int(msg.get("pid", 0))

    # ---- issuing ---------------------------------------------------------------------------------

    def new_handle(self) -> int:
        return next(self._ids)

    def issue(
        self,
        op: list[Any],
        record: OpRecord,
        blobs: list[tuple[int, str, list[int], bytes]] | None = None,
        urgent: bool = False,
    ) -> int:
        """Append an encoded op ``[name, args, kwargs, outs]``; returns its batch's seq.

        ``urgent``: the caller waits for this op next, so its batch goes now.
        """
        with self._lock:
            if self.broken:
                raise ServerGone(self.broken)
            if not self._pending:
                self._first_ns = record.t0
                self._span_id = self.trace.new_span_id()
            self._pending.append(op)
            self._records.append(record)
            if blobs:
                for ident, dtype, shape, data in blobs:
                    if len(data) <= INLINE_BYTES:
                        self._inline.append([ident, dtype, shape, len(data)])
                        self._inline_data.append(data)
                    else:
                        put = {"blob": ident, "dtype": dtype, "shape": shape, "nbytes": len(data)}
                        self._large.append(json_frame(MsgType.PUT, put))
                        self._large.extend(chunk_frames(ident, memoryview(data)))
            seq = self.sent_seq + 1
            self.ops_issued += 1
            n = len(self._pending)
            if (
                self.sync
                or urgent
                or n >= self.max_batch_ops
                or (not self._in_flight and n >= self.min_batch_ops)
                or len(self._large) > 64
            ):
                self._flush_locked()
            elif n == 1 and not self._in_flight:
                self._kick.set()  # the heartbeat thread sends it after a short linger
        if self.sync:
            self.wait(seq, record.name)
        return seq

    def flush(self) -> None:
        with self._lock:
            if self._pending or self.frees:
                self._flush_locked()

    def _flush_locked(self) -> None:
        if self.broken:
            raise ServerGone(self.broken)
        with self._cond:
            while len(self._in_flight) >= self.max_in_flight and not self.broken:
                self._cond.wait(0.25)
        if self.broken:
            raise ServerGone(self.broken)
        t_ser = now_ns()
        frees = []
        popleft = self.frees.popleft
        while True:
            try:
                frees.append(popleft())
            except IndexError:
                break
        self.sent_seq += 1
        seq = self.sent_seq
        span_id = self._span_id or self.trace.new_span_id()
        head: dict[str, Any] = {"seq": seq, "ops": self._pending, "free": frees}
        if self._inline:
            head["blobs"] = self._inline
        tp = self.trace.traceparent(span_id)
        if tp:
            head["tp"] = tp
        frames = [*self._large, *split_frame(MsgType.BATCH, head, self._inline_data)]
        batch = Batch(seq, span_id, self._records, self._first_ns or t_ser)
        batch.t_serialize = t_ser
        batch.nbytes = sum(len(f) for f in frames)
        self._pending, self._records, self._inline, self._inline_data, self._large = (
            [],
            [],
            [],
            [],
            [],
        )
        self._first_ns = self._span_id = 0
        with self._cond:
            self._in_flight[seq] = batch
        batch.t_send = now_ns()
        try:
            self.writer.send(*frames)
        except ConnectionClosed as exc:
            self._break(f"the server at {self.address} went away: {exc}")
            raise ServerGone(self.broken) from None
        batch.t_sent = now_ns()
        self.batches_sent += 1

    # ---- waiting ---------------------------------------------------------------------------------

    def wait(self, seq: int, reason: str = "wait") -> None:
        """Block until batch ``seq`` is done; raise the first asynchronous error, if any.

        The waiting thread reads the socket itself when no one else is (no hand-off from the
        receiver thread on the way back).
        """
        t0 = now_ns()
        if seq > self.sent_seq:
            with self._lock:
                if seq > self.sent_seq:
                    self._flush_locked()
        while self.done_seq < seq and not self.broken:
            if self._rx_lock.acquire(timeout=0.002):
                try:
                    self._read_until(seq)
                finally:
                    self._rx_lock.release()
        self.trace.wait_span(reason, t0, now_ns(), seq)
        if self.done_seq < seq:
            raise ServerGone(self.broken)
        self.raise_pending()

    def _read_until(self, seq: int) -> None:
        reader = self._reader
        while self.done_seq < seq and not self.broken:
            try:
                got = reader.next_frame()
                if got is None:
                    if not self._readable(0.25):
                        continue
                    reader.fill()
                    continue
            except TimeoutError:
                continue
            except (ConnectionClosed, ProtocolError, OSError, ValueError) as exc:
                self._lost(exc)
                return
            self._handle(*got)

    def _readable(self, timeout: float) -> bool:
        try:
            return bool(select.select([self.sock], [], [], timeout)[0])
        except (OSError, ValueError):  # closed under us
            raise ConnectionClosed("connection closed") from None

    def raise_pending(self) -> None:
        err = self._error
        if err is not None:
            self._error = None
            raise err

    def synchronize(self) -> None:
        """Wait for every op issued so far (``torch.cuda.synchronize()``)."""
        with self._lock:
            if self._pending or self.frees:
                self._flush_locked()
            seq = self.sent_seq
        self.wait(seq, "synchronize")

    # ---- receiving -------------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        """Reads whatever arrives while no program thread is waiting (and reading) itself."""
        reader = self._reader
        while not self._stop.is_set() and not self.broken:
            try:
                if not self._readable(0.25):
                    continue
            except ConnectionClosed as exc:
                self._lost(exc)
                return
            if not self._rx_lock.acquire(timeout=0.05):
                continue
            try:
                if reader.next_frame_ready() or self._readable(0):
                    if not reader.next_frame_ready():
                        reader.fill()
                    while (got := reader.next_frame()) is not None:
                        self._handle(*got)
            except TimeoutError:
                pass
            except (ConnectionClosed, ProtocolError, OSError, ValueError) as exc:
                self._lost(exc)
                return
            finally:
                self._rx_lock.release()

    def _lost(self, exc: Exception) -> None:
        if not self.closed and not self._closing:
            self._break(f"the server at {self.address} went away: {exc}")

    def _handle(self, mtype: int, body: bytes) -> None:
        self.last_recv_ns = now_ns()
        try:
            self._on_message(mtype, body)
        except ProtocolError as exc:
            self._break(f"bad message from {self.address}: {exc}")
        except Exception:
            log.exception("gpu-trace: remote: handling a %s message failed", mtype)

    def _on_message(self, mtype: int, body: bytes) -> None:
        if mtype == MsgType.DONE:
            self._on_done(decode_json(body), now_ns())
        elif mtype == MsgType.DATA:
            head, data = decode_split(body)
            fid = head["fetch"]
            buf = bytearray(int(head["nbytes"]))
            entry = [DTYPES[head["dtype"]], list(head["shape"]), buf, 0]
            self._fetches[fid] = entry
            if len(data):
                buf[: len(data)] = data
                entry[3] = len(data)
        elif mtype == MsgType.CHUNK:
            fid, offset, data = decode_chunk(body)
            entry = self._fetches[fid]
            entry[2][offset : offset + len(data)] = data
            entry[3] = offset + len(data)
        elif mtype == MsgType.PONG:
            t0, t1, t2 = decode_pong(body)
            self._pong = (t0, t1, t2, self.last_recv_ns)
            self._pong_event.set()
        elif mtype == MsgType.TRACE:
            self.trace.server_records(decode_json(body))
        elif mtype == MsgType.BYE:
            self._bye.set()
        elif mtype == MsgType.ERROR:
            msg = decode_json(body)
            self._break(f"the server at {self.address} closed the session: {msg.get('message')}")

    def _on_done(self, msg: dict[str, Any], t_done: int) -> None:
        seq = msg.get("seq")
        with self._cond:
            batch = self._in_flight.pop(seq, None)
        if batch is None:
            raise ProtocolError(f"DONE for unknown batch {seq}")
        for index, value in (msg.get("results") or {}).items():
            batch.records[int(index)].result = value
        error = msg.get("error")
        if error and self._error is None:
            record = batch.records[int(error.get("index", 0))]
            text = f"{error.get('type', 'Error')}: {error.get('message', '')}"
            self._error = RemoteOpError(record.name, text, user_frames(record.stack))
        self.trace.batch_done(batch, t_done, msg.get("t"), bool(error))
        with self._cond:
            self.done_seq = max(self.done_seq, seq)
            self._cond.notify_all()
        if not self._in_flight and self._pending and self._lock.acquire(timeout=0.05):
            try:
                if self._pending and not self.broken:
                    self._flush_locked()
            except ServerGone:
                pass
            finally:
                self._lock.release()

    def take_fetch(self, fid: int) -> Any:
        entry = self._fetches.pop(fid, None)
        if entry is None:
            raise ServerGone(f"the server at {self.address} sent no data for a fetch")
        dtype, shape, buf, _ = entry
        return tensor_from_bytes(dtype, shape, buf)

    # ---- heartbeats, clock sync, failure -----------------------------------------------------------

    def ping(self) -> tuple[int, int, int, int]:
        """One clock-sync exchange ``(t0, t1, t2, t3)``; ServerGone if no answer in time."""
        with self._ping_lock:
            self._pong_event.clear()
            t0 = now_ns()
            self.writer.send(frame(MsgType.PING, PING_BODY.pack(t0)))
            if not self._pong_event.wait(self.timeout_s) or self._pong is None:
                self._break(f"the server at {self.address} did not answer for {self.timeout_s:g} s")
                raise ServerGone(self.broken)
            return self._pong

    def _heartbeat_loop(self) -> None:
        next_beat = time.monotonic() + self.heartbeat_s
        while not self._stop.is_set():
            if self._kick.wait(max(0.0, next_beat - time.monotonic())):
                self._kick.clear()
                time.sleep(self.linger_s)
                if self._pending and not self._in_flight and self._lock.acquire(timeout=0.05):
                    try:
                        if self._pending and not self._in_flight and not self.broken:
                            self._flush_locked()
                    except ServerGone:
                        pass
                    finally:
                        self._lock.release()
            if self._stop.is_set() or time.monotonic() < next_beat:
                continue
            next_beat = time.monotonic() + self.heartbeat_s
            try:
                self.trace.clock_exchange(2)
            except (ServerGone, ConnectionClosed):
                return
            self.trace.flush()

    def _break(self, reason: str) -> None:
        if self.broken is None:
            self.broken = reason
            log.warning("gpu-trace: %s", reason)
        with self._cond:
            self._cond.notify_all()
        self._pong_event.set()

    def close(self) -> None:
        """Send what is pending, say goodbye (the server sends its last spans), disconnect."""
        if self.closed:
            return
        try:
            if not self.broken:
                self.flush()
                self._closing = True
                self.writer.send(frame(MsgType.BYE))
                self._bye.wait(min(self.timeout_s, 10.0))
        except (ServerGone, ConnectionClosed):
            pass
        self.closed = True
        self._stop.set()
        self._kick.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for t in (self._receiver, self._heartbeat):
            if t is not threading.current_thread():
                t.join(timeout=2)
        self.trace.close()
        if self.broken is None:
            self.broken = f"the connection to {self.address} is closed"
