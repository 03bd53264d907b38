"""The CPU share a worker process gets from its tenant's place in the policy
(runtime/server/cpu_share.py): lower priority classes far behind, weights as nice steps under
``fair``, sessions sinking as they attain service under ``las``; every thread of a worker set."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from gpu_trace.runtime.server.cpu_share import apply_nice, worker_nice
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


@pytest.mark.parametrize(
    ("attained_s", "nice"), [(0, 0), (0.99, 0), (1, 10), (9.9, 10), (10, 15), (100, 19), (1e4, 19)]
)
def test_under_las_a_session_sinks_as_it_attains_service(attained_s: float, nice: int) -> None:
    """Tiresias' queues (1 s, 10 s, 100 s by default) as nice levels 0, 10, 15, 19."""
    tenants = [Tenant(name="a", token="a" * 16), Tenant(name="b", token="b" * 16)]
    scheduler = PolicyScheduler(make_policy("las"))
    assert worker_nice(tenants[0], tenants, scheduler, round(attained_s * 1e9)) == nice


def test_las_levels_add_to_a_lower_class_and_stop_at_19() -> None:
    scheduler = PolicyScheduler(make_policy("las", thresholds_ns=[10**8]))
    low = TENANTS[2]  # priority -3 against the top's 1: nice 14
    assert worker_nice(low, TENANTS, scheduler, 0) == 14
    assert worker_nice(low, TENANTS, scheduler, 10**8) == 19
    assert worker_nice(TENANTS[3], TENANTS, scheduler, 10**8) == 10


def test_other_policies_ignore_attained_service() -> None:
    for policy in ("fair", "fifo", "rr"):
        scheduler = PolicyScheduler(make_policy(policy))
        assert worker_nice(TENANTS[3], TENANTS, scheduler, 10**12) == 0


THREADS = textwrap.dedent(
    """
    import sys, threading, time
    for _ in range(3):
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    print("up", flush=True)
    sys.stdin.read()
    """
)


def test_every_thread_of_a_worker_is_set() -> None:
    """Linux keeps a nice per thread: threads started before the front set the process (a
    worker's executor, torch's pools made while it stood by) must be set too."""
    with subprocess.Popen(
        [sys.executable, "-c", THREADS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "up\n"
            tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
            assert len(tids) == 4
            assert apply_nice(proc.pid, 7) == 4
            assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {7}
            assert apply_nice(proc.pid, 7) == 0  # already so: nothing to change
        finally:
            proc.kill()
