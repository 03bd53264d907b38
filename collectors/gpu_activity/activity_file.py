"""The GPU activity spool file: what the injection library writes and the replay tool writes.

One file per process, ``<run_dir>/spool/gpu_activity-<pid>-<tag>.bin``, appended to by CUPTI's
buffer-completed callback (never a program thread). Arrow is out of reach from C without a
dependency, so the file is a plain chunked binary format, with the same guarantee as the Arrow
spool (``tracer/spool.py``): every chunk carries a CRC-32 of its payload, a damaged chunk is
skipped and named, a truncated tail (a killed process) loses only the chunk being written.

Layout: the 8-byte magic ``GTACT001``, then chunks, each a little-endian header ``u32 type, u32
count, u32 payload bytes, u32 crc32(payload)`` and its payload:

- ``RECORDS``: ``count`` records of :data:`~.activity.RECORD`;
- ``NAMES``: ``count`` entries ``u32 id, u32 length, bytes``: kernel names (records' ``code``);
- ``ANCHORS``: ``count`` pairs ``i64 cupti_ns, i64 monotonic_ns`` read together; the records'
  times are CUPTI's, put on ``CLOCK_MONOTONIC`` by these (a pair with equal values: CUPTI already
  reads ``CLOCK_MONOTONIC``, through ``cuptiActivityRegisterTimestampCallback``);
- ``STATS``: ``u64 dropped`` records CUPTI reported dropped (``cuptiActivityGetNumDroppedRecords``)
  since the last stats chunk, ``u64 records`` written since;
- ``NOTE``: one UTF-8 line the library wants the run to show (e.g. another profiler holds CUPTI).
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gpu_trace.collectors.gpu_activity.activity import RECORD

MAGIC = b"GTACT001"
HEADER = struct.Struct("<IIII")
RECORDS, NAMES, ANCHORS, STATS, NOTE = 1, 2, 3, 4, 5
PREFIX = "gpu_activity-"
SUFFIX = ".bin"
#: Rows per records chunk the Python writer makes (the C library writes one per CUPTI buffer).
CHUNK_RECORDS = 64 * 1024


@dataclass
class ActivityData:
    """Everything read from one or more activity files."""

    records: np.ndarray = field(default_factory=lambda: np.zeros(0, RECORD))
    names: dict[int, str] = field(default_factory=dict)
    anchors: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    dropped: int = 0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def activity_files(spool: Path) -> list[Path]:
    """A spool directory's activity files, by name."""
    if not spool.is_dir():
        return []
    return sorted(p for p in spool.iterdir() if p.name.startswith(PREFIX) and p.suffix == SUFFIX)


def _chunk(kind: int, count: int, payload: bytes) -> bytes:
    return HEADER.pack(kind, count, len(payload), zlib.crc32(payload)) + payload


def encode(
    records: np.ndarray,
    names: dict[int, str] | None = None,
    anchors: list[tuple[int, int]] | None = None,
    dropped: int = 0,
    notes: list[str] | None = None,
) -> bytes:
    """A whole activity file's bytes (what the C library writes over a run, in one piece)."""
    out = [MAGIC]
    if anchors:
        out.append(_chunk(ANCHORS, len(anchors), np.asarray(anchors, "<i8").tobytes()))
    if names:
        blob = b"".join(
            struct.pack("<II", i, len(b)) + b
            for i, b in ((i, n.encode("utf-8", "surrogateescape")) for i, n in names.items())
        )
        out.append(_chunk(NAMES, len(names), blob))
    records = np.ascontiguousarray(records, dtype=RECORD)
    for lo in range(0, len(records), CHUNK_RECORDS):
        part = records[lo : lo + CHUNK_RECORDS]
        out.append(_chunk(RECORDS, len(part), part.tobytes()))
    for note in notes or ():
        out.append(_chunk(NOTE, 1, note.encode()))
    out.append(_chunk(STATS, 1, struct.pack("<QQ", dropped, len(records))))
    return b"".join(out)


def write(path: Path, data: bytes) -> Path:
    """Write a file atomically (a temporary renamed into place, like the Arrow spool)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def read(paths: list[Path]) -> ActivityData:
    """Read every chunk that reads and sums right; the rest are named in ``problems``."""
    data = ActivityData()
    parts: list[np.ndarray] = []
    anchors: list[np.ndarray] = []
    for path in paths:
        _read_one(path, data, parts, anchors)
    if parts:
        data.records = np.concatenate(parts)
    if anchors:
        data.anchors = np.concatenate(anchors)
    return data


def _read_one(path: Path, data: ActivityData, parts: list[np.ndarray], anchors: list) -> None:
    try:
        blob = path.read_bytes()
    except OSError as exc:
        data.problems.append(f"{path.name}: unreadable ({exc})")
        return
    if not blob.startswith(MAGIC):
        data.problems.append(f"{path.name}: not a GPU activity file (bad magic); skipped")
        return
    pos, skipped, index = len(MAGIC), [], 0
    while pos < len(blob):
        if pos + HEADER.size > len(blob):
            data.problems.append(f"{path.name}: truncated after chunk {index}; the rest is kept")
            break
        kind, count, size, crc = HEADER.unpack_from(blob, pos)
        payload = blob[pos + HEADER.size : pos + HEADER.size + size]
        if len(payload) < size:
            data.problems.append(f"{path.name}: truncated in chunk {index}; the rest is kept")
            break
        pos += HEADER.size + size
        if zlib.crc32(payload) != crc:
            skipped.append(f"chunk {index}: checksum mismatch")
        else:
            why = _take(kind, count, payload, data, parts, anchors)
            if why:
                skipped.append(f"chunk {index}: {why}")
        index += 1
    if skipped:
        data.problems.append(f"{path.name}: skipped " + "; ".join(skipped))


def _take(
    kind: int,
    count: int,
    payload: bytes,
    data: ActivityData,
    parts: list[np.ndarray],
    anchors: list,
) -> str | None:
    if kind == RECORDS:
        if count * RECORD.itemsize != len(payload):
            return f"{count} records in {len(payload)} bytes"
        parts.append(np.frombuffer(payload, dtype=RECORD))
    elif kind == ANCHORS:
        if count * 16 != len(payload):
            return f"{count} anchors in {len(payload)} bytes"
        anchors.append(np.frombuffer(payload, dtype="<i8").reshape(count, 2))
    elif kind == NAMES:
        pos = 0
        for _ in range(count):
            ident, length = struct.unpack_from("<II", payload, pos)
            data.names[ident] = payload[pos + 8 : pos + 8 + length].decode("utf-8", "replace")
            pos += 8 + length
    elif kind == STATS:
        dropped, _records = struct.unpack_from("<QQ", payload)
        data.dropped += dropped
    elif kind == NOTE:
        data.notes.append(payload.decode("utf-8", "replace"))
    else:
        return f"unknown chunk type {kind}"
    return None
