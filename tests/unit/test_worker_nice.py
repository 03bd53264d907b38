"""The CPU share a worker process gets from its tenant's place in the policy
(runtime/server/front.py, ``worker_nice``): lower priority classes far behind, weights as nice
steps under ``fair``."""

from __future__ import annotations

import pytest

from gpu_trace.runtime.server.front import worker_nice
from gpu_trace.runtime.sharing.policies import make_policy
from gpu_trace.runtime.sharing.scheduler import PolicyScheduler
from gpu_trace.runtime.sharing.tenants import Tenant

TENANTS = [
    Tenant(name="a", token="a" * 16, weight=2.0),
    Tenant(name="b", token="b" * 16, weight=1.0),
    Tenant(name="c", token="c" * 16, priority=-3),
    Tenant(name="d", token="d" * 16, priority=1),
]


@pytest.mark.parametrize(
    ("policy", "nice"),
    [("fair", {"a": 11, "b": 14, "c": 14, "d": 0}), ("fifo", {"a": 11, "b": 11, "c": 14, "d": 0})],
)
def test_worker_nice(policy: str, nice: dict[str, int]) -> None:
    scheduler = PolicyScheduler(make_policy(policy))
    assert {t.name: worker_nice(t, TENANTS, scheduler) for t in TENANTS} == nice


def test_one_class_of_equal_weights_runs_at_nice_0() -> None:
    tenants = [Tenant(name="a", token="a" * 16), Tenant(name="b", token="b" * 16)]
    scheduler = PolicyScheduler(make_policy("fair"))
    assert [worker_nice(t, tenants, scheduler) for t in tenants] == [0, 0]
