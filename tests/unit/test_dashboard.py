"""Dashboard queries, reports and figures on a real chDB store, without a browser."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("dash")

from gpu_trace.dashboard import callbacks, charts, figures, queries, reports, samples  # noqa: E402
from gpu_trace.dashboard.source import Source  # noqa: E402
from gpu_trace.tracer.store import Store, StoreError  # noqa: E402
from tests.dashboard_data import XSS, forwarded_run, lod_run  # noqa: E402


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Source]:
    store = Store(f"chdb://{tmp_path_factory.mktemp('dash') / 'store'}")
    lod_run(store)
    forwarded_run(store)
    samples.load_samples(store)
    src = Source(store=store)
    yield src
    src.close()


def overlapping(source: Source, run: str, t0: int, t1: int) -> int:
    return source.rows(
        "SELECT count() AS n FROM __db__.spans WHERE run_id = {r:String}"
        " AND start_ns < {t1:Int64} AND end_ns >= {t0:Int64}",
        {"r": run, "t0": t0, "t1": t1},
    )[0]["n"]


@pytest.mark.parametrize(
    "t0,t1,width", [(0, 10_000_000, 300), (0, 10_000_000, 3000), (1_000_000, 1_050_000, 1000)]
)
def test_window_draws_every_span_as_a_bar_or_density(source: Source, t0, t1, width) -> None:
    w = queries.window(source, "lod", t0, t1, width)
    assert w.total_spans == overlapping(source, "lod", t0, t1)
    assert all(b["end_ns"] - b["start_ns"] >= w.bar_threshold_ns for b in w.bars)


def test_zooming_in_turns_density_into_bars(source: Source) -> None:
    wide = queries.window(source, "lod", 0, 10_000_000, 300)
    assert {b["name"] for b in wide.bars} == {f"long{i}" for i in range(5)}
    assert wide.density_spans == 1000
    narrow = queries.window(source, "lod", 1_000_000, 1_050_000, 1000)
    assert {b["name"] for b in narrow.bars} == {"tiny", "long0"} and narrow.density_spans == 0


def test_bar_limit_moves_the_rest_into_density(source: Source, monkeypatch) -> None:
    monkeypatch.setattr(queries, "MAX_BARS", 100)
    w = queries.window(source, "lod", 0, 10_000_000, 30_000)
    assert w.capped and len(w.bars) <= 100
    assert w.total_spans == overlapping(source, "lod", 0, 10_000_000)


def test_tracks_group_remote_lanes_last_with_clock_uncertainty(source: Source) -> None:
    tracks = queries.tracks(source, "fwd")["tracks"]
    assert tracks[-1].lane == "server/execute" and tracks[-1].clock_uncertainty_ns == 5000
    assert "clock ±5 µs" in figures.track_label(tracks[-1])
    rows = [t.row for t in tracks]
    assert rows == sorted(rows) and len(set(rows)) == len(rows)


def test_flows_link_forwarded_calls_to_server_spans(source: Source) -> None:
    fl = queries.flows(source, "fwd", 0, 3_000_000)
    assert fl["total"] == 6
    assert {(f["p_lane"], f["c_lane"], f["c_host"]) for f in fl["links"]} == {
        ("forward/batch", "server/execute", "gpu-box")
    }


def test_span_details_cross_hosts_and_same_range_in_other_steps(source: Source) -> None:
    w = queries.window(source, "fwd", 0, 3_000_000, 2000)
    batch = next(b for b in w.bars if b["name"] == "batch" and b["start_ns"] == 1_500_000)
    s = queries.span(source, "fwd", batch["span_id"], batch["start_ns"])
    assert s["attrs"] == {"k": "1"} and s["children_total"] == 1
    assert s["children"][0]["host"] == "gpu-box"
    child = queries.span(source, "fwd", s["children"][0]["span_id"])
    assert child["parent"]["span_id"] == batch["span_id"]
    steps = queries.same_range_in_steps(source, "fwd", s)
    assert [(st["step"], st["start_ns"], st["current"]) for st in steps] == [
        ("ProfilerStep#0", 500_000, False),
        ("ProfilerStep#1", 1_500_000, True),
        ("ProfilerStep#2", 2_500_000, False),
    ]


def test_names_are_escaped_in_the_figure(source: Source) -> None:
    run = source.call("run", "fwd")
    tr = queries.tracks(source, "fwd")
    w = queries.window(source, "fwd", 0, 3_000_000, 2000)
    fig = figures.timeline(run, tr, w, queries.flows(source, "fwd", 0, 3_000_000), {}, [], 2000)
    text = str(fig.to_dict())  # to_json would \u003c-escape every "<" on its own
    assert "<script>" not in text and "<b>lane</b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "nvtx/&lt;b&gt;lane&lt;/b&gt;" in text


def test_ticks_are_durations_since_the_run_started() -> None:
    vals, labels = figures.ticks(1_000, 1_000 + 2_000_000_000, 1_000)
    assert vals[0] == 0 and labels[:3] == ["0 s", "0.2 s", "0.4 s"] or labels[1].endswith(" s")
    vals, labels = figures.ticks(0, 50_000, 0)
    assert all(label.endswith("µs") for label in labels)


def test_counters_are_bucketed_in_the_window(source: Source) -> None:
    run = source.call("run", "local-training")
    t0, t1 = run["started_ns"], run["ended_ns"]
    found = queries.counters(source, "local-training", ["nvml/gpu_util_pct"], t0, t1, 200)
    rows = found["nvml/gpu_util_pct"]
    assert 0 < len(rows) <= 100 and all(t0 <= r["ts_ns"] < t1 for r in rows)


def test_summary_of_the_local_sample(source: Source) -> None:
    data = reports.summary(source, "local-training")
    assert data["top"]["by_total"] and data["top"]["by_self"]
    paths = {n["path"] for n in data["modules"]["nodes"]}
    assert any("/" in p for p in paths), "nested modules"
    assert len(data["steps"]) == 12
    charts.module_tree(data["modules"])
    charts.steps(data["steps"])


def test_tenants_of_the_two_tenant_sample(source: Source) -> None:
    data = reports.tenants(source, "forwarded-two-tenants")
    assert len(data["tenants"]) == 2
    assert {t["session"] for t in data["tenants"]} == {"3", "4"}
    assert data["busy"] and data["queue"] and "session_memory_bytes" in data["counters"]
    assert set(data["missing"]) == {"quota_bytes", "evictions"}
    assert {r["tenant"] for r in data["busy"]} == {t["key"] for t in data["tenants"]}


def test_compare_two_runs(source: Source) -> None:
    data = reports.compare(source, "local-training", "forwarded-two-tenants")
    assert data["steps"]["a"]["count"] == 12 and data["steps"]["b"]["count"] == 12
    assert data["ops"] and [r["part"] for r in data["breakdown"]] == [
        "client", "wire", "queue", "execute"
    ]  # fmt: skip


def test_export_window_holds_only_the_window(source: Source) -> None:
    text, n = callbacks.export_window(source, "fwd", 0, 1_000_000)
    events = json.loads(text)["traceEvents"]
    names = [e["name"] for e in events if e.get("ph") == "X"]
    assert n == len(names) and "ProfilerStep#0" in names and XSS not in names


def test_source_sends_only_selects(source: Source) -> None:
    with pytest.raises(StoreError, match="read-only"):
        source.rows("DROP TABLE __db__.spans")
    with pytest.raises(StoreError, match="does not call"):
        source.call("ingest", "/tmp")


def test_unreachable_store_is_one_line(tmp_path: Path) -> None:
    src = Source("http://127.0.0.1:9", lock_timeout_s=0)
    with pytest.raises(StoreError) as exc:
        src.rows("SELECT 1")
    assert "127.0.0.1:9" in str(exc.value) and "\n" not in str(exc.value)


def test_a_steps_counterparts_are_the_other_steps(source: Source) -> None:
    w = queries.window(source, "fwd", 0, 3_000_000, 2000)
    step = next(b for b in w.bars if b["name"] == "ProfilerStep#1")
    s = queries.span(source, "fwd", step["span_id"], step["start_ns"])
    found = queries.same_range_in_steps(source, "fwd", s)
    assert [(f["step"], f["current"]) for f in found] == [
        ("ProfilerStep#0", False), ("ProfilerStep#1", True), ("ProfilerStep#2", False)
    ]  # fmt: skip
