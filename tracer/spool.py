"""Spool files: the recorder's output and the ingest's input.

One file per flush and kind, written as an Arrow IPC stream to a temporary name and renamed into
place, so a killed process leaves only whole files (and perhaps a ``.tmp`` that ingest ignores).
Each file's schema metadata says which run, host and process it belongs to; ingest needs nothing
else.

Every record batch carries a CRC-32 of its contents in its IPC custom metadata (``crc32``; the
schema metadata says ``checksum: crc32``), so the files stay plain Arrow streams any Arrow tool
reads. The sum is over the batch's logical contents (values, offsets rebased to 0, dictionaries),
not its bytes on disk, so it does not depend on how Arrow lays out or slices buffers. Readers
keep every batch that reads and sums right, less its impossible rows (:func:`~gpu_trace.tracer.
records.impossible_rows`); the others are skipped and named with their index and reason. Files
from before checksums (no ``checksum`` key) are checked for values only, and a batch of theirs
with an impossible row is skipped whole (without a sum, damage and truth look alike).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from gpu_trace.tracer.records import SCHEMAS, impossible_rows

log = logging.getLogger(__name__)

SPOOL_DIR = "spool"
SUFFIX = ".arrow"
#: Rows per record batch: the unit a checksum covers and a damaged file loses.
BATCH_ROWS = 64 * 1024
#: Schema metadata key naming the per-batch checksum, and the batches' custom metadata key.
CHECKSUM = "checksum"
CRC32 = b"crc32"


def spool_dir(run_dir: Path) -> Path:
    return Path(run_dir) / SPOOL_DIR


def _open_file(path: str) -> pa.NativeFile:
    return pa.OSFile(path, "wb")


class SpoolWriter:
    """Writes the tables of one process into ``<run_dir>/spool``.

    A write that fails (a full disk) raises and leaves nothing behind: no file, no temporary.
    ``open_file`` opens the temporary for writing (a seam: tests give one whose disk fills).
    """

    def __init__(
        self,
        run_dir: Path,
        meta: dict[str, str],
        *,
        open_file: Callable[[str], pa.NativeFile] = _open_file,
    ) -> None:
        self._open_file = open_file
        self.dir = spool_dir(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.meta = dict(meta)
        self.pid = int(meta["pid"])
        self._seq = itertools.count()
        # A random tag keeps names unique when a pid is reused within one run.
        self._tag = os.urandom(3).hex()

    def write(self, kind: str, table: pa.Table) -> Path | None:
        if table.num_rows == 0:
            return None
        schema = SCHEMAS.get(kind, table.schema)
        table = table.cast(schema) if kind in SCHEMAS else table
        meta = {**self.meta, "kind": kind}
        table = table.replace_schema_metadata(
            {k.encode(): str(v).encode() for k, v in meta.items()}
        )
        name = f"{kind}-{self.pid}-{self._tag}-{next(self._seq):06d}{SUFFIX}"
        tmp = self.dir / f".{name}.tmp"
        schema = table.schema.with_metadata({**table.schema.metadata, CHECKSUM.encode(): CRC32})
        try:
            with self._open_file(str(tmp)) as sink, ipc.new_stream(sink, schema) as writer:
                for batch in table.to_batches(max_chunksize=BATCH_ROWS):
                    sums = {CRC32: str(checksum(batch)).encode()}
                    writer.write_batch(batch, custom_metadata=sums)
            os.replace(tmp, self.dir / name)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return self.dir / name


def checksum(batch: pa.RecordBatch) -> int:
    """CRC-32 of a batch's logical contents: equal for equal values however they are laid out."""
    crc = zlib.crc32(str(batch.num_rows).encode())
    for column in batch.columns:
        crc = _feed(crc, column)
    return crc


def _feed(crc: int, arr: pa.Array) -> int:
    # Buffers are read with NumPy, never through pyarrow's to_numpy/__array__ (nor pa.array):
    # those ask whether pandas is installed and import it (about 350 modules), which the flusher
    # did at its first flush in the middle of the traced program (records.py says why not).
    t = arr.type
    crc = zlib.crc32(f"{t}:{len(arr)}:{arr.null_count};".encode(), crc)
    if arr.null_count:
        crc = zlib.crc32(np.packbits(_validity(arr)).tobytes(), crc)
    if pa.types.is_dictionary(t):
        return _feed(_feed(crc, arr.indices), arr.dictionary)
    if pa.types.is_list(t) or pa.types.is_map(t):
        bounds = (
            np.frombuffer(arr.buffers()[1], np.int32, len(arr) + 1, arr.offset * 4)
            if len(arr)
            else np.zeros(1, np.int32)
        )
        first, last = int(bounds[0]), int(bounds[-1])
        crc = zlib.crc32((bounds - first).astype(np.int32).tobytes(), crc)
        values = arr.values.slice(first, last - first)
        children = values.flatten() if pa.types.is_struct(values.type) else [values]
        for child in children:
            crc = _feed(crc, child)
        return crc
    if pa.types.is_string(t) or pa.types.is_binary(t):
        bufs = arr.buffers()
        offsets = (
            np.frombuffer(bufs[1], np.int32, len(arr) + 1, arr.offset * 4)
            if len(arr)
            else np.empty(0, np.int32)
        )
        first, last = (int(offsets[0]), int(offsets[-1])) if len(arr) else (0, 0)
        crc = zlib.crc32((np.asarray(offsets, np.int64) - first).astype(np.int32).tobytes(), crc)
        if last > first:
            crc = zlib.crc32(memoryview(bufs[2])[first:last], crc)
        return crc
    if pa.types.is_primitive(t) and t.bit_width % 8 == 0 and len(arr):
        width = t.bit_width // 8
        return zlib.crc32(
            memoryview(arr.buffers()[1])[arr.offset * width : (arr.offset + len(arr)) * width], crc
        )
    return zlib.crc32(repr(arr.to_pylist()).encode(), crc)  # no spool column is of another type


def _validity(arr: pa.Array) -> np.ndarray:
    """Whether each value of ``arr`` (which has nulls) is valid, as booleans, from its bitmap."""
    bitmap = arr.buffers()[0]
    if bitmap is None:  # nulls without a bitmap (a null-typed or union column): none valid
        return np.zeros(len(arr), dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + len(arr)].astype(bool)


@dataclass
class SpoolFile:
    """What a reader got out of one spool file."""

    path: Path
    kind: str
    meta: dict[str, str]
    table: pa.Table | None
    problem: str | None = None
    skipped_batches: int = 0
    notes: list[str] = field(default_factory=list)


def read_spool_file(path: Path) -> SpoolFile:
    """Read every batch that can be read; a damaged tail is reported, not raised."""
    path = Path(path)
    kind = path.name.split("-", 1)[0]
    try:
        reader = ipc.open_stream(pa.memory_map(str(path), "r"))
    except (pa.ArrowInvalid, OSError, pa.ArrowException) as exc:
        return SpoolFile(path, kind, {}, None, problem=f"unreadable header: {exc}")
    raw = reader.schema.metadata or {}
    meta = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}
    kind = meta.get("kind", kind)
    summed = meta.get(CHECKSUM) == CRC32.decode()
    batches: list[pa.RecordBatch] = []
    notes: list[str] = []
    skipped = 0
    problem = None
    for index in itertools.count():
        try:
            batch, custom = reader.read_next_batch_with_custom_metadata()
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError, pa.ArrowException) as exc:
            problem = f"truncated or corrupt after {sum(b.num_rows for b in batches)} rows: {exc}"
            break
        reason = _damaged(batch, custom, summed)
        impossible = None
        if reason is None:
            try:
                impossible = impossible_rows(kind, batch)
            except (pa.ArrowException, ValueError) as exc:
                reason = f"unreadable ({exc})"
        if impossible is not None:
            bad, why = impossible
            if not summed or bad.all():  # without a sum, damage and truth look alike
                reason = why
            else:  # the batch is as written: only its impossible rows go
                notes.append(f"batch {index}: {int(bad.sum())} of {batch.num_rows} rows: {why}")
                batch = batch.filter(pa.array(~bad))
        if reason:
            skipped += 1
            notes.append(f"batch {index} ({batch.num_rows} rows): {reason}")
        else:
            batches.append(batch)
    if notes:
        what = "skipped " + "; ".join(notes)
        problem = what if problem is None else f"{what}; {problem}"
    table = pa.Table.from_batches(batches, schema=reader.schema) if batches else None
    return SpoolFile(path, kind, meta, table, problem, skipped_batches=skipped, notes=notes)


def _damaged(batch: pa.RecordBatch, custom: pa.KeyValueMetadata | None, summed: bool) -> str | None:
    """Why a batch read from a spool file is not what was written, or None."""
    if summed:
        expected = (custom or {}).get(CRC32)
        if expected is None:
            return "no checksum"
        try:
            actual = checksum(batch)
        except (pa.ArrowException, ValueError, IndexError, TypeError) as exc:
            return f"unreadable ({exc})"
        if str(actual).encode() != expected:
            return "checksum mismatch"
    else:  # an older spool: no sums, so make sure Arrow can walk every value before using them
        try:
            batch.validate(full=True)
        except pa.ArrowException as exc:
            return f"invalid ({exc})"
    return None


def count_rows(path: Path) -> int | None:
    """Rows a spool file holds, read from its batches' headers (memory-mapped, not checked or
    decoded); None when the file does not read to its end. A count independent of ingest's, to
    check the store against before a spool is removed."""
    try:
        with pa.memory_map(str(path), "r") as source:
            reader = ipc.open_stream(source)
            rows = 0
            while True:
                try:
                    rows += reader.read_next_batch().num_rows
                except StopIteration:
                    return rows
    except (pa.ArrowInvalid, OSError, pa.ArrowException):
        return None


def list_spool(run_dir: Path) -> list[Path]:
    """Whole spool files of a run, oldest first (temporary files are ignored)."""
    d = spool_dir(run_dir)
    if not d.is_dir():
        return []
    files = [p for p in d.iterdir() if p.suffix == SUFFIX and not p.name.startswith(".")]
    return sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name))
