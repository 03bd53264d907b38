"""GPU activity from real CUPTI records (an H100, replayed): spool file -> conversion -> store.

tests/data/cupti-h100-lm.jsonl.gz holds 13,329 records of three training steps, recorded with
cupti-python over CUPTI 13.0. The replay writes the activity file the injection library writes,
and ingest converts and stores it: the road a live capture takes after the buffer callback.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from gpu_trace.collectors.gpu_activity import activity_file
from gpu_trace.collectors.gpu_activity.__main__ import replay
from gpu_trace.collectors.gpu_activity.activity import RECORD
from gpu_trace.query import reads
from gpu_trace.store.client import Store
from gpu_trace.store.ingest import ingest
from gpu_trace.tracer.run import RunInfo
from gpu_trace.tracer.spool import SpoolWriter

DATA = Path(__file__).parents[1] / "data" / "cupti-h100-lm.jsonl.gz"
FIRST_NS = 1795546636035488715  # the file's first CUPTI timestamp
MAIN_TID, OTHER_TID = 4052377920, 3705685696  # pthread ids CUPTI reported for the two threads


def _records() -> list[dict]:
    with gzip.open(DATA, "rt") as f:
        return [json.loads(line) for line in f]


def _run(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    RunInfo(
        run_id="gpu", trace_id="cd" * 16, started_ns=0, ended_ns=10**10, status="finished"
    ).save(run_dir)
    return run_dir


def _ingest(tmp_path: Path, run_dir: Path) -> tuple[Store, object]:
    store = Store(f"chdb://{tmp_path / 'store'}")
    return store, ingest(store, run_dir)


def test_every_record_becomes_a_span_and_every_device_record_finds_its_call(
    tmp_path: Path,
) -> None:
    run_dir = _run(tmp_path)
    replay(DATA, run_dir, anchor=(FIRST_NS, 5_000))
    with Store(f"chdb://{tmp_path / 'store'}") as store:
        report = ingest(store, run_dir)
        assert not report.problems
        _, rows = store.sql(
            "SELECT category, count() FROM gpu_trace.spans GROUP BY category ORDER BY category"
        )
        counts = dict(rows)
        # kind 5 is CUPTI's RUNTIME and kind 4 its DRIVER (cupti_activity.h)
        assert counts == {
            "cuda_api": 8429 + 4271,
            "cuda_sync": 31,
            "kernel": 523,
            "memcpy": 48,
            "memset": 27,
        }
        _, rows = store.sql(
            "SELECT countIf(startsWith(name, 'cuda') OR startsWith(name, '__cuda')), count()"
            " FROM gpu_trace.spans WHERE category = 'cuda_api'"
        )
        assert rows == [(8429, 12700)]
        # every kernel, copy, memset and sync is the child of the API call of its correlation id
        _, rows = store.sql(
            "SELECT d.category, count(), countIf(a.span_id != 0),"
            " countIf(d.attrs['correlation'] = a.attrs['correlation'])"
            " FROM gpu_trace.spans d LEFT JOIN gpu_trace.spans a"
            " ON a.span_id = d.parent_span_id AND a.category = 'cuda_api'"
            " WHERE d.category IN ('kernel', 'memcpy', 'memset', 'cuda_sync')"
            " GROUP BY d.category ORDER BY d.category"
        )
        assert [(c, n) for c, n, _, _ in rows] == [
            ("cuda_sync", 31),
            ("kernel", 523),
            ("memcpy", 48),
            ("memset", 27),
        ]
        assert all(n == linked == same for _, n, linked, same in rows)
        _, rows = store.sql(
            "SELECT a.name, count() FROM gpu_trace.spans k JOIN gpu_trace.spans a"
            " ON a.span_id = k.parent_span_id WHERE k.category = 'kernel'"
            " GROUP BY a.name ORDER BY a.name"
        )
        assert dict(rows) == {
            "cuLaunchKernel": 30,
            "cudaLaunchKernel": 400,
            "cudaLaunchKernelExC": 93,
        }
        _, rows = store.sql(
            "SELECT lane, count() FROM gpu_trace.spans"
            " WHERE category IN ('kernel', 'memcpy', 'memset') GROUP BY lane"
        )
        assert rows == [("gpu0/stream7", 598)]
        _, rows = store.sql(
            "SELECT name, attrs FROM gpu_trace.spans WHERE category = 'kernel'"
            " ORDER BY start_ns LIMIT 1"
        )
        name, attrs = rows[0]
        assert name.startswith("void at::native::(anonymous namespace)::distribution_elementwise")
        assert attrs["grid"] == "[5, 1, 1]" and attrs["block"] == "[256, 1, 1]"
        assert attrs["registers per thread"] == "56" and attrs["stream"] == "7"
        assert {"correlation", "device", "context", "shared memory"} <= set(attrs)
        _, rows = store.sql(
            "SELECT name, attrs['bytes'], attrs['memory bandwidth (GB/s)'] FROM gpu_trace.spans"
            " WHERE category = 'memcpy' ORDER BY start_ns LIMIT 1"
        )
        assert rows[0][0] == "Memcpy HtoD (Pageable -> Device)" and rows[0][1] == "8388608"
        assert float(rows[0][2]) > 0
        # the clock: CUPTI's first time is the anchor's monotonic time, others follow exactly
        _, rows = store.sql("SELECT min(start_ns) FROM gpu_trace.spans")
        assert rows == [(5_000,)]
        assert reads.run(store, "gpu")["attrs"]["gpu_activity_records"] == "13329"
        _, rows = store.sql("SELECT count(), uniqExact(span_id) FROM gpu_trace.spans")
        assert rows == [(13329, 13329)]
    assert not list((run_dir / "spool").glob("gpu_activity-*"))  # converted once, into the spool


def test_api_calls_nest_in_the_innermost_op_of_their_thread(tmp_path: Path) -> None:
    """CUPTI reports pthread ids; mapped to the OS ids the recorder stores, an API call's parent
    is the innermost recorder span open on its thread, across lanes."""
    recs = [r for r in _records() if r["kind"] in (4, 5)]
    main = sorted((r for r in recs if r["thread_id"] == MAIN_TID), key=lambda r: r["start"])
    anchor = (FIRST_NS, 10**9)
    mono = lambda t: t - FIRST_NS + 10**9  # noqa: E731
    a, b = main[100], main[101]  # two consecutive calls on the main thread
    # op "outer" holds both; module "inner" (another lane, deeper) holds only a; step "late"
    # (started after a ended) holds only b.
    spans = [
        (11, 0, "torch/ops", "op", "outer", mono(a["start"]) - 100, mono(b["end"]) + 100, 0),
        (12, 0, "torch/modules", "module", "inner", mono(a["start"]) - 50, mono(a["end"]) + 50, 0),
        (13, 11, "torch/ops", "op", "late", mono(a["end"]) + 1, mono(b["end"]) + 10, 1),
    ]
    run_dir = _run(tmp_path)
    writer = SpoolWriter(
        run_dir, {"run_id": "gpu", "trace_id": "cd" * 16, "pid": "777", "host": "h"}
    )
    cols = list(zip(*spans))
    n = len(spans)
    table = pa.table(
        {
            "span_id": pa.array(cols[0], pa.uint64()),
            "parent_span_id": pa.array(cols[1], pa.uint64()),
            "pid": pa.array([777] * n, pa.uint32()),
            "tid": pa.array([4242] * n, pa.uint64()),
            "lane": pa.array(cols[2]),
            "category": pa.array(cols[3]),
            "name": pa.array(cols[4]),
            "start_ns": pa.array(cols[5], pa.int64()),
            "end_ns": pa.array(cols[6], pa.int64()),
            "depth": pa.array(cols[7], pa.uint16()),
            "attrs": pa.array([[]] * n, pa.map_(pa.string(), pa.string())),
        }
    )
    writer.write("spans", table)
    replay(DATA, run_dir, anchor=anchor, threads={MAIN_TID: 4242}, pid=777)
    with Store(f"chdb://{tmp_path / 'store'}") as store:
        ingest(store, run_dir)
        _, rows = store.sql(
            "SELECT attrs['correlation'], parent_span_id, tid FROM gpu_trace.spans"
            " WHERE category = 'cuda_api' AND attrs['correlation'] IN"
            f" ('{a['correlation_id']}', '{b['correlation_id']}') ORDER BY start_ns"
        )
        assert rows == [
            (str(a["correlation_id"]), 12, 4242),
            (str(b["correlation_id"]), 13, 4242),
        ]
        _, rows = store.sql(
            "SELECT countIf(parent_span_id != 0), uniqExact(tid) FROM gpu_trace.spans"
            f" WHERE category = 'cuda_api' AND tid = {OTHER_TID}"
        )
        assert rows[0][0] == 0  # the other thread (unmapped, its own id) is in no op


def test_drops_and_damage_are_shown_and_the_rest_kept(tmp_path: Path) -> None:
    """A chunk that fails its checksum and a truncated tail: one line each, the rest stored;
    records CUPTI dropped are counted into the run and shown by gpu-trace show."""
    records = np.zeros(3, RECORD)
    records["kind"] = 5
    records["pid"] = 9
    records["tid"] = 1
    records["correlation"] = [1, 2, 3]
    records["code"] = 211
    records["start"] = [100, 200, 300]
    records["end"] = [150, 250, 350]
    good = activity_file.encode(records[:2], dropped=17)
    bad = bytearray(activity_file.encode(records[2:]))
    bad[-40] ^= 0xFF  # inside the records chunk's payload
    run_dir = _run(tmp_path)
    spool = run_dir / "spool"
    activity_file.write(
        spool / "gpu_activity-9-a.bin", good + bytes(bad[len(activity_file.MAGIC) :])
    )
    activity_file.write(spool / "gpu_activity-9-b.bin", good[:-10])  # killed mid-write
    home = tmp_path / "home"
    env = {**os.environ, "GPU_TRACE_HOME": str(home)}
    out = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "ingest", str(run_dir)],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "gpu_activity-9-a.bin: skipped chunk 2: checksum mismatch" in out.stdout + out.stderr
    assert "gpu_activity-9-b.bin: truncated" in out.stdout + out.stderr
    assert "CUPTI dropped 17 GPU activity records" in out.stdout + out.stderr
    shown = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "show", "gpu"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "gpu activity=4 records (17 dropped, 0 without an API call)" in shown.stdout


def test_a_garbled_replay_line_is_named_and_the_rest_kept(tmp_path: Path) -> None:
    with gzip.open(DATA, "rt") as f:
        lines = f.read().splitlines()[:50]
    lines[10] = lines[10][:25]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    out, n, problems = replay(path, _run(tmp_path))
    assert n == 49 and len(problems) == 1 and problems[0].startswith("bad.jsonl:11: not JSON")
    assert out.name.startswith("gpu_activity-425-")


@pytest.mark.parametrize("blob", [b"", b"GTACT0", b"not an activity file at all"])
def test_an_unreadable_activity_file_is_one_line(tmp_path: Path, blob: bytes) -> None:
    path = activity_file.write(tmp_path / "gpu_activity-1-x.bin", blob)
    data = activity_file.read([path])
    assert len(data.records) == 0 and len(data.problems) == 1
