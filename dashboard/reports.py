"""Whole-run reports: Summary (top ranges, module tree, forwarding, steps), Tenants and Compare.

What each tab shows, put together from :mod:`gpu_trace.query`'s reads (the tenants' from
:mod:`gpu_trace.query.tenancy`, the module tree from :mod:`gpu_trace.query.module_tree`, GPU
work from :mod:`gpu_trace.query.gpu_work`); the charts are in :mod:`gpu_trace.plots.charts`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from gpu_trace.dashboard.readonly_store import ReadOnlyStore
from gpu_trace.query import gpu_work, reads
from gpu_trace.query import summary as summaries
from gpu_trace.query.module_tree import module_tree
from gpu_trace.query.summary import RunSummary, run_summary
from gpu_trace.query.tenancy import (
    CUMULATIVE,
    EVENT_LANES,
    NO_TENANT,
    TENANT_METRICS,
    tenants,
)

__all__ = [
    "CUMULATIVE",
    "EVENT_LANES",
    "NO_TENANT",
    "TENANT_METRICS",
    "compare",
    "module_tree",
    "step_times",
    "summary",
    "tenants",
    "top_ranges",
]


def top_ranges(summary: RunSummary, top: int = 25) -> dict[str, list[dict[str, Any]]]:
    """The summary's top range names over every lane, by total and by self time, as rows."""

    def rows(by: str) -> list[dict[str, Any]]:
        return [{**asdict(r), "mean_ns": r.mean_ns} for r in summary.top(by, top)]

    return {"by_total": rows("total"), "by_self": rows("self")}


def step_times(source: ReadOnlyStore, run_id: str) -> list[dict[str, Any]]:
    """Steps of a run in order: ``name, pid, index, start_ns, dur_ns`` (index per process)."""
    return summaries.step_times(source, run_id)


def summary(source: ReadOnlyStore, run_id: str, top: int = 25) -> dict[str, Any]:
    """Everything the Summary tab shows."""
    base = run_summary(source, run_id, top=top)
    fwd = reads.forwarding(source, run_id, top=top)
    if fwd.get("ops"):
        # Each forwarded op's GPU time: the device work under its server op spans, by parent
        # links (gpu_work.op_gpu_time); None when the server recorded no GPU activity.
        gpu = gpu_work.op_gpu_time(source, run_id)
        for op in fwd["ops"]:
            op["gpu_ns"] = gpu.get(op["name"], 0) if gpu else None
        fwd["totals"]["gpu_ns"] = sum(gpu.values()) if gpu else None
    return {
        "run": base,
        "top": top_ranges(base, top),
        "modules": module_tree(source, run_id),
        "forwarding": fwd,
        "steps": step_times(source, run_id),
        "kernels": gpu_work.top_kernels(source, run_id, top),
        "gpu_steps": gpu_work.busy_per_step(
            source,
            run_id,
            source.cached(("gpu_intervals", run_id), lambda: gpu_work.intervals(source, run_id)),
        ),
    }


# ---- compare -------------------------------------------------------------------------------------


def _step_stats(summary: RunSummary) -> dict[str, Any]:
    """The distribution of the run's most frequent kind of step (the summary's numbers)."""
    main = max(summary.steps, key=lambda k: k.count, default=None)
    if main is None:
        return {"count": 0, "mean_ns": 0, "median_ns": 0, "p90_ns": 0}
    return {"count": main.count, "mean_ns": main.mean_ns, "median_ns": main.p50_ns,
            "p90_ns": main.p90_ns}  # fmt: skip


def compare(source: ReadOnlyStore, a: str, b: str, top: int = 15) -> dict[str, Any]:
    """Two runs side by side: step statistics, top ranges by total time, forwarding breakdown.

    ``ops`` rows are ``name, a_ns, b_ns, delta_ns`` for the union of each run's top names (summed
    over lanes); ``breakdown`` rows are ``part, a_ns, b_ns, delta_ns``.
    """
    out: dict[str, Any] = {"a": a, "b": b, "steps": {}, "step_series": {}}
    totals: dict[str, dict[str, int]] = {}
    fwd: dict[str, dict[str, int]] = {}
    for key, run_id in (("a", a), ("b", b)):
        summary = run_summary(source, run_id, top=top)
        out["steps"][key] = _step_stats(summary)
        out["step_series"][key] = step_times(source, run_id)
        per_name: dict[str, int] = {}
        for lane in summary.lanes:
            for r in lane.ranges:
                per_name[r.name] = per_name.get(r.name, 0) + r.total_ns
        totals[key] = per_name
        fwd[key] = reads.forwarding(source, run_id, top=1)["totals"]
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
