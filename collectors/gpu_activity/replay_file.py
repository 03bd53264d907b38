"""Recorded CUPTI records (JSON lines) as raw activity records: the seam for machines without a GPU.

A replay file holds one JSON object per CUPTI activity record, with the attribute names NVIDIA's
``cupti-python`` gives them (``kind`` as its number, ``start``/``end`` in CUPTI's nanoseconds,
``correlation_id``, ``thread_id``...); ``tests/data/cupti-h100-lm.jsonl.gz`` is one, recorded on
an H100 (``python -m gpu_trace.collectors.gpu_activity record-replay`` makes more on a GPU
machine). This module fills the same :data:`~.activity.RECORD` array that the injection library
writes, so a replayed file and a live capture take the same road from there on: activity file,
conversion, spans.
"""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import numpy as np

from gpu_trace.collectors.gpu_activity import activity as act

log = logging.getLogger(__name__)

#: cupti-python attribute -> RECORD field, for the scalar fields that map one to one.
_SCALARS = {
    "kind": "kind",
    "device_id": "device",
    "start": "start",
    "end": "end",
    "correlation_id": "correlation",
    "context_id": "context",
    "stream_id": "stream",
    "process_id": "pid",
    "thread_id": "tid",
    "return_value": "ret",
    "bytes": "bytes",
    "registers_per_thread": "registers",
    "static_shared_memory": "static_smem",
    "dynamic_shared_memory": "dynamic_smem",
    "src_kind": "src_kind",
    "dst_kind": "dst_kind",
}
#: Where each kind keeps what RECORD calls ``sub``.
_SUB = {act.MEMCPY: "copy_kind", act.MEMSET: "memory_kind", act.SYNCHRONIZATION: "type"}


def read_replay(path: Path) -> tuple[np.ndarray, dict[int, str], list[str]]:
    """Records, kernel names (by the id in ``code``) and problems (lines skipped, one each)."""
    opener = gzip.open if Path(path).suffix == ".gz" else open
    rows: list[dict] = []
    problems: list[str] = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    problems.append(f"{Path(path).name}:{lineno}: not JSON ({exc}); skipped")
                    continue
                if not isinstance(row, dict) or row.get("kind") not in act.KINDS:
                    continue  # kinds we do not convert (markers, external correlation)
                rows.append(row)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        problems.append(
            f"{Path(path).name}: truncated or unreadable after {len(rows)} records ({exc})"
        )
    records = act.empty(len(rows))
    names: dict[str, int] = {}
    for i, row in enumerate(rows):
        try:
            _fill(records[i], row, names)
        except (TypeError, ValueError, OverflowError) as exc:
            problems.append(f"{Path(path).name}: record {i}: {exc}; skipped")
            records[i]["kind"] = 0
    keep = records["kind"] != 0
    records = records[keep]
    # CUPTI names the process only on API records; a replay file is one process's records.
    api = np.isin(records["kind"], act.API_KINDS)
    if api.any():
        pids, counts = np.unique(records["pid"][api], return_counts=True)
        records["pid"][records["pid"] == 0] = pids[np.argmax(counts)]
    return records, {v: k for k, v in names.items()}, problems


def _fill(rec: np.void, row: dict, names: dict[str, int]) -> None:
    for src, dst in _SCALARS.items():
        v = row.get(src)
        if v is not None:
            rec[dst] = v
    kind = int(row["kind"])
    sub = _SUB.get(kind)
    if sub is not None and row.get(sub) is not None:
        rec["sub"] = row[sub]
    if kind in act.API_KINDS:
        rec["code"] = row.get("cbid", 0)
    elif kind == act.CONCURRENT_KERNEL:
        rec["code"] = names.setdefault(str(row.get("name") or ""), len(names))
        rec["grid"] = (row.get("grid_x", 0), row.get("grid_y", 0), row.get("grid_z", 0))
        rec["block"] = (row.get("block_x", 0), row.get("block_y", 0), row.get("block_z", 0))
    if kind == act.SYNCHRONIZATION:
        rec["device"] = act.NONE_U32  # CUPTI's sync records name a context, not a device
