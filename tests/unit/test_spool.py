"""Spool integrity: every batch carries a checksum of its contents; readers skip and name batches
that are damaged (checksum, unreadable) or impossible (negative times, spans ending before they
start, unknown categories) and keep the rest; older spools without checksums still read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from gpu_trace.tracer.records import (
    CLOCK_SYNC_SCHEMA,
    COUNTER_SCHEMA,
    SPAN_SCHEMA,
    attrs_column,
    dict_column,
    numeric_column,
)
from gpu_trace.tracer.spool import (
    BATCH_ROWS,
    SpoolWriter,
    checksum,
    list_spool,
    read_spool_file,
)

REPO = Path(__file__).resolve().parents[2]
META = {"run_id": "r", "trace_id": "ab" * 16, "host": "h", "pid": "7", "process_name": "t"}


def spans(n: int, *, start: int = 1_000, category: str = "nvtx") -> pa.Table:
    i = np.arange(n, dtype=np.int64)
    return pa.table(
        {
            "span_id": numeric_column(i + 1, pa.uint64()),
            "parent_span_id": numeric_column(np.zeros(n), pa.uint64()),
            "pid": numeric_column(np.full(n, 7), pa.uint32()),
            "tid": numeric_column(np.full(n, 3), pa.uint64()),
            "lane": dict_column(["nvtx/gpu_trace"] * n),
            "category": dict_column([category] * n),
            "name": dict_column([f"n{k % 7}" for k in range(n)]),
            "start_ns": numeric_column(start + i * 10, pa.int64()),
            "end_ns": numeric_column(start + i * 10 + 5, pa.int64()),
            "depth": numeric_column(np.zeros(n), pa.uint16()),
            "attrs": attrs_column([{"k": str(k)} if k % 3 == 0 else None for k in range(n)]),
        },
        schema=SPAN_SCHEMA,
    )


def write(tmp_path: Path, kind: str, table: pa.Table) -> Path:
    path = SpoolWriter(tmp_path, META).write(kind, table)
    assert path is not None
    return path


def test_every_kind_round_trips_with_checksums(tmp_path: Path) -> None:
    n = 2 * BATCH_ROWS + 123  # three batches, the last one short
    counters = pa.table(
        {
            "source": dict_column(["user"] * 5),
            "device": dict_column([""] * 5),
            "metric": dict_column(["loss"] * 5),
            "ts_ns": numeric_column(np.arange(5) + 10, pa.int64()),
            "value": numeric_column(np.linspace(0, 1, 5), pa.float64()),
            "labels": attrs_column([None, {"a": "b"}, None, None, {"c": "d", "e": ""}]),
        },
        schema=COUNTER_SCHEMA,
    )
    clock = pa.table(
        [dict_column(["peer"] * 2)] + [numeric_column([5, 6], pa.int64()) for _ in range(4)],
        schema=CLOCK_SYNC_SCHEMA,
    )
    for kind, table in (("spans", spans(n)), ("counters", counters), ("clock_sync", clock)):
        path = write(tmp_path, kind, table)
        f = read_spool_file(path)
        assert (f.problem, f.skipped_batches) == (None, 0), f.problem
        assert f.table.to_pylist() == table.to_pylist()
        # Still a plain Arrow stream: Arrow's own reader reads it without knowing of the sums.
        with ipc.open_stream(pa.memory_map(str(path))) as reader:
            assert reader.read_all().num_rows == table.num_rows


def test_checksum_is_of_contents_not_layout() -> None:
    table = spans(1000)
    whole = table.combine_chunks().to_batches()[0]
    # The same rows as a slice (offset 500) of a longer array: other buffers, same sum.
    sliced = pa.concat_tables([spans(500), table]).combine_chunks().slice(500, 1000)
    (batch,) = sliced.to_batches()
    assert batch.column(0).offset == 500 and batch.to_pylist() == whole.to_pylist()
    assert checksum(batch) == checksum(whole)
    changed = table.set_column(7, "start_ns", pa.array(np.arange(1000) * 10 + 1001, pa.int64()))
    assert checksum(changed.to_batches()[0]) != checksum(whole)


def _batch_rows(path: Path) -> list[int]:
    with ipc.open_stream(pa.memory_map(str(path))) as reader:
        return [b.num_rows for b in reader]


def test_ff_bytes_in_the_middle_skip_only_that_batch(tmp_path: Path) -> None:
    n = 3 * BATCH_ROWS
    path = write(tmp_path, "spans", spans(n))
    data = bytearray(path.read_bytes())
    middle = len(data) // 2  # inside the second batch's body: bodies are nearly all of the file
    data[middle : middle + 4096] = b"\xff" * 4096
    path.write_bytes(bytes(data))
    f = read_spool_file(path)
    assert f.skipped_batches == 1
    assert f.table.num_rows == n - BATCH_ROWS
    assert min(f.table.column("start_ns").to_pylist()) >= 0
    assert f.notes[0].startswith(f"batch 1 ({BATCH_ROWS} rows): ")
    assert "checksum mismatch" in f.notes[0] or "unreadable" in f.notes[0]


def test_a_flipped_bit_in_a_value_is_caught(tmp_path: Path) -> None:
    table = spans(1000)
    path = write(tmp_path, "spans", table)
    data = bytearray(path.read_bytes())
    # A start time that stays possible with its lowest bit flipped: only the checksum sees it.
    value = (1_000 + 500 * 10).to_bytes(8, "little")
    at = data.index(value)
    data[at] ^= 1
    path.write_bytes(bytes(data))
    f = read_spool_file(path)
    assert f.table is None and f.skipped_batches == 1
    assert f.notes == ["batch 0 (1000 rows): checksum mismatch"]


def test_a_truncated_tail_keeps_the_whole_batches(tmp_path: Path) -> None:
    n = 3 * BATCH_ROWS
    path = write(tmp_path, "spans", spans(n))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.9)])  # in the last batch
    f = read_spool_file(path)
    assert f.table.num_rows == 2 * BATCH_ROWS and f.skipped_batches == 0
    assert f.problem.startswith(f"truncated or corrupt after {2 * BATCH_ROWS} rows")


@pytest.mark.parametrize(
    "table, reason",
    [
        (spans(10, start=-100), "negative start_ns"),
        (
            spans(10).set_column(8, "end_ns", pa.array([0] * 10, pa.int64())),
            "a span ends before it starts",
        ),
        (spans(10, category="evil"), "unknown category 'evil'"),
    ],
)
def test_a_valid_but_impossible_batch_is_skipped(
    tmp_path: Path, table: pa.Table, reason: str
) -> None:
    good = spans(BATCH_ROWS)  # batch 0 good, batch 1 impossible: one file, checksums right
    path = write(tmp_path, "spans", pa.concat_tables([good, table]))
    f = read_spool_file(path)
    assert f.table.num_rows == BATCH_ROWS
    assert f.notes == [f"batch 1 (10 rows): {reason}"]


def test_only_the_impossible_rows_of_a_summed_batch_go(tmp_path: Path) -> None:
    # A batch as its writer wrote it (its sum is right) loses only the rows that cannot be.
    table = spans(1000)
    ends = np.arange(1000) * 10 + 1_005
    ends[[3, 500]] = 0
    table = table.set_column(8, "end_ns", pa.array(ends, pa.int64()))
    f = read_spool_file(write(tmp_path, "spans", table))
    assert f.skipped_batches == 0 and f.table.num_rows == 998
    assert {4, 501}.isdisjoint(f.table.column("span_id").to_pylist())  # ids are row + 1
    assert f.notes == ["batch 0: 2 of 1000 rows: a span ends before it starts"]
    assert f.problem == "skipped batch 0: 2 of 1000 rows: a span ends before it starts"


def test_counters_and_clock_samples_before_time_zero_are_skipped(tmp_path: Path) -> None:
    clock = pa.table(
        [dict_column(["p"])] + [numeric_column([v], pa.int64()) for v in (5, 0, -1, 0)],
        schema=CLOCK_SYNC_SCHEMA,
    )
    f = read_spool_file(write(tmp_path, "clock_sync", clock))
    assert f.table is None and f.notes == ["batch 0 (1 rows): negative rtt_ns"]


def test_a_spool_without_checksums_still_reads_and_is_checked(tmp_path: Path) -> None:
    # As recorders before checksums wrote it: no checksum key, no per-batch metadata.
    path = tmp_path / "spans-7-aaaaaa-000000.arrow"
    table = pa.concat_tables([spans(100), spans(100, start=-5)])
    table = table.replace_schema_metadata({**META, "kind": "spans"})
    with pa.OSFile(str(path), "wb") as sink, ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=100):
            writer.write_batch(batch)
    f = read_spool_file(path)
    assert f.table.num_rows == 100
    assert f.notes == ["batch 1 (100 rows): negative start_ns"]


def test_the_sample_runs_spooled_before_checksums_read_whole() -> None:
    run_dir = REPO / "sample_traces" / "runs" / "local-training"
    files = list_spool(run_dir)
    assert files
    for path in files:
        f = read_spool_file(path)
        assert (f.problem, f.skipped_batches) == (None, 0), (path.name, f.problem)
        assert f.table is not None and f.table.num_rows > 0
