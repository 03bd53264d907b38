"""Ingest throughput: spool files -> chDB, next to chDB's own insert of the same spans.

    python bench/ingest.py [--spans 1000000] [--file-rows 100000] [--rounds 3]
                           [--baseline CHECKOUT] [--insert-df] [--keep]

Writes N synthetic spans as real spool files once (SpoolWriter, the recorder's own format:
dictionary strings, attribute maps, a CRC per batch, one file per ``--file-rows``), then, in a
fresh child process per measurement (chDB holds one store per process, and each starts cold),
ingests the run directory into a fresh embedded store with ``gpu_trace.store.ingest.ingest`` and
inserts the same spans, from the Arrow table in memory, into a second table of the same layout
with chDB's ``Python(table)`` table function: the peer, chDB's own Arrow insert (no files, no
checksums, no added columns, no idempotency log). The two go in alternating order from round to
round, after a first ``Python()`` query (chDB imports pyarrow.dataset and pandas at its first,
once per process) and the imports of numpy, pyarrow and gpu_trace. ``--insert-df`` adds a second peer: clickhouse-connect's ``insert_df`` from a pandas frame
(the usual way to load a frame into ClickHouse; slow, so off by default).

``--baseline CHECKOUT``: also measure another tree (a ``git worktree add`` of an earlier commit,
or a revision, which the bench checks out into its temporary directory and removes after), in
child processes interleaved with this tree's, round after round: before and after a change in one
run, over the same spool files. Children import ``gpu_trace`` from their tree, mapped as its
``pyproject.toml`` maps it.

Prints each round, then the median and range over the rounds of each tree's rows/s, the peer's,
and their ratio (each child's ingest time against its own peer's), the process CPU time of each
(engine threads included: on a saturated machine the steadier figure), and with a baseline the
after / before ratio of ingest times round by round; with the load average and CPU count, since
the machine is shared. No thresholds: figures only, and only ratios within one run mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import checkout

HERE = Path(__file__).resolve()
TREE = HERE.parents[1]

NAMES = [f"aten::op_{i}" for i in range(200)]
LANES = ["nvtx/gpu_trace", "nvtx/default", "cpu/main", "gpu0/stream7"]


# ---- the spans -----------------------------------------------------------------------------------


def synthetic_spans(n: int, seed: int = 0, first_id: int = 1 << 32) -> Any:
    import numpy as np
    import pyarrow as pa

    from gpu_trace.tracer.records import SPAN_SCHEMA, numeric_column

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

    def dictionary(values: list[str], codes: Any) -> pa.Array:
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


def write_run(run_dir: Path, table: Any, file_rows: int) -> None:
    from gpu_trace.tracer.run import RunInfo, new_trace_id
    from gpu_trace.tracer.spool import SpoolWriter

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


# ---- one measurement (a child process) -----------------------------------------------------------


def measure(run_dir: Path, spans: int, store_dir: Path, peer_first: bool, insert_df: bool) -> dict:
    """Ingest ``run_dir`` into a fresh store at ``store_dir`` and insert the same spans with chDB's
    own Arrow insert (and ``insert_df``); seconds of each."""
    import chdb

    from gpu_trace.store.client import Store
    from gpu_trace.store.ingest import ingest

    table = synthetic_spans(spans)
    out: dict[str, float] = {}
    with Store(f"chdb://{store_dir}") as store:
        store.client.command("CREATE TABLE gpu_trace.spans_peer AS gpu_trace.spans")
        # chDB's first Python() in a process imports pyarrow.dataset (and pandas, which building
        # the table did already): done here, so that neither side pays it.
        warm = chdb.connect(os.path.realpath(store_dir))
        one = table.slice(0, 1)  # noqa: F841 - chDB's Python() finds it by name
        warm.query("SELECT count() FROM Python(one)")
        warm.close()

        def ours() -> None:
            c0, t0 = time.process_time(), time.perf_counter()
            report = ingest(store, run_dir)
            out["ingest_s"] = time.perf_counter() - t0
            out["ingest_cpu_s"] = time.process_time() - c0
            assert report.rows["spans"] == spans, report

        def peer() -> None:
            conn = chdb.connect(os.path.realpath(store_dir))  # a second handle on the same engine
            try:
                arrow_table = table  # noqa: F841 - chDB's Python() finds it by name
                columns = ", ".join(table.column_names)
                c0, t0 = time.process_time(), time.perf_counter()
                conn.query(
                    f"INSERT INTO gpu_trace.spans_peer ({columns}) SELECT * FROM Python(arrow_table)"
                )
                out["arrow_s"] = time.perf_counter() - t0
                out["arrow_cpu_s"] = time.process_time() - c0
            finally:
                conn.close()

        for step in (peer, ours) if peer_first else (ours, peer):
            step()
        rows = store.client.query("SELECT count() FROM gpu_trace.spans_peer").result_rows[0][0]
        assert rows == spans, rows
        if insert_df:
            store.client.command("TRUNCATE TABLE gpu_trace.spans_peer")
            df = table.to_pandas()
            df["run_id"] = "peer-run"
            df["trace_id"] = "0" * 32
            df["host"] = "bench"
            df["attrs"] = [dict(a) for a in df["attrs"]]
            t0 = time.perf_counter()
            store.client.insert_df("gpu_trace.spans_peer", df)
            out["df_s"] = time.perf_counter() - t0
    return out


# ---- the run -------------------------------------------------------------------------------------


def _child(tree: Path, run_dir: Path, args: argparse.Namespace, store_dir: Path, rnd: int) -> dict:
    cmd = [sys.executable, str(HERE), "--child", str(run_dir), "--tree", str(tree)]
    cmd += ["--spans", str(args.spans), "--store", str(store_dir)]
    cmd += ["--peer-first"] if rnd % 2 else []
    cmd += ["--insert-df"] if args.insert_df else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    shutil.rmtree(store_dir, ignore_errors=True)
    if done.returncode:
        raise SystemExit(f"child for {tree} failed:\n{done.stdout}{done.stderr}")
    result: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--spans", type=int, default=1_000_000, help="spans to ingest (default 1M)")
    p.add_argument("--file-rows", type=int, default=100_000, help="spans per spool file")
    p.add_argument("--rounds", type=int, default=3, help="measurements per tree (default 3)")
    p.add_argument("--baseline", help="another tree or revision to measure too (before)")
    p.add_argument("--insert-df", action="store_true", help="also time insert_df from pandas")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--child", help=argparse.SUPPRESS)  # the run directory
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    p.add_argument("--peer-first", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        checkout.use_tree(args.tree)
        result = measure(
            Path(args.child), args.spans, Path(args.store), args.peer_first, args.insert_df
        )
        print(json.dumps(result))
        return

    tmp = Path(tempfile.mkdtemp(prefix="gpu-trace-bench-ingest-"))
    worktree = None
    try:
        trees = [("after", TREE)]
        if args.baseline:
            base, worktree = checkout.worktree(args.baseline, tmp)
            trees.insert(0, ("before", base))
        run_dir = tmp / "runs" / "bench-run"
        write_run(run_dir, synthetic_spans(args.spans), args.file_rows)
        files = len(list((run_dir / "spool").iterdir()))
        load0 = os.getloadavg()
        print(f"spans: {args.spans:,} in {files} spool files; {os.cpu_count()} CPUs")
        for label, tree in trees:
            print(f"{label}: {checkout.describe(tree)}")
        results: dict[str, list[dict]] = {label: [] for label, _ in trees}
        for rnd in range(args.rounds):
            order = trees if rnd % 2 == 0 else trees[::-1]
            for label, tree in order:
                r = _child(tree, run_dir, args, tmp / f"store-{label}-{rnd}", rnd)
                results[label].append(r)
                extra = f", insert_df {r['df_s']:.2f} s" if "df_s" in r else ""
                print(
                    f"round {rnd + 1} {label:>6}: ingest {r['ingest_s']:.3f} s"
                    f" ({args.spans / r['ingest_s'] / 1e6:.2f} M/s), chDB Python(arrow)"
                    f" {r['arrow_s']:.3f} s ({args.spans / r['arrow_s'] / 1e6:.2f} M/s),"
                    f" ingest/arrow {r['arrow_s'] / r['ingest_s']:.2f}x; CPU s ingest"
                    f" {r['ingest_cpu_s']:.3f}, arrow {r['arrow_cpu_s']:.3f}{extra}",
                    flush=True,
                )
        load1 = os.getloadavg()
    finally:
        checkout.remove(worktree)
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)

    def mps(seconds: list[float]) -> list[float]:
        return [args.spans / s / 1e6 for s in seconds]

    print(f"\nmedian (range) over {args.rounds} rounds, M spans/s; ratio: rows/s of ingest / peer")
    for label, _ in trees:
        rs = results[label]
        line = (
            f"  {label:>6}: ingest {_spread(mps([r['ingest_s'] for r in rs]))},"
            f" chDB Python(arrow) {_spread(mps([r['arrow_s'] for r in rs]))},"
            f" ingest/arrow {_spread([r['arrow_s'] / r['ingest_s'] for r in rs])}x"
        )
        if args.insert_df:
            line += f", insert_df {_spread(mps([r['df_s'] for r in rs]))}"
        print(line)
        print(
            f"  {'':>6}  CPU s (process, engine threads too): ingest"
            f" {_spread([r['ingest_cpu_s'] for r in rs], '{:.3f}')},"
            f" chDB Python(arrow) {_spread([r['arrow_cpu_s'] for r in rs], '{:.3f}')}"
        )
    if args.baseline:
        ratios = [
            b["ingest_s"] / a["ingest_s"] for a, b in zip(results["after"], results["before"])
        ]
        print(f"  ingest speed after / before, round by round: {_spread(ratios)}x")
    print(f"  load average (1 min) {load0[0]:.2f} at the start, {load1[0]:.2f} at the end")


if __name__ == "__main__":
    main()
