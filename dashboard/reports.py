"""Whole-run reports: Summary (top ranges, module tree, forwarding, steps), Tenants and Compare.

Plain functions of a :class:`~gpu_trace.dashboard.source.Source` returning dicts and lists; the
charts are in :mod:`gpu_trace.dashboard.charts`.

Tenants: the sharing runtime's per-tenant quotas and evictions (issue 6) are not built yet. What
exists is the forwarding server's per-session accounting: every session's ``session_memory_bytes``,
``session_handles`` and ``queue_depth`` counters (``source = 'runtime'``, label ``session``) and its
server spans (queue, execute). A tenant here is one forwarding session, named by the client
process that opened it. When counters carry a ``tenant`` label, or ``quota_bytes`` and
``evictions`` metrics appear, they are used as they are (:data:`TENANT_METRICS`).
"""

from __future__ import annotations

from typing import Any

from gpu_trace.dashboard.source import Source

#: Runtime counter metrics shown per tenant, with what they mean. The last two come with issue 6.
TENANT_METRICS = {
    "session_memory_bytes": "device memory the session holds",
    "session_handles": "tensor handles the session holds",
    "queue_depth": "batches waiting on the server when the session's batch finished",
    "quota_bytes": "the tenant's memory quota (sharing runtime)",
    "evictions": "tensors offloaded to host memory (sharing runtime)",
}


def top_ranges(summary: dict[str, Any], top: int = 25) -> dict[str, list[dict[str, Any]]]:
    """Store.summary's per-lane rows as two flat lists, by total and by self time."""
    rows: dict[tuple, dict[str, Any]] = {}
    for lane in summary.get("lanes", []):
        for r in lane["by_total"] + lane["by_self"]:
            rows[(lane["lane"], r["name"])] = {"lane": lane["lane"], **r}
    flat = list(rows.values())
    return {
        "by_total": sorted(flat, key=lambda r: (-r["total_ns"], r["name"]))[:top],
        "by_self": sorted(flat, key=lambda r: (-r["self_ns"], r["name"]))[:top],
    }


def module_tree(source: Source, run_id: str, limit: int = 300_000) -> dict[str, Any]:
    """Module spans aggregated by their path of enclosing modules.

    Returns ``{"nodes": [{"path", "name", "parent", "depth", "count", "total_ns"}], "spans",
    "truncated"}``; ``path`` joins names with ``/``. At most ``limit`` spans are read (the page says
    when a run has more).
    """
    rows = source.rows(
        """
        SELECT span_id, parent_span_id, name, end_ns - start_ns AS dur FROM __db__.spans
        WHERE run_id = {run:String} AND category = 'module' ORDER BY start_ns LIMIT {n:UInt32}
        """,
        {"run": run_id, "n": limit + 1},
    )
    truncated = len(rows) > limit
    rows = rows[:limit]
    by_id = {r["span_id"]: r for r in rows}
    paths: dict[int, str] = {}

    def path(r: dict[str, Any]) -> str:
        sid = r["span_id"]
        if sid not in paths:
            chain, cur = [], r
            while cur is not None and cur["span_id"] not in paths and len(chain) < 64:
                chain.append(cur)
                cur = by_id.get(cur["parent_span_id"])
            prefix = paths[cur["span_id"]] if cur is not None and cur["span_id"] in paths else ""
            for c in reversed(chain):
                prefix = f"{prefix}/{c['name']}" if prefix else c["name"]
                paths[c["span_id"]] = prefix
        return paths[sid]

    nodes: dict[str, dict[str, Any]] = {}
    for r in rows:
        p = path(r)
        node = nodes.setdefault(
            p,
            {
                "path": p,
                "name": r["name"],
                "parent": p.rsplit("/", 1)[0] if "/" in p else "",
                "depth": p.count("/"),
                "count": 0,
                "total_ns": 0,
            },
        )
        node["count"] += 1
        node["total_ns"] += int(r["dur"])
    ordered = sorted(nodes.values(), key=lambda n: n["path"])
    return {"nodes": ordered, "spans": len(rows), "truncated": truncated}


def step_times(source: Source, run_id: str) -> list[dict[str, Any]]:
    """Steps of a run in order: ``name, pid, index, start_ns, dur_ns`` (index per process)."""
    rows = source.rows(
        """
        SELECT name, pid, start_ns, end_ns - start_ns AS dur_ns FROM __db__.spans
        WHERE run_id = {run:String} AND category = 'step' ORDER BY pid, start_ns LIMIT 100000
        """,
        {"run": run_id},
    )
    seen: dict[int, int] = {}
    for r in rows:
        r["index"] = seen.get(r["pid"], 0)
        seen[r["pid"]] = r["index"] + 1
    return rows


def summary(source: Source, run_id: str, top: int = 25) -> dict[str, Any]:
    """Everything the Summary tab shows."""
    base = source.call("summary", run_id, top=top)
    return {
        "top": top_ranges(base, top),
        "counters": base["counters"],
        "modules": module_tree(source, run_id),
        "forwarding": source.call("forwarding", run_id, top=top),
        "steps": step_times(source, run_id),
    }


# ---- tenants -------------------------------------------------------------------------------------


def tenants(source: Source, run_id: str, buckets: int = 60) -> dict[str, Any]:
    """Per tenant (forwarding session), over time: runtime counters, busy share, queue wait.

    Returns ``{"tenants": [{"key", "label", "session", "pid"}], "counters": {metric: [{"tenant",
    "ts_ns", "value"}]}, "busy": [...], "queue": [...], "bucket_ns", "missing": [metric, ...]}``.
    ``busy`` rows are ``tenant, ts_ns, share`` (the session's execute time over the bucket);
    ``queue`` rows are ``tenant, ts_ns, mean_ns, max_ns`` of its batches' queue spans.
    """
    run = source.call("run", run_id)
    t0, t1 = int(run["started_ns"]), int(run["ended_ns"] or run["started_ns"] + 1)
    bucket = max(1, -(-(t1 - t0) // buckets))
    counter_rows = source.rows(
        """
        SELECT if(labels['tenant'] != '', labels['tenant'], concat('session ', labels['session']))
                 AS tenant, labels['session'] AS session, metric, ts_ns, value
        FROM __db__.counters
        WHERE run_id = {run:String} AND source = 'runtime'
          AND (labels['tenant'] != '' OR labels['session'] != '')
        ORDER BY tenant, metric, ts_ns
        """,
        {"run": run_id},
    )
    # A session's counters are taken when one of its batches' reply ends, so they name the
    # client process that sent that batch: that is how a session gets a name.
    owners = source.rows(
        """
        SELECT c.labels['session'] AS session, any(p.host) AS host, any(p.pid) AS pid
        FROM __db__.counters AS c
        INNER JOIN (SELECT parent_span_id, end_ns FROM __db__.spans
                    WHERE run_id = {run:String} AND lane = 'server/reply') AS r
          ON r.end_ns = c.ts_ns
        INNER JOIN (SELECT span_id, host, pid FROM __db__.spans
                    WHERE run_id = {run:String} AND category = 'forward') AS p
          ON p.span_id = r.parent_span_id
        WHERE c.run_id = {run:String} AND c.source = 'runtime' AND c.labels['session'] != ''
        GROUP BY session
        """,
        {"run": run_id},
    )
    pid_session = {(o["host"], int(o["pid"])): o["session"] for o in owners}
    server = source.rows(
        """
        SELECT p.host AS host, p.pid AS pid, s.lane AS lane,
               intDiv(s.start_ns - {t0:Int64}, {bucket:Int64}) AS b,
               count() AS n, sum(s.end_ns - s.start_ns) AS ns, max(s.end_ns - s.start_ns) AS max_ns
        FROM __db__.spans AS s
        INNER JOIN (SELECT span_id, host, pid FROM __db__.spans
                    WHERE run_id = {run:String} AND category = 'forward') AS p
          ON p.span_id = s.parent_span_id
        WHERE s.run_id = {run:String} AND s.lane IN ('server/execute', 'server/queue')
        GROUP BY host, pid, lane, b ORDER BY host, pid, lane, b
        """,
        {"run": run_id, "t0": t0, "bucket": bucket},
    )
    names: dict[str, dict[str, Any]] = {}

    def tenant_of(host: str, pid: int) -> str:
        session = pid_session.get((host, pid))
        key = f"session {session}" if session else f"client {host}:{pid}"
        entry = names.setdefault(key, {"key": key, "session": session or "", "pid": pid})
        entry["label"] = f"{key} (client pid {pid} on {host})" if session else key
        return key

    busy, queue = [], []
    for r in server:
        tenant = tenant_of(r["host"], int(r["pid"]))
        ts = t0 + int(r["b"]) * bucket
        if r["lane"] == "server/execute":
            busy.append({"tenant": tenant, "ts_ns": ts, "share": int(r["ns"]) / bucket})
        else:
            mean = int(r["ns"]) // max(1, int(r["n"]))
            queue.append({"tenant": tenant, "ts_ns": ts, "mean_ns": mean, "max_ns": r["max_ns"]})
    by_metric: dict[str, list[dict[str, Any]]] = {}
    for r in counter_rows:
        names.setdefault(
            r["tenant"], {"key": r["tenant"], "label": r["tenant"], "session": r["session"]}
        )
        by_metric.setdefault(r["metric"], []).append(
            {"tenant": r["tenant"], "ts_ns": r["ts_ns"], "value": r["value"]}
        )
    return {
        "tenants": sorted(names.values(), key=lambda t: t["key"]),
        "counters": by_metric,
        "busy": busy,
        "queue": queue,
        "bucket_ns": bucket,
        "missing": [m for m in TENANT_METRICS if m not in by_metric],
    }


# ---- compare -------------------------------------------------------------------------------------


def _step_stats(steps: list[dict[str, Any]]) -> dict[str, Any]:
    durs = sorted(int(s["dur_ns"]) for s in steps)
    if not durs:
        return {"count": 0, "mean_ns": 0, "median_ns": 0, "p90_ns": 0}
    return {
        "count": len(durs),
        "mean_ns": sum(durs) // len(durs),
        "median_ns": durs[len(durs) // 2],
        "p90_ns": durs[min(len(durs) - 1, (len(durs) * 9) // 10)],
    }


def compare(source: Source, a: str, b: str, top: int = 15) -> dict[str, Any]:
    """Two runs side by side: step statistics, top ranges by total time, forwarding breakdown.

    ``ops`` rows are ``name, a_ns, b_ns, delta_ns`` for the union of each run's top names (summed
    over lanes); ``breakdown`` rows are ``part, a_ns, b_ns, delta_ns``.
    """
    out: dict[str, Any] = {"a": a, "b": b, "steps": {}, "step_series": {}}
    totals: dict[str, dict[str, int]] = {}
    fwd: dict[str, dict[str, int]] = {}
    for key, run_id in (("a", a), ("b", b)):
        steps = step_times(source, run_id)
        out["steps"][key] = _step_stats(steps)
        out["step_series"][key] = steps
        per_name: dict[str, int] = {}
        for lane in source.call("summary", run_id, top=top)["lanes"]:
            for r in lane["by_total"]:
                per_name[r["name"]] = per_name.get(r["name"], 0) + int(r["total_ns"])
        totals[key] = per_name
        fwd[key] = source.call("forwarding", run_id, top=1)["totals"]
    names = sorted(
        set(totals["a"]) | set(totals["b"]),
        key=lambda n: -max(totals["a"].get(n, 0), totals["b"].get(n, 0)),
    )[:top]
    out["ops"] = [
        {
            "name": n,
            "a_ns": totals["a"].get(n, 0),
            "b_ns": totals["b"].get(n, 0),
            "delta_ns": totals["b"].get(n, 0) - totals["a"].get(n, 0),
        }
        for n in names
    ]
    out["breakdown"] = [
        {
            "part": part.removesuffix("_ns"),
            "a_ns": int(fwd["a"].get(part, 0)),
            "b_ns": int(fwd["b"].get(part, 0)),
            "delta_ns": int(fwd["b"].get(part, 0)) - int(fwd["a"].get(part, 0)),
        }
        for part in ("client_ns", "wire_ns", "queue_ns", "execute_ns")
    ]
    return out
