"""Op templates: an op's wire form with its handle numbers left out, sent once per signature.

Two calls of an op with the same signature (the shape cache's key: the op, its tensors' dtypes,
shapes, strides and offsets, and every other argument's value) differ only in the handle numbers
they name: their inputs, uploads and outputs. So the client sends the wire form of the first one
as a template, ``[id, name, args, kwargs, outs, holes]``, in the ``defs`` of a batch's JSON
header, with each handle replaced by a hole (``{"xh": k}`` for tensor handle ``k`` of the
op's numbers, ``{"xb": k}`` for an upload, ``k`` itself in ``outs``); every later call is the
template's id and its numbers, int64s in the batch's binary op stream::

    op stream: (id, number, ...)*        an id of 0: the next op of the header's JSON ``ops``

Templates are data, like the rest of a message: the server validates a definition when it
arrives (bounded, holes numbered in range), fills it in with checked numbers, and decodes the
result like any JSON op (a template whose arguments are constants and top-level tensors skips
that: its constants are decoded once, its tensors looked up per call).
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

from gpu_trace.runtime.protocol.wire import MAX_BATCH_OPS, MAX_LIST, ProtocolError

#: Most templates one session may define (a client past it sends JSON ops).
MAX_TEMPLATES = 1 << 18
#: Most handle numbers in one template.
MAX_HOLES = 4096
#: Most JSON values (:func:`weight`) in one template, and in all of a session's: templates stay
#: for the session's life, so what they may hold is bounded (a client sends a larger op, or any
#: op past the session's total, as JSON).
MAX_TEMPLATE_NODES = 4096
MAX_SESSION_NODES = 1 << 21

_SWAP = sys.byteorder != "little"


# ---- client --------------------------------------------------------------------------------------


def make_template(tid: int, name: str, args: list, kwargs: dict, outs: Any) -> list[Any]:
    """The definition of the wire op ``[name, args, kwargs, outs]``: its handles, in the order
    :func:`numbers` finds them, replaced by holes."""
    count = [0]

    def hole(tag: str) -> dict[str, int]:
        count[0] += 1
        return {tag: count[0] - 1}

    def walk(v: Any) -> Any:
        t = type(v)
        if t is dict and len(v) == 1:
            if "h" in v:
                return hole("xh")
            if "b" in v:
                return hole("xb")
            return v
        if t is list:
            return [walk(x) for x in v]
        if t is dict:
            return {k: walk(x) for k, x in v.items()}
        return v

    def walk_outs(v: Any) -> Any:
        if type(v) is int:
            count[0] += 1
            return count[0] - 1
        if type(v) is list:
            return [walk_outs(x) for x in v]
        return v

    targs = walk(args)
    tkwargs = {k: walk(v) for k, v in kwargs.items()}
    touts = walk_outs(outs)
    return [tid, name, targs, tkwargs, touts, count[0]]


def numbers(args: list, kwargs: dict, outs: Any) -> list[int]:
    """The handle numbers of a wire op, in its template's hole order (see :func:`make_template`)."""
    out: list[int] = []

    def walk(v: Any) -> None:
        t = type(v)
        if t is dict:
            if len(v) == 1 and ("h" in v or "b" in v):
                out.append(v.get("h", v.get("b")))
            else:
                for x in v.values():
                    walk(x)
        elif t is list:
            for x in v:
                walk(x)

    def walk_outs(v: Any) -> None:
        if type(v) is int:
            out.append(v)
        elif type(v) is list:
            for x in v:
                walk_outs(x)

    walk(args)
    for v in kwargs.values():
        walk(v)
    walk_outs(outs)
    return out


def weight(value: Any) -> int:
    """The number of JSON values in ``value`` (containers and scalars alike)."""
    t = type(value)
    if t is list:
        return 1 + sum(weight(v) for v in value)
    if t is dict:
        return 1 + sum(weight(v) for v in value.values())
    return 1


# ---- server --------------------------------------------------------------------------------------


class Templates(dict):
    """A session's templates by id, and the JSON values they hold (``nodes``)."""

    nodes = 0


class Template:
    """A validated definition; ``prep`` is the executor's decoded form (made on first use)."""

    __slots__ = ("name", "args", "kwargs", "outs", "holes", "prep")

    def __init__(self, name: str, args: list, kwargs: dict, outs: Any, holes: int) -> None:
        self.name = name
        self.args = args
        self.kwargs = kwargs
        self.outs = outs
        self.holes = holes
        self.prep: Any = None


class TOp:
    """One call of a template: the template and its handle numbers."""

    __slots__ = ("t", "vals")

    def __init__(self, t: Template, vals: list[int]) -> None:
        self.t = t
        self.vals = vals

    def materialize(self) -> list[Any]:
        """The call as a JSON op ``[name, args, kwargs, outs]`` (decoded like any other)."""
        t, vals = self.t, self.vals

        def fill(v: Any) -> Any:
            tv = type(v)
            if tv is dict:
                if len(v) == 1:
                    if "xh" in v:
                        return {"h": vals[v["xh"]]}
                    if "xb" in v:
                        return {"b": vals[v["xb"]]}
                return {k: fill(x) for k, x in v.items()}
            if tv is list:
                return [fill(x) for x in v]
            return v

        def fill_outs(v: Any) -> Any:
            if type(v) is int:
                return vals[v]
            if type(v) is list:
                return [fill_outs(x) for x in v]
            return v

        return [t.name, fill(t.args), {k: fill(x) for k, x in t.kwargs.items()}, fill_outs(t.outs)]


def define(templates: Templates, defs: Any) -> None:
    """Validate and add a batch's ``defs`` to a session's ``templates``."""
    if type(defs) is not list or len(defs) > MAX_BATCH_OPS:
        raise ProtocolError(f"field 'defs' must be a list of at most {MAX_BATCH_OPS} items")
    for d in defs:
        if type(d) is not list or len(d) != 6:
            raise ProtocolError("a template is [id, name, args, kwargs, outs, holes]")
        tid, name, args, kwargs, outs, holes = d
        if type(tid) is not int or not 0 < tid <= MAX_TEMPLATES or tid in templates:
            raise ProtocolError(f"template ids are new integers in [1, {MAX_TEMPLATES}]")
        if type(name) is not str or len(name) > 256:
            raise ProtocolError("a template's op name must be a string")
        if type(args) is not list or type(kwargs) is not dict:
            raise ProtocolError("a template's args must be a list and its kwargs an object")
        if type(holes) is not int or not 0 <= holes <= MAX_HOLES:
            raise ProtocolError(f"a template has at most {MAX_HOLES} holes")
        seen: list[int] = []
        _holes(args, seen, 0)
        _holes(kwargs, seen, 0)
        _out_holes(outs, seen, 0)
        if sorted(seen) != list(range(holes)):
            raise ProtocolError("a template's holes must be numbered 0..holes-1, each once")
        nodes = weight(d)
        if nodes > MAX_TEMPLATE_NODES or templates.nodes + nodes > MAX_SESSION_NODES:
            raise ProtocolError("template too large, or the session's templates hold too much")
        templates.nodes += nodes
        templates[tid] = Template(name, args, kwargs, outs, holes)


def has_hole(v: Any) -> bool:
    """Whether a (defined, so valid) template argument holds a hole anywhere."""
    seen: list[int] = []
    _holes(v, seen, 0)
    return bool(seen)


def _holes(v: Any, seen: list[int], depth: int) -> None:
    if depth > 8:
        raise ProtocolError("template nested too deeply")
    t = type(v)
    if t is dict:
        if len(v) == 1 and ("xh" in v or "xb" in v):
            k = v.get("xh", v.get("xb"))
            if type(k) is not int or not 0 <= k < MAX_HOLES:
                raise ProtocolError("a template hole is {xh|xb: index}")
            seen.append(k)
        else:
            for x in v.values():
                _holes(x, seen, depth + 1)
    elif t is list:
        if len(v) > MAX_LIST:
            raise ProtocolError("list argument too long")
        for x in v:
            _holes(x, seen, depth + 1)


def _out_holes(v: Any, seen: list[int], depth: int) -> None:
    t = type(v)
    if t is int:
        if not 0 <= v < MAX_HOLES:
            raise ProtocolError("a template's outs hold hole indices")
        seen.append(v)
    elif t is list and depth < 2 and len(v) <= MAX_LIST:
        for x in v:
            _out_holes(x, seen, depth + 1)
    elif v is not None:
        raise ProtocolError("a template's outs are hole indices, lists of them, or null")


def expand(templates: dict[int, Template], stream: bytes | memoryview, ops: Any) -> list[Any]:
    """A batch's ops in order: the binary op stream with the header's JSON ``ops`` put in."""
    if type(ops) is not list:
        raise ProtocolError("field 'ops' must be a list")
    if len(stream) % 8:
        raise ProtocolError("the op stream is a whole number of int64s")
    arr = array("q")
    arr.frombytes(stream)
    if _SWAP:
        arr.byteswap()
    vals = arr.tolist()
    out: list[Any] = []
    append = out.append
    get = templates.get
    i, j, n = 0, 0, len(vals)
    while i < n:
        tid = vals[i]
        i += 1
        if tid == 0:
            if j >= len(ops):
                raise ProtocolError("the op stream names more JSON ops than the batch has")
            append(ops[j])
            j += 1
            continue
        t = get(tid)
        if t is None:
            raise ProtocolError(f"unknown template {tid}")
        k = i + t.holes
        if k > n:
            raise ProtocolError("the op stream ends inside an op")
        append(TOp(t, vals[i:k]))
        i = k
        if len(out) > MAX_BATCH_OPS:
            raise ProtocolError("batch too large")
    if j != len(ops):
        raise ProtocolError("the batch's JSON ops are not all in its op stream")
    return out
