"""`gpu-trace import`'s reading and conversion of Kineto traces (store/trace_file.py,
store/kineto_trace.py), without a store: exact times, lanes and categories, nesting, launch
links, and every kind of bad input."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from gpu_trace.store.importer import convert
from gpu_trace.store.trace_file import TraceImportError, read_trace, to_ns

BASE = 1_790_000_000_000_000_000


def trace(events: list[dict], **meta: object) -> dict:
    return {"schemaVersion": 1, "baseTimeNanoseconds": BASE, **meta, "traceEvents": events}


def x(cat: str, name: str, ts: str, dur: str, pid: int = 9, tid: int = 9, **args: object) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def flow(ph: str, flow_id: int, tid: int, ts: str) -> dict:
    return {"ph": ph, "id": flow_id, "pid": 9, "tid": tid, "ts": ts, "cat": "fwdbwd",
            "name": "fwdbwd", **({"bp": "e"} if ph == "f" else {})}  # fmt: skip


def small() -> dict:
    """One step of a program: an op launching a kernel through the runtime (and the driver
    under it), a copy, a memset; floats as text, as read_trace parses them."""
    return trace(
        [
            {"ph": "M", "name": "process_name", "pid": 9, "tid": 0, "args": {"name": "python3"}},
            {"ph": "M", "name": "thread_name", "pid": 9, "tid": 9, "args": {"name": "main"}},
            {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
            x("user_annotation", "ProfilerStep#3", "4685424240000.001", "1000.000"),
            x("cpu_op", "aten::mm", "4685424240010.916", "50.5", **{"External id": 7}),
            x(
                "cuda_runtime",
                "cudaLaunchKernel",
                "4685424240020.333",
                "5.1",
                correlation=11,
                cbid=211,
            ),  # fmt: skip
            x("cuda_driver", "cuLaunchKernel", "4685424240021", "2.001", correlation=12, cbid=307),
            x(
                "kernel",
                "sgemm",
                "4685424240030.002",
                "100.25",
                0,
                7,
                correlation=11,
                device=0,
                stream=7,
                grid=[1, 2, 3],
                block=[128, 1, 1],
                **{"registers per thread": 64},
            ),  # fmt: skip
            x(
                "gpu_memset",
                "Memset (Device)",
                "4685424240130.5",
                "1",
                0,
                7,
                correlation=12,
                device=0,
                stream=7,
                bytes=48,
            ),  # fmt: skip
            x(
                "gpu_memcpy",
                "Memcpy HtoD",
                "4685424240200",
                "3",
                0,
                9,
                correlation=99,
                device=0,
                stream=9,
                bytes=4096,
                **{"memory bandwidth (GB/s)": "1.3653333333333333"},
            ),  # fmt: skip
            x("gpu_user_annotation", "Optimizer.step", "4685424240029", "110", 0, 7),
            x("overhead", "Activity Buffer Request", "4685424240000", "1", -1, 0),
            {
                "ph": "s",
                "id": 11,
                "pid": 9,
                "tid": 9,
                "ts": "4685424240020.333",
                "cat": "ac2g",
                "name": "ac2g",
            },  # fmt: skip
            x("cpu_op", "MmBackward0", "4685424240500", "20", 9, 10, **{"Sequence number": 5}),
            flow("s", 1, 9, "4685424240010.916"),  # at aten::mm
            flow("f", 1, 10, "4685424240500"),  # at MmBackward0
            {
                "ph": "i",
                "s": "g",
                "name": "Iteration Start",
                "pid": "Traces",
                "tid": "x",
                "ts": "4685424240000",
            },  # fmt: skip
        ]
    )


def rows(data: dict) -> dict[str, dict]:
    converted = convert(data, name="t.json", command="import t.json")
    return {r["name"]: r for r in converted.spans.to_pylist()}


def test_times_are_exact_nanoseconds_from_the_text() -> None:
    assert to_ns("4685424253834.916") == 4_685_424_253_834_916
    assert to_ns("4685424240188.38") == 4_685_424_240_188_380
    assert to_ns(12) == 12_000 and to_ns("0.5") == 500 and to_ns("-1.25") == -1250
    assert to_ns("1.5e3") == 1_500_000 and to_ns("2.0004") == 2000
    # Older PyTorch versions write Unix microseconds, where a float is 0.25 us coarse: the
    # nearest float of this one is 2 ns off. Why the text is parsed.
    assert round(float("1700000000000000.123") * 1000) != 1_700_000_000_000_000_123
    assert to_ns("1700000000000000.123") == 1_700_000_000_000_000_123
    for bad in ("", "abc", None, [1], True):
        with pytest.raises(ValueError):
            to_ns(bad)


def test_events_become_spans_on_gpu_trace_lanes() -> None:
    r = rows(small())
    assert (r["ProfilerStep#3"]["category"], r["ProfilerStep#3"]["lane"]) == ("step", "steps")
    assert (r["aten::mm"]["category"], r["aten::mm"]["lane"]) == ("op", "torch/ops")
    assert r["aten::mm"]["start_ns"] == 4_685_424_240_010_916
    assert r["aten::mm"]["end_ns"] == 4_685_424_240_010_916 + 50_500
    api = r["cudaLaunchKernel"]
    assert (api["category"], api["lane"], api["tid"]) == ("cuda_api", "cuda_api", 9)
    assert dict(api["attrs"])["api"] == "runtime"
    assert dict(r["cuLaunchKernel"]["attrs"])["api"] == "driver"
    kernel = r["sgemm"]
    assert (kernel["category"], kernel["lane"], kernel["pid"]) == ("kernel", "gpu0/stream7", 9)
    attrs = dict(kernel["attrs"])
    assert attrs["grid"] == "[1, 2, 3]" and attrs["registers per thread"] == "64"
    assert (r["Memset (Device)"]["category"], r["Memcpy HtoD"]["lane"]) == (
        "memset",
        "gpu0/stream9",
    )
    assert dict(r["Memcpy HtoD"]["attrs"])["memory bandwidth (GB/s)"] == "1.3653333333333333"
    note = r["Optimizer.step"]
    assert (note["category"], note["lane"]) == ("nvtx", "gpu0/stream7/annotations")


def test_nesting_and_launch_links() -> None:
    r = rows(small())
    step, op, api = r["ProfilerStep#3"], r["aten::mm"], r["cudaLaunchKernel"]
    assert op["parent_span_id"] == step["span_id"] and op["depth"] == 1
    assert api["parent_span_id"] == op["span_id"] and api["depth"] == 2
    # The kernel and memset hang under the call with their correlation; the copy's is missing.
    assert r["sgemm"]["parent_span_id"] == api["span_id"]
    assert r["Memset (Device)"]["parent_span_id"] == r["cuLaunchKernel"]["span_id"]
    assert r["Memcpy HtoD"]["parent_span_id"] == 0
    # The trace's fwdbwd flow: the backward op names its forward op.
    assert dict(r["MmBackward0"]["attrs"])["forward span"] == str(op["span_id"])
    converted = convert(small(), name="t", command="c")
    assert converted.linked == 2
    assert converted.skipped == {"overhead events": 1, "'i' events": 1}
    assert converted.backward_pairs == 1
    assert converted.counts == {"step": 1, "op": 2, "cuda_api": 2, "kernel": 1, "memset": 1,
                                "memcpy": 1, "nvtx": 1}  # fmt: skip


def test_run_attributes_and_clock_anchor() -> None:
    data = small()
    data.update(trace_id="25A8C11B34694816A5DEFC448FC21B4F", cuda_runtime_version=13000,
                deviceProperties=[{"id": 0, "name": "NVIDIA H100 80GB HBM3", "numSms": 132}],
                distributedInfo={"rank": 2, "world_size": 4})  # fmt: skip
    converted = convert(data, name="t.json", command="import t.json")
    info = converted.info
    assert info.trace_id == "25a8c11b34694816a5defc448fc21b4f" and info.status == "finished"
    assert info.started_ns == 4_685_424_240_000_001 and info.ended_ns == 4_685_424_241_000_001
    a = info.attrs
    assert (a["anchor_mono_ns"], a["anchor_wall_ns"]) == ("0", str(BASE))
    assert a["kineto.cuda_runtime_version"] == "13000" and (a["rank"], a["world_size"]) == (
        "2",
        "4",
    )
    assert json.loads(a["device_properties"])[0]["numSms"] == 132
    assert converted.threads == [("", 9, 9, "python3", "main")]  # host: the trace names none
    assert info.hosts == []  # the H100 trace names no host
    data["host_name"] = "gpu-node-7"  # newer PyTorch versions do
    assert convert(data, name="t.json", command="c").info.hosts == ["gpu-node-7"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"this is not json", "not JSON: Expecting value at line 1 column 1"),
        (b'{"traceEvents": [', "not JSON"),
        (b'{"schemaVersion": 1}', "not a Chrome trace (no traceEvents list)"),
        (b'"a string"', "not a Chrome trace"),
        (b"\x80garbage", "not JSON (not UTF-8 text)"),
    ],
)
def test_files_that_are_not_traces(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "t.json"
    path.write_bytes(content)
    with pytest.raises(TraceImportError, match="^t.json: ") as info:
        read_trace(path)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_truncated_and_damaged_gzip(tmp_path: Path) -> None:
    whole = gzip.compress(json.dumps(small()).encode())
    path = tmp_path / "t.json.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceImportError, match="gzip stream is truncated"):
        read_trace(path)
    path.write_bytes(whole[:10] + b"\x00" * 40 + whole[50:])
    with pytest.raises(TraceImportError, match="not a readable gzip file"):
        read_trace(path)
    with pytest.raises(TraceImportError, match="cannot read"):
        read_trace(tmp_path / "missing.json")


def test_what_is_not_a_regular_file_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """`gpu-trace import /dev/zero` read until the kernel's OOM killer ended it (issue 29)."""
    for path in (Path("/dev/zero"), tmp_path):
        with pytest.raises(TraceImportError, match="not a regular file"):
            read_trace(path)


def test_a_gzip_bomb_is_refused_at_its_bound(tmp_path: Path) -> None:
    """A gzip of 300 MiB of one byte (a few hundred KiB on disk) grows past 100x its size:
    refused while it is decompressed, before it is all in memory or parsed (issue 29's 2 MB file
    of 2 GiB of JSON peaked at 6.7 GB)."""
    path = tmp_path / "bomb.json.gz"
    block = b" " * (1 << 20)
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(b'{"traceEvents": [')
        for _ in range(300):
            f.write(block)
        f.write(b"]}")
    assert path.stat().st_size * 100 < (256 << 20) < 300 << 20  # under the 256 MiB floor x100
    with pytest.raises(TraceImportError, match=r"decompresses to more than 256 MiB .*gzip bomb"):
        read_trace(path)
    # several members and trailing zeros, as gzip writes for concatenated files, still read
    one = gzip.compress(b'{"traceEvents": ')
    path.write_bytes(one + gzip.compress(b"[]}") + b"\0" * 8)
    assert read_trace(path)[0] == {"traceEvents": []}


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}", "(nested too deeply)"),
        (
            '{"traceEvents": [{"ph": "X", "ts": ' + "9" * 5000 + "}]}",
            "(a number of more than 4,300 digits)",
        ),
    ],
    ids=["deep", "digits"],
)
def test_hostile_json_is_one_line(tmp_path: Path, content: str, says: str) -> None:
    """RecursionError and Python's integer-digits ValueError were tracebacks (issue 29)."""
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(TraceImportError) as info:
        read_trace(path)
    assert str(info.value) == f"t.json: not a Chrome trace {says}"


def test_a_list_is_a_trace_too(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(small()["traceEvents"]))
    data, digest = read_trace(path)
    assert len(data["traceEvents"]) == len(small()["traceEvents"]) and len(digest) == 64


def broken(change: dict, drop: str | None = None) -> dict:
    data = small()
    ev = data["traceEvents"][7]  # the kernel
    ev.update(change)
    if drop:
        del ev[drop]
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (broken({}, drop="dur"), "event 7 (kernel) has no 'dur'"),
        (broken({}, drop="ts"), "event 7 (kernel) has no 'ts'"),
        (broken({}, drop="name"), "event 7 (kernel) has no 'name'"),
        (broken({"ts": "soon"}), "event 7 (kernel): ts/dur soon is not a number"),
        (broken({"dur": "-2.5"}), "event 7 (kernel): negative dur -2.5"),
        (broken({"pid": "GPU"}), "event 7: pid is 'GPU', not an integer"),
        (broken({"args": {"device": "x"}}), "event 7: device is 'x', not an integer"),
        # numbers past an int64 column were an OverflowError traceback
        (broken({"pid": 2**80}), "a time, pid or tid too large for 64 bits"),
        (broken({"ts": "1e30"}), "a time, pid or tid too large for 64 bits"),
        (trace([1]), "event 0 is a int, not an object"),
        (trace([]), "no events of a PyTorch profiler trace"),
        (trace([x("overhead", "a", "1", "1")]), "no events of a PyTorch profiler trace"),
    ],
)
def test_events_missing_what_they_need(data: dict, message: str) -> None:
    with pytest.raises(TraceImportError) as info:
        convert(data, name="t", command="c")
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_python_functions_nest_among_themselves() -> None:
    """with_stack's Python functions come from another tracer than the ops; an op that starts
    inside one and ends after it must not take its children (their self times went negative)."""
    data = trace(
        [
            x("python_function", "train.py(5): <module>", "1000", "100"),
            x("cpu_op", "aten::linear", "1050", "100"),
            x("python_function", "module.py(1782): _call_impl", "1060", "30"),
        ]
    )
    r = rows(data)
    module, op, call = (
        r["train.py(5): <module>"],
        r["aten::linear"],
        r["module.py(1782): _call_impl"],
    )
    assert (module["category"], module["lane"]) == ("module", "torch/modules")
    assert call["parent_span_id"] == module["span_id"] and call["depth"] == 1
    assert op["parent_span_id"] == 0
