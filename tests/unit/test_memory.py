"""Memory: per-tenant sums of session accounts, quota and capacity decisions, waiters (no torch)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.sharing.memory import Memory, QuotaError, allocator_bytes
from gpu_trace.runtime.sharing.sessions import MemoryAccount
from gpu_trace.runtime.sharing.tenants import Tenant
from gpu_trace.runtime.sharing.usage import Usage

_ids = itertools.count(1)

A = Tenant("a", "token-a-0123456789", memory_bytes=1000, on_quota="wait")
B = Tenant("b", "token-b-0123456789", memory_fraction=0.5)
C = Tenant("c", "token-c-0123456789")  # no quota


def session(tenant: Tenant) -> SimpleNamespace:
    return SimpleNamespace(id=next(_ids), tenant=tenant, account=MemoryAccount(), usage=Usage())


class Clock:
    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        return self.t


@pytest.fixture
def woken() -> list:
    return []


@pytest.fixture
def memory(woken: list) -> Memory:
    m = Memory(4000, wake=woken.append, clock=Clock())
    m.add_tenants([A, B, C])
    return m


def test_allocator_rounding() -> None:
    assert [allocator_bytes(n, 512) for n in (0, 1, 511, 512, 513, 1 << 20)] == [
        0,
        512,
        512,
        512,
        1024,
        1 << 20,
    ]
    assert allocator_bytes(513, 1) == 513


def test_limits_resolve_against_capacity(memory: Memory) -> None:
    snap = memory.snapshot()
    assert snap["a"]["limit_bytes"] == 1000
    assert snap["b"]["limit_bytes"] == 2000
    assert snap["c"]["limit_bytes"] is None
    assert snap["a"] == {
        "used_bytes": 0,
        "resident_bytes": 0,
        "limit_bytes": 1000,
        "peak_bytes": 0,
        "sessions": 0,
        "waiting": 0,
    }


def test_sessions_of_a_tenant_share_its_sum(memory: Memory) -> None:
    s1, s2, other = session(A), session(A), session(B)
    for s in (s1, s2, other):
        memory.attach(s)
    s1.account.charge_bytes(300)
    s2.account.charge_bytes(500)
    other.account.charge_bytes(700)
    snap = memory.snapshot()
    assert snap["a"]["used_bytes"] == 800 and snap["a"]["sessions"] == 2
    assert snap["b"]["used_bytes"] == 700
    assert memory.used_bytes == 1500
    s2.account.charge_bytes(-500)
    assert memory.snapshot()["a"]["used_bytes"] == 300
    assert memory.snapshot()["a"]["peak_bytes"] == 800
    memory.detach(s1)
    assert memory.snapshot()["a"] == {**memory.snapshot()["a"], "used_bytes": 0, "sessions": 1}
    assert memory.used_bytes == 700


def test_quota_refusal_names_used_asked_limit(memory: Memory) -> None:
    s1, s2 = session(A), session(A)
    memory.attach(s1)
    memory.attach(s2)
    s1.account.charge_bytes(600)
    s2.account.charge_bytes(300)
    assert memory.refusal(s2, 100) is None
    r = memory.refusal(s2, 200)
    assert r is not None and (r.kind, r.used, r.asked, r.limit) == ("quota", 900, 200, 1000)
    assert not r.hopeless  # s1 could free
    err = r.error("waited 1 s")
    assert isinstance(err, QuotaError) and isinstance(err, OpError)
    assert "tenant 'a'" in str(err) and "900" in str(err) and "200" in str(err)
    assert "1000" in str(err) and "waited 1 s" in str(err)
    assert err.wire() == {"tenant": "a", "used": 900, "asked": 200, "limit": 1000, "kind": "quota"}


def test_output_already_counted_is_held(memory: Memory) -> None:
    s = session(A)
    memory.attach(s)
    s.account.charge_bytes(900)  # 400 of it is the op's output, checked after it ran
    assert memory.refusal(s, 400, held=400) is None
    s.account.charge_bytes(200)
    r = memory.refusal(s, 600, held=600)
    assert r is not None and r.used == 500 and r.asked == 600


def test_waiting_cannot_help(memory: Memory) -> None:
    alone = session(A)
    memory.attach(alone)
    alone.account.charge_bytes(500)
    r = memory.refusal(alone, 600)
    assert r is not None and "this session alone would hold 1100 bytes" in r.hopeless
    other = session(A)
    memory.attach(other)
    other.account.charge_bytes(100)
    r = memory.refusal(alone, 450)
    assert r is not None and r.hopeless == ""  # the other session could free its 100
    memory.wait(other, "quota", 10)  # a waiting session frees nothing
    r = memory.refusal(alone, 450)
    assert r is not None and "no other session of tenant 'a' holds memory" in r.hopeless


def test_no_quota_is_bounded_by_capacity_only(memory: Memory) -> None:
    s = session(C)
    memory.attach(s)
    assert memory.refusal(s, 4000) is None
    r = memory.refusal(s, 4001)
    assert r is not None and r.kind == "capacity" and r.limit == 4000
    assert "alone would hold 4001 bytes" in r.hopeless


def test_capacity_counts_resident_bytes_and_asks_the_pager() -> None:
    c, b = session(C), session(B)
    calls = []
    pager_ready = False

    def reclaim(need_bytes: int, for_session: object, reason: str) -> int:
        calls.append((need_bytes, for_session, reason))
        if not pager_ready:  # no idle session to page out
            return 0
        b.usage.evicted_bytes = 1500  # paged out: still b's, no longer on the device
        return 1500

    memory = Memory(4000, reclaim=reclaim, clock=Clock())
    memory.add_tenants([A, B, C])
    memory.attach(c)
    memory.attach(b)
    b.account.charge_bytes(1500)
    c.account.charge_bytes(2000)
    r = memory.refusal(c, 1000)
    assert r is not None and r.kind == "capacity" and r.used == 3500 and r.hopeless == ""

    calls.clear()
    pager_ready = True
    assert memory.refusal(c, 1000) is None
    assert calls == [(500, c, "capacity")]
    snap = memory.snapshot()
    assert snap["b"]["used_bytes"] == 1500 and snap["b"]["resident_bytes"] == 0
    # paged-out bytes still count against b's quota
    assert memory.refusal(b, 600).kind == "quota"


def test_waiters_wake_when_their_tenant_frees(memory: Memory, woken: list) -> None:
    s1, s2, other = session(A), session(A), session(B)
    for s in (s1, s2, other):
        memory.attach(s)
    s1.account.charge_bytes(900)
    memory.wait(s2, "quota", 10**9)
    assert memory.snapshot()["a"]["waiting"] == 1 and memory.waiting() == 1
    other.account.charge_bytes(100)
    other.account.charge_bytes(-100)  # another tenant's free does not wake a quota waiter
    assert woken == []
    s1.account.charge_bytes(-400)
    assert woken == [s2]
    memory.resumed(s2)
    assert memory.waiting() == 0


def test_capacity_waiters_wake_on_any_free(memory: Memory, woken: list) -> None:
    c, b = session(C), session(B)
    memory.attach(c)
    memory.attach(b)
    b.account.charge_bytes(100)
    memory.wait(c, "capacity", 10**9)
    b.account.charge_bytes(-100)
    assert woken == [c]


def test_closing_session_wakes_and_leaves(memory: Memory, woken: list) -> None:
    s1, s2 = session(A), session(A)
    memory.attach(s1)
    memory.attach(s2)
    s1.account.charge_bytes(900)
    memory.wait(s2, "quota", 10**9)
    memory.detach(s1)
    assert woken == [s2]
    assert memory.snapshot()["a"]["used_bytes"] == 0
    memory.detach(s2)
    assert memory.waiting() == 0


def test_due_wakes_waits_that_ran_out(memory: Memory, woken: list) -> None:
    s = session(A)
    memory.attach(s)
    memory.wait(s, "quota", 50)
    memory.clock.t = 49
    memory.due()
    assert woken == []
    memory.clock.t = 50
    memory.due()
    assert woken == [s]


def test_account_rounds_to_allocator_blocks() -> None:
    torch = pytest.importorskip("torch")
    m = Memory(1 << 20, block_bytes=512)
    s = session(C)
    m.attach(s)
    t = torch.ones(3)  # 12 bytes
    s.account.charge(t)
    assert s.account.bytes == 512 and m.snapshot()["c"]["used_bytes"] == 512


def test_bad_capacity() -> None:
    with pytest.raises(ValueError):
        Memory(0)
