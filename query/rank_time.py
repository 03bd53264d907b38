"""Where each rank's time goes: the process standing for each rank, and per step its
computation, communication, their overlap and idle time; the share of its NCCL kernels' time a
computation kernel ran beside (HTA's overlap); per step, the rank that made the others wait.

Per step and rank (:func:`rank_steps`, :class:`RankStep`, in
:func:`~gpu_trace.query.distributed.rank_summary`'s ``steps``;
a rank's steps are its own process's ``step`` spans, ``ProfilerStep#N``), each figure the time
within the step covered by:

- **computation**: the rank's ``op`` and ``module`` spans (CPU: what torch ran) and its kernels
  not named ``nccl`` (GPU); a span inside which its thread entered a collective (``backward``
  around DDP's all-reduce: it holds the rank's wait) counts only outside that thread's collective
  calls, while the spans that hold none (each layer's backward, the ops) count whole;
- **communication**: the rank's collective calls (lane :data:`COLLECTIVE_LANE`, enter to the
  backend's end) and its NCCL kernels;
- **overlap**: both at once (computation while a collective is in flight: DDP's backward of the
  next layers while a bucket's all-reduce runs, or a compute kernel beside an NCCL kernel);
- **idle**: neither: the step minus the union of both.

So ``compute + comm - overlap + idle == step`` exactly, in integer ns, per step and in the
per-rank totals (sums over the rank's steps).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpu_trace.query.summary import Queries
from gpu_trace.tracer.ranks import COLLECTIVE_LANE

# One process per rank: the one whose facts came from torch.distributed, else the first pid.
_PROCESSES = """
SELECT host, pid, any(process_attrs) AS facts
FROM __db__.threads FINAL
WHERE run_id = {run_id:String} AND process_attrs['rank'] != ''
GROUP BY host, pid ORDER BY host, pid
"""


@dataclass(frozen=True)
class RankStep:
    """One step of one rank: its computation, communication, their overlap and its idle time
    (the module docstring defines them; ``compute + comm - overlap + idle == step_ns``)."""

    rank: int
    step: int  # the rank's i-th step, in time order (steps of two ranks are matched by it)
    name: str  # as recorded: ProfilerStep#N
    start_ns: int
    step_ns: int
    compute_ns: int
    comm_ns: int
    overlap_ns: int
    idle_ns: int


@dataclass(frozen=True)
class StepStraggler:
    """One step (the ranks' i-th, matched by order) and the rank that made the others wait most
    in it: the collectives whose last enter fell in that rank's step, the waiting they caused
    (``caused``: per rank, every rank's wait caused in the step, for the ranking)."""

    step: int
    rank: int
    entered_last: int
    caused_ns: int
    caused: dict[int, int]  # rank -> wait it caused in this step


@dataclass(frozen=True)
class Process:
    """A recorded process with a rank: where it ran and its facts (:data:`KEYS`, strings)."""

    host: str
    pid: int
    facts: dict[str, str]

    @property
    def rank(self) -> int:
        return int(self.facts["rank"])

    def number(self, key: str) -> int | None:
        """Fact ``key`` as an int, None if absent or not a number."""
        value = self.facts.get(key, "")
        return int(value) if value.isdigit() else None


def processes(store: Queries, run_id: str) -> list[Process]:
    """Every recorded process of the run whose facts have a rank."""
    rows = store.query(_PROCESSES, {"run_id": run_id}).result_rows
    out = [Process(str(h), int(p), {str(k): str(v) for k, v in f.items()}) for h, p, f in rows]
    return [p for p in out if p.facts.get("rank", "").isdigit()]


def standing(procs: Iterable[Process]) -> dict[int, Process]:
    """The process standing for each rank: the one whose facts came from torch.distributed,
    else the one of the lowest pid."""
    main: dict[int, Process] = {}
    for p in sorted(procs, key=lambda p: (p.facts.get("source") != "torch", p.pid)):
        main.setdefault(p.rank, p)
    return main


def step_stragglers(
    steps: list[RankStep], lates: Iterable[tuple[int, int, int]]
) -> list[StepStraggler]:
    """Per step, the rank that made the others wait most: each collective's wait is counted in
    the step of the rank that entered it last, the one its enter falls in (``lates``: late rank,
    its enter, the wait caused); steps of the ranks are matched by order (``RankStep.step``)."""
    starts: dict[int, list[RankStep]] = {}
    for s in steps:
        starts.setdefault(s.rank, []).append(s)
    for mine in starts.values():
        mine.sort(key=lambda s: s.start_ns)
    per_step: dict[int, dict[int, list[int]]] = {}  # step -> rank -> [times last, caused]
    for rank, enter, caused in lates:
        mine = starts.get(rank, [])
        i = bisect.bisect_right([s.start_ns for s in mine], enter) - 1
        if i < 0 or enter >= mine[i].start_ns + mine[i].step_ns:
            continue  # entered between steps: counted in the run's ranking only
        got = per_step.setdefault(mine[i].step, {}).setdefault(rank, [0, 0])
        got[0] += 1
        got[1] += caused
    out = []
    for step, ranks in sorted(per_step.items()):
        rank, (n, caused) = max(ranks.items(), key=lambda kv: (kv[1][1], kv[1][0]))
        out.append(
            StepStraggler(step, rank, n, caused, {r: v[1] for r, v in sorted(ranks.items())})
        )
    return out


_RANK_PROCS = """
SELECT t.1 AS host, t.2 AS pid, t.3 AS rank
FROM (SELECT arrayJoin({procs:Array(Tuple(String, UInt32, Int64))}) AS t)
"""


# Each rank's own steps (its process's step spans), in time order.
_STEPS_OF_RANKS = f"""
SELECT r.rank AS rank, s.name AS name, s.start_ns AS start_ns, s.end_ns AS end_ns
FROM __db__.spans AS s INNER JOIN ({_RANK_PROCS}) AS r ON r.host = s.host AND r.pid = s.pid
WHERE s.run_id = {{run_id:String}} AND s.category = 'step' AND s.end_ns > s.start_ns
ORDER BY rank, start_ns, end_ns
"""


# A rank's work within [lo, hi) per unit (a CPU thread, or a GPU stream's lane: kernels record tid 0)
# and kind (comm: collective calls and NCCL kernels; compute: ops, modules, other kernels) as
# disjoint intervals: spans in start order, a new island where a span starts past the furthest end
# before it, each island its extent. A compute span inside which its thread entered a collective
# (the first collective call starting at or after it starts before it ends) is of kind 'holds':
# it holds the wait (`backward` around DDP's all-reduce), and counts only outside the thread's
# collective calls; its children, which hold none, count whole.
_WORK = f"""
SELECT rank, unit, kind, min(start_ns) AS lo, max(end_ns) AS hi
FROM (
    SELECT rank, unit, kind, start_ns, end_ns,
           sum(if(rn = 1 OR start_ns > reach, 1, 0)) OVER (
               PARTITION BY rank, unit, kind ORDER BY start_ns, end_ns
               ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS island
    FROM (
        SELECT rank, unit, if(kind = 'compute' AND next_call < end_ns, 'holds', kind) AS kind,
               start_ns, end_ns,
               max(end_ns) OVER (PARTITION BY rank, unit, kind ORDER BY start_ns, end_ns
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach,
               row_number() OVER (PARTITION BY rank, unit, kind ORDER BY start_ns, end_ns) AS rn
        FROM (
            SELECT rank, unit, kind, start_ns, end_ns,
                   min(if(kind = 'comm', start_ns, toInt64(9223372036854775807))) OVER (
                       PARTITION BY rank, unit ORDER BY start_ns, kind DESC
                       ROWS BETWEEN CURRENT ROW AND UNBOUNDED FOLLOWING) AS next_call
            FROM (
                SELECT r.rank AS rank, if(s.category = 'kernel', s.lane, toString(s.tid)) AS unit,
                       s.start_ns AS start_ns, s.end_ns AS end_ns,
                       if(s.category = 'collective' OR
                          (s.category = 'kernel' AND positionCaseInsensitive(s.name, 'nccl') > 0),
                          'comm', 'compute') AS kind
                FROM __db__.spans AS s
                INNER JOIN ({_RANK_PROCS}) AS r ON r.host = s.host AND r.pid = s.pid
                WHERE s.run_id = {{run_id:String}} AND s.end_ns > s.start_ns
                  AND s.end_ns > {{lo:Int64}} AND s.start_ns < {{hi:Int64}}
                  AND ((s.category = 'collective' AND s.lane = {{lane:String}})
                       OR s.category IN ('op', 'module', 'kernel'))
            )
        )
    )
)
GROUP BY rank, unit, kind, island ORDER BY rank, unit, kind, lo
"""


Intervals = list[tuple[int, int]]  # disjoint, in order


# Each rank's kernels merged into islands, communication (named nccl) and computation apart.
_KERNEL_ISLANDS = f"""
SELECT rank, kind, min(start_ns) AS lo, max(end_ns) AS hi
FROM (
    SELECT rank, kind, start_ns, end_ns,
           sum(if(rn = 1 OR start_ns > reach, 1, 0)) OVER (
               PARTITION BY rank, kind ORDER BY start_ns, end_ns
               ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS island
    FROM (
        SELECT rank, kind, start_ns, end_ns,
               max(end_ns) OVER (PARTITION BY rank, kind ORDER BY start_ns, end_ns
                                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach,
               row_number() OVER (PARTITION BY rank, kind ORDER BY start_ns, end_ns) AS rn
        FROM (
            SELECT r.rank AS rank, s.start_ns AS start_ns, s.end_ns AS end_ns,
                   if(positionCaseInsensitive(s.name, 'nccl') > 0, 'comm', 'compute') AS kind
            FROM __db__.spans AS s
            INNER JOIN ({_RANK_PROCS}) AS r ON r.host = s.host AND r.pid = s.pid
            WHERE s.run_id = {{run_id:String}} AND s.category = 'kernel' AND s.end_ns > s.start_ns
        )
    )
)
GROUP BY rank, kind, island ORDER BY rank, kind, lo
"""


def kernel_overlap(store: Queries, run_id: str, procs: Mapping[int, Process]) -> dict[int, float]:
    """Per rank with NCCL kernels, the share of their time (merged) a computation kernel ran
    beside: the definition of HTA's ``get_comm_comp_overlap`` (kernels named ``nccl`` are
    communication, the others computation), from the run's own spans."""
    params = {"run_id": run_id, "procs": [(p.host, p.pid, r) for r, p in procs.items()]}
    islands: dict[int, dict[str, Intervals]] = {}
    for rank, kind, lo, hi in store.query(_KERNEL_ISLANDS, params).result_rows:
        islands.setdefault(int(rank), {}).setdefault(str(kind), []).append((int(lo), int(hi)))
    out = {}
    for rank, kinds in islands.items():
        comm = kinds.get("comm", [])
        total = sum(hi - lo for lo, hi in comm)
        if total:
            both = _both(kinds.get("compute", []), comm)
            out[rank] = sum(hi - lo for lo, hi in both) / total
    return out


def _union(parts: Iterable[Intervals]) -> Intervals:
    out: Intervals = []
    for lo, hi in sorted(i for part in parts for i in part):
        if out and lo <= out[-1][1]:
            if hi > out[-1][1]:
                out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _minus(a: Intervals, b: Intervals) -> Intervals:
    """``a`` less ``b``."""
    out: Intervals = []
    j = 0
    for lo, hi in a:
        while j < len(b) and b[j][1] <= lo:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > lo:
                out.append((lo, b[k][0]))
            lo = max(lo, b[k][1])
            k += 1
        if lo < hi:
            out.append((lo, hi))
    return out


def _both(a: Intervals, b: Intervals) -> Intervals:
    """``a`` and ``b`` at once."""
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


class _Covered:
    """How much of a window disjoint intervals cover."""

    def __init__(self, spans: Intervals) -> None:
        self.spans = spans
        self.ends = [hi for _, hi in spans]

    def within(self, lo: int, hi: int) -> int:
        total = 0
        for a, b in self.spans[bisect.bisect_right(self.ends, lo) :]:
            if a >= hi:
                break
            total += min(b, hi) - max(a, lo)
        return total


def rank_steps(store: Queries, run_id: str, procs: Mapping[int, Process]) -> list[RankStep]:
    """Every step of each rank (``procs``: the process standing for it) with its computation,
    communication, overlap and idle time (the module docstring defines them)."""
    params = {"run_id": run_id, "procs": [(p.host, p.pid, r) for r, p in procs.items()]}
    steps = store.query(_STEPS_OF_RANKS, params).result_rows
    if not steps:
        return []
    lo, hi = min(int(s[2]) for s in steps), max(int(s[3]) for s in steps)
    work: dict[int, dict[str, dict[str, Intervals]]] = {}  # rank -> unit -> kind -> intervals
    rows = store.query(_WORK, {**params, "lo": lo, "hi": hi, "lane": COLLECTIVE_LANE})
    for rank, unit, kind, a, b in rows.result_rows:
        work.setdefault(int(rank), {}).setdefault(str(unit), {}).setdefault(str(kind), []).append(
            (int(a), int(b))
        )
    measures: dict[int, tuple[_Covered, _Covered, _Covered, _Covered]] = {}
    for rank, units in work.items():
        compute = _union(
            [u.get("compute", []) for u in units.values()]
            + [_minus(u.get("holds", []), u.get("comm", [])) for u in units.values()]
        )
        comm = _union(u.get("comm", []) for u in units.values())
        measures[rank] = (
            _Covered(compute),
            _Covered(comm),
            _Covered(_both(compute, comm)),
            _Covered(_union([compute, comm])),
        )
    empty = _Covered([])
    out: list[RankStep] = []
    index: dict[int, int] = {}
    for rank, name, start, end in steps:
        rank, start, end = int(rank), int(start), int(end)
        busy, talk, both, either = measures.get(rank, (empty,) * 4)
        out.append(
            RankStep(
                rank=rank,
                step=index.get(rank, 0),
                name=str(name),
                start_ns=start,
                step_ns=end - start,
                compute_ns=busy.within(start, end),
                comm_ns=talk.within(start, end),
                overlap_ns=both.within(start, end),
                idle_ns=end - start - either.within(start, end),
            )
        )
        index[rank] = index.get(rank, 0) + 1
    return out
