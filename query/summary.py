"""A run's summary, computed once: what `gpu-trace show`, ``Run.summary()`` and the dashboard's
Summary tab print or draw.

:func:`run_summary` returns a :class:`RunSummary`; it needs only the store's public ``query``
(``Store`` has it; ``Store.summary`` calls it). Definitions, also in docs/cli.md ("show"):

- **Run time**: the run's ``ended_ns - started_ns`` (for a run without an end, its spans' extent).
  A share is a time over the run time.
- **Events**: spans plus counter samples stored for the run (:func:`event_count`); what `ls`
  lists and `record`'s closing line says. Clock-offset samples are bookkeeping, not events.
- **Lane busy time**: the union of the lane's span intervals: time covered by any of its spans,
  nested or concurrent ones counted once, so it never exceeds the run time.
- **Per range name** (per lane): count, total (durations summed), self (each span's duration
  minus the time its children on the same thread cover, overlapping children counted once; work a
  span started on another thread runs concurrently and does not count against it), median and
  max duration, share (total over the run time: ranges on several threads can pass 100%).
  Marks are instants and left out; steps are grouped by kind, as below.
- **Steps** (category ``step``), per kind (the name without its number: ``ProfilerStep#7`` is a
  ``ProfilerStep``): count, p50, p90 (linear between the nearest ranks, as numpy's default),
  mean, max.
- **Counters**: per host/source/device/metric, samples, min, mean, max; the samplers' own
  metrics (:data:`SAMPLER_METRICS`: ``call_us.<family>``, how long each NVML call took) apart in
  ``sampler``, so they do not crowd the program's and the machine's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from clickhouse_connect.driver.query import QueryResult

#: Metric name prefixes of what a sampler records about itself rather than about the run.
SAMPLER_METRICS = ("call_us.",)


def _step_kind(column: str) -> str:
    """A step's kind: its name without a trailing number (``ProfilerStep#7``, ``step 7``)."""
    return rf"replaceRegexpOne({column}, '[\\s#_:-]*[0-9]+$', '')"


# Lane busy time: spans of a lane in start order; each adds what it reaches past the furthest end
# before it (a window over the preceding rows), so nested and overlapping spans count once.
_LANES = """
SELECT lane, count() AS spans,
       sum(greatest(0, end_ns - greatest(start_ns, if(rn = 1, start_ns, reach)))) AS busy_ns
FROM (
    SELECT lane, start_ns, end_ns,
           max(end_ns) OVER (PARTITION BY lane ORDER BY start_ns, end_ns
                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach,
           row_number() OVER (PARTITION BY lane ORDER BY start_ns, end_ns) AS rn
    FROM __db__.spans
    WHERE run_id = {run_id:String} AND category != 'mark'
)
GROUP BY lane ORDER BY lane
"""

# Per (lane, name): self time is a span's duration minus the union of its same-thread children,
# each cut to the parent (children found by parent_span_id; the same union-by-window as above, per
# parent). The top rows per lane by total and by self time are kept.
_RANGES = """
WITH kids AS (
    SELECT c.parent_span_id AS sid, c.host AS host, c.pid AS pid, c.tid AS tid,
           greatest(c.start_ns, p.start_ns) AS s, least(c.end_ns, p.end_ns) AS e
    FROM __db__.spans AS c
    INNER JOIN (SELECT span_id, host, pid, tid, start_ns, end_ns FROM __db__.spans
                WHERE run_id = {run_id:String} AND category != 'mark') AS p
      ON p.span_id = c.parent_span_id AND p.host = c.host AND p.pid = c.pid AND p.tid = c.tid
    WHERE c.run_id = {run_id:String} AND c.parent_span_id != 0 AND c.category != 'mark'
),
covered AS (
    SELECT sid, host, pid, tid,
           sum(greatest(0, e - greatest(s, if(rn = 1, s, reach)))) AS child_ns
    FROM (
        SELECT sid, host, pid, tid, s, e,
               max(e) OVER (PARTITION BY sid, host, pid, tid ORDER BY s, e
                            ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS reach,
               row_number() OVER (PARTITION BY sid, host, pid, tid ORDER BY s, e) AS rn
        FROM kids WHERE e > s
    )
    GROUP BY sid, host, pid, tid
),
per_name AS (
    SELECT sp.lane AS lane, if(sp.category = 'step', __step_kind__, sp.name) AS name,
           any(sp.category) AS category, count() AS count,
           sum(sp.end_ns - sp.start_ns) AS total_ns,
           sum(sp.end_ns - sp.start_ns - c.child_ns) AS self_ns,
           toInt64(round(quantileExactInclusive(0.5)(sp.end_ns - sp.start_ns))) AS median_ns,
           max(sp.end_ns - sp.start_ns) AS max_ns
    FROM __db__.spans AS sp
    LEFT JOIN covered AS c
      ON c.sid = sp.span_id AND c.host = sp.host AND c.pid = sp.pid AND c.tid = sp.tid
    WHERE sp.run_id = {run_id:String} AND sp.category != 'mark'
    GROUP BY lane, name
)
SELECT * FROM (
    SELECT lane, name, category, count, total_ns, self_ns, median_ns, max_ns,
           row_number() OVER (PARTITION BY lane ORDER BY total_ns DESC, name) AS rank_total,
           row_number() OVER (PARTITION BY lane ORDER BY self_ns DESC, name) AS rank_self
    FROM per_name
)
WHERE rank_total <= {top:UInt32} OR rank_self <= {top:UInt32}
ORDER BY lane, rank_total
""".replace("__step_kind__", _step_kind("sp.name"))

_STEPS = f"""
SELECT {_step_kind("name")} AS kind, count() AS count,
       toInt64(round(quantileExactInclusive(0.5)(end_ns - start_ns))) AS p50_ns,
       toInt64(round(quantileExactInclusive(0.9)(end_ns - start_ns))) AS p90_ns,
       toInt64(intDiv(sum(end_ns - start_ns), count())) AS mean_ns,
       max(end_ns - start_ns) AS max_ns
FROM __db__.spans
WHERE run_id = {{run_id:String}} AND category = 'step'
GROUP BY kind ORDER BY kind
"""

_STEP_LIST = """
SELECT name, pid, start_ns, end_ns - start_ns AS dur_ns FROM __db__.spans
WHERE run_id = {run:String} AND category = 'step' ORDER BY pid, start_ns LIMIT {limit:UInt32}
"""

# The mean sums a series' values in sorted order: a float sum depends on its order, and the
# engine adds parts in whatever order they lie (a run imported back, or ingested in other
# batches, would show a mean a last digit off).
_COUNTERS = """
SELECT host, source, device, metric, count() AS count, min(value) AS min,
       arraySum(arraySort(groupArray(value))) / count() AS mean, max(value) AS max
FROM __db__.counters WHERE run_id = {run_id:String}
GROUP BY host, source, device, metric ORDER BY source, device, metric, host
"""

_RUN = """
SELECT r.started_ns, r.ended_ns, s.lo, s.hi, s.n, c.n
FROM (SELECT started_ns, ended_ns FROM __db__.runs FINAL WHERE run_id = {run_id:String}) AS r,
     (SELECT min(start_ns) AS lo, max(end_ns) AS hi, count() AS n FROM __db__.spans
      WHERE run_id = {run_id:String}) AS s,
     (SELECT count() AS n FROM __db__.counters WHERE run_id = {run_id:String}) AS c
"""


class Queries(Protocol):
    """What the summary needs of a store (``Store`` has it)."""

    def query(self, template: str, params: dict[str, Any] | None = None) -> QueryResult: ...


@dataclass(frozen=True)
class RangeStats:
    """One range name on one lane."""

    lane: str
    name: str
    category: str
    count: int
    total_ns: int
    self_ns: int
    median_ns: int
    max_ns: int
    share: float  # total over the run time

    @property
    def mean_ns(self) -> int:
        return self.total_ns // max(1, self.count)


@dataclass(frozen=True)
class LaneStats:
    """One lane: its spans, busy time (union of its intervals), and its top range names."""

    lane: str
    spans: int
    busy_ns: int
    share: float  # busy over the run time
    ranges: list[RangeStats] = field(default_factory=list)  # by total time, most first
    by_self: list[RangeStats] = field(default_factory=list)  # by self time, most first


@dataclass(frozen=True)
class StepStats:
    """The step-time distribution of one kind of step."""

    kind: str
    count: int
    p50_ns: int
    p90_ns: int
    mean_ns: int
    max_ns: int


@dataclass(frozen=True)
class CounterStats:
    """One counter series: samples, min, mean, max."""

    host: str
    source: str
    device: str
    metric: str
    count: int
    min: float
    mean: float
    max: float


@dataclass(frozen=True)
class RunSummary:
    """A run's summary (see the module docstring for each number's definition)."""

    run_id: str
    run_ns: int
    events: int
    lanes: list[LaneStats]
    steps: list[StepStats]
    counters: list[CounterStats]
    sampler: list[CounterStats]

    def top(self, by: str = "total", n: int = 25) -> list[RangeStats]:
        """The top ``n`` range names over every lane by ``total`` or ``self`` time."""
        if by not in ("total", "self"):
            raise ValueError(f"by is 'total' or 'self', got {by!r}")
        seen = {(r.lane, r.name): r for lane in self.lanes for r in lane.ranges + lane.by_self}
        key = (
            (lambda r: (-r.total_ns, r.name)) if by == "total" else (lambda r: (-r.self_ns, r.name))
        )
        return sorted(seen.values(), key=key)[:n]

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON (``show --json``); ranges carry ``mean_ns`` too."""
        out = asdict(self)
        for lane, data in zip(self.lanes, out["lanes"]):
            for key in ("ranges", "by_self"):
                for r, row in zip(getattr(lane, key), data[key]):
                    row["mean_ns"] = r.mean_ns
        return out


def event_count(counts: Mapping[str, int]) -> int:
    """A run's events: its stored spans plus counter samples (``counts`` as ``Store.counts``
    gives them). The one definition `ls`, `show` and `record`'s closing line use."""
    return int(counts.get("spans", 0)) + int(counts.get("counters", 0))


def is_sampler_metric(metric: str) -> bool:
    """Whether ``metric`` is a sampler's own (:data:`SAMPLER_METRICS`)."""
    return metric.startswith(SAMPLER_METRICS)


def run_summary(store: Queries, run_id: str, top: int = 20) -> RunSummary:
    """The summary of the stored run ``run_id``, with the top ``top`` range names per lane by
    total and by self time."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a positive int, got {top!r}")
    params: dict[str, Any] = {"run_id": run_id}
    found = store.query(_RUN, params).result_rows
    started, ended, lo, hi, n_spans, n_counters = found[0] if found else (0, 0, 0, 0, 0, 0)
    run_ns = int(ended) - int(started) if int(ended) else 0
    if run_ns <= 0 and n_spans:
        run_ns = int(hi) - int(lo)

    def share(ns: int) -> float:
        return ns / run_ns if run_ns > 0 else 0.0

    lanes: dict[str, LaneStats] = {}
    for lane, spans, busy in store.query(_LANES, params).result_rows:
        lanes[lane] = LaneStats(str(lane), int(spans), int(busy), share(int(busy)))
    rows = store.query(_RANGES, {**params, "top": top}).named_results()
    for r in rows:
        lane = lanes.get(r["lane"])
        if lane is None:
            continue
        stats = RangeStats(
            lane=str(r["lane"]),
            name=str(r["name"]),
            category=str(r["category"]),
            count=int(r["count"]),
            total_ns=int(r["total_ns"]),
            self_ns=int(r["self_ns"]),
            median_ns=int(r["median_ns"]),
            max_ns=int(r["max_ns"]),
            share=share(int(r["total_ns"])),
        )
        if r["rank_total"] <= top:
            lane.ranges.append(stats)
        if r["rank_self"] <= top:
            lane.by_self.append(stats)
    for lane in lanes.values():
        lane.by_self.sort(key=lambda s: (-s.self_ns, s.name))
    steps = [
        StepStats(str(kind), int(n), int(p50), int(p90), int(mean), int(mx))
        for kind, n, p50, p90, mean, mx in store.query(_STEPS, params).result_rows
    ]
    counters: list[CounterStats] = []
    sampler: list[CounterStats] = []
    for host, source, device, metric, n, low, mean, high in store.query(
        _COUNTERS, params
    ).result_rows:
        c = CounterStats(str(host), str(source), str(device), str(metric), int(n),
                         float(low), float(mean), float(high))  # fmt: skip
        (sampler if is_sampler_metric(c.metric) else counters).append(c)
    return RunSummary(
        run_id=run_id,
        run_ns=max(0, run_ns),
        events=event_count({"spans": int(n_spans), "counters": int(n_counters)}),
        lanes=list(lanes.values()),
        steps=steps,
        counters=counters,
        sampler=sampler,
    )


def step_times(store: Queries, run_id: str, limit: int = 100_000) -> list[dict[str, Any]]:
    """Steps of a run in order: ``name, pid, index, start_ns, dur_ns`` (index per process), at
    most ``limit``."""
    rows = list(store.query(_STEP_LIST, {"run": run_id, "limit": limit}).named_results())
    seen: dict[int, int] = {}
    for r in rows:
        r["index"] = seen.get(r["pid"], 0)
        seen[r["pid"]] = r["index"] + 1
    return rows
