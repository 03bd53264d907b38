"""A Chrome trace that ``gpu-trace export`` wrote reads back as the run it was
(``exported_trace.convert_export``), without a store: span ids, parents, hosts behind renumbered pids,
tids behind synthetic ones, lanes, categories, depths, attributes whose names clash with the
exporter's own arguments, counters with sources and labels, the run's metadata; in both
dialects. What the Kineto dialect writes only once (device work's track) comes back as
docs/import.md says."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from gpu_trace.export.chrome import write_chrome_trace
from gpu_trace.store.exported_trace import is_export
from gpu_trace.store.importer import convert
from gpu_trace.store.trace_file import TraceImportError, read_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_chrome import BASE, ROWS, RUN, THREADS, gpu_activity_rows, spans  # noqa: E402

COLUMNS = ("span_id", "parent_span_id", "host", "pid", "tid", "lane", "category", "name",
           "start_ns", "end_ns", "depth", "attrs")  # fmt: skip
COUNTERS = pa.table(
    {
        "host": ["h1", "h1", "h2", "h2", "h1"],
        "source": ["nvml", "nvml", "user", "host", "user"],
        "device": ["gpu0", "gpu0", "", "pid77", ""],
        "metric": ["sm_util", "sm_util", "loss", "process_rss_bytes", "delta"],
        "ts_ns": pa.array([BASE - 2_001, BASE + 200, BASE + 300, BASE + 301, BASE + 302]),
        "value": [50.5, float("nan"), 1 / 3, 7942144.0, -0.0],
        "labels": pa.array(
            [[], [], [("pool", "cached")], [("pid", "77")], []], pa.map_(pa.string(), pa.string())
        ),
    }
)
#: Attributes named like the exporter's own arguments, or with its escape in front.
CLASHING = {"span_id": "mine", "depth": "deep", "attr.x": "y", "attr.lane": "z", "lane": "w"}


def with_depth(table: pa.Table, depths: list[int]) -> pa.Table:
    i = table.schema.get_field_index("depth")
    return table.set_column(i, "depth", pa.array(depths, pa.uint16()))


def by_id(table: pa.Table) -> dict[int, dict]:
    out = {}
    for row in table.select(list(COLUMNS)).to_pylist():
        row["attrs"] = dict(row["attrs"] or [])
        out[row["span_id"]] = row
    return out


def round_trip(tmp_path: Path, rows: list[tuple], depths: list[int], **options: object) -> tuple:
    """Spans of ``rows`` (and COUNTERS) exported and read back: (original, converted)."""
    table = with_depth(spans(rows), depths)
    path = tmp_path / "t.json.gz"
    write_chrome_trace(path, {**RUN, "ended_ns": BASE + 10**7, "command": "python train.py",
                              "status": "finished"},  # fmt: skip
                       THREADS, [table], [COUNTERS], **options)  # fmt: skip
    data, _ = read_trace(path)
    assert is_export(data)
    return table, convert(data, name=path.name, command="import t.json.gz")


@pytest.mark.parametrize("categories", ["kineto", "native"])
def test_spans_come_back_as_recorded(tmp_path: Path, categories: str) -> None:
    rows = [r if r[7] != "forward" else (*r[:10], {**r[10], **CLASHING}) for r in ROWS]
    depths = [0, 0, 1, 1, 0, 3, 0]
    original, converted = round_trip(tmp_path, rows, depths, categories=categories)
    before, after = by_id(original), by_id(converted.spans)
    assert after.keys() == before.keys()
    kernel = next(s for s, r in before.items() if r["lane"] == "gpu0/stream7")
    if categories == "kineto":
        # On a GPU's track the dialect keeps neither the pid and tid of device work nor whether
        # device and stream were attributes: the launching call's process (the host's busiest
        # without one), tid 0, and device and stream from the lane.
        k = before[kernel]
        before[kernel] = {**k, "pid": 10, "tid": 0, "attrs": {"device": "0", "stream": "7"}}
    assert after == before
    # Two hosts' pid 10: the exporter renumbered one, the import gives both back.
    assert {(r["host"], r["pid"], r["tid"]) for r in after.values()} >= {("h1", 10, 10),
                                                                          ("h2", 10, 77)}  # fmt: skip
    assert after[2]["attrs"] == {"batch": "3", **CLASHING}
    assert converted.counts == {"step": 1, "nvtx": 1, "op": 1, "mark": 1, "forward": 1,
                                "server": 1, "kernel": 1}  # fmt: skip


def test_gpu_activity_comes_back_with_its_launches(tmp_path: Path) -> None:
    rows = gpu_activity_rows()
    original, converted = round_trip(tmp_path, rows, [0, 1, 1, 0, 0, 0, 1, 1])
    before, after = by_id(original), by_id(converted.spans)
    # Kernel and memset: their launching call's pid (10), tid 0, attributes exact (Kineto's
    # numbers as the text they were: "0.0625", "[4, 2, 1]"). The GPU annotation has no call:
    # the host's busiest process.
    before[6] = {**before[6], "pid": 10, "tid": 0}
    for sid in (4, 5):
        before[sid] = {**before[sid], "tid": 0}
    assert after == before
    assert converted.linked == 2


def test_counters_and_the_run_come_back(tmp_path: Path) -> None:
    _, converted = round_trip(tmp_path, ROWS, [0] * len(ROWS))
    got = converted.counters.to_pylist()
    for row in got:
        row["labels"] = dict(row["labels"] or [])
    finite = COUNTERS.filter(pa.array([True, False, True, True, True])).to_pylist()
    for row in finite:
        row["labels"] = dict(row["labels"] or [])
    assert got == finite  # NaN is left out (JSON has none); -0.0, 1/3 and the times exact
    assert str(got[-1]["value"]) == "-0.0"
    info = converted.info
    assert (info.trace_id, info.started_ns, info.ended_ns, info.hosts, info.status) == (
        RUN["trace_id"], BASE, BASE + 10**7, ["h1", "h2"], "finished")  # fmt: skip
    assert info.command == "import t.json.gz" and info.run_id != RUN["run_id"]
    assert info.attrs == {
        **RUN["attrs"],  # the clock anchor as recorded: same wall-clock times
        "source": "gpu-trace",
        "source_file": "t.json.gz",
        "source_run_id": "r1",
        "source_command": "python train.py",
    }
    assert sorted(converted.threads) == sorted(
        (t["host"], t["pid"], t["tid"], t["process_name"], t["thread_name"]) for t in THREADS
    )


def test_an_older_export_without_the_trailers_map(tmp_path: Path) -> None:
    """A file from before the trailer named hosts, pids and tids: its one host, the file's pids
    and tids (synthetic ones too), the rest as recorded."""
    rows = [r for r in ROWS if r[0] == "h1" and r[5] != "gpu0/stream7"]
    path = tmp_path / "old.json"
    write_chrome_trace(path, {**RUN, "hosts": ["h1"]}, THREADS, [spans(rows)])
    data = json.loads(path.read_text(), parse_float=str)
    for key in ("processes", "tracks", "threads", "attrs", "started_ns", "ended_ns"):
        del data["gpu_trace"][key]
    converted = convert(data, name="old.json", command="c")
    after = by_id(converted.spans)
    assert {r["host"] for r in after.values()} == {"h1"}
    assert after[1]["tid"] == 10 and after[2]["tid"] >= 1 << 30  # steps keep the real tid
    assert [after[s]["lane"] for s in sorted(after)] == [r[5] for r in rows]
    assert converted.info.started_ns == BASE  # the time base, which was the run's start


def test_a_broken_export_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "t.json.gz"
    write_chrome_trace(path, RUN, THREADS, [spans(ROWS)], [COUNTERS])
    with gzip.open(path, "rt") as f:
        data = json.load(f, parse_float=str)
    span = next(e for e in data["traceEvents"] if e["ph"] == "X")
    del span["args"]["span_id"]
    with pytest.raises(TraceImportError, match=r"^event \d+: span_id is None, not text$"):
        convert(data, name="t", command="c")
    span["args"]["span_id"] = "xyz"
    with pytest.raises(TraceImportError, match="span_id 'xyz' is not 16 hex digits"):
        convert(data, name="t", command="c")
    span["args"]["span_id"] = "00000000000000ff"
    span["pid"] = 2**80
    with pytest.raises(TraceImportError, match="pid 1208925819614629174706176 or tid"):
        convert(data, name="t", command="c")
    span["pid"], span["ts"] = 10, "1e30"  # past an int64 column: was an OverflowError traceback
    with pytest.raises(TraceImportError, match="^a time, pid or tid too large for 64 bits$"):
        convert(data, name="t", command="c")
    data["traceEvents"] = [e for e in data["traceEvents"] if e["ph"] == "C"]
    data["traceEvents"][0]["args"] = {"value": "high"}
    with pytest.raises(TraceImportError, match="sm_util value is 'high', not a number"):
        convert(data, name="t", command="c")
    data["gpu_trace"]["processes"] = "none"
    with pytest.raises(TraceImportError, match=r"^gpu_trace.processes is not a list of objects$"):
        convert(data, name="t", command="c")
