"""Chrome trace export speed: our streaming exporter vs ``json.dumps`` of a list of event dicts.

    python bench/export.py [--spans 1000000] [--batch 65536] [--gz]

Both sides start from the same Arrow batches (as ``Store.iter_spans`` yields them) and write a
file; the peer builds every event as a dict and dumps the whole list, the usual way exporters are
written. One run prints both, and the ratio (this machine is shared and noisy: compare ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa

from gpu_trace.export.chrome import write_chrome_trace
from gpu_trace.tracer.records import ATTRS


def synthetic_batches(
    total: int, batch_rows: int = 65536, threads: int = 4, seed: int = 0
) -> Iterator[pa.Table]:
    """Span batches ordered by start: per thread, steps of nested ranges 3 deep, attrs on some."""
    rng = np.random.default_rng(seed)
    names = pa.array(["forward", "backward", "optimizer.step", "aten::mm", "aten::add", "load"])
    lanes = pa.array(["nvtx/gpu_trace", "nvtx/torch"])
    cats = pa.array(["nvtx", "op"])
    done = 0
    t0 = 1_000_000_000
    while done < total:
        n = min(batch_rows, total - done)
        i = np.arange(done, done + n, dtype=np.int64)
        start = t0 + i * 1_000 + rng.integers(0, 10, n)
        depth = (i % 3).astype(np.uint16)
        dur = 3_000 - depth.astype(np.int64) * 1_000 + rng.integers(0, 999, n)
        sid = (i + 1).astype(np.uint64)
        parent = np.where(depth > 0, sid - 1, 0).astype(np.uint64)
        lane_codes = (i % 2).astype(np.int32)
        offsets = np.zeros(n + 1, dtype=np.int32)
        has = (i % 10) == 0
        offsets[1:] = np.cumsum(has)
        k = int(has.sum())
        attrs = pa.MapArray.from_arrays(
            pa.array(offsets),
            pa.array(["batch"] * k),
            pa.array([str(x) for x in i[has]]),
            type=ATTRS,
        )
        yield pa.table(
            {
                "run_id": pa.array(["bench"] * n),
                "trace_id": pa.array(["0" * 32] * n),
                "host": pa.DictionaryArray.from_arrays(
                    pa.array(np.zeros(n, np.int32)), pa.array(["node1"])
                ),
                "span_id": pa.array(sid),
                "parent_span_id": pa.array(parent),
                "pid": pa.array(np.full(n, 4242, np.uint32)),
                "tid": pa.array((4242 + i % threads).astype(np.uint64)),
                "lane": pa.DictionaryArray.from_arrays(pa.array(lane_codes), lanes),
                "category": pa.DictionaryArray.from_arrays(pa.array(lane_codes), cats),
                "name": pa.DictionaryArray.from_arrays(
                    pa.array((i % len(names)).astype(np.int32)), names
                ),
                "start_ns": pa.array(start),
                "end_ns": pa.array(start + dur),
                "depth": pa.array(depth),
                "attrs": attrs,
            }
        )
        done += n


RUN = {"run_id": "bench", "trace_id": "0" * 32, "started_ns": 1_000_000_000, "hosts": ["node1"]}


def peer_json_dumps(path: Path, batches: Iterator[pa.Table]) -> None:
    """The usual exporter: a dict per event, one ``json.dumps`` of the whole list."""
    events = []
    base = RUN["started_ns"]
    for batch in batches:
        for row in batch.to_pylist():
            events.append(
                {
                    "ph": "X",
                    "cat": row["category"],
                    "name": row["name"],
                    "pid": row["pid"],
                    "tid": row["tid"],
                    "ts": (row["start_ns"] - base) / 1000,
                    "dur": (row["end_ns"] - row["start_ns"]) / 1000,
                    "args": {"span_id": f"{row['span_id']:016x}", **dict(row["attrs"] or [])},
                }
            )
    path.write_text(json.dumps({"traceEvents": events}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--gz", action="store_true", help="also time a gzipped export")
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args(argv)
    n = args.spans
    print(f"chrome export, {n:,} synthetic spans, batches of {args.batch:,}, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace.json"
        batches = list(synthetic_batches(n, args.batch))  # generated up front: not timed
        t = time.perf_counter()
        stats = write_chrome_trace(out, RUN, [], iter(batches))
        ours = time.perf_counter() - t
        size = out.stat().st_size
        print(
            f"  gpu-trace    {ours:7.2f} s  {n / ours:12,.0f} spans/s  {size / 1e6:8.1f} MB  (+{stats['flows']} flows)"
        )
        if args.gz:
            t = time.perf_counter()
            write_chrome_trace(Path(tmp) / "trace.json.gz", RUN, [], iter(batches))
            gz = time.perf_counter() - t
            gz_size = (Path(tmp) / "trace.json.gz").stat().st_size
            print(f"  gpu-trace gz {gz:7.2f} s  {n / gz:12,.0f} spans/s  {gz_size / 1e6:8.1f} MB")
        tracemalloc.start()
        write_chrome_trace(out, RUN, [], synthetic_batches(min(n, 1 << 18), args.batch))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        print(
            f"  peak traced memory, {min(n, 1 << 18):,} spans generated on the fly: {peak / 1e6:.1f} MB"
        )
        if not args.no_peer:
            t = time.perf_counter()
            peer_json_dumps(Path(tmp) / "peer.json", iter(batches))
            peer = time.perf_counter() - t
            print(f"  json.dumps   {peer:7.2f} s  {n / peer:12,.0f} spans/s")
            print(f"  ratio        {peer / ours:7.1f}x faster than json.dumps of a list")
    return 0


if __name__ == "__main__":
    sys.exit(main())
