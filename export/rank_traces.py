"""One Chrome trace per rank (``rank-<N>.json``), as Holistic Trace Analysis reads a multi-rank
trace: a directory of files, each with its ``distributedInfo``, written in one pass over the
run's batches (``gpu-trace export --ranks-dir``)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa

from gpu_trace.export.chrome import ChromeTraceExporter

__all__ = ["write_rank_traces"]


def write_rank_traces(
    directory: str | os.PathLike[str],
    run: dict[str, object],
    threads: Iterable[dict[str, object]],
    rank_pids: dict[int, set[tuple[str, int]]],
    span_batches: Iterable[pa.Table],
    counter_batches: Iterable[pa.Table] = (),
    *,
    world_size: int | None = None,
    backend: str = "",
    suffix: str = ".json",
) -> dict[int, dict[str, object]]:
    """Write one Chrome trace per rank into ``directory``, ``rank-<N><suffix>``, as HTA reads a
    multi-rank trace (a directory of files, each with ``distributedInfo``); returns each rank's
    stats. ``rank_pids`` gives each rank's processes as (host, pid); a rank's file holds their
    spans and its hosts' counters. Spans of processes without a rank (the launcher's) are in no
    file. One pass over the batches."""
    import pyarrow.compute as pc

    out = Path(directory)
    world = world_size if world_size is not None else max(rank_pids, default=-1) + 1
    thread_rows = list(threads)
    exporters: dict[int, ChromeTraceExporter] = {}
    keys: dict[int, pa.Array] = {}
    hosts: dict[int, pa.Array] = {}
    for rank, pids in sorted(rank_pids.items()):
        mine = [
            t for t in thread_rows if (str(t.get("host", "")), int(str(t.get("pid", 0)))) in pids
        ]
        exporters[rank] = ChromeTraceExporter(
            out / f"rank-{rank}{suffix}",
            run=run,
            threads=mine,
            rank=rank,
            world_size=world,
            backend=backend,
        )
        keys[rank] = pa.array(sorted(f"{h}\x00{p}" for h, p in pids))
        hosts[rank] = pa.array(sorted({h for h, _ in pids}))
    ok = False
    try:
        for batch in span_batches:
            key = pc.binary_join_element_wise(
                pc.cast(batch["host"], pa.string()), pc.cast(batch["pid"], pa.string()), "\x00"
            )
            for rank, exporter in exporters.items():
                part = batch.filter(pc.is_in(key, value_set=keys[rank]))
                if part.num_rows:
                    exporter.write_spans(part)
        for batch in counter_batches:
            host = pc.cast(batch["host"], pa.string())
            for rank, exporter in exporters.items():
                part = batch.filter(pc.is_in(host, value_set=hosts[rank]))
                if part.num_rows:
                    exporter.write_counters(part)
        ok = True
    finally:
        stats = {rank: exporter.close(complete=ok) for rank, exporter in exporters.items()}
    return stats
