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

Memory (:mod:`gpu_trace.runtime.sharing.memory`): every op is checked against its tenant's quota and
the device's capacity before it runs, by the bytes it will allocate as the server works them out
(:mod:`gpu_trace.runtime.server.sizing`: the op on meta tensors, cached by signature, with its
parts' temporaries for an op that decomposes into others; or a bound for ops whose size depends on
data), never by what the client claims; uploads by their size, the runtime's ``rt::`` ops by
their own bounds. After the op its session's account is the exact book-keeping; an op that still
grew it past a limit (by what a kernel allocates inside itself, the one thing not bounded) has
its outputs freed and is refused. A refused op fails with a
:class:`~gpu_trace.runtime.sharing.memory.QuotaError`, or, for a tenant whose ``on_quota`` is
``wait``, its batch is parked at that op (its progress kept in ``Work.resume``, a
:class:`~gpu_trace.runtime.sharing.scheduler.Parked`) while other sessions run, and the op runs
when memory is freed. The executor never blocks on memory. On CUDA each session
runs on its own stream, and its device time is read from CUDA events recorded around its
batches, later, without synchronizing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.protocol.templates import Template, TOp, has_hole
from gpu_trace.runtime.protocol.values import ArgDecoder, encode_result
from gpu_trace.runtime.protocol.wire import (
    DONE_OK_BODY,
    HEADER,
    MAX_BATCH_OPS,
    MAX_FREES,
    ConnectionClosed,
    MsgType,
    ProtocolError,
    done_value_frame,
    frame,
    json_frame,
)
from gpu_trace.runtime.server import allowlist
from gpu_trace.runtime.server.device_ops import use_flags
from gpu_trace.runtime.server.plan import (
    MAX_TEMPLATE_SIZES,
    Calls,
    Plan,
    check_sizes,
    held_storages,
    recount,
)
from gpu_trace.runtime.server.pseudo_ops import rng_state, run_pseudo, seed_device, set_rng_state
from gpu_trace.runtime.server.sink import (
    ReturnSink,
    Sink,
    record_batch,
    record_counters,
    record_quota_wait,
)
from gpu_trace.runtime.server.sizing import Sizing, sizer
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


class _Refused(Exception):
    """An op may not allocate now; the batch fails it or waits (the tenant's ``on_quota``).

    ``rerun``: the op did not run, or ran without changing anything but its freed outputs, so
    it may run again. ``blobs``: the ``(id, tensor)`` of uploads its arguments took; if it is to
    run again they are put back (:meth:`Executor._put_back`), else they are used up. ``undo``:
    called too when it is to run again (an ``rt::backward`` puts its graph back).
    """

    def __init__(
        self, refusal: Refusal, rerun: bool = True, blobs: Any = (), undo: Any = None
    ) -> None:
        self.refusal = refusal
        self.rerun = rerun
        self.blobs = blobs
        self.undo = undo


class Executor:
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
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.scheduler = scheduler
        #: Where traced sessions' spans go (:mod:`gpu_trace.runtime.server.sink`).
        self.sink: Sink = sink if sink is not None else ReturnSink()
        #: The server's GPU activity capture (:mod:`gpu_trace.runtime.server.device_activity`;
        #: None: off).
        self.activity = activity
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng_owner: Session | None = None
        self._ops: dict[str, tuple[Any, Any, bool, bool, bool, Any]] = {}
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
        #: More ``rt::`` ops by name, each called with the session and the op's arguments (a
        #: worker's test probes; empty in a server).
        self.extra_ops: dict[str, Callable[[Session, list[object]], object]] = {}
        #: Device memory by tenant; a server passes its own (``Server.memory``).
        self.memory = memory if memory is not None else Memory(1 << 62, wake=scheduler.unpark)
        #: What ops will allocate, worked out before they run
        #: (:mod:`gpu_trace.runtime.server.sizing`).
        self.sizing = Sizing(self.memory.block_bytes)
        self._cuda = self.device.type == "cuda"
        self._streams: dict[int, torch.cuda.Stream] = {}  # session id -> its CUDA stream
        # session id -> unread CUDA events
        self._events: dict[int, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        self._refused: dict[int, dict[int, QuotaError]] = {}  # session id -> refused uploads
        self._blobs_taken = 0
        # uploads the current JSON op's arguments took
        self._taken: list[tuple[int, torch.Tensor]] = []
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
        seq, ops, frees = _batch_head(head)
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
                ops, gate = _page_in(pager, session, head, ops)
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
        self._reply(session, seq, error, results, t)
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
                mark(op.t.name if type(op) is TOp else _name(op))
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
                        op_spans.append((_name(op), t0, now_ns()))
                except _Refused as refused:
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
                return self._op_error(session, exc, index, _name(op)), False
        return None, False

    def _on_refused(
        self,
        session: Session,
        work: Work,
        refused: _Refused,
        ops: list[Any],
        index: int,
        frees: list[Any],
    ) -> bool:
        """An op was refused for memory: True to run it again (the batch's frees made room),
        False to park the batch at it; raises the quota error when it fails instead."""
        if refused.rerun and _free_early(session, work, ops, index, frees):
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

    def _reply(
        self,
        session: Session,
        seq: int,
        error: dict[str, Any] | None,
        results: dict[str, Any],
        t: tuple[int, int, int, int, int],
    ) -> None:
        """The batch's DONE: a fixed binary frame for most, JSON with results or an error."""
        reply = None
        if error is None and session.binary and len(results) < 2:  # most batches: no JSON
            if not results:
                reply = _DONE_OK + DONE_OK_BODY.pack(seq, *t)
            else:  # one number (``.item()``...); None for any other value
                ((index, value),) = results.items()
                reply = done_value_frame(seq, t, int(index), value)
        if reply is not None:
            session.send(reply)
        elif error is None and not results:  # the same JSON each time, formatted directly
            session.send(_done_frame(seq, t))
        else:
            done = {"seq": seq, "ok": error is None, "error": error, "results": results, "t": t}
            session.send(json_frame(MsgType.DONE, done))

    def _decoder(self, session: Session) -> ArgDecoder:
        """The decoder of ``session``'s JSON ops (its handles and uploads)."""
        return ArgDecoder(session.handles.get, self._blob_taker(session), self.device)

    def _op(self, session: Session, decoder: ArgDecoder, op: Any) -> Any:
        if type(op) is not list or len(op) != 4:
            raise ProtocolError("an op is [name, args, kwargs, outs]")
        name, args, kwargs, outs = op
        account = session.account
        before = account.bytes
        if self._taken:
            self._taken.clear()
        entry = self._ops.get(name)
        if entry is None:
            if type(name) is not str:
                raise ProtocolError("op name must be a string")
            if name.startswith("rt::"):
                value = run_pseudo(self, session, decoder, name, args, outs)
                if account.bytes > before and self.memory.over(session):
                    self._admit_output(session, before, outs, False, None)
                return value
            entry = self._resolve(name)
        if type(args) is not list:
            raise ProtocolError("op args must be a list")
        taken = self._blobs_taken
        a = decoder.decode_args(args)
        k = decoder.decode_kwargs(kwargs) if kwargs else {}
        idents = _idents(args, kwargs if k else {})  # kwargs: an object, as decoded
        return self._run_op(session, entry, a, k, outs, before, taken, idents=idents)

    def _resolve(self, name: str) -> tuple[Any, Any, bool, bool, bool, Any]:
        """An allow-listed ATen op's entry (see :func:`_entry`), made once per name."""
        entry = self._ops.get(name)
        if entry is None:
            target = allowlist.resolve(name)
            if target is None:
                raise OpError(allowlist.refusal(name))
            entry = self._ops[name] = _entry(target)
        return entry

    def _top(self, session: Session, plan: Plan, vals: list[int]) -> Any:
        """A template call (``plan``: the template's decoded form, see :meth:`_prepare`) that
        is not of :meth:`Plan.run`'s shape: its tensors looked up by the call's handle numbers
        ``vals``, put in the decoded constants."""
        before = session.account.bytes
        taken = self._blobs_taken
        a = list(plan.args)
        get = session.handles.get
        key = []
        for pos, hole in plan.holes:
            x = a[pos] = get(vals[hole])
            key.append((x.dtype, x.shape, x.stride(), x.storage_offset()))
        for pos, hs in plan.lists:
            xs = a[pos] = [get(vals[hole]) for hole in hs]
            key += [(x.dtype, x.shape, x.stride(), x.storage_offset()) for x in xs]
        outs = plan.outs
        filled = None if outs is None else [_filled(h, vals) for h in outs]
        return self._run_op(
            session,
            plan.entry,
            a,
            dict(plan.kwargs) if plan.kwargs else {},
            filled,
            before,
            taken,
            plan.sizes,
            tuple(key),
            [vals[hole] for hole in plan.inputs],
        )

    def _prepare(self, t: Template) -> Plan | bool:
        """A template's decoded form (:class:`~gpu_trace.runtime.server.plan.Plan`): its op's
        entry, its constants decoded, the ``(position, hole)`` of each top-level tensor; False
        where tensors are nested in arguments, or it names a runtime op (such templates are
        filled in per call)."""
        if t.name.startswith("rt::") or type(t.outs) not in (list, type(None)):
            return False
        if t.outs is not None and not all(_out_hole(o) for o in t.outs):
            return False
        entry = self._resolve(t.name)

        def constant(ident: int) -> Any:
            raise ProtocolError("a template's constants cannot name tensors")

        decoder = ArgDecoder(constant, constant, self.device)
        args: list[Any] = []
        holes: list[tuple[int, int]] = []
        lists: list[tuple[int, tuple[int, ...]]] = []
        for pos, v in enumerate(t.args):
            if type(v) is dict and len(v) == 1 and "xh" in v:
                holes.append((pos, v["xh"]))
                args.append(None)
            elif type(v) is list and v and all(_is_hole(x) for x in v):  # a list of tensors
                lists.append((pos, tuple(x["xh"] for x in v)))
                args.append(None)
            elif has_hole(v):
                return False
            else:
                args.append(decoder.decode(v, 1))
        if has_hole(t.kwargs):
            return False
        kwargs = decoder.decode_kwargs(t.kwargs) if t.kwargs else {}
        return Plan(t.name, entry, args, holes, kwargs, t.outs, tuple(lists))

    def _run_op(
        self,
        session: Session,
        entry: tuple[Any, Any, bool, bool, bool, Any],
        a: list[Any],
        k: dict[str, Any],
        outs: Any,
        before: int,
        taken: int,
        sizes: dict[Any, int] | None = None,
        key: Any = None,
        idents: list[int] | None = None,
    ) -> Any:
        """Run a decoded op: its rules and memory checks, the op, its outputs' handles.

        ``sizes``: a template's own sizes by ``key``, its tensors' signatures (see :meth:`_top`).
        ``idents``: the handles it takes (their storages are counted again after an op that may
        grow them in place: :func:`~gpu_trace.runtime.server.plan.recount`).
        """
        target, rule, sized, rerunnable, seeded, size = entry
        account = session.account
        held = None
        if rule is not None:
            rule(a, k)
        if sized:
            check_sizes(a, k)
        if size is not None:  # what it will allocate, checked before it does
            asked: int | None
            if sizes is None:
                asked = self.sizing.op_bytes(size, target, a, k)
            else:
                asked = sizes.get(key)
                if asked is None:
                    asked = self.sizing.op_bytes(size, target, a, k)
                    if len(sizes) >= MAX_TEMPLATE_SIZES:
                        sizes.clear()
                    sizes[key] = asked
            if asked:
                self.admit(session, asked, taken)
                if not rerunnable and idents:  # it may grow its inputs' storages in place
                    held = held_storages(session.handles, idents)
        rng = None
        if seeded and session.tenant.on_quota == "wait":
            rng = rng_state(self.torch, self.device)  # a re-run must draw the same numbers
        result = target(*a, **k)
        if held is not None:
            recount(session.handles, held)
        if type(outs) is list and len(outs) == 1 and isinstance(result, self.torch.Tensor):
            h = outs[0]  # one tensor result: most ops
            if h is not None:
                session.handles.put(h, result)
            value = None
        else:
            value = self._assign(session, result, outs)
        if account.bytes > before and self.memory.over(session):
            self._admit_output(
                session, before, outs, rerunnable and self._blobs_taken == taken, rng
            )
        return value

    def _admit_output(
        self, session: Session, before: int, outs: Any, rerunnable: bool, rng: Any
    ) -> None:
        """An op's outputs took ``session`` from ``before`` bytes to more: keep them, or free
        them and refuse the op (it fails, or waits and runs again)."""
        grown = session.account.bytes - before
        refusal = self.memory.refusal(session, grown, held=grown)
        if refusal is None:
            return
        if session.tenant.on_quota == "wait" and not rerunnable and not refusal.hopeless:
            # It changed its inputs or used an upload, so it cannot run twice: its outputs stay,
            # and the tenant's next allocations wait until it is back under its quota.
            return
        for handle in _handles(outs):
            session.handles.free(handle)
        if rng is not None:
            set_rng_state(self.torch, self.device, rng)
        raise _Refused(refusal, rerun=rerunnable)

    # ---- memory ----------------------------------------------------------------------------------

    def admit(
        self, session: Session, nbytes: int, taken: int | None = None, undo: Any = None
    ) -> None:
        """May an op of ``session`` allocate ``nbytes`` now? If not it does not run: it is
        refused (it fails, or its batch waits and it runs later; see :meth:`_batch`).

        ``taken``: the count of uploads taken when the op's arguments began to be decoded (None:
        when its JSON op began); those taken since go back if it is to run later, and ``undo()``
        is called then.
        """
        refusal = self.memory.refusal(session, nbytes)
        if refusal is not None:
            blobs = self._taken
            n = len(blobs) if taken is None else min(self._blobs_taken - taken, len(blobs))
            raise _Refused(refusal, blobs=blobs[len(blobs) - n :] if n > 0 else (), undo=undo)

    def _put_back(self, session: Session, refused: _Refused) -> None:
        """What a refused op took (uploads: counted again), back for when it runs again."""
        for ident, tensor in refused.blobs:
            session.blobs.add(ident, tensor, tensor.untyped_storage().nbytes())
        if refused.undo is not None:
            refused.undo()

    def _blob_taker(self, session: Session) -> Callable[[int], torch.Tensor]:
        take = session.blobs.take
        refused = self._refused.get(session.id)

        def taker(ident: int) -> torch.Tensor:
            self._blobs_taken += 1
            if refused is not None and ident in refused:
                raise refused.pop(ident)
            tensor = take(ident)
            self._taken.append((ident, tensor))
            return tensor

        return taker

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

    def _assign(self, session: Session, result: Any, outs: Any) -> Any:
        torch = self.torch
        if outs is None:
            return encode_result(_scalar(result))
        if type(outs) is not list:
            raise ProtocolError("op outs must be a list or null")
        values = result if isinstance(result, tuple) else (result,)
        if len(outs) != len(values):
            raise ProtocolError("op outs do not match the op's results")
        meta: list[Any] = []
        for value, spec in zip(values, outs):
            if isinstance(value, torch.Tensor):
                if spec is not None:
                    session.handles.put(spec, value)
                meta.append(None)
            elif isinstance(value, (list, tuple)) and all(
                isinstance(v, torch.Tensor) for v in value
            ):
                if type(spec) is not list or len(spec) != len(value):
                    raise ProtocolError("op outs do not match a list of results")
                for v, h in zip(value, spec):
                    if h is not None:
                        session.handles.put(h, v)
                meta.append(None)
            elif spec is not None:  # a handle for what is not a tensor
                raise ProtocolError("op outs do not match the op's results")
            else:
                meta.append(encode_result(_scalar(value)))
        return None if all(m is None for m in meta) else meta

    def _switch_rng(self, session: Session) -> None:
        if self._rng_owner is session:
            return
        torch = self.torch
        previous = self._rng_owner
        if previous is not None and not previous.closed:
            previous.rng_state = rng_state(torch, self.device)
        if session.rng_state is not None:
            set_rng_state(torch, self.device, session.rng_state)
        elif session.seed is not None:
            seed_device(torch, self.device, session.seed)
        self._rng_owner = session

    # ---- tracing ---------------------------------------------------------------------------------


_DONE_OK = HEADER.pack(DONE_OK_BODY.size, MsgType.DONE_OK)


def _done_frame(seq: int, t: tuple[int, ...]) -> bytes:
    """The DONE of a batch with no error and no results (integers only: no escaping)."""
    body = b'{"seq":%d,"ok":true,"error":null,"results":{},"t":[%d,%d,%d,%d,%d]}' % (seq, *t)
    return HEADER.pack(len(body), MsgType.DONE) + body


def _name(op: object) -> str:
    """An op's name for its span and its error (``?`` where it has none)."""
    if type(op) is TOp:
        return op.t.name[:200]
    return op[0][:200] if type(op) is list and op and type(op[0]) is str else "?"


def _scalar(value: Any) -> Any:
    torch = __import__("torch")
    if isinstance(value, torch.Tensor):
        raise OpError("a tensor result needs an output handle")
    return value


def _entry(target: Any) -> tuple[Any, Any, bool, bool, bool, Any]:
    """What the executor needs to know of an ATen op, worked out once per op name.

    ``sized``: it takes a size argument (checked against a plain bound first). ``rerunnable``:
    it changes none of its inputs, so it may run again after its outputs were refused.
    ``seeded``: it draws random numbers (a re-run restores the generator first). ``size``: how
    :class:`~gpu_trace.runtime.server.sizing.Sizing` works out what it allocates (None: it returns
    no tensor).
    """
    import torch

    schema = target._schema
    arguments = schema.arguments
    sized = any(a.name in ("size", "sizes") for a in arguments)
    rerunnable = "batch_norm" not in schema.name and not any(  # batch norm's running stats
        a.alias_info is not None and a.alias_info.is_write for a in arguments
    )
    seeded = torch.Tag.nondeterministic_seeded in target.tags
    # The overload's own C++ callable: calling the OpOverload adds a Python frame per op.
    call = getattr(target, "_op", target)
    return call, allowlist.rule(target), sized, rerunnable, seeded, sizer(target)


def _page_in(
    pager: Pager, session: Session, head: dict[str, Any], ops: list[Any]
) -> tuple[list[Any], Gate | None]:
    """A paged-out session comes back: each op waits for its own inputs only (the gate)."""
    if any(type(op) is TOp for op in ops):  # the pager reads JSON ops
        ops = head["ops"] = [op.materialize() if type(op) is TOp else op for op in ops]
    return ops, pager.begin_batch(session, ops)


def _batch_head(head: Any) -> tuple[int, list[Any], list[Any]]:
    """A batch's ``seq``, ``ops`` and ``free`` list, checked."""
    seq = head.get("seq")
    ops = head.get("ops", [])
    frees = head.get("free", [])
    if type(seq) is not int or type(ops) is not list or type(frees) is not list:
        raise ProtocolError("batch needs an integer seq and lists ops and free")
    if len(ops) > MAX_BATCH_OPS or len(frees) > MAX_FREES:
        raise ProtocolError("batch too large")
    return seq, ops, frees


def _free_early(session: Session, work: Work, ops: list[Any], index: int, frees: list[Any]) -> bool:
    """Free now the handles of the batch's ``free`` list that its ops from ``index`` on do not
    name (the client freed them before it sent the batch; they are freed after its ops, unless
    an op is refused for memory). True if there were any. Done once per batch."""
    if not frees or work.resume is not None and work.resume.freed_early:
        return False
    if work.resume is None:
        work.resume = Parked()
    work.resume.freed_early = True
    named: set[int] = set()
    _ints(ops[index:], named, 0)
    before = session.account.bytes
    for handle in frees:
        if type(handle) is int and handle not in named:
            session.free(handle)
    return session.account.bytes < before


def _ints(value: Any, out: set[int], depth: int) -> None:
    """Every integer in an op list (handles, graph ids and sizes alike: a superset is safe)."""
    t = type(value)
    if t is int:
        out.add(value)
    elif t is TOp:
        out.update(value.vals)
    elif t is list and depth < 16:
        for v in value:
            _ints(v, out, depth + 1)
    elif t is dict and depth < 16:
        for v in value.values():
            _ints(v, out, depth + 1)


def _out_hole(o: object) -> bool:
    """An output of a template a plan takes: a hole, none, or a list of them (a list result:
    ``_foreach_sqrt``, ``split``)."""
    return o is None or type(o) is int or type(o) is list and all(_out_hole(x) for x in o)


def _filled(out: object, vals: list[int]) -> object:
    """A template's output hole filled with its call's handle number (lists: each)."""
    if type(out) is int:
        return vals[out]
    if type(out) is list:
        return [_filled(o, vals) for o in out]
    return None


def _is_hole(v: object) -> bool:
    """A template's tensor hole, ``{"xh": k}``."""
    return type(v) is dict and len(v) == 1 and "xh" in v


def _idents(args: list[object], kwargs: dict[str, object]) -> list[int]:
    """The handles a JSON op names as arguments, top level and keyword (``out=``)."""
    out = []
    for v in (*args, *kwargs.values()):
        if type(v) is dict and len(v) == 1 and type(v.get("h")) is int:
            out.append(v["h"])
    return out


def _handles(outs: Any) -> list[int]:
    """The handle numbers in an op's ``outs`` (nested lists, None for results not kept)."""
    if type(outs) is int:
        return [outs]
    if type(outs) is list:
        return [h for o in outs for h in _handles(o)]
    return []
