"""The dashboard's GPU activity: stream lanes grouped per GPU, short kernel names, a kernel's
launch chain, top kernels, busy and idle per step, GPU time per forwarded op (real chDB, runs
built in tests/dashboard_data.py with exact times)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("dash")

from gpu_trace.dashboard import (  # noqa: E402
    panels,
    reports,
    timeline,
)
from gpu_trace.dashboard.readonly_store import ReadOnlyStore  # noqa: E402
from gpu_trace.plots import charts, figures  # noqa: E402
from gpu_trace.query import gpu_work  # noqa: E402
from gpu_trace.query.gpu import busy_ns  # noqa: E402
from gpu_trace.query.source import rows as query_rows
from gpu_trace.store.client import Store  # noqa: E402
from gpu_trace.store.importer import import_trace  # noqa: E402
from tests.dashboard_data import (  # noqa: E402
    FILL,
    FILL_SHORT,
    cupti_run,
    forwarded_gpu_run,
    gpu_run,
)

US = 1000


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadOnlyStore]:
    store = Store(f"chdb://{tmp_path_factory.mktemp('dash-gpu') / 'store'}")
    gpu_run(store)
    forwarded_gpu_run(store)
    src = ReadOnlyStore(store=store)
    yield src
    src.close()


def test_short_kernel_names() -> None:
    assert gpu_work.short_kernel_name(FILL) == FILL_SHORT
    for plain in ("ampere_sgemm_128x64_nn", "Memcpy HtoD (Pinned -> Device)", "Memset (Device)"):
        assert gpu_work.short_kernel_name(plain) == plain
    lam = (
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<"
        "at::native::(anonymous namespace)::f(at::TensorIteratorBase&)::{lambda(int)#1}>"
        "(at::TensorIteratorBase&)::{lambda(int)#1}>(int, int)"
    )
    assert gpu_work.short_kernel_name(lam) == "elementwise_kernel<128, 2, lambda>"
    assert len(gpu_work.short_kernel_name("void f<" + "x, " * 100 + "y>()")) == 60


def test_stream_lanes_are_grouped_under_their_gpu_in_stream_order(
    source: ReadOnlyStore,
) -> None:
    info = timeline.tracks(source, "gpu")["tracks"]
    lanes = [t.lane for t in info]
    # The thread's lanes first (cuda_api among them), then GPU 0's streams by number, then GPU 1.
    assert lanes == [
        "steps", "torch/modules", "torch/ops", "cuda_api",
        "gpu0/stream7", "gpu0/stream13", "gpu1/stream7",
    ]  # fmt: skip
    gpu = [t for t in info if t.device is not None]
    assert all(t.levels == 1 for t in gpu)  # a stream is one row whatever the call's depth
    labels = [figures.track_label(t) for t in gpu]
    assert labels[0] == "client · GPU 0 · stream 7 · pid 10"
    assert labels[2].startswith("client · GPU 1 · stream 7")


def test_kernels_are_colored_named_short_and_banded_per_gpu(source: ReadOnlyStore) -> None:
    run, tr = timeline.run(source, "gpu"), timeline.tracks(source, "gpu")
    win = timeline.window(source, "gpu", 0, 2000 * US, 1600)
    fig = figures.timeline(run, tr, win, width_px=1600)
    by_name = {t["name"]: t for t in fig["data"] if t["type"] == "bar"}
    assert {"kernel", "memcpy", "memset", "cuda_api"} <= set(by_name)
    colors = {by_name[c]["marker"]["color"] for c in ("kernel", "memcpy", "memset")}
    assert len(colors) == 3
    labels = fig["layout"]["meta"]["labels"]["text"]
    assert "vectorized_elementwise_…" in labels and not any(x.startswith("void") for x in labels)
    zoomed = timeline.window(source, "gpu", 150 * US, 450 * US, 1600)
    assert FILL_SHORT in figures.timeline(run, tr, zoomed)["layout"]["meta"]["labels"]["text"]
    assert any(figures.esc(FILL) in h for h in by_name["kernel"]["hovertext"])  # full name
    bands = [s for s in fig["layout"]["shapes"] if s["fillcolor"] in figures.GPU_BANDS]
    rows = {t.lane: t.row for t in tr["tracks"]}
    assert [(b["y0"] + 0.5, b["y1"] - 0.5) for b in bands] == [
        (rows["gpu0/stream7"], rows["gpu0/stream13"]),
        (rows["gpu1/stream7"], rows["gpu1/stream7"]),
    ]


def test_a_kernels_launch_chain_goes_up_to_its_step(source: ReadOnlyStore) -> None:
    kernel = timeline.span(source, "gpu", "1")
    assert kernel is not None
    chain = gpu_work.launch_chain(source, "gpu", kernel["span_id"], kernel["parent_span_id"])
    assert [(c["name"], c["category"]) for c in chain] == [
        ("cudaLaunchKernel", "cuda_api"), ("aten::mm", "op"), ("Net", "module"),
        ("ProfilerStep#0", "step"),
    ]  # fmt: skip
    assert chain[0]["tid"] == 10 and chain[0]["span_id"] == "103"
    body = str(panels.details(kernel, [], 0, chain).to_plotly_json())
    assert "details-launch-op" in body and "aten::mm" in body
    assert "cudaLaunchKernel · 10.00 µs" in body or "cudaLaunchKernel · 10 µs" in body
    # Work whose call was not recorded says so; a loop in the parents ends the walk.
    orphan = {**kernel, "parent_span_id": "999999"}
    assert gpu_work.launch_chain(source, "gpu", "1", "999999") == []
    assert "no launching call" in str(panels.details(orphan, [], 0, []).to_plotly_json())


def test_top_kernels_per_device_with_share_of_busy_time(source: ReadOnlyStore) -> None:
    found = gpu_work.top_kernels(source, "gpu")
    assert [(d["device"], d["kernels"]) for d in found] == [(0, 3), (1, 0)]  # GPU 1: a memset
    d = found[0]
    # Busy: union of [200,400), [300,500) memcpy, [900,1100), [1500,1600) = 300+200+100 µs,
    # over the device's window [200, 1600) µs.
    assert (d["busy_ns"], d["window_ns"], d["kernel_ns"]) == (600 * US, 1400 * US, 500 * US)
    assert [(k["short"], k["count"], k["total_ns"], k["mean_ns"]) for k in d["top"]] == [
        (FILL_SHORT, 2, 300 * US, 150 * US),
        ("ampere_sgemm_128x64_nn", 1, 200 * US, 200 * US),
    ]
    assert [k["share"] for k in d["top"]] == [0.5, 200 / 600]


def test_busy_and_idle_per_step_are_the_union_inside_each_step(source: ReadOnlyStore) -> None:
    rows = gpu_work.busy_per_step(source, "gpu")
    got = [(r["step"], r["device"], r["busy_ns"], r["idle_ns"], r["busy_share"]) for r in rows]
    assert got == [
        ("ProfilerStep#0", 0, 400 * US, 600 * US, 0.4),
        ("ProfilerStep#0", 1, 0, 1000 * US, 0.0),
        ("ProfilerStep#1", 0, 200 * US, 800 * US, 0.2),
        ("ProfilerStep#1", 1, 100 * US, 900 * US, 0.1),
    ]
    fig = charts.gpu_busy(rows)
    assert {t.name for t in fig.data} == {"GPU 0 busy", "GPU 0 idle", "GPU 1 busy", "GPU 1 idle"}


def test_covered_matches_a_brute_force_count() -> None:
    rng = np.random.default_rng(7)
    start = rng.integers(0, 1000, 200)
    end = start + rng.integers(0, 30, 200)
    s, e = gpu_work.union(start, end)
    w0 = rng.integers(-50, 1050, 100)
    w1 = w0 + rng.integers(1, 200, 100)
    mask = np.zeros(1100, bool)
    for a, b in zip(start, end):
        mask[a:b] = True
    want = [int(mask[max(0, a) : max(0, b)].sum()) for a, b in zip(w0, w1)]
    assert gpu_work.covered(s, e, w0, w1).tolist() == want


def test_the_union_per_step_is_the_busy_time_gpu_trace_show_reports(source: ReadOnlyStore) -> None:
    # One busy time: the per-step figures cut the same union that query/gpu.py's busy_ns
    # measures for gpu-trace show (work on two streams at once counts once).
    devices = gpu_work.intervals(source, "gpu")
    for d in gpu_work.top_kernels(source, "gpu"):
        s, e = devices[d["device"]]
        assert int((e - s).sum()) == d["busy_ns"]
    rng = np.random.default_rng(11)
    start = np.sort(rng.integers(0, 10_000, 300))
    end = start + rng.integers(1, 200, 300)
    s, e = gpu_work.union(start, end)
    assert int((e - s).sum()) == busy_ns(start, end)


def test_forwarded_ops_gain_their_gpu_time_by_parent_links(source: ReadOnlyStore) -> None:
    assert gpu_work.op_gpu_time(source, "fwd-gpu") == {"aten::mm": 100 * US, "aten::relu": 20 * US}
    fwd = reports.summary(source, "fwd-gpu")["forwarding"]
    assert {o["name"]: o["gpu_ns"] for o in fwd["ops"]} == {
        "aten::mm": 100 * US,
        "aten::relu": 20 * US,
    }
    fig = charts.forwarding(fwd)
    assert any(t.name.startswith("GPU time") for t in fig.data)
    # A run without server GPU work: no GPU time, no marker.
    assert gpu_work.op_gpu_time(source, "gpu") == {}


def test_summary_shows_the_gpu_tables(source: ReadOnlyStore) -> None:
    data = reports.summary(source, "gpu")
    body = str(panels.summary(data).to_plotly_json())
    assert "Top kernels by GPU time" in body and "summary-kernels-gpu0" in body
    assert FILL_SHORT in body and "summary-gpu-busy" in body and "40.0%" in body


def test_kernels_are_short_in_the_self_time_chart_and_an_empty_host_is_left_out() -> None:
    rows = [{"name": FILL, "lane": "gpu0/stream7", "total_ns": 2, "self_ns": 2},
            {"name": "aten::mm", "lane": "torch/ops", "total_ns": 1, "self_ns": 1}]  # fmt: skip
    assert list(charts.top_self(rows).data[0].y) == [
        "aten::mm · torch/ops",
        figures.esc(f"{FILL_SHORT} · gpu0/stream7"),
    ]
    stream = timeline.TrackInfo("", 928, 0, "gpu0/stream7", 1, 0, 1, process="python3")
    thread = timeline.TrackInfo("", 928, 968, "torch/ops", 1, 0, 1, thread="pt_autograd_0")
    assert figures.track_label(stream) == "GPU 0 · stream 7 · python3 928"
    assert figures.track_label(thread) == "pid 928 · pt_autograd_0 · torch/ops"


def test_the_real_h100_trace_imported_reads_on_the_dashboard(source: ReadOnlyStore) -> None:
    """Five steps of the H100 PyTorch profiler trace through ``gpu-trace import``: the stream
    rows come last and one row high, every kernel is counted in the top kernels, a kernel's
    launch chain goes through its CUDA call to the op that launched it, and the whole-run window
    draws every span once (bar or density)."""
    data = Path(__file__).resolve().parents[1] / "data" / "kineto-h100-lm-5steps.json.gz"
    with gzip.open(data, "rt") as f:
        kernels = sum(e.get("cat") == "kernel" for e in json.load(f)["traceEvents"])
    run_id = import_trace(source.store(), data).run_id  # one chDB per process: the same store
    info = timeline.tracks(source, run_id)["tracks"]
    assert [t.lane for t in info[-2:]] == ["gpu0/stream7", "gpu0/stream7/annotations"]
    assert all(t.device is None for t in info[:-2]) and info[-2].levels == 1
    found = gpu_work.top_kernels(source, run_id)
    assert [(d["device"], d["kernels"]) for d in found] == [(0, kernels)]
    longest = query_rows(
        source,
        "SELECT toString(span_id) AS id, toString(parent_span_id) AS parent FROM __db__.spans"
        " WHERE run_id = {r:String} AND category = 'kernel'"
        " ORDER BY end_ns - start_ns DESC LIMIT 1",
        {"r": run_id},
    )[0]
    chain = gpu_work.launch_chain(source, run_id, longest["id"], longest["parent"])
    assert chain[0]["category"] == "cuda_api" and chain[1]["category"] == "op"
    r = timeline.run(source, run_id)
    win = timeline.window(source, run_id, int(r["started_ns"]), int(r["ended_ns"]), 1600)
    assert win.total_spans == sum(t.spans for t in info)
    fig = figures.timeline(r, timeline.tracks(source, run_id), win)
    assert any(t["name"] == "kernel" for t in fig["data"] if t["type"] == "bar")


def test_the_launch_link_joins_the_call_to_its_kernel_on_their_rows(
    source: ReadOnlyStore,
) -> None:
    tr = timeline.tracks(source, "gpu")["tracks"]
    kernel = timeline.span(source, "gpu", "1")
    assert kernel is not None
    call = gpu_work.launch_chain(source, "gpu", "1", kernel["parent_span_id"])[0]
    xs, ys = figures.launch_link(tr, dict(call), kernel, 0)
    rows = {t.lane: t for t in tr}
    api = rows["cuda_api"]
    assert xs == [150 * US, 200 * US]
    assert ys == [api.row + api.level(3), rows["gpu0/stream7"].row]
    gone = {**kernel, "lane": "gpu9/stream1"}  # a track the figure does not draw
    assert figures.launch_link(tr, dict(call), gone, 0) == ([], [])
    fig = figures.timeline(timeline.run(source, "gpu"), timeline.tracks(source, "gpu"),
                           timeline.window(source, "gpu", 0, 2000 * US))  # fmt: skip
    assert fig["data"][figures.LAUNCH_TRACE]["name"] == "launch"
    assert fig["data"][figures.LAUNCH_TRACE]["x"] == []


def test_a_servers_gpu_work_comes_after_its_server_tracks(source: ReadOnlyStore) -> None:
    """A forwarded call reads down the page: client op, server execute and op, the server
    thread's CUDA calls, then the server's GPU streams."""
    info = timeline.tracks(source, "fwd-gpu")["tracks"]
    assert [(t.host, t.lane) for t in info] == [
        ("client", "forward/batch"), ("client", "forward/op"),
        ("gpu-box", "server/execute"), ("gpu-box", "server/op"), ("gpu-box", "cuda_api"),
        ("gpu-box", "gpu0/stream7"),
    ]  # fmt: skip


def test_real_cupti_records_through_the_collectors_conversion_read_on_the_dashboard(
    source: ReadOnlyStore,
) -> None:
    """The H100 CUPTI recording replayed and converted by the collector: GPU 0's work row, then
    the threads' waits on its stream and context in the GPU group; every kernel counted; a
    kernel's chain starts at the CUDA call that launched it; every span drawn once."""
    spans = cupti_run(source.store())
    info = timeline.tracks(source, "cupti")["tracks"]
    gpu = [t for t in info if t.device is not None]
    assert gpu == info[-len(gpu) :]  # the GPU group last
    labels = [figures.track_label(t) for t in gpu]
    assert labels[0].startswith("h100 · GPU 0 · context") and "waits of" in labels[0]
    assert labels[1].startswith("h100 · GPU 0 · stream 7 · pid") and "waits" not in labels[1]
    assert all("stream 7" in x and "waits of" in x for x in labels[2:]) and len(labels) > 2
    (device,) = gpu_work.top_kernels(source, "cupti")
    assert device["device"] == 0 and device["kernels"] == 523
    k = query_rows(
        source,
        "SELECT toString(span_id) AS id, toString(parent_span_id) AS parent FROM __db__.spans"
        " WHERE run_id = 'cupti' AND category = 'kernel' ORDER BY start_ns LIMIT 1",
    )[0]
    chain = gpu_work.launch_chain(source, "cupti", k["id"], k["parent"])
    assert chain and chain[0]["category"] == "cuda_api" and chain[0]["lane"] == "cuda_api"
    r = timeline.run(source, "cupti")
    win = timeline.window(source, "cupti", int(r["started_ns"]), int(r["ended_ns"]), 1600)
    assert win.total_spans == spans
