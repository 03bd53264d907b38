"""Callbacks: thin glue from page events to queries, figures and panels.

Every callback catches the store's errors (unreachable, closed, an unknown run) and shows their
one-line message in the page instead of a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Any

from dash import ALL, Dash, Input, Output, Patch, State, ctx, no_update
from dash.exceptions import PreventUpdate

from gpu_trace.dashboard import address, panels, rank_view, reports, timeline
from gpu_trace.dashboard.address import Address
from gpu_trace.dashboard.layout import TABS
from gpu_trace.dashboard.readonly_store import ReadOnlyStore
from gpu_trace.dashboard.views import (
    DEFAULT_VIEWPORT,
    TAB_VALUES,
    TIMELINE_OUTPUTS,
    Outputs,
    _address,
    _fail,
    _framing,
    _moved,
    _run_option,
    _search,
    _steps_window,
    draw,
    first_view,
    open_run,
    plot_width,
)
from gpu_trace.dashboard.warmup import Warmer
from gpu_trace.plots import figures
from gpu_trace.query import gpu_work, reads, windows
from gpu_trace.query.distributed import rank_summary

log = logging.getLogger(__name__)

#: The Export tab refuses windows with more spans than this (gpu-trace export streams any size).
EXPORT_MAX_SPANS = 2_000_000

__all__ = [
    "DEFAULT_VIEWPORT",
    "EXPORT_MAX_SPANS",
    "TAB_VALUES",
    "TIMELINE_OUTPUTS",
    "draw",
    "export_window",
    "first_view",
    "open_run",
    "plot_width",
    "register",
]


def register(app: Dash, source: ReadOnlyStore, warmer: Warmer | None = None) -> None:
    """Attach every callback of the page to ``app``; ``warmer`` reads each run stored while the
    page is open ahead of its first view (dashboard/warmup.py)."""

    app.clientside_callback(
        "function(p) { return window.innerWidth; }",
        Output("viewport", "data"),
        Input("url", "pathname"),
    )

    @app.callback(
        Output("runs-table", "children"),
        Output("run", "options"),
        Output("compare-a", "options"),
        Output("compare-b", "options"),
        Output("runs-message", "children"),
        Output("runs-stamp", "data"),
        Output("run", "value", allow_duplicate=True),
        Input("runs-search", "value"),
        Input("runs-status", "value"),
        Input("runs-refresh", "n_intervals"),
        State("run", "value"),
        State("runs-stamp", "data"),
        prevent_initial_call="initial_duplicate",
    )
    def list_runs(
        runs_search: str | None, status: str | None, _tick: int | None, current: str | None,
        shown_stamp: str | None,
    ) -> tuple:  # fmt: skip
        """The run list, the run picker and compare's pickers; on the page's periodic tick only
        when the store's runs changed since the list shown (no query while an embedded store is
        held, one small one on a server), and never waiting for a store another process holds.
        A page opened on an empty store opens the first run stored (``last``) once there is one;
        otherwise what is on screen stays."""
        stamp: object = no_update
        ticked = ctx.triggered_id == "runs-refresh"
        if ticked:
            try:
                stamp = source.runs_stamp(timeout_s=0)
            except Exception:
                raise PreventUpdate from None  # busy or down: the next tick asks again
            if stamp == shown_stamp:
                raise PreventUpdate
        else:
            with contextlib.suppress(Exception):
                stamp = source.runs_stamp()
        try:
            runs = reads.runs(source, limit=500, search=runs_search or None)
        except Exception as exc:
            return [], [], [], [], _fail(exc), no_update, no_update
        if ticked and warmer is not None and runs:
            warmer.want()  # a run stored while the page is open: the newest, read ahead
        opened: object = no_update
        if ticked and not current and runs and str(shown_stamp).startswith("0:"):
            with contextlib.suppress(Exception):
                opened = reads.resolve_run(source, "last")
        shown = [r for r in runs if not status or r.get("status") == status]
        opts = [_run_option(r) for r in runs]
        note = (
            ""
            if runs
            else panels.message("No runs yet: gpu-trace record -- python train.py", "note")
        )
        picker = opts
        if current and current not in {r["run_id"] for r in runs}:
            # The run on screen stays in the picker (an old one, or one a search left out).
            with contextlib.suppress(Exception):
                picker = [_run_option(timeline.run(source, current)), *opts]
        return panels.runs_table(shown), picker, opts, opts, note, stamp, opened

    @app.callback(
        *[Output(f"panel-{v}", "style") for v, _ in TABS],
        Input("tabs", "value"),
        prevent_initial_call=True,  # the page is sent with the right panel shown
    )
    def show_tab(tab: str) -> list:
        return [{} if v == tab else {"display": "none"} for v, _ in TABS]

    # Only a zoom, a pan or a double-click moves the window. plotly also reports other layout
    # changes (the autosize of a first draw): sent to the timeline callback, such a no-op would
    # make Dash drop the answer of a call still in flight (the newest call of a callback wins).
    app.clientside_callback(
        """function(r) {
            const moved = r && Object.keys(r).some(k => /^xaxis\\d*\\.(range|autorange)/.test(k));
            return moved ? r : window.dash_clientside.no_update;
        }""",
        Output("zoom", "data"),
        Input("timeline", "relayoutData"),
        prevent_initial_call=True,
    )

    @app.callback(
        *[Output(c, p) for c, p in TIMELINE_OUTPUTS],
        Input("url", "search"),
        Input("run", "value"),
        Input("reset", "n_clicks"),
        Input("steps", "n_clicks"),
        Input("zoom", "data"),
        Input({"type": "goto", "span": ALL, "start": ALL, "end": ALL}, "n_clicks"),
        Input("counter-pick", "value"),
        Input("search", "n_submit"),
        Input("search", "n_blur"),
        Input("search-prev", "n_clicks"),
        Input("search-next", "n_clicks"),
        State("search", "value"),
        State("search-hit", "data"),
        State("window", "data"),
        State("tabs", "value"),
        State("viewport", "data"),
    )
    def update_timeline(
        location, run_id, _reset, _steps, zoom, _goto, picked, _submit, _blur, _prev, _next,
        term, hit, win, tab, viewport,
    ):  # fmt: skip
        """Every change of what the timeline shows, in one round trip: the address, the run
        picker, Whole run and Steps, zoom and pan, a step link, the counters, the search. Each
        change but the address's writes the view's address (``address.write``)."""
        out: Outputs = {k: no_update for k in TIMELINE_OUTPUTS}
        trig = ctx.triggered_id
        if trig is None or trig == "url":
            addr = address.parse(location, TAB_VALUES)
            if win and win.get("search") == location:
                # The page came with this view drawn (app.py), the view wrote this address
                # itself, or a link to it was followed.
                want = addr.tab
                out[("tabs", "value")] = want if want and want != tab else no_update
                return _ordered(out)
            view = open_run(source, addr, viewport, location or "")
            view[("tabs", "value")] = addr.tab or tab
            return _ordered(view)
        if trig == "run":
            # None: Dash's Dropdown clears a value it has no option for; nothing to draw.
            if not run_id or (win and win.get("run") == run_id):
                return _ordered(out)
            other = tab if tab in TAB_VALUES and tab != "timeline" else None
            return _ordered(open_run(source, Address(run=run_id, tab=other), viewport))
        if not win:
            return _ordered(out)
        shown = hit.get("q") if hit and hit.get("run") == win["run"] else None
        if trig == "reset":
            win = {**win, "t0": win["start"], "t1": win["end"]}
        elif trig == "steps":
            if not win.get("steps"):
                return _ordered(out)
            t0, t1 = _steps_window(win["steps"])
            win = {**win, "t0": t0, "t1": t1}
        elif trig == "zoom":
            moved = _moved(win, zoom)
            if moved is None:
                return _ordered(out)
            win = moved
        elif isinstance(trig, dict) and trig.get("type") == "goto":
            if not ctx.triggered[0]["value"]:
                return _ordered(out)
            start, end = int(trig["start"]), int(trig["end"])
            win = _framing(win, start, end)
            out[("selected", "data")] = {"span_id": trig["span"], "start_ns": start}
        elif trig in ("search", "search-prev", "search-next"):
            prop = ctx.triggered[0]["prop_id"].rsplit(".", 1)[-1]
            step = None if prop == "n_blur" else trig != "search-prev"
            found = _search(source, win, term, hit, step)
            if found is None:
                return _ordered(out)
            out.update(found)
            now = out[("search-hit", "data")]
            shown = now.get("q") if isinstance(now, dict) else shown if now is no_update else None
            if out.get(("window", "data"), no_update) is no_update:
                # Counted, not moved: the figure stays; the address gets the term.
                written = _address(win, picked, shown, tab)
                out[("url", "search")] = written
                out[("window", "data")] = {**win, "search": written}
                return _ordered(out)
            win = out[("window", "data")]
        elif trig != "counter-pick":
            return _ordered(out)
        written = _address(win, picked, shown, tab)
        win = {**win, "search": written}
        out[("url", "search")] = written
        out[("window", "data")] = win
        out.update(draw(source, win, picked))
        return _ordered(out)

    @app.callback(
        Output("selected", "data", allow_duplicate=True),
        Input("timeline", "clickData"),
        prevent_initial_call=True,
    )
    def select(click: dict | None) -> Any:
        """A click on a bar selects its span (the details panel shows it)."""
        point = ((click or {}).get("points") or [{}])[0]
        data = point.get("customdata")
        if isinstance(data, list) and len(data) == 2:
            return {"span_id": str(data[0]), "start_ns": int(data[1])}
        return no_update

    @app.callback(
        Output("details", "children"),
        Output("timeline", "figure", allow_duplicate=True),
        Input("selected", "data"),
        State("window", "data"),
        prevent_initial_call=True,  # the page is sent with the hint
    )
    def show_details(sel: dict | None, win: dict | None) -> Any:
        """The selected span's details; for GPU work, the line from its launching call to it
        (trace 0 of the figure, set with a Patch: the window is not drawn again)."""
        link = Patch()
        link["data"][figures.LAUNCH_TRACE]["x"] = []
        link["data"][figures.LAUNCH_TRACE]["y"] = []
        if not sel or not win:
            return panels.details(None, [], 0), link
        try:
            s = timeline.span(source, win["run"], sel["span_id"], sel.get("start_ns"))
            if s is None:
                return panels.message(f"span {sel['span_id']} is not in run {win['run']}"), link
            steps = timeline.same_range_in_steps(source, win["run"], s)
            chain = None
            if s["category"] in gpu_work.DEVICE_CATEGORIES:
                chain = gpu_work.launch_chain(source, win["run"], s["span_id"], s["parent_span_id"])
                if chain and chain[0]["category"] == "cuda_api":
                    tracks = timeline.tracks(source, win["run"])["tracks"]
                    xs, ys = figures.launch_link(tracks, dict(chain[0]), s, win["base"])
                    link["data"][figures.LAUNCH_TRACE]["x"] = xs
                    link["data"][figures.LAUNCH_TRACE]["y"] = ys
            return panels.details(s, steps, win["base"], chain), link
        except Exception as exc:
            return _fail(exc), no_update

    @app.callback(Output("summary-body", "children"), Input("tabs", "value"), Input("run", "value"))
    def show_summary(tab: str, run_id: str | None) -> Any:
        if tab != "summary" or not run_id:
            return no_update
        try:
            return panels.summary(reports.summary(source, run_id))
        except Exception as exc:
            return _fail(exc)

    @app.callback(Output("tenants-body", "children"), Input("tabs", "value"), Input("run", "value"))
    def show_tenants(tab: str, run_id: str | None) -> Any:
        if tab != "tenants" or not run_id:
            return no_update
        try:
            return panels.tenants(reports.tenants(source, run_id))
        except Exception as exc:
            return _fail(exc)

    @app.callback(Output("ranks-body", "children"), Input("tabs", "value"), Input("run", "value"))
    def show_ranks(tab: str, run_id: str | None) -> Any:
        if tab != "ranks" or not run_id:
            return no_update
        try:
            return rank_view.ranks(rank_summary(source, run_id))
        except Exception as exc:
            return _fail(exc)

    @app.callback(
        Output("compare-body", "children"),
        Input("compare-a", "value"),
        Input("compare-b", "value"),
    )
    def show_compare(a: str | None, b: str | None) -> Any:
        if not a or not b:
            return panels.message("Pick two runs to compare.", "note")
        try:
            return panels.compare(reports.compare(source, a, b))
        except Exception as exc:
            return _fail(exc)

    @app.callback(
        Output("download", "data"),
        Output("export-message", "children"),
        Input("export-button", "n_clicks"),
        State("window", "data"),
        prevent_initial_call=True,
    )
    def export(_n: int, win: dict | None) -> tuple:
        if not win:
            return no_update, panels.message("no run selected")
        try:
            data, spans = export_window(source, win["run"], int(win["t0"]), int(win["t1"]))
        except Exception as exc:
            return no_update, _fail(exc)
        name = f"{win['run']}-{int(win['t0']) - win['base']}-{int(win['t1']) - win['base']}.json"
        return {"content": data, "filename": name}, panels.message(
            f"wrote {name}: {spans:,} spans", "note"
        )


def _ordered(out: Outputs) -> tuple:
    return tuple(out[k] for k in TIMELINE_OUTPUTS)


def export_window(source: ReadOnlyStore, run_id: str, t0: int, t1: int) -> tuple[str, int]:
    """Chrome trace JSON of the spans and counters in ``[t0, t1)``, and how many spans it holds."""
    from gpu_trace.export.exporter import export_run, get_exporter

    n = windows.spans_in(source, run_id, t0, t1)
    if n > EXPORT_MAX_SPANS:
        raise ValueError(
            f"the window holds {n:,} spans; zoom in below {EXPORT_MAX_SPANS:,} or use "
            f"gpu-trace export {run_id} -o FILE.json.gz"
        )
    with tempfile.TemporaryDirectory(prefix="gpu-trace-export-") as tmp:
        path = Path(tmp) / "window.json"
        exporter = get_exporter(
            "chrome",
            path=path,
            run=reads.run(source, run_id),
            threads=reads.threads(source, run_id),
            total_spans=int(n),
        )
        spans = source.spans(run_id, start_ns=t0, end_ns=t1)
        if not export_run(exporter, spans, source.counters(run_id, start_ns=t0, end_ns=t1)):
            raise ValueError(f"the export failed: {getattr(exporter, 'error', None)}")
        return path.read_text(), int(n)
