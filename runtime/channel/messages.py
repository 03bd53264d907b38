"""What the front and a worker say to each other, and the socket they say it on.

A worker process is joined to the front by one ``AF_UNIX`` ``SOCK_SEQPACKET`` socket pair made
when the worker starts: each message is one packet (no framing to get wrong), JSON of one of the
dataclasses below, named by its ``kind``. Only data crosses: numbers, strings and the client's
connection, passed once as a file descriptor (``SCM_RIGHTS``) with :class:`Assign`. Nothing here
imports torch; both sides use it.

Front to worker: :class:`Assign` (a session and its client's socket), :class:`Limits` (the bytes
it may hold now), :class:`End` (evict or shut down, with the reason the client is told),
:class:`PageOut` (an admin's request). Worker to front: :class:`Ready` (standby: torch imported,
device warmed), :class:`Report` (its session's usage and memory, whenever they changed, at most
every ``REPORT_S``), :class:`PagedOut` (the answer to a :class:`PageOut`), :class:`Ended` (the
session ended, and why: the client left, was told to go, or the device failed).
"""

from __future__ import annotations

import contextlib
import json
import socket
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

#: Largest message either side sends (a Report with a usage snapshot is well under 1 KiB).
MAX_MESSAGE = 64 << 10
#: How often a worker reports its session's usage while it changes (seconds).
REPORT_S = 0.1


class ChannelClosed(Exception):
    """The other side is gone (a worker that died, or a front that closed the channel)."""


@dataclass
class Message:
    kind: ClassVar[str] = ""


@dataclass
class Ready(Message):
    kind: ClassVar[str] = "ready"
    pid: int
    device: str
    #: Seconds the worker took to import torch and warm the device.
    warm_s: float
    #: ``on`` when its GPU activity capture runs, else ``off`` or why not (one line).
    gpu_activity: str = "off"
    #: Device memory its context holds before any session's tensor (CUDA; 0 where unknown).
    context_bytes: int = 0


@dataclass
class Assign(Message):
    """The session a standby worker is to run; the client's socket travels with it."""

    kind: ClassVar[str] = "assign"
    session: int
    tenant: dict[str, Any]
    client: dict[str, str]
    trace: bool
    binary: bool
    #: Bytes the session may hold (its tenant's quota less what its other sessions hold; None:
    #: no quota), and device bytes it may keep resident.
    limit_bytes: int | None
    capacity_bytes: int
    idle_timeout_s: float
    idle_s: float | None
    spin_us: float | None
    #: ``return`` (spans back to the client) or ``spool:DIR`` (spool files the front ingests).
    sink: str = "return"
    #: Milliseconds every received frame is held back (benchmarks simulate a longer network).
    delay_ms: float = 0.0
    #: The front's own backend settings (:mod:`gpu_trace.runtime.protocol.backend_flags`):
    #: the worker's own, under which the session's ops run unless it sets others, as a
    #: single-process server runs them under its process's; None: torch's defaults.
    flags: dict[str, Any] | None = None


@dataclass
class Limits(Message):
    kind: ClassVar[str] = "limits"
    limit_bytes: int | None
    capacity_bytes: int


@dataclass
class End(Message):
    kind: ClassVar[str] = "end"
    message: str
    reason: str


@dataclass
class PageOut(Message):
    kind: ClassVar[str] = "page-out"
    by: str = ""


@dataclass
class PagedOut(Message):
    kind: ClassVar[str] = "paged-out"
    bytes: int | None


@dataclass
class Report(Message):
    kind: ClassVar[str] = "report"
    usage: dict[str, Any]
    memory_bytes: int
    memory_peak_bytes: int
    paged_bytes: int
    #: ``running``, ``queued``, ``waiting-for-memory``, ``paged-out`` or ``idle``.
    state: str
    batches: int
    #: Run directories of spool files written since the last report (``spool:`` sinks).
    dirty: list[str] = field(default_factory=list)
    #: The worker's GPU activity so far (``device_activity.Counts`` as a dict), when it captures.
    gpu_activity: dict[str, int] = field(default_factory=dict)


@dataclass
class Ended(Message):
    kind: ClassVar[str] = "ended"
    reason: str
    message: str = ""


KINDS: dict[str, type[Message]] = {
    cls.kind: cls for cls in (Ready, Assign, Limits, End, PageOut, PagedOut, Report, Ended)
}


def encode(msg: Message) -> bytes:
    body = json.dumps({"kind": msg.kind, **asdict(msg)}, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE:
        raise ValueError(f"a {msg.kind} message of {len(body)} bytes is over {MAX_MESSAGE}")
    return body


def decode(body: bytes) -> Message:
    """The message in ``body``; ``ValueError`` for anything that is not one, named."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("a channel message that is not JSON") from None
    if not isinstance(obj, dict):
        raise ValueError("a channel message that is not an object")
    cls = KINDS.get(str(obj.pop("kind", "")))
    if cls is None:
        raise ValueError("a channel message of no known kind")
    names = {f.name for f in fields(cls)}
    if set(obj) - names:
        raise ValueError(f"a {cls.kind} message with unknown fields")
    try:
        return cls(**obj)
    except TypeError:
        raise ValueError(f"a {cls.kind} message with missing fields") from None


class Channel:
    """One end of a front-worker socket pair: whole messages, and a file descriptor with one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @staticmethod
    def pair() -> tuple[Channel, socket.socket]:
        """The front's channel and the worker's socket (to pass to the worker process)."""
        front, worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        return Channel(front), worker

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: Message, fd: int | None = None) -> None:
        body = encode(msg)
        try:
            if fd is None:
                self.sock.sendall(body)
            else:
                socket.send_fds(self.sock, [body], [fd])
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None

    def recv(self, timeout: float | None = None) -> tuple[Message, int | None]:
        """The next message and the file descriptor it carried (None: none); ``TimeoutError``
        after ``timeout`` seconds, :class:`ChannelClosed` at the other side's end."""
        self.sock.settimeout(timeout)
        try:
            body, fds, flags, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
        except TimeoutError:
            raise
        except OSError as exc:
            raise ChannelClosed(str(exc)) from None
        if not body:
            for fd in fds:
                _close(fd)
            raise ChannelClosed("the other side closed the channel")
        if flags & socket.MSG_TRUNC:
            for fd in fds:
                _close(fd)
            raise ValueError("a channel message longer than its bound")
        try:
            msg = decode(body)
        except ValueError:
            for fd in fds:
                _close(fd)
            raise
        return msg, (fds[0] if fds else None)

    def close(self) -> None:
        self.sock.close()


def _close(fd: int) -> None:
    import os

    with contextlib.suppress(OSError):
        os.close(fd)
