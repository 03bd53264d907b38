"""The policy across worker processes, as CPU shares: each worker's nice value.

With ``--isolation process`` every session's work runs in a worker of its own, scheduled by the
operating system, so the server's policy reaches the workers as nice values (the front sets
them, :class:`~gpu_trace.runtime.server.front.Front`):

- a lower priority class runs at nice 10 and more (the kernel then gives it a few percent of a
  CPU that a higher class wants);
- under ``fair`` a smaller weight adds nice steps (each about 1.25x less CPU: weight 2 against 1
  is 3 steps);
- under ``las`` a session sinks as it attains service, Tiresias' discretized queues as nice
  levels: queue 0 (under the first threshold, 1 s of device time by default) adds nothing,
  queue ``k`` adds ``5 + 5k`` (10, 15, 19: about 9x, 28x and 68x less CPU than queue 0 when
  both want it). A session only sinks, so raising a nice is all it takes, which needs no
  privilege. Tiresias' starvation promotion has no counterpart: the kernel never starves a
  niced process, it runs whenever no less-niced one wants the CPU.

Linux keeps a nice value per thread, and a thread takes its creator's when it starts:
:func:`apply_nice` sets every thread of the worker (its executor, torch's pools made while it
stood by), not only its first.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpu_trace.runtime.sharing.policies import LAS_THRESHOLDS_NS

if TYPE_CHECKING:
    from gpu_trace.runtime.sharing.scheduler import PolicyScheduler
    from gpu_trace.runtime.sharing.tenants import Tenant

#: The highest nice value (the least CPU).
MOST_NICE = 19


def las_nice(queue: int) -> int:
    """The nice a session in LAS queue ``queue`` adds (0 is the top queue)."""
    return 0 if queue <= 0 else min(MOST_NICE, 5 + 5 * queue)


def worker_nice(
    tenant: Tenant,
    tenants: Sequence[Tenant],
    scheduler: PolicyScheduler,
    attained_ns: int = 0,
) -> int:
    """The nice value (0-19) of a worker running a session of ``tenant``'s, among ``tenants``,
    whose session has attained ``attained_ns`` of device time so far (see the module's text)."""
    top = max(t.priority for t in tenants)
    nice = 0 if tenant.priority >= top else min(MOST_NICE, 10 + top - tenant.priority)
    policy = scheduler.policy
    if policy.name == "fair":
        heaviest = max(t.weight for t in tenants if t.priority == tenant.priority)
        nice += round(math.log(heaviest / tenant.weight, 1.25))
    elif policy.name == "las":
        thresholds = getattr(policy, "thresholds_ns", LAS_THRESHOLDS_NS)
        nice += las_nice(bisect.bisect_right(thresholds, attained_ns))
    return max(0, min(MOST_NICE, nice))


def apply_nice(pid: int, nice: int) -> int:
    """Set every thread of process ``pid`` to ``nice``; the threads changed. A thread that is
    gone, or that only privilege could lower, is left as it is."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):  # not Linux, or the process is gone
        tids = [pid]
    changed = 0
    for tid in tids:
        with contextlib.suppress(OSError):
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
    return changed
