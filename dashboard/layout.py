"""The page: a header with the run picker, the tabs, and one panel per tab (all kept mounted).

The page is sent with its first view in it (the run, the window and its figure: ``view``, from
``callbacks.first_view``), so the timeline is drawn without waiting for a callback.
"""

from __future__ import annotations

from typing import Any

from dash import dcc, html, no_update

from gpu_trace.dashboard import panels

#: How often an open page asks whether runs were stored, updated or removed (milliseconds).
RUNS_REFRESH_MS = 3000

TABS = (
    ("runs", "Runs"),
    ("timeline", "Timeline"),
    ("summary", "Summary"),
    ("tenants", "Tenants"),
    ("ranks", "Ranks"),
    ("compare", "Compare"),
    ("export", "Export"),
)

CSS = """
body { font-family: system-ui, sans-serif; margin: 0; font-size: 14px; color: #222; }
header { display: flex; gap: 1em; align-items: center; padding: 6px 12px; background: #263238; color: #fff; }
header h1 { font-size: 18px; margin: 0; }
header .store { font-size: 12px; opacity: .8; }
#run { min-width: 420px; color: #222; }
.panel { padding: 8px 12px; }
.toolbar { display: flex; gap: 1em; align-items: center; flex-wrap: wrap; margin-bottom: 4px; }
.message { padding: 6px 10px; margin: 6px 0; border-radius: 4px; }
.message.error { background: #fdecea; color: #8a1c1c; border: 1px solid #f5c2c0; }
.message.note { background: #fff8e1; color: #5d4400; border: 1px solid #ffe08a; }
.hint { color: #666; font-size: 12px; }
table.grid, table.kv { border-collapse: collapse; margin: 6px 0; font-size: 12px; }
table.grid td, table.grid th, table.kv td, table.kv th { border: 1px solid #ddd; padding: 2px 6px; text-align: left; }
button.goto { display: block; margin: 2px 0; font-size: 12px; text-align: left; background: #f4f6f8; border: 1px solid #ccd; cursor: pointer; }
button.goto.current { font-weight: bold; }
.search { display: inline-flex; gap: 4px; align-items: center; }
#details { border-top: 1px solid #ddd; margin-top: 6px; padding-top: 4px; }
#timeline { transition: opacity .15s; }
#timeline[data-dash-is-loading="true"] { opacity: .55; cursor: progress; transition: opacity .2s .3s; }
"""


def _panel(name: str, children: list, visible: bool) -> html.Div:
    return html.Div(
        children,
        id=f"panel-{name}",
        className="panel",
        style={} if visible else {"display": "none"},
    )


def page(store_display: str, view: dict[tuple[str, str], Any] | None = None) -> html.Div:
    """The page; ``view`` maps (component id, property) to what it starts with."""
    view = {k: v for k, v in (view or {}).items() if not isinstance(v, type(no_update))}

    def first(cid: str, prop: str, default: Any = None) -> dict[str, Any]:
        value = view.get((cid, prop), default)
        return {} if value is None else {prop: value}

    tab = view.get(("tabs", "value"), "timeline")
    runs = _panel(
        "runs",
        [
            dcc.Input(id="runs-search", type="search", placeholder="search id, command, host, status",
                      debounce=True, style={"width": "30em"}),
            html.Div(id="runs-message"),
            dcc.Dropdown(id="runs-status", placeholder="any status", clearable=True,
                         options=[{"label": v, "value": v} for v in
                                  ("finished", "failed", "killed", "running", "unknown")],
                         style={"width": "14em", "display": "inline-block"}),
            html.Div(id="runs-table"),
            # New runs appear in the list and the run picker while the page stays open: the
            # list is asked again when the store's runs changed (callbacks.list_runs).
            dcc.Interval(id="runs-refresh", interval=RUNS_REFRESH_MS),
            dcc.Store(id="runs-stamp"),
        ],
        tab == "runs",
    )  # fmt: skip
    timeline = _panel(
        "timeline",
        [
            html.Div(
                [
                    html.Button("Whole run", id="reset", n_clicks=0,
                                title="the whole run (double-click the chart does the same)"),
                    html.Button("Steps", id="steps", n_clicks=0,
                                title="from the first step's start to the last step's end",
                                disabled=view.get(("steps", "disabled"), False)),
                    html.Span(id="window-text", **first("window-text", "children")),
                    html.Span(
                        [
                            dcc.Input(id="search", type="text", debounce=False,
                                      placeholder="find spans: name, or a glob (aten::*)",
                                      spellCheck=False, autoComplete="off",
                                      style={"width": "18em"}, **first("search", "value")),
                            html.Button("◀", id="search-prev", n_clicks=0,
                                        title="previous match (Shift+Enter in the box)"),
                            html.Button("▶", id="search-next", n_clicks=0,
                                        title="next match (Enter in the box)"),
                            html.Span(id="search-count", className="hint",
                                      **first("search-count", "children")),
                        ],
                        className="search",
                    ),
                    dcc.Dropdown(id="counter-pick", multi=True, placeholder="counters",
                                 style={"minWidth": "420px"},
                                 **first("counter-pick", "options"),
                                 **first("counter-pick", "value")),
                    html.Span(id="lod", className="hint", **first("lod", "children")),
                ],
                className="toolbar",
            ),
            html.Div(id="timeline-message", **first("timeline-message", "children")),
            # No dcc.Loading around the graph: it would re-mount the plot on every update; the
            # CSS above dims the graph while Dash waits for its figure.
            dcc.Graph(id="timeline", config={"scrollZoom": True, "displaylogo": False},
                      **first("timeline", "figure")),
            html.Div(panels.details(None, [], 0), id="details"),
        ],
        tab == "timeline",
    )  # fmt: skip
    compare = _panel(
        "compare",
        [
            html.Div(
                [
                    dcc.Dropdown(id="compare-a", placeholder="run A", style={"minWidth": "360px"}),
                    dcc.Dropdown(id="compare-b", placeholder="run B", style={"minWidth": "360px"}),
                ],
                className="toolbar",
            ),
            dcc.Loading(html.Div(id="compare-body")),
        ],
        tab == "compare",
    )
    export = _panel(
        "export",
        [
            html.P("Writes the spans and counters of the window visible on the Timeline tab as "
                   "Chrome trace JSON (Perfetto, chrome://tracing, Holistic Trace Analysis). "
                   "For a whole run, gpu-trace export RUN -o FILE.json.gz streams any size."),
            html.Div(id="export-info", **first("export-info", "children")),
            html.Button("Download visible window", id="export-button", n_clicks=0),
            html.Div(id="export-message"),
            dcc.Download(id="download"),
        ],
        tab == "export",
    )  # fmt: skip
    return html.Div(
        [
            dcc.Location(id="url", refresh=False),
            dcc.Store(id="viewport", **first("viewport", "data")),
            dcc.Store(id="window", **first("window", "data")),
            dcc.Store(id="selected"),
            dcc.Store(id="search-hit", **first("search-hit", "data")),
            dcc.Store(id="zoom"),
            html.Header(
                [
                    html.H1("gpu-trace"),
                    dcc.Dropdown(id="run", placeholder="pick a run", clearable=False,
                                 **first("run", "options"), **first("run", "value")),
                    html.Span(f"store: {store_display}", className="store"),
                ]
            ),
            html.Div(id="message", **first("message", "children")),
            dcc.Tabs(id="tabs", value=tab, children=[dcc.Tab(label=t, value=v, id=f"tab-{v}")
                                                     for v, t in TABS]),
            runs,
            timeline,
            _panel("summary", [dcc.Loading(html.Div(id="summary-body"))], tab == "summary"),
            _panel("tenants", [dcc.Loading(html.Div(id="tenants-body"))], tab == "tenants"),
            _panel("ranks", [dcc.Loading(html.Div(id="ranks-body"))], tab == "ranks"),
            compare,
            export,
        ]
    )  # fmt: skip
