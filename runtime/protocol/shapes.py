"""Output metadata of forwarded ops from the ``meta`` device, cached by op and input signature.

Running an op on meta tensors costs 240-450 µs; the same op on inputs of the same dtypes, shapes,
strides and scalar arguments always gives the same output metadata, so a plan is computed once per
signature and then found by one dict lookup. A plan says, for each result, either which input it
is (in-place and ``out=`` ops return an argument) or the dtype, shape, stride and offset of a new
tensor (views included: the server makes the same view).

Ops whose output shape depends on data (``nonzero``, boolean indexing) or that have no meta kernel
get :data:`DYNAMIC`: the client runs them synchronously and asks the server for the shapes.
"""

from __future__ import annotations

import threading
from typing import Any

#: Plan of an op whose outputs cannot be known without running it.
DYNAMIC = "dynamic"
#: Plan of an op that changes an argument's shape or strides in place (``resize_``, ``out=``).
RESIZED = "resized"
#: Most plans kept; past it the cache starts over (signatures with NaN scalars never match).
MAX_PLANS = 20000

_torch: Any = None


def _t() -> Any:
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


class NewTensor(tuple):
    """Plan of a new result: ``(dtype, shape, stride, offset)``."""

    __slots__ = ()


class Alias(int):
    """Plan of a result that is the op's flattened tensor argument number ``int(self)``."""

    __slots__ = ()


class ShapeCache:
    """Plans by ``(op, signature)``; thread-safe (the autograd engine issues from its own thread)."""

    def __init__(self, max_plans: int = MAX_PLANS) -> None:
        #: The plans; read directly on the hot path (one dict lookup). Never replaced: cleared.
        self.plans: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self.max_plans = max_plans
        self.misses = 0

    def __len__(self) -> int:
        return len(self.plans)

    def get(self, key: Any) -> Any:
        return self.plans.get(key)

    def put(self, key: Any, plan: Any) -> None:
        with self._lock:
            if len(self.plans) >= self.max_plans:
                self.plans.clear()
            self.plans[key] = plan
        self.misses += 1

    def plan(self, func: Any, args: tuple, kwargs: dict[str, Any], is_remote: Any) -> Any:
        """Run ``func`` on meta copies of its tensor arguments and describe the results."""
        torch = _t()
        try:
            out, inputs, before = on_meta(func, args, kwargs, _upload_like)
        except Exception:
            return DYNAMIC
        ids = {id(m): i for i, m in enumerate(inputs)}

        def describe(r: Any) -> Any:
            if r is None:  # an undefined optional result (a masked gradient)
                return None
            if isinstance(r, torch.Tensor):
                i = ids.get(id(r))
                if i is not None:
                    if before[i][:3] != (tuple(r.shape), r.stride(), r.storage_offset()):
                        return RESIZED
                    return Alias(i)
                return NewTensor((r.dtype, tuple(r.shape), tuple(r.stride()), r.storage_offset()))
            if isinstance(r, (list, tuple)) and all(
                v is None or isinstance(v, torch.Tensor) for v in r
            ):
                return [describe(v) for v in r]
            return DYNAMIC

        values = out if isinstance(out, tuple) else (out,)
        described = tuple(describe(v) for v in values)
        if any(d is RESIZED for d in described):
            return RESIZED
        if any(d is DYNAMIC for d in described):
            return DYNAMIC
        return (isinstance(out, tuple), described)


def on_meta(
    func: Any, args: Any, kwargs: dict[str, Any], like: Any
) -> tuple[Any, list[Any], list[tuple]]:
    """Run ``func`` on meta copies of its tensor arguments (``like(x)`` makes each), nested in
    lists and tuples too, with devices made ``meta``: the client's plans and the server's sizes
    (:mod:`gpu_trace.runtime.server.sizing`) come from this one runner.

    Returns the result, the meta inputs in argument order, and for each the ``(shape, stride,
    offset, storage bytes)`` it had before the call (an in-place op may change them). Raises what
    the op raises on meta (``NotImplementedError`` where it has no meta kernel).
    """
    torch = _t()
    inputs: list[Any] = []
    before: list[tuple] = []

    def to_meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            m = like(x)
            inputs.append(m)
            before.append(
                (tuple(m.shape), m.stride(), m.storage_offset(), m.untyped_storage().nbytes())
            )
            return m
        if isinstance(x, torch.device):
            return torch.device("meta")
        if isinstance(x, (list, tuple)):
            return type(x)(to_meta(v) for v in x)
        return x

    margs = tuple(to_meta(a) for a in args)
    mkwargs = {k: to_meta(v) for k, v in kwargs.items()}
    if not inputs and "device" not in mkwargs and _takes_device(func):
        # a factory sent without a device would make a real (CPU) tensor here: sized on meta too
        mkwargs["device"] = torch.device("meta")
    return func(*margs, **mkwargs), inputs, before


def _takes_device(func: Any) -> bool:
    """Whether ``func`` (an ATen overload) has a keyword-only ``device`` argument."""
    schema = getattr(func, "_schema", None)
    try:
        return any(a.name == "device" and a.kwarg_only for a in schema.arguments)  # type: ignore[union-attr]
    except AttributeError:
        return False


def _upload_like(x: Any) -> Any:
    """A client's meta copy: a CPU tensor is an upload, and uploads arrive contiguous."""
    if x.device.type == "cpu":
        return _t().empty(x.shape, dtype=x.dtype, device="meta")
    return meta_like(x)


def meta_like(x: Any) -> Any:
    """A meta tensor with ``x``'s dtype, shape, strides and storage offset."""
    torch = _t()
    shape, stride, offset = tuple(x.shape), tuple(x.stride()), x.storage_offset()
    extent = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)
    if any(s == 0 for s in shape):
        extent = offset
    base = torch.empty(max(extent, 0), dtype=x.dtype, device="meta")
    return base.as_strided(shape, stride, offset)
