"""The parts of a batch the executor reads and writes besides running its ops: its head
(:func:`batch_head`), its ops' names for spans and errors (:func:`op_name`), the handles it frees
early to make room (:func:`free_early`), its ops' inputs paged back in (:func:`page_in`), and its
DONE reply (:func:`reply`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpu_trace.runtime.protocol.templates import TOp
from gpu_trace.runtime.protocol.wire import (
    DONE_OK_BODY,
    HEADER,
    MAX_BATCH_OPS,
    MAX_FREES,
    MsgType,
    ProtocolError,
    done_value_frame,
    json_frame,
)
from gpu_trace.runtime.sharing.scheduler import Parked, Work
from gpu_trace.runtime.sharing.sessions import Session

if TYPE_CHECKING:
    from gpu_trace.runtime.sharing.pager import Pager
    from gpu_trace.runtime.sharing.restore import Gate

__all__ = ["batch_head", "op_name", "free_early", "page_in", "reply", "done_frame"]

DONE_OK = HEADER.pack(DONE_OK_BODY.size, MsgType.DONE_OK)


def done_frame(seq: int, t: tuple[int, ...]) -> bytes:
    """The DONE of a batch with no error and no results (integers only: no escaping)."""
    body = b'{"seq":%d,"ok":true,"error":null,"results":{},"t":[%d,%d,%d,%d,%d]}' % (seq, *t)
    return HEADER.pack(len(body), MsgType.DONE) + body


def reply(
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
            reply = DONE_OK + DONE_OK_BODY.pack(seq, *t)
        else:  # one number (``.item()``...); None for any other value
            ((index, value),) = results.items()
            reply = done_value_frame(seq, t, int(index), value)
    if reply is not None:
        session.send(reply)
    elif error is None and not results:  # the same JSON each time, formatted directly
        session.send(done_frame(seq, t))
    else:
        done = {"seq": seq, "ok": error is None, "error": error, "results": results, "t": t}
        session.send(json_frame(MsgType.DONE, done))


def op_name(op: object) -> str:
    """An op's name for its span and its error (``?`` where it has none)."""
    if type(op) is TOp:
        return op.t.name[:200]
    return op[0][:200] if type(op) is list and op and type(op[0]) is str else "?"


def batch_head(head: Any) -> tuple[int, list[Any], list[Any]]:
    """A batch's ``seq``, ``ops`` and ``free`` list, checked."""
    seq = head.get("seq")
    ops = head.get("ops", [])
    frees = head.get("free", [])
    if type(seq) is not int or type(ops) is not list or type(frees) is not list:
        raise ProtocolError("batch needs an integer seq and lists ops and free")
    if len(ops) > MAX_BATCH_OPS or len(frees) > MAX_FREES:
        raise ProtocolError("batch too large")
    return seq, ops, frees


def page_in(
    pager: Pager, session: Session, head: dict[str, Any], ops: list[Any]
) -> tuple[list[Any], Gate | None]:
    """A paged-out session comes back: each op waits for its own inputs only (the gate)."""
    if any(type(op) is TOp for op in ops):  # the pager reads JSON ops
        ops = head["ops"] = [op.materialize() if type(op) is TOp else op for op in ops]
    return ops, pager.begin_batch(session, ops)


def free_early(session: Session, work: Work, ops: list[Any], index: int, frees: list[Any]) -> bool:
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
