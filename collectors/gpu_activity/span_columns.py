"""The spans' Arrow columns built from GPU activity records' numpy columns, without per-record Python.

:func:`~gpu_trace.collectors.gpu_activity.conversion.convert` decides what each record becomes
(its clock, thread, parent and span id); this builds the rows of the ``spans`` table from that:
numbers as decimal strings in Arrow's C++ cast, names and lanes as dictionaries over the few
distinct values a run has, attribute maps whose every row has the same keys built as one Arrow
map, the API calls' table (:func:`api_table`, on lane :data:`API_LANE`) and each kind of device
work's (:func:`device_table`: kernels, copies, memsets, synchronizations with PyTorch's profiler's
argument names).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gpu_trace.collectors.gpu_activity import activity as act
from gpu_trace.collectors.gpu_activity.cbid_names import DRIVER, RUNTIME
from gpu_trace.collectors.gpu_activity.demangle import demangle
from gpu_trace.tracer.columns import columns_to_table
from gpu_trace.tracer.records import (
    ATTRS,
    CUDA_API,
    CUDA_SYNC,
    KERNEL,
    MEMCPY,
    numeric_column,
    string_column,
)

API_LANE = "cuda_api"


def _strings(values: np.ndarray) -> pa.Array:
    """Numbers as decimal strings (Arrow's cast, in C++)."""
    v = np.ascontiguousarray(values)
    return pc.cast(
        pa.Array.from_buffers(pa.from_numpy_dtype(v.dtype), len(v), [None, pa.py_buffer(v)]),
        pa.string(),
    )


def _dictionary(codes: np.ndarray, values: list[str]) -> pa.Array:
    return pa.DictionaryArray.from_arrays(numeric_column(codes, pa.int32()), string_column(values))


def _small_codes(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values of small non-negative integer keys and each key's index among them,
    without sorting (a run has a few hundred distinct API calls or kernels, not millions)."""
    key = np.asarray(key, np.int64)
    if len(key) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int32)
    if key.max() > 1 << 24:  # not small after all
        uniq, codes = np.unique(key, return_inverse=True)
        return uniq, codes.ravel().astype(np.int32)
    present = np.bincount(key) > 0
    uniq = np.flatnonzero(present)
    lut = np.zeros(len(present), np.int32)
    lut[uniq] = np.arange(len(uniq), dtype=np.int32)
    return uniq, lut[key]


def _attrs(n: int, items: list[tuple[str, pa.Array]]) -> pa.Array:
    """A map column whose every row has the keys of ``items`` in order, with their values."""
    k = len(items)
    values = pa.concat_arrays([v.cast(pa.string()) for _, v in items])
    order = (np.arange(n)[:, None] + np.arange(k)[None, :] * n).ravel()
    return _map(n, [key for key, _ in items], values.take(numeric_column(order, pa.int64())))


def _int_attrs(keys: list[str], columns: list[np.ndarray]) -> pa.Array:
    """Like :func:`_attrs` for integer values only: the (rows, keys) matrix read row by row is
    already in map order, so one cast makes every value (the API calls' path: most records)."""
    n = len(columns[0]) if columns else 0
    matrix = np.empty((n, len(keys)), np.int64)
    for j, c in enumerate(columns):
        matrix[:, j] = c
    return _map(n, keys, _strings(matrix.ravel()))


def _map(n: int, keys: list[str], values: pa.Array) -> pa.Array:
    k = len(keys)
    offsets = numeric_column(np.arange(0, (n + 1) * k, k, dtype=np.int32), pa.int32())
    key_column = string_column(keys).take(numeric_column(np.tile(np.arange(k), n), pa.int64()))
    return pa.MapArray.from_arrays(offsets, key_column, values, type=ATTRS)


def _table(
    *,
    span_id: np.ndarray,
    parent: np.ndarray,
    pid: np.ndarray,
    tid: np.ndarray,
    lane: pa.Array,
    category: str,
    name: pa.Array,
    start: np.ndarray,
    end: np.ndarray,
    depth: np.ndarray,
    attrs: pa.Array,
) -> pa.Table:
    n = len(span_id)
    return columns_to_table(
        {
            "span_id": pa.array(span_id, pa.uint64()),
            "parent_span_id": pa.array(parent, pa.uint64()),
            "pid": pa.array(pid.astype(np.uint32), pa.uint32()),
            "tid": pa.array(tid, pa.uint64()),
            "lane": lane,
            "category": _dictionary(np.zeros(n, np.int32), [category]),
            "name": name,
            "start_ns": pa.array(start, pa.int64()),
            "end_ns": pa.array(end, pa.int64()),
            "depth": pa.array(depth.astype(np.uint16), pa.uint16()),
            "attrs": attrs,
        }
    )


def api_table(
    r: dict[str, np.ndarray],
    pid: np.ndarray,
    tid: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    ids: np.ndarray,
    parent: np.ndarray,
    depth: np.ndarray,
) -> pa.Table:
    n = len(r["kind"])
    driver = r["kind"] == act.DRIVER
    key = r["code"].astype(np.int64) * 2 + driver
    uniq, codes = _small_codes(key)
    names = [
        (DRIVER if k & 1 else RUNTIME).get(int(k >> 1), f"{'cu' if k & 1 else 'cuda'}Api#{k >> 1}")
        for k in uniq
    ]
    failed = r["ret"] != 0  # the return value only where a call failed: rare, and kept short
    keys = ["correlation", "cbid", "return"]
    columns = [r["correlation"], r["code"], r["ret"]]
    attrs = _int_attrs(keys[:2], columns[:2])
    if failed.any():
        rows = np.flatnonzero(failed)
        bad = _int_attrs(keys, [c[rows] for c in columns])
        attrs = _replace_rows(attrs, rows, bad)
    return _table(
        span_id=ids,
        parent=parent,
        pid=pid,
        tid=tid,
        lane=_dictionary(np.zeros(n, np.int32), [API_LANE]),
        category=CUDA_API,
        name=_dictionary(codes.ravel(), names),
        start=start,
        end=end,
        depth=depth,
        attrs=attrs,
    )


def _replace_rows(attrs: pa.Array, rows: np.ndarray, other: pa.Array) -> pa.Array:
    """``attrs`` with the maps at ``rows`` replaced by ``other``'s, in order."""
    n = len(attrs)
    source = np.arange(n)
    source[rows] = n + np.arange(len(rows))
    return pa.concat_arrays([attrs, other]).take(numeric_column(source, pa.int64()))


def _lanes(device: np.ndarray, stream: np.ndarray, sync_type: np.ndarray | None) -> pa.Array:
    """``gpu<d>/stream<s>``; a context-wide synchronization on ``gpu<d>/sync``."""
    stream = stream.astype(np.int64)
    if sync_type is not None:
        stream = np.where(stream == act.NONE_U32, -1, stream)
    key = device.astype(np.int64) * (1 << 33) + stream + 1
    uniq, codes = np.unique(key, return_inverse=True)  # few lanes, but keys are wide
    labels = []
    for k in uniq:
        d, s = int(k) >> 33, (int(k) & ((1 << 33) - 1)) - 1
        gpu = "gpu" if d == act.NONE_U32 else f"gpu{d}"
        labels.append(f"{gpu}/sync" if s < 0 else f"{gpu}/stream{s}")
    return _dictionary(codes.ravel(), labels)


def _coded(values: np.ndarray, label: dict[int, str], fmt: str) -> pa.Array:
    uniq, codes = _small_codes(values)
    return _dictionary(codes.ravel(), [fmt.format(label.get(int(u), str(int(u)))) for u in uniq])


def device_table(
    category: str,
    r: np.ndarray,
    pid: np.ndarray,
    tid: np.ndarray,
    device: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    ids: np.ndarray,
    parent: np.ndarray,
    names: dict[int, str],
) -> pa.Table:
    n = len(r)
    common = [
        ("correlation", _strings(r["correlation"])),
        ("device", _strings(device.astype(np.int64))),
        ("context", _strings(r["context"])),
        ("stream", _strings(r["stream"])),
    ]
    dur = end - start
    if category == KERNEL:
        uniq, codes = _small_codes(r["code"])
        labels = [demangle(names.get(int(u), f"kernel#{int(u)}")) for u in uniq]
        name = _dictionary(codes.ravel(), labels)
        smem = r["static_smem"].astype(np.int64) + r["dynamic_smem"]
        items = [
            *common,
            ("registers per thread", _strings(r["registers"])),
            ("shared memory", _strings(smem)),
            ("static shared memory", _strings(r["static_smem"])),
            ("dynamic shared memory", _strings(r["dynamic_smem"])),
            ("grid", _triples(r["grid"])),
            ("block", _triples(r["block"])),
        ]
    elif category == CUDA_SYNC:
        name = _coded(r["sub"], act.SYNC_TYPES, "{}")
        items = common
    else:
        if category == MEMCPY:
            key = (
                r["sub"].astype(np.int64) << 16
                | r["src_kind"].astype(np.int64) << 8
                | r["dst_kind"]
            )
            uniq, codes = _small_codes(key)
            labels = [
                "Memcpy {} ({} -> {})".format(
                    act.MEMCPY_KINDS.get(int(k) >> 16, "?"),
                    act.MEMORY_KINDS.get((int(k) >> 8) & 255, "?"),
                    act.MEMORY_KINDS.get(int(k) & 255, "?"),
                )
                for k in uniq
            ]
            name = _dictionary(codes.ravel(), labels)
        else:
            name = _coded(r["sub"], act.MEMORY_KINDS, "Memset ({})")
        bandwidth = np.divide(
            r["bytes"].astype(np.float64), dur, out=np.zeros(n), where=dur > 0
        )  # bytes per ns is GB/s
        items = [
            *common,
            ("bytes", _strings(r["bytes"])),
            ("memory bandwidth (GB/s)", _strings(bandwidth)),
        ]
    sync_type = r["sub"] if category == CUDA_SYNC else None
    return _table(
        span_id=ids,
        parent=parent,
        pid=pid,
        tid=tid if category == CUDA_SYNC else np.zeros(n, np.uint64),
        lane=_lanes(device, r["stream"], sync_type),
        category=category,
        name=name,
        start=start,
        end=end,
        depth=np.zeros(n, np.int64),
        attrs=_attrs(n, items),
    )


def _triples(v: np.ndarray) -> pa.Array:
    """``[x, y, z]`` strings, as PyTorch's profiler writes grid and block."""
    x, y, z = (_strings(v[:, i]) for i in range(3))
    inner = pc.binary_join_element_wise(x, y, z, ", ")
    return pc.binary_join_element_wise("[", inner, "]", "")
