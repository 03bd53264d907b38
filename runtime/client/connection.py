"""The forwarding client's connection: batching, sync points, errors, heartbeats, clock sync.

Ops are appended to the pending batch; the batch is sent when nothing is in flight (the server
would otherwise sit idle: so a step's first op goes at once, alone, and the server starts while
the program issues the rest), when it reaches ``max_batch_ops``, or at a sync point; with
``hold_us``, also when its first op has waited that long. (``min_batch_ops`` above 1 holds the
first ops until there are that many, a heartbeat-thread wake-up after ``linger_us`` sending a
lone one: on the 2-vCPU VM this was measured on, 8 cost the client 7-16% more CPU a training step
than 1, and the server more too.) While one batch is in flight the next
one fills, so batches grow exactly as large as the network and the server make them: the DONE
that frees the window is handled by the receiver thread, which gets the GIL at the program's
next op (PyTorch lets it go around each op's dispatch). ``hold_us`` bounds the wait where the
receiver thread gets no CPU (a machine short of CPUs); it is off by default because every batch
costs both sides a send and a wake-up: on the 2-vCPU VM this was measured on, 250 µs sent twice
the batches and cost more CPU than it saved waiting (docs/remote.md, "Performance"). At most
``max_in_flight`` batches are outstanding; past that, issuing waits (like CUDA's launch queue).
In ``sync`` mode every op is sent alone and waited for.

Three threads besides the program's: the receiver (DONEs of batches nobody waits for; see
:mod:`gpu_trace.runtime.client.receiver`, which also holds how messages are read and handled), the
heartbeat (pings every ``heartbeat_s``, which are also clock-sync exchanges, and a backstop
flush), and the autograd engine's device thread, which issues backward ops like any other.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from array import array
from typing import Any

from gpu_trace import config
from gpu_trace.runtime.client.batch import Batch, OpRecord
from gpu_trace.runtime.client.receiver import Receiver
from gpu_trace.runtime.client.trace import ClientTrace
from gpu_trace.runtime.protocol import auth
from gpu_trace.runtime.protocol.addresses import parse_address
from gpu_trace.runtime.protocol.errors import ProtocolMismatch, RemoteOpError, ServerGone
from gpu_trace.runtime.protocol.templates import (
    MAX_SESSION_NODES,
    MAX_TEMPLATE_NODES,
    MAX_TEMPLATES,
    make_template,
    weight,
)
from gpu_trace.runtime.protocol.wire import (
    HEADER,
    INLINE_BYTES,
    JSON_LEN,
    MAX_FRAME,
    ConnectionClosed,
    FrameReader,
    FrameWriter,
    MsgType,
    ProtocolError,
    calls_frame,
    chunk_frames,
    dumps,
    frame,
    int64_bytes,
    json_frame,
    split_frame,
    tune,
)

log = logging.getLogger(__name__)

now_ns = time.perf_counter_ns

_epochs = itertools.count(1)


def _batch_frame(head: dict[str, Any], stream: bytes) -> bytes:
    """A BATCH frame without uploads, as one buffer (:func:`split_frame`'s layout)."""
    h = dumps(head).encode()
    return HEADER.pack(JSON_LEN.size + len(h) + len(stream), MsgType.BATCH) + (
        JSON_LEN.pack(len(h)) + h + stream
    )


class Connection(Receiver):
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
        min_batch_ops: int = 1,
        linger_us: float = 300.0,
        hold_us: float | None = None,
        max_in_flight: int = 16,
        trace: bool | None = None,
        spin_us: float | None = None,
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
        #: The longest an issued op waits in the pending batch while another is in flight (ns;
        #: ``hold_us``, none by default: see the module docstring).
        self.hold_ns = int(hold_us * 1e3) if hold_us is not None else 1 << 62
        #: How long a waiting thread polls for the reply before sleeping (ns).
        self.spin_ns = FrameReader.spin_budget(config.spin_us(spin_us))
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
        self._reader = FrameReader(sock, MAX_FRAME, delay_ns=int(delay_ms * 1e6))
        # Readers sleep in recv, waking this often to see whether to go on waiting.
        self._reader.set_timeout(0.25)

        self._lock = threading.RLock()  # pending batch and sending
        self._cond = threading.Condition(threading.Lock())  # completion
        self._pending: list[list[Any]] = []  # JSON ops of the pending batch
        self._codes = array("q")  # its op stream (templates' ids and numbers; 0: a JSON op)
        self._defs: list[list[Any]] = []  # templates defined since the last batch
        self._records: list[OpRecord] = []
        self._inline: list[list[Any]] = []
        self._inline_data: list[memoryview | bytes] = []
        self._large: list[bytes | memoryview] = []
        self._first_ns = 0
        self._span_id = 0
        self.frees: collections.deque[int] = collections.deque()
        #: Bytes of the storages its live tensors own, as the profiler hears of them
        #: (:mod:`~gpu_trace.runtime.client.profiler_memory`).
        self.allocated = 0
        self._in_flight: dict[int, Batch] = {}
        self.sent_seq = 0
        self.done_seq = 0
        self._error: RemoteOpError | None = None
        self.broken: str | None = None
        self._told = False  # the server said why the session ended (see _break)
        self.closed = False
        #: Handle numbers (``next(c.ids)``; the hot path takes them without a method call).
        self.ids = itertools.count(1)
        #: This connection among all of the process's: a plan's template is ours if its
        #: ``tepoch`` is this (templates are per session).
        self.epoch = next(_epochs)
        self._defined = 0  # templates defined in this session, and the JSON values they hold
        self._nodes = 0
        self._fetches = {}  # see Receiver
        self._ping_lock = threading.Lock()
        self._rx_lock = threading.Lock()  # whoever holds it reads the socket
        self._waiting = 0  # threads waiting for a message (they read themselves)
        self._rx_wanted = threading.Event()  # batches in flight that nobody waits for
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
        client = {
            "host": socket.gethostname(),
            "pid": str(os.getpid()),
            "trace": "1" if self.trace.enabled else "0",
            **self.trace.identity(),
        }
        try:
            _, msg = auth.client_handshake(self.sock, self.address, token, client)
        except ProtocolMismatch:
            self.sock.close()
            raise
        except (ConnectionClosed, ProtocolError, TimeoutError, OSError, ValueError) as exc:
            self.sock.close()
            raise ServerGone(f"handshake with {self.address} failed: {exc}") from None
        self.session_id = int(msg.get("session", 0))
        self.server_device = str(msg.get("device", ""))
        self.server_host = str(msg.get("host", ""))
        self.server_pid = int(msg.get("pid", 0))
        #: Where the server's spans go: "return" (TRACE messages into our run) or "store".
        self.server_sink = str(msg.get("sink", "return"))
        #: The tenant the server knows us as (our token says which).
        self.tenant = str(msg.get("tenant", ""))
        #: Whether the server takes op templates and an op stream (else every op is JSON).
        self.templates = msg.get("templates") is True
        #: Whether it takes CALLS frames (batches of template calls without JSON).
        self.binary = self.templates and msg.get("binary") is True

    # ---- issuing ---------------------------------------------------------------------------------

    def new_handle(self) -> int:
        return next(self.ids)

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
            self._pending.append(op)
            self._codes.append(0)
            seq = self._appended(record, blobs, urgent)
        if self.sync:
            self.wait(seq, record.name)
        return seq

    def issue_t(
        self,
        tid: int,
        nums: list[int],
        record: OpRecord,
        blobs: list[tuple[int, str, list[int], bytes]] | None = None,
        urgent: bool = False,
    ) -> int:
        """Append a call of template ``tid`` with its handle numbers (see :meth:`define`);
        ``urgent`` as :meth:`issue`'s."""
        with self._lock:
            if self.broken:
                raise ServerGone(self.broken)
            codes = self._codes
            codes.append(tid)
            codes.extend(nums)
            records = self._records
            if blobs or self.sync or urgent or not records:
                seq = self._appended(record, blobs, urgent)
            else:  # _appended's common case, inline (this runs for nearly every op)
                records.append(record)
                seq = self.sent_seq + 1
                self.ops_issued += 1
                n = len(records)
                if (
                    n >= self.max_batch_ops
                    or record.t0 - self._first_ns >= self.hold_ns
                    or (not self._in_flight and n >= self.min_batch_ops)
                ):
                    self._flush_locked()
        if self.sync:
            self.wait(seq, record.name)
        return seq

    def define(self, plan: Any, name: str, args: list, kwargs: dict, outs: Any) -> int:
        """The id of ``plan``'s template in this session, defining it with the next batch from
        the wire op ``[name, args, kwargs, outs]``; 0 when the session has all it may define
        (the op then goes as JSON). Ops issued after this return may use the id."""
        with self._lock:
            if plan.tepoch != self.epoch:
                tid = 0
                if self.templates and self._defined < MAX_TEMPLATES:
                    d = make_template(self._defined + 1, name, args, kwargs, outs)
                    nodes = weight(d)
                    if nodes <= MAX_TEMPLATE_NODES and self._nodes + nodes <= MAX_SESSION_NODES:
                        self._defined += 1
                        self._nodes += nodes
                        self._defs.append(d)
                        tid = self._defined
                plan.tid = tid
                plan.tepoch = self.epoch
            return plan.tid

    def _appended(self, record: OpRecord, blobs: Any, urgent: bool) -> int:
        """An op was appended (under the lock): note it, send the batch if it is time."""
        records = self._records
        if not records:
            self._first_ns = record.t0
            self._span_id = self.trace.new_span_id()
        records.append(record)
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
        n = len(records)
        if self.sync or urgent:
            self._flush_locked(urgent=True)
        elif (
            n >= self.max_batch_ops
            or record.t0 - self._first_ns >= self.hold_ns
            or (not self._in_flight and n >= self.min_batch_ops)
            or len(self._large) > 64
        ):
            self._flush_locked()
        elif n == 1 and not self._in_flight:
            self._kick.set()  # the heartbeat thread sends it after a short linger
        return seq

    def flush(self) -> None:
        with self._lock:
            if self._records or self.frees:
                self._flush_locked()

    def _flush_locked(self, urgent: bool = False) -> None:
        """Send the pending batch. ``urgent``: the caller waits for it next and reads the reply
        itself, so the receiver thread is not woken for it."""
        if self.broken:
            raise ServerGone(self.broken)
        if len(self._in_flight) >= self.max_in_flight:
            with self._cond:
                while len(self._in_flight) >= self.max_in_flight and not self.broken:
                    self._cond.wait(0.25)
        if self.broken:
            raise ServerGone(self.broken)
        t_ser = now_ns()
        # Others only append (handles freed by the garbage collector): take what is there now.
        pending = self.frees
        frees = [pending.popleft() for _ in range(len(pending))] if pending else []
        self.sent_seq = seq = self.sent_seq + 1
        span_id = self._span_id or self.trace.new_span_id()
        if self.binary and not (self._pending or self._defs or self._inline or self._large):
            codes = self._codes  # template calls only: no JSON
            frames = [calls_frame(seq, self.trace.parent(span_id), frees, int64_bytes(codes))]
            del codes[:]
        else:
            frames = self._batch_frames(seq, span_id, frees)
        batch = Batch(seq, span_id, self._records, self._first_ns or t_ser)
        batch.t_serialize = t_ser
        batch.nbytes = sum(map(len, frames)) if len(frames) > 1 else len(frames[0])
        self._records = []
        self._first_ns = self._span_id = 0
        self._in_flight[seq] = batch
        if not urgent and not self._rx_wanted.is_set():
            self._rx_wanted.set()
        batch.t_send = now_ns()
        try:
            self.writer.send(*frames)
        except ConnectionClosed as exc:
            self._last_words()
            self._break(f"the server at {self.address} went away: {exc}")
            raise ServerGone(self.broken) from None
        batch.t_sent = now_ns()
        self.batches_sent += 1

    def _batch_frames(self, seq: int, span_id: int, frees: list[int]) -> list[Any]:
        """The pending batch as a BATCH frame (and the large uploads before it); resets it."""
        head: dict[str, Any] = {"seq": seq, "ops": self._pending, "free": frees}
        if self._defs:
            head["defs"] = self._defs
        stream = b""
        if self.templates:  # the op stream goes first, then the blobs' bytes
            stream = int64_bytes(self._codes)
            head["xb"] = len(stream)
        if self._inline:
            head["blobs"] = self._inline
        if self.trace.enabled:
            tp = self.trace.traceparent(span_id)
            if tp:
                head["tp"] = tp
        if self._inline_data:
            frames: list[bytes | memoryview] = split_frame(
                MsgType.BATCH, head, [stream, *self._inline_data]
            )
        else:
            frames = [_batch_frame(head, stream)]
        if self._large:
            frames = [*self._large, *frames]
        self._pending, self._inline, self._inline_data, self._large = [], [], [], []
        self._codes = array("q")
        self._defs = []
        return frames

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
                    self._flush_locked(urgent=True)
        if self.done_seq < seq:
            self.wait_for(lambda: self.done_seq < seq)
        if self.trace.enabled:
            self.trace.wait_span(reason, t0, now_ns(), seq)
        if self.done_seq < seq:
            raise ServerGone(self.broken)
        self.raise_pending()

    def raise_pending(self) -> None:
        err = self._error
        if err is not None:
            self._error = None
            raise err

    def synchronize(self) -> None:
        """Wait for every op issued so far (``torch.cuda.synchronize()``)."""
        with self._lock:
            if self._records or self.frees:
                self._flush_locked(urgent=True)
            seq = self.sent_seq
        self.wait(seq, "synchronize")

    # ---- heartbeats, failure, close ---------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        next_beat = time.monotonic() + self.heartbeat_s
        while not self._stop.is_set():
            if self._kick.wait(max(0.0, next_beat - time.monotonic())):
                self._kick.clear()
                time.sleep(self.linger_s)
                if self._records and not self._in_flight and self._lock.acquire(timeout=0.05):
                    try:
                        if self._records and not self._in_flight and not self.broken:
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

    def _break(self, reason: str, told: bool = False) -> None:
        """The session is over, for ``reason``; ``told``: the server said why (an ERROR), which
        wins over what a failed send or read concluded in the meantime."""
        if self.broken is None or told and not self._told:
            self.broken = reason
            self._told = told
            log.warning("gpu-trace: %s", reason)
        with self._cond:
            self._cond.notify_all()
        self._pong_event.set()
        self._rx_wanted.set()

    def abandon(self, parent: int) -> None:
        """In a process forked from the one that opened this session (``parent``): let go of it
        without a word to the server. The parent's threads did not come along, and its locks
        may be held by them, so nothing here takes a lock; this process's copy of the socket is
        closed (not shut down: the parent's stays open)."""
        self.closed = True
        self._closing = True
        self.broken = f"the session belongs to process {parent}"
        with contextlib.suppress(OSError):
            os.close(self.sock.detach())

    def close(self) -> None:
        """Send what is pending, say goodbye (the server sends its last spans), disconnect."""
        if self.closed:
            return
        try:
            if not self.broken:
                self.flush()
                self._closing = True
                self.writer.send(frame(MsgType.BYE))
                deadline = time.monotonic() + min(self.timeout_s, 10.0)
                self.wait_for(lambda: not self._bye.is_set(), deadline)
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
