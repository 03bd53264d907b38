"""The server's executor: one thread owns the device and runs the sessions' work in turn.

Connections put work (uploads, batches, close) into a :class:`~gpu_trace.runtime.scheduler.Scheduler`;
the executor takes one item at a time and runs it (or a connection runs a lone small batch itself
when the device is idle). ATen ops are resolved against the allow-list; the runtime's own
``rt::`` ops are in :mod:`gpu_trace.runtime.pseudo_ops`; each traced batch's spans go to the
server's sink (:mod:`gpu_trace.runtime.sink`).

Everything that touches a session's tables happens on this thread, so they need no locks. The
random generator's state is switched with the session, so tenants never share a random stream.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

from gpu_trace.runtime import allowlist
from gpu_trace.runtime.pseudo_ops import rng_state, run_pseudo, seed_device, set_rng_state
from gpu_trace.runtime.scheduler import PolicyScheduler, Work
from gpu_trace.runtime.session import OpError, Session
from gpu_trace.runtime.sink import ReturnSink, record_batch
from gpu_trace.runtime.values import ArgDecoder, encode_result
from gpu_trace.runtime.wire import (
    MAX_BATCH_OPS,
    MAX_FREES,
    MsgType,
    ProtocolError,
    frame,
    json_frame,
)

log = logging.getLogger(__name__)

now_ns = time.perf_counter_ns

#: Largest tensor a factory op may create, as a multiple of nothing: a plain byte bound.
MAX_FACTORY_BYTES = 64 << 30


class Executor:
    """Runs work items on the device, one at a time."""

    def __init__(self, device: str, scheduler: PolicyScheduler, sink: Any = None) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.scheduler = scheduler
        #: Where traced sessions' spans go (:mod:`gpu_trace.runtime.sink`).
        self.sink = sink if sink is not None else ReturnSink()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng_owner: Session | None = None
        self._ops: dict[str, tuple[Any, Any, bool]] = {}
        self.batches = 0
        #: The session whose work runs now (None: none).
        self.current: Session | None = None
        #: Held while work runs; a connection may run work inline when it is free and nothing
        #: is queued (no hand-off between threads for a lone batch).
        self.lock = threading.Lock()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="gpu-trace-executor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.scheduler.wait(0.2):
                continue
            with self.lock:
                got = self.scheduler.take(0)
                if got is not None:
                    self._run_safely(*got)

    def try_inline(self, session: Session, work: Work) -> bool:
        """Run ``work`` on the calling thread if nothing is queued or running; False if not."""
        if self.scheduler.depth() or not self.lock.acquire(blocking=False):
            return False
        try:
            if self.scheduler.depth():
                return False
            self._run_safely(session, work)
            return True
        finally:
            self.lock.release()

    def _run_safely(self, session: Session, work: Work) -> None:
        self.current = session  # the admin listing's "running"
        try:
            self.run(session, work)
        except Exception:  # a bug here must not take the server down
            log.exception("gpu-trace serve: session %d: work failed", session.id)
        finally:
            self.current = None

    def run(self, session: Session, work: Work) -> None:
        if work.kind == "close":
            if self._rng_owner is session:
                self._rng_owner = None
            if session.trace:
                self.sink.session_closed(session)
            session.close()
            self.scheduler.forget(session)
            return
        if session.closed:
            return
        try:
            if work.kind == "put-inline":
                if type(work.head) is not int or work.head <= 0:
                    raise ProtocolError("blob ids are positive integers")
                session.blobs.add(work.head, *work.data)
            elif work.kind == "bye":
                try:
                    self.sink.export(session, session.log.take())
                    session.send(frame(MsgType.BYE))
                finally:
                    if work.done is not None:
                        work.done.set()
            elif work.kind == "put":
                dtype, shape, nbytes = work.data
                session.blobs.begin(work.head, dtype, shape, nbytes)
            elif work.kind == "chunk":
                ident, offset, data = work.data
                session.blobs.chunk(ident, offset, data)
            elif work.kind == "batch":
                self._batch(session, work)
        except ProtocolError as exc:
            self._fail(session, str(exc))

    def _fail(self, session: Session, message: str) -> None:
        log.info("gpu-trace serve: session %d: protocol error: %s", session.id, message)
        with contextlib.suppress(Exception):
            session.send(json_frame(MsgType.ERROR, {"message": message}))
        session.closed = True

    # ---- batches ---------------------------------------------------------------------------------

    def _batch(self, session: Session, work: Work) -> None:
        head = work.head
        seq = head.get("seq")
        ops = head.get("ops", [])
        frees = head.get("free", [])
        if type(seq) is not int or type(ops) is not list or type(frees) is not list:
            raise ProtocolError("batch needs an integer seq and lists ops and free")
        if len(ops) > MAX_BATCH_OPS or len(frees) > MAX_FREES:
            raise ProtocolError("batch too large")
        self._switch_rng(session)
        exec_start = now_ns()
        decoder = ArgDecoder(session.handles.get, session.blobs.take, self.device)
        results: dict[str, Any] = {}
        error = None
        execute_id = session.log.new_id() if session.trace else 0
        op_spans: list[tuple[str, int, int]] = []
        for index, op in enumerate(ops):
            name = op[0] if type(op) is list and op and type(op[0]) is str else "?"
            try:
                t0 = now_ns()
                value = self._op(session, decoder, op)
                t1 = now_ns()
                if session.trace:
                    op_spans.append((name[:200], t0, t1))
                if value is not None:
                    results[str(index)] = value
            except Exception as exc:  # the op's error goes back to the client, the session goes on
                error = {"index": index, "op": name[:200], "type": type(exc).__name__}
                error["message"] = str(exc)[:4000]
                break
        for handle in frees:
            session.free(handle)
        if self.device.type == "cuda" and (head.get("sync") or error is None and results):
            self.torch.cuda.synchronize(self.device)
        exec_end = now_ns()
        self.scheduler.charge(session, exec_end - exec_start)
        session.batches += 1
        session.ops += len(ops)
        self.batches += 1
        done = {
            "seq": seq,
            "ok": error is None,
            "error": error,
            "results": results,
            "t": [work.recv_start_ns, work.recv_end_ns, exec_start, exec_end, now_ns()],
        }
        session.send(json_frame(MsgType.DONE, done))
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
            )

    def _op(self, session: Session, decoder: ArgDecoder, op: Any) -> Any:
        if type(op) is not list or len(op) != 4:
            raise ProtocolError("an op is [name, args, kwargs, outs]")
        name, args, kwargs, outs = op
        entry = self._ops.get(name)
        if entry is None:
            if type(name) is not str:
                raise ProtocolError("op name must be a string")
            if name.startswith("rt::"):
                return run_pseudo(self, session, decoder, name, args, outs)
            target = allowlist.resolve(name)
            if target is None:
                raise OpError(f"op {name[:200]!r} is not on the server's allow-list")
            sized = any(a.name in ("size", "sizes") for a in target._schema.arguments)
            entry = self._ops[name] = (target, allowlist.RULES.get(target._schema.name), sized)
        target, rule, sized = entry
        if type(args) is not list:
            raise ProtocolError("op args must be a list")
        a = decoder.decode_args(args)
        k = decoder.decode_kwargs(kwargs) if kwargs else {}
        if rule is not None:
            rule(a, k)
        if sized:
            _check_sizes(a, k)
        result = target(*a, **k)
        if type(outs) is list and len(outs) == 1 and type(outs[0]) is int:
            if not isinstance(result, self.torch.Tensor):
                raise ProtocolError("op outs do not match the op's results")
            session.handles.put(outs[0], result)
            if session.account.limit_bytes is not None and session.account.over_limit():
                raise OpError(
                    f"session memory limit of {session.account.limit_bytes} bytes exceeded"
                )
            return None
        return self._assign(session, result, outs)

    def _assign(self, session: Session, result: Any, outs: Any) -> Any:
        torch = self.torch
        if outs is None:
            return encode_result(_scalar(result))
        if type(outs) is not list:
            raise ProtocolError("op outs must be a list or null")
        values = result if isinstance(result, tuple) else (result,)
        if len(outs) != len(values):
            raise ProtocolError("op outs do not match the op's results")
        meta = []
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
            else:
                meta.append(encode_result(_scalar(value)))
        if session.account.over_limit():
            raise OpError(f"session memory limit of {session.account.limit_bytes} bytes exceeded")
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


def _scalar(value: Any) -> Any:
    torch = __import__("torch")
    if isinstance(value, torch.Tensor):
        raise OpError("a tensor result needs an output handle")
    return value


def _check_sizes(args: list[Any], kwargs: dict[str, Any]) -> None:
    """Refuse factory sizes beyond any device's memory before allocating (a cheap bound)."""
    for value in (*args, *kwargs.values()):
        if (
            type(value) is list
            and value
            and len(value) <= 16
            and all(type(v) is int for v in value)
        ):
            numel = 1
            for v in value:
                numel *= max(v, 0)
            if numel * 8 > MAX_FACTORY_BYTES:
                raise OpError(f"a size of {value} elements is beyond the server's limit")
