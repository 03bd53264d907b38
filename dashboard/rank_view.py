"""The Ranks tab: a distributed run's ranks as `gpu-trace show` prints them (one
:class:`~gpu_trace.query.distributed.RankSummary`), with charts of where each rank's step time
went and of each rank's communication per step.

Plain functions to component trees; names from the store are text (Dash escapes them).
"""

from __future__ import annotations

from dash import dcc, html

from gpu_trace import _format as fmt
from gpu_trace.dashboard.panels import message, table
from gpu_trace.plots import rank_charts
from gpu_trace.query.distributed import RankSummary

NO_RANKS = (
    "This run has no ranks: no process of it carried a rank (torchrun, mpirun, srun or "
    "torch.distributed set none). docs/distributed.md says how a job is recorded."
)
#: Steps listed in the per-step straggler table (those with the most waiting).
STEP_STRAGGLERS = 10


def _share(ns: int, of: int) -> str:
    return f"{fmt.duration(ns)} ({100 * ns / of:.0f}%)" if of > 0 else fmt.duration(ns)


def ranks(summary: RankSummary | None) -> html.Div:
    """The Ranks tab of one run (a note when it has no ranks)."""
    if summary is None or not summary.ranks:
        return html.Div(message(NO_RANKS, "note"), id="ranks-none")
    head = f"world size {summary.world_size}"
    head += f", backend {summary.backend}" if summary.backend else ""
    head += f", job {summary.job}" if summary.job else ""
    kernels = any(r.kernel_overlap is not None for r in summary.ranks)
    rows = [
        [str(r.rank), r.host, ",".join(str(p) for p in r.pids), fmt.duration(r.busy_ns),
         fmt.count(r.collectives), fmt.duration(r.waited_ns), fmt.count(r.entered_last),
         fmt.duration(r.caused_ns),
         *([] if not kernels else
           ["-" if r.kernel_overlap is None else f"{100 * r.kernel_overlap:.1f}%"])]
        for r in summary.ranks
    ]  # fmt: skip
    heads = ["rank", "host", "pid", "busy", "collectives", "waited", "last", "caused"]
    parts: list = [
        html.P(head),
        html.Div(table(heads + (["NCCL overlap"] if kernels else []), rows), id="ranks-table"),
    ]
    if summary.straggler is not None:
        parts.append(
            html.P(
                f"straggler: rank {summary.straggler}, last to enter "
                f"{fmt.count(summary.straggler_last)} collectives; the others waited "
                f"{fmt.duration(summary.straggler_wait_ns)} for it",
                id="ranks-straggler",
            )
        )
    stepped = [r for r in summary.ranks if r.steps]
    if stepped:
        rows = [
            [str(r.rank), fmt.count(r.steps), fmt.duration(r.step_ns),
             _share(r.compute_ns, r.step_ns), _share(r.comm_ns, r.step_ns),
             _share(r.overlap_ns, r.step_ns), _share(r.idle_ns, r.step_ns)]
            for r in stepped
        ]  # fmt: skip
        heads = ["rank", "steps", "step time", "compute", "comm", "overlap", "idle"]
        parts += [
            html.H4("steps per rank"),
            html.Div(table(heads, rows), id="ranks-steps-table"),
            dcc.Graph(figure=rank_charts.step_time(summary), id="ranks-step-time"),
            dcc.Graph(figure=rank_charts.comm_per_step(summary), id="ranks-comm"),
        ]
    if summary.collectives:
        rows = [
            [c.op, fmt.count(c.count), " ".join(f"{r}:{n}" for r, n in c.calls.items()),
             fmt.duration(c.total_ns), fmt.duration(c.skew_sum_ns), fmt.duration(c.skew_max_ns)]
            for c in summary.collectives
        ]  # fmt: skip
        heads = ["collective", "count", "calls per rank", "total", "skew sum", "skew max"]
        parts += [html.H4("collectives"), html.Div(table(heads, rows), id="ranks-collectives")]
    if summary.step_stragglers:
        shown = sorted(summary.step_stragglers, key=lambda s: -s.caused_ns)[:STEP_STRAGGLERS]
        rows = [
            [str(s.step), str(s.rank), fmt.count(s.entered_last), fmt.duration(s.caused_ns),
             " ".join(f"{r}:{fmt.duration(ns)}" for r, ns in s.caused.items())]
            for s in sorted(shown, key=lambda s: s.step)
        ]  # fmt: skip
        parts += [
            html.H4(f"stragglers per step (the {len(shown)} with the most waiting)"),
            html.Div(table(["step", "rank", "last", "caused", "by rank"], rows),
                     id="ranks-step-stragglers"),
        ]  # fmt: skip
    return html.Div(parts, id="ranks-view")
