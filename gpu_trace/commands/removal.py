"""`gpu-trace rm` and `gpu-trace gc`: remove runs from the store and their run directories.

`rm RUN...` removes the named runs (ids, unique prefixes, ``last``) from the store and their
directories under GPU_TRACE_HOME/runs; every name is checked first, so one bad name removes
nothing. `gc` removes what is older than ``--older-than``: runs in the store with their
directories, spools of stored runs (``--spools-only`` keeps the runs), and directories of runs
that never reached the store. A run that may still be recording is never touched. Both print what
they removed with its size: a directory's bytes on disk, and a run's share of the store estimated
from ``system.parts`` (the tables' bytes times the run's share of their rows). On a terminal,
a progress line on stderr says what each is at (run directories looked at, runs, spools and
directories removed, of how many), cleared before every line they print.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gpu_trace import _format as fmt
from gpu_trace._progress import PhaseProgress
from gpu_trace.commands import CLIError, echo, err
from gpu_trace.commands.runs import checked_dsn, store_module
from gpu_trace.query import reads

if TYPE_CHECKING:
    from gpu_trace.store.client import Store
    from gpu_trace.tracer.run import RunInfo

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "": 86400}


def parse_age(text: str) -> int:
    """``30m``, ``12h``, ``7d``, ``2w`` (a bare number is days) as nanoseconds; ValueError if not."""
    m = _AGE.match(text or "")
    if not m:
        raise ValueError(f"--older-than takes a number and a unit (30m, 12h, 7d, 2w), got {text!r}")
    return int(float(m.group(1)) * _UNIT_S[m.group(2)] * 1_000_000_000)


@dataclass
class _Target:
    """One run to remove: its rows in the store and/or its run directory."""

    run_id: str
    in_store: bool = False
    #: Its run directories: one, none, or one per record of a job (``record --job``).
    run_dirs: list[Path] = field(default_factory=list)
    store_rows: int = 0
    store_bytes: int | None = None
    dir_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    def sizes(self, *, store: bool = True, directory: bool = True) -> str:
        parts = []
        if store and self.in_store:
            if self.store_bytes is None:
                parts.append(f"{fmt.count(self.store_rows)} rows in the store")
            else:
                parts.append(f"~{fmt.size(self.store_bytes)} in the store")
        if directory and self.run_dirs:
            parts.append(f"{fmt.size(self.dir_bytes)} in {self.where}")
        return ", ".join(parts) or "nothing on disk"

    @property
    def run_dir(self) -> Path | None:
        """The run's (first) directory: where its run.json says whether it still records."""
        return self.run_dirs[0] if self.run_dirs else None

    @property
    def where(self) -> str:
        first = str(self.run_dirs[0]) if self.run_dirs else ""
        return first if len(self.run_dirs) < 2 else f"{first} and {len(self.run_dirs) - 1} more"


def cmd_rm(args: argparse.Namespace) -> int:
    from gpu_trace.store import retention

    store_mod = store_module()
    dsn = checked_dsn(args.store)
    try:
        store = store_mod.Store(dsn)
    except store_mod.StoreError as exc:
        raise CLIError(str(exc)) from None
    with store:
        dirs = retention.run_dirs()
        targets: dict[str, _Target] = {}
        bad: list[str] = []
        for ref in args.runs:
            run_id = _resolve(store, ref, dirs, bad)
            if run_id is not None and run_id not in targets:
                targets[run_id] = _Target(run_id, run_dirs=dirs.get(run_id, []))
        if bad:
            raise CLIError("; ".join(bad) + "; nothing was removed")
        stored = reads.has_runs(store, list(targets))
        live = []
        for t in targets.values():
            t.in_store = t.run_id in stored
            why = _live(store, t)
            if why and not args.force:
                live.append(f"run {t.run_id} {why}")
        if live:
            raise CLIError("; ".join(live) + "; nothing was removed (--force removes it anyway)")
        # One run goes at once; many may take a while (a store delete and a directory each).
        with _Progress("rm" if len(targets) > 1 else None) as progress:
            progress("measuring", 0, None)
            _measure(store, list(targets.values()))
            for i, t in enumerate(targets.values()):
                progress("removing runs", i, len(targets))
                _remove(store, t, store_rows=True, directory=True)
                progress.say(f"removed run {t.run_id}: {t.sizes()}")
    _total("removed", list(targets.values()))
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from gpu_trace.store import retention
    from gpu_trace.tracer.run import RunInfo

    try:
        age_ns = parse_age(args.older_than)
    except ValueError as exc:
        raise CLIError(str(exc), 2) from None
    before = time.time_ns() - age_ns
    store_mod = store_module()
    dsn = checked_dsn(args.store)
    try:
        store = store_mod.Store(dsn)
    except store_mod.StoreError as exc:
        raise CLIError(str(exc)) from None
    verb = "would remove" if args.dry_run else "removed"
    runs: list[_Target] = []  # runs removed from the store (with their directories)
    spools: list[_Target] = []  # spool files of stored runs
    orphans: list[_Target] = []  # directories of runs the store does not have
    kept: list[str] = []
    progress = _Progress("gc")
    with store, progress:
        progress("looking at run directories", 0, None)
        dirs = retention.run_dirs()
        stored = reads.has_runs(store, list(dirs))
        if not args.spools_only:
            for run_id, status, attrs in reads.runs_started_before(store, before):
                t = _Target(run_id, in_store=True, run_dirs=dirs.get(run_id, []))
                why = _live(store, t, (status, attrs))
                recent = [d for d in t.run_dirs if _last_write_ns(d) >= before]
                if not why and recent:
                    why = f"was written to less than {args.older_than} ago ({recent[0]})"
                if why:
                    kept.append(f"run {t.run_id} {why}")
                    continue
                runs.append(t)
        handled = {t.run_id for t in runs}
        parts = [(run_id, path) for run_id, paths in dirs.items() for path in paths]
        for i, (run_id, path) in enumerate(parts):
            progress("looking at run directories", i, len(parts))
            if run_id in handled:
                continue
            try:
                info: RunInfo | None = RunInfo.load(path)
            except (OSError, ValueError, TypeError):
                info = None
            if _started_wall_ns(info, path) >= before or _last_write_ns(path) >= before:
                continue
            if info is not None and retention.is_live(info):
                kept.append(f"run {run_id} is still recording ({path})")
                continue
            t = _Target(run_id, in_store=run_id in stored, run_dirs=[path])
            if t.in_store:
                if _spool_bytes(path):
                    spools.append(t)
            elif not args.spools_only or _spool_bytes(path):
                orphans.append(t)
        progress("measuring", 0, None)
        _measure(store, runs)
        _measure(store, orphans)
        for t in spools:
            t.dir_bytes = _spool_bytes(t.run_dir)
        doing = "checking" if args.dry_run else "removing"
        for i, t in enumerate(runs):
            progress(f"{doing} runs", i, len(runs))
            if not args.dry_run:
                _remove(store, t, store_rows=True, directory=True)
            progress.say(f"{verb} run {t.run_id}: {t.sizes()}")
        for i, t in enumerate(spools):
            progress(f"{doing} spools of stored runs", i, len(spools))
            if t.run_dir is None:  # every spool was found by its directory
                continue
            try:
                release = retention.release_spool(
                    store, t.run_dir, keep=False, dry_run=args.dry_run
                )
            except store_mod.StoreError as exc:
                release = None
                kept.append(f"the spool of run {t.run_id}: its ingest could not be checked ({exc})")
            if release is not None and release.kept:
                kept.append(f"the spool of run {t.run_id}: {release.kept}")
                t.dir_bytes = 0
            elif release is not None:
                t.dir_bytes = release.removed_bytes
                progress.say(f"{verb} the spool of run {t.run_id}: {fmt.size(t.dir_bytes)}")
        for i, t in enumerate(orphans):
            progress(f"{doing} run directories not in the store", i, len(orphans))
            if not args.dry_run:
                _remove(store, t, store_rows=False, directory=True)
            progress.say(
                f"{verb} {t.run_dir} (run {t.run_id} is not in the store): {fmt.size(t.dir_bytes)}"
            )
    for line in kept:
        err(f"kept {line}")
    removed_spools = [t for t in spools if t.dir_bytes]
    if not (runs or removed_spools or orphans):
        echo(f"gc: nothing older than {args.older_than} to remove")
        return 0
    _total(verb, runs)
    if removed_spools:
        size = sum(t.dir_bytes for t in removed_spools)
        echo(f"{verb} {len(removed_spools)} spool(s) of stored runs: {fmt.size(size)}")
    if orphans:
        size = sum(t.dir_bytes for t in orphans)
        echo(f"{verb} {len(orphans)} run director(ies) not in the store: {fmt.size(size)}")
    return 0


# ---- helpers ------------------------------------------------------------------------------------


class _Progress(PhaseProgress):
    """The progress line of ``rm`` and ``gc`` on stderr (a terminal only; none without a
    ``prefix``), cleared before each line the command prints and, as a context, at the end,
    also when it fails: the error line then starts clean."""

    def __init__(self, prefix: str | None) -> None:
        super().__init__(sys.stderr, prefix=prefix or "")
        self.enabled = self.enabled and prefix is not None

    def say(self, line: str) -> None:
        self.close()
        echo(line)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve(store: Store, ref: str, dirs: dict[str, list[Path]], bad: list[str]) -> str | None:
    """The run id ``ref`` names in the store, or else among the run directories; None (and a
    line in ``bad``) when it names none or several."""
    try:
        return str(reads.resolve_run(store, ref))
    except reads.UnknownRunError as exc:
        message = str(exc)
    if ref in dirs:
        return ref
    matches = sorted(r for r in dirs if ref and r.startswith(ref))
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        bad.append(f"run prefix {ref!r} is ambiguous among run directories: {', '.join(matches)}")
    else:
        bad.append(message.replace(" in the store;", " in the store or under GPU_TRACE_HOME/runs;"))
    return None


def _live(store: Store, t: _Target, row: tuple[str, dict[str, str]] | None = None) -> str:
    """Why a run may still be recording ("" if it is not): its run.json when it has a directory
    here, else its ``runs`` row."""
    from gpu_trace.store import retention
    from gpu_trace.tracer.run import RunInfo

    info = None
    for d in t.run_dirs:  # any record of a job still at it keeps the whole run
        try:
            info = RunInfo.load(d)
        except (OSError, ValueError, TypeError):
            info = None
        if info is not None and retention.is_live(info):
            break
    if info is None and t.in_store:
        if row is None:
            stored = reads.run(store, t.run_id)
            row = (str(stored.get("status", "")), dict(stored.get("attrs") or {}))
        info = RunInfo(t.run_id, "", 0, status=row[0], attrs=row[1])
    if info is None or not retention.is_live(info):
        return ""
    host = info.attrs.get("recorder_host", "")
    pid = info.attrs.get("recorder_pid", "")
    who = f" (recorder pid {pid} on {host})" if pid and host else ""
    return f"is still recording{who}"


def _measure(store: Store, targets: list[_Target]) -> None:
    from gpu_trace.store import retention

    ids = [t.run_id for t in targets if t.in_store]
    rows = store.table_rows(ids) if ids else {}
    sizes = store.run_bytes(ids) if ids else {}
    for t in targets:
        t.store_rows = sum(rows.get(t.run_id, {}).values())
        t.store_bytes = None if sizes is None else sizes.get(t.run_id, 0)
        t.dir_bytes = sum(retention.dir_bytes(d) for d in t.run_dirs)


def _remove(store: Store, t: _Target, *, store_rows: bool, directory: bool) -> None:
    """The store's rows first: a failed delete leaves the directory, so nothing is lost unseen."""
    from gpu_trace.store import retention

    store_mod = store_module()
    if store_rows and t.in_store:
        try:
            store.delete_run(t.run_id)
        except store_mod.StoreError as exc:
            raise CLIError(f"run {t.run_id} not removed: {exc}") from None
    for d in t.run_dirs if directory else []:
        if not d.exists():
            continue
        try:
            retention.remove_run_dir(d)
        except (OSError, ValueError) as exc:
            raise CLIError(f"run {t.run_id}: {d} not removed: {exc}") from None


def _total(verb: str, targets: list[_Target]) -> None:
    if not targets:
        return
    in_store = [t for t in targets if t.in_store]
    known = [t.store_bytes for t in in_store if t.store_bytes is not None]
    store_part = (
        f"~{fmt.size(sum(known))} in the store (estimated from system.parts)"
        if len(known) == len(in_store)
        else f"{fmt.count(sum(t.store_rows for t in in_store))} rows in the store"
    )
    disk = sum(t.dir_bytes for t in targets if t.run_dirs)
    echo(
        f"{verb} {len(targets)} run(s): {store_part if in_store else 'none in the store'}, "
        f"{fmt.size(disk)} of run directories"
    )


def _spool_bytes(path: Path | None) -> int:
    from gpu_trace.store import retention
    from gpu_trace.tracer.spool import spool_dir

    if path is None or not spool_dir(path).is_dir():
        return 0
    return retention.dir_bytes(spool_dir(path))


def _started_wall_ns(info: RunInfo | None, path: Path) -> int:
    """When a run started, wall clock: from run.json's clock anchor, else the directory's time."""
    if info is not None:
        try:
            return (
                int(info.attrs["anchor_wall_ns"])
                + int(info.started_ns)
                - int(info.attrs["anchor_mono_ns"])
            )
        except (KeyError, ValueError, TypeError):
            pass
    return _last_write_ns(path)


def _last_write_ns(path: Path) -> int:
    """The newest modification time of anything under ``path`` (a run still being written to
    is young however long ago it started)."""
    newest = 0
    for p in [path, *path.rglob("*")]:
        try:
            newest = max(newest, p.lstat().st_mtime_ns)
        except OSError:
            continue
    return newest
