"""Connections that have not authenticated yet: bounded in number and in time, apart from sessions.

Every connection costs the server a socket and a reader thread
(:mod:`gpu_trace.runtime.server.server`) from the moment it is accepted. Left unbounded, peers that
connect and say nothing, or trickle a byte now and then (slowloris), hold those until the server has
room for no one else. So:

- At most :attr:`Handshakes.limit` connections are in their handshake (accepted, no WELCOME yet)
  at once. A connection accepted at the limit ends the oldest pending handshake of the peer
  address that has the most of them, rather than being refused itself: a real client
  authenticates in one round trip, so a peer holding every slot cannot keep it out (from another
  address, never; from its own, only by opening more connections within that round trip than
  the client has), while refusing new connections would keep everyone out until the squatters'
  deadlines passed.
- Each handshake has a deadline, :attr:`Handshakes.timeout_s` after its accept. It is absolute:
  bytes trickling in do not extend it
  (:meth:`~gpu_trace.runtime.protocol.wire.FrameReader.read_by`).
- Sessions are bounded separately (``max_sessions``); an authenticated connection is out of
  these counts.

What ends a handshake early (room made, a deadline passed, a refusal such as a wrong token) is
counted and logged at most once per :attr:`Handshakes.log_every_s`, one line with the counts:
a flood of connections must not become a flood of log lines.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import threading
import time
from collections import Counter

log = logging.getLogger(__name__)

#: Seconds between two log lines about handshakes that ended early.
LOG_EVERY_S = 10.0


class Handshakes:
    """The connections in their handshake, oldest first, with their deadlines."""

    def __init__(self, limit: int, timeout_s: float, log_every_s: float = LOG_EVERY_S) -> None:
        if type(limit) is not int or limit < 1:
            raise ValueError(f"the handshake limit must be a positive integer, got {limit!r}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"the handshake timeout must be a positive number, got {timeout_s!r}")
        self.limit = limit
        self.timeout_s = float(timeout_s)
        self.log_every_s = log_every_s
        #: Handshakes ended early since the server started, by why (``room``, ``timeout``...).
        self.ended: Counter[str] = Counter()
        self._pending: dict[socket.socket, str] = {}  # peer host; insertion order: oldest first
        self._lock = threading.Lock()
        self._unlogged: Counter[str] = Counter()
        self._logged_at = -math.inf
        self._timer: threading.Timer | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def begin(self, conn: socket.socket, host: str = "") -> float:
        """Count ``conn`` from ``host`` in (at the limit, ending the oldest handshake of the host
        with the most); its deadline."""
        with self._lock:
            if len(self._pending) >= self.limit:
                by_host = Counter(self._pending.values())
                most = max(by_host.values())
                # The oldest connection of a host with the most (dicts keep insertion order).
                oldest = next(c for c, h in self._pending.items() if by_host[h] == most)
                del self._pending[oldest]
                with contextlib.suppress(OSError):  # its thread sees the socket shut and ends
                    oldest.shutdown(socket.SHUT_RDWR)
                self._count("room")
            self._pending[conn] = host
        return time.monotonic() + self.timeout_s

    def done(self, conn: socket.socket) -> bool:
        """``conn`` is out of its handshake (authenticated, or gone); whether it was in it."""
        with self._lock:
            return self._pending.pop(conn, None) is not None

    def failed(self, why: str) -> None:
        """Count a handshake that ended early: ``timeout``, ``refused``, ``protocol``..."""
        with self._lock:
            self._count(why)

    def flush(self) -> None:
        """Log what is counted and not logged yet (at close)."""
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._log()

    def _count(self, why: str) -> None:  # under _lock
        self.ended[why] += 1
        self._unlogged[why] += 1
        wait = self._logged_at + self.log_every_s - time.monotonic()
        if wait <= 0:
            self._log()
        elif self._timer is None:  # the line comes when the interval is over
            self._timer = threading.Timer(wait, self._on_timer)
            self._timer.daemon = True
            self._timer.start()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            self._log()

    def _log(self) -> None:  # under _lock
        if not self._unlogged:
            return
        parts = [f"{n} {_WHY.get(why, why)}" for why, n in sorted(self._unlogged.items())]
        log.warning(
            "gpu-trace serve: connections ended before authenticating: %s (%d of at most %d "
            "pending now, %g s each)",
            ", ".join(parts),
            len(self._pending),
            self.limit,
            self.timeout_s,
        )
        self._unlogged.clear()
        self._logged_at = time.monotonic()


_WHY = {
    "room": "to make room for newer ones",
    "timeout": "past the handshake deadline",
    "refused": "refused (wrong token, full server...)",
    "protocol": "with a malformed handshake",
    "accept": "not accepted (accept failed: out of file descriptors or memory)",
}

__all__ = ["Handshakes"]
