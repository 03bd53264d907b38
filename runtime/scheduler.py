"""Scheduling: the work items a connection queues and the policy that picks what runs next.

Connections put work (uploads, batches, close) into a :class:`Scheduler`; the executor takes one
item at a time and runs it. Which session goes next is the scheduler's policy: the seam for
sharing (issue #6). :class:`FifoScheduler`, the default, serves work in arrival order.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gpu_trace.runtime.session import Session


@dataclass
class Work:
    """One unit of a session's work, in the order its connection received it."""

    kind: str  # "batch", "put", "put-inline", "chunk", "bye", "close"
    head: Any = None
    data: Any = None
    recv_start_ns: int = 0
    recv_end_ns: int = 0
    done: threading.Event | None = None


class Scheduler(Protocol):
    """The scheduling policy seam: which session's work runs next."""

    def submit(self, session: Session, work: Work) -> None: ...

    def take(self, timeout: float) -> tuple[Session, Work] | None: ...

    def wait(self, timeout: float) -> bool:
        """Wait until some work is queued; False on timeout."""
        ...

    def drop(self, session: Session) -> None: ...

    def depth(self) -> int: ...


class FifoScheduler:
    """Work in arrival order, whatever the session."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Session, Work]] = collections.deque()
        self._cond = threading.Condition()

    def submit(self, session: Session, work: Work) -> None:
        with self._cond:
            self._queue.append((session, work))
            self._cond.notify()

    def take(self, timeout: float) -> tuple[Session, Work] | None:
        with self._cond:
            if not self._queue and timeout > 0:
                self._cond.wait(timeout)
            return self._queue.popleft() if self._queue else None

    def wait(self, timeout: float) -> bool:
        with self._cond:
            if not self._queue:
                self._cond.wait(timeout)
            return bool(self._queue)

    def drop(self, session: Session) -> None:
        with self._cond:
            kept = [(s, w) for s, w in self._queue if s is not session or w.kind == "close"]
            self._queue.clear()
            self._queue.extend(kept)

    def depth(self) -> int:
        return len(self._queue)
