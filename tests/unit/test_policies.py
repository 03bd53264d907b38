"""Scheduling policies, driven through the real PolicyScheduler with a fake clock.

Sessions are small stand-ins with the two attributes the scheduler reads (``id``, ``tenant``);
work items carry their simulated device time in ``head``; the device runs one item at a time and
charges it, as the executor does.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gpu_trace.runtime.sharing.policies import (
    DEFAULT_POLICY,
    POLICIES,
    FairSharePolicy,
    FifoPolicy,
    LasPolicy,
    RoundRobinPolicy,
    make_policy,
)
from gpu_trace.runtime.sharing.scheduler import PolicyScheduler, Work
from gpu_trace.runtime.sharing.tenants import Tenant

MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


@dataclass(eq=False)
class FakeSession:
    id: int
    tenant: Tenant


def session(ident: int, tenant: str = "", weight: float = 1.0, priority: int = 0) -> FakeSession:
    name = tenant or f"t{ident}"
    return FakeSession(ident, Tenant(name=name, token="", weight=weight, priority=priority))


class Device:
    """A simulated device: items run one at a time, each for its ``head`` nanoseconds."""

    def __init__(self, policy: object) -> None:
        self.clock = Clock()
        self.sched = PolicyScheduler(policy, clock=self.clock)  # type: ignore[arg-type]
        self.served: list[int] = []  # session ids, in the order their items ran
        self.service: dict[int, int] = {}

    def submit(self, s: FakeSession, items: int = 1, service_ns: int = MS) -> None:
        for _ in range(items):
            self.sched.submit(s, Work("batch", head=service_ns))

    def step(self) -> int | None:
        got = self.sched.take(0)
        if got is None:
            return None
        s, work = got
        self.clock.now += work.head
        self.sched.charge(s, work.head)
        self.served.append(s.id)
        self.service[s.id] = self.service.get(s.id, 0) + work.head
        return s.id

    def run(self, steps: int | None = None) -> list[int]:
        start = len(self.served)
        while steps is None or len(self.served) - start < steps:
            if self.step() is None:
                break
        return self.served[start:]


# ---- FIFO and round robin --------------------------------------------------------------------


def _a_a_b(policy: object) -> list[int]:
    dev = Device(policy)
    a, b = session(1), session(2)
    dev.submit(a)
    dev.clock.now = 1
    dev.submit(a)
    dev.clock.now = 2
    dev.submit(b)
    return dev.run()


def test_fifo_serves_items_in_arrival_order_whatever_the_session() -> None:
    assert _a_a_b(FifoPolicy()) == [1, 1, 2]


def test_round_robin_alternates_sessions_one_item_each() -> None:
    assert _a_a_b(RoundRobinPolicy()) == [1, 2, 1]
    dev = Device(RoundRobinPolicy())
    a, b, c = session(1), session(2), session(3)
    dev.submit(a, 3)
    dev.submit(b, 3)
    dev.submit(c, 1)
    assert dev.run() == [1, 2, 3, 1, 2, 1, 2]


def test_round_robin_turn_moves_when_a_session_runs_alone() -> None:
    dev = Device(RoundRobinPolicy())
    a, b = session(1), session(2)
    dev.submit(b)
    assert dev.run() == [2]
    dev.submit(a, 2)
    dev.submit(b, 2)
    # b just had its turn, so a goes first.
    assert dev.run() == [1, 2, 1, 2]


# ---- fair share ------------------------------------------------------------------------------


def test_fair_share_gives_tenants_device_time_in_proportion_to_weight() -> None:
    dev = Device(FairSharePolicy())
    heavy = session(1, "heavy", weight=2.0)
    light = session(2, "light", weight=1.0)
    # Item sizes differ, so counting items (round robin) would give heavy 3/4 of the time.
    dev.submit(heavy, 400, service_ns=3 * MS)
    dev.submit(light, 400, service_ns=1 * MS)
    dev.run(300)
    total = dev.service[1] + dev.service[2]
    assert abs(dev.service[1] / total - 2 / 3) < 0.01
    # Within one item of the ideal virtual time of each.
    policy = dev.sched.policy
    assert isinstance(policy, FairSharePolicy)
    assert abs(policy.virtual_time("heavy") - policy.virtual_time("light")) <= 3 * MS


def test_fair_share_round_robins_between_one_tenants_sessions() -> None:
    dev = Device(FairSharePolicy())
    a1, a2 = session(1, "a"), session(2, "a")
    b = session(3, "b")
    dev.submit(a1, 4)
    dev.submit(a2, 4)
    dev.submit(b, 8)
    order = dev.run(8)
    assert order.count(3) == 4  # tenant b gets half, not a third
    assert [s for s in order if s != 3] == [1, 2, 1, 2]


def test_fair_share_banks_no_credit_for_an_idle_tenant() -> None:
    dev = Device(FairSharePolicy())
    busy, idle = session(1, "busy"), session(2, "idle")
    dev.submit(busy, 200)
    dev.run(100)  # busy alone for 100 items: idle used nothing meanwhile
    dev.submit(idle, 100)
    order = dev.run(20)
    # It starts even with the busy tenant: alternation, not 20 items in a row to catch up.
    assert 9 <= order.count(2) <= 11
    assert order[:4].count(1) >= 1


def test_fair_share_no_credit_after_a_pause_mid_run() -> None:
    dev = Device(FairSharePolicy())
    a, b = session(1, "a"), session(2, "b")
    dev.submit(a, 300)
    dev.submit(b, 10)
    dev.run(20)  # both busy, then b runs dry
    dev.run(50)  # a alone
    dev.submit(b, 50)
    order = dev.run(20)
    assert 9 <= order.count(2) <= 11


def test_fair_share_keeps_a_tenants_lead_across_sessions() -> None:
    """A tenant that used more cannot reset its virtual time by reconnecting."""
    dev = Device(FairSharePolicy())
    a_old, b = session(1, "a"), session(2, "b")
    dev.submit(a_old, 10, service_ns=10 * MS)
    dev.submit(b, 1)
    dev.run()  # a used 100 ms, b 1 ms
    dev.sched.forget(a_old)
    a_new = session(3, "a")
    dev.submit(a_new, 5)
    dev.submit(b, 50)
    order = dev.run(20)
    # b was idle, so it starts at the virtual time of a's last item (90 ms), not at its own 1 ms;
    # a keeps its 10 ms lead: b runs ten items in a row, then they alternate.
    assert order[:10] == [2] * 10
    assert order[10:].count(3) == 5


# ---- least attained service ------------------------------------------------------------------


def las(**options: object) -> LasPolicy:
    options.setdefault("thresholds_ns", (10 * MS, 100 * MS))
    options.setdefault("starve_factor", None)
    return LasPolicy(**options)  # type: ignore[arg-type]


def test_las_prefers_less_attained_service_but_keeps_fifo_within_a_queue() -> None:
    dev = Device(las())
    old, new = session(1), session(2)
    dev.submit(old, 20)
    dev.run(5)  # old: 5 ms, still in the top queue
    dev.submit(new, 5)
    # Both in the top queue: old entered it first and keeps the device until 10 ms.
    # Then old is in queue 1 and new, with less service, goes first.
    assert dev.run() == [1] * 5 + [2] * 5 + [1] * 10
    policy = dev.sched.policy
    assert isinstance(policy, LasPolicy)
    assert policy.queue_of(dev.sched.flows()[0]) == 1


def test_las_orders_a_queue_by_when_flows_entered_it_not_by_arrival() -> None:
    def first_after(charges: list[FakeSession]) -> int:
        dev = Device(las())
        early, late = session(1), session(2)
        dev.submit(early)
        dev.clock.now = 1
        dev.submit(late)
        for s in charges:  # each crosses 10 ms: into queue 1, at this time
            dev.clock.now += 1
            dev.sched.charge(s, 20 * MS)
        return dev.run()[0]

    assert first_after([session(1), session(2)]) == 1
    assert first_after([session(2), session(1)]) == 2


def test_las_promotes_a_starved_flow_to_the_top_queue() -> None:
    def when_old_runs(starve_factor: float | None) -> int:
        dev = Device(las(thresholds_ns=(10 * MS,), starve_factor=starve_factor))
        old = session(1)
        dev.submit(old, 1, service_ns=20 * MS)
        dev.run()  # 20 ms attained: queue 1
        dev.submit(old, 3)
        # A stream of short new sessions, one arriving every 5 ms, each with 5 ms of work.
        for ident in range(2, 42):
            dev.submit(session(ident), 1, service_ns=5 * MS)
            dev.step()
            if dev.served[-1] == 1:
                return dev.clock.now
        dev.run()
        return dev.clock.now if dev.served[-1] == 1 else -1

    promoted = when_old_runs(2.0)
    # Waited 2 x 20 ms (its attained service since it entered the top queue), then promoted.
    assert 0 < promoted <= 20 * MS + 2 * 20 * MS + 2 * 5 * MS + MS
    # Without the starvation limit it waits for the whole stream.
    assert when_old_runs(None) > 20 * MS + 40 * 5 * MS


def test_las_absolute_starve_limit() -> None:
    dev = Device(las(thresholds_ns=(10 * MS,), starve_ns=12 * MS))
    old = session(1)
    dev.submit(old, 1, service_ns=1000 * MS)
    dev.run()
    dev.submit(old, 1)
    order = []
    for ident in range(2, 10):
        dev.submit(session(ident), 1, service_ns=5 * MS)
        order.append(dev.step())
    assert 1 in order[:4]
    assert isinstance(dev.sched.policy, LasPolicy)
    assert dev.sched.policy.promotions == 1


def test_las_rejects_bad_thresholds() -> None:
    with pytest.raises(ValueError, match="increasing"):
        LasPolicy(thresholds_ns=(10, 5))
    with pytest.raises(ValueError, match="starve_factor"):
        LasPolicy(starve_factor=0)


# ---- what the scheduler does around the policy ---------------------------------------------


@pytest.mark.parametrize("name", POLICIES)
def test_strict_priority_comes_before_any_policy(name: str) -> None:
    dev = Device(make_policy(name))
    low = session(1, "low", priority=0)
    high = session(2, "high", priority=1)
    dev.submit(low, 3)
    dev.clock.now = 1
    dev.submit(high, 3)
    assert dev.run() == [2, 2, 2, 1, 1, 1]


@pytest.mark.parametrize("name", POLICIES)
def test_park_holds_work_until_unpark(name: str) -> None:
    dev = Device(make_policy(name))
    a, b = session(1), session(2)
    dev.submit(a, 2)
    dev.submit(b, 1)
    dev.sched.park(a)
    assert dev.sched.parked() == [a]
    assert dev.sched.depth() == 1
    assert dev.sched.queued(a) == 2
    assert dev.run() == [2]
    assert dev.sched.take(0) is None
    assert not dev.sched.wait(0)
    dev.sched.unpark(a)
    assert dev.sched.parked() == []
    assert dev.run() == [1, 1]


def test_a_parked_sessions_close_is_still_taken() -> None:
    sched = PolicyScheduler(make_policy("fair"), clock=Clock())
    a = session(1)
    sched.park(a)
    sched.submit(a, Work("batch"))
    assert sched.take(0) is None
    sched.drop(a)  # the connection ended: its work goes, a close follows
    sched.submit(a, Work("close"))
    got = sched.take(0)
    assert got is not None and got[0] is a and got[1].kind == "close"
    # And a close behind queued work of a parked session still waits its turn in that queue.
    b = session(2)
    sched.submit(b, Work("batch"))
    sched.park(b)
    sched.submit(b, Work("close"))
    assert sched.take(0) is None
    sched.drop(b)
    got = sched.take(0)
    assert got is not None and got[1].kind == "close"


def test_requeue_puts_work_back_at_the_head_with_its_place_in_line() -> None:
    dev = Device(FifoPolicy())
    a, b = session(1), session(2)
    dev.sched.submit(a, Work("batch", head="a1"))
    dev.clock.now = 1
    dev.sched.submit(b, Work("batch", head="b1"))
    dev.clock.now = 2
    dev.sched.submit(a, Work("batch", head="a2"))
    got = dev.sched.take(0)
    assert got is not None and got[1].head == "a1"
    dev.sched.requeue(a, got[1])  # parked part-way, resumed later
    heads = []
    while (got := dev.sched.take(0)) is not None:
        heads.append(got[1].head)
    assert heads == ["a1", "b1", "a2"]


def test_drop_keeps_only_a_close_and_forget_drops_the_flow() -> None:
    dev = Device(make_policy("las"))
    a, b = session(1), session(2)
    dev.submit(a, 3)
    dev.submit(b, 1)
    dev.sched.charge(a, 5 * MS)
    dev.sched.drop(a)
    assert dev.sched.queued(a) == 0
    assert dev.sched.depth() == 1
    dev.sched.forget(a)
    assert [f.key for f in dev.sched.flows()] == [2]
    dev.submit(a, 1)  # a session id coming back is a new flow, with nothing attained
    assert {f.key: f.attained_ns for f in dev.sched.flows()}[1] == 0
    assert sorted(dev.run()) == [1, 2]


def test_device_time_of_work_run_inline_is_charged() -> None:
    """The executor runs a lone batch without queueing it; its device time still counts."""
    sched = PolicyScheduler(make_policy("las"), clock=Clock())
    a = session(1)
    sched.charge(a, 7 * MS)
    assert [(f.key, f.attained_ns) for f in sched.flows()] == [(1, 7 * MS)]
    assert sched.depth() == 0


# ---- by name ---------------------------------------------------------------------------------


def test_make_policy_by_name() -> None:
    assert POLICIES == ("fifo", "rr", "fair", "las")
    assert DEFAULT_POLICY in POLICIES
    for name in POLICIES:
        assert make_policy(name).name == name
    policy = make_policy("las", thresholds_ns=(5 * MS,), starve_factor=3.0)
    assert isinstance(policy, LasPolicy) and policy.thresholds_ns == (5 * MS,)


def test_make_policy_bad_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'lottery'.*fifo, rr, fair, las"):
        make_policy("lottery")
    with pytest.raises(ValueError, match="'rr'"):
        make_policy("rr", quantum=3)
