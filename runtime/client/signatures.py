"""What the client knows of each op signature it has seen: the ready plan of its results
(:class:`One` new tensor, :class:`Many` other results, :class:`Call` a non-tensor result or
none), cached by signature key in the shape cache (:data:`cache`), and the value-blind
signatures whose float arguments change at every call (:func:`miss`: after
:data:`VOLATILE_AFTER` values, one plan serves them all and the op goes as JSON).
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_trace.runtime.client import profiler_memory
from gpu_trace.runtime.client.connection import Connection
from gpu_trace.runtime.protocol.shapes import (
    DYNAMIC,
    MAX_PLANS,
    RESIZED,
    NewTensor,
    ShapeCache,
)

__all__ = ["cache", "One", "Many", "Call", "VOLATILE_AFTER", "miss", "make_plan"]

#: Output metadata by op signature, and the ready plans (``cache.plans``).
cache = ShapeCache()


class One:
    """A plan made ready: the op's one result is a new tensor (``contiguous``: its strides are
    those a new tensor of its shape gets, so the wrapper is made without giving them).

    ``tid``: the op's template in the session whose ``epoch`` is ``tepoch`` (0: none there).
    """

    __slots__ = (
        "shape", "dtype", "stride", "offset", "sig", "contiguous", "tid", "tepoch", "nbytes"
    )  # fmt: skip

    def __init__(
        self, dtype: Any, shape: tuple, stride: tuple, offset: int, owns: bool = True
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.stride = stride
        self.offset = offset
        self.sig = (dtype, shape, stride, offset)
        self.contiguous = offset == 0 and _contiguous_strides(shape) == stride
        self.tid = 0
        self.tepoch = 0
        #: Its result's storage bytes (0: the result is a view of an input).
        self.nbytes = profiler_memory.storage_bytes(dtype, shape, stride, offset) if owns else 0


class Many:
    """A plan made ready for any other results: ``described`` as the shape cache describes
    them (:mod:`gpu_trace.runtime.protocol.shapes`); ``tid``/``tepoch`` as :class:`One`'s."""

    __slots__ = ("is_tuple", "described", "tid", "tepoch", "owns")

    def __init__(self, is_tuple: bool, described: tuple, owns: bool = True) -> None:
        self.is_tuple = is_tuple
        self.described = described
        self.tid = 0
        self.tepoch = 0
        self.owns = owns  # its new results have storages of their own (the op makes no views)


class Call:
    """The plan of an op with a non-tensor result (``.item()``, ``bool()``...: run at once) or
    none (in place, issued without waiting); ``tid``/``tepoch`` as :class:`One`'s."""

    __slots__ = ("tid", "tepoch")

    def __init__(self) -> None:
        self.tid = 0
        self.tepoch = 0


#: Signatures that differ only in float values a value-blind op may take, each with its plan
#: and template, before its calls with new values go as JSON ops (see :func:`miss`).
VOLATILE_AFTER = 4


class Seen:
    """A value-blind signature: how many float values it took, and the twin of its first plan
    (the same results, no template: sent as JSON)."""

    __slots__ = ("count", "twin")

    def __init__(self, twin: One | Many | Call) -> None:
        self.count = 1
        self.twin = twin


#: Per value-blind key, what was seen of it.
_blind: dict[object, Seen] = {}
#: Per op, by ``id(op)``: whether float arguments leave its results' metadata alone.
_value_blind: dict[int, bool] = {}
_FLOAT = (float,)


def _blind_key(k: object) -> object:
    """A signature key with every float's value left out."""
    if type(k) is tuple:
        if len(k) == 2 and k[0] is float:
            return _FLOAT
        return tuple([_blind_key(x) for x in k])
    return k


def _is_value_blind(func: torch._ops.OpOverload, kind: str) -> bool:
    """Ops whose float arguments cannot change what their results look like: those returning
    nothing, pointwise ones (ATen's ``pointwise`` tag: the result is the broadcast of the
    tensor inputs; a float's type counts, which the key keeps, not its value) and foreach ones
    (each result shaped as its input). Not ``arange``, ``upsample_*.vec`` and the like."""
    blind = _value_blind.get(id(func))
    if blind is None:
        blind = kind == "none" or str(func.name()).startswith("aten::_foreach_")
        blind = blind or torch.Tag.pointwise in getattr(func, "tags", ())
        _value_blind[id(func)] = blind
    return blind


def miss(
    c: Connection,
    func: torch._ops.OpOverload,
    args: tuple,
    kwargs: dict,
    key: tuple,
    name: str,
    kind: str,
) -> One | Many | Call | str:
    """The plan of a signature not in the cache.

    A float that changes at every step (an optimizer's bias corrections, a learning-rate
    schedule: ``param.add_(buf, alpha=-lr)``) makes a new signature at every call: a ``meta``
    run (hundreds of µs), a cache entry and a template each time, until the cache starts over
    and the session may define no more. For ops whose floats cannot change their results'
    metadata, once a signature has taken :data:`VOLATILE_AFTER` float values, a new one reuses
    the plan of the first (no ``meta`` run) and goes as a JSON op: no entry, no template.
    """
    bkey = _blind_key(key) if _is_value_blind(func, kind) else key
    entry = _blind.get(bkey) if bkey != key else None
    if entry is not None:
        entry.count += 1
        if entry.count > VOLATILE_AFTER:
            twin = entry.twin
            twin.tepoch = c.epoch  # its tid stays 0: the op goes as JSON
            return twin
    plan = Call() if kind != "tensor" else make_plan(func, args, kwargs, key, name)
    if kind != "tensor":
        cache.put(key, plan)
    if bkey != key and entry is None and not isinstance(plan, str):  # not DYNAMIC
        if len(_blind) >= MAX_PLANS:
            _blind.clear()
        _blind[bkey] = Seen(_twin(plan))
    return plan


def _twin(plan: One | Many | Call) -> One | Many | Call:
    """A plan like ``plan`` with no template of its own."""
    if type(plan) is One:
        return One(plan.dtype, plan.shape, plan.stride, plan.offset, plan.nbytes > 0)
    if type(plan) is Many:
        return Many(plan.is_tuple, plan.described, plan.owns)
    return Call()


def make_plan(func: Any, args: tuple, kwargs: dict, key: tuple, name: str) -> Any:
    """Compute, make ready and cache the plan of a signature not seen yet (or raise)."""
    plan = cache.plan(func, args, kwargs, None)
    if plan is RESIZED:
        raise NotImplementedError(
            f"{name} would change a remote tensor's shape in place; use the functional form"
        )
    if plan is not DYNAMIC:
        is_tuple, described = plan
        owns = profiler_memory.allocates(func)
        if not is_tuple and len(described) == 1 and type(described[0]) is NewTensor:
            dtype, shape, stride, offset = described[0]
            plan = One(dtype, shape, stride, offset, owns)
        else:
            plan = Many(is_tuple, described, owns)
    cache.put(key, plan)
    return plan


def _contiguous_strides(shape: tuple) -> tuple:
    """The strides ``_make_wrapper_subclass`` gives a tensor of ``shape`` when given none."""
    return tuple(torch.empty(shape, device="meta").stride())
