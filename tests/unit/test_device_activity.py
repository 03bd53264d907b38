"""The server's GPU activity pieces: busy time as a union, the growing activity file read in whole
chunks once each, GPU rows in the server's span tables, measured-or-not busy time per tenant."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_trace.collectors.gpu_activity import activity as act
from gpu_trace.collectors.gpu_activity import activity_file
from gpu_trace.runtime.protocol.span_tables import decode_tables, encode_tables, span_table
from gpu_trace.runtime.server import admin
from gpu_trace.runtime.server.activity_tail import FileSource
from gpu_trace.runtime.server.device_activity import DeviceActivity, union_ns
from gpu_trace.runtime.sharing.sessions import Session, SpanLog


def _union(intervals: list[tuple[int, int]]) -> int:
    covered: set[int] = set()
    for s, e in intervals:
        covered.update(range(s, e))
    return len(covered)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)), max_size=30),
    st.integers(0, 30),
)
def test_busy_time_is_the_union_of_intervals_across_calls(
    pairs: list[tuple[int, int]], cut: int
) -> None:
    intervals = sorted((s, s + d) for s, d in pairs)
    first, second = intervals[:cut], intervals[cut:]
    total, covered = 0, 0
    for part in (first, second):
        s = np.array([a for a, _ in part], np.int64)
        e = np.array([b for _, b in part], np.int64)
        got, covered = union_ns(s[::-1], e[::-1], covered)  # any order within a call
        total += got
    assert total == _union(intervals)


def _records(n: int, start: int) -> np.ndarray:
    r = act.empty(n)
    r["kind"], r["correlation"] = act.CONCURRENT_KERNEL, np.arange(start, start + n)
    return r


def test_a_growing_file_is_read_in_whole_chunks_once_each(tmp_path: Path) -> None:
    source = FileSource(tmp_path)
    path = source.spool / f"{activity_file.PREFIX}1-a{activity_file.SUFFIX}"
    whole = activity_file.encode(_records(3, 1), {0: "k0"}, anchors=[(100, 0)])
    more = activity_file.encode(_records(2, 4), {1: "k1"})[len(activity_file.MAGIC) :]
    path.parent.mkdir(parents=True)
    path.write_bytes(whole + more[:30])  # the library is half way through a chunk
    (first,) = source.read_new()
    assert first.records["correlation"].tolist() == [1, 2, 3]
    assert first.anchors.tolist() == [[100, 0]] and first.names[0] == "k0"
    assert source.read_new() == []  # nothing whole since
    with open(path, "ab") as f:
        f.write(more[30:])
    (second,) = source.read_new()
    assert second.records["correlation"].tolist() == [4, 5]  # not the first three again
    assert second.anchors.tolist() == [[100, 0]] and second.names == {0: "k0", 1: "k1"}
    assert not source.problems
    source.close()
    assert not source.directory.exists()


def test_a_file_that_is_not_activity_is_named_once(tmp_path: Path) -> None:
    source = FileSource(tmp_path)
    source.spool.mkdir(parents=True)
    (source.spool / f"{activity_file.PREFIX}2-b{activity_file.SUFFIX}").write_bytes(b"x" * 64)
    assert source.read_new() == [] and source.read_new() == []
    assert source.problems == [
        f"{activity_file.PREFIX}2-b.bin: not a GPU activity file (bad magic)"
    ]


def test_gpu_tables_cross_in_one_field_and_a_bad_one_is_one_message() -> None:
    table = span_table([[5, 0, "server/op", "aten::mm", 10, 20, None]], 42, lambda: 99)
    assert decode_tables(encode_tables([table, table])).to_pylist() == table.to_pylist() * 2
    assert decode_tables(None) is None and decode_tables(encode_tables([])) is None
    for bad, why in (
        ("not base64!", "do not read"),
        (encode_tables([]) + "AAAA", "do not read"),
        (7, "not a string"),
    ):
        with pytest.raises(ValueError, match=why):
            decode_tables(bad)


def test_tables_added_from_another_thread_go_out_with_the_next_take() -> None:
    log = SpanLog()
    log.span(1, 0, "server/execute", "execute", 0, 5)
    table = span_table([[2, 1, "server/op", "x", 1, 2, None]], 1, lambda: 3)
    t = threading.Thread(target=log.add_table, args=(table,))
    t.start()
    t.join()
    body = log.take()
    assert [s[0] for s in body["spans"]] == [1] and body["gpu"] == [table]
    assert "gpu" not in log.take()


def test_ended_sessions_keep_their_gpu_busy_time_and_unmeasured_stays_unmeasured() -> None:
    ledger = admin.Ledger()
    measured = Session({"host": "a"}, lambda *a: None)
    unmeasured = Session({"host": "b"}, lambda *a: None)
    measured.usage.gpu_busy_ns = 1234
    for s in (measured, unmeasured):
        ledger.open(s)
        ledger.retire(s)
    assert ledger.ended["default"]["gpu_busy_ns"] == 1234
    only_unmeasured = admin.Ledger()
    only_unmeasured.open(unmeasured)
    only_unmeasured.retire(unmeasured)
    assert "gpu_busy_ns" not in only_unmeasured.ended["default"]


def test_bytes_read_are_given_back_to_the_disk(tmp_path: Path) -> None:
    source = FileSource(tmp_path)
    path = source.spool / f"{activity_file.PREFIX}3-c{activity_file.SUFFIX}"
    activity_file.write(path, activity_file.encode(_records(20_000, 1)))  # 2 MB
    before = path.stat()
    assert before.st_blocks * 512 >= before.st_size
    (data,) = source.read_new()
    assert len(data.records) == 20_000
    after = path.stat()
    assert after.st_size == before.st_size  # the library's offsets stay valid
    assert after.st_blocks * 512 < before.st_size // 4


def _kernel_after_its_launch(tmp_path: Path) -> tuple[DeviceActivity, Session, list]:
    """A launch inside an op read in one poll, its kernel in the next (another CUPTI buffer)."""
    source = FileSource(tmp_path)
    activity = DeviceActivity(source)
    session = Session({"host": "a"}, lambda *a: None)
    session.trace = True
    activity.batch(session, 100, 1_000, 9_000, [("aten::mm", 2_000, 8_000)], [101])
    tid = activity.batches()[0].tid
    api, kernel = act.empty(1), act.empty(1)
    api["kind"], api["pid"], api["tid"], api["correlation"] = act.RUNTIME, activity.pid, tid, 9
    api["start"], api["end"] = 3_000, 4_000
    kernel["kind"], kernel["pid"], kernel["correlation"] = act.CONCURRENT_KERNEL, activity.pid, 9
    kernel["start"], kernel["end"] = 5_000, 7_000
    polls = []
    for i, part in enumerate((api, kernel)):
        name = f"{activity_file.PREFIX}{activity.pid}-{i}{activity_file.SUFFIX}"
        activity_file.write(source.spool / name, activity_file.encode(part, {0: "k"}))
        activity.poll()
        (table,) = session.log.take()["gpu"]
        polls.append(table.to_pylist())
    return activity, session, polls


def test_a_kernel_read_after_its_launch_still_finds_it(tmp_path: Path) -> None:
    activity, session, (first, second) = _kernel_after_its_launch(tmp_path)
    assert [(r["category"], r["parent_span_id"]) for r in first] == [("cuda_api", 101)]
    # the launch is not sent again; the kernel names it
    assert [(r["category"], r["parent_span_id"]) for r in second] == [
        ("kernel", first[0]["span_id"])
    ]
    assert activity.counts.unattributed == 0 and session.usage.gpu_busy_ns == 2_000
    # On the server's rows as its other spans: the call on the executor's under its op, the
    # kernel on thread 0 of its stream's lane; raw server times kept like every server span's.
    (call,), (work,) = first, second
    assert (call["tid"], call["depth"], work["tid"], work["depth"]) == (2, 3, 0, 0)
    assert dict(work["attrs"])["raw_start_ns"] == str(work["start_ns"]) == "5000"
    assert dict(call["attrs"])["raw_end_ns"] == "4000" and dict(call["attrs"])["correlation"] == "9"


def test_what_the_library_says_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = FileSource(tmp_path)
    activity = DeviceActivity(source)
    note = "GPU activity is off: CUPTI's activity buffers are taken (another profiler)"
    for i in range(2):  # the library says it again after a fork, or the next file
        path = source.spool / f"{activity_file.PREFIX}{activity.pid}-{i}{activity_file.SUFFIX}"
        activity_file.write(path, activity_file.encode(act.empty(0), notes=[note]))
        activity.poll()
    assert activity.notes == [note]
    assert [r.getMessage() for r in caplog.records].count(f"gpu-trace serve: {note}") == 1


def test_a_burst_of_gpu_spans_goes_back_in_frames_the_client_reads(tmp_path: Path) -> None:
    """More spans than one frame may hold (wire.MAX_FRAME): several TRACE messages, all read."""
    from gpu_trace.collectors.gpu_activity.conversion import convert
    from gpu_trace.runtime.protocol import wire
    from gpu_trace.runtime.server.sink import ReturnSink

    n = 200_000
    records = act.empty(2 * n)
    records["kind"][0::2], records["kind"][1::2] = act.RUNTIME, act.CONCURRENT_KERNEL
    records["pid"], records["correlation"] = 7, np.repeat(np.arange(1, n + 1), 2)
    records["start"] = np.arange(2 * n) * 1000
    records["end"] = records["start"] + 500
    table = convert(records, {0: "void gemm_kernel<float, 128, 128>(float*, float*, int)"}).table
    frames: list[bytes] = []
    session = Session({"host": "a"}, lambda frame: frames.append(bytes(frame)))
    ReturnSink().export(session, {"spans": [], "counters": [], "gpu": [table]})
    sizes = [wire.HEADER.unpack_from(f)[0] for f in frames]
    assert max(sizes) <= wire.MAX_FRAME  # in one message: about 98 MiB, a broken session
    got = [decode_tables(wire.decode_json(f[wire.HEADER.size :])["gpu"]) for f in frames]
    assert sum(t.num_rows for t in got) == 2 * n


def test_a_batch_that_went_on_on_another_thread_finds_each_ops_calls_on_its_own(
    tmp_path: Path,
) -> None:
    """A batch parked for memory on a connection's thread and finished on the executor's: the
    launch made by its first op (on the first thread) is under that op, not lost."""
    source = FileSource(tmp_path)
    activity = DeviceActivity(source)
    session = Session({"host": "a"}, lambda *a: None)
    session.trace = True
    here = threading.get_native_id()
    elsewhere = here + 1_000_000  # the thread it parked on
    ops = [("aten::empty", 2_000, 3_000), ("aten::mm", 5_000, 8_000)]
    activity.batch(session, 100, 1_000, 9_000, ops, [101, 102], [(1, elsewhere)])
    api = act.empty(2)
    api["kind"], api["pid"], api["correlation"] = act.RUNTIME, activity.pid, (1, 2)
    api["tid"], api["start"], api["end"] = (elsewhere, here), (2_100, 5_100), (2_900, 7_900)
    path = source.spool / f"{activity_file.PREFIX}{activity.pid}-p{activity_file.SUFFIX}"
    activity_file.write(path, activity_file.encode(api, {}))
    activity.poll()
    (table,) = session.log.take()["gpu"]
    assert sorted(table.column("parent_span_id").to_pylist()) == [101, 102]
