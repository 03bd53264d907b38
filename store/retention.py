"""What stays on disk after a run is stored: spool removal after a verified ingest, and the run
directories `gpu-trace rm` and `gpu-trace gc` may remove.

A run's spool is its data until the store holds it: after an ingest, :func:`release_spool` checks
that every spool file is logged ``done`` in the store's ``ingest_log`` (same name and size), that
no file had damaged batches or other problems, that each file holds as many rows (counted from
the file again) as its ingest logged, and that the store holds at least as many rows of the run
per table as the log says the files gave (the files' rows were read with their CRC-32s checked);
only then are those files removed. ``run.json``, ``stats/`` and a small
``ingested.json`` (which store, how many rows, how many bytes removed) stay, so a later `gpu-trace
ingest` and `gpu-trace gc` know the run was stored. Anything short of that keeps every file and
says why.

Only directories under ``GPU_TRACE_HOME/runs`` are ever removed from (the repository's
``sample_traces/runs``, or a ``--run-dir`` elsewhere, stay), and never one whose run is still
recording: its ``run.json`` says ``running`` and its recorder is alive, or cannot be checked (run
on another host) (:func:`~gpu_trace.tracer.run.recorder_died`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpu_trace import config
from gpu_trace.tracer.files import replace_text
from gpu_trace.tracer.records import SCHEMAS
from gpu_trace.tracer.run import RunInfo, recorder_died
from gpu_trace.tracer.spool import count_rows, list_spool, spool_dir

if TYPE_CHECKING:
    from gpu_trace.store.client import Store

log = logging.getLogger(__name__)

#: The marker a run directory keeps once its spool was removed after a verified ingest.
INGESTED_FILE = "ingested.json"


@dataclass
class SpoolRelease:
    """What :func:`release_spool` did with one run directory's spool."""

    run_dir: Path
    removed_files: int = 0
    removed_bytes: int = 0
    #: Why the spool was kept ("" when it was removed or there was none).
    kept: str = ""
    rows: dict[str, int] = field(default_factory=dict)


def release_spool(
    store: Store, run_dir: str | Path, *, keep: bool | None = None, dry_run: bool = False
) -> SpoolRelease:
    """Remove ``run_dir``'s spool files if the store verifiably holds what they held.

    Call after :func:`~gpu_trace.store.ingest.ingest` of the same directory into ``store``.
    ``keep`` (``--keep-spool``; default ``GPU_TRACE_KEEP_SPOOL``) keeps them. Never raises for what
    it finds (the reason is in :attr:`SpoolRelease.kept`); StoreError when the store cannot be
    asked, with every file kept. ``dry_run`` checks and counts what would go, removing nothing.
    """
    run_dir = Path(run_dir)
    release = SpoolRelease(run_dir)
    if config.keep_spool(keep):
        release.kept = "as asked (--keep-spool or GPU_TRACE_KEEP_SPOOL)"
        return release
    if not under_runs_dir(run_dir):
        release.kept = f"it is not under {config.runs_dir()}, where gpu-trace removes spools"
        return release
    try:
        info = RunInfo.load(run_dir)
    except (OSError, ValueError, TypeError) as exc:
        release.kept = f"its run.json cannot be read ({exc})"
        return release
    if is_live(info):
        release.kept = "the run is still recording"
        return release
    files = {p.name: p.stat().st_size for p in list_spool(run_dir)}
    if not files:
        return release  # nothing to remove (removed before, or the run recorded nothing)
    rows, problem = verify(store, info.run_id, files, spool_dir(run_dir))
    release.rows = rows
    if problem:
        release.kept = problem
        log.info("gpu-trace: %s: spool kept: %s", run_dir, problem)
        return release
    if dry_run:
        release.removed_files, release.removed_bytes = len(files), sum(files.values())
        return release
    removed_files, removed_bytes = _remove_files(run_dir, files)
    release.removed_files, release.removed_bytes = removed_files, removed_bytes
    marker = {
        "run_id": info.run_id,
        "store": store.target.display(),
        "rows": rows,
        "removed_files": removed_files,
        "removed_bytes": removed_bytes,
        "removed_at_ns": time.time_ns(),
    }
    try:
        replace_text(run_dir / INGESTED_FILE, json.dumps(marker, indent=2, sort_keys=True))
    except OSError as exc:  # the spool is stored and gone either way; only the note is missing
        log.warning("gpu-trace: %s not written: %s", run_dir / INGESTED_FILE, exc)
    return release


def verify(
    store: Store, run_id: str, files: dict[str, int], spool_dir_of: Path | None = None
) -> tuple[dict[str, int], str | None]:
    """Rows per kind that ``files`` (spool file name -> size) gave the store, per its
    ``ingest_log``, and why the store does not verifiably hold them all (None when it does).

    With ``spool_dir_of`` (the files' directory), each file's rows are also counted from the file
    itself and must equal what its ingest logged."""
    logged = store.query(
        """
        SELECT file, size, argMax(status, ingested_ns), argMax(kind, ingested_ns),
               argMax(rows, ingested_ns), argMax(problem, ingested_ns)
        FROM __db__.ingest_log WHERE run_id = {run_id:String} GROUP BY file, size
        """,
        {"run_id": run_id},
    ).result_rows
    entries = {(str(f), int(s)): (str(st), str(k), int(n), str(p)) for f, s, st, k, n, p in logged}
    rows = {kind: 0 for kind in SCHEMAS}
    damaged = 0
    for name, size in files.items():
        entry = entries.get((name, size))
        if entry is None or entry[0] != "done":
            return rows, f"{name} is not stored (ingest it again: gpu-trace ingest)"
        status, kind, n, problem = entry
        rows[kind] = rows.get(kind, 0) + n
        damaged += bool(problem)
        if not problem and spool_dir_of is not None:
            held = count_rows(spool_dir_of / name)
            if held != n:
                return rows, f"{name} holds {held} rows, its ingest stored {n}"
    if damaged:
        return rows, f"{damaged} spool file(s) had damaged or incomplete batches (see ingest)"
    stored = store.table_rows([run_id]).get(run_id, {})
    for kind, n in rows.items():
        if stored.get(kind, 0) < n:
            return rows, f"the store holds {stored.get(kind, 0)} of the spool's {n} {kind} rows"
    return rows, None


def _remove_files(run_dir: Path, files: dict[str, int]) -> tuple[int, int]:
    """Remove the verified spool files (and temporaries a killed writer left); a file that changed
    since it was verified stays, and so does the spool directory unless it is empty."""
    d = spool_dir(run_dir)
    count = size = 0
    for name, verified in files.items():
        path = d / name
        try:
            if path.stat().st_size != verified:
                continue
            path.unlink()
        except OSError:
            continue
        count += 1
        size += verified
    for tmp in d.glob(".*.tmp"):
        try:
            n = tmp.stat().st_size
            tmp.unlink()
        except OSError:
            continue
        size += n
    with contextlib.suppress(OSError):  # not empty (a file written since) or already gone
        d.rmdir()
    return count, size


# ---- run directories -------------------------------------------------------------------------


def under_runs_dir(path: Path) -> bool:
    """Whether ``path`` is a directory inside ``GPU_TRACE_HOME/runs`` (not the folder itself)."""
    try:
        runs = config.runs_dir().resolve()
        resolved = Path(path).resolve()
    except OSError:
        return False
    return resolved != runs and resolved.is_relative_to(runs)


def is_live(info: RunInfo) -> bool:
    """Whether a run may still be recording: ``running`` and its recorder not known to be gone
    (a recorder on another host, or one that is not named, counts as alive)."""
    return info.status == "running" and recorder_died(info) is None


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (their sizes; links are not followed)."""
    total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def run_dirs() -> dict[str, list[Path]]:
    """Run directories under ``GPU_TRACE_HOME/runs`` by run id (from ``run.json``, else the
    directory's name), in name order: one per run, several for a job whose records each wrote
    one (``record --job``: ``job-ID.HOST.PID``)."""
    out: dict[str, list[Path]] = {}
    root = config.runs_dir()
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.is_symlink():
            continue
        run_id = d.name
        with contextlib.suppress(OSError, ValueError, TypeError):
            run_id = RunInfo.load(d).run_id or d.name
        out.setdefault(run_id, []).append(d)
    return out


def remove_run_dir(path: Path) -> int:
    """Remove a run directory under ``GPU_TRACE_HOME/runs``; its bytes. ValueError for any other
    path (nothing else is ever removed)."""
    if not under_runs_dir(path) or Path(path).is_symlink():
        raise ValueError(f"{path} is not a run directory under {config.runs_dir()}")
    size = dir_bytes(path)
    shutil.rmtree(path)
    return size
