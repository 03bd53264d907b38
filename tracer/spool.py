"""Spool files: the recorder's output and the ingest's input.

One file per flush and kind, written as an Arrow IPC stream to a temporary name and renamed into
place, so a killed process leaves only whole files (and perhaps a ``.tmp`` that ingest ignores).
Each file's schema metadata says which run, host and process it belongs to; ingest needs nothing
else. Readers keep every batch they can read from a truncated or corrupt file and say what they
skipped.
"""

from __future__ import annotations

import itertools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from gpu_trace.tracer.records import SCHEMAS

log = logging.getLogger(__name__)

SPOOL_DIR = "spool"
SUFFIX = ".arrow"


def spool_dir(run_dir: Path) -> Path:
    return Path(run_dir) / SPOOL_DIR


class SpoolWriter:
    """Writes the tables of one process into ``<run_dir>/spool``."""

    def __init__(self, run_dir: Path, meta: dict[str, str]) -> None:
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
        with pa.OSFile(str(tmp), "wb") as sink, ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=64 * 1024)
        os.replace(tmp, self.dir / name)
        return self.dir / name


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
    meta = {k.decode(): v.decode() for k, v in raw.items()}
    kind = meta.get("kind", kind)
    batches: list[pa.RecordBatch] = []
    problem = None
    while True:
        try:
            batches.append(reader.read_next_batch())
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError, pa.ArrowException) as exc:
            problem = f"truncated or corrupt after {sum(b.num_rows for b in batches)} rows: {exc}"
            break
    table = pa.Table.from_batches(batches, schema=reader.schema) if batches else None
    return SpoolFile(path, kind, meta, table, problem=problem)


def list_spool(run_dir: Path) -> list[Path]:
    """Whole spool files of a run, oldest first (temporary files are ignored)."""
    d = spool_dir(run_dir)
    if not d.is_dir():
        return []
    files = [p for p in d.iterdir() if p.suffix == SUFFIX and not p.name.startswith(".")]
    return sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name))
