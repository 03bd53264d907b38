"""The server's executor: one thread owns the device and runs the sessions' work in turn.

Connections put work (uploads, batches, close) into a
:class:`~gpu_trace.runtime.sharing.scheduler.Scheduler`; the executor takes one item at a time and
runs it (or a connection runs a lone small batch itself when the device is idle). ATen ops are
resolved against the allow-list; a template's calls run compiled, one Python call per op
(:mod:`gpu_trace.runtime.server.plan`), with the same checks as every other op; the runtime's
own ``rt::`` ops are in :mod:`gpu_trace.runtime.server.pseudo_ops`; each traced batch's spans go
to the server's sink (:mod:`gpu_trace.runtime.server.sink`).

Everything that touches a session's tables happens on this thread, so they need no locks. The
random generator's state is switched with the session, so tenants never share a random stream.

Memory: every op is checked against its tenant's quota and the device's capacity before it runs
(:mod:`gpu_trace.runtime.server.op_runner`, which the executor is); a refused op fails, or its
batch is parked at that op (its progress kept in ``Work.resume``, a
:class:`~gpu_trace.runtime.sharing.scheduler.Parked`) while other sessions run. The executor never
blocks on memory. On CUDA each session runs on its own stream, and its device time is read from
CUDA events recorded around its batches, later, without synchronizing. A batch's head, early
frees and reply are in :mod:`gpu_trace.runtime.server.batch_parts`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu_trace.runtime.protocol.templates import TOp
from gpu_trace.runtime.protocol.wire import (
    ConnectionClosed,
    MsgType,
    ProtocolError,
    frame,
    json_frame,
)
from gpu_trace.runtime.server.batch_parts import (
    batch_head,
    free_early,
    op_name,
    page_in,
    reply,
)
from gpu_trace.runtime.server.device_ops import use_flags
from gpu_trace.runtime.server.op_runner import OpRunner, Refused
from gpu_trace.runtime.server.plan import Calls
from gpu_trace.runtime.server.sink import (
    ReturnSink,
    Sink,
    record_batch,
    record_counters,
    record_quota_wait,
)
from gpu_trace.runtime.sharing.memory import Memory, QuotaError, Refusal
from gpu_trace.runtime.sharing.scheduler import Parked, PolicyScheduler, Wait, Work
from gpu_trace.runtime.sharing.sessions import Session

if TYPE_CHECKING:
    import torch

    from gpu_trace.runtime.server.device_activity import DeviceActivity
    from gpu_trace.runtime.sharing.pager import Pager
    from gpu_trace.runtime.sharing.restore import Gate

log = logging.getLogger(__name__)

now_ns = time.perf_counter_ns

_NO_STREAM = contextlib.nullcontext()  # the CPU device's (reusable)


class Executor(OpRunner):
    """Runs work items on the device, one at a time."""

    def __init__(
        self,
        device: str,
        scheduler: PolicyScheduler,
        sink: Sink | None = None,
        memory: Memory | None = None,
        pager: Pager | None = None,
        lock: threading.Lock | None = None,
        activity: DeviceActivity | None = None,
    ) -> None:

        super().__init__(
            device, memory if memory is not None else Memory(1 << 62, wake=scheduler.unpark)
        )
        self.scheduler = scheduler
        #: Where traced sessions' spans go (:mod:`gpu_trace.runtime.server.sink`).
        self.sink: Sink = sink if sink is not None else ReturnSink()
        #: The server's GPU activity capture (:mod:`gpu_trace.runtime.server.device_activity`;
        #: None: off).
        self.activity = activity
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.batches = 0
        #: Pages idle sessions out to host memory and back (:mod:`gpu_trace.runtime.sharing.pager`;
        #: None: never).
        self.pager = pager
        #: The session whose work runs now (None: none).
        self.current: Session | None = None
        #: Told each op's name before it runs, and "" once its batch is over (a worker's
        #: :class:`~gpu_trace.runtime.channel.beacon.Beacon`, so that the front can name the op a
        #: crash ended; None: nobody asks).
        self.mark: Callable[[str], None] | None = None
        #: Told of every error an op or a batch raised, with the op's name ("" for a batch's),
        #: before it goes back to the client (a worker checks whether its CUDA context survived).
        self.on_error: Callable[[Exception, str], None] | None = None
        #: Set (by a worker's ``on_error``) once this process's CUDA context has failed: every
        #: later CUDA call would raise the same error, so the batch in hand makes none (no sync,
        #: no event) and replies with its op's error; the worker then ends the session.
        self.context_lost = False
        self._streams: dict[int, torch.cuda.Stream] = {}  # session id -> its CUDA stream
        # session id -> unread CUDA events
        self._events: dict[int, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        #: Held while work runs; a connection may run work inline when it is free and nothing
        #: is queued (no hand-off between threads for a lone batch).
        self.lock = lock if lock is not None else threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gpu-trace-executor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        memory = self.memory
        while not self._stop.is_set():
            if not self.scheduler.wait(0.2):
                if memory.waiting():
                    with self.lock:
                        memory.due()  # waits that ran out are retried (and fail)
                continue
            with self.lock:
                if memory.waiting():
                    memory.due()
                got = self.scheduler.take(0)
                if got is not None:
                    self._run_safely(*got)

    def try_inline(self, session: Session, work: Work) -> bool:
        """Run ``work`` on the calling thread if nothing is queued or running; False if not."""
        if self.scheduler.depth() or not self.lock.acquire(blocking=False):
            return False
        try:
            # A parked session's queued work is not counted in depth(): it goes first. (Only
            # waits for memory park a session.)
            if self.scheduler.depth() or (self.memory.waiting() and self.scheduler.queued(session)):
                return False
            self._run_safely(session, work)
            return True
        finally:
            self.lock.release()

    def _run_safely(self, session: Session, work: Work) -> None:
        self.current = session  # the admin listing's "running"
        try:
            self.run(session, work)
        except ConnectionClosed as exc:  # the client went away with work in flight
            log.debug("gpu-trace serve: session %d: client gone: %s", session.id, exc)
            session.closed = True
        except Exception as exc:  # a bug here must not take the server down
            log.exception("gpu-trace serve: session %d: work failed", session.id)
            if self.on_error is not None:
                self.on_error(exc, "")
            # Nor leave its client waiting for a reply that will never come: the session ends
            # with an ERROR saying so, which the client raises at its next sync point.
            self._fail(session, f"internal error in the server ({type(exc).__name__}: {exc})")
        finally:
            self.current = None
            if self.mark is not None:
                self.mark("")

    def run(self, session: Session, work: Work) -> None:
        if work.kind == "batch" and not session.closed:  # most work: first
            try:
                self._batch(session, work)
            except ProtocolError as exc:
                self._fail(session, str(exc))
            return
        if work.kind == "close":
            if self._rng_owner is session:
                self._rng_owner = None
            self._read_events(session)
            if self.activity is not None:  # its last kernels: spans if traced, busy time
                self.activity.session_done(session, ended=True)
            if session.trace:
                self.sink.session_closed(session)
            if self.pager is not None:
                self.pager.forget(session)
            session.close()
            self.memory.detach(session)
            self._streams.pop(session.id, None)
            self._events.pop(session.id, None)
            self._refused.pop(session.id, None)
            self.scheduler.forget(session)
            return
        if session.closed:
            return
        try:
            if work.kind == "put-inline":
                if type(work.head) is not int or work.head <= 0:
                    raise ProtocolError("blob ids are positive integers")
                if work.resume is None:
                    session.usage.bytes_in += work.data[1]
                if self._admit_upload(session, work, work.head, work.data[1]):
                    session.blobs.add(work.head, *work.data)
            elif work.kind == "bye":
                try:
                    if session.trace:  # the run ends with the session's final numbers
                        self._read_events(session)
                        if self.activity is not None:
                            self.activity.session_done(session)
                        record_counters(session, now_ns(), self.scheduler.depth(), self.memory)
                    self.sink.export(session, session.log.take())
                    session.send(frame(MsgType.BYE))
                finally:
                    if work.done is not None:
                        work.done.set()
            elif work.kind == "put":
                dtype, shape, nbytes = work.data
                if self._admit_upload(session, work, work.head, nbytes):
                    session.blobs.begin(work.head, dtype, shape, nbytes)
            elif work.kind == "chunk":
                ident, offset, data = work.data
                session.usage.bytes_in += len(data)
                refused = self._refused.get(session.id)
                if refused is None or ident not in refused:
                    session.blobs.chunk(ident, offset, data)
        except ProtocolError as exc:
            self._fail(session, str(exc))

    def _fail(self, session: Session, message: str) -> None:
        log.info("gpu-trace serve: session %d: protocol error: %s", session.id, message)
        with contextlib.suppress(Exception):
            session.send(json_frame(MsgType.ERROR, {"message": message}))
        session.closed = True

    # ---- batches ---------------------------------------------------------------------------------

    def _batch(self, session: Session, work: Work) -> None:
        """Run a batch (or go on with a parked one): its ops in order, then its frees, its reply
        and its spans. An op's error ends the batch and goes back in the reply; an op refused
        for memory that is to wait parks the batch where it stopped."""
        head = work.head
        seq, ops, frees = batch_head(head)
        if self._rng_owner is not session:
            self._switch_rng(session)
        use_flags(self.torch, session)  # its TF32, cuDNN... settings, not the last session's
        usage = session.usage
        start = now_ns()
        state = work.resume
        if state is None:  # a fresh batch (else one resumed after waiting for memory)
            first, exec_start, results, op_spans = 0, start, {}, []
            execute_id = session.log.new_id() if session.trace else 0
            usage.queue_ns += max(0, start - work.recv_end_ns)
        else:
            first, exec_start = state.index, state.exec_start
            results, op_spans, execute_id = state.results, state.op_spans, state.execute_id
        stream = self._stream(session) if self._cuda else None
        with self.torch.cuda.stream(stream) if stream is not None else _NO_STREAM:
            events = self._begin_events() if stream is not None else None
            pager = self.pager
            gate = None
            if pager is not None and pager.is_paged(session):
                ops, gate = page_in(pager, session, head, ops)
            error, parked = self._run_ops(
                session, work, ops, frees, first, gate, exec_start, results, op_spans, execute_id
            )
            if not parked:
                error = self._finish_ops(session, work, head, frees, stream, error, results, ops)
            if pager is not None and not self.context_lost:
                pager.end_batch(session)
            if events is not None and not self.context_lost:
                events[1].record(stream)
                self._events.setdefault(session.id, []).append(events)
        exec_end = now_ns()
        self._charge(session, exec_end - start)
        usage.last_active_ns = exec_end
        if parked:
            self.scheduler.park(session)
            self.scheduler.requeue(session, work)
            return
        self._count(session, len(ops))
        t = (work.recv_start_ns, work.recv_end_ns, exec_start, exec_end, now_ns())
        reply(session, seq, error, results, t)
        if session.trace:
            record_batch(
                session,
                head,
                (work.recv_start_ns, work.recv_end_ns),
                execute_id,
                exec_start,
                exec_end,
                op_spans,
                self.scheduler.depth(),
                self.sink,
                memory=self.memory,
                activity=self.activity,
                threads=work.resume.threads if work.resume is not None else None,
            )
        elif self.activity is not None:  # its GPU busy time: its CUDA calls are in this window
            self.activity.batch(session, session.log.new_id(), exec_start, exec_end, [], [])

    def _run_ops(
        self,
        session: Session,
        work: Work,
        ops: list[Any],
        frees: list[Any],
        first: int,
        gate: Gate | None,
        exec_start: int,
        results: dict[str, Any],
        op_spans: list[tuple[str, int, int]],
        execute_id: int,
    ) -> tuple[dict[str, Any] | None, bool]:
        """Run ``ops`` from ``first`` on: the first op's error (None: none), and whether the
        batch parked (an op waits for memory; its progress is in ``work.resume``)."""
        trace = session.trace
        decoder = None  # made for the first op that is not a prepared template's call
        calls = Calls(self, session)  # what a template's compiled call reads (plan.py)
        # Runs of compiled calls go on in a tight loop (below) where nothing is done between
        # two ops: no page-in gate, no spans, no memory wait to end.
        chain = gate is None and not trace
        mark = self.mark
        n = len(ops)
        index = first - 1
        while index + 1 < n:
            index += 1
            op = ops[index]
            if mark is not None:
                mark(op.t.name if type(op) is TOp else op_name(op))
            try:
                try:
                    if gate is not None:
                        gate(op)
                    t0 = now_ns() if trace else 0
                    if type(op) is TOp:
                        plan = op.t.prep
                        if plan is None:  # its first call
                            plan = op.t.prep = self._prepare(op.t)
                        if not plan:  # a template too nested to prepare: its JSON op
                            op = op.materialize()
                    else:
                        plan = None
                    if plan:
                        if plan.out != -1:  # most calls: one tensor out, or none kept
                            value = plan.run(calls, op.vals)
                            if chain and (work.resume is None or work.resume.wait is None):
                                while value is None and index + 1 < n:
                                    nxt = ops[index + 1]
                                    if type(nxt) is not TOp:
                                        break
                                    plan = nxt.t.prep
                                    if not plan or plan.out == -1:
                                        break
                                    index += 1
                                    op = nxt
                                    if mark is not None:
                                        mark(op.t.name)
                                    value = plan.run(calls, op.vals)
                        else:
                            value = self._top(session, plan, op.vals)
                    else:
                        if decoder is None:
                            decoder = self._decoder(session)
                        value = self._op(session, decoder, op)
                    if trace:
                        op_spans.append((op_name(op), t0, now_ns()))
                except Refused as refused:
                    if self._on_refused(session, work, refused, ops, index, frees):
                        index -= 1  # the batch's own frees made room, maybe: again
                        continue
                    progress = work.resume or Parked()
                    progress.index, progress.exec_start = index, exec_start
                    progress.results, progress.op_spans = results, op_spans
                    progress.execute_id = execute_id
                    progress.threads.append((len(op_spans), threading.get_native_id()))
                    work.resume = progress
                    return None, True
                if work.resume is not None:
                    self._end_wait(session, work, "ran")
                if value is not None:
                    results[str(index)] = value
            except Exception as exc:  # the op's error goes back; the session goes on
                return self._op_error(session, exc, index, op_name(op)), False
        return None, False

    def _on_refused(
        self,
        session: Session,
        work: Work,
        refused: Refused,
        ops: list[Any],
        index: int,
        frees: list[Any],
    ) -> bool:
        """An op was refused for memory: True to run it again (the batch's frees made room),
        False to park the batch at it; raises the quota error when it fails instead."""
        if refused.rerun and free_early(session, work, ops, index, frees):
            self._put_back(session, refused)
            return True
        exc = self._wait_or_fail(session, work, refused.refusal)
        if exc is not None:
            raise exc from None
        self._put_back(session, refused)
        return False

    def _op_error(self, session: Session, exc: Exception, index: int, name: str) -> dict[str, Any]:
        """The reply's ``error`` for the op at ``index`` that raised ``exc``."""
        if self.on_error is not None:
            self.on_error(exc, name)
        error: dict[str, Any] = {"index": index, "op": name[:200], "type": type(exc).__name__}
        error["message"] = str(exc)[:4000]
        if isinstance(exc, QuotaError):
            error["quota"] = exc.wire()
            session.usage.quota_errors += 1
        elif isinstance(exc, self.torch.OutOfMemoryError) and self._cuda:
            self.torch.cuda.empty_cache()  # what the failed op left cached
        return error

    def _finish_ops(
        self,
        session: Session,
        work: Work,
        head: dict[str, Any],
        frees: list[Any],
        stream: torch.cuda.Stream | None,
        error: dict[str, Any] | None,
        results: dict[str, Any],
        ops: list[Any],
    ) -> dict[str, Any] | None:
        """:meth:`_after_ops`, where an error raised at the stream's sync is the batch's own (a
        CUDA error is reported at a later call than the kernel that caused it: an out-of-range
        index is seen at the sync), not the server's: the reply's error, at the last op."""
        if self.context_lost:
            return error
        try:
            self._after_ops(session, work, head, frees, stream, error is None and bool(results))
        except Exception as exc:
            if error is not None:  # the op's error stands; the worker still hears of this one
                if self.on_error is not None:
                    self.on_error(exc, "")
                return error
            results.clear()
            return self._op_error(session, exc, max(0, len(ops) - 1), "(the batch, at its sync)")
        return error

    def _after_ops(
        self,
        session: Session,
        work: Work,
        head: dict[str, Any],
        frees: list[Any],
        stream: torch.cuda.Stream | None,
        answered: bool,
    ) -> None:
        """The batch's ops are done (or one failed): its frees, and on CUDA its stream synced
        when the client asked or there are results to send (``answered``)."""
        if work.resume is not None:
            self._end_wait(session, work, "failed")  # a retried op that failed otherwise
        if frees:
            session.free_many(frees)
        if stream is not None and (head.get("sync") or answered):
            stream.synchronize()

    def _count(self, session: Session, n: int) -> None:
        """One more batch of ``n`` ops, for the session, its usage and the server."""
        usage = session.usage
        session.batches += 1
        session.ops += n
        usage.batches += 1
        usage.ops += n
        self.batches += 1

    # ---- memory ----------------------------------------------------------------------------------

    def _admit_upload(self, session: Session, work: Work, ident: int, nbytes: int) -> bool:
        """May ``session`` keep an upload of ``nbytes``? False: it waits (parked), or it was
        refused and the op that uses it fails with the quota error."""
        refusal = self.memory.refusal(session, nbytes)
        if refusal is None:
            self._end_wait(session, work, "ran")
            return True
        error = self._wait_or_fail(session, work, refusal)
        if error is None:
            self.scheduler.park(session)
            self.scheduler.requeue(session, work)
        else:
            self._refused.setdefault(session.id, {})[ident] = error
        return False

    def _wait_or_fail(self, session: Session, work: Work, refusal: Refusal) -> QuotaError | None:
        """The error to fail with, or None when ``work`` is to wait (the caller parks it)."""
        tenant = session.tenant
        wait = work.resume.wait if work.resume is not None else None
        if tenant.on_quota != "wait":
            return refusal.error()
        if refusal.hopeless:
            note = f"waiting cannot help: {refusal.hopeless}"
            if wait is not None:
                note = f"waited {(now_ns() - wait.t0) / 1e9:.1f} s; {note}"
            self._end_wait(session, work, "hopeless")
            return refusal.error(note)
        clock = self.memory.clock()
        if wait is None:
            wait = Wait(now_ns(), clock + int(tenant.wait_s * 1e9))
            if work.resume is None:
                work.resume = Parked()
            work.resume.wait = wait
            session.usage.quota_waits += 1
        elif clock >= wait.deadline:
            self._end_wait(session, work, "timeout")
            return refusal.error(f"waited {tenant.wait_s:g} s, the tenant's wait_s")
        wait.refusal = refusal
        self.memory.wait(session, refusal.kind, wait.deadline)
        return None

    def _end_wait(self, session: Session, work: Work, outcome: str) -> None:
        """``work`` waited for memory and now goes on (or fails): record the wait."""
        progress = work.resume
        if progress is None or progress.wait is None:
            return
        wait, progress.wait = progress.wait, None
        self.memory.resumed(session)
        r = wait.refusal  # set by _wait_or_fail whenever a wait is parked
        if session.trace and r is not None:
            attrs = {
                "reason": r.kind,
                "tenant": r.tenant,
                "asked": str(r.asked),
                "used": str(r.used),
                "limit": str(r.limit),
                "outcome": outcome,
            }
            head = work.head if type(work.head) is dict else None
            record_quota_wait(session, head, wait.t0, now_ns(), attrs)

    # ---- device time -----------------------------------------------------------------------------

    def _stream(self, session: Session) -> torch.cuda.Stream | None:
        """``session``'s own CUDA stream (None on the CPU device)."""
        if not self._cuda:
            return None
        stream = self._streams.get(session.id)
        if stream is None:
            stream = self._streams[session.id] = self.torch.cuda.Stream(self.device)
        return stream

    def session_stream(self, session: Session) -> torch.cuda.Stream | None:
        """``session``'s CUDA stream, where its kernels run (None on the CPU device, or before
        its first batch). Whoever reads its tensors from another stream (the pager, paging it
        out) synchronizes this one first."""
        return self._streams.get(session.id)

    def _begin_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        cuda = self.torch.cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def _charge(self, session: Session, wall_ns: int) -> None:
        """Device time of a batch: its wall time on the CPU; on CUDA, what its events say,
        read when the device has got there (never waited for)."""
        if not self._cuda:
            session.usage.busy_ns += wall_ns
            self.scheduler.charge(session, wall_ns)
        else:
            self._read_events(session)

    def _read_events(self, session: Session) -> None:
        pending = self._events.get(session.id)
        if self.context_lost:  # events of a failed context cannot be read
            if pending:
                pending.clear()
            return
        busy = 0
        while pending and pending[0][1].query():
            start, end = pending.pop(0)
            busy += int(start.elapsed_time(end) * 1e6)
        if busy > 0:
            session.usage.busy_ns += busy
            self.scheduler.charge(session, busy)
