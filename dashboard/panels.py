"""Dash components built from query results: tables, the span details panel, messages.

Plain functions to component trees. Dash renders every string child as text (React escapes it),
so names from the store never become markup here.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from dash import dcc, html
from dash.development.base_component import Component

from gpu_trace import _format as fmt
from gpu_trace.plots import charts
from gpu_trace.query.gpu_work import DeviceKernels, SpanRef, StepBusy
from gpu_trace.query.relatives import SpanDetail, SpanRow, StepCounterpart
from gpu_trace.query.summary import RunSummary
from gpu_trace.query.tenancy import NO_TENANT, Tenants, TenantSummary

TENANTS_NOTE = (
    "Per tenant, from the sharing runtime's counters and the server's spans in this run: memory "
    "held against the tenant's quota, its share of the server's busy time, queue wait per batch, "
    "page-outs and restores, quota waits. A run holds only its own tenants' numbers: a client's "
    "run never gets another tenant's (docs/sharing.md)."
)
TENANTS_BEFORE = (
    "This run was recorded before tenants existed: each forwarding session is shown as a tenant "
    "of its own, named by its session; quotas, page-outs and the busy and queue counters were not "
    "recorded (busy and queue wait come from the server's spans)."
)
TENANTS_UNSTAMPED = (
    "This run was stored before server spans carried their session and tenant: its server "
    "spans' busy time, queue wait, page-outs and restores are under '{}', their sessions there "
    "by client process. The counters still name each tenant."
)
_TOTALS_HINT = (
    "Busy and queue wait: totals of the server/execute and server/queue spans.",
    "Totals are the last values of the cumulative counters (busy: busy_ns, the device time the "
    "scheduler charged); batches and ops: the server/execute spans.",
)


def message(text: str, kind: str = "error") -> html.Div:
    """A one-line message in the page (errors say what went wrong and what to do)."""
    return html.Div(text, className=f"message {kind}", role="alert" if kind == "error" else None)


def _cell(value: object) -> html.Td:
    return html.Td(value if isinstance(value, Component) else str(value))


def table(headers: list[str], rows: list[list[Any]], cls: str = "grid") -> html.Table:
    """A table of text cells (a Dash component in a cell is kept as it is)."""
    return html.Table(
        [html.Thead(html.Tr([html.Th(h) for h in headers]))]
        + [html.Tbody([html.Tr([_cell(c) for c in row]) for row in rows])],
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


def _span_line(s: SpanRow, base: int) -> str:
    dur = int(s["end_ns"]) - int(s["start_ns"])
    return (
        f"{s['name']} · {s['lane']} · {s['host']} pid {s['pid']} · "
        f"+{fmt.duration(int(s['start_ns']) - base)} · {fmt.duration(dur)}"
    )


def _launch(start_ns: int, chain: list[SpanRef], base: int) -> list[Component]:
    """What launched a kernel, copy or memset: its API call (name, duration, thread), then the
    op, modules and ranges open on that thread, innermost first, each a link to it."""
    parts: list[Component] = [html.H5("launched by")]
    if not chain:
        return [*parts, html.Div("no launching call recorded for it", className="hint")]
    call = chain[0]
    if call["category"] == "cuda_api":
        parts.append(
            html.Div(
                f"{call['name']} · {fmt.duration(call['end_ns'] - call['start_ns'])} · "
                f"{call['host']} pid {call['pid']} tid {call['tid']}, "
                f"{fmt.duration(start_ns - call['start_ns'])} before it started",
                id="details-launch-call",
            )
        )
    op = next((c for c in chain if c["category"] not in ("cuda_api", "step")), None)
    if op is not None:
        parts.append(
            html.Div(
                ["at launch, inside ", html.B(op["name"], id="details-launch-op"),
                 f" ({op['category']}, {op['lane']})"]
            )
        )  # fmt: skip
    for c in chain:
        line = (
            f"{c['name']} · {c['lane']} · {c['host']} pid {c['pid']} tid {c['tid']} · "
            f"+{fmt.duration(c['start_ns'] - base)} · {fmt.duration(c['end_ns'] - c['start_ns'])}"
        )
        parts.append(_goto(line, c["span_id"], c["start_ns"], c["end_ns"]))
    return parts


def details(
    s: SpanDetail | None,
    steps: list[StepCounterpart],
    base: int,
    chain: list[SpanRef] | None = None,
) -> html.Div:
    """The span details panel: fields, attributes, what launched it (``chain``: GPU work's API
    call and the ranges open at launch, :func:`gpu_work.launch_chain`), parent, children, same
    range in other steps."""
    if s is None:
        return html.Div("Click a span to see its details.", className="hint", id="details-empty")
    dur = int(s["end_ns"]) - int(s["start_ns"])
    fields: list[list[Any]] = [
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
    if chain is not None:
        parts += _launch(int(s["start_ns"]), chain, base)
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
    floor = "+" if s.get("children_partial") else ""  # too many inside it to read them all
    parts.append(html.H5(f"children ({s.get('children_total', 0)}{floor})"))
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
    """The Summary tab: what `gpu-trace show` prints (one RunSummary), with charts."""
    run: RunSummary = data["run"]
    top = data["top"]
    parts: list[Any] = []
    if run.steps:
        rows = [
            [s.kind, fmt.count(s.count), fmt.duration(s.p50_ns), fmt.duration(s.p90_ns),
             fmt.duration(s.mean_ns), fmt.duration(s.max_ns)]
            for s in run.steps
        ]  # fmt: skip
        parts += [
            html.H4("Step times"),
            html.Div(table(["step", "count", "p50", "p90", "mean", "max"], rows),
                     id="summary-step-stats"),
        ]  # fmt: skip
    lanes = [[lane.lane, fmt.count(lane.spans), fmt.duration(lane.busy_ns),
              f"{100 * lane.share:.1f}%"] for lane in run.lanes]  # fmt: skip
    rows_total = [
        [r["name"], r["lane"], fmt.count(r["count"]), fmt.duration(r["total_ns"]),
         fmt.duration(r["self_ns"]), fmt.duration(r["median_ns"]), fmt.duration(r["max_ns"]),
         f"{100 * r['share']:.1f}%"]
        for r in top["by_total"]
    ]  # fmt: skip
    head = ["name", "lane", "count", "total", "self", "median", "max", "of run"]
    mods = data["modules"]
    parts += [
        html.H4("Lanes"),
        html.P(
            "busy: time covered by the lane's spans, nested ones counted once", className="hint"
        ),
        html.Div(table(["lane", "spans", "busy", "of run"], lanes), id="summary-lanes"),
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
    parts += _gpu_tables(data.get("kernels") or [], data.get("gpu_steps") or [])
    return html.Div(parts)


def _gpu_tables(devices: list[DeviceKernels], steps: list[StepBusy]) -> list[Component]:
    """Top kernels by GPU time per device, and each step's GPU busy and idle share."""
    if not devices:
        return []
    parts: list[Component] = [html.H4("Top kernels by GPU time")]
    head = ["kernel", "count", "total", "mean", "share of busy"]
    for d in devices:
        idle = d["window_ns"] - d["busy_ns"]
        parts.append(
            html.P(
                f"GPU {d['device']}: {fmt.count(d['kernels'])} kernels, "
                f"{fmt.duration(d['kernel_ns'])} of kernel time; busy "
                f"{fmt.duration(d['busy_ns'])}, idle {fmt.duration(idle)} between its first "
                "and last work (busy: kernels, copies and memsets, overlaps once)"
            )
        )
        rows = [
            [html.Span(k["short"], title=k["name"]), fmt.count(k["count"]),
             fmt.duration(k["total_ns"]), fmt.duration(k["mean_ns"]), f"{100 * k['share']:.1f}%"]
            for k in d["top"]
        ]  # fmt: skip
        parts.append(html.Div(table(head, rows), id=f"summary-kernels-gpu{d['device']}"))
    parts.append(dcc.Graph(figure=charts.gpu_busy(steps), id="summary-gpu-busy"))
    if steps:
        rows = [
            [r["step"], r["pid"], f"GPU {r['device']}", fmt.duration(r["dur_ns"]),
             fmt.duration(r["busy_ns"]), fmt.duration(r["idle_ns"]),
             f"{100 * r['busy_share']:.1f}%"]
            for r in steps
        ]  # fmt: skip
        head = ["step", "pid", "device", "step time", "GPU busy", "GPU idle", "busy share"]
        parts.append(html.Details([html.Summary("GPU busy and idle per step"),
                                   table(head, rows)], id="summary-gpu-steps"))  # fmt: skip
    return parts


def _pair(a: Any, b: Any, show: Any) -> str:
    """``a · b``; ``-`` for a number the run did not record."""
    return " · ".join(show(v) if v is not None else "-" for v in (a, b))


def _tenant_row(t: TenantSummary) -> list[str]:
    busy = "-"
    if t["busy_ns"] is not None:
        busy = fmt.duration(t["busy_ns"])
        if t["busy_share"] is not None:
            busy += f" ({t['busy_share']:.1%} of the run)"
    return [
        t["tenant"],
        ", ".join(t["sessions"]) or "-",
        fmt.size(t["peak_bytes"]),
        fmt.size(t["quota_bytes"]) if t["quota_bytes"] else "no quota",
        f"{t['peak_share']:.2%}" if t["peak_share"] is not None else "-",
        busy,
        f"{fmt.count(t['batches'])} · {fmt.count(t['ops'])}",
        _pair(t["queue_wait_ns"], t["queue_mean_ns"], fmt.duration),
        _pair(t["bytes_in"], t["bytes_out"], fmt.size),
        _pair(t["evictions"], t["restores"], fmt.count),
        _pair(t["quota_waits"], t["quota_errors"], fmt.count),
    ]


def tenants(data: Tenants) -> html.Div:
    """The Tenants tab: a summary row per tenant, its sessions, then the charts over time."""
    parts: list[Any] = [message(TENANTS_NOTE, "note")]
    if not data["tenants"]:
        parts.append(
            message("No forwarding sessions in this run (record --remote makes them).", "note")
        )
        return html.Div(parts)
    if not data["labelled"]:
        parts.append(message(TENANTS_BEFORE, "note"))
    if any(t["key"] == NO_TENANT for t in data["tenants"]):
        parts.append(message(TENANTS_UNSTAMPED.format(NO_TENANT), "note"))
    head = ["tenant", "sessions", "peak memory", "quota", "peak / quota", "busy",
            "batches · ops", "queue wait · per batch", "bytes in · out", "page-outs · restores",
            "quota waits · errors"]  # fmt: skip
    parts += [
        html.H4("Tenants"),
        html.Div(table(head, [_tenant_row(t) for t in data["summary"]]), id="tenants-summary"),
        html.P(_TOTALS_HINT[any(t["busy_from"] == "busy_ns" for t in data["summary"])],
               className="hint"),
    ]  # fmt: skip
    sessions = [
        [t["key"], s["session"] or "-",
         f"pid {s['pid']} on {s['host']}" if s["host"] else "-",
         fmt.count(s["batches"]), fmt.count(s["ops"])]
        for t in data["tenants"] for s in t["sessions"]
    ]  # fmt: skip
    if sessions:
        parts += [
            html.H4("Sessions"),
            table(["tenant", "session", "client", "batches", "ops"], sessions),
        ]
    parts += [
        dcc.Graph(figure=charts.tenant_memory(data), id="tenants-memory"),
        dcc.Graph(figure=charts.tenant_busy(data), id="tenants-busy"),
        dcc.Graph(figure=charts.tenant_queue(data), id="tenants-queue"),
        dcc.Graph(figure=charts.tenant_paging(data), id="tenants-paging"),
    ]
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
