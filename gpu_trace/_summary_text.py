"""A run's summary as text: what `gpu-trace show` prints and ``Run.summary()`` shows.

It formats a :class:`~gpu_trace.query.summary.RunSummary` (every number is computed there) and
the run's row; the CLI and the notebook API both call :func:`render_summary`.
"""

from __future__ import annotations

from typing import Any

from gpu_trace import _format as fmt
from gpu_trace.query.distributed import RankSummary
from gpu_trace.query.summary import CounterStats, RunSummary

#: What the samplers' own metrics are, said above their table.
SAMPLER_NOTE = "the samplers' own metrics (call_us.<family>: mean µs of an NVML call, per second)"


def wall_ns(run: dict[str, Any]) -> int | None:
    """The run's start as wall-clock ns (from the anchors its recorder stored), None if unknown."""
    attrs = run.get("attrs") or {}
    try:
        return int(run["started_ns"]) - int(attrs["anchor_mono_ns"]) + int(attrs["anchor_wall_ns"])
    except (KeyError, ValueError, TypeError):
        return None


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _share(value: float) -> str:
    return f"{100 * value:.1f}%"


def render_summary(run: dict[str, Any], summary: RunSummary) -> str:
    """The run's header, step-time distribution per step kind, lanes with their busy time, the top
    range names per lane, counters, and the samplers' own metrics."""
    from gpu_trace.tracer.run import describe_recording

    lines = []
    dur = (run.get("ended_ns") or 0) - (run.get("started_ns") or 0)
    lines.append(
        f"run {run['run_id']}  {run.get('status', '')}  {fmt.wall_time(wall_ns(run))}  "
        f"{fmt.duration(dur) if dur > 0 else ''}".rstrip()
    )
    reason = (run.get("attrs") or {}).get("reason")
    if reason and run.get("status") != "finished":
        lines.append(f"status: {run.get('status', '')}: {reason}")
    lines.append(f"command: {run.get('command', '')}")
    lines.append(f"trace id: {run.get('trace_id', '')}  hosts: {','.join(run.get('hosts') or [])}")
    attrs = run.get("attrs") or {}
    for key in sorted(k for k in attrs if k.startswith("clock.")):  # a job's other hosts
        lines.append(f"clock of {key.removeprefix('clock.')}: {attrs[key]}")
    lines.append(f"recording: {describe_recording(run.get('attrs') or {})}")
    lines.append(
        f"events: {fmt.count(summary.events)} ({fmt.count(int(run.get('spans') or 0))} spans, "
        f"{fmt.count(int(run.get('counters') or 0))} counter samples)"
    )
    if summary.steps:
        lines += ["", "step times"]
        rows = [
            [clip(s.kind, 40), fmt.count(s.count), fmt.duration(s.p50_ns),
             fmt.duration(s.p90_ns), fmt.duration(s.mean_ns), fmt.duration(s.max_ns)]
            for s in summary.steps
        ]  # fmt: skip
        lines.append(
            fmt.table(["STEP", "COUNT", "P50", "P90", "MEAN", "MAX"], rows, right={1, 2, 3, 4, 5})
        )
    if summary.lanes:
        lines += ["", "lanes (busy: time covered by the lane's spans, nested ones counted once)"]
        rows = [
            [clip(lane.lane, 40), fmt.count(lane.spans), fmt.duration(lane.busy_ns),
             _share(lane.share)]
            for lane in summary.lanes
        ]  # fmt: skip
        lines.append(fmt.table(["LANE", "SPANS", "BUSY", "OF RUN"], rows, right={1, 2, 3}))
    for lane in summary.lanes:
        lines += ["", f"{lane.lane}  ({fmt.count(lane.spans)} spans)"]
        rows = [
            [clip(r.name, 48), fmt.count(r.count), fmt.duration(r.total_ns),
             fmt.duration(r.self_ns), fmt.duration(r.median_ns), fmt.duration(r.max_ns),
             _share(r.share)]
            for r in lane.ranges
        ]  # fmt: skip
        lines.append(
            fmt.table(
                ["NAME", "COUNT", "TOTAL", "SELF", "MEDIAN", "MAX", "OF RUN"],
                rows,
                right={1, 2, 3, 4, 5, 6},
            )
        )
    hosts = len(run.get("hosts") or []) > 1  # counters say their host when there are several
    if summary.counters:
        lines += ["", "counters", _counter_table(summary.counters, hosts)]
    if summary.sampler:
        lines += ["", SAMPLER_NOTE, _counter_table(summary.sampler, hosts)]
    return "\n".join(lines)


def _counter_table(counters: list[CounterStats], hosts: bool = False) -> str:
    rows = [
        [*([clip(c.host, 24)] if hosts else []), c.source, c.device or "-", c.metric,
         fmt.count(c.count), f"{c.min:.4g}", f"{c.mean:.4g}", f"{c.max:.4g}"]
        for c in counters
    ]  # fmt: skip
    head = ["SOURCE", "DEVICE", "METRIC", "SAMPLES", "MIN", "MEAN", "MAX"]
    first = 1 if hosts else 0
    return fmt.table(
        (["HOST"] if hosts else []) + head, rows, right={3 + first, 4 + first, 5 + first, 6 + first}
    )


def _of_step(ns: int, step_ns: int) -> list[str]:
    return [fmt.duration(ns), f"{100 * ns / step_ns:.0f}" if step_ns > 0 else "-"]


def render_ranks(ranks: RankSummary) -> str:
    """A distributed run's Ranks section: each rank's process, host and busy time, its
    collectives and the waiting it did; per rank, its steps' computation, communication, overlap
    and idle time, and how often it entered a collective last and the waiting that caused; the
    collectives per kind with their skew; the straggler (tracer/ranks.py has the definitions)."""
    head = f"ranks (world size {ranks.world_size}"
    head += f", backend {ranks.backend}" if ranks.backend else ""
    head += f", job {clip(ranks.job, 40)})" if ranks.job else ")"
    lines = ["", head]
    kernels = any(r.kernel_overlap is not None for r in ranks.ranks)  # a GPU run with NCCL
    rows = [
        [str(r.rank), "-" if r.local_rank is None else str(r.local_rank),
         "-" if r.node is None else str(r.node), clip(r.host, 24),
         ",".join(str(p) for p in r.pids), fmt.duration(r.busy_ns), fmt.count(r.collectives),
         fmt.duration(r.waited_ns),
         *([] if not kernels else
           ["-" if r.kernel_overlap is None else f"{100 * r.kernel_overlap:.1f}%"])]
        for r in ranks.ranks
    ]  # fmt: skip
    heads = ["RANK", "LOCAL", "NODE", "HOST", "PID", "BUSY", "COLLECTIVES", "WAITED"]
    lines.append(
        fmt.table(heads + (["NCCL OVERLAP"] if kernels else []), rows, right={0, 1, 2, 5, 6, 7, 8})
    )
    if any(r.steps for r in ranks.ranks):
        lines += [
            "",
            "steps per rank (sums over its steps, % of them; LAST: collectives it entered last, "
            "CAUSED: the others' wait for it)",
        ]
        rows = [
            [str(r.rank), fmt.count(r.steps), fmt.duration(r.step_ns),
             fmt.duration(r.step_ns // max(1, r.steps)), *_of_step(r.compute_ns, r.step_ns),
             *_of_step(r.comm_ns, r.step_ns), *_of_step(r.overlap_ns, r.step_ns),
             *_of_step(r.idle_ns, r.step_ns), fmt.count(r.entered_last),
             fmt.duration(r.caused_ns)]
            for r in ranks.ranks
        ]  # fmt: skip
        heads = ["RANK", "STEPS", "STEP TIME", "MEAN", "COMPUTE", "%", "COMM", "%", "OVERLAP",
                 "%", "IDLE", "%", "LAST", "CAUSED"]  # fmt: skip
        lines.append(fmt.table(heads, rows, right=set(range(14))))
    if ranks.collectives:
        lines += ["", "collectives (skew: the last rank to enter minus the first, per collective)"]
        rows = [
            [c.op, fmt.count(c.count), " ".join(f"{r}:{n}" for r, n in c.calls.items()),
             fmt.duration(c.total_ns), fmt.duration(c.skew_sum_ns), fmt.duration(c.skew_max_ns)]
            for c in ranks.collectives
        ]  # fmt: skip
        lines.append(
            fmt.table(
                ["COLLECTIVE", "COUNT", "CALLS PER RANK", "TOTAL", "SKEW SUM", "SKEW MAX"],
                rows,
                right={1, 3, 4, 5},
            )
        )
    if ranks.straggler is not None:
        lines.append(
            f"straggler: rank {ranks.straggler}, last to enter {fmt.count(ranks.straggler_last)} "
            f"collectives; the others waited {fmt.duration(ranks.straggler_wait_ns)} for it"
        )
    if ranks.step_stragglers:
        shown = sorted(ranks.step_stragglers, key=lambda s: -s.caused_ns)[:STEP_STRAGGLERS]
        lines += [
            "",
            f"stragglers per step (the {len(shown)} steps with the most waiting of "
            f"{len(ranks.step_stragglers)}; CAUSED: the others' wait for it in the step)",
        ]
        rows = [
            [str(s.step), str(s.rank), fmt.count(s.entered_last), fmt.duration(s.caused_ns),
             " ".join(f"{r}:{fmt.duration(ns)}" for r, ns in s.caused.items())]
            for s in sorted(shown, key=lambda s: s.step)
        ]  # fmt: skip
        lines.append(
            fmt.table(["STEP", "RANK", "LAST", "CAUSED", "BY RANK"], rows, right={0, 1, 2, 3})
        )
    return "\n".join(lines)


#: How many steps' stragglers `show` lists (those with the most waiting).
STEP_STRAGGLERS = 10
