"""Clocks of other hosts: another host's spool times mapped onto the run's clock.

Spool files whose metadata names a :data:`CLOCK_PEER` (a forwarding server's spans and counters)
hold that host's raw times, and so does a part of a job recorded on a host other than the run's
clock host (:class:`JobPart`). Ingest maps them with a
:class:`~gpu_trace.tracer.clocksync.ClockModel` fitted to all the run's ``clock_sync`` rows for
that peer (stored and in this spool: :func:`clock_models`), keeping the raw times and the offset
applied in attrs (:func:`map_clock`); the streaming exporter maps a live run's spans the same way.
Apart from ingest's reading of the spool, since it is about times, not files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from gpu_trace.store import jobs
from gpu_trace.tracer.clocksync import ClockModel
from gpu_trace.tracer.run import RunInfo

if TYPE_CHECKING:
    from gpu_trace.store.client import Store

log = logging.getLogger(__name__)

#: Spool metadata naming the host whose clock a file's times are on; ingest maps them onto the
#: run's clock with the run's ``clock_sync`` rows for that peer (forwarding servers' spans).
CLOCK_PEER = "clock_peer"
#: Clock samples are filtered per window of this many ns (lowest RTTs kept in each), as the
#: forwarding client does.
CLOCK_WINDOW_NS = 30_000_000_000


@dataclass
class JobPart:
    """A run directory that is one part of a job, and the job's run as stored before it."""

    stored: RunInfo | None
    peer: str  # the part's host when its times need mapping onto the run's clock, else ""
    clock: jobs.PartClock | None = None

    @classmethod
    def of(cls, info: RunInfo, stored: RunInfo | None) -> JobPart:
        """``info``'s part (``jobs.is_part(info)``), with the job's run as stored before it."""
        host = info.hosts[0] if info.hosts else ""
        other = stored is not None and bool(host) and host != jobs.clock_host(stored)
        return cls(stored, host if other else "")


def job_clock_rows(
    info: RunInfo, clock: jobs.PartClock, samples: set[tuple[int, int, int]]
) -> pa.Table:
    """The part's offset as the run's ``clock_sync`` rows (``show`` and the dashboard list them):
    on the run's clock host, the part's host the peer."""
    rows = sorted(samples)
    n = len(rows)
    return pa.table(
        {
            "peer": pa.array([clock.host] * n, pa.string()),
            "ts_ns": pa.array([r[0] for r in rows], pa.int64()),
            "offset_ns": pa.array([r[1] for r in rows], pa.int64()),
            "rtt_ns": pa.array([r[2] for r in rows], pa.int64()),
            "uncertainty_ns": pa.array([r[2] // 2 for r in rows], pa.int64()),
            "run_id": pa.array([info.run_id] * n, pa.string()),
            "host": pa.array([clock.clock_host] * n, pa.string()),
        }
    )


def collect_clock(table: pa.Table, rows: dict[str, set[tuple[int, int, int]]]) -> None:
    peers = table.column("peer").cast(pa.string()).to_pylist()
    ts, off, rtt = (table.column(c).to_pylist() for c in ("ts_ns", "offset_ns", "rtt_ns"))
    for peer, t, o, r in zip(peers, ts, off, rtt):
        rows.setdefault(peer or "", set()).add((int(t), int(o), int(r)))


def clock_models(
    store: Store, run_id: str, rows: dict[str, set[tuple[int, int, int]]]
) -> dict[str, ClockModel]:
    """A clock model per peer from the run's ``clock_sync`` rows: stored ones and this ingest's."""
    stored = store.query(
        "SELECT peer, ts_ns, offset_ns, rtt_ns FROM __db__.clock_sync WHERE run_id = {run_id:String}",
        {"run_id": run_id},
    )
    for peer, t, o, r in stored.result_rows:
        rows.setdefault(peer, set()).add((int(t), int(o), int(r)))
    models = {}
    for peer, samples in rows.items():
        try:
            models[peer] = ClockModel.from_measurements(sorted(samples), window_ns=CLOCK_WINDOW_NS)
        except ValueError as exc:
            log.warning("gpu-trace: clock of %s in run %s: %s", peer, run_id, exc)
    return models


def map_clock(
    kind: str, table: pa.Table, model: ClockModel | None, peer: str
) -> tuple[pa.Table, str | None]:
    """A peer's spans or counters on the run's clock, with what was applied.

    Spans keep their raw times in attrs ``raw_start_ns``/``raw_end_ns`` (the writer puts them
    there) and get ``clock_offset_ns`` and ``clock_uncertainty_ns``. Without a model (no clock
    samples of ``peer`` in the run) the times stay as they are, with an offset of 0.
    """
    note = None if model is not None else f"no clock_sync rows for {peer!r}: times not mapped"
    if kind == "counters":
        if model is not None:
            ts = table.column("ts_ns").to_numpy()
            table = table.set_column(
                table.schema.get_field_index("ts_ns"), "ts_ns", pa.array(model.map_to_client(ts)[0])
            )
        return table, note
    start = table.column("start_ns").to_numpy()
    end = table.column("end_ns").to_numpy()
    if model is not None:
        start, offset, unc = model.map_to_client(start)
        end = model.map_to_client(end)[0]
    else:
        offset = unc = np.zeros(len(start), dtype=np.int64)
    i = table.schema.get_field_index
    table = table.set_column(i("start_ns"), "start_ns", pa.array(start, pa.int64()))
    table = table.set_column(i("end_ns"), "end_ns", pa.array(end, pa.int64()))
    attrs = _append_attrs(
        table.column("attrs"),
        {"clock_offset_ns": offset.astype(str), "clock_uncertainty_ns": unc.astype(str)},
    )
    return table.set_column(i("attrs"), "attrs", attrs), note


def _append_attrs(column: pa.ChunkedArray, extra: dict[str, np.ndarray]) -> pa.Array:
    """Each row's map with ``extra``'s keys added (one value per row), built in one pass."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(arr)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    keys = arr.keys.slice(offsets[0], offsets[-1] - offsets[0])
    items = arr.items.slice(offsets[0], offsets[-1] - offsets[0])
    offsets = offsets - offsets[0]
    lengths = np.diff(offsets)
    k = len(extra)
    old_total = int(offsets[-1])
    # New layout per row: its old entries, then the k new ones.
    new_offsets = np.concatenate(([0], np.cumsum(lengths + k)))
    order = np.empty(old_total + n * k, dtype=np.int64)
    row_of = np.repeat(np.arange(n), lengths)
    order[np.arange(old_total) + k * row_of] = np.arange(old_total)
    for j in range(k):
        order[offsets[1:] + k * np.arange(n) + j] = old_total + j * n + np.arange(n)
    all_keys = pa.concat_arrays(
        [keys.cast(pa.string()), *(pa.array([name] * n, pa.string()) for name in extra)]
    )
    all_items = pa.concat_arrays(
        [items.cast(pa.string()), *(pa.array(v.tolist(), pa.string()) for v in extra.values())]
    )
    take = pa.array(order)
    return pa.MapArray.from_arrays(
        pa.array(new_offsets, pa.int32()), all_keys.take(take), all_items.take(take)
    ).cast(arr.type)
