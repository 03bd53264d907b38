"""Tenants of the sharing runtime in a client's run, over time.

The sharing runtime's counters in a client's run (``source = 'runtime'``, labelled ``tenant`` and
``session``; docs/sharing.md, "In the client's run") and its sessions' server spans (execute,
queue, evict, restore, quota-wait), grouped by tenant (:func:`tenants`, :data:`TENANT_METRICS`).
A run holds only its own sessions' tenants. A plain function of a
:class:`~gpu_trace.query.source.Source`; the dashboard's Tenants tab draws what it returns
(:mod:`gpu_trace.plots.charts`).
"""

from __future__ import annotations

from typing import Any, TypedDict

from gpu_trace.query import reads
from gpu_trace.query.source import Source
from gpu_trace.query.source import rows as query_rows

#: Runtime counters (``source = 'runtime'``) the Tenants tab reads, with what they are
#: (docs/sharing.md, "In the client's run"). Per session (labels ``session``, ``tenant``) but for
#: the last three (label ``tenant``); those in :data:`CUMULATIVE` are totals since it connected.
TENANT_METRICS = {
    "session_memory_bytes": "bytes the session holds, as its tenant's quota counts them",
    "session_handles": "tensors the session holds",
    "queue_depth": "work items waiting on the server when the session's batch ended",
    "busy_ns": "device time of the session's batches",
    "queue_wait_ns": "time its batches waited for the executor",
    "bytes_in": "tensor bytes uploaded",
    "bytes_out": "tensor bytes downloaded",
    "quota_waits": "ops that waited for memory",
    "quota_errors": "ops that failed on the quota",
    "evictions": "times the session was paged out",
    "restores": "times it was paged back in",
    "session_paged_bytes": "its bytes paged out to host memory",
    "tenant_memory_bytes": "all the tenant's sessions: bytes held, resident and paged out",
    "tenant_resident_bytes": "all the tenant's sessions: bytes on the device",
    "quota_bytes": "the tenant's memory quota (absent: no quota)",
}
CUMULATIVE = (
    "busy_ns", "queue_wait_ns", "bytes_in", "bytes_out", "quota_waits", "quota_errors",
    "evictions", "restores",
)  # fmt: skip
#: Server lanes whose spans are drawn as events: page-outs, restores, waits for memory.
EVENT_LANES = {
    "server/evict": "page-out",
    "server/restore": "restore",
    "server/quota-wait": "quota wait",
}
#: Where a run stored before server spans carried their session and tenant shows those spans.
NO_TENANT = "no tenant recorded"
_SESSION_SPANS = ("server/receive", "server/queue", "server/execute", "server/reply", *EVENT_LANES)


class TenantSession(TypedDict):
    """One session of a tenant: its client process where known, its batches and ops."""

    session: str
    host: str
    pid: int | None
    batches: int
    ops: int


class TenantEntry(TypedDict):
    key: str  # the tenant
    sessions: list[TenantSession]


class TenantSample(TypedDict):
    """One runtime counter sample of a tenant's session."""

    tenant: str
    session: str
    ts_ns: int
    value: float


class TenantBusy(TypedDict):
    """A tenant's ``server/execute`` time in one bucket (``ts_ns``: its start)."""

    tenant: str
    ts_ns: int
    ns: int
    share: float


class TenantQueue(TypedDict):
    """A tenant's batches that waited for the executor, started in one bucket."""

    tenant: str
    ts_ns: int
    n: int
    ns: int
    mean_ns: int
    max_ns: int


class TenantEvent(TypedDict):
    """A page-out, restore or wait for memory (``kind``: :data:`EVENT_LANES`' words)."""

    tenant: str
    session: str
    kind: str
    start_ns: int
    end_ns: int
    attrs: dict[str, str]
    index: int  # its place among the tenant's events of its kind, from 1


class TenantSummary(TypedDict):
    """One tenant's row of the summary table; None where the run did not record it."""

    tenant: str
    sessions: list[str]
    peak_bytes: int | None
    quota_bytes: int | None
    peak_share: float | None
    busy_ns: int | None
    busy_from: str | None
    busy_share: float | None
    batches: int
    ops: int
    queue_wait_ns: int | None
    queue_mean_ns: int | None
    bytes_in: int | None
    bytes_out: int | None
    evictions: int | None
    restores: int | None
    quota_waits: int | None
    quota_errors: int | None


#: (ts_ns, value) points of one line.
Points = list[tuple[int, float]]


class Tenants(TypedDict):
    """What :func:`tenants` returns (see its docstring)."""

    run_ns: tuple[int, int]
    range_ns: tuple[int, int]
    bucket_ns: int
    labelled: bool
    tenants: list[TenantEntry]
    counters: dict[str, list[TenantSample]]
    memory: dict[str, dict[str, Points]]  # tenant -> held, resident, quota
    cumulative: dict[str, dict[str, Points]]  # tenant -> metric -> totals
    busy: list[TenantBusy]
    queue: list[TenantQueue]
    events: list[TenantEvent]
    summary: list[TenantSummary]


def _stepwise_sum(rows: list[TenantSample]) -> Points:
    """``(ts_ns, value)`` of a sum over sessions, each at its latest sample (rows in time order)."""
    latest: dict[str, float] = {}
    out: list[tuple[int, float]] = []
    for r in rows:
        latest[r["session"]] = float(r["value"])
        point = (int(r["ts_ns"]), sum(latest.values()))
        if out and out[-1][0] == point[0]:
            out[-1] = point
        else:
            out.append(point)
    return out


def tenants(source: Source, run_id: str, buckets: int = 60) -> Tenants:
    """Per tenant over time: memory against quota, busy share, queue wait, page-outs; a summary.

    A tenant is the ``tenant`` label of the run's runtime counters. A run recorded before tenants
    existed has only a ``session`` label: each session is then a tenant of its own, ``session N``.
    A client's run holds only its own sessions, so only its own tenants' numbers.

    A server span's session and tenant are what the server stamped on it when it wrote it (attrs
    ``session`` and ``tenant``, :func:`~gpu_trace.runtime.protocol.span_tables.span_owner`):
    nothing is read from its id or joined by time. A run stored before server spans carried them
    shows their busy time, queue wait and page-outs under :data:`NO_TENANT`, its sessions there
    by client process (a ``server/execute`` span's parent is its client's ``forward`` span: that
    names the client process in every run).

    Busy share is exact: the ``server/execute`` spans, each cut at the bucket edges, over the
    bucket's length (the cumulative ``busy_ns`` counter is sampled only every 200 ms; on the CPU
    device it is the same time, on a GPU the kernels' time: the summary's busy total is the
    counter, what the scheduler charged). Queue wait is per batch, from the ``server/queue`` spans.

    Returns ``{"run_ns": (start, end), "range_ns": (first, last), "bucket_ns", "labelled",
    "tenants": [{"key", "sessions": [{"session", "host", "pid", "batches", "ops"}]}], "counters":
    {metric: [{"tenant", "session", "ts_ns", "value"}]}, "memory": {tenant: {"held", "resident",
    "quota": [(ts_ns, bytes)]}}, "cumulative": {tenant: {metric: [(ts_ns, total)]}}, "busy":
    [{"tenant", "ts_ns", "ns", "share"}], "queue": [{"tenant", "ts_ns", "n", "ns", "mean_ns",
    "max_ns"}], "events": [{"tenant", "session", "kind", "start_ns", "end_ns", "attrs",
    "index"}], "summary": [per tenant]}``; ``ts_ns`` of a bucket is its start.
    """
    run = reads.run(source, run_id)
    r0, r1 = int(run["started_ns"]), int(run["ended_ns"] or run["started_ns"] + 1)
    params: dict[str, Any] = {"run": run_id}
    counter_rows = query_rows(
        source,
        """
        SELECT labels['tenant'] AS tenant, labels['session'] AS session, metric, ts_ns, value
        FROM __db__.counters
        WHERE run_id = {run:String} AND source = 'runtime'
          AND (labels['tenant'] != '' OR labels['session'] != '')
        ORDER BY ts_ns, metric LIMIT 1000000
        """,
        params,
    )
    # A server span's session and tenant are its attrs, stamped by the server when it wrote it
    # (runtime/protocol/span_tables.py span_owner); empty in a run stored before they were.
    executes = query_rows(
        source,
        """
        SELECT s.attrs['session'] AS session, s.attrs['tenant'] AS tenant, count() AS batches,
               sum(toUInt64OrZero(s.attrs['ops'])) AS ops, p.host AS host, p.pid AS pid
        FROM (SELECT parent_span_id, attrs FROM __db__.spans
              WHERE run_id = {run:String} AND lane = 'server/execute') AS s
        LEFT JOIN (SELECT span_id, host, pid FROM __db__.spans
                   WHERE run_id = {run:String} AND category = 'forward') AS p
          ON p.span_id = s.parent_span_id
        GROUP BY session, tenant, host, pid
        """,
        params,
    )
    extent = query_rows(
        source,
        """
        SELECT min(start_ns) AS lo, max(end_ns) AS hi, count() AS n FROM __db__.spans
        WHERE run_id = {run:String} AND lane IN {lanes:Array(String)}
        """,
        {**params, "lanes": list(_SESSION_SPANS)},
    )[0]
    times = [int(r["ts_ns"]) for r in counter_rows[:1] + counter_rows[-1:]]
    if int(extent["n"]):
        times += [int(extent["lo"]), int(extent["hi"])]
    lo, hi = (min(times), max(times)) if times else (r0, r1)
    bucket = max(1, -(-(hi - lo + 1) // buckets))
    window = {**params, "lo": lo, "bucket": bucket}
    busy_rows = query_rows(
        source,
        """
        SELECT session, tenant, b,
               sum(least(end_ns, {lo:Int64} + (b + 1) * {bucket:Int64})
                   - greatest(start_ns, {lo:Int64} + b * {bucket:Int64})) AS ns
        FROM (SELECT attrs['session'] AS session, attrs['tenant'] AS tenant, start_ns, end_ns,
                     arrayJoin(range(toUInt32(intDiv(start_ns - {lo:Int64}, {bucket:Int64})),
                                     toUInt32(intDiv(end_ns - 1 - {lo:Int64}, {bucket:Int64}) + 1)))
                       AS b
              FROM __db__.spans
              WHERE run_id = {run:String} AND lane = 'server/execute'
                AND end_ns > start_ns AND start_ns >= {lo:Int64})
        GROUP BY session, tenant, b ORDER BY session, tenant, b
        """,
        window,
    )
    queue_rows = query_rows(
        source,
        """
        SELECT attrs['session'] AS session, attrs['tenant'] AS tenant,
               intDiv(start_ns - {lo:Int64}, {bucket:Int64}) AS b, count() AS n,
               sum(end_ns - start_ns) AS ns, max(end_ns - start_ns) AS max_ns
        FROM __db__.spans
        WHERE run_id = {run:String} AND (lane = 'server/queue' OR startsWith(lane, 'server/queue/'))
          AND start_ns >= {lo:Int64}
        GROUP BY session, tenant, b ORDER BY session, tenant, b
        """,
        window,
    )
    event_rows = query_rows(
        source,
        """
        SELECT attrs['session'] AS session, attrs['tenant'] AS tenant, lane, start_ns, end_ns,
               attrs
        FROM __db__.spans
        WHERE run_id = {run:String} AND lane IN {lanes:Array(String)}
        ORDER BY start_ns LIMIT 20000
        """,
        {**params, "lanes": list(EVENT_LANES)},
    )

    # Tenants: the counters' tenant label; in a run from before tenants, each session its own.
    labelled = any(r["tenant"] for r in counter_rows)
    named = {r["session"]: r["tenant"] for r in counter_rows if r["session"] and r["tenant"]}

    def tenant_of(r: dict[str, Any]) -> str:
        """A server span's tenant: its own ``tenant`` attr, else its session's counters' (a
        session's tenant never changes), else its session's name; none in an older run."""
        if r["tenant"]:
            return str(r["tenant"])
        if r["session"]:
            return named.get(r["session"]) or f"session {r['session']}"
        return NO_TENANT

    sessions: dict[str, dict[str, TenantSession]] = {}  # tenant -> session -> entry

    def session_entry(tenant: str, session: str, key: str = "") -> TenantSession:
        blank = TenantSession(session=session, host="", pid=None, batches=0, ops=0)
        return sessions.setdefault(tenant, {}).setdefault(session or key, blank)

    by_metric: dict[str, list[TenantSample]] = {}
    grouped: dict[tuple[str, str], list[TenantSample]] = {}  # (metric, tenant) -> rows
    for r in counter_rows:
        tenant = r["tenant"] or named.get(r["session"]) or f"session {r['session']}"
        row = TenantSample(tenant=tenant, session=r["session"], ts_ns=int(r["ts_ns"]),
                           value=float(r["value"]))  # fmt: skip
        by_metric.setdefault(r["metric"], []).append(row)
        grouped.setdefault((r["metric"], tenant), []).append(row)
        sessions.setdefault(tenant, {})
        if r["session"]:
            session_entry(tenant, r["session"])
    for c in executes:
        # Without a session (an older run): one entry per client process.
        entry = session_entry(tenant_of(c), c["session"], f"{c['host']}:{c['pid']}")
        if c["host"]:
            entry["host"], entry["pid"] = c["host"], int(c["pid"])
        entry["batches"] += int(c["batches"])
        entry["ops"] += int(c["ops"])
    for r in event_rows:
        sessions.setdefault(tenant_of(r), {})

    def points(metric: str, tenant: str) -> Points:
        return [(r["ts_ns"], r["value"]) for r in grouped.get((metric, tenant), [])]

    memory: dict[str, dict[str, Points]] = {}
    cumulative: dict[str, dict[str, Points]] = {}
    for tenant in sessions:
        memory[tenant] = {
            "held": points("tenant_memory_bytes", tenant)
            or _stepwise_sum(grouped.get(("session_memory_bytes", tenant), [])),
            "resident": points("tenant_resident_bytes", tenant),
            "quota": points("quota_bytes", tenant),
        }
        cumulative[tenant] = {
            m: _stepwise_sum(grouped[(m, tenant)]) for m in CUMULATIVE if (m, tenant) in grouped
        }

    busy = [
        TenantBusy(tenant=tenant_of(r), ts_ns=lo + int(r["b"]) * bucket, ns=int(r["ns"]), share=int(r["ns"]) / bucket)
        for r in busy_rows
    ]  # fmt: skip
    queue = [
        TenantQueue(tenant=tenant_of(r), ts_ns=lo + int(r["b"]) * bucket, n=int(r["n"]), ns=int(r["ns"]), mean_ns=int(r["ns"]) // max(1, int(r["n"])),
                    max_ns=int(r["max_ns"]))
        for r in queue_rows
    ]  # fmt: skip
    events: list[TenantEvent] = []
    seen: dict[tuple[str, str], int] = {}
    for r in event_rows:
        tenant, kind = tenant_of(r), EVENT_LANES[r["lane"]]
        seen[(tenant, kind)] = seen.get((tenant, kind), 0) + 1
        events.append(
            TenantEvent(tenant=tenant, session=r["session"], kind=kind,
                        start_ns=int(r["start_ns"]), end_ns=int(r["end_ns"]),
                        attrs=dict(r["attrs"] or {}), index=seen[(tenant, kind)])
        )  # fmt: skip

    summary: list[TenantSummary] = []
    for tenant in sorted(sessions):
        summary.append(
            _tenant_summary(tenant, sessions[tenant], memory[tenant], cumulative[tenant],
                            [b for b in busy if b["tenant"] == tenant],
                            [q for q in queue if q["tenant"] == tenant], r1 - r0,
                            labelled and tenant != NO_TENANT)
        )  # fmt: skip
    return {
        "run_ns": (r0, r1),
        "range_ns": (lo, hi),
        "bucket_ns": bucket,
        "labelled": labelled,
        "tenants": [
            {"key": t, "sessions": sorted(s.values(), key=lambda e: (e["session"], e["pid"] or 0))}
            for t, s in sorted(sessions.items())
        ],
        "counters": by_metric,
        "memory": memory,
        "cumulative": cumulative,
        "busy": busy,
        "queue": queue,
        "events": events,
        "summary": summary,
    }


def _tenant_summary(
    tenant: str,
    sessions: dict[str, TenantSession],
    memory: dict[str, Points],
    cumulative: dict[str, Points],
    busy: list[TenantBusy],
    queue: list[TenantQueue],
    run_ns: int,
    labelled: bool,
) -> TenantSummary:
    """One tenant's row of the summary table; None where the run did not record it."""

    def last(metric: str) -> int | None:
        series = cumulative.get(metric)
        if series:
            return int(series[-1][1])
        # The runtime that labels tenants counts page-outs and restores only when they happen.
        return 0 if labelled and metric in ("evictions", "restores") else None

    peak = int(max(v for _, v in memory["held"])) if memory["held"] else None
    quota = int(memory["quota"][-1][1]) if memory["quota"] else None
    busy_ns = last("busy_ns")
    busy_from = "busy_ns"
    if busy_ns is None and busy:
        busy_ns, busy_from = sum(b["ns"] for b in busy), "server/execute spans"
    batches = sum(q["n"] for q in queue)
    wait = last("queue_wait_ns")
    if wait is None and queue:
        wait = sum(q["ns"] for q in queue)
    return TenantSummary(
        tenant=tenant,
        sessions=sorted(s["session"] for s in sessions.values() if s["session"]),
        peak_bytes=peak,
        quota_bytes=quota,
        peak_share=peak / quota if peak is not None and quota else None,
        busy_ns=busy_ns,
        busy_from=busy_from if busy_ns is not None else None,
        busy_share=busy_ns / run_ns if busy_ns is not None and run_ns > 0 else None,
        batches=batches,
        ops=sum(s["ops"] for s in sessions.values()),
        queue_wait_ns=wait,
        queue_mean_ns=wait // batches if wait is not None and batches else None,
        bytes_in=last("bytes_in"),
        bytes_out=last("bytes_out"),
        evictions=last("evictions"),
        restores=last("restores"),
        quota_waits=last("quota_waits"),
        quota_errors=last("quota_errors"),
    )
