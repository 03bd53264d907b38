"""Scheduling policies: which session's work the executor runs next.

A policy implements :class:`~gpu_trace.runtime.sharing.scheduler.Policy`: ``pick(ready, now_ns)``
chooses one of the flows (sessions' queues) that have work, ``charged(flow, service_ns,
now_ns)`` hears how much device time an item used, ``forget(flow)`` drops a closed session.
They are pure: no threads, no I/O, time passed in. Strict tenant priority is applied by the
:class:`~gpu_trace.runtime.sharing.scheduler.PolicyScheduler` before ``pick``: a policy only ever
chooses among flows of one priority class.

- ``fifo``: the oldest queued item first, whatever the session.
- ``rr``: sessions take turns, one item each.
- ``fair``: weighted fair share of device time between tenants (start-time fair queueing),
  round robin between one tenant's sessions.
- ``las``: least attained service, discretized into priority queues as in Tiresias (Gu et al.,
  NSDI 2019), with its starvation limit.

``make_policy(name, **options)`` builds one by name (the server's ``--policy``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

from gpu_trace.runtime.sharing.scheduler import FifoPolicy, Flow, Policy

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "FairSharePolicy",
    "FifoPolicy",
    "LasPolicy",
    "RoundRobinPolicy",
    "make_policy",
]

SECOND_NS = 1_000_000_000


def _next_in_turn(flows: Iterable[Flow], last_key: int | None) -> Flow:
    """The flow after ``last_key`` in the cycle of session ids (ids only grow, so a new session
    joins at the end of the cycle)."""
    first: Flow | None = None
    after: Flow | None = None
    for flow in flows:
        if first is None or flow.key < first.key:
            first = flow
        if last_key is not None and flow.key > last_key and (after is None or flow.key < after.key):
            after = flow
    chosen = after if after is not None else first
    assert chosen is not None
    return chosen


class RoundRobinPolicy:
    """Sessions take turns, one item each, in the order of their ids.

    A session that had nothing queued keeps its place in the cycle when it has work again.
    """

    name = "rr"

    def __init__(self) -> None:
        self._last: int | None = None

    def pick(self, ready: list[Flow], now_ns: int) -> Flow:
        flow = _next_in_turn(ready, self._last)
        self._last = flow.key
        return flow

    def charged(self, flow: Flow, service_ns: int, now_ns: int) -> None:
        pass

    def forget(self, flow: Flow) -> None:
        pass


class FairSharePolicy:
    """Weighted fair share of device time between tenants; round robin within a tenant.

    Each tenant has a virtual time: the device time its sessions used divided by its weight.
    The ready tenant with the least virtual time goes next (ties: the one whose session arrived
    first), so over a busy period a tenant of weight 2 gets twice the device time of a tenant of
    weight 1. A tenant that was idle and has work again starts at the virtual time of the last
    tenant served in its priority class, the least among the tenants that stayed busy (start-time
    fair queueing): an idle tenant banks no credit, and cannot lock others out when it returns.
    A tenant's virtual time outlives its sessions (tenants come from the tenants file, so they
    are few), so reconnecting does not reset it.
    """

    name = "fair"

    def __init__(self) -> None:
        self._vtime: dict[str, float] = {}  # tenant -> device ns / weight
        self._floor: dict[int, float] = {}  # priority class -> virtual time of the last pick
        self._last: dict[str, int] = {}  # tenant -> key of its session served last

    def pick(self, ready: list[Flow], now_ns: int) -> Flow:
        floor = self._floor.get(ready[0].priority, 0.0)
        by_tenant: dict[str, list[Flow]] = {}
        for flow in ready:  # in order of arrival, so ties go to the earliest
            by_tenant.setdefault(flow.tenant, []).append(flow)
        best: str | None = None
        for tenant in by_tenant:
            vtime = self._vtime.get(tenant, 0.0)
            if vtime < floor:  # back from idle: no banked credit
                vtime = self._vtime[tenant] = floor
            if best is None or vtime < self._vtime.get(best, 0.0):
                best = tenant
        assert best is not None
        self._vtime.setdefault(best, floor)
        self._floor[ready[0].priority] = self._vtime[best]
        flow = _next_in_turn(by_tenant[best], self._last.get(best))
        self._last[best] = flow.key
        return flow

    def charged(self, flow: Flow, service_ns: int, now_ns: int) -> None:
        self._vtime[flow.tenant] = self._vtime.get(flow.tenant, 0.0) + service_ns / flow.weight

    def forget(self, flow: Flow) -> None:
        if self._last.get(flow.tenant) == flow.key:
            del self._last[flow.tenant]

    def virtual_time(self, tenant: str) -> float:
        """``tenant``'s virtual time (device ns per unit of weight), for tests and listings."""
        return self._vtime.get(tenant, 0.0)


#: Default attained-service thresholds of :class:`LasPolicy`: 1 s, 10 s, 100 s of device time.
LAS_THRESHOLDS_NS = (1 * SECOND_NS, 10 * SECOND_NS, 100 * SECOND_NS)


class LasPolicy:
    """Least attained service, discretized (Tiresias' discretized LAS on one device).

    A session's flow is in queue ``k`` when the device time it attained since it last entered
    the top queue lies between ``thresholds_ns[k-1]`` and ``thresholds_ns[k]``; the defaults,
    1 s, 10 s and 100 s, make four queues. Batches take milliseconds to seconds, so a short
    job or an interactive session (under a second of device time) stays in the top queue, a
    training run sinks within minutes, and flows in one queue are not reordered by every batch.
    The lowest-numbered queue with work goes first; within a queue, the flow that entered it
    first (a new flow enters the top queue when it arrives), so a flow keeps the device until it
    crosses its queue's threshold.

    Starvation (Tiresias' STARVELIMIT): a flow below the top queue that has waited, since it was
    last served or since its work was queued, for ``starve_factor`` times the device time it
    attained since it last entered the top queue is promoted to the top queue and its count
    starts again. ``starve_ns``, if given, is an absolute bound on that wait as well. The wait
    limit grows with what a flow used, so long jobs tolerate longer waits in proportion.
    """

    name = "las"

    def __init__(
        self,
        thresholds_ns: Iterable[int] = LAS_THRESHOLDS_NS,
        starve_factor: float | None = 10.0,
        starve_ns: int | None = None,
    ) -> None:
        thresholds = [int(t) for t in thresholds_ns]
        if any(t <= 0 for t in thresholds) or any(
            b <= a for a, b in zip(thresholds, thresholds[1:])
        ):
            raise ValueError(f"LAS thresholds must be positive and increasing, got {thresholds}")
        if starve_factor is not None and starve_factor <= 0:
            raise ValueError(f"starve_factor must be > 0 or None, got {starve_factor}")
        if starve_ns is not None and starve_ns <= 0:
            raise ValueError(f"starve_ns must be > 0 or None, got {starve_ns}")
        self.thresholds_ns = tuple(thresholds)
        self.starve_factor = starve_factor
        self.starve_ns = starve_ns
        #: Promotions so far (starvation prevention at work).
        self.promotions = 0

    def queue_of(self, flow: Flow) -> int:
        """The queue ``flow`` is in (0 is the top)."""
        return self._state(flow)["q"]

    def _state(self, flow: Flow, attained_ns: int | None = None) -> dict[str, Any]:
        state = flow.state.get("las")
        if state is None:
            if attained_ns is None:
                attained_ns = flow.attained_ns
            state = flow.state["las"] = {
                "q": bisect.bisect_right(self.thresholds_ns, attained_ns),
                "base": 0,  # attained_ns when it last entered the top queue
                "since": flow.arrived_ns,  # when it entered its queue
                "ran": None,  # when its last service ended
            }
        return state

    def _starved(self, flow: Flow, state: dict[str, Any], now_ns: int) -> bool:
        if state["q"] == 0 or state["ran"] is None:
            return False
        waited = now_ns - max(state["ran"], flow.head_ns)
        if self.starve_ns is not None and waited >= self.starve_ns:
            return True
        if self.starve_factor is None:
            return False
        return waited >= self.starve_factor * (flow.attained_ns - state["base"])

    def pick(self, ready: list[Flow], now_ns: int) -> Flow:
        best: Flow | None = None
        best_key: tuple[int, int, int] | None = None
        for flow in ready:
            state = self._state(flow)
            if self._starved(flow, state, now_ns):
                state.update(q=0, base=flow.attained_ns, since=now_ns)
                self.promotions += 1
            key = (state["q"], state["since"], flow.arrived_ns)
            if best_key is None or key < best_key:
                best, best_key = flow, key
        assert best is not None
        return best

    def charged(self, flow: Flow, service_ns: int, now_ns: int) -> None:
        # First seen here (its work ran inline): its queue is what it had before this charge.
        state = self._state(flow, flow.attained_ns - service_ns)
        state["ran"] = now_ns
        q = bisect.bisect_right(self.thresholds_ns, flow.attained_ns - state["base"])
        if q > state["q"]:
            state["q"], state["since"] = q, now_ns

    def forget(self, flow: Flow) -> None:
        pass


#: The policies by name, as ``--policy`` takes them.
POLICIES = ("fifo", "rr", "fair", "las")
#: What the server uses when no policy is named.
DEFAULT_POLICY = "fair"

_CLASSES: dict[str, type] = {
    "fifo": FifoPolicy,
    "rr": RoundRobinPolicy,
    "fair": FairSharePolicy,
    "las": LasPolicy,
}


def make_policy(name: str, **options: Any) -> Policy:
    """The policy called ``name`` (one of :data:`POLICIES`), built with ``options``."""
    cls = _CLASSES.get(name)
    if cls is None:
        raise ValueError(
            f"unknown scheduling policy {name!r}; choose one of: {', '.join(POLICIES)}"
        )
    try:
        return cls(**options)
    except TypeError as exc:  # an option this policy does not take
        raise ValueError(f"scheduling policy {name!r}: {exc}") from None
