"""Chrome trace export: exact formatting, tracks, flows, counters, escaping, streaming memory."""

from __future__ import annotations

import gzip
import io
import json
import re
import sys
import threading
import tracemalloc
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest

import gpu_trace
from gpu_trace._progress import TerminalProgress
from gpu_trace.export.chrome import ChromeTraceExporter, write_chrome_trace
from gpu_trace.export.tracks import SYNTHETIC_BASE
from gpu_trace.tracer.records import ATTRS
from gpu_trace.tracer.spool import list_spool, read_spool_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.export import synthetic_batches  # noqa: E402

BASE = 1_000_000_000
RUN = {
    "run_id": "r1",
    "trace_id": "ab" * 16,
    "started_ns": BASE,
    "hosts": ["h1", "h2"],
    "attrs": {"anchor_mono_ns": str(BASE - 5), "anchor_wall_ns": "1700000000000000000"},
}
THREADS = [
    {
        "host": "h1",
        "pid": 10,
        "tid": 10,
        "process_name": "python train.py",
        "thread_name": "MainThread",
    },
    {
        "host": "h2",
        "pid": 10,
        "tid": 77,
        "process_name": "gpu-trace serve",
        "thread_name": "worker",
    },
]


def spans(rows: list[tuple], *, dictionary: bool = False) -> pa.Table:
    """rows: (host, span_id, parent, pid, tid, lane, category, name, start, end, attrs)."""
    cols = list(zip(*rows, strict=True))

    def s(values: tuple) -> pa.Array:
        arr = pa.array(list(values), pa.string())
        return arr.dictionary_encode() if dictionary else arr

    return pa.table(
        {
            "run_id": pa.array(["r1"] * len(rows)),
            "trace_id": pa.array([RUN["trace_id"]] * len(rows)),
            "host": s(cols[0]),
            "span_id": pa.array(cols[1], pa.uint64()),
            "parent_span_id": pa.array(cols[2], pa.uint64()),
            "pid": pa.array(cols[3], pa.uint32()),
            "tid": pa.array(cols[4], pa.uint64()),
            "lane": s(cols[5]),
            "category": s(cols[6]),
            "name": s(cols[7]),
            "start_ns": pa.array(cols[8], pa.int64()),
            "end_ns": pa.array(cols[9], pa.int64()),
            "depth": pa.array([0] * len(rows), pa.uint16()),
            "attrs": pa.array([list(a.items()) if a else [] for a in cols[10]], ATTRS),
        }
    )


ROWS = [
    ("h1", 1, 0, 10, 10, "steps", "step", "ProfilerStep#0", BASE + 1_000, BASE + 9_000, None),
    (
        "h1",
        2,
        0,
        10,
        10,
        "nvtx/gpu_trace",
        "nvtx",
        "forward",
        BASE + 1_500,
        BASE + 3_001,
        {"batch": "3"},
    ),
    ("h1", 3, 2, 10, 10, "nvtx/gpu_trace", "op", "aten::mm", BASE + 1_600, BASE + 2_999, None),
    ("h1", 4, 2, 10, 10, "nvtx/gpu_trace", "mark", "here", BASE + 2_000, BASE + 2_000, None),
    (
        "h1",
        5,
        0,
        10,
        10,
        "forward/send",
        "forward",
        "send aten::mm",
        BASE + 3_100,
        BASE + 3_200,
        None,
    ),
    (
        "h2",
        6,
        5,
        10,
        77,
        "server/queue",
        "server",
        "queue",
        BASE + 3_500,
        BASE + 4_250,
        {"tenant": "a"},
    ),
    ("h1", 7, 0, 10, 11, "gpu0/stream7", "kernel", "sgemm", BASE + 4_000, BASE + 4_000_123, None),
]
COUNTERS = pa.table(
    {
        "host": ["h1", "h1", "h1"],
        "source": ["nvml", "nvml", "user"],
        "device": ["gpu0", "gpu0", ""],
        "metric": ["sm_util", "sm_util", "loss"],
        "ts_ns": pa.array([BASE + 100, BASE + 200, BASE + 300], pa.int64()),
        "value": [50.0, float("nan"), 0.25],
    }
)


def load(path: Path) -> dict:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def by_phase(trace: dict, ph: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == ph]


def assert_nested(events: list[dict]) -> None:
    """Complete events on each (pid, tid) nest: Chrome's rule for one thread."""
    tracks: dict[tuple, list[dict]] = {}
    for e in events:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for key, evs in tracks.items():
        stack: list[Decimal] = []
        for e in sorted(evs, key=lambda e: (Decimal(str(e["ts"])), -Decimal(str(e["dur"])))):
            ts, end = Decimal(str(e["ts"])), Decimal(str(e["ts"])) + Decimal(str(e["dur"]))
            while stack and stack[-1] <= ts:
                stack.pop()
            assert not stack or end <= stack[-1], f"{e['name']} overlaps its parent on {key}"
            stack.append(end)


def test_golden_small_run(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    stats = write_chrome_trace(path, RUN, THREADS, [spans(ROWS[:4]), spans(ROWS[4:])], [COUNTERS])
    text = path.read_text()
    trace = json.loads(text)

    assert (
        stats["spans"] == 6
        and stats["marks"] == 1
        and stats["counters"] == 2
        and stats["flows"] == 1
    )
    assert stats["complete"] is True and stats["events"] == len(trace["traceEvents"])
    assert re.search(r'"distributedInfo": \{"rank": 0, "world_size": 1\}', text.splitlines()[1])
    assert trace["displayTimeUnit"] == "ns" and trace["deviceProperties"] == []
    assert trace["gpu_trace"]["time_base_ns"] == BASE and trace["gpu_trace"]["complete"] is True
    assert trace["baseTimeNanoseconds"] == 1700000000000000000 + 5

    # Exact microseconds from integer nanoseconds: three fraction digits, no float rounding.
    lines = text.splitlines()
    fwd = next(line for line in lines if '"name":"forward"' in line)
    assert '"ts":1.500,"dur":1.501' in fwd
    assert '"ts":1.600,"dur":1.399' in next(
        line for line in lines if "aten::mm" in line and '"ph":"X"' in line
    )
    assert '"ts":4.000,"dur":3996.123' in next(line for line in lines if "sgemm" in line)

    x = {e["name"]: e for e in by_phase(trace, "X")}
    step = x["ProfilerStep#0"]
    assert (step["pid"], step["tid"], step["cat"]) == (10, 10, "user_annotation")  # real tid
    assert x["aten::mm"]["cat"] == "cpu_op" and x["aten::mm"]["args"]["category"] == "op"
    assert x["forward"]["args"] == {
        "span_id": "0000000000000002",  # 16 hex digits, as the dashboard and OpenTelemetry
        "category": "nvtx",
        "lane": "nvtx/gpu_trace",
        "batch": "3",
    }
    assert x["aten::mm"]["args"]["parent_span_id"] == "0000000000000002"
    assert x["sgemm"]["cat"] == "kernel" and (
        x["sgemm"]["args"]["device"],
        x["sgemm"]["args"]["stream"],
    ) == (0, 7)
    # Lanes of one OS thread are separate tracks; the steps lane keeps the OS tid.
    assert x["forward"]["tid"] == x["aten::mm"]["tid"] >= SYNTHETIC_BASE
    assert x["forward"]["tid"] != x["send aten::mm"]["tid"]
    assert_nested(trace["traceEvents"])

    # The same pid on another host is another process.
    queue = x["queue"]
    assert queue["pid"] != 10 and queue["args"]["tenant"] == "a"

    meta = by_phase(trace, "M")
    names = {(e["name"], e["pid"], e.get("tid")): e["args"] for e in meta}
    # Perfetto and chrome://tracing show the pid after the name: the name repeats it only where
    # the Chrome pid is not the recorded one.
    assert names[("process_name", 10, 0)] == {"name": "h1 python train.py"}
    assert names[("process_name", queue["pid"], 0)] == {"name": "h2 gpu-trace serve (pid 10)"}
    assert names[("thread_name", 10, 10)] == {"name": "MainThread · steps"}
    assert names[("thread_name", 10, x["forward"]["tid"])] == {
        "name": "MainThread · nvtx/gpu_trace"
    }
    assert names[("thread_name", queue["pid"], queue["tid"])] == {"name": "worker · server/queue"}
    # Device work sits where PyTorch's profiler puts it: pid the device, tid the stream.
    assert (x["sgemm"]["pid"], x["sgemm"]["tid"]) == (0, 7)
    assert names[("process_name", 0, 0)] == {"name": "h1 GPU 0"}
    assert names[("thread_name", 0, 7)] == {"name": "stream 7"}
    sort = {e["tid"]: e["args"]["sort_index"] for e in meta if e["name"] == "thread_sort_index"}
    assert sort[10] < sort[x["forward"]["tid"]] < sort[x["send aten::mm"]["tid"]]

    (mark,) = by_phase(trace, "i")
    assert (
        mark["name"] == "here"
        and mark["s"] == "t"
        and "dur" not in mark
        and mark["tid"] == x["forward"]["tid"]
    )
    assert '"ts":2.000,' in next(line for line in lines if '"name":"here"' in line)

    # One flow: the client's send (h1) is the parent of the server's queue span (h2).
    (s,) = by_phase(trace, "s")
    (f,) = by_phase(trace, "f")
    assert s["id"] == f["id"] and f["bp"] == "e" and s["cat"] == f["cat"]
    send = x["send aten::mm"]
    assert (s["pid"], s["tid"], s["ts"]) == (send["pid"], send["tid"], send["ts"])
    assert (f["pid"], f["tid"], f["ts"]) == (queue["pid"], queue["tid"], queue["ts"])

    # Counters: NaN dropped, one series per device, "value" where there is none.
    counters = by_phase(trace, "C")
    assert [(c["name"], c["args"]) for c in counters] == [
        ("sm_util", {"gpu0": 50.0}),
        ("loss", {"value": 0.25}),
    ]
    assert '"ts":0.100,' in next(line for line in lines if '"ph":"C"' in line)
    # A host's counters are counter tracks of its first process, not of a synthetic pid.
    assert {c["pid"] for c in counters} == {10}
    assert not [n for k, n in names.items() if k[0] == "process_name" and "counters" in n["name"]]


def test_counters_sit_under_a_named_process(tmp_path: Path) -> None:
    """Perfetto draws a counter event as a track of its pid's process, titled "name pid": a
    host's counters go under its process (known from the threads rows when no span is in the
    file), and only a host with no process at all gets a ``<host> counters`` process; the
    importer reads every sample's host back either way."""
    from gpu_trace.store.importer import convert
    from gpu_trace.store.trace_file import read_trace

    counters = pa.table(
        {
            "host": ["h1", "h3"],
            "source": ["nvml", "host"],
            "device": ["gpu0", ""],
            "metric": ["sm_util", "cpu_percent"],
            "ts_ns": pa.array([BASE + 100, BASE + 200], pa.int64()),
            "value": [50.0, 12.5],
        }
    )
    path = tmp_path / "c.json"
    write_chrome_trace(path, RUN, THREADS, [], [counters])
    trace = load(path)
    names = {
        e["pid"]: e["args"]["name"] for e in by_phase(trace, "M") if e["name"] == "process_name"
    }
    h1, h3 = by_phase(trace, "C")
    assert h1["pid"] == 10 and names[10] == "h1 python train.py"
    assert h3["pid"] >= SYNTHETIC_BASE and names[h3["pid"]] == "h3 counters"
    converted = convert(read_trace(path)[0], name="c.json", command="import c.json")
    assert converted.counters.column("host").to_pylist() == ["h1", "h3"]


def test_gzip_and_dictionary_columns_give_the_same_trace(tmp_path: Path) -> None:
    write_chrome_trace(tmp_path / "a.json", RUN, THREADS, [spans(ROWS)], [COUNTERS])
    write_chrome_trace(
        tmp_path / "b.json.gz", RUN, THREADS, [spans(ROWS, dictionary=True)], [COUNTERS]
    )
    with gzip.open(tmp_path / "b.json.gz") as f:
        assert f.read() == (tmp_path / "a.json").read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("dictionary", [False, True])
def test_weird_strings_round_trip(tmp_path: Path, dictionary: bool) -> None:
    weird = [
        '"quote"\n<script>',
        "back\\slash\ttab\r\x00\x01\x1f\x7f",
        "ünïcødé 🚀 \u2028\u2029 </script>",
        "",
        "{}[],:",
    ]
    rows = [
        (
            'h"1',
            i + 1,
            0,
            10,
            10,
            w or "lane",
            "nvtx",
            w,
            BASE + i,
            BASE + i + 1,
            {w or "k": w, "span_id": "mine"},
        )
        for i, w in enumerate(weird)
    ]
    path = tmp_path / "w.json"
    write_chrome_trace(path, {**RUN, "run_id": 'r"\n'}, [], [spans(rows, dictionary=dictionary)])
    trace = load(path)
    x = by_phase(trace, "X")
    assert [e["name"] for e in x] == weird
    for e, w in zip(x, weird, strict=True):
        assert e["args"][w or "k"] == w
        assert e["args"]["attr.span_id"] == "mine"  # our own argument names win
        assert e["args"]["lane"] == (w or "lane")
    assert trace["traceName"] == 'r"\n'
    assert any(
        e["args"]["name"] == 'h"1'  # no process name recorded: the host alone
        for e in by_phase(trace, "M")
        if e["name"] == "process_name"
    )


def test_timestamps_are_exact_and_may_be_negative(tmp_path: Path) -> None:
    big = 123_456_789_012_345_678
    rows = [
        ("h1", 1, 0, 10, 10, "steps", "step", "ProfilerStep#0", BASE - 1_234, BASE + 5, None),
        ("h1", 2, 0, 10, 10, "steps", "step", "ProfilerStep#1", BASE + big, BASE + big + 999, None),
    ]
    path = tmp_path / "t.json"
    write_chrome_trace(path, RUN, [], [spans(rows)])
    trace = json.loads(path.read_text(), parse_float=Decimal)
    a, b = by_phase(trace, "X")
    assert (a["ts"], a["dur"]) == (Decimal("-1.234"), Decimal("1.239"))
    assert (b["ts"], b["dur"]) == (Decimal(big) / 1000, Decimal("0.999"))
    assert a["ts"] * 1000 + BASE == BASE - 1_234


def test_base_defaults_to_first_span_without_run_start(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    write_chrome_trace(path, {"run_id": "x"}, [], [spans(ROWS[1:3])])
    trace = load(path)
    assert trace["gpu_trace"]["time_base_ns"] == BASE + 1_500
    assert by_phase(trace, "X")[0]["ts"] == 0
    assert "baseTimeNanoseconds" not in trace


def test_flow_parents_are_looked_up_in_a_bounded_window(tmp_path: Path) -> None:
    # Parent 1 is a plain span on h1, parent 2 a forward span; 100 local spans come in between.
    rows = [
        ("h1", 1, 0, 10, 10, "cpu", "nvtx", "old", BASE, BASE + 10, None),
        ("h1", 2, 0, 10, 10, "forward/send", "forward", "send", BASE + 1, BASE + 2, None),
    ]
    rows += [
        ("h1", 100 + i, 0, 10, 10, "cpu", "nvtx", "x", BASE + 3 + i, BASE + 4 + i, None)
        for i in range(100)
    ]
    rows += [
        (
            "h2",
            900,
            1,
            20,
            20,
            "server/queue",
            "server",
            "child of old",
            BASE + 500,
            BASE + 501,
            None,
        ),
        (
            "h2",
            901,
            2,
            20,
            20,
            "server/queue",
            "server",
            "child of send",
            BASE + 502,
            BASE + 503,
            None,
        ),
    ]
    batches = [spans(rows[i : i + 10]) for i in range(0, len(rows), 10)]
    small = write_chrome_trace(tmp_path / "a.json", RUN, [], batches, flow_window=16)
    assert small["flows"] == 1  # the forward span is kept, the old plain span fell out
    (f,) = by_phase(load(tmp_path / "a.json"), "f")
    assert f["ts"] == 0.502
    assert write_chrome_trace(tmp_path / "b.json", RUN, [], batches, flow_window=1000)["flows"] == 2
    assert write_chrome_trace(tmp_path / "c.json", RUN, [], batches, flow_window=0)["flows"] == 0


def test_an_error_midway_still_leaves_a_valid_file(tmp_path: Path) -> None:
    def batches():
        yield spans(ROWS[:3])
        raise KeyboardInterrupt

    path = tmp_path / "t.json"
    with pytest.raises(KeyboardInterrupt):
        write_chrome_trace(path, RUN, THREADS, batches())
    trace = load(path)
    assert len(by_phase(trace, "X")) == 3 and trace["gpu_trace"]["complete"] is False


def test_exporter_contract_and_bad_input(tmp_path: Path) -> None:
    progress: list[tuple[int, int | None]] = []
    exp = ChromeTraceExporter(
        tmp_path / "t.json",
        run=RUN,
        threads=THREADS,
        progress=lambda d, t: progress.append((d, t)),
        total_spans=7,
    )
    assert exp.export(spans(ROWS[:4])).name == "SUCCESS"
    assert exp.export(pa.table({"name": ["x"]})).name == "FAILURE"
    assert "lacks columns" in exp.error  # the caller reports it, in its own words
    assert exp.export(spans(ROWS[4:])).name == "SUCCESS"
    assert exp.force_flush(timeout_millis=100)
    exp.shutdown()
    exp.shutdown()
    assert exp.export(spans(ROWS)).name == "FAILURE"
    assert progress == [(4, 7), (7, 7)]
    trace = load(tmp_path / "t.json")
    assert len(by_phase(trace, "X")) == 6 and trace["gpu_trace"]["complete"] is False
    with pytest.raises(ValueError):
        ChromeTraceExporter(tmp_path / "missing" / "t.json", run=RUN)
    with pytest.raises(ValueError):
        ChromeTraceExporter(tmp_path / "t.json", run=RUN, rank=2, world_size=2)
    with pytest.raises(ValueError):
        ChromeTraceExporter(tmp_path / "t.json", run=RUN, categories="hta")


def test_native_categories(tmp_path: Path) -> None:
    write_chrome_trace(tmp_path / "t.json", RUN, [], [spans(ROWS)], categories="native")
    assert {e["cat"] for e in by_phase(load(tmp_path / "t.json"), "X")} == {
        "step",
        "nvtx",
        "op",
        "forward",
        "server",
        "kernel",
    }


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_progress_draws_only_on_a_terminal() -> None:
    plain = io.StringIO()
    bar = TerminalProgress(plain)
    bar(5, 10)
    bar.close()
    assert plain.getvalue() == ""
    tty = _Tty()
    bar = TerminalProgress(tty, width=10)
    bar(5, 10)
    bar(5, 10)  # unchanged: not redrawn
    bar(10, 10)
    bar(3, None)
    bar.close()
    assert tty.getvalue() == (
        "\r[#####.....]  50% 5/10 spans\r[##########] 100% 10/10 spans\n\r3 spans\n"
    )


def test_export_of_a_real_recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_TRACE_NVTX", "off")
    run_dir = tmp_path / "run"
    gpu_trace.start(run_dir)
    try:
        for i in range(3):
            gpu_trace.step(i)
            with gpu_trace.range("forward", batch=i), gpu_trace.range('inner "q"\n'):
                gpu_trace.mark("checkpoint", i=i)
            gpu_trace.counter("loss", 1.0 / (i + 1))
        gpu_trace.step(3)
    finally:
        gpu_trace.stop()

    tables, counters, threads = [], [], []
    for f in list_spool(run_dir):
        sf = read_spool_file(f)
        assert sf.problem is None and sf.table is not None
        t = sf.table.replace_schema_metadata(None)
        n = t.num_rows
        t = t.append_column("host", pa.array([sf.meta["host"]] * n))
        if sf.kind == "spans":
            tables.append(t)
            threads.append(
                {
                    "host": sf.meta["host"],
                    "pid": int(sf.meta["pid"]),
                    "tid": threading.get_native_id(),
                    "process_name": sf.meta["process_name"],
                    "thread_name": "MainThread",
                }
            )
        elif sf.kind == "counters":
            counters.append(t)
    all_spans = pa.concat_tables(tables).sort_by("start_ns")
    run = json.loads((run_dir / "run.json").read_text())
    path = tmp_path / "rank-0.json"
    stats = write_chrome_trace(
        path,
        run,
        threads,
        all_spans.to_batches(max_chunksize=5),
        counters,
        total_spans=all_spans.num_rows,
    )
    trace = load(path)
    x = by_phase(trace, "X")
    steps = [e for e in x if e["name"].startswith("ProfilerStep#")]
    assert [e["name"] for e in steps] == [f"ProfilerStep#{i}" for i in range(4)]
    assert {e["tid"] for e in steps} == {threading.get_native_id()}
    assert (
        sum(e["name"] == "forward" for e in x) == 3
        and sum(e["name"] == 'inner "q"\n' for e in x) == 3
    )
    assert [e["args"]["batch"] for e in x if e["name"] == "forward"] == ["0", "1", "2"]
    assert [e["args"]["i"] for e in by_phase(trace, "i")] == ["0", "1", "2"]
    assert [c["args"]["value"] for c in by_phase(trace, "C")] == [1.0, 0.5, 1.0 / 3]
    assert stats["spans"] + stats["marks"] == all_spans.num_rows and stats["flows"] == 0
    assert_nested(trace["traceEvents"])
    # Durations equal the recorded ones to the nanosecond.
    rec = {r["span_id"]: r["end_ns"] - r["start_ns"] for r in all_spans.to_pylist()}
    for e in x:
        assert round(Decimal(str(e["dur"])) * 1000) == rec[int(e["args"]["span_id"], 16)]


def test_big_batches_are_formatted_in_slices(tmp_path: Path) -> None:
    table = next(synthetic_batches(40_000, 40_000))
    one = write_chrome_trace(tmp_path / "a.json", RUN, [], [table])
    many = write_chrome_trace(tmp_path / "b.json", RUN, [], table.to_batches(max_chunksize=1_000))
    assert one == {**many, "path": one["path"]}

    def events(name: str) -> list[str]:
        return sorted(json.dumps(e, sort_keys=True) for e in load(tmp_path / name)["traceEvents"])

    assert events("a.json") == events("b.json")


def _export_peak(path: Path, n: int) -> tuple[int, int, dict]:
    """Peak memory (Python and numpy via tracemalloc, plus Arrow's pool) of one streamed export."""
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    old = pa.default_memory_pool()
    seen = {"bytes": 0}

    def counted():
        for b in synthetic_batches(n, 65536):
            seen["bytes"] += b.nbytes
            yield b

    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        stats = write_chrome_trace(path, {"run_id": "big", "started_ns": 0}, [], counted())
        py_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(old)
    return py_peak + pool.max_memory(), seen["bytes"], stats


@pytest.mark.slow
def test_memory_stays_flat_for_a_million_spans(tmp_path: Path) -> None:
    """Streaming: peak memory does not grow with the number of spans."""
    small_peak, _, _ = _export_peak(tmp_path / "small.json", 300_000)
    peak, data, stats = _export_peak(tmp_path / "big.json", 1_000_000)
    out = (tmp_path / "big.json").stat().st_size
    assert stats["spans"] == 1_000_000 and out > 150_000_000
    # 3x the spans, (about) the same peak: a batch's worth of buffers, not the run's.
    assert peak < 1.2 * small_peak, (peak, small_peak)
    assert peak < 0.35 * data and peak < 0.2 * out, (peak, data, out)
    # the file is whole: its trailer parses
    tail = (tmp_path / "big.json").read_bytes()[-4000:].decode()
    assert json.loads("{" + tail[tail.index('"gpu_trace"') :])["gpu_trace"]["spans"] == 1_000_000


def test_integer_looking_attributes_stay_valid_json(tmp_path: Path) -> None:
    values = ["0", "-7", "123", "0123", "-0", "12345678901234567890", "1e3", " 1"]
    rows = [
        ("h", 1, 0, 10, 10, "lane", "nvtx", f"s{i}", BASE + i, BASE + i + 1, {"correlation": v})
        for i, v in enumerate(values)
    ]
    path = tmp_path / "ints.json"
    write_chrome_trace(path, RUN, [], [spans(rows)])
    got = [e["args"]["correlation"] for e in by_phase(load(path), "X")]
    # canonical integers become numbers (HTA needs them); anything else stays the string it was,
    # "-0" too (as a number it reads back as 0: `gpu-trace import` keeps the text it reads)
    assert got == [0, -7, 123, "0123", "-0", "12345678901234567890", "1e3", " 1"]


def gpu_activity_rows() -> list[tuple]:
    """An op launching a kernel through the runtime and a memset through the driver, as the
    CUPTI collector and `gpu-trace import` store them, and a GPU annotation over the kernel."""
    k_attrs = {
        **{"correlation": "11", "device": "0", "stream": "7", "context": "1"},
        **{"grid": "[4, 2, 1]", "block": "[128, 1, 1]", "registers per thread": "64"},
        **{"shared memory": "1024", "blocks per SM": "0.25"},
    }
    m_attrs = {"correlation": "12", "device": "0", "stream": "7", "bytes": "48"}
    m_attrs["memory bandwidth (GB/s)"] = "0.0625"
    api = {"correlation": "11", "cbid": "211", "api": "runtime"}
    driver = {"correlation": "12", "cbid": "1", "api": "driver"}
    sync13, sync14 = ({"correlation": c, "cbid": "131"} for c in ("13", "14"))

    def row(sid: int, parent: int, pid: int, tid: int, lane: str, cat: str, name: str,
            t0: int, t1: int, attrs: dict | None) -> tuple:  # fmt: skip
        return ("h1", sid, parent, pid, tid, lane, cat, name, BASE + t0, BASE + t1, attrs)

    return [
        row(1, 0, 10, 10, "torch/ops", "op", "aten::mm", 1_000, 90_000, None),
        row(2, 1, 10, 10, "cuda_api", "cuda_api", "cudaLaunchKernel", 2_000, 7_000, api),
        row(3, 1, 10, 10, "cuda_api", "cuda_api", "cuMemsetD32Async", 8_000, 9_000, driver),
        row(6, 0, 0, 7, "gpu0/stream7/annotations", "nvtx", "Optimizer.step", 9_500, 40_000, None),
        row(4, 2, 10, 0, "gpu0/stream7", "kernel", "sgemm", 10_000, 30_000, k_attrs),
        row(5, 3, 10, 0, "gpu0/stream7", "memset", "Memset (Device)", 31_000, 31_768, m_attrs),
        # The CUPTI collector says runtime or driver by the function's name alone.
        row(7, 1, 10, 10, "cuda_api", "cuda_api", "cuStreamSynchronize", 40_000, 41_000, sync13),
        row(8, 1, 10, 10, "cuda_api", "cuda_api", "cudaStreamSynchronize", 42_000, 43_000, sync14),
    ]


def test_gpu_activity_in_pytorch_profilers_dialect(tmp_path: Path) -> None:
    props = [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132}]
    run = {**RUN, "attrs": {**RUN["attrs"], "device_properties": json.dumps(props)}}
    write_chrome_trace(tmp_path / "t.json", run, THREADS, [spans(gpu_activity_rows())])
    trace = load(tmp_path / "t.json")
    assert trace["deviceProperties"] == props
    x = {e["name"]: e for e in by_phase(trace, "X")}
    assert x["cudaLaunchKernel"]["cat"] == "cuda_runtime"
    assert x["cuMemsetD32Async"]["cat"] == "cuda_driver"
    assert x["cuMemsetD32Async"]["args"]["correlation"] == 12
    assert x["cuStreamSynchronize"]["cat"] == "cuda_driver"
    assert x["cudaStreamSynchronize"]["cat"] == "cuda_runtime"
    assert (x["Memset (Device)"]["cat"], x["Optimizer.step"]["cat"]) == (
        "gpu_memset",
        "gpu_user_annotation",
    )
    kernel = x["sgemm"]
    # Where PyTorch's profiler puts device work, with its numbers as numbers.
    assert (kernel["pid"], kernel["tid"]) == (0, 7) == (x["Optimizer.step"]["pid"], 7)
    args = kernel["args"]
    assert (args["device"], args["stream"], args["correlation"], args["context"]) == (0, 7, 11, 1)
    assert "attr.device" not in args and "attr.stream" not in args  # once, from the lane
    assert (args["grid"], args["block"]) == ([4, 2, 1], [128, 1, 1])
    assert (args["registers per thread"], args["shared memory"], args["blocks per SM"]) == (
        64,
        1024,
        0.25,
    )
    memset = x["Memset (Device)"]["args"]
    assert (memset["bytes"], memset["memory bandwidth (GB/s)"]) == (48, 0.0625)
    assert "device" not in x["Optimizer.step"]["args"]  # as Kineto writes GPU annotations
    # ac2g arrows from each launching call to its device work.
    starts = {e["id"]: e for e in by_phase(trace, "s")}
    ends = by_phase(trace, "f")
    assert {e["cat"] for e in ends} == {"ac2g"} and len(ends) == 2
    for f in ends:
        s, child = starts[f["id"]], x["sgemm" if f["ts"] == kernel["ts"] else "Memset (Device)"]
        call = x["cudaLaunchKernel" if child is kernel else "cuMemsetD32Async"]
        assert (s["pid"], s["tid"], s["ts"]) == (call["pid"], call["tid"], call["ts"])
        assert (f["pid"], f["tid"], f["bp"]) == (0, 7, "e")
    assert_nested(trace["traceEvents"])

    # Native categories keep ours, and values as recorded.
    write_chrome_trace(tmp_path / "n.json", run, THREADS, [spans(gpu_activity_rows())],
                       categories="native")  # fmt: skip
    native = {e["name"]: e for e in by_phase(load(tmp_path / "n.json"), "X")}
    assert native["cuMemsetD32Async"]["cat"] == "cuda_api"
    assert native["sgemm"]["args"]["grid"] == "[4, 2, 1]"


def test_device_properties_from_nvmls_gpu_names(tmp_path: Path) -> None:
    gpus = "gpu0=NVIDIA H100 80GB HBM3,gpu1=NVIDIA H100 80GB HBM3"
    run = {**RUN, "attrs": {**RUN["attrs"], "gpus": gpus}}
    write_chrome_trace(tmp_path / "t.json", run, THREADS, [spans(ROWS)])
    assert load(tmp_path / "t.json")["deviceProperties"] == [
        {"id": 0, "name": "NVIDIA H100 80GB HBM3"},
        {"id": 1, "name": "NVIDIA H100 80GB HBM3"},
    ]


def test_backward_ops_get_their_fwdbwd_arrow(tmp_path: Path) -> None:
    rows = [
        ("h1", 1, 0, 10, 10, "torch/ops", "op", "aten::mm", BASE + 1_000, BASE + 2_000, None),
        (
            "h1",
            2,
            0,
            10,
            11,
            "torch/ops",
            "op",
            "MmBackward0",
            BASE + 5_000,
            BASE + 6_000,
            {"forward span": "1"},
        ),  # fmt: skip
        (
            "h1",
            3,
            0,
            10,
            11,
            "torch/ops",
            "op",
            "AddBackward0",
            BASE + 7_000,
            BASE + 8_000,
            {"forward span": "not an id"},
        ),  # fmt: skip
    ]
    write_chrome_trace(tmp_path / "t.json", RUN, THREADS, [spans(rows)])
    trace = load(tmp_path / "t.json")
    x = {e["name"]: e for e in by_phase(trace, "X")}
    (s,) = by_phase(trace, "s")
    (f,) = by_phase(trace, "f")
    assert s["cat"] == f["cat"] == "fwdbwd" and s["id"] == f["id"] and f["bp"] == "e"
    fwd, bwd = x["aten::mm"], x["MmBackward0"]
    assert (s["pid"], s["tid"], s["ts"]) == (fwd["pid"], fwd["tid"], fwd["ts"])
    assert (f["pid"], f["tid"], f["ts"]) == (bwd["pid"], bwd["tid"], bwd["ts"])
