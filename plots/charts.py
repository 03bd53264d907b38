"""Charts of the dashboard's Summary, Tenants and Compare tabs, from what the query layer returns
(:mod:`gpu_trace.query.tenancy`, :mod:`gpu_trace.query.gpu_work`, the dashboard's reports).

Plain functions to plotly figures; every name drawn is HTML-escaped (:func:`figures.esc`).
Durations go in as integer ns and are drawn in ms.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from gpu_trace import _format as fmt
from gpu_trace.plots.figures import empty, esc
from gpu_trace.query.gpu_work import StepBusy, device_lane, short_kernel_name
from gpu_trace.query.tenancy import TenantBusy, TenantEvent, TenantQueue, Tenants

PARTS = (
    ("client_ns", "client", "#ff7f0e"),
    ("wire_ns", "wire", "#7f7f7f"),
    ("queue_ns", "queue", "#bcbd22"),
    ("execute_ns", "execute", "#d62728"),
)


def layout(fig: go.Figure, title: str, height: int = 320, **extra: Any) -> go.Figure:
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
    # Kernel names are long C++: their short form (gpu_work.short_kernel_name) on device lanes.
    labels = [
        esc(
            f"{short_kernel_name(r['name']) if device_lane(r['lane']) else r['name']} · {r['lane']}"
        )
        for r in rows
    ]
    fig = go.Figure(
        [
            go.Bar(orientation="h", y=labels, x=[_ms(r["total_ns"]) for r in rows], name="total",
                   marker_color="#c6dbef"),
            go.Bar(orientation="h", y=labels, x=[_ms(r["self_ns"]) for r in rows], name="self",
                   marker_color="#1f77b4"),
        ]
    )  # fmt: skip
    return layout(
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
    return layout(fig, "module tree (total ms)", height=420)


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
    if any(o.get("gpu_ns") is not None for o in ops):
        # GPU time is part of execute: a marker on each op's bar, not a part of the stack.
        fig.add_trace(
            go.Scatter(x=[_ms(o.get("gpu_ns") or 0) for o in ops], y=names, mode="markers",
                       name="GPU time (server kernels, copies, memsets)",
                       marker={"symbol": "diamond", "color": "#8c564b", "size": 9},
                       hovertemplate="%{y}: GPU %{x:.3f} ms<extra></extra>")
        )  # fmt: skip
    title = "forwarded time per op (ms)"
    if bad:
        title += f" ({bad} negative values from malformed spans drawn as 0)"
    return layout(fig, title, height=140 + 18 * len(ops), barmode="stack")


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
    return layout(fig, "step times")


# ---- tenants -------------------------------------------------------------------------------------

#: One colour per tenant, the same in every chart of the tab (plotly's default sequence).
TENANT_COLORS = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)  # fmt: skip
_MIB = float(1 << 20)
#: Hover text of a line: its (escaped) trace name, never a name pasted into the template, where a
#: ``%{...}`` in a tenant's name would be read as a field.
_HOVER = "%{fullData.name}: %{y:.4g}"


def _colors(data: Tenants) -> dict[str, str]:
    keys = [t["key"] for t in data["tenants"]]
    return {k: TENANT_COLORS[i % len(TENANT_COLORS)] for i, k in enumerate(keys)}


def _since(data: Tenants, ts: Any) -> float:
    """Seconds since the run started (the timeline's +time)."""
    return (int(ts) - int(data["run_ns"][0])) / 1e9


def _tenant_layout(fig: go.Figure, data: Tenants, title: str, **extra: Any) -> go.Figure:
    """Every tenant chart on the same x range: the tenants' activity, in seconds since the run
    started (as the timeline counts); legend entries in the tenants' order."""
    lo, hi = (_since(data, t) for t in data["range_ns"])
    pad = (hi - lo) * 0.01
    fig.update_xaxes(ticksuffix=" s", range=[lo - pad, hi + pad])
    fig = layout(fig, title, height=300, **extra)
    fig.update_layout(legend_traceorder="normal")
    return fig


def _step_line(
    data: Tenants,
    points: list[tuple[int, float]],
    name: str,
    color: str,
    scale: float = 1.0,
    unit: str = "",
    mode: str = "lines",
    **line: Any,
) -> go.Scatter:
    """A counter as a step line (a value holds until the next sample); ``name`` is escaped."""
    return go.Scatter(
        x=[_since(data, t) for t, _ in points],
        y=[v / scale for _, v in points],
        name=esc(name),
        mode=mode,
        line={"shape": "hv", "color": color, **line},
        hovertemplate=f"{_HOVER}{unit}<extra></extra>",
    )


def tenant_memory(data: Tenants) -> go.Figure:
    """Memory each tenant holds (solid) and has on the device (dotted) against its quota (dashed).

    The y axis is logarithmic when every peak is under a twentieth of the largest quota (memory
    would be a flat line at the bottom); two buttons switch.
    """
    colors = _colors(data)
    fig = go.Figure()
    peak = top_quota = 0.0
    for tenant, series in sorted(data["memory"].items()):
        color, quota = colors.get(tenant, "#333"), series["quota"]
        if series["held"]:
            peak = max(peak, *(v for _, v in series["held"]))
            name = f"{tenant} held" + ("" if quota else " (no quota)")
            fig.add_trace(_step_line(data, series["held"], name, color, scale=_MIB,
                                     unit=" MiB", mode="lines+markers"))  # fmt: skip
        if series["resident"]:
            fig.add_trace(_step_line(data, series["resident"], f"{tenant} on the device", color,
                                     scale=_MIB, unit=" MiB", dash="dot", width=1))  # fmt: skip
        if quota:
            top_quota = max(top_quota, *(v for _, v in quota))
            name = f"{tenant} quota {fmt.size(int(quota[-1][1]))}"
            fig.add_trace(
                _step_line(data, quota, name, color, scale=_MIB, unit=" MiB", dash="dash")
            )
    if not fig.data:
        return empty("no memory counters in this run")
    log = top_quota > 0 and peak < top_quota / 20
    # Log ticks at powers of 32 bytes, named in binary units (plotly's own would say "100µ" MiB).
    exponents = range(0, 46, 5)
    scales = {
        "linear": {"yaxis.type": "linear", "yaxis.tickmode": "auto", "yaxis.title.text": "MiB"},
        "log": {"yaxis.type": "log", "yaxis.tickmode": "array", "yaxis.title.text": ""},
    }
    fig.update_yaxes(
        tickvals=[2.0 ** (e - 20) for e in exponents],
        ticktext=[fmt.size(1 << e) for e in exponents],
    )
    fig.update_layout(scales["log" if log else "linear"])
    buttons = [
        {"label": label, "method": "relayout", "args": [args]} for label, args in scales.items()
    ]
    menu = {"type": "buttons", "direction": "right", "buttons": buttons, "active": int(log),
            "x": 1, "xanchor": "right", "y": 1.2, "yanchor": "top"}  # fmt: skip
    title = "memory per tenant against its quota" + (" (log scale)" if log else " (MiB)")
    return _tenant_layout(fig, data, title, updatemenus=[menu])


def tenant_busy(data: Tenants) -> go.Figure:
    """Each tenant's share of each bucket's time that the server executed its batches (stacked)."""
    if not data["busy"]:
        return empty("no server execute spans (no forwarded work in this run)")
    colors, width = _colors(data), int(data["bucket_ns"])
    series: dict[str, list[TenantBusy]] = {}
    for r in data["busy"]:
        series.setdefault(r["tenant"], []).append(r)
    fig = go.Figure(
        [
            go.Bar(
                x=[_since(data, int(r["ts_ns"]) + width // 2) for r in rs],
                y=[100 * float(r["share"]) for r in rs],
                width=width / 1e9,
                name=esc(tenant),
                marker_color=colors.get(tenant, "#333"),
                customdata=[_ms(r["ns"]) for r in rs],
                hovertemplate="%{fullData.name}: %{y:.1f}% (%{customdata:.1f} ms)<extra></extra>",
            )
            for tenant, rs in sorted(series.items())
        ]
    )
    fig.update_yaxes(title_text="% of the time", rangemode="tozero")
    title = f"busy share: server execute time per {fmt.duration(width)}, by tenant"
    return _tenant_layout(fig, data, title, barmode="stack", bargap=0)


def tenant_queue(data: Tenants) -> go.Figure:
    """Mean queue wait of each tenant's batches per bucket (hover: batches, max)."""
    if not data["queue"]:
        return empty("no server queue spans (no forwarded work in this run)")
    colors, width = _colors(data), int(data["bucket_ns"])
    series: dict[str, list[TenantQueue]] = {}
    for r in data["queue"]:
        series.setdefault(r["tenant"], []).append(r)
    fig = go.Figure(
        [
            go.Scatter(
                x=[_since(data, int(r["ts_ns"]) + width // 2) for r in rs],
                y=[_ms(r["mean_ns"]) for r in rs],
                customdata=[[r["n"], _ms(r["max_ns"])] for r in rs],
                mode="markers",
                marker={"color": colors.get(tenant, "#333"), "size": 8},
                name=esc(tenant),
                hovertemplate="%{fullData.name}: %{y:.3f} ms mean over %{customdata[0]} batches,"
                " max %{customdata[1]:.3f} ms<extra></extra>",
            )
            for tenant, rs in sorted(series.items())
        ]
    )
    fig.update_yaxes(title_text="ms", rangemode="tozero")
    return _tenant_layout(fig, data, f"queue wait per batch (ms, mean per {fmt.duration(width)})")


#: Cumulative counters drawn as steps in :func:`tenant_paging`, and how.
_COUNTS = (
    ("evictions", "page-outs", "solid"),
    ("restores", "restores", "dash"),
    ("quota_waits", "quota waits", "dot"),
    ("quota_errors", "quota errors", "dashdot"),
)
_SYMBOLS = {"page-out": "triangle-down", "restore": "triangle-up", "quota wait": "x"}


def _event_text(e: TenantEvent) -> str:
    a = e["attrs"]
    parts = [f"{e['tenant']} {e['kind']} #{e['index']}"]
    if e["session"]:
        parts[0] += f" (session {e['session']})"
    if a.get("reason"):
        parts.append(f"reason: {a['reason']}")
    if str(a.get("bytes", "")).isdigit():
        parts.append(f"{fmt.size(int(a['bytes']))} in {a.get('storages', '?')} storages")
    parts.append(f"took {fmt.duration(int(e['end_ns']) - int(e['start_ns']))}")
    if str(a.get("first_op_ns", "")).isdigit():
        parts.append(f"first op after {fmt.duration(int(a['first_op_ns']))}")
    return esc(" · ".join(parts))


def tenant_paging(data: Tenants) -> go.Figure:
    """Page-outs, restores, quota waits and errors per tenant: the cumulative counters as steps,
    the ``server/evict``, ``server/restore`` and ``server/quota-wait`` spans as markers (at their
    start, at their count; hover: reason, bytes, how long)."""
    colors = _colors(data)
    fig = go.Figure()
    for tenant, metrics in sorted(data["cumulative"].items()):
        for metric, label, dash in _COUNTS:
            points = metrics.get(metric) or []
            if any(v for _, v in points):
                color = colors.get(tenant, "#333")
                fig.add_trace(_step_line(data, points, f"{tenant} {label}", color, dash=dash))
    groups: dict[tuple[str, str], list[TenantEvent]] = {}
    for e in data["events"]:
        groups.setdefault((e["tenant"], e["kind"]), []).append(e)
    for (tenant, kind), es in sorted(groups.items()):
        fig.add_trace(
            go.Scatter(
                x=[_since(data, e["start_ns"]) for e in es],
                y=[e["index"] for e in es],
                mode="markers",
                marker={"symbol": _SYMBOLS.get(kind, "circle"), "size": 11,
                        "color": colors.get(tenant, "#333")},
                name=esc(f"{tenant} {kind} spans"),
                hovertext=[_event_text(e) for e in es],
                hoverinfo="text",
            )
        )  # fmt: skip
    if not fig.data:
        return empty("no page-outs, restores, quota waits or quota errors in this run")
    fig.update_yaxes(title_text="count", rangemode="tozero")
    return _tenant_layout(fig, data, "page-outs, restores and quota waits per tenant")


def tenant_lines(data: Tenants, metric: str, title: str, scale: float = 1.0) -> go.Figure:
    """One runtime counter over time, a step line per tenant (per session where it has several)."""
    rows = data["counters"].get(metric) or []
    if not rows:
        return empty(f"no {metric} counters in this run")
    colors = _colors(data)
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in rows:
        series.setdefault((r["tenant"], r["session"]), []).append((r["ts_ns"], r["value"]))
    tenants = [t for t, _ in series]
    fig = go.Figure(
        [
            _step_line(data, points, f"{t} session {s}" if tenants.count(t) > 1 else t,
                       colors.get(t, "#333"), scale=scale, mode="lines+markers")
            for (t, s), points in sorted(series.items())
        ]
    )  # fmt: skip
    return _tenant_layout(fig, data, title)


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
    return layout(fig, "step times, side by side")


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
    return layout(fig, title, height=140 + 22 * len(rows), barmode="group")


def gpu_busy(rows: list[StepBusy]) -> go.Figure:
    """Each step's GPU busy and idle share, per device (stacked to 100% of the step)."""
    if not rows:
        return empty("no steps with GPU work in this run: busy and idle per step need steps")
    fig = go.Figure()
    devices = sorted({r["device"] for r in rows})
    for d in devices:
        mine = [r for r in rows if r["device"] == d]
        # One bar per step (and device, where there are several): busy and idle stack to 100%.
        on = f" · GPU {d}" if len(devices) > 1 else ""
        x = [f"{esc(r['step'])} · pid {r['pid']}{on}" for r in mine]
        for key, label, color in (("busy_ns", "busy", "#8c564b"), ("idle_ns", "idle", "#e5d8d3")):
            ns = [r["busy_ns"] if key == "busy_ns" else r["idle_ns"] for r in mine]
            fig.add_trace(
                go.Bar(x=x, y=[100 * n / max(1, r["dur_ns"]) for n, r in zip(ns, mine)],
                       name=f"GPU {d} {label}", marker_color=color,
                       customdata=[fmt.duration(n) for n in ns],
                       hovertemplate=f"%{{x}}: GPU {d} {label} %{{y:.1f}}% (%{{customdata}})"
                       "<extra></extra>")
            )  # fmt: skip
    fig.update_yaxes(range=[0, 100], ticksuffix="%")
    fig.update_xaxes(showticklabels=len(rows) <= 60)
    return layout(fig, "GPU busy and idle share of each step", barmode="stack")
