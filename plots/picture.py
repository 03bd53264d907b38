"""A timeline figure for a notebook: bar names as a text trace, and the figure drawn as a PNG.

The dashboard draws the names on bars with its own script (``layout.meta.labels``), which a
notebook does not load: :func:`labels_as_text` puts them in a trace. :func:`picture` draws the
figure with matplotlib, for viewers that run no JavaScript; :func:`figure_with_picture` is a
plotly Figure that carries it (``Run.timeline(static=True)``, docs/notebooks.md).
"""

from __future__ import annotations

import base64
import functools
from typing import TYPE_CHECKING

from gpu_trace.plots.figures import esc

if TYPE_CHECKING:
    import numpy as np
    import plotly.graph_objects as go
    from matplotlib.axes import Axes


def labels_as_text(figure: dict[str, object]) -> None:
    """The names on the bars as a text trace: the dashboard draws them with its own script
    (``layout.meta.labels``), which a notebook does not load."""
    layout = figure.get("layout")
    data = figure.get("data")
    if not isinstance(layout, dict) or not isinstance(data, list):
        return
    labels = (layout.pop("meta", None) or {}).get("labels") or {}
    if labels.get("text"):
        beside = labels.get("beside") or [False] * len(labels["text"])
        data.append(
            {"type": "scatter", "mode": "text", "x": labels["x"], "y": labels["y"],
             "text": [esc(t) for t in labels["text"]], "textposition": "middle right",
             "textfont": {"size": 10, "color": ["#222" if o else "white" for o in beside]},
             "hoverinfo": "skip", "showlegend": False}
        )  # fmt: skip


@functools.cache
def figure_with_picture() -> type:
    """A plotly Figure that carries a PNG of itself and offers both to Jupyter (plotly is
    imported lazily, so the class is made on first use)."""
    import plotly.graph_objects as go

    class Figure(go.Figure):
        def __init__(self, figure: go.Figure, png: bytes) -> None:
            super().__init__(figure)
            self._png = png

        @property
        def png(self) -> bytes:
            """The figure drawn as a PNG (matplotlib)."""
            return self._png

        def _repr_mimebundle_(
            self,
            include: object = None,
            exclude: object = None,
            validate: bool = True,
            **kw: object,
        ) -> dict[str, object]:
            # Jupyter draws plotly's own mime type; a viewer that runs no JavaScript (nbconvert,
            # GitHub) takes the PNG. Plotly's text/html would be chosen before the PNG there and
            # show nothing without its script, so it is left out.
            bundle = dict(super()._repr_mimebundle_(include, exclude, validate, **kw) or {})
            bundle.pop("text/html", None)
            bundle["image/png"] = base64.b64encode(self._png).decode("ascii")
            bundle.setdefault("text/plain", f"<timeline figure, {len(self.data)} traces>")
            return bundle

        def _ipython_display_(self) -> None:
            # plotly's own shows its renderer's bundle, which has no PNG.
            from IPython.display import display

            display(self._repr_mimebundle_(), raw=True)

    return Figure


def _rgba(color: object) -> str | tuple[float, float, float, float]:
    """A plotly colour (``#hex``, ``rgb(...)``, ``rgba(...)``) as matplotlib takes it."""
    text = str(color)
    if text.startswith("rgb"):
        parts = [float(v) for v in text[text.index("(") + 1 : text.rindex(")")].split(",")]
        return (parts[0] / 255, parts[1] / 255, parts[2] / 255, parts[3] if len(parts) > 3 else 1.0)
    return text


def _values(spec: object) -> np.ndarray:
    """A trace's array: a sequence (None for a gap), an array, or plotly's typed-array dict
    (:func:`gpu_trace.plots.figures.typed`)."""
    import numpy as np

    if isinstance(spec, dict) and "bdata" in spec:
        shape = [int(n) for n in str(spec["shape"]).split(",")]
        raw = base64.b64decode(spec["bdata"])
        return np.frombuffer(raw, dtype=f"<{spec['dtype']}").reshape(shape).astype(float)
    if isinstance(spec, np.ndarray):
        return spec.astype(float)
    values = spec if isinstance(spec, (list, tuple)) else []
    return np.asarray([np.nan if v is None else v for v in values], dtype=float)


def picture(plotly_figure: go.Figure, dpi: int = 100) -> bytes:
    """The timeline figure (:func:`gpu_trace.plots.figures.timeline`'s, bar names as a text trace) drawn
    with matplotlib as a PNG of the same size and layout: the track rows with their bars,
    density cells and bands, then each counter panel with its title. Hovers, flows' clicks and
    legends' toggles are the interactive figure's; the PNG holds no date or version, so the
    same figure gives the same bytes."""
    import io
    from html import unescape

    import numpy as np

    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import LinearSegmentedColormap
        from matplotlib.figure import Figure
        from matplotlib.ticker import EngFormatter
    except ImportError:
        raise ImportError(
            "timeline(static=True) draws with matplotlib: pip install matplotlib"
        ) from None
    figure = plotly_figure.to_plotly_json()  # plain dicts, as figures.timeline built them
    layout = figure["layout"]
    width, height = float(layout.get("width") or 1200), float(layout["height"])
    margin = layout["margin"]
    plot_w = width - margin["l"] - margin["r"]
    plot_h = height - margin["t"] - margin["b"]
    pt = 72 / dpi  # plotly sizes are pixels, matplotlib's points
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    axes: dict[str, Axes] = {}
    for key in sorted((k for k in layout if k.startswith("yaxis")), key=lambda k: int(k[5:] or 1)):
        n = key[5:]
        y0, y1 = layout[key]["domain"]
        ax = fig.add_axes(
            (
                margin["l"] / width,
                (margin["b"] + y0 * plot_h) / height,
                plot_w / width,
                (y1 - y0) * plot_h / height,
            )
        )
        xaxis = layout[f"xaxis{n}"]
        ax.set_xlim(*xaxis["range"])
        ax.set_xticks(xaxis["tickvals"])
        ax.set_xticklabels(xaxis["ticktext"] if xaxis.get("showticklabels") else [])
        ax.tick_params(labelsize=9 * pt, length=2)
        ax.grid(axis="x", color="#e5e5e5", linewidth=0.6)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        axes[n] = ax
    top = axes[""]
    yaxis = layout["yaxis"]
    top.set_ylim(*yaxis["range"])
    top.set_yticks(yaxis.get("tickvals") or [])
    top.set_yticklabels([unescape(t) for t in yaxis.get("ticktext") or []], fontsize=10 * pt)
    for shape in layout.get("shapes") or []:
        top.axhspan(shape["y0"], shape["y1"], color=_rgba(shape["fillcolor"]), lw=0, zorder=0)
    for trace in figure["data"]:
        ax = axes.get(str(trace.get("yaxis", "y"))[1:], top)
        kind, mode = trace.get("type"), trace.get("mode", "")
        if kind == "bar":
            color = _rgba(trace["marker"]["color"])
            ax.barh(_values(trace["y"]), _values(trace["x"]), left=_values(trace["base"]),
                    height=trace.get("width", 0.8), color=color, linewidth=0)  # fmt: skip
        elif kind == "heatmap":
            z = _values(trace["z"])
            left = trace["x0"] - trace["dx"] / 2
            low, high = trace["colorscale"][0][1], trace["colorscale"][-1][1]
            ax.imshow(
                np.ma.masked_invalid(z), aspect="auto", interpolation="nearest",
                cmap=LinearSegmentedColormap.from_list("busy", [_rgba(low), _rgba(high)]),
                vmin=0, vmax=1, origin="upper",
                extent=(left, left + z.shape[1] * trace["dx"], trace["y0"] + z.shape[0] - 0.5,
                        trace["y0"] - 0.5),
            )  # fmt: skip
        elif mode == "text":
            colors = trace.get("textfont", {}).get("color") or ["#222"] * len(trace["text"])
            for x, y, text, color in zip(trace["x"], trace["y"], trace["text"], colors):
                ax.text(x, y, unescape(text), fontsize=10 * pt, color=color, va="center",
                        clip_on=True)  # fmt: skip
        elif kind == "scatter" and len(trace.get("x") or []):
            x, y = _values(trace["x"]), _values(trace["y"])
            line = trace.get("line") or {}
            if "error_y" in trace:  # the clock panel
                ax.errorbar(x, y, yerr=_values(trace["error_y"]["array"]), fmt="o", ms=3)
            elif "lines" in mode:
                step = "steps-post" if line.get("shape") == "hv" else "default"
                ax.plot(x, y, drawstyle=step, lw=line.get("width", 1.2),
                        color=_rgba(line["color"]) if "color" in line else None,
                        label=unescape(str(trace.get("name", ""))))  # fmt: skip
    for n, ax in axes.items():
        if n:
            ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
            ax.tick_params(axis="y", labelsize=9 * pt)
            unit = "B" if layout[f"yaxis{n}"].get("ticksuffix") == "B" else ""
            ax.yaxis.set_major_formatter(EngFormatter(unit=unit))  # 12.5 M, not 1.25 and 1e7
            if f"legend{n}" in layout:
                ax.legend(fontsize=10 * pt, loc="upper right", frameon=False)
    for note in layout.get("annotations") or []:
        fig.text(
            (margin["l"] + note["x"] * plot_w) / width,
            (margin["b"] + note["y"] * plot_h) / height + 2 / height,
            unescape(note["text"]),
            ha=note.get("xanchor", "center"),
            va="bottom",
            fontsize=note.get("font", {}).get("size", 13) * pt,
        )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()
