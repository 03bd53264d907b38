"""What a Chrome trace export writes around its events: the header before them (the rank in
``distributedInfo``, the run's GPUs in ``deviceProperties``) and the trailer after them (the
``gpu_trace`` object: the run's metadata, the time base, counts, and what each Chrome pid and tid
stands for, which ``gpu-trace import`` reads back; ``baseTimeNanoseconds`` where the run has a
wall-clock anchor).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from gpu_trace.export.json_fragments import dumps

__all__ = ["RunRow", "header", "trailer"]

#: The run's row as the store returns it (``run_id``, ``trace_id``, ``started_ns``, ``hosts``,
#: ``attrs``...; attrs a dict or (key, value) pairs).
RunRow = dict[str, Any]


def header(run: RunRow, *, rank: int, world_size: int, backend: str) -> str:
    """The file's start, up to the opening of ``traceEvents``."""
    # One key per line, "rank" first with a space after the colon: HTA finds a file's rank
    # with the regex '"rank":\s+(\d+)' over the first lines of the file.
    return (
        "{\n"
        f'"distributedInfo": {{"rank": {rank}, "world_size": {world_size}'
        + (f', "backend": {dumps(backend)}' if backend else "")
        + "},\n"
        '"schemaVersion": 1,\n'
        '"displayTimeUnit": "ns",\n'
        f'"deviceProperties": {_device_properties(run)},\n'
        f'"traceName": {dumps(str(run.get("run_id", "")))},\n'
        '"traceEvents": [\n'
    )


def _device_properties(run: RunRow) -> str:
    """The run's GPUs as Kineto lists them: the ``device_properties`` attribute (what an
    imported trace had), else the names NVML gave a recorded run (``gpus``:
    ``gpu0=NVIDIA H100 80GB HBM3,...``) as ``{"id", "name"}``; ``[]`` without either. HTA
    reads the GPUs' properties from here."""
    attrs = run.get("attrs") or {}
    if isinstance(attrs, list):
        attrs = dict(attrs)
    try:
        props = json.loads(attrs.get("device_properties", "[]"))
    except (TypeError, ValueError):
        props = []
    if not props and attrs.get("gpus"):
        for entry in str(attrs["gpus"]).split(","):
            key, _, name = entry.partition("=")
            index = key.strip().removeprefix("gpu")
            if index.isdigit() and name:
                props.append({"id": int(index), "name": name.strip()})
    return dumps(props if isinstance(props, list) else [])


def trailer(
    run: RunRow,
    *,
    base_ns: int | None,
    stats: Mapping[str, object],
    flow_window: int,
    kineto: bool,
    thread_rows: list[dict[str, str | int]],
    process_rows: list[dict[str, str | int | bool]],
    track_rows: list[dict[str, int]],
) -> str:
    """The file's end, from the close of ``traceEvents``: ``stats`` are the exporter's counts,
    the rows what :class:`~gpu_trace.export.tracks.Tracks` noted and the run's threads rows."""
    base = base_ns if base_ns is not None else 0
    info = {
        "run_id": run.get("run_id", ""),
        "trace_id": run.get("trace_id", ""),
        "command": run.get("command", ""),
        "hosts": list(run.get("hosts") or []),
        "status": run.get("status", ""),
        "time_base_ns": base,
        "time_base": "ts 0 is time_base_ns on the run's reference clock (CLOCK_MONOTONIC ns)",
        "ts_unit": "us",
        "spans": stats["spans"],
        "marks": stats["marks"],
        "counters": stats["counters"],
        "flows": stats["flows"],
        "flow_window": flow_window,
        "complete": stats["complete"],
    }
    attrs = run.get("attrs") or {}
    if isinstance(attrs, list):  # a map as the store may return it: (key, value) pairs
        attrs = dict(attrs)
    # What `gpu-trace import` needs to store the run again as it was (docs/import.md).
    info.update(
        {
            "categories": "kineto" if kineto else "native",
            "started_ns": _int_or_zero(run.get("started_ns")),
            "ended_ns": _int_or_zero(run.get("ended_ns")),
            "attrs": {str(k): str(v) for k, v in attrs.items()},
            "threads": thread_rows,
            "processes": process_rows,
            "tracks": track_rows,
        }
    )
    tail = f'\n],\n"gpu_trace": {dumps(info)}'
    try:
        wall = base - int(attrs["anchor_mono_ns"]) + int(attrs["anchor_wall_ns"])
        tail += f',\n"baseTimeNanoseconds": {wall}'
    except (KeyError, TypeError, ValueError):
        pass
    return tail + "\n}\n"


def _int_or_zero(value: object) -> int:
    """A run's time as an integer (a store's number, or its text); 0 where it has none."""
    if isinstance(value, (int, np.integer, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            return int(value)
    return 0
