"""Callbacks: thin glue from page events to queries, figures and panels.

Every callback catches the store's errors (unreachable, closed, an unknown run) and shows their
one-line message in the page instead of a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

from dash import ALL, Dash, Input, Output, Patch, State, ctx, no_update
from dash.exceptions import PreventUpdate

from gpu_trace.dashboard import address, panels, reports, timeline
from gpu_trace.dashboard.address import Address
from gpu_trace.dashboard.layout import TABS
from gpu_trace.dashboard.readonly_store import ReadOnlyStore
from gpu_trace.plots import figures
from gpu_trace.query import gpu_work, reads, windows
from gpu_trace.query import matches as search
from gpu_trace.query.reads import UnknownRunError
from gpu_trace.store.client import StoreError

log = logging.getLogger(__name__)

#: Errors shown in the page as their message.
EXPECTED = (StoreError, UnknownRunError, ValueError)
#: What a callback sets: (component id, property) -> value (a figure, children, data, ...).
Outputs = dict[tuple[str, str], Any]
#: Counters shown under the timeline when a run is opened, the first three present.
DEFAULT_COUNTERS = (
    "nvml/gpu_util_pct",
    "nvml/mem_used_bytes",
    "runtime/session_memory_bytes",
    "host/cpu_util_pct",
    "user/loss",
)
#: The Export tab refuses windows with more spans than this (gpu-trace export streams any size).
EXPORT_MAX_SPANS = 2_000_000
_RANGE = re.compile(r"^xaxis\d*\.range\[([01])\]$")


def _fail(exc: Exception) -> Any:
    if not isinstance(exc, EXPECTED):
        log.exception("gpu-trace dashboard: unexpected error")
        return panels.message(f"internal error: {type(exc).__name__}: {exc}")
    return panels.message(str(exc))


def _synthetic(run: dict[str, Any]) -> bool:
    attrs = run.get("attrs") or {}
    return "synthetic" in attrs.get("gpus", "").lower() or "synthetic" in attrs.get("nvml", "")


#: What the timeline callback sets, in order (component id, property).
TIMELINE_OUTPUTS = (
    ("run", "value"),
    ("message", "children"),
    ("tabs", "value"),
    ("counter-pick", "options"),
    ("counter-pick", "value"),
    ("window", "data"),
    ("selected", "data"),
    ("timeline", "figure"),
    ("lod", "children"),
    ("window-text", "children"),
    ("timeline-message", "children"),
    ("export-info", "children"),
    ("url", "search"),
    ("steps", "disabled"),
    ("search", "value"),
    ("search-count", "children"),
    ("search-hit", "data"),
)
#: The tabs' values (an address naming another tab is read without it).
TAB_VALUES = tuple(v for v, _ in TABS)
#: Plot width (px) when the page has not said its own.
DEFAULT_VIEWPORT = 1600


def plot_width(viewport: int | None) -> int:
    """The plot's width in pixels for a browser window ``viewport`` pixels wide."""
    return max(400, int(viewport or DEFAULT_VIEWPORT) - 330)


def _run_option(run: dict[str, Any]) -> dict[str, str]:
    return {"label": f"{run['run_id']} · {run.get('command', '')[:60]}", "value": run["run_id"]}


def _picked(asked: tuple[str, ...] | None, found: list[str]) -> list[str]:
    """The counter panels: those the address asks for that the run has (none, if it asks for
    none); else the first three of :data:`DEFAULT_COUNTERS` the run has."""
    if asked is not None:
        known = [m for m in asked if m in found]
        if known or not asked:
            return known
    return [m for m in DEFAULT_COUNTERS if m in found][:3]


def _first_window(
    addr: Address, start: int, end: int, steps: tuple[int, int, int] | None
) -> tuple[int, int]:
    """The window a run opens on: the address's, if it shows some of the run; else the run's
    steps, from the first one's start to the last one's end; else the whole run."""
    asked = address.window_in_run(addr.window, end - start)
    if asked is not None:
        return start + asked[0], start + asked[1]
    if steps is not None:
        return _steps_window(steps)
    return start, end


def _steps_window(steps: list[int] | tuple[int, ...]) -> tuple[int, int]:
    """The window that frames a run's steps (``timeline.steps_extent``)."""
    return int(steps[0]), max(int(steps[1]), int(steps[0]) + 1000)


def open_run(
    source: ReadOnlyStore, addr: Address, viewport: int | None, search_str: str | None = None
) -> Outputs:
    """Everything the timeline shows for a run opened at the address ``addr``: the run picker,
    the counters offered and picked, the window (the address's, else the run's steps, else the
    whole run) and its figure, the search term and its count. An unknown run (or a store that
    can't be reached) is a message.

    ``search_str``: the address (``?...``) the page shows, whose view this is; None when the
    view is of a run picked in the page, whose address (``?run=ID``) is then written.

    The page's first view is built here, on the server, with the page itself (app.py), so the
    first paint waits for no callback; the same function answers a run picked later.
    """
    out: Outputs = {k: no_update for k in TIMELINE_OUTPUTS}
    out[("selected", "data")] = None
    try:
        run_id = reads.resolve_run(source, addr.run)
        run = timeline.run(source, run_id)
    except Exception as exc:
        return {**out, **_cleared(), ("message", "children"): _fail(exc)}
    try:
        found = [f"{c['source']}/{c['metric']}" for c in timeline.counter_series(source, run_id)]
    except Exception:
        found = []
    picked = _picked(addr.counters, found)
    start = int(run["started_ns"])
    end = max(int(run["ended_ns"]) or start + 1, start + 1000)
    try:
        steps = timeline.steps_extent(source, run_id)
    except Exception:
        steps = None  # drawn without them; the figure's own queries say what is wrong
    t0, t1 = _first_window(addr, start, end, steps)
    if search_str is None:
        search_str = address.write(Address(run=run_id, tab=addr.tab))
        out[("url", "search")] = search_str
    win = {"run": run_id, "base": start, "t0": t0, "t1": t1, "start": start, "end": end,
           "steps": list(steps) if steps else None, "width": plot_width(viewport),
           "search": search_str}  # fmt: skip
    out.update(
        {
            ("run", "value"): run_id,
            ("message", "children"): "",
            ("counter-pick", "options"): [{"label": m, "value": m} for m in found],
            ("counter-pick", "value"): picked,
            ("window", "data"): win,
            ("steps", "disabled"): steps is None,
        }
    )
    out.update(_searched(source, run_id, addr.query))
    out.update(draw(source, win, picked))
    return out


def _count_text(total: int, index: int | None, term: str) -> str:
    """What the page says beside the search box: ``3 of 12`` (or ``12 matches``) and how the
    term is matched."""
    if not total:
        return f"no span matches · {search.describe(term)}"
    if index is None:
        return f"{total:,} match{'es' if total != 1 else ''} · {search.describe(term)}"
    return f"{index + 1:,} of {total:,} · {search.describe(term)}"


def _searched(source: ReadOnlyStore, run_id: str, term: str | None) -> Outputs:
    """The search box, its count and its state for ``term`` counted in the run (no match
    selected yet); all empty for no term."""
    if not term:
        return {("search", "value"): "", ("search-count", "children"): "",
                ("search-hit", "data"): None}  # fmt: skip
    try:
        total = search.count(source, run_id, term)
    except Exception as exc:
        return {("search", "value"): term, ("search-count", "children"): _fail(exc),
                ("search-hit", "data"): None}  # fmt: skip
    return {
        ("search", "value"): term,
        ("search-count", "children"): _count_text(total, None, term),
        ("search-hit", "data"): {"run": run_id, "q": term, "total": total, "index": None},
    }


def _address(win: dict, picked: list | None, term: str | None, tab: str | None) -> str:
    """The address of the view ``win`` shows (written to the page's address bar)."""
    base = int(win["base"])
    return address.write(
        Address(
            run=win["run"],
            tab=tab if tab and tab != "timeline" else None,
            window=(int(win["t0"]) - base, int(win["t1"]) - base),
            counters=tuple(picked or ()),
            query=term or None,
        )
    )


def _cleared() -> Outputs:
    return {
        ("run", "value"): None,
        ("counter-pick", "options"): [],
        ("counter-pick", "value"): [],
        ("window", "data"): None,
        ("timeline", "figure"): figures.empty("no run selected"),
        ("lod", "children"): "",
        ("window-text", "children"): "",
        ("timeline-message", "children"): "",
        ("export-info", "children"): "no run selected",
        ("steps", "disabled"): True,
        ("search-count", "children"): "",
        ("search-hit", "data"): None,
    }


def draw(source: ReadOnlyStore, win: dict, picked: list | None) -> Outputs:
    """The figure of the window ``win`` and the lines around it."""
    width = int(win.get("width") or plot_width(None))
    out: Outputs = {}
    try:
        run_id, t0, t1 = win["run"], int(win["t0"]), int(win["t1"])
        run = timeline.run(source, run_id)
        tr = timeline.tracks(source, run_id)
        w = timeline.window(source, run_id, t0, t1, width)
        fl = timeline.flows(source, run_id, t0, t1)
        cs = timeline.counters(source, run_id, list(picked or []), t0, t1, width)
        clock = [c for c in timeline.clock_sync(source, run_id) if t0 <= c["ts_ns"] < t1]
        fig = figures.timeline(run, tr, w, fl, cs, clock, width, _synthetic(run))
    except Exception as exc:
        out[("timeline", "figure")] = figures.empty("could not draw this window")
        out[("lod", "children")] = out[("window-text", "children")] = ""
        out[("timeline-message", "children")] = _fail(exc)
        out[("export-info", "children")] = ""
        return out
    base = win["base"]
    lod = (
        f"{len(w.bars):,} spans as bars (≥ {figures.fmt.duration(w.bar_threshold_ns)}"
        + (f"; {w.pinned:,} narrower: each row's longest, steps, batches" if w.pinned else "")
        + f"), {w.density_spans:,} narrower ones as density"
        + (" (bar limit reached)" if w.capped else "")
        + (f" · {fl['total']:,} forwarded-call links" if fl["total"] else "")
        + (f", {len(fl['links']):,} drawn" if fl["total"] > len(fl["links"]) else "")
        + (f" · {tr['unended']:,} spans without an end time not drawn" if tr["unended"] else "")
    )
    text = (
        f"+{figures.fmt.duration(t0 - base)} to +{figures.fmt.duration(t1 - base)} "
        f"({figures.fmt.duration(t1 - t0)})"
    )
    steps = win.get("steps")
    if steps and (t0, t1) == _steps_window(steps):
        text += f" · the run's {int(steps[2]):,} step{'s' if int(steps[2]) != 1 else ''}"
    elif (t0, t1) == (int(win["start"]), int(win["end"])):
        text += " · the whole run"
    note = (
        panels.message("NVML counters of this run are a replay of a SYNTHETIC sample file, "
                       "not a measurement.", "note") if _synthetic(run) else ""
    )  # fmt: skip
    out[("timeline", "figure")] = fig
    out[("lod", "children")] = lod
    out[("window-text", "children")] = text
    out[("timeline-message", "children")] = note
    out[("export-info", "children")] = f"Visible window: {text}, {w.total_spans:,} spans."
    return out


def first_view(source: ReadOnlyStore, location: str | None, viewport: int | None) -> dict:
    """The page's first view for the address ``location`` (``?...``; app.py puts it in the
    page)."""
    addr = address.parse(location, TAB_VALUES)
    first = {("tabs", "value"): addr.tab or "timeline", ("viewport", "data"): viewport}
    try:
        run_id = reads.resolve_run(source, addr.run)
    except Exception:
        run_id = None  # open_run says why, in the page
    if run_id and not timeline.prepared(source, run_id):
        # A run opened for the first time costs a scan of it (seconds for tens of millions of
        # spans): the page goes out at once and the timeline callback draws it. The picker gets
        # the run and its option together (Dash's Dropdown drops a value it has no option for).
        try:
            option = _run_option(timeline.run(source, run_id))
        except Exception:
            return first
        return {**first, ("run", "value"): run_id, ("run", "options"): [option]}
    view = {**open_run(source, addr, viewport, location or ""), **first}
    run_id = view[("run", "value")]
    view[("run", "options")] = [_run_option(timeline.run(source, run_id))] if run_id else []
    return view


def _moved(win: dict, relayout: dict | None) -> dict | None:
    """The window after a zoom or pan (plotly's relayoutData), or None if it did not move."""
    relayout = relayout or {}
    if any(k.endswith("autorange") for k in relayout):
        return {**win, "t0": win["start"], "t1": win["end"]}
    bounds: dict[int, float] = {}
    for k, v in relayout.items():
        m = _RANGE.match(k)
        if m:
            bounds[int(m.group(1))] = float(v)
    for k, v in relayout.items():
        if re.match(r"^xaxis\d*\.range$", k) and isinstance(v, list) and len(v) == 2:
            bounds = {0: float(v[0]), 1: float(v[1])}
    if len(bounds) == 2 and bounds[1] > bounds[0]:
        t0, t1 = win["base"] + int(bounds[0]), win["base"] + int(bounds[1])
        return {**win, "t0": t0, "t1": max(t1, t0 + 1)}
    return None


def _framing(win: dict, start: int, end: int) -> dict:
    """``win`` moved to frame the span ``[start, end)``: it fills the middle half."""
    pad = max((end - start) // 2, 1000)
    return {**win, "t0": start - pad, "t1": end + pad}


def _search(
    source: ReadOnlyStore, win: dict, term: str | None, hit: dict | None, forward: bool | None
) -> Outputs | None:
    """The search box's answer: ``term`` counted in the run (``forward`` None: leaving the
    box), and, going forward or back, the next or previous match framed and selected. None
    when nothing changes (the box left with the term already counted)."""
    term = (term or "").strip()
    run_id = win["run"]
    same = isinstance(hit, dict) and hit.get("run") == run_id and hit.get("q") == term
    if forward is None and (same or (not term and not hit)):
        return None
    if not term:
        return _searched(source, run_id, None)
    if address.text(term) is None:
        return {("search-count", "children"): panels.message(
            f"a search term is at most {address.MAX_TEXT} characters, without control characters"
        ), ("search-hit", "data"): None}  # fmt: skip
    out: Outputs = {}
    if not same:
        out = _searched(source, run_id, term)
        del out[("search", "value")]  # the box holds it
        hit = out[("search-hit", "data")]
    if forward is None or not hit or not hit["total"]:
        return out
    try:
        if hit.get("index") is not None:
            anchor = (int(hit["start_ns"]), int(hit["span_id"]))
            found = (
                search.neighbour(source, run_id, term, after=anchor)
                if forward
                else search.neighbour(source, run_id, term, before=anchor)
            )
        else:
            found = search.from_window(
                source, run_id, term, int(win["t0"]), int(win["t1"]), forward
            )
    except Exception as exc:
        return {**out, ("search-count", "children"): _fail(exc)}
    if found is None:  # nothing matches any more (a run does not change: not expected)
        return {**out, **_searched(source, run_id, term)}
    total = int(hit["total"])
    out[("search-hit", "data")] = {
        "run": run_id, "q": term, "total": total, "index": found.index,
        "span_id": found.span_id, "start_ns": found.start_ns,
    }  # fmt: skip
    out[("search-count", "children")] = _count_text(total, found.index, term)
    out[("window", "data")] = _framing(win, found.start_ns, found.end_ns)
    out[("selected", "data")] = {"span_id": found.span_id, "start_ns": found.start_ns}
    return out


def register(app: Dash, source: ReadOnlyStore) -> None:
    """Attach every callback of the page to ``app``."""

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
