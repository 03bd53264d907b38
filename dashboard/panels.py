"""Dash components built from query results: tables, the span details panel, messages.

Plain functions to component trees. Dash renders every string child as text (React escapes it),
so names from the store never become markup here.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from dash import dcc, html

from gpu_trace import _format as fmt
from gpu_trace.dashboard import charts

TENANTS_NOTE = (
    "A tenant here is one forwarding session on the server (docs/dashboard.md). Shown: the "
    "server's per-session accounting (memory and handles it holds, queue depth, from the "
    "runtime counters) and its server spans (execute share, queue wait). Quotas and evictions "
    "come with the sharing runtime (issue 6), which is not built yet: those charts say so until "
    "its counters appear."
)


def message(text: str, kind: str = "error") -> html.Div:
    """A one-line message in the page (errors say what went wrong and what to do)."""
    return html.Div(text, className=f"message {kind}", role="alert" if kind == "error" else None)


def table(headers: list[str], rows: list[list[Any]], cls: str = "grid") -> html.Table:
    return html.Table(
        [html.Thead(html.Tr([html.Th(h) for h in headers]))]
        + [html.Tbody([html.Tr([html.Td(str(c)) for c in row]) for row in rows])],
        className=cls,
    )


def runs_table(runs: list[dict[str, Any]]) -> html.Table:
    """The Runs tab: one row per run; its id links to its timeline."""
    head = ["run", "started", "duration", "events", "status", "hosts", "command"]
    rows = []
    for r in runs:
        dur = r.get("duration_ns")
        rows.append(
            html.Tr(
                [
                    html.Td(
                        dcc.Link(
                            r["run_id"],
                            href=f"?{urlencode({'run': r['run_id'], 'tab': 'timeline'})}",
                        )
                    ),
                    html.Td(fmt.wall_time(r.get("started_wall_ns"))),
                    html.Td(fmt.duration(dur) if dur else "-"),
                    html.Td(fmt.count(int(r.get("spans", 0)) + int(r.get("counters", 0)))),
                    html.Td(r.get("status", "")),
                    html.Td(", ".join(r.get("hosts") or [])),
                    html.Td(r.get("command", "")),
                ]
            )
        )
    return html.Table(
        [html.Thead(html.Tr([html.Th(h) for h in head])), html.Tbody(rows)], className="grid"
    )


def _goto(label: str, span_id: str, start: int, end: int, current: bool = False) -> html.Button:
    return html.Button(
        label,
        id={"type": "goto", "span": str(span_id), "start": int(start), "end": int(end)},
        className="goto current" if current else "goto",
        n_clicks=0,
    )


def _span_line(s: dict[str, Any], base: int) -> str:
    dur = int(s["end_ns"]) - int(s["start_ns"])
    return (
        f"{s['name']} · {s['lane']} · {s['host']} pid {s['pid']} · "
        f"+{fmt.duration(int(s['start_ns']) - base)} · {fmt.duration(dur)}"
    )


def details(s: dict[str, Any] | None, steps: list[dict[str, Any]], base: int) -> html.Div:
    """The span details panel: fields, attributes, parent, children, same range in other steps."""
    if s is None:
        return html.Div("Click a span to see its details.", className="hint", id="details-empty")
    dur = int(s["end_ns"]) - int(s["start_ns"])
    fields = [
        ["name", s["name"]],
        ["category", s["category"]],
        ["lane", s["lane"]],
        ["host · pid · tid", f"{s['host']} · {s['pid']} · {s['tid']}"],
        ["start", f"+{fmt.duration(int(s['start_ns']) - base)} ({s['start_ns']} ns)"],
        ["duration", f"{fmt.duration(dur)} ({dur} ns)"],
        ["depth", s["depth"]],
        ["span id", f"{int(s['span_id']):016x}"],
    ]
    attrs = sorted((s.get("attrs") or {}).items())
    parts: list[Any] = [
        html.H4(s["name"], id="details-name"),
        table(["field", "value"], fields, "kv"),
    ]
    if attrs:
        parts += [html.H5("attributes"), table(["key", "value"], [list(a) for a in attrs], "kv")]
    if "clock_uncertainty_ns" in (s.get("attrs") or {}):
        unc = int(s["attrs"]["clock_uncertainty_ns"] or 0)
        parts.append(
            html.P(
                f"Remote span: mapped onto this run's clock with offset "
                f"{s['attrs'].get('clock_offset_ns', '?')} ns, uncertain by ±{fmt.duration(unc)}.",
                className="hint",
            )
        )
    parent = s.get("parent")
    parts.append(html.H5("parent"))
    if parent:
        parts.append(
            _goto(_span_line(parent, base), parent["span_id"], parent["start_ns"], parent["end_ns"])
        )
    else:
        parts.append(html.Div("none (a root span)" if not int(s["parent_span_id"]) else
                              "not in this run", className="hint"))  # fmt: skip
    kids = s.get("children") or []
    parts.append(html.H5(f"children ({s.get('children_total', 0)})"))
    parts += [_goto(_span_line(c, base), c["span_id"], c["start_ns"], c["end_ns"]) for c in kids]
    if s.get("children_total", 0) > len(kids):
        parts.append(html.Div(f"and {s['children_total'] - len(kids)} more", className="hint"))
    parts.append(html.H5("same range in other steps"))
    if steps:
        parts += [
            _goto(
                f"{st['step']}: {fmt.duration(int(st['end_ns']) - int(st['start_ns']))}",
                st["span_id"],
                st["start_ns"],
                st["end_ns"],
                st["current"],
            )
            for st in steps
        ]
    else:
        parts.append(html.Div("not inside a step", className="hint"))
    return html.Div(parts, id="details-body")


def summary(data: dict[str, Any]) -> html.Div:
    top = data["top"]
    rows_total = [
        [r["name"], r["lane"], fmt.count(r["count"]), fmt.duration(r["total_ns"]),
         fmt.duration(r["self_ns"]), fmt.duration(r["mean_ns"]), fmt.duration(r["max_ns"])]
        for r in top["by_total"]
    ]  # fmt: skip
    head = ["name", "lane", "count", "total", "self", "mean", "max"]
    mods = data["modules"]
    parts: list[Any] = [
        html.H4("Top ranges by total time"),
        table(head, rows_total),
        dcc.Graph(figure=charts.top_self(top["by_self"]), id="summary-self"),
        dcc.Graph(figure=charts.module_tree(mods), id="summary-modules"),
    ]
    if mods["truncated"]:
        parts.append(message(f"module tree from the first {mods['spans']:,} module spans", "note"))
    fwd = data["forwarding"]
    parts.append(dcc.Graph(figure=charts.forwarding(fwd), id="summary-forwarding"))
    if fwd.get("ops"):
        t = fwd["totals"]
        parts.append(
            html.P(
                f"{fmt.count(t['count'])} forwarded ops in {fmt.count(fwd['batches'])} batches; "
                f"the program waited {fmt.duration(fwd['wait_ns'])} at sync points. "
                "Client, wire, queue and execute overlap (docs/remote.md)."
            )
        )
    parts.append(dcc.Graph(figure=charts.steps(data["steps"]), id="summary-steps"))
    return html.Div(parts)


def tenants(data: dict[str, Any]) -> html.Div:
    gib = float(1 << 30)
    parts: list[Any] = [message(TENANTS_NOTE, "note")]
    if not data["tenants"]:
        parts.append(
            message("No forwarding sessions in this run (record --remote makes them).", "note")
        )
        return html.Div(parts)
    parts.append(
        table(["tenant", "session", "client pid"],
              [[t["label"], t.get("session", ""), t.get("pid", "")] for t in data["tenants"]])
    )  # fmt: skip
    parts += [
        dcc.Graph(figure=charts.tenant_lines(data, "session_memory_bytes",
                                             "device memory held per tenant (GiB)", gib)),
        dcc.Graph(figure=charts.tenant_busy(data)),
        dcc.Graph(figure=charts.tenant_queue(data)),
        dcc.Graph(figure=charts.tenant_lines(data, "queue_depth", "server queue depth")),
    ]  # fmt: skip
    for metric in data["missing"]:
        if metric in ("quota_bytes", "evictions"):
            parts.append(
                message(f"{metric}: not recorded (quotas and evictions come with issue 6)", "note")
            )
    return html.Div(parts)


def compare(data: dict[str, Any]) -> html.Div:
    sa, sb = data["steps"]["a"], data["steps"]["b"]
    rows = [
        [k, fmt.duration(sa[k]) if sa["count"] else "-", fmt.duration(sb[k]) if sb["count"] else "-",
         fmt.duration(sb[k] - sa[k]) if sa["count"] and sb["count"] else "-"]
        for k in ("mean_ns", "median_ns", "p90_ns")
    ]  # fmt: skip
    rows.insert(0, ["steps", sa["count"], sb["count"], sb["count"] - sa["count"]])
    names = (data["a"], data["b"])
    ops = [[r["name"], fmt.duration(r["a_ns"]), fmt.duration(r["b_ns"]),
            fmt.duration(r["delta_ns"])] for r in data["ops"]]  # fmt: skip
    brk = [[r["part"], fmt.duration(r["a_ns"]), fmt.duration(r["b_ns"]),
            fmt.duration(r["delta_ns"])] for r in data["breakdown"]]  # fmt: skip
    head = ["", f"A: {data['a']}", f"B: {data['b']}", "B - A"]
    return html.Div(
        [
            html.H4("Step time"),
            table(head, rows),
            dcc.Graph(figure=charts.compare_steps(data)),
            html.H4("Top ranges by total time"),
            table(head, ops),
            dcc.Graph(figure=charts.compare_bars(data["ops"], "name", names, "total time (ms)")),
            html.H4("Forwarding breakdown"),
            table(head, brk),
            dcc.Graph(
                figure=charts.compare_bars(data["breakdown"], "part", names, "forwarded (ms)")
            ),
        ]
    )
