"""The forwarding client's receiving side: whoever needs a message reads the socket itself.

One lock, ``_rx_lock``, says who reads. A program thread waiting at a sync point, the heartbeat
waiting for its PONG and :meth:`~gpu_trace.runtime.client.connection.Connection.close` waiting for
BYE each take it and read until they have what they wait for, handling every other message on the
way (no hand-off between threads on the way back). They poll for ``spin_ns`` (``GPU_TRACE_SPIN_US``,
see :meth:`~gpu_trace.runtime.protocol.wire.FrameReader.spin`), then sleep in ``recv`` itself (no
``select`` first), waking every quarter second (the socket's receive timeout) to see whether to
go on.

The receiver thread reads only while batches that nobody waits for are in flight
(``_rx_wanted``): their DONEs free the in-flight window and send the next batch. It stays out of
the way of a waiting thread, so a synchronous round trip wakes no other thread.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu_trace.runtime.protocol.errors import QuotaExceeded, RemoteOpError, ServerGone, user_frames
from gpu_trace.runtime.protocol.values import DTYPES, tensor_from_bytes
from gpu_trace.runtime.protocol.wire import (
    CLOCK_SAMPLE,
    DONE_OK_BODY,
    MAX_CLOCK_SAMPLES,
    PING_BODY,
    ConnectionClosed,
    MsgType,
    ProtocolError,
    decode_chunk,
    decode_done_value,
    decode_json,
    decode_pong,
    decode_split,
    frame,
)

if TYPE_CHECKING:
    import socket

    from gpu_trace.runtime.client.batch import Batch, OpRecord
    from gpu_trace.runtime.client.trace import ClientTrace
    from gpu_trace.runtime.protocol.wire import FrameReader, FrameWriter

log = logging.getLogger(__name__)

now_ns = time.perf_counter_ns


class Receiver:
    """Reading and handling the server's messages (a part of
    :class:`~gpu_trace.runtime.client.connection.Connection`, its only subclass)."""

    # Connection's state that these methods read and set, declared once for the type checker
    # (Connection.__init__ gives the values), so that this part needs no import of the whole.
    address: str
    sock: socket.socket
    writer: FrameWriter
    trace: ClientTrace
    spin_ns: int
    timeout_s: float
    broken: str | None
    closed: bool
    done_seq: int
    last_recv_ns: int
    _reader: FrameReader
    _lock: threading.RLock
    _cond: threading.Condition
    _rx_lock: threading.Lock
    _ping_lock: threading.Lock
    _rx_wanted: threading.Event
    _stop: threading.Event
    _waiting: int
    _closing: bool
    _in_flight: dict[int, Batch]
    _records: list[OpRecord]
    _fetches: dict[int, list[Any]]  # fetch id -> [dtype, shape, buffer, bytes received]
    _error: RemoteOpError | None
    _pong: tuple[int, int, int, int] | None
    _pong_event: threading.Event
    _bye: threading.Event

    if TYPE_CHECKING:  # Connection's, which these methods call

        def _break(self, reason: str, told: bool = False) -> None: ...

        def _flush_locked(self, urgent: bool = False) -> None: ...

    # ---- reading ---------------------------------------------------------------------------------

    def read_while(self, waiting: Callable[[], bool], deadline: float = 0.0) -> None:
        """Read and handle messages while ``waiting()`` and the connection works.

        ``deadline`` (``time.monotonic()``; 0 for none): give up then (the caller decides what
        that means). Returns at once if another thread reads: it handles what we wait for.
        """
        reader = self._reader
        spin = self.spin_ns
        while waiting() and not self.broken:
            try:
                got = reader.next_frame()
                if got is None:
                    if not (spin and reader.spin(spin)):
                        reader.fill()  # sleeps in recv, up to the socket's receive timeout
                    got = reader.next_frame()
                    if got is None:
                        continue
            except TimeoutError:
                if deadline and time.monotonic() > deadline:
                    return
                continue
            except (ConnectionClosed, ProtocolError, OSError, ValueError) as exc:
                self._lost(exc)
                return
            self._handle(*got)

    def wait_for(self, waiting: Callable[[], bool], deadline: float = 0.0) -> None:
        """Until ``not waiting()``: read ourselves, or let whoever reads do it."""
        self._waiting += 1
        try:
            while waiting() and not self.broken:
                if deadline and time.monotonic() > deadline:
                    return
                if self._rx_lock.acquire(False) or self._rx_lock.acquire(timeout=0.002):
                    try:
                        self.read_while(waiting, deadline)
                    finally:
                        self._rx_lock.release()
        finally:
            self._waiting -= 1

    def _readable(self, timeout: float) -> bool:
        # poll, not select: select() refuses descriptors numbered 1024 or more, which a program
        # with many files, sockets or DataLoader workers open reaches, and the connection read
        # as closed (every forwarded call then failed with ServerGone).
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            return bool(poller.poll(max(0, int(timeout * 1000))))
        except (OSError, ValueError):  # closed under us
            raise ConnectionClosed("connection closed") from None

    def _receive_loop(self) -> None:
        """Reads DONEs of batches in flight while no other thread is reading."""
        reader = self._reader
        wanted = self._rx_wanted
        while not self._stop.is_set() and not self.broken:
            if not wanted.wait(0.25):
                continue
            if not self._in_flight:
                wanted.clear()
                if not self._in_flight:  # a batch sent between the check and the clear
                    continue
                wanted.set()
            if self._waiting:  # a program thread reads; let it
                time.sleep(0.0005)
                continue
            try:
                if not self._readable(0.05) or self._waiting:
                    continue
            except ConnectionClosed as exc:
                self._lost(exc)
                return
            if not self._rx_lock.acquire(timeout=0.05):
                continue
            try:
                if reader.next_frame_ready() or reader.poll():
                    while (got := reader.next_frame()) is not None:
                        self._handle(*got)
            except (ConnectionClosed, ProtocolError, OSError, ValueError) as exc:
                self._lost(exc)
                return
            finally:
                self._rx_lock.release()

    def _last_words(self) -> None:
        """A send failed: handle what the server sent before it closed (an ERROR saying why),
        unless another thread is reading (it will)."""
        if not self._rx_lock.acquire(False):
            return
        try:
            reader = self._reader
            with contextlib.suppress(ConnectionClosed, OSError):  # what came before stays
                while reader.poll():
                    pass
            with contextlib.suppress(ProtocolError, ValueError):
                while (got := reader.next_frame()) is not None:
                    self._handle(*got)
        finally:
            self._rx_lock.release()

    def _lost(self, exc: Exception) -> None:
        if not self.closed and not self._closing:
            self._break(f"the server at {self.address} went away: {exc}")
        elif self._closing:
            self._bye.set()

    # ---- handling --------------------------------------------------------------------------------

    def _handle(self, mtype: int, body: bytes) -> None:
        self.last_recv_ns = now_ns()
        try:
            self._on_message(mtype, body)
        except ProtocolError as exc:
            self._break(f"bad message from {self.address}: {exc}")
        except Exception:
            log.exception("gpu-trace: remote: handling a %s message failed", mtype)

    def _on_message(self, mtype: int, body: bytes) -> None:
        if mtype == MsgType.DONE_OK:
            if len(body) != DONE_OK_BODY.size:
                raise ProtocolError("malformed DONE_OK")
            seq, *t = DONE_OK_BODY.unpack(body)
            self._done(seq, None, None, t, self.last_recv_ns)
        elif mtype == MsgType.DONE_VALUE:
            seq, t, index, value = decode_done_value(body)
            self._done(seq, {index: value}, None, t, self.last_recv_ns)
        elif mtype == MsgType.DONE:
            msg = decode_json(body)
            self._done(
                msg.get("seq"),
                msg.get("results"),
                msg.get("error"),
                msg.get("t"),
                self.last_recv_ns,
            )
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
            text = str(msg.get("message"))[:500]
            if msg.get("reason") == "shutdown":  # "shutting down (SIGTERM)"
                self._break(f"the server at {self.address} is {text}", told=True)
            else:  # "session evicted by an administrator", a protocol error...
                self._break(f"the server at {self.address} closed the session: {text}", told=True)

    def _done(self, seq: Any, results: Any, error: Any, t: Any, t_done: int) -> None:
        """Batch ``seq`` is done (a DONE's fields; ``t``: the server's times)."""
        batch = self._in_flight.pop(seq, None)
        if batch is None:
            raise ProtocolError(f"DONE for unknown batch {str(seq)[:20]}")
        if results:
            for index, value in results.items():
                batch.records[int(index)].result = value
        if error and self._error is None:
            record = batch.records[int(error.get("index", 0))]
            text = f"{error.get('type', 'Error')}: {error.get('message', '')}"
            quota = error.get("quota")
            if isinstance(quota, dict):
                self._error = QuotaExceeded(record.name, text, user_frames(record.stack), quota)
            else:
                self._error = RemoteOpError(record.name, text, user_frames(record.stack))
        if self.trace.enabled:
            # A fast reply can be handled by another thread before the sender has noted the
            # end of its send (it is just past sendall): give it a moment, else use now.
            deadline = t_done + 2_000_000
            while not batch.t_sent and now_ns() < deadline:
                time.sleep(0)
            if not batch.t_sent:
                batch.t_sent = max(batch.t_send, t_done)
            self.trace.batch_done(batch, t_done, t, bool(error))
        with self._cond:
            if seq > self.done_seq:
                self.done_seq = seq
            self._cond.notify_all()
        if not self._in_flight and self._records and self._lock.acquire(timeout=0.05):
            try:
                if self._records and not self.broken:
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

    # ---- clock sync ------------------------------------------------------------------------------

    def ping(self) -> tuple[int, int, int, int]:
        """One clock-sync exchange ``(t0, t1, t2, t3)``; ServerGone if no answer in time."""
        with self._ping_lock:
            self._pong_event.clear()
            self._pong = None
            t0 = now_ns()
            self.writer.send(frame(MsgType.PING, PING_BODY.pack(t0)))
            deadline = time.monotonic() + self.timeout_s
            self.wait_for(lambda: not self._pong_event.is_set(), deadline)
            if self._pong is None:
                if not self.broken:
                    self._break(
                        f"the server at {self.address} did not answer for {self.timeout_s:g} s"
                    )
                raise ServerGone(self.broken)
            return self._pong

    def send_clock(self, samples: list[tuple[int, int, int, int]]) -> None:
        """Finished exchanges to a server that keeps its spans itself (a CLOCK message)."""
        for i in range(0, len(samples), MAX_CLOCK_SAMPLES):
            part = samples[i : i + MAX_CLOCK_SAMPLES]
            self.writer.send(frame(MsgType.CLOCK, b"".join(CLOCK_SAMPLE.pack(*s) for s in part)))
