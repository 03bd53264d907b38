"""Ingest throughput: spool files -> chDB, next to chDB's own inserts of the same data.

    python bench/ingest.py [--spans 2000000] [--file-rows 100000]

Writes N synthetic spans as real spool files (SpoolWriter, the recorder's own format: dictionary
strings, attribute maps, one file per ``--file-rows``), ingests the run directory into a fresh
embedded store with ``Store.ingest``, and inserts the same spans into a second table two ways:

- from a pandas DataFrame with clickhouse-connect's ``insert_df`` (the peer: the usual way to load
  a frame into ClickHouse; chDB's ``Python(df)`` table function can't take the attribute map
  column, a column of dicts);
- from the Arrow table in memory with chDB's ``Python(table)`` table function (no files, no
  metadata columns, no idempotency log: the engine's own ceiling for this data).

Prints rows/s for each and the ratios. The machine is shared, so only ratios within one run mean
much.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from gpu_trace.store.client import Store
from gpu_trace.store.ingest import ingest
from gpu_trace.tracer.records import SPAN_SCHEMA, numeric_column
from gpu_trace.tracer.run import RunInfo, new_trace_id
from gpu_trace.tracer.spool import SpoolWriter

NAMES = [f"aten::op_{i}" for i in range(200)]
LANES = ["nvtx/gpu_trace", "nvtx/default", "cpu/main", "gpu0/stream7"]


def synthetic_spans(n: int, seed: int = 0, first_id: int = 1 << 32) -> pa.Table:
    rng = np.random.default_rng(seed)
    start = np.cumsum(rng.integers(200, 5000, n, dtype=np.int64)) + 1_000_000_000
    dur = rng.integers(100, 100_000, n, dtype=np.int64)
    # One span in 16 carries one attribute, like ranges opened with keyword arguments.
    offsets = np.zeros(n + 1, dtype=np.int32)
    has = rng.random(n) < 1 / 16
    np.cumsum(has, out=offsets[1:])
    k = int(offsets[-1])
    attrs = pa.MapArray.from_arrays(
        pa.array(offsets), pa.array(["batch"] * k), pa.array(rng.integers(0, 1000, k).astype(str))
    )

    def dictionary(values: list[str], codes: np.ndarray) -> pa.Array:
        return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(values))

    return pa.table(
        {
            "span_id": numeric_column(
                np.arange(n, dtype=np.uint64) + np.uint64(first_id), pa.uint64()
            ),
            "parent_span_id": numeric_column(np.zeros(n, dtype=np.uint64), pa.uint64()),
            "pid": numeric_column(np.full(n, 4242), pa.uint32()),
            "tid": numeric_column(np.full(n, 4242), pa.uint64()),
            "lane": dictionary(LANES, rng.integers(0, len(LANES), n)),
            "category": dictionary(["nvtx", "op"], rng.integers(0, 2, n)),
            "name": dictionary(NAMES, rng.integers(0, len(NAMES), n)),
            "start_ns": numeric_column(start, pa.int64()),
            "end_ns": numeric_column(start + dur, pa.int64()),
            "depth": numeric_column(rng.integers(0, 4, n), pa.uint16()),
            "attrs": attrs,
        },
        schema=SPAN_SCHEMA,
    )


def write_run(run_dir: Path, table: pa.Table, file_rows: int) -> None:
    run_id = run_dir.name
    trace_id = new_trace_id()
    RunInfo(
        run_id=run_id,
        trace_id=trace_id,
        started_ns=int(table["start_ns"][0].as_py()),
        status="finished",
    ).save(run_dir)
    meta = {
        "run_id": run_id,
        "trace_id": trace_id,
        "host": "bench",
        "pid": "4242",
        "process_name": "bench",
    }
    writer = SpoolWriter(run_dir, meta)
    for offset in range(0, table.num_rows, file_rows):
        writer.write("spans", table.slice(offset, file_rows))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", type=int, default=2_000_000, help="spans to ingest (default 2M)")
    p.add_argument("--file-rows", type=int, default=100_000, help="spans per spool file")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="gpu-trace-bench-ingest-"))
    try:
        table = synthetic_spans(args.spans)
        run_dir = tmp / "runs" / "bench-run"
        write_run(run_dir, table, args.file_rows)
        files = len(list((run_dir / "spool").iterdir()))
        with Store(f"chdb://{tmp / 'store'}") as store:
            t0 = time.perf_counter()
            report = ingest(store, run_dir)
            ours = time.perf_counter() - t0
            assert report.rows["spans"] == args.spans, report

            # The peer: the same rows with the same extra columns, from pandas into the same table
            # layout (a second table, so both inserts start from an empty table).
            store.client.command("CREATE TABLE gpu_trace.spans_peer AS gpu_trace.spans")
            df = table.to_pandas()
            df["run_id"] = "peer-run"
            df["trace_id"] = "0" * 32
            df["host"] = "bench"
            df["attrs"] = [dict(a) for a in df["attrs"]]
            t0 = time.perf_counter()
            store.client.insert_df("gpu_trace.spans_peer", df)
            peer = time.perf_counter() - t0
            n_peer = store.client.query("SELECT count() FROM gpu_trace.spans_peer").result_rows[0][
                0
            ]
            assert n_peer == args.spans, n_peer

            import chdb

            store.client.command("TRUNCATE TABLE gpu_trace.spans_peer")
            conn = chdb.connect(str(tmp / "store"))  # a second handle on the same engine
            try:
                arrow_table = table  # noqa: F841 - chDB's Python() finds it by name
                columns = ", ".join(table.column_names)
                t0 = time.perf_counter()
                conn.query(
                    f"INSERT INTO gpu_trace.spans_peer ({columns}) SELECT * FROM Python(arrow_table)"
                )
                arrow = time.perf_counter() - t0
            finally:
                conn.close()
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"spans: {args.spans:,} in {files} spool files")
    print(
        f"gpu-trace ingest (spool -> chDB): {args.spans / ours / 1e6:6.2f} M spans/s  ({ours:.2f} s)"
    )
    print(
        f"chDB insert_df (pandas -> chDB):  {args.spans / peer / 1e6:6.2f} M spans/s  ({peer:.2f} s)"
    )
    print(
        f"chDB Python(arrow table):         {args.spans / arrow / 1e6:6.2f} M spans/s  ({arrow:.2f} s)"
    )
    print(
        f"ratio ingest / insert_df: {peer / ours:.2f}x; ingest / Python(arrow): {arrow / ours:.2f}x"
    )


if __name__ == "__main__":
    main()
