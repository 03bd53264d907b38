"""Ranks of a distributed job read back: how the ranks waited for each other.

Who each process is was recorded by :mod:`gpu_trace.tracer.ranks`. :func:`rank_summary` (``gpu-trace show``'s Ranks and Collectives sections) joins
each collective span (category ``collective``, lane :data:`COLLECTIVE_LANE`) to its rank and
links the ranks' spans of one collective by (process group, sequence number). Definitions
(docs/distributed.md):

- **enter**: a rank's collective span start (the c10d call on the program's thread);
- **skew** of a collective: the last rank's enter minus the first's;
- **wait caused** by the rank that entered last: the sum over the other ranks of the last enter
  minus theirs (what they spent waiting for it);
- **straggler**: the rank that entered last most often (ties: the larger wait caused); every
  rank's times last and wait caused rank them all (``RankStats.entered_last``, ``caused_ns``).

Where each rank's time goes, per step, is :mod:`gpu_trace.query.rank_time`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from gpu_trace.query.rank_time import (
    RankStep,
    StepStraggler,
    kernel_overlap,
    processes,
    rank_steps,
    standing,
    step_stragglers,
)
from gpu_trace.query.summary import Queries
from gpu_trace.tracer.ranks import COLLECTIVE_LANE

# ---- reading: ranks and collectives ----------------------------------------------------------------


# Busy time of each process: the union of its spans' intervals (marks and steps left out).
_BUSY = """
SELECT host, pid, sum(greatest(0, end_ns - greatest(start_ns, if(rn = 1, start_ns, reach)))) AS busy
FROM (
    SELECT host, pid, start_ns, end_ns,
           max(end_ns) OVER (PARTITION BY host, pid ORDER BY start_ns, end_ns
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach,
           row_number() OVER (PARTITION BY host, pid ORDER BY start_ns, end_ns) AS rn
    FROM __db__.spans
    WHERE run_id = {run_id:String} AND category NOT IN ('mark', 'step')
      AND (host, pid) IN ({pids:Array(Tuple(String, UInt32))})
)
GROUP BY host, pid
"""


@dataclass(frozen=True)
class RankStats:
    """One rank: its process (the first one recorded with its rank), where, and how busy."""

    rank: int
    pid: int
    host: str
    local_rank: int | None
    node: int | None
    busy_ns: int
    collectives: int  # its collective calls
    waited_ns: int  # summed over its collectives: the last rank's enter minus its own
    pids: list[int] = field(default_factory=list)  # every process that carried the rank
    entered_last: int = 0  # collectives it entered last (with a skew), the straggler's ranking
    caused_ns: int = 0  # the waiting it caused there: the other ranks' waits summed
    steps: int = 0  # its steps; the figures below are sums over them (see RankStep)
    step_ns: int = 0
    compute_ns: int = 0
    comm_ns: int = 0
    overlap_ns: int = 0
    idle_ns: int = 0
    #: Of its NCCL kernels' time, the share a computation kernel ran beside (HTA's
    #: ``comp_comm_overlap_ratio``, :func:`kernel_overlap`); None without NCCL kernels.
    kernel_overlap: float | None = None


@dataclass(frozen=True)
class CollectiveStats:
    """One kind of collective (``all_reduce``...) over the run."""

    op: str
    count: int  # collectives, each linked across the ranks that took part
    calls: dict[int, int]  # rank -> its calls
    total_ns: int  # every rank's spans summed
    skew_sum_ns: int
    skew_max_ns: int


@dataclass(frozen=True)
class RankSummary:
    """A distributed run's ranks, collectives and straggler (see the module docstring)."""

    world_size: int
    job: str
    backend: str
    ranks: list[RankStats]
    collectives: list[CollectiveStats]
    straggler: int | None  # the rank that entered last most often
    straggler_last: int  # how many collectives it entered last
    straggler_wait_ns: int  # the waiting it caused
    steps: list[RankStep] = field(default_factory=list)  # every rank's steps, by rank and time
    #: Per step in which a rank entered a collective last: who made the others wait most.
    step_stragglers: list[StepStraggler] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        """Plain data for JSON (``show --json``)."""
        out = asdict(self)
        out["collectives"] = [
            {**c, "calls": {str(k): v for k, v in c["calls"].items()}} for c in out["collectives"]
        ]
        out["step_stragglers"] = [
            {**s, "caused": {str(k): v for k, v in s["caused"].items()}}
            for s in out["step_stragglers"]
        ]
        return out


@dataclass(frozen=True)
class CollectiveCall:
    """One rank's part in one collective (``op``, ``pg``, ``seq`` link the ranks' parts): when
    it entered and ended, and how long it waited there for the last rank to enter."""

    op: str
    pg: str
    seq: str
    rank: int
    enter_ns: int
    end_ns: int
    wait_ns: int  # the last rank's enter minus this rank's
    last: bool  # this rank entered last (with a skew: it made the others wait)
    ranks: int  # how many ranks' parts the collective has


def rank_summary(store: Queries, run_id: str) -> RankSummary | None:
    """The ranks of a distributed run and how they waited for each other; None if no process
    of the run carries a rank."""
    procs = processes(store, run_id)
    if not procs:
        return None
    main = standing(procs)
    pids: dict[int, list[int]] = {}
    for p in sorted(procs, key=lambda p: p.pid):
        pids.setdefault(p.rank, []).append(p.pid)
    keys = [(p.host, p.pid) for p in main.values()]
    busy = {
        (str(h), int(pid)): int(b)
        for h, pid, b in store.query(_BUSY, {"run_id": run_id, "pids": keys}).result_rows
    }
    params = {
        "run_id": run_id,
        "procs": [(p.host, p.pid, r) for r, p in main.items()],
        "lane": COLLECTIVE_LANE,
    }
    per_op: dict[str, list[int]] = {}  # op -> [count, total, skew sum, skew max]
    last: dict[int, list[int]] = {}  # rank -> [times last, wait caused]
    lates: list[tuple[int, int, int]] = []  # (late rank, its enter, wait caused) per collective
    for op, n, first, latest, late, total, caused in store.query(_LINKED, params).result_rows:
        got = per_op.setdefault(str(op), [0, 0, 0, 0])
        got[0] += 1
        got[1] += int(total)
        if int(n) > 1:
            skew = int(latest) - int(first)
            got[2] += skew
            got[3] = max(got[3], skew)
            if skew > 0:
                was = last.setdefault(int(late), [0, 0])
                was[0] += 1
                was[1] += int(caused)
                lates.append((int(late), int(latest), int(caused)))
    calls: dict[str, dict[int, int]] = {}
    per_rank: dict[int, list[int]] = {}  # rank -> [calls, waited]
    for op, rank, n, waited in store.query(_PER_RANK, params).result_rows:
        calls.setdefault(str(op), {})[int(rank)] = int(n)
        mine = per_rank.setdefault(int(rank), [0, 0])
        mine[0] += int(n)
        mine[1] += int(waited)
    steps = rank_steps(store, run_id, main)
    overlap = kernel_overlap(store, run_id, main)
    totals: dict[int, list[int]] = {}  # rank -> [steps, step, compute, comm, overlap, idle]
    for s in steps:
        got = totals.setdefault(s.rank, [0] * 6)
        for i, v in enumerate((1, s.step_ns, s.compute_ns, s.comm_ns, s.overlap_ns, s.idle_ns)):
            got[i] += v
    ranks = [
        RankStats(
            rank=r,
            pid=p.pid,
            host=p.host,
            local_rank=p.number("local_rank"),
            node=p.number("node"),
            busy_ns=busy.get((p.host, p.pid), 0),
            collectives=per_rank.get(r, [0, 0])[0],
            waited_ns=per_rank.get(r, [0, 0])[1],
            pids=sorted(pids[r]),
            entered_last=last.get(r, [0, 0])[0],
            caused_ns=last.get(r, [0, 0])[1],
            kernel_overlap=overlap.get(r),
            **dict(zip(_TOTALS, totals.get(r, [0] * 6))),
        )
        for r, p in sorted(main.items())
    ]
    collectives = [
        CollectiveStats(op, v[0], dict(sorted(calls.get(op, {}).items())), v[1], v[2], v[3])
        for op, v in sorted(per_op.items(), key=lambda kv: -kv[1][1])
    ]
    straggler: int | None = None
    times = caused_ns = 0
    if last:
        straggler, (times, caused_ns) = max(last.items(), key=lambda kv: (kv[1][0], kv[1][1]))
    first_rank = main[min(main)]
    worlds = [w for p in main.values() if (w := p.number("world_size")) is not None]
    return RankSummary(
        world_size=max(worlds or [len(main)]),
        job=first_rank.facts.get("job", ""),
        backend=first_rank.facts.get("backend", ""),
        ranks=ranks,
        collectives=collectives,
        straggler=straggler,
        straggler_last=times,
        straggler_wait_ns=caused_ns,
        steps=steps,
        step_stragglers=step_stragglers(steps, lates),
    )


# Every rank's part in every collective, with the collective's last enter and how many took part.
_CALLS = """
SELECT c.op, c.pg, c.seq, c.rank, c.enter, c.enter + c.dur, l.last - c.enter, l.n,
       c.rank = l.late AND l.last > l.first
FROM ({ranked}) AS c
INNER JOIN (SELECT op, pg, seq, max(enter) AS last, min(enter) AS first,
                   argMax(rank, enter) AS late, count() AS n
            FROM ({ranked}) GROUP BY op, pg, seq) AS l
  USING (op, pg, seq)
ORDER BY c.enter, c.rank
"""


def collective_calls(store: Queries, run_id: str) -> list[CollectiveCall]:
    """Every rank's part in every collective of the run, in time order (``Run.collectives()``):
    one row per rank and collective; empty for a run without ranks."""
    main = standing(processes(store, run_id))
    if not main:
        return []
    params = {
        "run_id": run_id,
        "procs": [(p.host, p.pid, r) for r, p in main.items()],
        "lane": COLLECTIVE_LANE,
    }
    rows = store.query(_CALLS.format(ranked=_RANKED), params).result_rows
    return [
        CollectiveCall(str(op), str(pg), str(seq), int(rank), int(enter), int(end), int(wait),
                       bool(late), int(n))
        for op, pg, seq, rank, enter, end, wait, n, late in rows
    ]  # fmt: skip


# The ranks' collective spans, each with its rank (from the processes chosen above).
_RANKED = """
    SELECT s.name AS op, s.attrs['pg'] AS pg, s.attrs['seq'] AS seq, r.rank AS rank,
           s.start_ns AS enter, s.end_ns - s.start_ns AS dur
    FROM __db__.spans AS s
    INNER JOIN (SELECT t.1 AS host, t.2 AS pid, t.3 AS rank
                FROM (SELECT arrayJoin({procs:Array(Tuple(String, UInt32, Int64))}) AS t)) AS r
      ON r.host = s.host AND r.pid = s.pid
    WHERE s.run_id = {run_id:String} AND s.category = 'collective' AND s.lane = {lane:String}
"""

_LINKED = f"""
SELECT op, count() AS n, min(enter) AS first, max(enter) AS last,
       argMax(rank, enter) AS late, sum(dur) AS total, n * max(enter) - sum(enter) AS caused
FROM ({_RANKED}) GROUP BY op, pg, seq
"""

# Per rank and op: its calls, and how long it waited (the last enter minus its own).
_PER_RANK = f"""
SELECT op, rank, count() AS n, sum(last - enter) AS waited
FROM ({_RANKED}) AS c
INNER JOIN (SELECT op, pg, seq, max(enter) AS last FROM ({_RANKED}) GROUP BY op, pg, seq) AS l
  USING (op, pg, seq)
GROUP BY op, rank ORDER BY op, rank
"""


# ---- per step and rank: computation, communication, overlap, idle ----------------------------------

_TOTALS = ("steps", "step_ns", "compute_ns", "comm_ns", "overlap_ns", "idle_ns")
