"""Callbacks: thin glue from page events to queries, figures and panels.

Every callback catches the store's errors (unreachable, closed, an unknown run) and shows their
one-line message in the page instead of a traceback.
"""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from dash import ALL, Dash, Input, Output, State, ctx, no_update

from gpu_trace.dashboard import figures, panels, queries, reports
from gpu_trace.dashboard.layout import TABS
from gpu_trace.dashboard.source import Source
from gpu_trace.tracer.queries import UnknownRunError
from gpu_trace.tracer.store import StoreError

log = logging.getLogger(__name__)

#: Errors shown in the page as their message.
EXPECTED = (StoreError, UnknownRunError, ValueError)
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


def register(app: Dash, source: Source) -> None:
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
        Input("runs-search", "value"),
        Input("runs-status", "value"),
    )
    def list_runs(search: str | None, status: str | None) -> tuple:
        try:
            runs = source.call("runs", limit=500, search=search or None)
        except Exception as exc:
            return [], [], [], [], _fail(exc)
        shown = [r for r in runs if not status or r.get("status") == status]
        opts = [{"label": f"{r['run_id']} · {r.get('command', '')[:60]}", "value": r["run_id"]}
                for r in runs]  # fmt: skip
        note = (
            ""
            if runs
            else panels.message("No runs yet: gpu-trace record -- python train.py", "note")
        )
        return panels.runs_table(shown), opts, opts, opts, note

    @app.callback(
        Output("run", "value"),
        Output("message", "children"),
        Output("tabs", "value"),
        Input("url", "search"),
        State("tabs", "value"),
    )
    def pick_run(search: str | None, tab: str) -> tuple:
        ref = (parse_qs((search or "").lstrip("?")).get("run") or ["last"])[0]
        want = (parse_qs((search or "").lstrip("?")).get("tab") or [tab])[0]
        want = want if want in {v for v, _ in TABS} else tab
        try:
            return source.call("resolve_run", ref), "", want
        except Exception as exc:
            return None, _fail(exc), want

    @app.callback(
        *[Output(f"panel-{v}", "style") for v, _ in TABS],
        Input("tabs", "value"),
    )
    def show_tab(tab: str) -> list:
        return [{} if v == tab else {"display": "none"} for v, _ in TABS]

    @app.callback(
        Output("counter-pick", "options"),
        Output("counter-pick", "value"),
        Input("run", "value"),
    )
    def counter_options(run_id: str | None) -> tuple:
        if not run_id:
            return [], []
        try:
            found = [f"{c['source']}/{c['metric']}" for c in queries.counter_series(source, run_id)]
        except Exception:
            return [], []
        default = [m for m in DEFAULT_COUNTERS if m in found][:3]
        return [{"label": m, "value": m} for m in found], default

    @app.callback(
        Output("window", "data"),
        Output("selected", "data"),
        Input("run", "value"),
        Input("reset", "n_clicks"),
        Input("timeline", "relayoutData"),
        Input("timeline", "clickData"),
        Input({"type": "goto", "span": ALL, "start": ALL, "end": ALL}, "n_clicks"),
        State("window", "data"),
    )
    def navigate(run_id, _reset, relayout, click, _goto, win) -> tuple:
        trig = ctx.triggered_id
        if trig in ("run", "reset") or (win is None or win.get("run") != run_id):
            if not run_id:
                return None, None
            try:
                run = queries.run(source, run_id)
            except Exception:
                return None, None
            end = int(run["ended_ns"]) or int(run["started_ns"]) + 1
            full = {"run": run_id, "base": int(run["started_ns"]), "t0": int(run["started_ns"]),
                    "t1": max(end, int(run["started_ns"]) + 1000)}  # fmt: skip
            full["start"], full["end"] = full["t0"], full["t1"]
            return full, (None if trig == "run" else no_update)
        if trig == "timeline" and "timeline.clickData" in ctx.triggered_prop_ids:
            point = ((click or {}).get("points") or [{}])[0]
            data = point.get("customdata")
            if isinstance(data, list) and len(data) == 2:
                return no_update, {"span_id": str(data[0]), "start_ns": int(data[1])}
            return no_update, no_update
        if trig == "timeline":
            relayout = relayout or {}
            if any(k.endswith("autorange") for k in relayout):
                return {**win, "t0": win["start"], "t1": win["end"]}, no_update
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
                return {**win, "t0": t0, "t1": max(t1, t0 + 1)}, no_update
            return no_update, no_update
        if isinstance(trig, dict) and trig.get("type") == "goto" and ctx.triggered[0]["value"]:
            start, end = int(trig["start"]), int(trig["end"])
            pad = max((end - start) // 2, 1000)
            return (
                {**win, "t0": start - pad, "t1": end + pad},
                {"span_id": trig["span"], "start_ns": start},
            )
        return no_update, no_update

    @app.callback(
        Output("timeline", "figure"),
        Output("lod", "children"),
        Output("window-text", "children"),
        Output("timeline-message", "children"),
        Output("export-info", "children"),
        Input("window", "data"),
        Input("counter-pick", "value"),
        State("viewport", "data"),
    )
    def draw(win: dict | None, picked: list | None, viewport: int | None) -> tuple:
        if not win:
            return figures.empty("no run selected"), "", "", "", "no run selected"
        width = max(400, int(viewport or 1600) - 330)
        try:
            run_id, t0, t1 = win["run"], int(win["t0"]), int(win["t1"])
            run = queries.run(source, run_id)
            tr = queries.tracks(source, run_id)
            w = queries.window(source, run_id, t0, t1, width)
            fl = queries.flows(source, run_id, t0, t1)
            cs = queries.counters(source, run_id, list(picked or []), t0, t1, width)
            clock = [c for c in queries.clock_sync(source, run_id) if t0 <= c["ts_ns"] < t1]
            fig = figures.timeline(run, tr, w, fl, cs, clock, width, _synthetic(run))
        except Exception as exc:
            return figures.empty("could not draw this window"), "", "", _fail(exc), ""
        base = win["base"]
        lod = (
            f"{len(w.bars):,} spans as bars (≥ {figures.fmt.duration(w.bar_threshold_ns)}), "
            f"{w.density_spans:,} narrower ones as density"
            + (" (bar limit reached)" if w.capped else "")
            + (f" · {fl['total']:,} forwarded-call links" if fl["total"] else "")
            + (f", {len(fl['links']):,} drawn" if fl["total"] > len(fl["links"]) else "")
            + (f" · {tr['unended']:,} spans without an end time not drawn" if tr["unended"] else "")
        )
        text = (
            f"+{figures.fmt.duration(t0 - base)} to +{figures.fmt.duration(t1 - base)} "
            f"({figures.fmt.duration(t1 - t0)})"
        )
        note = (
            panels.message("NVML counters of this run are a replay of a SYNTHETIC sample file, "
                           "not a measurement.", "note") if _synthetic(run) else ""
        )  # fmt: skip
        export = f"Visible window: {text}, {w.total_spans:,} spans."
        return fig, lod, text, note, export

    @app.callback(
        Output("details", "children"),
        Input("selected", "data"),
        State("window", "data"),
    )
    def show_details(sel: dict | None, win: dict | None) -> Any:
        if not sel or not win:
            return panels.details(None, [], 0)
        try:
            s = queries.span(source, win["run"], sel["span_id"], sel.get("start_ns"))
            if s is None:
                return panels.message(f"span {sel['span_id']} is not in run {win['run']}")
            steps = queries.same_range_in_steps(source, win["run"], s)
            return panels.details(s, steps, win["base"])
        except Exception as exc:
            return _fail(exc)

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


def export_window(source: Source, run_id: str, t0: int, t1: int) -> tuple[str, int]:
    """Chrome trace JSON of the spans and counters in ``[t0, t1)``, and how many spans it holds."""
    from gpu_trace.tracer import chrome

    n = source.rows(
        "SELECT count() AS n FROM __db__.spans WHERE run_id = {run:String}"
        " AND start_ns < {t1:Int64} AND end_ns >= {t0:Int64}",
        {"run": run_id, "t0": t0, "t1": t1},
    )[0]["n"]
    if n > EXPORT_MAX_SPANS:
        raise ValueError(
            f"the window holds {n:,} spans; zoom in below {EXPORT_MAX_SPANS:,} or use "
            f"gpu-trace export {run_id} -o FILE.json.gz"
        )
    with tempfile.TemporaryDirectory(prefix="gpu-trace-export-") as tmp:
        path = Path(tmp) / "window.json"
        run = source.call("run", run_id)
        chrome.write_chrome_trace(
            path,
            run,
            source.call("threads", run_id),
            source.call("iter_spans", run_id, start_ns=t0, end_ns=t1),
            source.call("iter_counters", run_id, start_ns=t0, end_ns=t1),
            total_spans=int(n),
        )
        return path.read_text(), int(n)
