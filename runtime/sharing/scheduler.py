"""Scheduling: the work items connections queue, and which session's work runs next.

Connections put work (uploads, batches, close) into the :class:`Scheduler`; the executor takes
one item at a time and runs it. Each session has its own queue (:class:`Flow`), served in
order; which session goes next is chosen by a policy (:mod:`gpu_trace.runtime.sharing.policies`)
among the sessions that have work and are not parked, within the highest tenant priority that has
any. The executor tells the scheduler how much device time each item used (:meth:`charge`),
which is what least-attained-service and fair-share policies decide by. A session waiting for
memory is parked (:meth:`park`): its work stays queued, and other sessions run, until
:meth:`unpark`.

Nothing here touches torch or sockets, and time comes from ``clock``, so the same object runs
under the real server and under the replay benchmark's simulated clock.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from gpu_trace.runtime.sharing.memory import Refusal
    from gpu_trace.runtime.sharing.sessions import Session


@dataclass(slots=True)
class Wait:
    """A batch or upload waiting for memory: when it began, until when, and what refused it."""

    t0: int  # perf_counter ns, for the waited time reported
    deadline: int  # the memory clock's ns, past which the wait fails
    refusal: Refusal | None = None


@dataclass(slots=True)
class Parked:
    """What a batch parked part-way (waiting for memory) keeps, to go on where it stopped.

    ``index``: the op it stopped at (-1 until it parks at an op); ``freed_early``: the batch's
    ``free`` list was already freed early, once; ``wait``: the wait in progress, if any;
    ``threads``: ``(op spans recorded so far, OS thread id)`` at each park (the batch may go on
    on another thread: its ops' CUDA calls are found on the thread that ran them).
    """

    index: int = -1
    exec_start: int = 0
    results: dict[str, Any] = field(default_factory=dict)
    op_spans: list[tuple[str, int, int]] = field(default_factory=list)
    execute_id: int = 0
    freed_early: bool = False
    wait: Wait | None = None
    threads: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Work:
    """One unit of a session's work, in the order its connection received it."""

    kind: str  # "batch", "put", "put-inline", "chunk", "bye", "close"
    head: Any = None
    data: Any = None
    recv_start_ns: int = 0
    recv_end_ns: int = 0
    done: threading.Event | None = None
    #: When the scheduler queued it (the scheduler's clock); -1: never queued (ran inline).
    enqueued_ns: int = -1
    #: Work parked part-way (waiting for memory) keeps its progress here (None: not parked).
    resume: Parked | None = None


@dataclass(eq=False)
class Flow:
    """One session's queue and the numbers a policy decides by.

    ``attained_ns`` is the device time the session has used; ``arrived_ns`` when it first
    queued work; ``head_ns`` when the work at the head of its queue was queued. Policies may
    keep their own state in ``state``.
    """

    key: int
    tenant: str
    weight: float
    priority: int
    session: Session
    queue: collections.deque[Work] = field(default_factory=collections.deque)
    attained_ns: int = 0
    arrived_ns: int = 0
    head_ns: int = 0
    last_served_ns: int = 0
    parked: bool = False
    state: dict[str, Any] = field(default_factory=dict)

    def ready(self) -> bool:
        """Has work the executor may take now (a parked session's ``close`` still runs)."""
        if not self.queue:
            return False
        return not self.parked or self.queue[0].kind == "close"


class Policy(Protocol):
    """Chooses the next flow to serve. Pure: no threads, no I/O, time passed in."""

    name: str

    def pick(self, ready: list[Flow], now_ns: int) -> Flow:
        """One of ``ready`` (non-empty, all of one priority class, in order of arrival).

        Called for every item taken, also when only one flow is ready.
        """
        ...

    def charged(self, flow: Flow, service_ns: int, now_ns: int) -> None:
        """``flow`` used ``service_ns`` of device time (already added to ``attained_ns``)."""
        ...

    def forget(self, flow: Flow) -> None:
        """``flow``'s session is gone."""
        ...


class Scheduler(Protocol):
    """What the server and executor need from a scheduler."""

    def submit(self, session: Session, work: Work) -> None: ...

    def take(self, timeout: float) -> tuple[Session, Work] | None: ...

    def wait(self, timeout: float) -> bool:
        """Wait until some work may be taken; False on timeout."""
        ...

    def drop(self, session: Session) -> None: ...

    def depth(self) -> int: ...


class FifoPolicy:
    """The oldest queued work first, whatever the session."""

    name = "fifo"

    def pick(self, ready: list[Flow], now_ns: int) -> Flow:
        return min(ready, key=lambda f: f.head_ns)

    def charged(self, flow: Flow, service_ns: int, now_ns: int) -> None:
        pass

    def forget(self, flow: Flow) -> None:
        pass


class PolicyScheduler:
    """Per-session queues served by a :class:`Policy` (FIFO by default)."""

    def __init__(
        self, policy: Policy | None = None, clock: Callable[[], int] = time.monotonic_ns
    ) -> None:
        self.policy: Policy = policy if policy is not None else FifoPolicy()
        self.clock = clock
        self._flows: dict[int, Flow] = {}
        self._cond = threading.Condition()
        self._ready = 0  # items take() could return now

    # ---- queueing --------------------------------------------------------------------------------

    def _flow(self, session: Session) -> Flow:
        flow = self._flows.get(session.id)
        if flow is None:
            tenant = getattr(session, "tenant", None)
            flow = self._flows[session.id] = Flow(
                key=session.id,
                tenant=getattr(tenant, "name", "default"),
                weight=float(getattr(tenant, "weight", 1.0)),
                priority=int(getattr(tenant, "priority", 0)),
                session=session,
                arrived_ns=self.clock(),
            )
        return flow

    def _recount(self) -> None:
        self._ready = sum(len(f.queue) for f in self._flows.values() if f.ready())

    def submit(self, session: Session, work: Work) -> None:
        with self._cond:
            flow = self._flow(session)
            work.enqueued_ns = self.clock()
            if not flow.queue:
                flow.head_ns = work.enqueued_ns
            flow.queue.append(work)
            self._recount()
            if self._ready:
                self._cond.notify()

    def requeue(self, session: Session, work: Work) -> None:
        """Put ``work`` back at the head of its session's queue (a batch resumed later)."""
        with self._cond:
            flow = self._flow(session)
            if work.enqueued_ns < 0:  # ran inline, never queued: it arrived now
                work.enqueued_ns = self.clock()
            flow.queue.appendleft(work)
            flow.head_ns = work.enqueued_ns
            self._recount()
            if self._ready:
                self._cond.notify()

    def take(self, timeout: float) -> tuple[Session, Work] | None:
        with self._cond:
            if not self._ready and timeout > 0:
                self._cond.wait(timeout)
            if not self._ready:
                return None
            ready = [f for f in self._flows.values() if f.ready()]
            top = max(f.priority for f in ready)
            ready = [f for f in ready if f.priority == top]
            now = self.clock()
            # The policy sees every decision, a lone flow's too: fair share's virtual time and
            # round robin's turn move with what was served, not only with contested picks.
            flow = self.policy.pick(ready, now)
            work = flow.queue.popleft()
            flow.last_served_ns = now
            if flow.queue:
                flow.head_ns = flow.queue[0].enqueued_ns
            self._recount()
            return flow.session, work

    def wait(self, timeout: float) -> bool:
        with self._cond:
            if not self._ready:
                self._cond.wait(timeout)
            return bool(self._ready)

    def depth(self) -> int:
        return self._ready

    def queued(self, session: Session) -> int:
        """Items queued for ``session`` (parked or not)."""
        with self._cond:
            flow = self._flows.get(session.id)
            return len(flow.queue) if flow is not None else 0

    # ---- what the executor tells it --------------------------------------------------------------

    def charge(self, session: Session, service_ns: int) -> None:
        """``session`` used ``service_ns`` of device time."""
        if service_ns <= 0:
            return
        with self._cond:
            # A session whose work ran inline (nothing queued) may have no flow yet; its device
            # time counts all the same. Its ``close`` always comes through here and forgets it.
            flow = self._flow(session)
            flow.attained_ns += service_ns
            self.policy.charged(flow, service_ns, self.clock())

    def park(self, session: Session) -> None:
        """Hold ``session``'s work (it waits for memory) until :meth:`unpark`."""
        with self._cond:
            self._flow(session).parked = True
            self._recount()

    def unpark(self, session: Session) -> None:
        with self._cond:
            flow = self._flows.get(session.id)
            if flow is not None and flow.parked:
                flow.parked = False
                self._recount()
                if self._ready:
                    self._cond.notify()

    def parked(self) -> list[Session]:
        with self._cond:
            return [f.session for f in self._flows.values() if f.parked]

    def drop(self, session: Session) -> None:
        """Forget ``session``'s queued work, except a ``close``; its flow goes when that runs."""
        with self._cond:
            flow = self._flows.get(session.id)
            if flow is None:
                return
            kept = [w for w in flow.queue if w.kind == "close"]
            flow.queue.clear()
            flow.queue.extend(kept)
            if kept:
                flow.head_ns = kept[0].enqueued_ns
            flow.parked = False
            self._recount()

    def forget(self, session: Session) -> None:
        """``session`` is closed: drop its flow and the policy's state for it."""
        with self._cond:
            flow = self._flows.pop(session.id, None)
            if flow is not None:
                self.policy.forget(flow)
            self._recount()

    def flows(self) -> list[Flow]:
        """The flows, for accounting and the admin listing (copies of the numbers)."""
        with self._cond:
            return list(self._flows.values())
