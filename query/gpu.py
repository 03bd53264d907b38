"""Reads of a run's GPU activity: top kernels per device and how busy each device was.

Device work (kernels, copies, memsets) is stored on lanes ``gpu<device>/stream<stream>`` by the
CUPTI collector and by ``gpu-trace import``; this module answers ``gpu-trace show``'s GPU part
(and is where the dashboard's summary can ask the same). It needs only the store's public
``query`` and ``query_arrow``.

Busy time is the union of the device's work intervals over all its streams (work overlapping on
two streams counts once); idle time is the rest of the device's window, from its first work's
start to its last work's end. A kernel's share is its total time over the device's busy time, so
kernels running concurrently on several streams can add up to more than 100%.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypedDict

import numpy as np
import pyarrow as pa

from gpu_trace.tracer.records import KERNEL, MEMCPY, MEMSET

if TYPE_CHECKING:
    from clickhouse_connect.driver.query import QueryResult

#: A device lane's device number (ClickHouse regular expression).
_DEVICE = "toUInt32OrZero(extract(lane, '^gpu([0-9]+)/stream[0-9]+$'))"
_IS_DEVICE_LANE = "match(lane, '^gpu[0-9]+/stream[0-9]+$')"

_KERNELS = f"""
SELECT {_DEVICE} AS device, name, count() AS count, sum(end_ns - start_ns) AS total_ns
FROM __db__.spans
WHERE run_id = {{run_id:String}} AND category = '{KERNEL}' AND {_IS_DEVICE_LANE}
GROUP BY device, name
"""

_WORK = f"""
SELECT {_DEVICE} AS device, start_ns, end_ns
FROM __db__.spans
WHERE run_id = {{run_id:String}} AND category IN ('{KERNEL}', '{MEMCPY}', '{MEMSET}')
  AND {_IS_DEVICE_LANE}
ORDER BY device, start_ns
"""


class Queries(Protocol):
    """What these reads need of a store (``Store`` has it)."""

    def query(self, template: str, params: dict[str, str] | None = None) -> QueryResult: ...

    def query_arrow(self, template: str, params: dict[str, str] | None = None) -> pa.Table: ...


class KernelRow(TypedDict):
    """One kernel name on one device."""

    name: str
    count: int
    total_ns: int
    mean_ns: int
    share: float  # of the device's busy time


class DeviceSummary(TypedDict):
    """One device's work (see the module docstring)."""

    device: int
    work: int  # kernels, copies and memsets
    busy_ns: int
    window_ns: int
    idle_ns: int
    busy_share: float
    kernels: int
    kernel_ns: int
    top: list[KernelRow]


class GpuSummary(TypedDict):
    devices: list[DeviceSummary]


def busy_ns(start: np.ndarray, end: np.ndarray) -> int:
    """Length of the union of intervals ``[start, end)`` sorted by start."""
    if len(start) == 0:
        return 0
    reach = np.maximum.accumulate(end)
    before = np.concatenate(([start[0]], reach[:-1]))
    return int((reach - np.maximum(start, before)).sum())


def gpu_summary(store: Queries, run_id: str, top: int = 10) -> GpuSummary:
    """Per device: kernels, their total time, busy and idle time, and the top ``top`` kernels by
    total time (``name, count, total_ns, mean_ns, share``). ``{"devices": []}`` when the run
    has no device work."""
    per_name = store.query(_KERNELS, {"run_id": run_id}).result_rows
    work = store.query_arrow(_WORK, {"run_id": run_id})
    devices: dict[int, DeviceSummary] = {}
    if work.num_rows:
        dev = np.asarray(work.column("device").to_numpy(), np.int64)
        start = np.asarray(work.column("start_ns").to_numpy(), np.int64)
        end = np.asarray(work.column("end_ns").to_numpy(), np.int64)
        cuts = np.flatnonzero(np.diff(dev)) + 1
        for rows in np.split(np.arange(len(dev)), cuts):
            d = int(dev[rows[0]])
            busy = busy_ns(start[rows], end[rows])
            window = int(end[rows].max() - start[rows[0]])
            devices[d] = {
                "device": d,
                "work": len(rows),
                "busy_ns": busy,
                "window_ns": window,
                "idle_ns": window - busy,
                "busy_share": busy / window if window else 0.0,
                "kernels": 0,
                "kernel_ns": 0,
                "top": [],
            }
    for d, name, count, total in per_name:
        entry = devices.get(int(d))
        if entry is None:
            continue
        entry["kernels"] += int(count)
        entry["kernel_ns"] += int(total)
        entry["top"].append(
            {
                "name": str(name),
                "count": int(count),
                "total_ns": int(total),
                "mean_ns": int(total) // max(int(count), 1),
                "share": int(total) / entry["busy_ns"] if entry["busy_ns"] else 0.0,
            }
        )
    for entry in devices.values():
        entry["top"].sort(key=lambda k: (-k["total_ns"], k["name"]))
        del entry["top"][max(top, 0) :]
    return {"devices": [devices[d] for d in sorted(devices)]}
