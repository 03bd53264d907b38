"""The timeline figure: tracks of bars and density cells, flow lines, counters under it.

Plain functions from what :mod:`gpu_trace.query.windows` returns to a plotly figure; no
store, no Dash. The x axis is nanoseconds since the run started (ticks are labelled with
durations); every name plotly draws is HTML-escaped, so a span called ``<script>`` is shown as
text. The names on bars go raw in ``layout.meta.labels`` to ``static/labels.js``, which sets each
as a text node's content.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import plotly.graph_objects as go

from gpu_trace import _format as fmt
from gpu_trace.plots.labels import (  # noqa: F401 (figures.X stays: re-exported)
    BESIDE_MIN_CHARS,
    CHAR_EM,
    LABEL_FONT_PX,
    LABEL_PAD_PX,
    LABEL_PX,
    MAX_LABEL,
    esc,
    fit_label,
    label_px,
    owners_text,
    place_labels,
    track_label,
)
from gpu_trace.query.gpu_work import DEVICE_CATEGORIES, short_kernel_name
from gpu_trace.query.relatives import FlowLink, Flows
from gpu_trace.query.series import CounterPoint
from gpu_trace.query.timeline_tracks import TrackInfo, Tracks
from gpu_trace.query.windows import Window

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
    "memset": "#e6a100",
    "cuda_api": "#6b8fb3",
    "cuda_sync": "#c7787a",
    "mark": "#17becf",
}
#: Background of each GPU's group of stream rows (alternating, so two GPUs read apart).
GPU_BANDS = ("rgba(140,86,75,0.07)", "rgba(140,86,75,0.13)")
ROW_PX = 18
COUNTER_PX = 110
#: Space between two panels (px): a counter panel's title and the ticks of the axis above it.
GAP_PX = 36
TITLE_FONT_PX = 13
MARGIN_PX = {"r": 10, "t": 30, "b": 30}


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


def typed(values: np.ndarray) -> dict[str, str]:
    """A numpy array as plotly.js's typed-array spec (base64 bytes): far smaller and quicker to
    read in the page than a JSON list of numbers."""
    arr = np.ascontiguousarray(values)
    code = {"f": "f", "i": "i", "u": "u"}[arr.dtype.kind] + str(arr.dtype.itemsize)
    arr = arr.astype(f"<{code}", copy=False)
    return {
        "dtype": code,
        "bdata": base64.b64encode(arr.tobytes()).decode("ascii"),
        "shape": ", ".join(str(n) for n in arr.shape),
    }


def _axis(row: int) -> str:
    return "" if row == 1 else str(row)


def label_margin(labels: list[str], font_px: int = 10) -> int:
    """Left margin (px) that fits the widest track label, estimated from its length.

    Set explicitly because plotly's automatic margins draw the whole figure twice (once to
    measure the labels, once with the margin they need).
    """
    widest = max((len(html.unescape(text)) for text in labels), default=0)
    return max(50, int(12 + widest * font_px * CHAR_EM))


def timeline(
    run: dict[str, Any],
    tracks: Tracks,
    win: Window,
    flows: Flows | None = None,
    counters: Mapping[str, list[CounterPoint]] | None = None,
    clock: list[dict[str, Any]] | None = None,
    width_px: int = 1600,
    synthetic: bool = False,
) -> dict[str, Any]:
    """The whole timeline figure for one window, as the plain dict plotly.js draws.

    Built as a dict rather than a ``plotly.graph_objects.Figure``: plotly's validation of a
    figure with thousands of bars costs the server most of a second per window.
    """
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
    # Trace 0 is the selected GPU work's launch link, empty until a kernel is clicked (the
    # details callback fills it with a Patch: no redraw of the window).
    data: list[dict[str, Any]] = [launch_trace()]
    data += _density(win, base)
    bars, names = _bars(win, by_key, base, width_px)
    data += bars
    if flows and flows["links"]:
        data.append(_flows(flows["links"], by_key, base))
    legends: set[int] = set()  # panels (by row) with more than one line: each gets a legend
    for i, (name, rows) in enumerate(panels):
        lines = _counter_panel(i + 2, name, rows, base)
        if len(lines) > 1:
            legends.add(i + 2)
        data += lines
    if clock:
        lines = _clock_panel(len(heights), clock, base)
        if len(lines) > 1:
            legends.add(len(heights))
        data += lines
    for trace in data:
        row = trace.get("yaxis", "y")[1:]
        if row and int(row) in legends:
            trace.update(showlegend=True, legend=f"legend{row}")

    tickvals, ticktext = ticks(win.t0, win.t1, base)
    labels = [track_label(t) for t in info]
    # Panels are GAP_PX apart, whatever the figure's height: a counter's title sits in the gap
    # above its panel, clear of the span plot's axis and ticks (a gap in paper units shrank with
    # the figure and the title was drawn over that axis).
    plot_px = sum(heights) + GAP_PX * (len(heights) - 1)
    layout: dict[str, Any] = {
        "height": plot_px + MARGIN_PX["t"] + MARGIN_PX["b"],
        "margin": {"l": label_margin(labels), **MARGIN_PX},
        "barmode": "overlay",
        "dragmode": "zoom",
        "hovermode": "closest",
        "uirevision": run["run_id"],
        "legend": {"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0},
        "plot_bgcolor": "white",
        "annotations": [],
        # The names on the bars, raw text: static/labels.js draws them in one SVG layer over
        # the plot (as a plotly text trace they took a third of plotly's drawing time).
        "meta": {"labels": names},
        # Remote (clock-mapped) tracks get a tinted band.
        "shapes": [
            {"type": "rect", "xref": "x domain", "yref": "y", "x0": 0, "x1": 1,
             "y0": t.row - 0.5, "y1": t.row + t.levels - 0.5, "fillcolor": "rgba(255,160,0,0.08)",
             "line": {"width": 0}, "layer": "below"}
            for t in info if t.remote
        ] + _gpu_bands(info),
    }  # fmt: skip
    # One column of subplots sharing the x axis (what plotly's make_subplots lays out), the
    # track rows on top. Every axis has a fixed margin and never hides labels that overflow:
    # both make plotly measure every tick label and draw again (seconds for 300 tracks).
    unit = 1 / plot_px
    gap = GAP_PX * unit
    top = 1.0
    for r, (h, title) in enumerate(zip(heights, titles), start=1):
        bottom = max(0.0, top - h * unit)
        layout[f"xaxis{_axis(r)}"] = {
            "anchor": f"y{_axis(r)}",
            "domain": [0, 1],
            "range": [win.t0 - base, win.t1 - base],
            "tickvals": tickvals,
            "ticktext": ticktext,
            "showgrid": True,
            "showticklabels": r == len(heights),
            "automargin": False,
            "ticklabeloverflow": "allow",
            **({"matches": "x"} if r > 1 else {}),
        }
        layout[f"yaxis{_axis(r)}"] = {
            "anchor": f"x{_axis(r)}",
            "domain": [bottom, top],
            "fixedrange": True,
            "automargin": False,
            "ticklabeloverflow": "allow",
            "tickfont": {"size": 9},
        }
        if title:
            # A panel of several lines has its legend at the right of the gap above it, its
            # title then at the left.
            x, anchor = (0.0, "left") if r in legends else (0.5, "center")
            layout["annotations"].append(
                {"text": title, "x": x, "y": top, "xref": "paper", "yref": "paper",
                 "xanchor": anchor, "yanchor": "bottom", "showarrow": False,
                 "font": {"size": TITLE_FONT_PX}}
            )  # fmt: skip
        if r in legends:
            layout[f"legend{r}"] = {
                "x": 1, "xanchor": "right", "y": top, "yanchor": "bottom", "yref": "paper",
                "orientation": "h", "bgcolor": "rgba(255,255,255,0.8)", "font": {"size": 10},
                "itemclick": "toggle", "itemdoubleclick": "toggleothers",
            }  # fmt: skip
        top = bottom - gap
    layout["yaxis"].update(
        range=[n_rows - 0.5, -0.5],
        tickvals=[t.row for t in info],
        ticktext=labels,
        tickfont={"size": 10},
        zeroline=False,
    )
    for i, (name, _) in enumerate(panels):
        # From zero: a flat counter is a flat line at its value, not five ticks of one number.
        layout[f"yaxis{_axis(i + 2)}"]["rangemode"] = "tozero"
        if name.endswith("_bytes"):  # 40 GB, not plotly's 40B (for 40 billion)
            layout[f"yaxis{_axis(i + 2)}"].update(tickformat="~s", ticksuffix="B")
    if clock:
        layout[f"yaxis{_axis(len(heights))}"]["title"] = {"text": "µs"}
    return {"data": data, "layout": layout}


#: Index of the launch-link trace in the timeline figure's data.
LAUNCH_TRACE = 0


def launch_trace(xs: list[int] | None = None, ys: list[int] | None = None) -> dict[str, Any]:
    """The line from a CUDA call to the work it launched (a kernel, copy or memset)."""
    return {
        "type": "scatter", "x": xs or [], "y": ys or [], "mode": "lines+markers",
        "line": {"color": "rgba(200,30,30,0.9)", "width": 2},
        "marker": {"size": 6, "symbol": ["circle", "arrow-right"], "color": "rgb(200,30,30)"},
        "name": "launch", "showlegend": False, "hoverinfo": "skip",
    }  # fmt: skip


def launch_link(
    tracks: list[TrackInfo], call: Mapping[str, object], work: Mapping[str, object], base: int
) -> tuple[list[int], list[int]]:
    """x (ns since ``base``) and timeline rows of the line from ``call``'s start to ``work``'s
    start; empty when either is on a track not drawn."""
    by_key = _rows_of(tracks)
    ends = []
    for s in (call, work):
        key = (str(s["host"]), int(str(s["pid"])), int(str(s["tid"])), str(s["lane"]))
        t = by_key.get(key)
        if t is None:
            return [], []
        ends.append((int(str(s["start_ns"])) - base, t.row + t.level(int(str(s["depth"])))))
    return [x for x, _ in ends], [y for _, y in ends]


def _gpu_bands(info: list[TrackInfo]) -> list[dict[str, object]]:
    """A tinted band behind each GPU's stream rows (one group per host and GPU)."""
    groups: dict[tuple[str, int], list[int]] = {}
    for t in info:
        if t.device is not None:
            rows = groups.setdefault((t.host, t.device), [t.row, t.row + t.levels])
            rows[0], rows[1] = min(rows[0], t.row), max(rows[1], t.row + t.levels)
    return [
        {"type": "rect", "xref": "x domain", "yref": "y", "x0": 0, "x1": 1, "y0": lo - 0.5,
         "y1": hi - 0.5, "fillcolor": GPU_BANDS[i % 2], "line": {"width": 0}, "layer": "below"}
        for i, (lo, hi) in enumerate(groups.values())
    ]  # fmt: skip


def _density(win: Window, base: int) -> list[dict[str, Any]]:
    count = win.count
    used = np.flatnonzero(count.sum(axis=1)) if count.size else np.zeros(0, np.int64)
    if not len(used):
        return []
    lo, hi = int(used.min()), int(used.max()) + 1
    count = count[lo:hi]
    busy = np.where(
        count > 0, np.minimum(1.0, win.busy_ns[lo:hi] / max(1, win.bucket_ns)), np.nan
    ).astype(np.float32)
    top = int(count.max())
    kind = np.uint8 if top < 2**8 else np.uint16 if top < 2**16 else np.uint32
    return [
        {
            "type": "heatmap",
            "z": typed(busy),
            "customdata": typed(count.astype(kind)),
            "x0": win.t0 - base + win.bucket_ns / 2,
            "dx": win.bucket_ns,
            "y0": lo,
            "dy": 1,
            "zmin": 0,
            "zmax": 1,
            "colorscale": [[0, "rgba(120,120,200,0.25)"], [1, "rgba(40,40,140,0.95)"]],
            "showscale": False,
            "hoverongaps": False,
            "name": "density",
            "hovertemplate": "%{customdata} spans narrower than a pixel<br>busy %{z:.0%}"
            "<extra>density</extra>",
        }
    ]


def _bars(
    win: Window, by_key: dict, base: int, width_px: int
) -> tuple[list[dict[str, Any]], dict[str, list]]:
    """One bar trace per category (each bar keeps its own hover text and click data), and the
    names to write (:func:`place_labels`)."""
    ns_per_px = max(1.0, (win.t1 - win.t0) / max(1, width_px))
    groups: dict[str, dict[str, list]] = {}
    named: list[tuple[int, float, float, str]] = []  # row, left and right px, name
    for b in win.bars:
        t = by_key.get((b["host"], int(b["pid"]), int(b["tid"]), b["lane"]))
        if t is None:
            continue
        start = int(b["start_ns"])
        dur = int(b["end_ns"]) - start
        g = groups.get(b["category"])
        if g is None:
            g = groups[b["category"]] = {k: [] for k in ("x", "base", "y", "hover", "cd")}
        row = t.row + t.level(int(b["depth"]))
        # At least a pixel wide: a pinned span narrower than that is still seen (and clicked).
        g["x"].append(max(dur, 1, int(ns_per_px)))
        g["base"].append(start - base)
        g["y"].append(row)
        name = esc(b["name"])
        owner = owners_text(((b.get("tenant") or "", b.get("session") or ""),))
        g["hover"].append(
            f"{name}<br>{fmt.duration(dur)} · {esc(b['lane'])}"
            + (f"<br>{esc(owner)}" if owner else "")
        )
        g["cd"].append([b["span_id"], start])
        left, right = max(start, win.t0), min(start + max(dur, int(ns_per_px)), win.t1)
        # Kernel names are long C++ (the full one is in the hover and the details).
        text = (
            short_kernel_name(str(b["name"]))
            if b["category"] in DEVICE_CATEGORIES
            else str(b["name"])
        )
        named.append((row, (left - win.t0) / ns_per_px, (right - win.t0) / ns_per_px, text))
    traces: list[dict[str, Any]] = [
        {
            "type": "bar",
            "orientation": "h",
            "x": g["x"],
            "base": g["base"],
            "y": g["y"],
            "width": 0.8,
            "name": esc(category),
            "marker": {"color": COLORS.get(category, "#bcbd22"), "line": {"width": 0}},
            "hovertext": g["hover"],
            "hoverinfo": "text",
            "customdata": g["cd"],
        }
        for category, g in sorted(groups.items())
    ]
    placed = place_labels(named, win.t1 - win.t0, ns_per_px)
    labels: dict[str, list] = {"x": [], "y": [], "text": [], "beside": []}
    for row, x_px, text, beside in placed:
        labels["x"].append(win.t0 - base + x_px * ns_per_px)
        labels["y"].append(row)
        labels["text"].append(text)
        labels["beside"].append(beside)
    return traces, labels


def _flows(links: list[FlowLink], by_key: dict, base: int) -> dict[str, Any]:
    xs: list[Any] = []
    ys: list[Any] = []
    for link in links:
        p = by_key.get((link["p_host"], int(link["p_pid"]), int(link["p_tid"]), link["p_lane"]))
        c = by_key.get((link["c_host"], int(link["c_pid"]), int(link["c_tid"]), link["c_lane"]))
        if p is None or c is None:
            continue
        xs += [int(link["p_start"]) - base, int(link["c_start"]) - base, None]
        ys += [p.row + p.level(int(link["p_depth"])), c.row + c.level(int(link["c_depth"])), None]
    return {
        "type": "scatter",
        "x": xs,
        "y": ys,
        "mode": "lines",
        "line": {"color": "rgba(90,90,90,0.45)", "width": 1},
        "name": "forwarded call → server",
        "hoverinfo": "skip",
    }


def series_names(series: list[str]) -> list[str]:
    """Legend names of a panel's lines (``host[ device][ tenant T][ session S]``, as
    ``timeline.counters`` names them): without the host and device where every line has the
    same (``tenant alice session 2``, ``gpu1``); a single line keeps its whole name."""
    if len(series) < 2:
        return list(series)
    words = [s.split(" ") for s in series]
    same = 0
    for column in zip(*words):
        if len(set(column)) > 1 or column[0] in ("tenant", "session"):
            break
        same += 1
    same = min(same, min(len(w) for w in words) - 1)  # every name keeps a word
    return [" ".join(w[same:]) for w in words]


def _counter_panel(
    row: int, name: str, rows: list[CounterPoint], base: int
) -> list[dict[str, Any]]:
    series: dict[str, tuple[list, list]] = {}
    for r in rows:
        xs, ys = series.setdefault(r["series"], ([], []))
        xs.append(int(r["ts_ns"]) - base)
        ys.append(float(r["value"]))
    return [
        {
            "type": "scatter",
            "x": xs,
            "y": ys,
            "xaxis": f"x{_axis(row)}",
            "yaxis": f"y{_axis(row)}",
            "mode": "lines",
            # A counter holds its value until the next sample: steps, not slopes between
            # samples (the window's data starts with the last sample before it).
            "line": {"width": 1.2, "shape": "hv"},
            "name": esc(label),
            "showlegend": False,
            # The line's (escaped) name, never a name pasted into the template, where a
            # ``%{...}`` in a tenant's name would be read as a field.
            "hovertemplate": "%{fullData.name}: %{y:.4g}<extra>%{meta}</extra>",
            "meta": esc(name),
        }
        for label, (xs, ys) in zip(series_names(list(series)), series.values())
    ]


def _clock_panel(row: int, clock: list[dict[str, Any]], base: int) -> list[dict[str, Any]]:
    peers: dict[str, list[dict]] = {}
    for c in clock:
        peers.setdefault(f"{c['host']} → {c['peer']}", []).append(c)
    out = []
    for label, rows in peers.items():
        ref = int(rows[0]["offset_ns"])
        out.append(
            {
                "type": "scatter",
                "x": [int(r["ts_ns"]) - base for r in rows],
                "y": [(int(r["offset_ns"]) - ref) / 1000 for r in rows],
                "xaxis": f"x{_axis(row)}",
                "yaxis": f"y{_axis(row)}",
                "error_y": {
                    "type": "data",
                    "array": [int(r["uncertainty_ns"]) / 1000 for r in rows],
                },
                "mode": "markers",
                "name": esc(label),
                "showlegend": False,
                "hovertemplate": "%{fullData.name}<br>offset %{y:.1f} µs from the first"
                " ± %{error_y.array:.1f} µs<extra>clock sync</extra>",
            }
        )
    return out


def empty(message: str) -> go.Figure:
    """A figure that only says ``message`` (no run, nothing in the window)."""
    fig = go.Figure()
    fig.add_annotation(text=esc(message), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(height=200, xaxis_visible=False, yaxis_visible=False, plot_bgcolor="white")
    return fig
