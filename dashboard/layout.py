"""The page: a header with the run picker, the tabs, and one panel per tab (all kept mounted)."""

from __future__ import annotations

from dash import dcc, html

TABS = (
    ("runs", "Runs"),
    ("timeline", "Timeline"),
    ("summary", "Summary"),
    ("tenants", "Tenants"),
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
#details { border-top: 1px solid #ddd; margin-top: 6px; padding-top: 4px; }
"""


def _panel(name: str, children: list, visible: bool = False) -> html.Div:
    return html.Div(
        children,
        id=f"panel-{name}",
        className="panel",
        style={} if visible else {"display": "none"},
    )


def page(store_display: str) -> html.Div:
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
        ],
    )  # fmt: skip
    timeline = _panel(
        "timeline",
        [
            html.Div(
                [
                    html.Button("Whole run", id="reset", n_clicks=0),
                    html.Span(id="window-text"),
                    dcc.Dropdown(id="counter-pick", multi=True, placeholder="counters",
                                 style={"minWidth": "420px"}),
                    html.Span(id="lod", className="hint"),
                ],
                className="toolbar",
            ),
            html.Div(id="timeline-message"),
            dcc.Loading(dcc.Graph(id="timeline", config={"scrollZoom": True, "displaylogo": False}),
                        delay_show=400),
            html.Div(id="details"),
        ],
        visible=True,
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
    )
    export = _panel(
        "export",
        [
            html.P("Writes the spans and counters of the window visible on the Timeline tab as "
                   "Chrome trace JSON (Perfetto, chrome://tracing, Holistic Trace Analysis). "
                   "For a whole run, gpu-trace export RUN -o FILE.json.gz streams any size."),
            html.Div(id="export-info"),
            html.Button("Download visible window", id="export-button", n_clicks=0),
            html.Div(id="export-message"),
            dcc.Download(id="download"),
        ],
    )  # fmt: skip
    return html.Div(
        [
            dcc.Location(id="url", refresh=False),
            dcc.Store(id="viewport"),
            dcc.Store(id="window"),
            dcc.Store(id="selected"),
            html.Header(
                [
                    html.H1("gpu-trace"),
                    dcc.Dropdown(id="run", placeholder="pick a run", clearable=False),
                    html.Span(f"store: {store_display}", className="store"),
                ]
            ),
            html.Div(id="message"),
            dcc.Tabs(id="tabs", value="timeline", children=[dcc.Tab(label=t, value=v, id=f"tab-{v}")
                                                            for v, t in TABS]),
            runs,
            timeline,
            _panel("summary", [dcc.Loading(html.Div(id="summary-body"))]),
            _panel("tenants", [dcc.Loading(html.Div(id="tenants-body"))]),
            compare,
            export,
        ]
    )  # fmt: skip
