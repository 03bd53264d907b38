"""Charts of the Summary, Tenants and Compare tabs, from what :mod:`.reports` returns.

Plain functions to plotly figures; every name drawn is HTML-escaped (:func:`figures.esc`).
Durations go in as integer ns and are drawn in ms.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from gpu_trace.dashboard.figures import empty, esc

PARTS = (
    ("client_ns", "client", "#ff7f0e"),
    ("wire_ns", "wire", "#7f7f7f"),
    ("queue_ns", "queue", "#bcbd22"),
    ("execute_ns", "execute", "#d62728"),
)


def _layout(fig: go.Figure, title: str, height: int = 320, **extra: Any) -> go.Figure:
    fig.update_layout(
        title={"text": esc(title), "font": {"size": 14}},
        height=height,
        margin={"l": 10, "r": 10, "t": 40, "b": 30},
        plot_bgcolor="white",
        legend={"orientation": "h"},
        **extra,
    )
    return fig


def _ms(ns: Any) -> float:
    return int(ns) / 1e6


def top_self(rows: list[dict[str, Any]]) -> go.Figure:
    """Top ranges by self time, with total time behind them."""
    if not rows:
        return empty("no ranges in this run")
    rows = rows[::-1]
    labels = [esc(f"{r['name']} · {r['lane']}") for r in rows]
    fig = go.Figure(
        [
            go.Bar(orientation="h", y=labels, x=[_ms(r["total_ns"]) for r in rows], name="total",
                   marker_color="#c6dbef"),
            go.Bar(orientation="h", y=labels, x=[_ms(r["self_ns"]) for r in rows], name="self",
                   marker_color="#1f77b4"),
        ]
    )  # fmt: skip
    return _layout(
        fig, "top ranges by self time (ms)", height=120 + 18 * len(rows), barmode="overlay"
    )


def module_tree(modules: dict[str, Any]) -> go.Figure:
    """The module tree as an icicle: each box is a module path, sized by its total time."""
    nodes = modules["nodes"]
    if not nodes:
        return empty("no module ranges in this run (PyTorch --torch module or op records them)")
    fig = go.Figure(
        go.Icicle(
            ids=[esc(n["path"]) for n in nodes],
            labels=[esc(n["name"]) for n in nodes],
            parents=[esc(n["parent"]) for n in nodes],
            values=[_ms(n["total_ns"]) for n in nodes],
            customdata=[n["count"] for n in nodes],
            branchvalues="total",
            hovertemplate="%{label}<br>%{value:.3f} ms in %{customdata} calls<extra></extra>",
            root_color="white",
        )
    )
    return _layout(fig, "module tree (total ms)", height=420)


def forwarding(fwd: dict[str, Any]) -> go.Figure:
    """Where forwarded time went per op: client, wire, queue, execute (stacked)."""
    ops = fwd.get("ops") or []
    if not ops:
        return empty("this run forwarded nothing (gpu-trace record --remote records forwarding)")
    ops = ops[::-1]
    names = [esc(o["name"]) for o in ops]
    bad = sum(1 for o in ops for key, _, _ in PARTS if int(o[key]) < 0)
    # A negative part means malformed spans (an unfinished send has end_ns 0): drawn as 0, and said.
    ops = [{**o, **{k: max(0, int(o[k])) for k, _, _ in PARTS}} for o in ops]
    fig = go.Figure(
        [
            go.Bar(orientation="h", y=names, x=[_ms(o[key]) for o in ops], name=label,
                   marker_color=color)
            for key, label, color in PARTS
        ]
    )  # fmt: skip
    title = "forwarded time per op (ms)"
    if bad:
        title += f" ({bad} negative values from malformed spans drawn as 0)"
    return _layout(fig, title, height=140 + 18 * len(ops), barmode="stack")


def steps(rows: list[dict[str, Any]]) -> go.Figure:
    """Step durations over the run, one line per process."""
    if not rows:
        return empty("no steps in this run")
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_pid.setdefault(int(r["pid"]), []).append(r)
    fig = go.Figure(
        [
            go.Scatter(
                x=[r["index"] for r in rs],
                y=[_ms(r["dur_ns"]) for r in rs],
                text=[esc(r["name"]) for r in rs],
                mode="lines+markers",
                name=f"pid {pid}",
                hovertemplate="%{text}: %{y:.2f} ms<extra></extra>",
            )
            for pid, rs in sorted(by_pid.items())
        ]
    )
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="ms", rangemode="tozero")
    return _layout(fig, "step times")


# ---- tenants -------------------------------------------------------------------------------------


def tenant_lines(data: dict[str, Any], metric: str, title: str, scale: float = 1.0) -> go.Figure:
    """One runtime counter per tenant over time (seconds since ``t0``)."""
    rows = data["counters"].get(metric) or []
    if not rows:
        return empty(f"no {metric} counters in this run")
    t0 = min(int(r["ts_ns"]) for r in rows)
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(r["tenant"], []).append(r)
    fig = go.Figure(
        [
            go.Scatter(
                x=[(int(r["ts_ns"]) - t0) / 1e9 for r in rs],
                y=[float(r["value"]) / scale for r in rs],
                mode="lines+markers",
                line_shape="hv",
                name=esc(tenant),
            )
            for tenant, rs in sorted(series.items())
        ]
    )
    fig.update_xaxes(title_text="s")
    return _layout(fig, title, height=280)


def tenant_busy(data: dict[str, Any]) -> go.Figure:
    """Each tenant's share of the server's execute time per bucket (stacked)."""
    if not data["busy"]:
        return empty("no server execute spans (no forwarded work in this run)")
    return _tenant_series(
        data, data["busy"], "share", 1.0, "busy share of the server (execute time / time)", True
    )


def tenant_queue(data: dict[str, Any]) -> go.Figure:
    """Mean queue wait of each tenant's batches per bucket."""
    if not data["queue"]:
        return empty("no server queue spans (no forwarded work in this run)")
    return _tenant_series(data, data["queue"], "mean_ns", 1e6, "queue wait per batch (ms)", False)


def _tenant_series(
    data: dict[str, Any], rows: list[dict], key: str, scale: float, title: str, stack: bool
) -> go.Figure:
    t0 = min(int(r["ts_ns"]) for r in rows)
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(r["tenant"], []).append(r)
    fig = go.Figure(
        [
            go.Scatter(
                x=[(int(r["ts_ns"]) - t0) / 1e9 for r in rs],
                y=[float(r[key]) / scale for r in rs],
                mode="lines",
                stackgroup="one" if stack else None,
                name=esc(tenant),
            )
            for tenant, rs in sorted(series.items())
        ]
    )
    fig.update_xaxes(title_text="s")
    return _layout(fig, title, height=280)


# ---- compare -------------------------------------------------------------------------------------


def compare_steps(data: dict[str, Any]) -> go.Figure:
    fig = go.Figure()
    for key in ("a", "b"):
        rows = data["step_series"][key]
        fig.add_trace(
            go.Scatter(
                x=list(range(len(rows))),
                y=[_ms(r["dur_ns"]) for r in rows],
                mode="lines+markers",
                name=esc(f"{key}: {data[key]}"),
            )
        )
    fig.update_yaxes(title_text="ms", rangemode="tozero")
    return _layout(fig, "step times, side by side")


def compare_bars(rows: list[dict[str, Any]], label: str, names: tuple[str, str], title: str):
    if not rows:
        return empty("nothing to compare")
    ys = [esc(r[label]) for r in rows][::-1]
    fig = go.Figure(
        [
            go.Bar(orientation="h", y=ys, x=[_ms(r[f"{k}_ns"]) for r in rows][::-1],
                   name=esc(f"{k}: {n}"))
            for k, n in zip(("a", "b"), names)
        ]
    )  # fmt: skip
    return _layout(fig, title, height=140 + 22 * len(rows), barmode="group")
