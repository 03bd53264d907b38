"""Charts of a distributed run's ranks (the dashboard's Ranks tab), from
:class:`~gpu_trace.query.distributed.RankSummary`: where each rank's step time went, and each
rank's communication step by step (a straggler's partners wait in theirs).

Plain functions to plotly figures; every name drawn is HTML-escaped. Durations go in as integer ns
and are drawn in ms.
"""

from __future__ import annotations

import plotly.graph_objects as go

from gpu_trace.plots.charts import layout
from gpu_trace.plots.figures import empty
from gpu_trace.query.distributed import RankSummary

#: A rank's step time in four parts that add up to it: computation alone, communication alone,
#: both at once, neither.
PARTS = (
    ("compute only", "#1f77b4"),
    ("communication only", "#d62728"),
    ("overlap", "#9467bd"),
    ("idle", "#c7c7c7"),
)


def step_time(summary: RankSummary) -> go.Figure:
    """Per rank, its steps' time summed and split into computation alone, communication alone,
    overlap and idle (stacked bars that add up to the rank's step time)."""
    ranks = [r for r in summary.ranks if r.steps]
    if not ranks:
        return empty("no steps on the ranks (ProfilerStep#N or gpu_trace.step)")
    parts = [
        [(r.compute_ns - r.overlap_ns) / 1e6 for r in ranks],
        [(r.comm_ns - r.overlap_ns) / 1e6 for r in ranks],
        [r.overlap_ns / 1e6 for r in ranks],
        [r.idle_ns / 1e6 for r in ranks],
    ]
    x = [f"rank {r.rank}" for r in ranks]
    fig = go.Figure(
        [
            go.Bar(x=x, y=ys, name=name, marker_color=color,
                   hovertemplate=f"%{{x}}: {name} %{{y:.2f}} ms<extra></extra>")
            for (name, color), ys in zip(PARTS, parts)
        ]
    )  # fmt: skip
    fig.update_yaxes(title_text="ms over its steps", rangemode="tozero")
    return layout(fig, "where each rank's step time went", barmode="stack")


def comm_per_step(summary: RankSummary) -> go.Figure:
    """Each rank's communication (its collective calls and NCCL kernels, its waiting included)
    step by step: the ranks that wait for a straggler have the tall lines."""
    if not summary.steps:
        return empty("no steps on the ranks (ProfilerStep#N or gpu_trace.step)")
    by_rank: dict[int, list[tuple[int, float]]] = {}
    for s in summary.steps:
        by_rank.setdefault(s.rank, []).append((s.step, s.comm_ns / 1e6))
    fig = go.Figure(
        [
            go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], name=f"rank {rank}",
                       mode="lines+markers",
                       hovertemplate=f"rank {rank}, step %{{x}}: %{{y:.2f}} ms<extra></extra>")
            for rank, points in sorted(by_rank.items())
        ]
    )  # fmt: skip
    steps = max(len(points) for points in by_rank.values())
    fig.update_xaxes(title_text="step", nticks=min(11, steps), tickformat="d")
    fig.update_yaxes(title_text="ms", rangemode="tozero")
    return layout(fig, "communication per step (ms, waiting included)")
