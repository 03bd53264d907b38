"""The timeline's views: a run opened at an address (its first view, built with the page), a
window drawn, a zoom or pan read, the search box answered. Plain functions of the store and the
page's state that return what the page shows (:data:`Outputs`); :mod:`.callbacks` wires them to
the page's events.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from dash import no_update

from gpu_trace.dashboard import address, panels, timeline
from gpu_trace.dashboard.address import Address
from gpu_trace.dashboard.layout import TABS
from gpu_trace.dashboard.readonly_store import ReadOnlyStore
from gpu_trace.plots import figures
from gpu_trace.query import matches as search
from gpu_trace.query import reads
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
        # The window first: it reads the grid it is answered from, the tracks then come from it.
        w = timeline.window(source, run_id, t0, t1, width)
        tr = timeline.tracks(source, run_id)
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
