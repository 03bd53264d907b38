"""Dashboard queries, reports and figures on a real chDB store, without a browser."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

pytest.importorskip("dash")

from gpu_trace.dashboard import (  # noqa: E402
    callbacks,
    panels,
    reports,
    samples,
    timeline,
)
from gpu_trace.dashboard.readonly_store import ReadOnlyStore  # noqa: E402
from gpu_trace.plots import charts, figures  # noqa: E402
from gpu_trace.query import overview, reads, timeline_tracks, windows  # noqa: E402
from gpu_trace.query.source import rows as query_rows
from gpu_trace.store.client import Store, StoreError  # noqa: E402
from tests.dashboard_data import (  # noqa: E402
    XSS,
    forwarded_run,
    lod_run,
    minute_run,
    tenants_run,
)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadOnlyStore]:
    store = Store(f"chdb://{tmp_path_factory.mktemp('dash') / 'store'}")
    lod_run(store)
    forwarded_run(store)
    tenants_run(store, "tenants-xss", ("alice", XSS))
    tenants_run(store, "sessions-only", None, stamped=False)
    tenants_run(store, "tenants-one-id-prefix", ("alice", "bob"))
    tenants_run(store, "tenants-unstamped", ("alice", "bob"), stamped=False)
    minute_run(store)
    samples.load_samples(store)
    src = ReadOnlyStore(store=store)
    yield src
    src.close()


def overlapping(source: ReadOnlyStore, run: str, t0: int, t1: int) -> int:
    return query_rows(
        source,
        "SELECT count() AS n FROM __db__.spans WHERE run_id = {r:String}"
        " AND start_ns < {t1:Int64} AND end_ns >= {t0:Int64}",
        {"r": run, "t0": t0, "t1": t1},
    )[0]["n"]


@pytest.mark.parametrize(
    "t0,t1,width", [(0, 10_000_000, 300), (0, 10_000_000, 3000), (1_000_000, 1_050_000, 1000)]
)
def test_window_draws_every_span_as_a_bar_or_density(source: ReadOnlyStore, t0, t1, width) -> None:
    w = timeline.window(source, "lod", t0, t1, width)
    assert w.total_spans == overlapping(source, "lod", t0, t1)
    wide = [b for b in w.bars if not b.get("pinned")]
    assert all(b["end_ns"] - b["start_ns"] >= w.bar_threshold_ns for b in wide)
    # Narrower ones only as the rule says: at most one per row and third of the window.
    assert len(w.bars) - len(wide) == w.pinned <= 2 * timeline.PINS_PER_ROW


def test_zooming_in_turns_density_into_bars(source: ReadOnlyStore) -> None:
    wide = timeline.window(source, "lod", 0, 10_000_000, 300)
    assert {b["name"] for b in wide.bars if not b.get("pinned")} == {f"long{i}" for i in range(5)}
    # The 1 µs spans are density but for the first of each third of the window (drawn anyway).
    pinned = [b for b in wide.bars if b.get("pinned")]
    assert [b["start_ns"] for b in pinned] == [0, 3_340_000, 6_670_000]
    assert {b["name"] for b in pinned} == {"tiny"} and wide.density_spans == 1000 - 3
    narrow = timeline.window(source, "lod", 1_000_000, 1_050_000, 1000)
    assert {b["name"] for b in narrow.bars} == {"tiny", "long0"} and narrow.density_spans == 0


def test_bar_limit_moves_the_rest_into_density(source: ReadOnlyStore, monkeypatch) -> None:
    monkeypatch.setattr(windows, "MAX_BARS", 100)
    w = timeline.window(source, "lod", 0, 10_000_000, 30_000)
    assert w.capped and len(w.bars) <= 100
    assert w.total_spans == overlapping(source, "lod", 0, 10_000_000)


def test_tracks_group_remote_lanes_last_with_clock_uncertainty(source: ReadOnlyStore) -> None:
    tracks = timeline.tracks(source, "fwd")["tracks"]
    assert tracks[-1].lane == "server/execute" and tracks[-1].clock_uncertainty_ns == 5000
    assert "clock ±5 µs" in figures.track_label(tracks[-1])
    rows = [t.row for t in tracks]
    assert rows == sorted(rows) and len(set(rows)) == len(rows)


def test_flows_link_forwarded_calls_to_server_spans(source: ReadOnlyStore) -> None:
    fl = timeline.flows(source, "fwd", 0, 3_000_000)
    assert fl["total"] == 6
    assert {(f["p_lane"], f["c_lane"], f["c_host"]) for f in fl["links"]} == {
        ("forward/batch", "server/execute", "gpu-box")
    }


def test_span_details_cross_hosts_and_same_range_in_other_steps(source: ReadOnlyStore) -> None:
    w = timeline.window(source, "fwd", 0, 3_000_000, 2000)
    batch = next(b for b in w.bars if b["name"] == "batch" and b["start_ns"] == 1_500_000)
    s = timeline.span(source, "fwd", batch["span_id"], batch["start_ns"])
    assert s["attrs"] == {"k": "1"} and s["children_total"] == 1
    assert s["children"][0]["host"] == "gpu-box"
    child = timeline.span(source, "fwd", s["children"][0]["span_id"])
    assert child["parent"]["span_id"] == batch["span_id"]
    steps = timeline.same_range_in_steps(source, "fwd", s)
    assert [(st["step"], st["start_ns"], st["current"]) for st in steps] == [
        ("ProfilerStep#0", 500_000, False),
        ("ProfilerStep#1", 1_500_000, True),
        ("ProfilerStep#2", 2_500_000, False),
    ]


def test_names_are_escaped_in_the_figure(source: ReadOnlyStore) -> None:
    run = reads.run(source, "fwd")
    tr = timeline.tracks(source, "fwd")
    w = timeline.window(source, "fwd", 0, 3_000_000, 2000)
    fig = figures.timeline(run, tr, w, timeline.flows(source, "fwd", 0, 3_000_000), {}, [], 2000)
    # Everything plotly draws is escaped (a JSON encoder would \u003c-escape every "<" on its
    # own); the names on bars are raw text for static/labels.js, which sets them as textContent.
    drawn = {**fig, "layout": {k: v for k, v in fig["layout"].items() if k != "meta"}}
    text = str(drawn)
    assert "<script>" not in text and "<b>lane</b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "nvtx/&lt;b&gt;lane&lt;/b&gt;" in text


def test_ticks_are_durations_since_the_run_started() -> None:
    vals, labels = figures.ticks(1_000, 1_000 + 2_000_000_000, 1_000)
    assert vals[0] == 0 and labels[:3] == ["0 s", "0.2 s", "0.4 s"] or labels[1].endswith(" s")
    vals, labels = figures.ticks(0, 50_000, 0)
    assert all(label.endswith("µs") for label in labels)


def test_counters_are_bucketed_in_the_window(source: ReadOnlyStore) -> None:
    run = reads.run(source, "local-training")
    t0, t1 = run["started_ns"], run["ended_ns"]
    found = timeline.counters(source, "local-training", ["nvml/gpu_util_pct"], t0, t1, 200)
    rows = found["nvml/gpu_util_pct"]
    assert 0 < len(rows) <= 100 and all(t0 <= r["ts_ns"] < t1 for r in rows)


def test_summary_of_the_local_sample(source: ReadOnlyStore) -> None:
    data = reports.summary(source, "local-training")
    assert data["top"]["by_total"] and data["top"]["by_self"]
    paths = {n["path"] for n in data["modules"]["nodes"]}
    assert any("/" in p for p in paths), "nested modules"
    assert len(data["steps"]) == 12
    charts.module_tree(data["modules"])
    charts.steps(data["steps"])


def text_of(component: object) -> str:
    """The text a Dash component tree shows (its string children, in order)."""
    if isinstance(component, str | int | float):
        return str(component)
    children = getattr(component, "children", None)
    if isinstance(children, list | tuple):
        return " ".join(text_of(c) for c in children)
    return "" if children is None else text_of(children)


def test_tenants_of_the_two_tenant_sample(source: ReadOnlyStore) -> None:
    run = "forwarded-two-tenants"
    data = reports.tenants(source, run)
    assert data["labelled"] and [t["key"] for t in data["tenants"]] == ["alice", "bob"]
    alice, bob = (t["sessions"] for t in data["tenants"])
    assert len(alice) == len(bob) == 1 and alice[0]["session"] != bob[0]["session"]
    assert alice[0]["pid"] != bob[0]["pid"], "each tenant's session is its own client process"
    # Every server span names its session and tenant, as the server stamped it; one tenant each.
    stamped = query_rows(
        source,
        "SELECT attrs['session'] AS s, groupUniqArray(attrs['tenant']) AS t FROM __db__.spans"
        " WHERE run_id = {r:String} AND category = 'server' GROUP BY s ORDER BY s",
        {"r": run},
    )
    assert {r["s"]: list(r["t"]) for r in stamped} == {
        alice[0]["session"]: ["alice"], bob[0]["session"]: ["bob"]
    }  # fmt: skip
    quotas = {t: m["quota"][-1][1] for t, m in data["memory"].items()}
    assert quotas == {"alice": 512 << 20, "bob": 256 << 20}
    lines = {t.name: t.line.dash for t in charts.tenant_memory(data).data if "quota" in t.name}
    assert lines == {"alice quota 512 MiB": "dash", "bob quota 256 MiB": "dash"}

    # bob was paged out while idle and restored, three times; alice never.
    events = [(e["tenant"], e["kind"], e["index"]) for e in data["events"]]
    assert sorted(events) == [("bob", k, i) for k in ("page-out", "restore") for i in (1, 2, 3)]
    assert {e["attrs"]["reason"] for e in data["events"] if e["kind"] == "page-out"} == {"idle"}
    paging = {t.name for t in charts.tenant_paging(data).data}
    assert {"bob page-outs", "bob restores", "bob page-out spans", "bob restore spans"} <= paging

    # Busy share and queue wait per tenant: every execute and queue span counted once.
    assert {r["tenant"] for r in data["busy"]} == {r["tenant"] for r in data["queue"]} == {
        "alice", "bob"
    }  # fmt: skip
    spans = query_rows(
        source,
        "SELECT lane, count() AS n, sum(end_ns - start_ns) AS ns FROM __db__.spans"
        " WHERE run_id = {r:String} AND lane IN ('server/execute', 'server/queue') GROUP BY lane",
        {"r": run},
    )
    totals = {r["lane"]: r for r in spans}
    assert sum(r["ns"] for r in data["busy"]) == totals["server/execute"]["ns"]
    assert sum(r["n"] for r in data["queue"]) == totals["server/queue"]["n"]
    assert all(0 < r["share"] <= 1 for r in data["busy"])

    # The summary is the counters' last values (summed over a tenant's sessions).
    last = {
        (r["t"], r["metric"]): r["v"]
        for r in query_rows(
            source,
            """SELECT t, metric, sum(v) AS v FROM (
                 SELECT labels['tenant'] AS t, labels['session'] AS s, metric,
                        argMax(value, ts_ns) AS v
                 FROM __db__.counters WHERE run_id = {r:String} AND source = 'runtime'
                   AND s != '' GROUP BY t, s, metric) GROUP BY t, metric""",
            {"r": run},
        )
    }
    peaks = {
        r["t"]: r["v"]
        for r in query_rows(
            source,
            "SELECT labels['tenant'] AS t, max(value) AS v FROM __db__.counters"
            " WHERE run_id = {r:String} AND metric = 'tenant_memory_bytes' GROUP BY t",
            {"r": run},
        )
    }
    meta = reads.run(source, run)
    for row in data["summary"]:
        t = row["tenant"]
        for m in ("busy_ns", "queue_wait_ns", "bytes_in", "bytes_out", "quota_waits"):
            assert row[m] == last[(t, m)], (t, m)
        assert row["quota_errors"] == last[(t, "quota_errors")] == 0
        assert (row["evictions"], row["restores"]) == ((3, 3) if t == "bob" else (0, 0))
        assert row["peak_bytes"] == peaks[t] and row["peak_share"] == peaks[t] / quotas[t]
        assert row["busy_share"] == row["busy_ns"] / (meta["ended_ns"] - meta["started_ns"])
        assert row["batches"] == sum(r["n"] for r in data["queue"] if r["tenant"] == t)
        assert row["queue_mean_ns"] == row["queue_wait_ns"] // row["batches"]
        # On the CPU device busy_ns is the batches' wall time: the execute spans' (to rounding).
        spans_ns = sum(r["ns"] for r in data["busy"] if r["tenant"] == t)
        assert abs(spans_ns - row["busy_ns"]) < 1e-4 * row["busy_ns"]
    text = text_of(panels.tenants(data))
    assert "512 MiB" in text and "256 MiB" in text and "3 · 3" in text
    assert "issue 6" not in text and "own tenants" in text


def test_a_run_from_before_tenants_has_a_tenant_per_session(source: ReadOnlyStore) -> None:
    data = reports.tenants(source, "sessions-only")
    assert not data["labelled"]
    # The counters name their sessions; the server spans, stored before they carried theirs,
    # are under "no tenant recorded", by client process (their batches' parents).
    assert [(t["key"], s["session"], s["pid"], s["batches"], s["ops"])
            for t in data["tenants"] for s in t["sessions"]] == [
        (reports.NO_TENANT, "", 21, 4, 12), (reports.NO_TENANT, "", 22, 4, 12),
        ("session 1", "1", None, 0, 0), ("session 2", "2", None, 0, 0),
    ]  # fmt: skip
    spans, one, two = data["summary"]
    assert spans["busy_ns"] == 4 * 200_000 + 4 * 300_000
    assert spans["busy_from"] == "server/execute spans"
    assert (spans["queue_wait_ns"], spans["batches"]) == (4 * 10_000 + 4 * 30_000, 8)
    assert one["busy_ns"] is None and one["batches"] == 0  # no guess from the spans' ids
    assert one["peak_bytes"] == 4 << 20 and one["quota_bytes"] is None
    assert one["evictions"] is None and not data["events"]
    assert {r["tenant"] for r in data["busy"]} == {reports.NO_TENANT}
    text = text_of(panels.tenants(data))
    assert "before tenants" in text and "no quota" in text and "pid 21 on client" in text
    assert "stored before server spans carried their session and tenant" in text


def test_a_server_spans_tenant_is_the_one_stamped_on_it_not_its_id_bits(
    source: ReadOnlyStore,
) -> None:
    run = "tenants-one-id-prefix"
    prefixes = query_rows(
        source,
        "SELECT uniqExact(bitShiftRight(span_id, 32)) AS n FROM __db__.spans"
        " WHERE run_id = {r:String} AND category = 'server'",
        {"r": run},
    )
    assert prefixes[0]["n"] == 1  # by their ids, both sessions' spans are one session's
    data = reports.tenants(source, run)
    assert [(t["key"], s["session"], s["pid"], s["batches"], s["ops"])
            for t in data["tenants"] for s in t["sessions"]] == [
        ("alice", "1", 21, 4, 12), ("bob", "2", 22, 4, 12)
    ]  # fmt: skip
    busy = {t: sum(r["ns"] for r in data["busy"] if r["tenant"] == t) for t in ("alice", "bob")}
    assert busy == {"alice": 4 * 200_000, "bob": 4 * 300_000}
    queue = {t: sum(r["ns"] for r in data["queue"] if r["tenant"] == t) for t in ("alice", "bob")}
    assert queue == {"alice": 4 * 10_000, "bob": 4 * 30_000}
    assert [(e["tenant"], e["session"], e["kind"]) for e in data["events"]] == [
        ("bob", "2", "page-out"), ("bob", "2", "restore")
    ]  # fmt: skip
    # The timeline's server lanes name the tenants whose spans they hold.
    server = [t for t in timeline.tracks(source, run)["tracks"] if t.lane.startswith("server/")]
    lanes = {t.lane: t for t in server}
    assert lanes["server/execute"].tenants == ("alice", "bob")
    assert lanes["server/evict"].tenants == ("bob",)  # only bob was paged out
    assert figures.track_label(lanes["server/execute"]).endswith("tenants alice, bob")
    assert figures.track_label(lanes["server/evict"]).endswith(
        "server/evict · tenant bob (session 2)"
    )


def test_a_run_stored_before_server_spans_carried_their_tenant_says_so(
    source: ReadOnlyStore,
) -> None:
    data = reports.tenants(source, "tenants-unstamped")
    assert [t["key"] for t in data["tenants"]] == ["alice", "bob", reports.NO_TENANT]
    alice, bob, spans = data["summary"]
    assert (alice["busy_ns"], bob["busy_ns"]) == (800_000, 1_200_000)  # their counters
    assert (alice["batches"], bob["batches"], spans["batches"]) == (0, 0, 8)
    assert spans["evictions"] is None  # no page-out counter is its, though two spans are
    assert {e["tenant"] for e in data["events"]} == {reports.NO_TENANT}
    tracks = timeline.tracks(source, "tenants-unstamped")["tracks"]
    assert all(not t.tenants for t in tracks)
    assert "stored before server spans" in text_of(panels.tenants(data))


def test_tenant_names_are_text(source: ReadOnlyStore) -> None:
    data = reports.tenants(source, "tenants-xss")
    assert [t["key"] for t in data["tenants"]] == [XSS, "alice"]  # "<" sorts first
    xss, alice = data["summary"]
    assert (alice["quota_bytes"], xss["quota_bytes"]) == (64 << 20, None)
    assert (xss["evictions"], xss["restores"], alice["evictions"]) == (1, 1, 0)
    assert (alice["busy_ns"], xss["busy_ns"], xss["queue_wait_ns"]) == (800_000, 1_200_000, 120_000)
    assert [(e["tenant"], e["kind"]) for e in data["events"]] == [
        (XSS, "page-out"), (XSS, "restore")
    ]  # fmt: skip
    for fig in (
        charts.tenant_memory(data),
        charts.tenant_busy(data),
        charts.tenant_queue(data),
        charts.tenant_paging(data),
        charts.tenant_lines(data, "session_handles", "handles"),
    ):
        text = str(fig)
        assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
        # Hover templates name the trace through its escaped name, never the name itself.
        assert all(XSS not in (t.hovertemplate or "") for t in fig.data)
    # In the page a name is a text child (Dash renders it as text, never as markup).
    assert XSS in text_of(panels.tenants(data))


def test_compare_two_runs(source: ReadOnlyStore) -> None:
    data = reports.compare(source, "local-training", "forwarded-two-tenants")
    assert data["steps"]["a"]["count"] == 12 and data["steps"]["b"]["count"] == 12
    assert data["ops"] and [r["part"] for r in data["breakdown"]] == [
        "client", "wire", "queue", "execute"
    ]  # fmt: skip


def test_export_window_holds_only_the_window(source: ReadOnlyStore) -> None:
    text, n = callbacks.export_window(source, "fwd", 0, 1_000_000)
    events = json.loads(text)["traceEvents"]
    names = [e["name"] for e in events if e.get("ph") == "X"]
    assert n == len(names) and "ProfilerStep#0" in names and XSS not in names


def test_source_sends_only_selects(source: ReadOnlyStore) -> None:
    with pytest.raises(StoreError, match="read-only"):
        query_rows(source, "DROP TABLE __db__.spans")
    # Reads only: no method of the dashboard's store writes, or calls the store by name.
    assert not any(hasattr(source, name) for name in ("call", "ingest", "insert_rows", "sql"))


def test_unreachable_store_is_one_line(tmp_path: Path) -> None:
    src = ReadOnlyStore("http://127.0.0.1:9", lock_timeout_s=0)
    with pytest.raises(StoreError) as exc:
        query_rows(src, "SELECT 1")
    assert "127.0.0.1:9" in str(exc.value) and "\n" not in str(exc.value)


def test_a_steps_counterparts_are_the_other_steps(source: ReadOnlyStore) -> None:
    w = timeline.window(source, "fwd", 0, 3_000_000, 2000)
    step = next(b for b in w.bars if b["name"] == "ProfilerStep#1")
    s = timeline.span(source, "fwd", step["span_id"], step["start_ns"])
    found = timeline.same_range_in_steps(source, "fwd", s)
    assert [(f["step"], f["current"]) for f in found] == [
        ("ProfilerStep#0", False), ("ProfilerStep#1", True), ("ProfilerStep#2", False)
    ]  # fmt: skip


def decoded(spec: dict) -> np.ndarray:
    """A plotly.js typed-array spec back as a numpy array."""
    shape = [int(n) for n in spec["shape"].split(",")]
    return np.frombuffer(base64.b64decode(spec["bdata"]), dtype=spec["dtype"]).reshape(shape)


def lod_figure(source: ReadOnlyStore, t0: int, t1: int, width: int) -> tuple[timeline.Window, dict]:
    run = reads.run(source, "lod")
    w = timeline.window(source, "lod", t0, t1, width)
    return w, figures.timeline(run, timeline.tracks(source, "lod"), w, None, {}, [], width)


@pytest.mark.parametrize("t0,t1,width", [(0, 10_000_000, 300), (1_000_000, 1_050_000, 1000)])
def test_the_figure_draws_each_span_as_one_bar_or_in_one_density_cell(
    source: ReadOnlyStore, t0, t1, width
) -> None:
    w, fig = lod_figure(source, t0, t1, width)
    bars = [t for t in fig["data"] if t["type"] == "bar"]
    cells = [t for t in fig["data"] if t["type"] == "heatmap"]
    in_bars = sum(len(t["x"]) for t in bars)
    in_cells = int(decoded(cells[0]["customdata"]).sum()) if cells else 0
    assert in_bars + in_cells == overlapping(source, "lod", t0, t1)
    assert in_bars == len(w.bars) and in_cells == w.density_spans
    for t in bars:  # each bar can be clicked for its details
        assert len(t["customdata"]) == len(t["x"]) and all(len(c) == 2 for c in t["customdata"])


def test_density_cells_say_how_busy_and_leave_empty_cells_blank(source: ReadOnlyStore) -> None:
    w, fig = lod_figure(source, 0, 10_000_000, 300)
    (cells,) = [t for t in fig["data"] if t["type"] == "heatmap"]
    count, busy = decoded(cells["customdata"]), decoded(cells["z"])
    assert count.shape == busy.shape and count.shape[1] == -(-10_000_000 // w.bucket_ns)
    assert np.isnan(busy[count == 0]).all() and not cells["hoverongaps"]
    # 1 µs spans every 10 µs: each cell is about a tenth busy.
    assert np.nanmax(busy) <= 1 and 0.05 < float(np.nanmean(busy)) < 0.2


def test_bars_are_one_trace_per_category(source: ReadOnlyStore) -> None:
    run = reads.run(source, "fwd")
    w = timeline.window(source, "fwd", 0, 3_000_000, 2000)
    fig = figures.timeline(run, timeline.tracks(source, "fwd"), w, None, {}, [], 2000)
    names = [t["name"] for t in fig["data"] if t["type"] == "bar"]
    assert sorted(names) == sorted(set(names)) == ["forward", "nvtx", "server", "step"]


def test_wide_bars_are_labelled_with_their_name_cut_to_fit(source: ReadOnlyStore) -> None:
    run = reads.run(source, "fwd")
    tr = timeline.tracks(source, "fwd")
    w = timeline.window(source, "fwd", 0, 3_000_000, 2000)
    fig = figures.timeline(run, tr, w, None, {}, [], 2000)
    # The names are not a plotly trace (plotly styles each text element one by one): they go to
    # static/labels.js in the layout's meta, as x (ns since the run started), row and text.
    assert not [t for t in fig["data"] if t.get("mode") == "text"]
    labels = fig["layout"]["meta"]["labels"]
    assert len(labels["x"]) == len(labels["y"]) == len(labels["text"])
    assert "ProfilerStep#0" in labels["text"]
    step = labels["text"].index("ProfilerStep#0")
    bar = next(t for t in fig["data"] if t["type"] == "bar" and t["name"] == "step")
    i = next(i for i, y in enumerate(bar["y"]) if y == labels["y"][step])
    assert bar["base"][i] < labels["x"][step] < bar["base"][i] + bar["x"][i]  # inside its bar
    # A step is 900 µs (600 px at 1.5 µs a pixel): named in full. Narrower than LABEL_PX at
    # 1/10 of the width: no label.
    # Narrower than LABEL_PX at 1/10 of the width: not written inside the bar (beside it, where
    # the row has room: test_narrow_bars_are_named_beside_them_where_there_is_room).
    narrow = figures.timeline(run, tr, w, None, {}, [], 200)["layout"]["meta"]["labels"]
    inside = [t for t, beside in zip(narrow["text"], narrow["beside"]) if not beside]
    assert not [t for t in inside if "batch" in t]
    assert figures.fit_label("ProfilerStep#0", figures.LABEL_PX - 1) == ""
    cut = figures.fit_label("aten::convolution_backward", 60)
    assert cut.endswith("…") and len(cut) * figures.LABEL_FONT_PX * figures.CHAR_EM <= 60


def test_bar_names_are_raw_text_for_the_labels_layer(source: ReadOnlyStore) -> None:
    """static/labels.js sets each name as a text node's textContent (never parsed as markup),
    so the figure carries names as they are, unlike plotly's labels and hovers."""
    run = reads.run(source, "fwd")
    w = timeline.window(source, "fwd", 2_900_000, 3_000_000, 2000)  # the script-named span, wide
    fig = figures.timeline(run, timeline.tracks(source, "fwd"), w, None, {}, [], 2000)
    assert XSS in fig["layout"]["meta"]["labels"]["text"]
    assert any(figures.esc(XSS) in h for t in fig["data"] for h in t.get("hovertext", []))


def test_axes_never_make_plotly_measure_labels_and_draw_twice(source: ReadOnlyStore) -> None:
    w, fig = lod_figure(source, 0, 10_000_000, 300)
    axes = [v for k, v in fig["layout"].items() if k.startswith(("xaxis", "yaxis"))]
    assert axes and all(a["automargin"] is False for a in axes)
    assert all(a["ticklabeloverflow"] == "allow" for a in axes)
    labels = fig["layout"]["yaxis"]["ticktext"]
    widest = max(len(x) for x in labels)
    assert fig["layout"]["margin"]["l"] >= widest * 10 * 0.55  # room for the longest label


def test_typed_arrays_round_trip() -> None:
    a = np.array([[1.5, np.nan], [0.25, 1.0]], dtype=np.float32)
    spec = figures.typed(a)
    assert spec["dtype"] == "f4" and spec["shape"] == "2, 2"
    np.testing.assert_array_equal(decoded(spec), a)
    assert decoded(figures.typed(np.arange(5, dtype=np.uint16)))[-1] == 4


def test_the_first_view_is_built_for_the_address(source: ReadOnlyStore) -> None:
    fresh = ReadOnlyStore(store=source.store())  # nothing read yet
    unread = callbacks.first_view(fresh, "?run=fwd&tab=summary", 1500)
    # A run not read yet: the page goes out at once (the callback draws it), with its run.
    assert ("timeline", "figure") not in unread and ("window", "data") not in unread
    assert unread[("run", "value")] == "fwd" and unread[("run", "options")][0]["value"] == "fwd"
    timeline.prepare(source, "fwd")
    view = callbacks.first_view(source, "?run=fwd&tab=summary", 1500)
    assert view[("run", "value")] == "fwd" and view[("tabs", "value")] == "summary"
    win = view[("window", "data")]
    # It frames the run's steps (ProfilerStep#0 at 0 to #2's end at 2.9 ms; the run is 3 ms).
    assert (win["t0"], win["t1"], win["width"], win["search"]) == (
        0, 2_900_000, callbacks.plot_width(1500), "?run=fwd&tab=summary"
    )  # fmt: skip
    assert any(t["type"] == "bar" for t in view[("timeline", "figure")]["data"])
    assert "as bars" in view[("lod", "children")]
    missing = callbacks.first_view(source, "?run=nope", None)
    assert missing[("window", "data")] is None and missing[("run", "value")] is None
    assert "no run 'nope'" in str(missing[("message", "children")])


def test_the_page_is_sent_with_the_view_its_address_asks_for(source: ReadOnlyStore) -> None:
    from gpu_trace.dashboard.app import VIEW_COOKIE, create_app

    client = create_app(source).server.test_client()
    client.get("/")
    timeline.prepare(source, "fwd")
    assert VIEW_COOKIE in client.get("/").get_data(as_text=True)  # the page sets the cookie
    plain = json.loads(client.get("/_dash-layout").get_data())
    assert '"type": "bar"' not in json.dumps(plain)  # no cookie: Dash's callback draws it
    client.set_cookie(VIEW_COOKIE, quote(json.dumps({"search": "?run=fwd", "width": 1500})))
    layout = json.dumps(json.loads(client.get("/_dash-layout").get_data()))
    assert '"type": "bar"' in layout and '"run": "fwd"' in layout
    client.set_cookie(VIEW_COOKIE, "garbage")
    assert client.get("/_dash-layout").status_code == 200


def test_the_page_asks_for_its_layout_before_dashs_scripts_have_run(source: ReadOnlyStore) -> None:
    """The head script fetches the layout and the callback list at once and hands them to Dash
    when it asks: the server builds the first view while the scripts load and run."""
    from gpu_trace.dashboard.app import create_app

    client = create_app(source).server.test_client()
    page = client.get("/").get_data(as_text=True)
    head = page[: page.index("</head>")]
    assert '["/_dash-layout", "/_dash-dependencies"]' in head and "window.fetch" in head
    assert head.index("document.cookie") < head.index("fetch0(url")  # the view goes with it
    assert page.index("</head>") < page.index("dash_renderer")


def test_the_page_gets_regenerator_runtime_instead_of_dashs_whole_polyfill(
    source: ReadOnlyStore,
) -> None:
    """Dash's and dcc's scripts need the regeneratorRuntime global from @babel/polyfill; the
    rest of it (core-js) only serves browsers Dash does not support. The browser tests run the
    page with it."""
    from gpu_trace.dashboard.app import _regenerator_runtime, create_app

    page = create_app(source).server.test_client().get("/").get_data(as_text=True)
    assert "/deps/polyfill@" not in page
    assert "regeneratorRuntime=e" in page and page.index("regeneratorRuntime=e") < page.index(
        "dash_renderer"
    )
    assert _regenerator_runtime() in page


def test_runs_without_server_spans_skip_the_flow_query(source: ReadOnlyStore) -> None:
    assert timeline.tracks(source, "lod")["server_tracks"] == 0
    assert timeline.tracks(source, "fwd")["server_tracks"] > 0
    assert timeline.flows(source, "lod", 0, 10_000_000) == {"links": [], "total": 0}
    assert timeline.flows(source, "fwd", 0, 3_000_000)["total"] > 0


def test_zoom_and_pan_move_the_window() -> None:
    win = {"base": 100, "start": 100, "end": 1100, "t0": 100, "t1": 1100}
    moved = callbacks._moved(win, {"xaxis.range[0]": 200.0, "xaxis.range[1]": 300.0})
    assert (moved["t0"], moved["t1"]) == (300, 400)
    moved = callbacks._moved(win, {"xaxis2.range": [10, 20]})
    assert (moved["t0"], moved["t1"]) == (110, 120)
    assert callbacks._moved({**win, "t0": 300}, {"xaxis.autorange": True})["t0"] == 100
    assert callbacks._moved(win, {"autosize": True}) is None


def test_the_page_loads_the_dashboards_own_plotly_bundle(source: ReadOnlyStore) -> None:
    from plotly.offline import get_plotlyjs_version

    from gpu_trace.dashboard import app

    # A plotly upgrade without scripts/build_plotly_bundle.sh fails here (the page would then
    # fall back to the full plotly.js, several times slower to start).
    assert app.plotly_bundle_version() == get_plotlyjs_version()
    client = app.create_app(source).server.test_client()
    page = client.get("/").get_data(as_text=True)
    url = next(u for u in page.split("'") if "plotly-dashboard.min.js" in u)
    bundle = client.get(url)
    assert bundle.status_code == 200 and "max-age" in bundle.headers["Cache-Control"]
    assert "package_data/plotly.min.js" not in page
    bundle.close()
    chunks = [u for u in page.split("'") if "/dcc/async-" in u]
    assert len(chunks) == 2  # dcc.Graph's and dcc.Dropdown's code come with the page
    # ... before Dash's renderer starts (a graph drawn before window.Plotly is there would make
    # dcc.Graph fetch the full plotly.js), and the labels layer right after plotly.js.
    renderer = page.index('id="_dash-renderer"')
    assert all(page.index(u) < renderer for u in [*chunks, url])
    assert page.index(url) < page.index("gpuTraceLabels") < renderer
    for u in chunks:
        r = client.get(u)
        assert r.status_code == 200 and b"webpackChunkdash_core_components" in r.data
        r.close()


def test_every_trace_type_drawn_is_in_the_plotly_bundle(source: ReadOnlyStore) -> None:
    from gpu_trace.dashboard.app import PLOTLY_TRACES

    timeline.prepare(source, "forwarded-two-tenants")
    view = callbacks.first_view(source, "?run=forwarded-two-tenants", 1500)
    types = {t["type"] for t in view[("timeline", "figure")]["data"]}
    summary = reports.summary(source, "local-training")
    tenants = reports.tenants(source, "forwarded-two-tenants")
    compare = reports.compare(source, "local-training", "forwarded-two-tenants")
    for fig in (
        charts.top_self(summary["top"]["by_self"]),
        charts.module_tree(summary["modules"]),
        charts.forwarding(summary["forwarding"]),
        charts.steps(summary["steps"]),
        charts.tenant_lines(tenants, "queue_depth", "queue"),
        charts.tenant_memory(tenants),
        charts.tenant_busy(tenants),
        charts.tenant_queue(tenants),
        charts.tenant_paging(tenants),
        charts.compare_steps(compare),
        charts.compare_bars(compare["ops"], "name", ("a", "b"), "ms"),
        figures.empty("nothing"),
    ):
        types |= {t.type for t in fig.data}
    assert types and types <= set(PLOTLY_TRACES)
    assert {"bar", "heatmap", "icicle", "scatter"} <= types
    # And any chart added later: every plotly trace class or trace dict the code names.
    import re

    import plotly.graph_objects as go
    from plotly.basedatatypes import BaseTraceType

    code = "".join(Path(str(m.__file__)).read_text() for m in (charts, figures, panels))
    named = {c.lower() for c in re.findall(r"\bgo\.(?!Figure\b)([A-Z]\w*)\(", code)}
    traces = {name.lower() for name in dir(go) if isinstance(getattr(go, name), type)
              and issubclass(getattr(go, name), BaseTraceType)}  # fmt: skip
    named |= set(re.findall(r'"type": "(\w+)"', code)) & traces
    assert named and named <= set(PLOTLY_TRACES), named - set(PLOTLY_TRACES)


def _timeline_callback(client, app, changed: str, values: dict) -> tuple[int, dict]:
    """POST the page's timeline callback as the Dash renderer does; (status, what it updated).
    ``values``: each input's and state's value by ``id.property`` (None where not given; no step
    links)."""
    key = next(k for k in app.callback_map if "timeline.figure" in k)
    spec = app.callback_map[key]

    def given(deps: list) -> list:
        return [
            [] if isinstance(d["id"], dict) else  # the pattern-matched step links: none
            {"id": d["id"], "property": d["property"],
             "value": values.get(f"{d['id']}.{d['property']}")}
            for d in deps
        ]  # fmt: skip

    body = {
        "output": key,
        "outputs": [{"id": c, "property": p} for c, p in callbacks.TIMELINE_OUTPUTS],
        "inputs": given(spec["inputs"]),
        "changedPropIds": [changed],
        "state": given(spec["state"]),
    }
    r = client.post("/_dash-update-component", json=body)
    return r.status_code, (r.get_json(silent=True) or {}).get("response", {})


def test_a_run_picker_cleared_by_dash_leaves_the_timeline_drawn(source: ReadOnlyStore) -> None:
    # The old "blank first timeline": the run picker got its value before its options, Dash's
    # Dropdown cleared it, and the chain run -> window -> figure drew "no run selected".
    from gpu_trace.dashboard.app import create_app

    app = create_app(source)
    client = app.server.test_client()
    timeline.prepare(source, "fwd")
    view = callbacks.first_view(source, "?run=fwd", 1500)
    page = {"url.search": "?run=fwd", "window.data": view[("window", "data")],
            "tabs.value": "timeline", "viewport.data": 1500}  # fmt: skip
    status, changed = _timeline_callback(client, app, "run.value", {**page, "run.value": None})
    assert not changed, changed  # nothing redrawn
    # Loading the page: the view it came with is the one its address asks for.
    status, changed = _timeline_callback(client, app, "url.search", {**page, "run.value": "fwd"})
    assert not changed, changed
    # Another address, and a zoom: one round trip each, straight to the figure.
    status, changed = _timeline_callback(client, app, "url.search",
                                         {**page, "url.search": "?run=lod"})  # fmt: skip
    assert changed["run"]["value"] == "lod" and changed["window"]["data"]["run"] == "lod"
    assert any(t["type"] == "bar" for t in changed["timeline"]["figure"]["data"])
    zoom = {"xaxis.range[0]": 1_000_000, "xaxis.range[1]": 2_000_000}
    status, changed = _timeline_callback(client, app, "zoom.data", {**page, "zoom.data": zoom})
    win = changed["window"]["data"]
    assert (win["t0"], win["t1"]) == (1_000_000, 2_000_000) and "timeline" in changed


def test_a_first_view_started_with_the_page_is_taken_by_its_layout_request() -> None:
    from gpu_trace.dashboard.app import FirstViews

    built: list[tuple] = []

    def build(search: str, width: int | None) -> dict:
        built.append((search, width))
        return {"search": search, "width": width, "n": len(built)}

    views = FirstViews(build)
    views.start("?run=a", 1600)
    views.start("?run=a", 1600)  # a reload while the first is still wanted: built once
    assert views.take("?run=a", 1600)["n"] == 1 and built == [("?run=a", 1600)]
    assert views.take("?run=a", 1600)["n"] == 2  # taken once; asked again, built again
    views.start("?run=b", 1600)
    assert views.take("?run=b", 1200)["width"] == 1200  # another width: built for it
    for i in range(FirstViews.KEEP + 3):
        views.start(f"?run={i}", None)
    assert len(views._started) <= FirstViews.KEEP


def test_no_callback_shadows_a_module_the_dashboard_imports() -> None:
    """A nested ``def timeline`` inside ``register()`` once hid the timeline module from every
    callback there ('function' object has no attribute 'span'); only a browser showed it."""
    import ast

    for path in sorted(Path(callbacks.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {
            (a.asname or a.name).split(".")[0]
            for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for a in node.names
        }
        for top in tree.body:
            for node in ast.walk(top):
                if node is not top and isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    assert node.name not in imported, f"{path.name}:{node.lineno} {node.name}"


SECOND = 10**9
MINUTE_WIDTH = 1270  # the plot of a 1600 px window


def minute_figure(
    source: ReadOnlyStore, t0: int, t1: int, counters: list[str] | None = None
) -> tuple[timeline.Window, dict]:
    run = reads.run(source, "minute")
    w = timeline.window(source, "minute", t0, t1, MINUTE_WIDTH)
    found = timeline.counters(source, "minute", counters or [], t0, t1, MINUTE_WIDTH)
    tr = timeline.tracks(source, "minute")
    return w, figures.timeline(run, tr, w, None, found, [], MINUTE_WIDTH)


def written(fig: dict) -> list[tuple[int, float, float, str]]:
    """The names written on the timeline: row, left and right pixel (estimated), text."""
    layout = fig["layout"]
    lo, hi = layout["xaxis"]["range"]
    px = MINUTE_WIDTH / (hi - lo)
    labels = layout["meta"]["labels"]
    return [
        (y, (x - lo) * px, (x - lo) * px + figures.label_px(text), text)
        for x, y, text in zip(labels["x"], labels["y"], labels["text"])
    ]


def test_the_whole_run_of_a_minute_names_its_steps_modules_and_batches(
    source: ReadOnlyStore,
) -> None:
    """The first view of a one-minute run: a step is 21 px, a module 2-6 px, a batch under a
    pixel; before, all but the steps were density and nothing was named until zoomed twice."""
    w, fig = minute_figure(source, 0, 60 * SECOND)
    names = [text for *_, text in written(fig)]
    assert sum(n.startswith("ProfilerStep#") for n in names) >= 6
    for name in ("Net", "Net.backward", "Net.decoder", "batch", "aten::relu"):
        assert name in names  # the ops too: the longest of a row of 2 ms ops (0.04 px)
    # Every step and forwarded batch is a bar however narrow; each span still drawn once.
    bars = [b["name"] for b in w.bars]
    assert sum(n.startswith("ProfilerStep#") for n in bars) == 60 and bars.count("batch") == 120
    assert w.pinned and w.total_spans == overlapping(source, "minute", 0, 60 * SECOND)
    drawn = [t for t in fig["data"] if t["type"] == "bar"]
    (cells,) = [t for t in fig["data"] if t["type"] == "heatmap"]
    assert sum(len(t["x"]) for t in drawn) + int(decoded(cells["customdata"]).sum()) == (
        w.total_spans
    )
    # Every bar at least a pixel wide, so a pinned 5 ms batch is seen.
    ns_per_px = 60 * SECOND / MINUTE_WIDTH
    assert min(x for t in drawn for x in t["x"]) >= int(ns_per_px)


def test_names_never_overlap_in_a_row(source: ReadOnlyStore) -> None:
    for t0, t1 in ((0, 60 * SECOND), (0, 6 * SECOND), (SECOND, SECOND + SECOND // 2)):
        rows: dict[int, list[tuple[float, float]]] = {}
        for row, a, b, _ in written(minute_figure(source, t0, t1)[1]):
            rows.setdefault(row, []).append((a, b))
        for spans in rows.values():
            spans.sort()
            assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))


def test_a_zoomed_in_window_draws_each_rows_longest_spans(source: ReadOnlyStore) -> None:
    """Zoomed in (read from the store, not the overview): 2 ms ops are narrower than a
    bucket, yet the three longest of their row are bars, named; the rest stay density."""
    t0, t1 = 0, 6 * SECOND
    w, fig = minute_figure(source, t0, t1)
    assert w.bucket_ns < timeline._overview(source, "minute").cell_ns  # the store's path
    ops = [b for b in w.bars if b["lane"] == "torch/ops"]
    assert len(ops) == timeline.PINS_PER_ROW and all(b.get("pinned") for b in ops)
    assert [b["name"] for b in w.bars].count("batch") == 12
    assert w.total_spans == overlapping(source, "minute", t0, t1)
    assert {"aten::addmm", "aten::relu"} & {text for *_, text in written(fig)}


def test_pick_pins_takes_each_rows_longest_per_part_and_the_marked_kinds() -> None:
    row = np.array([0, 0, 0, 1, 1, -1, 2, 0])
    part = np.array([0, 0, 0, 0, 0, 0, 0, 1])
    dur = np.array([5, 9, 7, 1, 2, 100, 3, 1])
    kind = np.array([False, False, True, False, False, True, True, False])
    start = np.arange(8)
    assert list(overview.pick_pins(row, part, dur, kind, 10, start)) == [1, 2, 4, 6, 7]
    assert list(overview.pick_pins(row, part, dur, kind, 1, start)) == [1, 2, 4, 6, 7]
    assert list(overview.pick_pins(row, part, dur, kind, 0, start)) == [1, 4, 6, 7]
    same = np.array([4, 4, 4])  # equally long: the earliest
    zero = np.zeros(3, int)
    assert list(overview.pick_pins(zero, zero, same, same < 0, 0, np.array([9, 3, 5]))) == [1]
    assert list(overview.window_part(np.array([-5, 0, 33, 34, 99]), 0, 100, 3)) == [0, 0, 0, 1, 2]


def test_a_counter_holds_its_value_in_a_window_narrower_than_its_sampling_interval(
    source: ReadOnlyStore,
) -> None:
    """Samples every 500 ms, a 100 ms window between two: the last sample before the window
    and the first after it come with it, drawn as steps, so the panel shows the value held."""
    t0, t1 = 10 * SECOND + SECOND // 10, 10 * SECOND + SECOND // 5
    found = timeline.counters(source, "minute", ["nvml/gpu_util_pct"], t0, t1, MINUTE_WIDTH)
    rows = found["nvml/gpu_util_pct"]
    assert [(r["ts_ns"], r["value"]) for r in rows] == [(10 * SECOND, 20.0), (10_500_000_000, 21.0)]
    _, fig = minute_figure(source, t0, t1, ["nvml/gpu_util_pct"])
    (line,) = [t for t in fig["data"] if t.get("yaxis") == "y2"]
    assert line["line"]["shape"] == "hv" and line["x"][0] < t0 < t1 < line["x"][-1]
    # A window with samples in it starts with the one before it too.
    rows = timeline.counters(
        source, "minute", ["nvml/gpu_util_pct"], 10_100_000_000, 11_900_000_000, MINUTE_WIDTH
    )["nvml/gpu_util_pct"]
    assert [r["value"] for r in rows] == [20.0, 21.0, 22.0, 23.0, 24.0]


def test_a_span_id_reads_the_same_in_the_page_and_in_its_export(source: ReadOnlyStore) -> None:
    """One form of a span id (16 hex digits) in the details panel and in the export's args; the
    export wrote decimal before."""
    w = timeline.window(source, "fwd", 0, 1_000_000, 2000)
    bar = next(b for b in w.bars if b["lane"] == "server/execute")
    s = timeline.span(source, "fwd", bar["span_id"], bar["start_ns"])
    assert s is not None and s["parent"] is not None
    shown = text_of(panels.details(s, [], 0)).split()
    text, _ = callbacks.export_window(source, "fwd", 0, 1_000_000)
    (event,) = [
        e
        for e in json.loads(text)["traceEvents"]
        if e.get("ph") == "X" and e["name"] == "execute" and e["args"]["span_id"] in shown
    ]
    assert event["args"]["span_id"] == f"{int(s['span_id']):016x}"
    assert event["args"]["parent_span_id"] == f"{int(s['parent_span_id']):016x}"


def test_panels_keep_a_fixed_gap_for_the_titles_whatever_the_figures_height(
    source: ReadOnlyStore,
) -> None:
    """A counter's title sits in the gap above its panel; the gap was a share of the figure
    (4%), 10 px for a run of few tracks, and the title covered the span plot's axis."""
    _, fig = minute_figure(source, 0, 60 * SECOND, ["nvml/gpu_util_pct"])
    layout = fig["layout"]
    plot_px = layout["height"] - layout["margin"]["t"] - layout["margin"]["b"]
    gap = (layout["yaxis"]["domain"][0] - layout["yaxis2"]["domain"][1]) * plot_px
    assert gap >= figures.GAP_PX - 0.5 >= figures.TITLE_FONT_PX * 1.4 + 8
    (title,) = layout["annotations"]
    assert title["y"] == layout["yaxis2"]["domain"][1] and title["yanchor"] == "bottom"


def test_counter_axes_start_at_zero_and_bytes_read_as_bytes(source: ReadOnlyStore) -> None:
    """A flat memory counter had five ticks of one number; plotly wrote 40B for 40 GB."""
    run = reads.run(source, "local-training")
    t0, t1 = run["started_ns"], run["ended_ns"]
    picked = ["nvml/gpu_util_pct", "nvml/mem_used_bytes"]
    found = timeline.counters(source, "local-training", picked, t0, t1, 1000)
    w = timeline.window(source, "local-training", t0, t1, 1000)
    tr = timeline.tracks(source, "local-training")
    layout = figures.timeline(run, tr, w, None, found, [], 1000)["layout"]
    assert layout["yaxis2"]["rangemode"] == layout["yaxis3"]["rangemode"] == "tozero"
    assert (layout["yaxis3"]["tickformat"], layout["yaxis3"]["ticksuffix"]) == ("~s", "B")
    assert "ticksuffix" not in layout["yaxis2"]


def test_the_coarse_and_the_fine_overview_draw_a_window_alike(source: ReadOnlyStore) -> None:
    """A run's first figure comes from the coarse grid, zooms past it from the fine one: a window
    both can answer gets the same bars (always-drawn ones included) and the same spans in each
    row's density, each cell within one bucket of where the other grid put it."""
    run = reads.run(source, "minute")
    start, end = int(run["started_ns"]), int(run["ended_ns"])
    tr = timeline.tracks(source, "minute")
    coarse = overview.overview(source, "minute", start, end, overview.COARSE_CELLS)
    fine = overview.overview(source, "minute", start, end)
    assert coarse.cell_ns > fine.cell_ns and coarse.split_ns == fine.split_ns == fine.cell_ns
    assert coarse.grid.num_rows < fine.grid.num_rows
    t0, t1 = start, end
    assert windows.bucket_size(t0, t1, MINUTE_WIDTH) >= coarse.cell_ns  # both answer it
    a = windows.window(source, "minute", t0, t1, MINUTE_WIDTH, coarse, tr)
    b = windows.window(source, "minute", t0, t1, MINUTE_WIDTH, fine, tr)
    key = lambda w: sorted((x["span_id"], x["start_ns"], bool(x.get("pinned"))) for x in w.bars)  # noqa: E731
    assert key(a) == key(b) and a.bar_threshold_ns == b.bar_threshold_ns
    assert (a.count.sum(axis=1) == b.count.sum(axis=1)).all()
    assert a.total_spans == b.total_spans == overlapping(source, "minute", t0, t1)
    # Each row's cumulative count never drifts by more than one bucket's worth.
    ca, cb = a.count.cumsum(axis=1), b.count.cumsum(axis=1)
    assert (ca[:, 1:] >= cb[:, :-1]).all() and (cb[:, 1:] >= ca[:, :-1]).all()
    # The tracks are the same whichever grid they come from.
    assert [t.key for t in timeline_tracks.tracks(source, "minute", fine)["tracks"]] == [
        t.key for t in tr["tracks"]
    ]


@pytest.mark.parametrize("run_id", ["lod", "minute"])
def test_the_long_spans_found_where_the_grid_saw_them_start_are_the_scans(
    source: ReadOnlyStore, monkeypatch, run_id: str
) -> None:
    """The grid's scan notes where the long spans start, so the long spans' query reads those
    granules only; past :data:`overview.MAX_LONG_STARTS` starts it reads every start. Both give
    the same long spans (short spans starting where a long one does, as the lod run's 1 us spans
    do, stay out) and the same grid."""
    run = reads.run(source, run_id)
    start, end = int(run["started_ns"]), int(run["ended_ns"])
    named = overview.overview(source, run_id, start, end)
    monkeypatch.setattr(overview, "MAX_LONG_STARTS", 0)
    scanned = overview.overview(source, run_id, start, end)
    rows = lambda t: sorted(tuple(r.values()) for r in t.to_pylist())  # noqa: E731
    assert named.long.num_rows == scanned.long.num_rows > 0
    assert rows(named.long) == rows(scanned.long)
    assert named.grid.equals(scanned.grid) and "long_starts" not in named.grid.column_names


def test_a_run_stored_while_the_page_is_open_is_read_ahead_of_its_first_view(
    source: ReadOnlyStore,
) -> None:
    """The page's periodic check that finds the store's runs changed has the newest run's
    overview and tracks read on the dashboard's warm-up thread (dashboard/warmup.py), so its
    first figure, when clicked, is drawn from them; the check that finds nothing new reads
    nothing."""
    from gpu_trace.dashboard.app import create_app

    app = create_app(source)
    client = app.server.test_client()
    newest = reads.resolve_run(source, "last")
    for key in [k for k in source.cache if newest in k]:  # as if stored after the page opened
        del source.cache[key]
    assert not timeline.prepared(source, newest)
    key = next(k for k in app.callback_map if "runs-table.children" in k)
    spec = app.callback_map[key]

    def tick(stamp: str | None) -> int:
        values = {"runs-refresh.n_intervals": 2, "runs-stamp.data": stamp}
        given = [{"id": d["id"], "property": d["property"],
                  "value": values.get(f"{d['id']}.{d['property']}")}
                 for d in spec["inputs"] + spec["state"]]  # fmt: skip
        n = len(spec["inputs"])
        body = {"output": key, "outputs": [dict(zip(("id", "property"), o.rsplit(".", 1)))
                                           for o in key.strip(".").split("...")],
                "inputs": given[:n], "state": given[n:],
                "changedPropIds": ["runs-refresh.n_intervals"]}  # fmt: skip
        r = client.post("/_dash-update-component", json=body)
        return r.status_code

    current = source.runs_stamp()
    assert tick(current) == 204  # nothing changed: no update, nothing read
    assert app.warmer.wait(60) and not timeline.prepared(source, newest)
    assert tick("an older stamp") == 200
    assert app.warmer.wait(60) and timeline.prepared(source, newest)


@pytest.mark.parametrize("max_bars", [windows.MAX_BARS, 3])
@pytest.mark.parametrize(
    "t0,t1",
    [
        (2_500_000_000, 2_510_000_000),
        (2_450_000_000, 2_600_000_000),
        (500_000_000, 3_500_000_000),
        (500_000_000, 6_400_000_000),
    ],
)
def test_a_window_read_from_the_store_takes_the_spans_begun_long_before_it_from_the_overview(
    source: ReadOnlyStore, monkeypatch, max_bars: int, t0: int, t1: int
) -> None:
    """The store is read from one fine cell before the window; the steps and modules that began
    earlier come from the overview's long spans. The window is the one read wholly from the
    store (from the longest span's length before it), bar for bar and cell for cell, capped or
    not."""
    monkeypatch.setattr(windows, "MAX_BARS", max_bars)
    ov, tr = timeline._overview(source, "minute"), timeline.tracks(source, "minute")
    assert windows.bucket_size(t0, t1, MINUTE_WIDTH) < ov.cell_ns  # the store's path
    assert windows._early(ov, t0 - ov.split_ns, t0).num_rows  # some began long before
    got = windows.window(source, "minute", t0, t1, MINUTE_WIDTH, ov, tr)
    whole = dataclasses.replace(ov, split_ns=10**18)  # nothing taken from memory
    want = windows.window(source, "minute", t0, t1, MINUTE_WIDTH, whole, tr)
    key = lambda b: (b["span_id"], b["start_ns"], bool(b.get("pinned")))  # noqa: E731
    assert sorted(map(key, got.bars)) == sorted(map(key, want.bars))
    assert (got.bar_threshold_ns, got.capped, got.pinned) == (
        want.bar_threshold_ns,
        want.capped,
        want.pinned,
    )
    assert np.array_equal(got.count, want.count) and np.allclose(got.busy_ns, want.busy_ns)
    assert got.total_spans == overlapping(source, "minute", t0, t1)
    # The spans drawn anyway are the rule's pick of every narrower span in the window.
    narrow = source.query_arrow(
        "SELECT toString(span_id) AS id, host, pid, tid, lane, category, name, depth, start_ns,"
        " end_ns FROM __db__.spans WHERE run_id = 'minute' AND start_ns < {t1:Int64}"
        " AND end_ns >= {t0:Int64} AND end_ns >= start_ns AND end_ns - start_ns < {thr:Int64}",
        {"t0": t0, "t1": t1, "thr": got.bar_threshold_ns},
    )
    start, end = narrow["start_ns"].to_numpy(), narrow["end_ns"].to_numpy()
    kind = np.isin(narrow["category"].to_numpy(zero_copy_only=False), overview.PIN_CATEGORIES)
    kind |= np.isin(narrow["lane"].to_numpy(zero_copy_only=False), overview.PIN_LANES)
    pick = overview.pick_pins(
        timeline_tracks.track_rows(narrow, tr["tracks"]),
        overview.window_part(start, t0, t1, windows.PINS_PER_ROW),
        end - start, kind, windows.MAX_PINNED_KINDS, start,
    )  # fmt: skip
    rule = {(str(narrow["id"][i]), int(start[i])) for i in pick}
    assert {(b["span_id"], b["start_ns"]) for b in got.bars if b.get("pinned")} == rule
