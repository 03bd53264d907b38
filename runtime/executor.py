"""The server's executor: one thread owns the device and runs the sessions' work in turn.

Connections put work (uploads, batches, close) into a :class:`Scheduler`; the executor takes one
item at a time and runs it. Which session goes next is the scheduler's policy: the seam for
sharing (issue #6). :class:`FifoScheduler`, the default, serves work in arrival order.

Everything that touches a session's tables happens on this thread, so they need no locks. The
random generator's state is switched with the session, so tenants never share a random stream.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from gpu_trace.runtime import allowlist
from gpu_trace.runtime.session import OpError, Session
from gpu_trace.runtime.values import ArgDecoder, encode_result, tensor_bytes
from gpu_trace.runtime.wire import (
    CHUNK_BYTES,
    MAX_BATCH_OPS,
    MAX_FREES,
    MsgType,
    ProtocolError,
    chunk_frames,
    frame,
    json_frame,
    split_frame,
)
from gpu_trace.tracer.context import parse_traceparent

log = logging.getLogger(__name__)

now_ns = time.perf_counter_ns

#: Largest tensor a factory op may create, as a multiple of nothing: a plain byte bound.
MAX_FACTORY_BYTES = 64 << 30


@dataclass
class Work:
    """One unit of a session's work, in the order its connection received it."""

    kind: str  # "batch", "put", "put-inline", "chunk", "bye", "close"
    head: Any = None
    data: Any = None
    recv_start_ns: int = 0
    recv_end_ns: int = 0
    done: threading.Event | None = None


class Scheduler(Protocol):
    """The scheduling policy seam: which session's work runs next."""

    def submit(self, session: Session, work: Work) -> None: ...

    def take(self, timeout: float) -> tuple[Session, Work] | None: ...

    def wait(self, timeout: float) -> bool:
        """Wait until some work is queued; False on timeout."""
        ...

    def drop(self, session: Session) -> None: ...

    def depth(self) -> int: ...


class FifoScheduler:
    """Work in arrival order, whatever the session."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Session, Work]] = collections.deque()
        self._cond = threading.Condition()

    def submit(self, session: Session, work: Work) -> None:
        with self._cond:
            self._queue.append((session, work))
            self._cond.notify()

    def take(self, timeout: float) -> tuple[Session, Work] | None:
        with self._cond:
            if not self._queue and timeout > 0:
                self._cond.wait(timeout)
            return self._queue.popleft() if self._queue else None

    def wait(self, timeout: float) -> bool:
        with self._cond:
            if not self._queue:
                self._cond.wait(timeout)
            return bool(self._queue)

    def drop(self, session: Session) -> None:
        with self._cond:
            kept = [(s, w) for s, w in self._queue if s is not session or w.kind == "close"]
            self._queue.clear()
            self._queue.extend(kept)

    def depth(self) -> int:
        return len(self._queue)


class Executor:
    """Runs work items on the device, one at a time."""

    def __init__(self, device: str, scheduler: Scheduler) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.scheduler = scheduler
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng_owner: Session | None = None
        self._ops: dict[str, tuple[Any, Any, bool]] = {}
        self.batches = 0
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
        try:
            self.run(session, work)
        except Exception:  # a bug here must not take the server down
            log.exception("gpu-trace serve: session %d: work failed", session.id)

    def run(self, session: Session, work: Work) -> None:
        if work.kind == "close":
            if self._rng_owner is session:
                self._rng_owner = None
            session.close()
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
                    send_trace(session)
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
            self._trace(session, head, work, execute_id, exec_start, exec_end, op_spans, len(ops))

    def _op(self, session: Session, decoder: ArgDecoder, op: Any) -> Any:
        if type(op) is not list or len(op) != 4:
            raise ProtocolError("an op is [name, args, kwargs, outs]")
        name, args, kwargs, outs = op
        entry = self._ops.get(name)
        if entry is None:
            if type(name) is not str:
                raise ProtocolError("op name must be a string")
            if name.startswith("rt::"):
                return self._pseudo(session, decoder, name, args, outs)
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

    def _pseudo(
        self, session: Session, decoder: ArgDecoder, name: str, args: Any, outs: Any
    ) -> Any:
        torch = self.torch
        if type(args) is not list:
            raise ProtocolError("op args must be a list")
        if name == "rt::fetch":  # send a tensor's bytes back: DATA, then CHUNKs if large
            if len(args) != 2 or type(args[1]) is not int:
                raise ProtocolError("rt::fetch takes [handle, fetch id]")
            tensor = decoder.decode(args[0])
            if not isinstance(tensor, torch.Tensor):
                raise OpError("rt::fetch needs a tensor")
            data = tensor_bytes(tensor.detach().to("cpu"))
            head = {
                "fetch": args[1],
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "nbytes": len(data),
            }
            if len(data) <= CHUNK_BYTES:
                session.send(*split_frame(MsgType.DATA, head, [data]))
            else:
                session.send(*split_frame(MsgType.DATA, head, []), *chunk_frames(args[1], data))
            return None
        if name == "rt::meta":  # the shape of outputs whose shape depends on data
            tensor = decoder.decode(args[0]) if args else None
            if not isinstance(tensor, torch.Tensor):
                raise OpError("rt::meta needs a tensor")
            return [
                list(tensor.shape),
                list(tensor.stride()),
                tensor.storage_offset(),
                str(tensor.dtype).removeprefix("torch."),
            ]
        if name == "rt::seed":
            if len(args) != 1 or type(args[0]) is not int:
                raise ProtocolError("rt::seed takes [seed]")
            _seed(torch, self.device, args[0] & 0xFFFFFFFFFFFFFFFF)
            session.seed = None
            self._rng_owner = session
            return None
        if name == "rt::fn":
            return self._function(session, decoder, args, outs)
        if name == "rt::backward":
            return self._backward(session, decoder, args, outs)
        if name == "rt::sync":
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return None
        if name == "rt::memory":
            return [session.account.bytes, session.account.peak_bytes, len(session.handles)]
        raise OpError(f"unknown runtime op {name[:100]!r}")

    def _function(self, session: Session, decoder: ArgDecoder, args: Any, outs: Any) -> Any:
        """``rt::fn``: a whole function (``runtime.composites``), its graph kept for backward."""
        from gpu_trace.runtime import composites

        torch = self.torch
        if len(args) != 5 or type(args[3]) is not list or type(args[4]) is not int:
            raise ProtocolError("rt::fn takes [name, args, kwargs, grad mask, graph id]")
        name, fargs, fkwargs, mask, graph_id = args
        fn = composites.server_function(name)
        if fn is None:
            raise OpError(f"function {str(name)[:100]!r} is not one the server runs whole")
        if type(fargs) is not list or type(outs) is not list:
            raise ProtocolError("rt::fn arguments and outs must be lists")
        a = decoder.decode_args(fargs)
        k = decoder.decode_kwargs(fkwargs) if fkwargs else {}
        leaves: list[Any] = []
        position = [0]

        def leaf(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                i = position[0]
                position[0] += 1
                if i < len(mask) and mask[i] is True:
                    x = x.detach().requires_grad_()
                    leaves.append(x)
                return x
            if type(x) in (list, tuple):
                return type(x)(leaf(v) for v in x)
            return x

        a = [leaf(x) for x in a]
        k = {key: leaf(v) for key, v in k.items()}
        with torch.set_grad_enabled(bool(leaves)):
            out = fn(*a, **k)
        flat = list(out) if isinstance(out, tuple) else [out]
        if len(flat) != len(outs) or not all(isinstance(o, torch.Tensor) for o in flat):
            raise ProtocolError("rt::fn outs do not match the function's results")
        for o, h in zip(flat, outs):
            session.handles.put(h, o.detach())
        if leaves and graph_id:
            session.add_graph(graph_id, (leaves, flat))
        return None

    def _backward(self, session: Session, decoder: ArgDecoder, args: Any, outs: Any) -> Any:
        """``rt::backward``: gradients of a kept graph's leaves, given its outputs' gradients."""
        torch = self.torch
        if len(args) != 2 or type(args[0]) is not int or type(args[1]) is not list:
            raise ProtocolError("rt::backward takes [graph id, output grads]")
        if type(outs) is not list:
            raise ProtocolError("rt::backward outs must be a list")
        leaves, outputs = session.take_graph(args[0])
        grads = decoder.decode_args(args[1])
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        result = torch.autograd.grad(
            [o for o, _ in pairs],
            leaves,
            [g for _, g in pairs],
            allow_unused=True,
            materialize_grads=True,
        )
        wanted = [h for h in outs if h is not None]
        if len(wanted) != len(result):
            raise ProtocolError("rt::backward outs do not match the graph's inputs")
        for h, g in zip(wanted, result):
            session.handles.put(h, g.contiguous())
        return None

    def _switch_rng(self, session: Session) -> None:
        if self._rng_owner is session:
            return
        torch = self.torch
        previous = self._rng_owner
        if previous is not None and not previous.closed:
            previous.rng_state = _rng_state(torch, self.device)
        if session.rng_state is not None:
            _set_rng_state(torch, self.device, session.rng_state)
        elif session.seed is not None:
            _seed(torch, self.device, session.seed)
        self._rng_owner = session

    # ---- tracing ---------------------------------------------------------------------------------

    def _trace(
        self,
        session: Session,
        head: dict[str, Any],
        work: Work,
        execute_id: int,
        exec_start: int,
        exec_end: int,
        op_spans: list[tuple[str, int, int]],
        n_ops: int,
    ) -> None:
        slog = session.log
        parsed = parse_traceparent(head.get("tp")) if type(head.get("tp")) is str else None
        parent = int(parsed[1], 16) if parsed else 0
        seq = str(head.get("seq"))
        slog.span(
            slog.new_id(),
            parent,
            "server/receive",
            "receive",
            work.recv_start_ns,
            work.recv_end_ns,
            {"seq": seq},
        )
        slog.span(
            slog.new_id(),
            parent,
            "server/queue",
            "queue",
            work.recv_end_ns,
            exec_start,
            {"seq": seq},
        )
        slog.span(
            execute_id,
            parent,
            "server/execute",
            "execute",
            exec_start,
            exec_end,
            {"seq": seq, "ops": str(n_ops)},
        )
        for name, t0, t1 in op_spans:
            slog.span(0, execute_id, "server/op", name, t0, t1)
        reply_end = now_ns()
        slog.span(slog.new_id(), parent, "server/reply", "reply", exec_end, reply_end, {"seq": seq})
        labels = {"session": str(session.id)}
        if reply_end - slog.last_sent_ns > 200_000_000 or len(slog.spans) > 20000:
            slog.counter("session_memory_bytes", reply_end, float(session.account.bytes), labels)
            slog.counter("session_handles", reply_end, float(len(session.handles)), labels)
            slog.counter("queue_depth", reply_end, float(self.scheduler.depth()), labels)
            slog.last_sent_ns = reply_end
            send_trace(session)


def send_trace(session: Session) -> None:
    """Ship the session's accumulated spans and counters (a TRACE message)."""
    body = session.log.take()
    if body["spans"] or body["counters"]:
        session.send(json_frame(MsgType.TRACE, body))


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


def _seed(torch: Any, device: Any, seed: int) -> None:
    # Not torch.manual_seed: in a process that is also a forwarding client, that would seed the
    # remote device too, from inside the server.
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def _rng_state(torch: Any, device: Any) -> Any:
    if device.type == "cuda":
        return (torch.get_rng_state(), torch.cuda.get_rng_state(device))
    return (torch.get_rng_state(), None)


def _set_rng_state(torch: Any, device: Any, state: Any) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
