"""The server's GPU activity, tied to the forwarded ops that launched it, and each session's GPU
busy time.

``gpu-trace serve`` on a CUDA device runs CUPTI's injection library in its own process
(``collectors/gpu_activity``), which appends raw activity records to files in a directory of
the server's (:class:`~gpu_trace.runtime.server.activity_tail.FileSource` reads what was added
since the last read). The server records
a span per executed op (``server/op``, under its batch's ``server/execute``), so the records
become spans the way a recorded program's do (:func:`~gpu_trace.collectors.gpu_activity.
conversion.convert`), with the server's recent execute and op spans as the parents: a CUDA call
made while an op ran is that op's child, and the kernels, copies and memsets it issued are the
call's (by CUPTI's correlation id). The op's span names its session, so each span goes to that
session's log and travels with its other server spans (back to the client, or into the spool of
``--store``), on the server's clock like them: the client's run maps them onto its own clock
with the same measured offset (``docs/remote.md``).

Conversion runs on a thread of its own every ``interval_s`` (never the executor's: a forwarded
batch never waits for it), and once more, on the executor, when a session says goodbye, so its
last kernels go out with its last spans. The CUDA calls of the last seconds are converted again
with each poll's records (their spans not sent twice), so a kernel whose record comes in a later
CUPTI buffer than its launch's still finds it. Each session's GPU busy time is the union of its
kernels' intervals (:func:`union_ns`), added to its usage as they arrive, an untraced session's
too (its batch's window on its thread stands for its op spans; its spans go nowhere); a kernel
of a session that has already ended still counts toward its tenant's total, its span is counted
``late``; one no batch launched is counted ``unattributed``: never silently lost.

A batch that waited for memory may go on on another thread (a lone batch runs on its
connection's thread, a resumed one on the executor's): the threads its ops ran on are noted where
it parked, so each op's CUDA calls are looked for on its own thread.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from gpu_trace.runtime.protocol.span_tables import span_owner
from gpu_trace.runtime.server.activity_tail import FileSource

if TYPE_CHECKING:
    import pyarrow as pa

    from gpu_trace.collectors.gpu_activity.activity_file import ActivityData
    from gpu_trace.collectors.gpu_activity.conversion import Parents
    from gpu_trace.runtime.sharing.sessions import Session

log = logging.getLogger(__name__)

#: Device work: the categories whose intervals make a session's GPU busy time (kernels only).
BUSY_CATEGORY = "kernel"


class Source(Protocol):
    """Where raw activity records come from: :class:`FileSource`, or a test's."""

    def read_new(self, flush: bool = False) -> list[ActivityData]:
        """Records added since the last call, one :class:`ActivityData` per file (a file's
        anchors and names with its records); ``flush``: ask the capture for what it holds."""
        ...

    def close(self) -> None:
        """The server stops: nothing more is read."""
        ...


def union_ns(start: np.ndarray, end: np.ndarray, covered_until: int = 0) -> tuple[int, int]:
    """Nanoseconds covered by the intervals ``[start, end)`` and not before ``covered_until``,
    and the new ``covered_until``: a session's busy time, added to as its kernels arrive (in
    time order across calls; overlapping kernels on several streams count once)."""
    if len(start) == 0:
        return 0, covered_until
    order = np.argsort(start, kind="stable")
    s = np.asarray(start, np.int64)[order]
    e = np.maximum(np.asarray(end, np.int64)[order], s)
    before = np.maximum.accumulate(np.concatenate([[covered_until], e[:-1]]))
    total = int(np.maximum(e - np.maximum(s, before), 0).sum())
    return total, max(covered_until, int(e.max()))


class ExecutedBatch(NamedTuple):
    """One executed batch's spans, as the parents its CUDA calls are found in (times on the
    server's clock, ``CLOCK_MONOTONIC``). The executor appends a plain tuple of these fields
    (the cheapest thing to make on its thread); the conversion thread names them."""

    session: Session
    tid: int  # the OS thread that ran it
    execute_id: int
    start: int
    end: int
    op_spans: list[tuple[str, int, int]]  # (name, start, end), as the executor recorded them
    op_ids: list[int]  # their span ids
    #: ``(op spans before, OS thread)`` where the batch parked (waited for memory) and went on,
    #: maybe on another thread; None: all on ``tid``.
    threads: list[tuple[int, int]] | None = None

    def op_tids(self) -> list[int]:
        """The OS thread that ran each op."""
        out: list[int] = []
        for count, tid in self.threads or ():
            out += [tid] * (count - len(out))
        return out + [self.tid] * (len(self.op_spans) - len(out))

    @property
    def ops(self) -> list[tuple[int, int, int]]:
        """``(span id, start, end)`` of each op."""
        return [(i, t0, t1) for i, (_, t0, t1) in zip(self.op_ids, self.op_spans, strict=True)]


@dataclass
class Counts:
    """What the server's GPU activity came to (its status and ``serve``'s closing line)."""

    records: int = 0
    spans: int = 0
    unattributed: int = 0  # spans launched outside every traced session's ops
    late: int = 0  # spans of a session that had already ended
    dropped: int = 0  # records CUPTI dropped (buffers full)


class DeviceActivity:
    """The server's GPU activity, converted under its sessions' op spans (see the module)."""

    def __init__(
        self,
        source: Source,
        *,
        pid: int | None = None,
        interval_s: float = 0.2,
        window_s: float = 60.0,
        max_batches: int = 100_000,
        carry_s: float = 2.0,
    ) -> None:
        self.source = source
        self.pid = os.getpid() if pid is None else pid
        self.interval_s = interval_s
        self.window_ns = int(window_s * 1e9)
        self.counts = Counts()
        #: What the capture said (CUPTI missing, taken by another profiler...), once each.
        self.notes: list[str] = []
        #: Batches executed lately (appended by the executor: one append per batch).
        self._batches: deque[tuple] = deque(maxlen=max_batches)
        self._covered: dict[int, int] = {}  # session id -> end of its busy time so far
        self._ended: set[int] = set()  # sessions whose last spans have gone out
        #: CUDA call records of the last ``carry_s`` seconds, converted again with the next ones.
        self._carry = np.zeros(0, dtype=_record_dtype())
        self.carry_ns = int(carry_s * 1e9)
        #: Adds GPU busy time to a session's usage; a server's ledger's, which also adds it to
        #: the tenant's total of ended sessions when it comes after the session ended.
        self.add_busy: Callable[[Session, int], None] = _add_busy
        self._lock = threading.Lock()  # one conversion at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the executor's side ---------------------------------------------------------------

    def batch(
        self,
        session: Session,
        execute_id: int,
        start: int,
        end: int,
        op_spans: list[tuple[str, int, int]],
        op_ids: list[int],
        threads: list[tuple[int, int]] | None = None,
    ) -> None:
        """A batch ran on this thread: its execute span and its op spans (``(name, t0, t1)``)
        with their ids (a session that is not traced has no op spans: its window alone ties its
        kernels to it, for its GPU busy time). One tuple appended: nothing else on this thread."""
        if session.usage.gpu_busy_ns is None:
            session.usage.gpu_busy_ns = 0
        self._batches.append(
            (session, threading.get_native_id(), execute_id, start, end, op_spans, op_ids, threads)
        )

    def batches(self) -> list[ExecutedBatch]:
        """The batches executed lately, oldest first (what a test's source lays records in)."""
        return [ExecutedBatch(*b) for b in self._batches]

    def session_done(self, session: Session, *, ended: bool = False) -> None:
        """``session`` says goodbye (or ended): convert what has arrived, so its last kernels go
        out with its last spans. Once it has ``ended``, its spans arriving later are ``late``."""
        self.poll(flush=True)
        if ended:
            self._ended.add(session.id)

    # ---- the conversion thread -------------------------------------------------------------

    def start(self) -> DeviceActivity:
        self._thread = threading.Thread(
            target=self._loop, name="gpu-trace-serve-gpu-activity", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.poll(flush=True)
        self.source.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self, flush: bool = False) -> int:
        """Convert the records that arrived and hand each span to its session; the spans made.
        Nothing raises: a failure is logged (with its traceback) and that poll's records are
        lost; the server serves on."""
        with self._lock:
            try:
                return self._poll(flush)
            except Exception:  # the server serves on without its GPU activity
                log.exception("gpu-trace serve: converting GPU activity failed")
                return 0

    def _poll(self, flush: bool) -> int:
        parts = self.source.read_new(flush)
        for problem in getattr(self.source, "problems", [])[:]:
            log.warning("gpu-trace serve: GPU activity: %s", problem)
        if hasattr(self.source, "problems"):
            self.source.problems.clear()
        if not parts:
            return 0
        batches = self._recent()
        made = 0
        for data in parts:
            for note in data.notes:  # e.g. another profiler holds CUPTI: said once
                if note not in self.notes:
                    self.notes.append(note)
                    log.warning("gpu-trace serve: %s", note)
            self.counts.dropped += data.dropped
            self.counts.records += len(data.records)
            if data.dropped:
                log.warning(
                    "gpu-trace serve: CUPTI dropped %d GPU activity records (buffers full)",
                    data.dropped,
                )
            if len(data.records):
                made += self._route(data, batches)
        return made

    def _recent(self) -> list[ExecutedBatch]:
        batches = self.batches()
        if batches:
            newest = max(b.end for b in batches)
            while self._batches and self._batches[0][4] < newest - self.window_ns:  # its end
                self._batches.popleft()
            batches = [b for b in batches if b.end >= newest - self.window_ns]
        live = {b.session.id for b in batches}
        for gone in (self._ended | set(self._covered)) - live:  # no batch of theirs is left
            if gone in self._ended:
                self._ended.discard(gone)
                self._covered.pop(gone, None)
        return batches

    def _route(self, data: ActivityData, batches: list[ExecutedBatch]) -> int:
        from gpu_trace.collectors.gpu_activity import activity as act
        from gpu_trace.collectors.gpu_activity.conversion import api_span_ids, convert

        # The CUDA calls of the last polls go in again, their spans not sent twice: a kernel
        # whose record comes in a later buffer than its launch's still finds its launch.
        carry = self._carry
        records = np.concatenate([carry, data.records]) if len(carry) else data.records
        parents, owner = _parents(_around(batches, records, data.anchors), self.pid)
        conv = convert(records, data.names, anchors=data.anchors, parents=parents)
        api = records[np.isin(records["kind"], act.API_KINDS)]
        if len(api):
            keep = api["end"] >= api["end"].max() - self.carry_ns  # CUPTI's clock, ns too
            self._carry = api[keep]
        table = conv.table
        if table.num_rows == 0:
            return 0
        ids = table.column("span_id").to_numpy()
        index = _sessions_of(ids, table.column("parent_span_id").to_numpy(), owner)
        if len(carry):
            index[np.isin(ids, api_span_ids(carry["pid"], carry["correlation"]))] = -2
        sessions = list(dict.fromkeys(owner.values()))
        self.counts.unattributed += int((index == -1).sum())
        made = 0
        for k in np.unique(index[index >= 0]).tolist():
            session = sessions[k]
            rows = np.flatnonzero(index == k)
            part = table.take(rows)
            self._busy(session, part)  # an ended session's too: its tenant's total takes it
            if session.id in self._ended:
                self.counts.late += len(rows)
            elif session.trace:  # an untraced session's count toward its GPU busy time only
                session.log.add_table(_final(part, span_owner(session)))
                self.counts.spans += len(rows)
                made += len(rows)
        return made

    def _busy(self, session: Session, part: pa.Table) -> None:
        import pyarrow.compute as pc

        kernels = part.filter(pc.equal(part.column("category").cast("string"), BUSY_CATEGORY))
        if kernels.num_rows == 0:
            return
        busy, self._covered[session.id] = union_ns(
            kernels.column("start_ns").to_numpy(),
            kernels.column("end_ns").to_numpy(),
            self._covered.get(session.id, 0),
        )
        self.add_busy(session, busy)


def _record_dtype() -> np.dtype:
    from gpu_trace.collectors.gpu_activity.activity import RECORD

    return RECORD


def _around(
    batches: list[ExecutedBatch], records: np.ndarray, anchors: np.ndarray
) -> list[ExecutedBatch]:
    """The batches that ran while the records' CUDA calls were made: the only possible parents
    (a poll's records span a second or so; the window holds up to a minute of batches)."""
    from gpu_trace.collectors.gpu_activity import activity as act
    from gpu_trace.collectors.gpu_activity.conversion import to_monotonic

    api = np.isin(records["kind"], act.API_KINDS)
    if not api.any():
        return []
    lo = int(to_monotonic(records["start"][api], anchors).min())
    hi = int(to_monotonic(records["end"][api], anchors).max())
    return [b for b in batches if b.end >= lo and b.start <= hi]


def _add_busy(session: Session, ns: int) -> None:
    session.usage.gpu_busy_ns = (session.usage.gpu_busy_ns or 0) + ns


def _sessions_of(ids: np.ndarray, parent: np.ndarray, owner: dict[int, Session]) -> np.ndarray:
    """Each span's session, as an index into ``owner``'s distinct sessions (-1: none): its
    parent op's or execute's, else its parent call's (a kernel's runtime call, a driver call's
    runtime call, that call's driver call: three steps at most)."""
    sessions = {s: k for k, s in enumerate(dict.fromkeys(owner.values()))}
    known_ids = np.fromiter(owner.keys(), np.uint64, len(owner))
    known_idx = np.fromiter((sessions[s] for s in owner.values()), np.int64, len(owner))
    index = np.full(len(ids), -1, np.int64)
    for _ in range(3):
        todo = np.flatnonzero(index < 0)
        if not len(todo) or not len(known_ids):
            break
        order = np.argsort(known_ids)
        keys = known_ids[order]
        pos = np.clip(np.searchsorted(keys, parent[todo]), 0, len(keys) - 1)
        hit = keys[pos] == parent[todo]
        if not hit.any():
            break
        found = todo[hit]
        index[found] = known_idx[order][pos[hit]]
        known_ids = np.concatenate([known_ids, ids[found].astype(np.uint64)])
        known_idx = np.concatenate([known_idx, index[found]])
    return index


def _parents(batches: list[ExecutedBatch], pid: int) -> tuple[Parents, dict[int, Session]]:
    """The batches' execute and op spans as conversion's parents (lane 1: execute, 0: ops), and
    which session each span id belongs to."""
    from gpu_trace.collectors.gpu_activity.conversion import Parents  # noqa: F811 (at run time)

    owner: dict[int, Session] = {}
    cols: list[tuple[int, int, int, int, int, int, int]] = []  # tid lane id parent t0 t1 depth
    for b in batches:
        owner[b.execute_id] = b.session
        tids = b.op_tids() if b.threads else None
        for tid in {b.tid, *(t for _, t in b.threads or ())}:
            cols.append((tid, 1, b.execute_id, 0, b.start, b.end, 1))
        for k, (op_id, (_, t0, t1)) in enumerate(zip(b.op_ids, b.op_spans, strict=True)):
            owner[op_id] = b.session
            cols.append((tids[k] if tids else b.tid, 0, op_id, b.execute_id, t0, t1, 2))
    if not cols:
        return Parents.none(), owner
    a = np.array(cols, dtype=np.int64).reshape(-1, 7)
    return (
        Parents(
            pid=np.full(len(a), pid, np.int64),
            tid=a[:, 0].astype(np.uint64),
            lane=a[:, 1],
            span_id=a[:, 2].astype(np.uint64),
            parent_span_id=a[:, 3].astype(np.uint64),
            start=a[:, 4],
            end=a[:, 5],
            depth=a[:, 6],
        ),
        owner,
    )


def _final(part: pa.Table, owner: dict[str, str]) -> pa.Table:
    """Spans as the server's span log sends them: on the server's threads as its other spans are
    (CUDA calls and waits on the executor's row under their op, at depth 3; device work on thread
    0), with their raw server times in attrs ``raw_start_ns``/``raw_end_ns`` and their session
    and tenant (``owner``, :func:`~gpu_trace.runtime.protocol.span_tables.span_owner`) like every
    server span. Column by column: no Python per span."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from gpu_trace.runtime.protocol.span_tables import SERVER_TIDS, THREAD_CATEGORIES

    category = part.column("category").cast(pa.string())
    on_thread = pc.is_in(category, value_set=pa.array(THREAD_CATEGORIES)).to_numpy(
        zero_copy_only=False
    )
    tid = np.where(on_thread, SERVER_TIDS["server/op"], 0).astype(np.uint64)
    depth = np.where(on_thread, 3, 0).astype(np.uint16)
    start = part.column("start_ns").to_numpy()
    end = part.column("end_ns").to_numpy()
    attrs = _append_attrs(
        part.column("attrs").combine_chunks(),
        [("raw_start_ns", start), ("raw_end_ns", end)]
        + [(key, np.full(len(start), value)) for key, value in owner.items()],
    )
    i = part.schema.get_field_index
    part = part.set_column(i("tid"), "tid", pa.array(tid, pa.uint64()))
    part = part.set_column(i("depth"), "depth", pa.array(depth, pa.uint16()))
    return part.set_column(i("attrs"), "attrs", attrs)


def _append_attrs(arr: pa.MapArray, extra: list[tuple[str, np.ndarray]]) -> pa.MapArray:
    """Each row's map with ``extra``'s keys added, one value per row (numbers as strings)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n, k = len(arr), len(extra)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    base, old = int(offsets[0]), int(offsets[-1] - offsets[0])
    keys = arr.keys.slice(base, old)
    items = arr.items.slice(base, old)
    rel = offsets - base
    lengths = np.diff(rel)
    new_offsets = np.concatenate(([0], np.cumsum(lengths + k)))
    row = np.repeat(np.arange(n), lengths + k)
    pos = np.arange(int(new_offsets[-1])) - new_offsets[row]
    extra_at = pos - lengths[row]  # >= 0: the extra key of that index
    src = np.where(extra_at < 0, rel[row] + pos, old + extra_at * n + row)
    new_keys = pa.concat_arrays(
        [keys.cast(pa.string()), *(pa.array([key] * n, pa.string()) for key, _ in extra)]
    )
    new_items = pa.concat_arrays(
        [items.cast(pa.string()), *(pc.cast(pa.array(v), pa.string()) for _, v in extra)]
    )
    take = pa.array(src, pa.int64())
    return pa.MapArray.from_arrays(
        pa.array(new_offsets, pa.int32()), new_keys.take(take), new_items.take(take), type=arr.type
    )


def start_capture(
    setting: str | None, directory: Path | None = None
) -> tuple[DeviceActivity | None, str | None]:
    """For ``gpu-trace serve`` (or one of its worker processes), before CUDA initializes in this
    process: name the injection library to the CUDA driver (``CUDA_INJECTION64_PATH``, read at
    ``cuInit``) with a directory for its files (``directory``, else one of the server's under
    ``GPU_TRACE_HOME``), and the capture that reads them; or None and why not, in one line (None
    when not asked for and there is no driver). Never raises."""
    from gpu_trace import config
    from gpu_trace.collectors import gpu_activity
    from gpu_trace.collectors.gpu_activity import library

    env, _state, line = gpu_activity.prepare(setting)
    if not env:
        return None, line
    try:
        if directory is None:
            directory = config.home() / "serve-activity" / str(os.getpid())
        (directory / "spool").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return None, f"GPU activity is off: {exc}"
    os.environ.update(env)
    os.environ["GPU_TRACE_RUN_DIR"] = str(directory)  # where the library writes
    flush = _library_flush(env[library.ENV])
    return DeviceActivity(FileSource(directory, flush=flush)), None


def _library_flush(path: str) -> Callable[[], None]:
    """The library's own flush (``gpu_trace_activity_flush``), found once CUDA has loaded it."""

    def flush() -> None:
        import ctypes

        ctypes.CDLL(path).gpu_trace_activity_flush()

    return flush
