"""The wire protocol: frames, message types, size bounds and the socket reader and writer.

A frame is a 5-byte header, ``<IB`` (body length, message type), and the body. Bodies are JSON
(UTF-8, decoded by ``json.loads`` only: no pickle, nothing executable), a JSON header followed by
raw tensor bytes (``BATCH``, ``DATA``), or fixed binary structs (``PING``, ``PONG``, ``CHUNK``).

A session, from the client's side::

    connect          <- CHALLENGE {v, nonce, server}
    HELLO {v, mac, client, binary} ->     mac = HMAC-SHA256(token, "gpu-trace/1" + nonce)
                     <- WELCOME {session, device, host, pid, sink, templates, binary}
                                                          (or ERROR, then close)
    PUT {blob, dtype, shape, nbytes} + CHUNK* ->   large uploads, streamed before their BATCH
    BATCH {seq, ops, free, blobs, tp, sync} + inline blob bytes ->
    CALLS seq span nfree flags, frees, op stream ->   (a batch of template calls only, binary)
                     <- DATA {fetch, dtype, shape, nbytes} + CHUNK*   (for rt::fetch ops)
                     <- DONE {seq, ok, error, results, t}
                     <- DONE_OK seq t*5                 (a batch done, no error, no results)
                     <- DONE_VALUE seq t*5 index kind value   (one number: ``.item()``...)
    PING t0 ->       <- PONG t0 t1 t2          (heartbeat and clock-sync exchange)
    CLOCK (t0 t1 t2 t3)* ->                   (finished exchanges, when the server keeps the spans)
                     <- TRACE {names, spans, counters}   (server spans, when the client traces)
                     <- ERROR {message, reason}   (then close: reason "evicted", "shutdown"...)
    BYE ->           <- BYE                    (after the last TRACE)

An admin client (``gpu-trace tenants``, :mod:`gpu_trace.runtime.client.admin_requests`; the server
answers in :mod:`gpu_trace.runtime.server.admin`) says ``"mode": "admin"`` in its HELLO; it gets
a WELCOME with no session, then::

    ADMIN {op: "list"} or {op: "evict", session} ->   <- ADMIN_REPLY {ok, ...}

``binary`` says the peer takes the binary forms: a client that said it in its HELLO may be sent
DONE_OK and DONE_VALUE; a server that said it in its WELCOME may be sent CALLS. The common
batch, template calls and frees only (:mod:`gpu_trace.runtime.protocol.templates`), and its reply
then carry no JSON at all: a synchronous round trip spends no time formatting or parsing it.

Every size is bounded before anything is allocated: a frame's length is checked against the
limit of the connection's state (:data:`MAX_HANDSHAKE_FRAME` before authentication) as soon as its
header is read.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import socket
import struct
import sys
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any

PROTOCOL_VERSION = 1

HEADER = struct.Struct("<IB")
_HEAD = HEADER.size
PING_BODY = struct.Struct("<q")
PONG_BODY = struct.Struct("<qqq")
CLOCK_SAMPLE = struct.Struct("<qqqq")  # t0, t1, t2, t3 of one finished clock-sync exchange
CHUNK_HEAD = struct.Struct("<QQ")  # blob or fetch id, byte offset
#: CALLS: seq, the client's span id (0: none), number of frees, flags (:data:`CALLS_SYNC`).
CALLS_HEAD = struct.Struct("<qqII")
CALLS_SYNC = 1  # the reply waits for the device (as BATCH's ``sync``)
#: DONE_OK: seq, then DONE's ``t``: receive start and end, execute start and end, reply.
DONE_OK_BODY = struct.Struct("<6q")
#: DONE_VALUE: DONE_OK's, the op's index in its batch, the value's kind; then the value (8 bytes).
DONE_VALUE_HEAD = struct.Struct("<6qiB")
_VALUE = (struct.Struct("<q"), struct.Struct("<d"), struct.Struct("<q"))  # int, float, bool
_VALUE_KINDS = {int: 0, float: 1, bool: 2}
JSON_LEN = struct.Struct("<I")  # BATCH and DATA: length of the JSON header before the raw bytes
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_TIMEVAL = struct.Struct("@ll")  # SO_RCVTIMEO: seconds, microseconds
_BIG_ENDIAN = sys.byteorder != "little"
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

#: Frames before authentication are small: the hello and the challenge.
MAX_HANDSHAKE_FRAME = 4096
#: Largest frame after authentication (a batch's JSON plus its inline tensor bytes, or a chunk).
MAX_FRAME = 32 << 20
#: Tensors larger than this are streamed in chunks of this size.
CHUNK_BYTES = 1 << 20
#: Tensors up to this size travel inside their batch.
INLINE_BYTES = 64 << 10
#: Largest single tensor either way.
MAX_TENSOR_BYTES = 8 << 30
#: Most ops in one batch, handles freed in one batch, elements in one list argument.
MAX_BATCH_OPS = 16384
MAX_FREES = 1 << 20
MAX_LIST = 1 << 16
#: Deepest nesting of an argument (lists in lists).
MAX_DEPTH = 4
MAX_STRING = 1024
#: Most clock-sync exchanges in one CLOCK message.
MAX_CLOCK_SAMPLES = 64
#: What an ADMIN request may ask for.
ADMIN_OPS = ("list", "evict", "page-out")


class MsgType(enum.IntEnum):
    CHALLENGE = 1
    HELLO = 2
    WELCOME = 3
    BATCH = 4
    PUT = 5
    CHUNK = 6
    DONE = 7
    DATA = 8
    PING = 9
    PONG = 10
    TRACE = 11
    BYE = 12
    ERROR = 13
    CLOCK = 14
    ADMIN = 15
    ADMIN_REPLY = 16
    CALLS = 17
    DONE_OK = 18
    DONE_VALUE = 19


_TYPES = frozenset(int(t) for t in MsgType)
_DONE_VALUE = HEADER.pack(DONE_VALUE_HEAD.size + 8, MsgType.DONE_VALUE)


class ProtocolError(ValueError):
    """A peer sent something the protocol does not allow; the connection is closed."""


class ConnectionClosed(ConnectionError):
    """The peer closed the connection (or it broke)."""


# ---- encoding ------------------------------------------------------------------------------------


#: ``json.dumps(obj, separators=(",", ":"))`` without making an encoder per call.
dumps = json.JSONEncoder(separators=(",", ":")).encode


def frame(mtype: MsgType, body: bytes | bytearray | memoryview = b"") -> bytes:
    """One frame (header and body)."""
    return HEADER.pack(len(body), mtype) + bytes(body)


def json_frame(mtype: MsgType, obj: Any) -> bytes:
    body = dumps(obj).encode()
    return HEADER.pack(len(body), mtype) + body


def split_frame(
    mtype: MsgType, head: Any, payload: Sequence[bytes | memoryview]
) -> list[bytes | memoryview]:
    """A frame whose body is a JSON header followed by raw bytes: returned as buffers to send."""
    h = dumps(head).encode()
    n = JSON_LEN.size + len(h) + sum(len(p) for p in payload)
    return [HEADER.pack(n, mtype) + JSON_LEN.pack(len(h)) + h, *payload]


def chunk_frames(ident: int, data: memoryview) -> list[bytes | memoryview]:
    """``data`` as CHUNK frames of at most :data:`CHUNK_BYTES`."""
    out: list[bytes | memoryview] = []
    for off in range(0, len(data), CHUNK_BYTES):
        part = data[off : off + CHUNK_BYTES]
        out.append(HEADER.pack(CHUNK_HEAD.size + len(part), MsgType.CHUNK))
        out.append(CHUNK_HEAD.pack(ident, off))
        out.append(part)
    return out


# ---- decoding ------------------------------------------------------------------------------------


def decode_json(body: bytes | memoryview) -> dict[str, Any]:
    """A JSON object body; ``ProtocolError`` for anything else."""
    try:
        obj = json.loads(bytes(body).decode())  # a str: json skips guessing the encoding
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ProtocolError(f"malformed JSON body: {str(exc)[:100]}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("message body must be a JSON object")
    return obj


def decode_split(body: bytes | memoryview) -> tuple[dict[str, Any], memoryview]:
    """The JSON header and the raw bytes after it."""
    view = memoryview(body)
    if len(view) < JSON_LEN.size:
        raise ProtocolError("truncated message header")
    (n,) = JSON_LEN.unpack_from(view)
    if n > len(view) - JSON_LEN.size:
        raise ProtocolError("message header longer than the message")
    head = decode_json(view[JSON_LEN.size : JSON_LEN.size + n])
    return head, view[JSON_LEN.size + n :]


def decode_calls(body: bytes | memoryview) -> tuple[int, int, int, list[int], memoryview]:
    """A CALLS body: ``(seq, span, flags, frees, op stream)``."""
    view = memoryview(body)
    if len(view) < CALLS_HEAD.size:
        raise ProtocolError("truncated calls header")
    seq, span, nfree, flags = CALLS_HEAD.unpack_from(view)
    end = CALLS_HEAD.size + 8 * nfree
    if nfree > MAX_FREES or end > len(view):
        raise ProtocolError("calls: bad number of frees")
    if seq < 0 or span < 0 or flags & ~CALLS_SYNC:
        raise ProtocolError("calls: bad header")
    frees = int64s(view[CALLS_HEAD.size : end]) if nfree else []
    return seq, span, flags, frees, view[end:]


def int64s(data: bytes | memoryview) -> list[int]:
    """Little-endian int64s (a whole number of them) as a list."""
    arr = array("q")
    arr.frombytes(data)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tolist()


def int64_bytes(values: array) -> bytes:
    """An ``array("q")`` as little-endian bytes."""
    if _BIG_ENDIAN:
        values = array("q", values)
        values.byteswap()
    return values.tobytes()


def calls_frame(seq: int, span: int, frees: list[int], stream: bytes) -> bytes:
    """A CALLS frame (see :func:`decode_calls`); ``stream`` is the op stream's bytes."""
    n = len(frees)
    head = CALLS_HEAD.pack(seq, span, n, 0)
    if n:
        head += int64_bytes(array("q", frees))
    return HEADER.pack(len(head) + len(stream), MsgType.CALLS) + head + stream


def done_value_frame(seq: int, t: Sequence[int], index: int, value: Any) -> bytes | None:
    """A DONE_VALUE frame of a batch whose one result, op ``index``'s, is ``value``; None for a
    value it cannot carry (the DONE's JSON then)."""
    kind = _VALUE_KINDS.get(type(value))
    if kind is None or kind == 0 and not INT64_MIN <= value <= INT64_MAX:
        return None
    return _DONE_VALUE + DONE_VALUE_HEAD.pack(seq, *t, index, kind) + _VALUE[kind].pack(value)


def decode_done_value(body: bytes | memoryview) -> tuple[int, list[int], int, Any]:
    """A DONE_VALUE body: ``(seq, t, index, value)``."""
    if len(body) != DONE_VALUE_HEAD.size + 8:
        raise ProtocolError("malformed DONE_VALUE")
    seq, *t, index, kind = DONE_VALUE_HEAD.unpack_from(body)
    if kind > 2:
        raise ProtocolError("DONE_VALUE of an unknown kind")
    (value,) = _VALUE[kind].unpack_from(body, DONE_VALUE_HEAD.size)
    return seq, t, index, bool(value) if kind == 2 else value


def decode_chunk(body: bytes | memoryview) -> tuple[int, int, memoryview]:
    view = memoryview(body)
    if len(view) < CHUNK_HEAD.size:
        raise ProtocolError("truncated chunk")
    ident, offset = CHUNK_HEAD.unpack_from(view)
    return ident, offset, view[CHUNK_HEAD.size :]


def decode_ping(body: bytes | memoryview) -> int:
    if len(body) != PING_BODY.size:
        raise ProtocolError("malformed ping")
    return PING_BODY.unpack(body)[0]


def decode_clock(body: bytes | memoryview) -> list[tuple[int, int, int, int]]:
    n, rest = divmod(len(body), CLOCK_SAMPLE.size)
    if rest or not 0 < n <= MAX_CLOCK_SAMPLES:
        raise ProtocolError("malformed clock samples")
    return list(CLOCK_SAMPLE.iter_unpack(body))


def decode_admin(body: bytes | memoryview) -> dict[str, Any]:
    """An ADMIN request, validated: ``{"op": "list"}``, or ``{"op": "evict" | "page-out",
    "session": N}``."""
    req = decode_json(body)
    op = field_str(req, "op", 16)
    if op not in ADMIN_OPS or set(req) - {"op", "session"}:
        raise ProtocolError(f"an admin request is one of {', '.join(ADMIN_OPS)}")
    if op in ("evict", "page-out"):
        return {"op": op, "session": field_int(req, "session", 1)}
    return {"op": op}


def decode_pong(body: bytes | memoryview) -> tuple[int, int, int]:
    if len(body) != PONG_BODY.size:
        raise ProtocolError("malformed pong")
    return PONG_BODY.unpack(body)


# ---- field validation ----------------------------------------------------------------------------


def field_int(obj: dict[str, Any], name: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    value = obj.get(name)
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(f"field {name!r} must be an integer in [{lo}, {hi}]")
    return value


def field_str(obj: dict[str, Any], name: str, max_len: int = MAX_STRING, default: Any = ...) -> str:
    value = obj.get(name, default)
    if value is ... or type(value) is not str or len(value) > max_len:
        raise ProtocolError(f"field {name!r} must be a string of at most {max_len} characters")
    return value


def field_list(obj: dict[str, Any], name: str, max_len: int, default: Any = ...) -> list[Any]:
    value = obj.get(name, default)
    if value is ... or type(value) is not list or len(value) > max_len:
        raise ProtocolError(f"field {name!r} must be a list of at most {max_len} items")
    return value


def field_bool(obj: dict[str, Any], name: str, default: bool = False) -> bool:
    value = obj.get(name, default)
    if type(value) is not bool:
        raise ProtocolError(f"field {name!r} must be a boolean")
    return value


# ---- sockets -------------------------------------------------------------------------------------


class FrameReader:
    """Reads whole frames from a socket, checking each length against ``max_frame`` first.

    The socket is blocking: :meth:`read` sleeps in ``recv`` itself (no ``select`` first), up to
    the receive timeout :meth:`set_timeout` gives the socket (``SO_RCVTIMEO``), then raises
    ``TimeoutError``. ``delay_ns`` holds every frame back until that long after it arrived (a
    delay line: frames stay in order and delays do not add up); benchmarks use it to simulate a
    longer network.
    """

    def __init__(self, sock: socket.socket, max_frame: int, delay_ns: int = 0) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self.delay_ns = delay_ns
        self._buf = bytearray()
        self._pos = 0
        #: perf_counter_ns when the current frame's first bytes were available.
        self.frame_started_ns = 0
        self._spin = 0  # :meth:`spin`'s current budget (ns; 0: not polled yet)
        self._missed = 0  # when the last poll that found nothing began (0: it found something)

    def set_timeout(self, seconds: float | None) -> None:
        """How long one :meth:`fill` may wait (None: for ever). The socket becomes blocking."""
        sock = self.sock
        sock.settimeout(None)
        us = 0 if seconds is None else max(1, int(seconds * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _TIMEVAL.pack(*divmod(us, 1000000)))

    def read(self) -> tuple[int, bytes]:
        """The next frame's ``(type, body)``; raises ProtocolError, ConnectionClosed or (past
        the receive timeout) TimeoutError."""
        while True:
            got = self.next_frame()
            if got is not None:
                return got
            self.fill()

    def read_by(self, deadline: float) -> tuple[int, bytes]:
        """The next frame, whole by ``deadline`` (``time.monotonic()`` seconds), else
        TimeoutError. Each ``recv`` waits only for the time left: a peer trickling bytes does
        not extend the deadline, as it would extend a receive timeout."""
        while True:
            got = self.next_frame()
            if got is not None:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no whole message in time")
            self.sock.settimeout(left)
            self.fill()

    def next_frame(self) -> tuple[int, bytes] | None:
        """A whole frame already received, or None (never reads the socket)."""
        buf = self._buf
        pos = self._pos
        if len(buf) - pos < _HEAD:
            return None
        n, mtype = HEADER.unpack_from(buf, pos)
        if n > self.max_frame:
            raise ProtocolError(f"frame of {n} bytes exceeds the limit of {self.max_frame}")
        if mtype not in _TYPES:
            raise ProtocolError(f"unknown message type {mtype}")
        end = pos + _HEAD + n
        if len(buf) < end:
            return None
        body = bytes(buf[pos + _HEAD : end])
        if end == len(buf):
            buf.clear()
            self._pos = 0
        elif end > (1 << 20):
            del buf[:end]
            self._pos = 0
        else:
            self._pos = end
        if self.delay_ns:
            wait = self.frame_started_ns + self.delay_ns - time.perf_counter_ns()
            if wait > 0:
                time.sleep(wait / 1e9)
        return mtype, body

    def next_frame_ready(self) -> bool:
        """Whether a whole frame is buffered."""
        avail = len(self._buf) - self._pos
        if avail < HEADER.size:
            return False
        n, _ = HEADER.unpack_from(self._buf, self._pos)
        return avail >= HEADER.size + n

    def fill(self) -> None:
        """Receive once: wait up to the receive timeout (TimeoutError past it)."""
        try:
            data = self.sock.recv(1 << 18)
        except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO ran out
            raise TimeoutError("no message in time") from None
        except OSError as exc:
            raise ConnectionClosed(f"connection broken: {exc}") from None
        self._append(data)

    def _append(self, data: bytes) -> None:
        if not data:
            raise ConnectionClosed("connection closed by peer")
        if len(self._buf) == self._pos:
            self.frame_started_ns = time.perf_counter_ns()
        self._buf += data

    def spin(self, spin_ns: int, stop: Callable[[], Any] | None = None) -> bool:
        """Poll for what comes next, giving the CPU away between tries (``sched_yield``); True
        once something arrived (or a whole frame was buffered), False if nothing did in time.
        ``stop()``: true when someone else has work for the CPU (polling then ends at once).

        A thread that sleeps in ``recv`` is woken by the kernel when data comes, which on a VM
        can cost more than the whole round trip (about 40 µs each way on the 2-vCPU VM this was
        measured on, when the sleeper's vCPU was idle). One that polls sees the data at once;
        yielding between tries lets the peer run first when both share one CPU.

        The budget follows the peer: after a poll that found nothing, it halves (down to a
        sixteenth of ``spin_ns``) if what came next took longer than ``spin_ns``, and is whole
        again if it did not; so waiting for replies that take milliseconds (large ops) costs
        little CPU, and a peer that answers within ``spin_ns`` is always caught.
        """
        if self.next_frame_ready():
            return True
        budget = self._spin or spin_ns
        if self._missed:  # the last poll found nothing: how long did it take after all?
            gap = self.frame_started_ns - self._missed
            if gap >= 0:
                budget = spin_ns if gap <= spin_ns else max(spin_ns >> 4, budget >> 1)
            self._missed = 0
        budget = self._spin = min(budget, spin_ns)
        recv = self.sock.recv
        clock = time.perf_counter_ns
        start = clock()
        end = start + budget
        while True:
            try:
                data = recv(1 << 18, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if stop is not None and stop():
                    return False
                if clock() >= end:
                    self._missed = start
                    return False
                _yield()
                continue
            except OSError as exc:
                raise ConnectionClosed(f"connection broken: {exc}") from None
            self._append(data)
            return True

    @staticmethod
    def spin_budget(spin_us: float) -> int:
        """The polling budget (ns) of a reader allowed ``spin_us``: none in a process that may
        run on one CPU only, where polling can only take the CPU from the peer (or whatever else
        runs there) and a woken thread costs less."""
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(2)
        return int(spin_us * 1000) if len(cpus) > 1 else 0

    def poll(self) -> bool:
        """Receive what has arrived without waiting; False if nothing had."""
        try:
            data = self.sock.recv(1 << 18, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise ConnectionClosed(f"connection broken: {exc}") from None
        self._append(data)
        return True


class FrameWriter:
    """Sends frames from any thread: one lock, one ``sendall`` of joined buffers per call."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.bytes_sent = 0

    def send(self, *buffers: bytes | memoryview) -> None:
        if len(buffers) == 1:  # most messages: one buffer
            data = buffers[0]
            with self.lock:
                try:
                    self.sock.sendall(data)
                except OSError as exc:
                    raise ConnectionClosed(f"connection broken: {exc}") from None
                self.bytes_sent += len(data)
            return
        with self.lock:
            self._send(buffers)

    def send_locked(self, fn: Callable[[], Sequence[bytes | memoryview]]) -> None:
        """Build the buffers and send them under the lock (the build may assign sequence numbers)."""
        with self.lock:
            self._send(fn())

    def _send(self, buffers: Sequence[bytes | memoryview]) -> None:
        total = sum(len(b) for b in buffers)
        try:
            if total <= (256 << 10) or len(buffers) == 1:
                self.sock.sendall(buffers[0] if len(buffers) == 1 else b"".join(buffers))
            else:  # large tensors: no joined copy
                for b in buffers:
                    self.sock.sendall(b)
        except OSError as exc:
            raise ConnectionClosed(f"connection broken: {exc}") from None
        self.bytes_sent += total


def tune(sock: socket.socket) -> None:
    """Low latency for small frames, big buffers for large tensors."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)


def wire_name(op: Any) -> str:
    """The name an ``OpOverload`` travels by (``aten::add.Tensor``; the server resolves it
    against its allow-list)."""
    return f"{op._schema.name}.{op._overloadname}"
