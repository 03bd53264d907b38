"""GPU activity's conversion pieces: the clock, the innermost-container search, names, tables."""

from __future__ import annotations

import numpy as np
import pytest

from gpu_trace.collectors.gpu_activity import activity as act
from gpu_trace.collectors.gpu_activity import activity_file
from gpu_trace.collectors.gpu_activity.cbid_names import DRIVER, RUNTIME
from gpu_trace.collectors.gpu_activity.conversion import (
    Parents,
    api_span_ids,
    convert,
    innermost,
    map_threads,
    to_monotonic,
)
from gpu_trace.collectors.gpu_activity.demangle import demangle


def test_one_anchor_is_an_exact_offset() -> None:
    t = np.array([10**18, 10**18 + 1, 10**18 + 123_456_789], np.int64)
    out = to_monotonic(t, np.array([[10**18, 42]], np.int64))
    assert out.tolist() == [42, 43, 42 + 123_456_789]


def test_anchors_follow_a_clock_running_at_another_rate_to_the_nanosecond() -> None:
    """CUPTI's clock and CLOCK_MONOTONIC drift apart (NTP slews the latter): between two pairs
    the offset is interpolated, so times in between land within a nanosecond of the truth."""
    base = 1_795_546_636_035_488_715  # a real CUPTI (Unix-epoch) timestamp: large on purpose
    mono0 = 7_000_000_000
    rate = 1 + 50e-6  # monotonic runs 50 ppm faster over the interval
    cupti = base + np.arange(0, 10_000_000_001, 250_000_000, dtype=np.int64)
    truth = mono0 + np.rint((cupti - base) * rate).astype(np.int64)
    anchors = np.array([[cupti[0], truth[0]], [cupti[-1], truth[-1]]], np.int64)
    assert np.abs(to_monotonic(cupti, anchors) - truth).max() <= 1
    # beyond the last pair the last offset holds (no extrapolated slope)
    later = to_monotonic(np.array([cupti[-1] + 1000]), anchors)
    assert later.tolist() == [truth[-1] + 1000]


def test_no_anchor_means_the_times_are_monotonic_already() -> None:
    t = np.array([5, 6], np.int64)
    assert to_monotonic(t, np.zeros((0, 2), np.int64)).tolist() == [5, 6]


def test_innermost_walks_up_to_the_deepest_container() -> None:
    # a [0,100] holds b [10,50] holds c [20,30]; d [60,90] is a's other child
    start = np.array([0, 10, 20, 60])
    end = np.array([100, 50, 30, 90])
    parent = np.array([-1, 0, 1, 0])
    q_start = np.array([21, 35, 55, 61, 95, 200, -5])
    q_end = np.array([29, 40, 58, 62, 99, 210, -1])
    assert innermost(start, end, parent, q_start, q_end).tolist() == [2, 1, 0, 3, 0, -1, -1]


def _api(n: int, tid: int = 7, pid: int = 3) -> np.ndarray:
    r = act.empty(n)
    r["kind"] = act.RUNTIME
    r["pid"] = pid
    r["tid"] = tid
    r["code"] = 211
    r["correlation"] = np.arange(1, n + 1)
    r["start"] = np.arange(n) * 100 + 10
    r["end"] = r["start"] + 20
    return r


def test_api_calls_take_the_latest_started_container_across_lanes() -> None:
    records = _api(3)  # calls at [10,30], [110,130], [210,230]
    # lane 0: op 1 [0,300] with child op 2 [100,140]; lane 1: NVTX 3 [5,250] (started later than
    # op 1, so it is the innermost for call 1 and call 3; op 2 wins for call 2)
    parents = Parents(
        pid=np.array([3, 3, 3]),
        tid=np.array([7, 7, 7], np.uint64),
        lane=np.array([0, 0, 1]),
        span_id=np.array([1, 2, 3], np.uint64),
        parent_span_id=np.array([0, 1, 0], np.uint64),
        start=np.array([0, 100, 5]),
        end=np.array([300, 140, 250]),
        depth=np.array([0, 1, 0]),
    )
    conv = convert(records, {}, parents=parents)
    assert conv.table.column("parent_span_id").to_pylist() == [3, 2, 3]
    assert conv.api_without_parent == 0
    other_thread = convert(_api(3, tid=8), {}, parents=parents)
    assert other_thread.table.column("parent_span_id").to_pylist() == [0, 0, 0]
    assert other_thread.api_without_parent == 3


def test_a_driver_call_inside_a_runtime_call_is_its_child() -> None:
    records = _api(2)
    records["kind"][1] = act.DRIVER
    records["code"][1] = 307
    records["start"][1], records["end"][1] = 12, 25  # inside call 1 [10, 30]
    table = convert(records, {}).table
    ids = table.column("span_id").to_pylist()
    assert table.column("parent_span_id").to_pylist() == [0, ids[0]]
    assert table.column("depth").to_pylist() == [0, 1]
    assert table.column("name").to_pylist() == ["cudaLaunchKernel", "cuLaunchKernel"]


def test_a_kernel_names_its_launch_and_one_without_is_counted() -> None:
    records = np.concatenate([_api(1), act.empty(2)])
    k = records[1:]
    k["kind"] = act.CONCURRENT_KERNEL
    k["pid"] = 3
    k["correlation"] = [1, 99]  # 99: its API record was never delivered
    k["stream"] = 13
    k["device"] = 2
    k["start"], k["end"] = [40, 60], [50, 70]
    k["grid"] = [[4, 2, 1], [1, 1, 1]]
    conv = convert(np.concatenate([records[:1], k]), {0: "_Z6kernelPf"})
    t = conv.table
    assert t.column("parent_span_id").to_pylist()[1:] == [
        int(api_span_ids(np.array([3]), np.array([1]))[0]),
        0,
    ]
    assert conv.unmatched == 1
    assert t.column("lane").to_pylist()[1:] == ["gpu2/stream13", "gpu2/stream13"]
    assert t.column("name").to_pylist()[1] == "kernel(float*)"
    assert dict(t.column("attrs").to_pylist()[1])["grid"] == "[4, 2, 1]"


def test_a_failed_call_carries_its_return_value() -> None:
    records = _api(2)
    records["ret"][1] = 2  # cudaErrorMemoryAllocation
    attrs = [dict(a) for a in convert(records, {}).table.column("attrs").to_pylist()]
    assert attrs == [
        {"correlation": "1", "cbid": "211"},
        {"correlation": "2", "cbid": "211", "return": "2"},
    ]


def test_thread_ids_map_and_unknown_ones_stay() -> None:
    tid = np.array([4052377920, 5, 3705685696], np.uint64)
    assert map_threads(tid, {4052377920: 100, 3705685696: 101}).tolist() == [100, 5, 101]


def test_cbid_tables_come_from_cuptis_headers() -> None:
    assert RUNTIME[211] == "cudaLaunchKernel" and RUNTIME[41] == "cudaMemcpyAsync"
    assert DRIVER[307] == "cuLaunchKernel" and DRIVER[259] == "cuDeviceTotalMem_v2"


@pytest.mark.parametrize(
    ("name", "shown"),
    [
        ("_ZN2at6native6kernelEPf", "at::native::kernel(float*)"),
        ("triton_poi_fused_add_0", "triton_poi_fused_add_0"),
        ("_Znot a symbol", "_Znot a symbol"),
    ],
)
def test_kernel_names_are_demangled_when_they_are_cxx_symbols(name: str, shown: str) -> None:
    assert demangle(name) == shown


def test_the_file_format_round_trips() -> None:
    records = _api(5)
    blob = activity_file.encode(records, {0: "k"}, [(1, 2)], dropped=3, notes=["hello"])
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = activity_file.write(Path(d) / "gpu_activity-3-x.bin", blob)
        data = activity_file.read([path])
    assert data.records.tobytes() == records.tobytes()
    assert data.names == {0: "k"} and data.anchors.tolist() == [[1, 2]]
    assert data.dropped == 3 and data.notes == ["hello"] and not data.problems


def test_the_bench_runs_its_conversion_part(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/gpu_activity.py on a machine without a GPU: the conversion part, at the smallest
    scale (its figures are the bench's business, not this test's)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "bench" / "gpu_activity.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_activity", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.conversion(scale=2, rounds=1)
    out = capsys.readouterr().out
    assert "26,658 records (2 x the H100 file)" in out
    assert out.count("M records/s") == 2
