"""The timeline figure: tracks of bars and density cells, flow lines, counters under it.

Plain functions from what :mod:`gpu_trace.dashboard.queries` returns to a plotly figure; no
store, no Dash. The x axis is nanoseconds since the run started (ticks are labelled with
durations); every name drawn is HTML-escaped, so a span called ``<script>`` is shown as text.
"""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np
import plotly.graph_objects as go
import pyarrow as pa
import pyarrow.compute as pc
from plotly.subplots import make_subplots

from gpu_trace import _format as fmt
from gpu_trace.dashboard.queries import TrackInfo, Window

#: Bar colour per span category.
COLORS = {
    "step": "#7f7f7f",
    "module": "#1f77b4",
    "op": "#2ca02c",
    "nvtx": "#9467bd",
    "forward": "#ff7f0e",
    "server": "#d62728",
    "kernel": "#8c564b",
    "memcpy": "#e377c2",
    "mark": "#17becf",
}
ROW_PX = 18
COUNTER_PX = 110
#: Bars at least this many pixels wide get their name written in them.
LABEL_PX = 40


def esc(text: Any) -> str:
    """Text for plotly labels and hovers, which render a subset of HTML: escaped, so it shows as is."""
    return html.escape(str(text), quote=False)


def track_label(t: TrackInfo) -> str:
    who = t.thread or (f"tid {t.tid}" if t.tid != t.pid else "main")
    proc = t.process.split(" ")[0].rsplit("/", 1)[-1] if t.process else "pid"
    label = f"{t.host} · {proc} {t.pid} · {who} · {t.lane}"
    if t.clock_uncertainty_ns:
        label += f" (clock ±{fmt.duration(t.clock_uncertainty_ns)})"
    return esc(label if len(label) <= 70 else "…" + label[-69:])


def ticks(t0: int, t1: int, base: int, n: int = 8) -> tuple[list[int], list[str]]:
    """Tick positions (ns since ``base``) and labels for the window ``[t0, t1)``."""
    span = max(1, t1 - t0)
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = int(next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)) or 1
    unit, scale = next(
        ((u, s) for u, s in (("s", 10**9), ("ms", 10**6), ("µs", 10**3)) if span >= s), ("ns", 1)
    )
    decimals = max(0, math.ceil(-math.log10(step / scale))) if step < scale else 0
    first = -(-(t0 - base) // step) * step
    vals = list(range(first, t1 - base + 1, step))
    return vals, [f"{v / scale:.{decimals}f} {unit}" for v in vals]


def _rows_of(tracks: list[TrackInfo]) -> dict[tuple, TrackInfo]:
    return {t.key: t for t in tracks}


def timeline(
    run: dict[str, Any],
    tracks: dict[str, Any],
    win: Window,
    flows: dict[str, Any] | None = None,
    counters: dict[str, list[dict[str, Any]]] | None = None,
    clock: list[dict[str, Any]] | None = None,
    width_px: int = 1600,
    synthetic: bool = False,
) -> go.Figure:
    """The whole timeline figure for one window."""
    base = int(run["started_ns"])
    info: list[TrackInfo] = tracks["tracks"]
    n_rows = max(1, tracks["rows"])
    by_key = _rows_of(info)
    panels = list((counters or {}).items())
    extra = 1 if clock else 0
    heights = [n_rows * ROW_PX + 40] + [COUNTER_PX] * (len(panels) + extra)
    titles = [""] + [
        esc(name + (" (SYNTHETIC NVML replay)" if synthetic and name.startswith("nvml/") else ""))
        for name, _ in panels
    ]
    if clock:
        titles.append("clock offset of each remote host, ± uncertainty")
    fig = make_subplots(
        rows=len(heights),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=min(0.04, 30 / max(1, sum(heights))),
        row_heights=heights,
        subplot_titles=titles,
    )
    _density(fig, win, by_key, base, n_rows)
    _bars(fig, win, by_key, base, width_px)
    if flows and flows["links"]:
        _flows(fig, flows["links"], by_key, base)
    for i, (name, rows) in enumerate(panels):
        _counter_panel(fig, i + 2, name, rows, base)
    if clock:
        _clock_panel(fig, len(heights), clock, base)

    for t in info:  # remote (clock-mapped) tracks get a tinted band
        if t.remote:
            fig.add_shape(
                type="rect", xref="x domain", x0=0, x1=1, y0=t.row - 0.5,
                y1=t.row + t.levels - 0.5, fillcolor="rgba(255,160,0,0.08)",
                line_width=0, layer="below", row=1, col=1,
            )  # fmt: skip
    tickvals, ticktext = ticks(win.t0, win.t1, base)
    fig.update_xaxes(
        range=[win.t0 - base, win.t1 - base], tickvals=tickvals, ticktext=ticktext, showgrid=True
    )
    fig.update_yaxes(
        row=1,
        col=1,
        range=[n_rows - 0.5, -0.5],
        tickvals=[t.row for t in info],
        ticktext=[track_label(t) for t in info],
        tickfont={"size": 10},
        fixedrange=True,
        zeroline=False,
    )
    for r in range(2, len(heights) + 1):
        fig.update_yaxes(row=r, col=1, fixedrange=True, tickfont={"size": 9})
    fig.update_layout(
        height=sum(heights) + 80,
        margin={"l": 10, "r": 10, "t": 30, "b": 30},
        barmode="overlay",
        dragmode="zoom",
        hovermode="closest",
        uirevision=run["run_id"],
        uniformtext={"minsize": 8, "mode": "hide"},
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0},
        plot_bgcolor="white",
    )
    return fig


def _density(fig: go.Figure, win: Window, by_key: dict, base: int, n_rows: int) -> None:
    cells = win.cells
    if not cells.num_rows:
        return
    nb = max(1, -(-(win.t1 - win.t0) // win.bucket_ns))
    # One code per track (host|pid|tid|lane), then row = the track's first row + the span's level.
    keys = (
        pc.binary_join_element_wise(
            cells["host"].cast(pa.string()),
            pc.cast(cells["pid"], pa.string()),
            pc.cast(cells["tid"], pa.string()),
            cells["lane"].cast(pa.string()),
            "|",
        )
        .combine_chunks()
        .dictionary_encode()
    )
    first = np.full(len(keys.dictionary) + 1, -1, dtype=np.int64)
    lowest = np.zeros_like(first)
    levels = np.ones_like(first)
    for i, key in enumerate(keys.dictionary.to_pylist()):
        host, pid, tid, lane = key.split("|", 3)
        t = by_key.get((host, int(pid), int(tid), lane))
        if t is not None:
            first[i], lowest[i], levels[i] = t.row, t.min_depth, t.levels
    code = keys.indices.to_numpy()
    depth = cells["depth"].to_numpy().astype(np.int64)
    row = first[code] + np.clip(depth - lowest[code], 0, levels[code] - 1)
    bucket = cells["bucket"].to_numpy().astype(np.int64)
    ok = (first[code] >= 0) & (bucket >= 0) & (bucket < nb)
    row, bucket = row[ok], bucket[ok]
    count = np.zeros((n_rows, nb), dtype=np.int64)
    busy_ns = np.zeros((n_rows, nb), dtype=np.float64)
    np.add.at(count, (row, bucket), cells["n"].to_numpy()[ok])
    np.add.at(busy_ns, (row, bucket), cells["busy_ns"].to_numpy()[ok])
    busy = np.where(count > 0, np.minimum(1.0, busy_ns / win.bucket_ns), np.nan).astype(np.float32)
    used = np.flatnonzero(count.sum(axis=1))
    if not len(used):
        return
    lo, hi = int(used.min()), int(used.max()) + 1
    fig.add_trace(
        go.Heatmap(
            z=busy[lo:hi],
            customdata=count[lo:hi].astype(np.int32),
            x0=win.t0 - base + win.bucket_ns / 2,
            dx=win.bucket_ns,
            y0=lo,
            dy=1,
            zmin=0,
            zmax=1,
            colorscale=[[0, "rgba(120,120,200,0.25)"], [1, "rgba(40,40,140,0.95)"]],
            showscale=False,
            name="density",
            hovertemplate="%{customdata} spans narrower than a pixel<br>busy %{z:.0%}"
            "<extra>density</extra>",
        ),
        row=1,
        col=1,
    )


def _bars(fig: go.Figure, win: Window, by_key: dict, base: int, width_px: int) -> None:
    ns_per_px = max(1.0, (win.t1 - win.t0) / max(1, width_px))
    groups: dict[str, dict[str, list]] = {}
    for b in win.bars:
        t = by_key.get((b["host"], int(b["pid"]), int(b["tid"]), b["lane"]))
        if t is None:
            continue
        dur = int(b["end_ns"]) - int(b["start_ns"])
        g = groups.setdefault(
            b["category"], {k: [] for k in ("x", "base", "y", "text", "hover", "cd")}
        )
        g["x"].append(max(dur, 1))
        g["base"].append(int(b["start_ns"]) - base)
        g["y"].append(t.row + t.level(int(b["depth"])))
        name = esc(b["name"])
        g["text"].append(name if dur / ns_per_px >= LABEL_PX else "")
        g["hover"].append(f"{name}<br>{fmt.duration(dur)} · {esc(b['lane'])}")
        g["cd"].append([b["span_id"], int(b["start_ns"])])
    for category, g in sorted(groups.items()):
        fig.add_trace(
            go.Bar(
                orientation="h",
                x=g["x"],
                base=g["base"],
                y=g["y"],
                width=0.8,
                name=esc(category),
                marker={"color": COLORS.get(category, "#bcbd22"), "line": {"width": 0}},
                text=g["text"],
                textposition="inside",
                insidetextanchor="start",
                textfont={"color": "white", "size": 10},
                hovertext=g["hover"],
                hoverinfo="text",
                customdata=g["cd"],
            ),
            row=1,
            col=1,
        )


def _flows(fig: go.Figure, links: list[dict[str, Any]], by_key: dict, base: int) -> None:
    xs: list[Any] = []
    ys: list[Any] = []
    for link in links:
        p = by_key.get((link["p_host"], int(link["p_pid"]), int(link["p_tid"]), link["p_lane"]))
        c = by_key.get((link["c_host"], int(link["c_pid"]), int(link["c_tid"]), link["c_lane"]))
        if p is None or c is None:
            continue
        xs += [int(link["p_start"]) - base, int(link["c_start"]) - base, None]
        ys += [p.row + p.level(int(link["p_depth"])), c.row + c.level(int(link["c_depth"])), None]
    fig.add_trace(
        go.Scatter(
            x=xs,
            y=ys,
            mode="lines",
            line={"color": "rgba(90,90,90,0.45)", "width": 1},
            name="forwarded call → server",
            hoverinfo="skip",
        ),
        row=1,
        col=1,
    )


def _counter_panel(fig: go.Figure, row: int, name: str, rows: list[dict], base: int) -> None:
    series: dict[str, tuple[list, list]] = {}
    for r in rows:
        xs, ys = series.setdefault(r["series"], ([], []))
        xs.append(int(r["ts_ns"]) - base)
        ys.append(float(r["value"]))
    for label, (xs, ys) in series.items():
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=ys,
                mode="lines",
                line={"width": 1.2},
                name=esc(f"{name} {label}"),
                showlegend=False,
                hovertemplate=f"{esc(label)}: %{{y:.4g}}<extra>{esc(name)}</extra>",
            ),
            row=row,
            col=1,
        )


def _clock_panel(fig: go.Figure, row: int, clock: list[dict[str, Any]], base: int) -> None:
    peers: dict[str, list[dict]] = {}
    for c in clock:
        peers.setdefault(f"{c['host']} → {c['peer']}", []).append(c)
    for label, rows in peers.items():
        ref = int(rows[0]["offset_ns"])
        fig.add_trace(
            go.Scatter(
                x=[int(r["ts_ns"]) - base for r in rows],
                y=[(int(r["offset_ns"]) - ref) / 1000 for r in rows],
                error_y={"type": "data", "array": [int(r["uncertainty_ns"]) / 1000 for r in rows]},
                mode="markers",
                name=esc(label),
                showlegend=False,
                hovertemplate=f"{esc(label)}<br>offset %{{y:.1f}} µs from the first"
                " ± %{error_y.array:.1f} µs<extra>clock sync</extra>",
            ),
            row=row,
            col=1,
        )
    fig.update_yaxes(title_text="µs", row=row, col=1)


def empty(message: str) -> go.Figure:
    """A figure that only says ``message`` (no run, nothing in the window)."""
    fig = go.Figure()
    fig.add_annotation(text=esc(message), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(height=200, xaxis_visible=False, yaxis_visible=False, plot_bgcolor="white")
    return fig
