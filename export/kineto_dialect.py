"""The Kineto dialect of the Chrome trace export: what PyTorch's profiler writes and Holistic
Trace Analysis and Perfetto's PyTorch views read.

Categories map onto Kineto's (:data:`KINETO_CATEGORIES`: ``op`` -> ``cpu_op``, ``nvtx``/``step``
-> ``user_annotation``, ``module`` -> ``python_function``, ``kernel`` -> ``kernel``, ``memcpy`` ->
``gpu_memcpy``; ``cuda_driver`` and ``gpu_user_annotation`` where the row says so:
:func:`kineto_rows`); Kineto's numeric arguments are written as JSON numbers
(:data:`KINETO_INT_ARGS`...); device work's ``device`` and ``stream`` are written once, from the
lane (:func:`without_lane_args`); a backward op's forward op is a ``fwdbwd`` flow
(:func:`forward_spans`).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.export.json_fragments import combined, dictionary, plain
from gpu_trace.export.tracks import DEVICE_TRACK
from gpu_trace.tracer.records import (
    CUDA_API,
    CUDA_SYNC,
    KERNEL,
    MEMCPY,
    MEMSET,
    MODULE,
    NVTX,
    OP,
    STEP,
)
from gpu_trace.tracer.trace_format import FORWARD_SPAN

__all__ = [
    "KINETO_CATEGORIES",
    "DEVICE_CATEGORIES",
    "INT_ARGS",
    "KINETO_INT_ARGS",
    "KINETO_NUMBER_ARGS",
    "KINETO_LIST_ARGS",
    "kineto_rows",
    "forward_spans",
    "attr_map",
    "without_lane_args",
]

#: Our categories as Kineto names them (what HTA and Perfetto's PyTorch views expect).
KINETO_CATEGORIES = {
    OP: "cpu_op",
    MODULE: "python_function",
    NVTX: "user_annotation",
    STEP: "user_annotation",
    KERNEL: "kernel",
    MEMCPY: "gpu_memcpy",
    MEMSET: "gpu_memset",
    CUDA_API: "cuda_runtime",  # "cuda_driver" for a call whose attribute api is "driver"
    CUDA_SYNC: "cuda_sync",
}
#: Device work: in the Kineto dialect, the flow from its launching call is an ``ac2g`` arrow.
DEVICE_CATEGORIES = (KERNEL, MEMCPY, MEMSET)
#: Kineto argument names HTA reads as integers: attributes with these names and an integer value
#: are written as JSON numbers (everything else stays a string, as recorded).
INT_ARGS = ("correlation", "External id", "Sequence number", "Fwd thread id", "Ev Idx", "cbid")
#: More of Kineto's numeric arguments, written as JSON numbers in the Kineto dialect as
#: PyTorch's profiler writes them (HTA reads them as numbers): integers, numbers, integer lists.
KINETO_INT_ARGS = (
    *INT_ARGS,
    "context",
    "bytes",
    "registers per thread",
    "shared memory",
    "static shared memory",
    "dynamic shared memory",
    "queued",
    "est. achieved occupancy %",
    "wait_on_stream",
    "wait_on_cuda_event_record_corr_id",
    "Record function id",
)
KINETO_NUMBER_ARGS = ("memory bandwidth (GB/s)", "blocks per SM", "warps per SM")
KINETO_LIST_ARGS = ("grid", "block")


def kineto_rows(
    batch: pa.Table, cat_names: list[str], cat_codes: np.ndarray, cat_json: pa.Array
) -> pa.Array:
    """Kineto's category where ours depends on the row: ``cuda_driver`` for a driver call (its
    ``api`` attribute says ``driver``, as an imported trace's do; without one, its name is the
    driver's ``cu*``, not the runtime's ``cuda*``), ``gpu_user_annotation`` for a range on a
    stream's annotation lane (an imported trace's)."""
    if CUDA_API in cat_names:
        is_api = cat_codes == cat_names.index(CUDA_API)
        api = pc.fill_null(pc.map_lookup(attr_map(batch["attrs"]), "api", "first"), "")
        name = plain(batch["name"])
        named_driver = pc.and_(pc.starts_with(name, "cu"), pc.invert(pc.starts_with(name, "cuda")))
        driver_rows = pc.or_(pc.equal(api, "driver"), pc.and_(pc.equal(api, ""), named_driver))
        driver = is_api & np.asarray(pc.fill_null(driver_rows, False), dtype=bool)
        if driver.any():
            cat_json = pc.if_else(pa.array(driver), '"cuda_driver"', cat_json)
    if NVTX in cat_names:
        lane_codes, lane_dict = dictionary(batch["lane"])
        on_stream = np.array(
            [bool(DEVICE_TRACK.match(x or "")) for x in lane_dict.to_pylist()] or [False]
        )
        rows = on_stream[lane_codes] & (cat_codes == cat_names.index(NVTX))
        if rows.any():
            cat_json = pc.if_else(pa.array(rows), '"gpu_user_annotation"', cat_json)
    return cat_json


def forward_spans(batch: pa.Table) -> np.ndarray | None:
    """Per row, the span id in the ``forward span`` attribute (a backward op's forward op, in an
    imported trace), 0 where there is none; None when no row has one."""
    value = pc.map_lookup(attr_map(batch["attrs"]), FORWARD_SPAN, "first")
    if value.null_count == len(value):
        return None
    ok = pc.fill_null(pc.match_substring_regex(value, r"^[0-9]{1,19}$"), False)
    ids = pc.cast(pc.if_else(ok, value, "0"), pa.uint64())
    return np.asarray(ids, dtype=np.uint64)


def attr_map(col: pa.Array | pa.ChunkedArray) -> pa.MapArray:
    """A map column (attributes, labels) as one MapArray, whichever form the store read it in."""
    attrs = combined(col)
    if isinstance(attrs, pa.MapArray):
        return attrs
    # (key, value) structs, as some reads give a map
    return pa.MapArray.from_arrays(attrs.offsets, attrs.values.field(0), attrs.values.field(1))


def without_lane_args(batch: pa.Table, device_rows: np.ndarray) -> pa.Array:
    """The attrs of ``batch`` less ``device`` and ``stream`` on the rows of device lanes, where
    the exporter writes both from the lane (Kineto writes each once, as a number)."""
    attrs = attr_map(batch["attrs"])
    if not device_rows.any():
        return attrs
    offsets = np.asarray(attrs.offsets, np.int64)
    lo, hi = int(offsets[0]), int(offsets[-1])  # a slice's keys and items are not sliced
    offsets = offsets - lo
    keys = plain(attrs.keys.slice(lo, hi - lo))
    items = plain(attrs.items.slice(lo, hi - lo))
    row = np.repeat(np.arange(len(attrs)), np.diff(offsets))
    drop = np.asarray(pc.is_in(keys, pa.array(["device", "stream"])), dtype=bool) & device_rows[row]
    if not drop.any():
        return attrs
    keep = pa.array(~drop)
    counts = np.bincount(row[~drop], minlength=len(attrs))
    new_offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    return pa.MapArray.from_arrays(pa.array(new_offsets), keys.filter(keep), items.filter(keep))
