"""What an op will allocate, known on the server before it runs, so quotas hold before memory moves.

The executor checks every op's new bytes against its tenant's quota and the device's capacity
before running it (:meth:`Sizing.op_bytes`). A client says what it expects an op to make, but a
hostile tenant would lie, so the server works it out itself, from the decoded arguments: the op
runs on meta copies of its tensors (:func:`~gpu_trace.runtime.protocol.shapes.on_meta`, the runner
the client's plans use) and its new storages are summed, with any input storage it grows (``out=``,
``resize_``). The answer depends only on the op and its arguments' signature (tensors' dtype,
shape, strides and offset; every other argument's value), so it is cached by both: a repeated op
costs one key and one dict lookup.

Ops whose output size depends on data have no meta kernel. Those in :data:`BOUNDS` get a sound
upper bound before they run, from their inputs' sizes (``nonzero``, ``masked_select``,
``unique``, boolean indexing) or a cheap reduction of a small input (``repeats.sum()`` for
``repeat_interleave``, ``input.max()`` for ``bincount``). Any other op that cannot run on meta is
refused with a message saying so: no allocation of unknown size goes through.

An op that decomposes into others at the dispatcher (``matmul``, ``einsum``: an honest client's
own dispatcher decomposes them, so only a hostile one sends them) counts every storage its parts
make, temporaries included. What is not bounded: temporaries a kernel makes inside itself, freed
before it returns (docs/sharing.md, "Memory quotas").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.protocol.shapes import ShapeCache, meta_like, on_meta
from gpu_trace.runtime.sharing.memory import allocator_bytes as _rounded

#: Sizes kept; past it the cache starts over.
MAX_SIZES = 20000

_torch: Any = None
_Tensor: Any = None  # torch.Tensor, once torch is loaded


def _t() -> Any:
    global _torch
    if _torch is None:
        import torch

        _torch = torch
    return _torch


class Sizing:
    """Bytes an op will allocate, by op and argument signature (``block``: the allocator's
    rounding of each storage, as :class:`~gpu_trace.runtime.sharing.memory.Memory` counts it)."""

    def __init__(self, block: int = 1, max_sizes: int = MAX_SIZES) -> None:
        self.block = max(1, int(block))
        #: ``(op, signature) -> bytes``; ``misses`` counts meta computations.
        self.cache = ShapeCache(max_sizes)

    def op_bytes(self, sizer: Any, call: Any, args: list[Any], kwargs: dict[str, Any]) -> int:
        """New bytes ``call(*args, **kwargs)`` will hold. ``sizer`` is :func:`sizer`'s: the op's
        name (sized on meta, by signature), or a bound of :data:`BOUNDS`."""
        if type(sizer) is not str:
            return sizer(self, call, args, kwargs)
        key = (sizer, signature(args), signature(kwargs) if kwargs else None)
        n = self.cache.plans.get(key)
        if n is None:
            n = self._measure(sizer, call, args, kwargs)
            self.cache.put(key, n)
        if type(n) is not int:
            raise OpError(n)
        return n

    def _measure(
        self, name: str, call: Any, args: Any, kwargs: dict[str, Any], parts: bool = False
    ) -> int | str:
        """New bytes of ``call`` (named ``name``) on meta; or, where it cannot run there, why (a
        string, cached so that a repeated refusal costs a lookup too). ``parts``: it decomposes
        into other ops at the dispatcher, whose results count too (its temporaries)."""
        torch = _t()
        made: dict[int, Any] = {}
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")  # the real op warns, if it does
                if parts:
                    out, inputs, before = _on_meta_counted(call, args, kwargs, made)
                else:
                    out, inputs, before = on_meta(call, args, kwargs, meta_like)
        except NotImplementedError:
            return (
                f"{name}: the server cannot tell what this op would allocate before it runs "
                "(its output size depends on data, and no bound for it is known), so it does "
                "not run it"
            )
        except Exception as exc:  # what the op itself would say of these arguments
            return f"{type(exc).__name__}: {str(exc)[:2000]}"
        return self.new_bytes([out, *made.values()], inputs, before)

    def new_bytes(self, out: Any, inputs: list[Any], before: list[tuple]) -> int:
        """Bytes of the storages in ``out`` that are not its inputs', plus what inputs' storages
        grew by (``before``: as :func:`~gpu_trace.runtime.protocol.shapes.on_meta` gives it)."""
        torch = _t()
        block = self.block
        grown: dict[int, tuple[Any, int]] = {}
        for m, b in zip(inputs, before):
            storage = m.untyped_storage()
            grown.setdefault(storage._cdata, (storage, b[3]))
        seen: set[int] = set()
        total = 0
        for r in _flat(out, torch.Tensor):
            storage = r.untyped_storage()
            key = storage._cdata
            if key in seen or key in grown:
                continue
            seen.add(key)
            total += _rounded(storage.nbytes(), block)
        for storage, nbytes in grown.values():
            now = storage.nbytes()
            if now > nbytes:
                total += _rounded(now, block) - _rounded(nbytes, block)
        return total


def signature(value: Any) -> Any:
    """A hashable key of decoded arguments: a tensor by dtype, shape, strides and offset,
    anything else by its type and value (``1`` and ``1.0`` make different dtypes)."""
    t = type(value)
    if t is _Tensor:
        return (value.dtype, value.shape, value.stride(), value.storage_offset())
    if t is list or t is tuple:  # most ops' arguments: tensors and numbers, keyed in line
        key: list[Any] = [t]
        for v in value:
            tv = type(v)
            if tv is _Tensor:
                key.append((v.dtype, v.shape, v.stride(), v.storage_offset()))
            elif tv is int or tv is bool:
                key.append((tv, v))
            else:
                key.append(signature(v))
        return tuple(key)
    if t is float:  # NaN equals nothing: keyed by its text, or every call would miss
        return (t, value) if value == value else (t, str(value))
    if t is dict:
        return tuple((k, signature(v)) for k, v in value.items())
    if isinstance(value, _t().Tensor):
        return (value.dtype, value.shape, value.stride(), value.storage_offset())
    return (t, value)


def sizer(target: Any) -> Any:
    """How the executor sizes ``target`` (an ``OpOverload``) before running it: None when it
    returns no tensor (it keeps nothing), its bound in :data:`BOUNDS`, a :func:`_composite`
    bound for an op that decomposes into others, or else its name (sized on meta)."""
    global _Tensor
    torch = _t()
    _Tensor = torch.Tensor
    schema = target._schema
    if not any("Tensor" in str(r.type) for r in schema.returns):
        return None
    name = f"{schema.name}.{schema.overload_name or 'default'}"
    bound = BOUNDS.get(name) or BOUNDS.get(schema.name)
    if bound is not None:
        return bound
    qualified = schema.name if not schema.overload_name else name
    try:
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(
            qualified, "CompositeImplicitAutograd"
        )
    except RuntimeError:  # a TorchScript builtin, not in the dispatcher
        composite = False
    return _composite(name) if composite else name


def _composite(name: str) -> Callable[[Sizing, Any, list[Any], dict[str, Any]], int]:
    """The bound of an op that decomposes into others at the dispatcher (``matmul``,
    ``einsum``...): every storage its parts make, temporaries included (an honest client never
    sends one: its own dispatcher decomposes them; a hostile one could make a small result from
    a huge temporary, as ``matmul`` of broadcast operands does)."""

    def sized(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
        key = (name, signature(a), signature(k) if k else None)
        n = sizing.cache.plans.get(key)
        if n is None:
            n = sizing._measure(name, call, a, k, parts=True)
            sizing.cache.put(key, n)
        if type(n) is not int:
            raise OpError(n)
        return n

    return sized


def _on_meta_counted(
    call: Any, args: Any, kwargs: dict[str, Any], made: dict[int, Any]
) -> tuple[Any, list[Any], list[tuple]]:
    """:func:`~gpu_trace.runtime.protocol.shapes.on_meta` with every tensor the op's parts return
    kept in ``made`` (by storage), through a dispatch mode pushed for the call only."""
    torch = _t()
    from torch.utils._python_dispatch import TorchDispatchMode

    class Parts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in _flat(result, torch.Tensor):
                made.setdefault(t.untyped_storage()._cdata, t)
            return result

    mode = Parts()
    torch._C._push_on_torch_dispatch_stack(mode)
    try:
        return on_meta(call, args, kwargs, meta_like)
    finally:
        torch._C._pop_torch_dispatch_stack(None)


# ---- bounds of data-dependent ops ------------------------------------------------------------------


def _arg(args: list[Any], kwargs: dict[str, Any], position: int, name: str, default: Any) -> Any:
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def _tensor(value: Any, what: str) -> Any:
    if not isinstance(value, _t().Tensor):
        raise OpError(f"{what} must be a tensor")
    return value


def _nonzero(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
    """``nonzero``, ``argwhere``: at most every element, an int64 index per dimension (one
    tensor, or one per dimension for ``nonzero_numpy``)."""
    x = _tensor(_arg(a, k, 0, "self", None), "nonzero's input")
    return max(x.dim(), 1) * _rounded(x.numel() * 8, sizing.block)


def _masked_select(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
    """At most every element of the broadcast input and mask."""
    torch = _t()
    x = _tensor(_arg(a, k, 0, "self", None), "masked_select's input")
    mask = _tensor(_arg(a, k, 1, "mask", None), "masked_select's mask")
    try:
        shape = torch.broadcast_shapes(x.shape, mask.shape)
    except RuntimeError as exc:
        raise OpError(str(exc)) from None
    return _rounded(math.prod(shape) * x.element_size(), sizing.block)


def _unique(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
    """The ``unique`` family: at most every element, plus an int64 inverse and counts each."""
    x = _tensor(_arg(a, k, 0, "self", None), "unique's input")
    n = x.numel()
    return sum(_rounded(b, sizing.block) for b in (n * x.element_size(), n * 8, n * 8))


def _total(repeats: Any) -> int:
    """``repeats.sum()``, in float64 so that no large value wraps it round to a small one."""
    torch = _t()
    if repeats.dtype.is_floating_point or repeats.dtype.is_complex or repeats.dtype == torch.bool:
        raise OpError("repeat_interleave's repeats must be an integer tensor")
    if repeats.numel() == 0:
        return 0
    total = float(repeats.to(torch.float64).abs().sum())
    return math.ceil(total * (1 + 1e-12)) + 1


def _repeat_interleave(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
    """``repeat_interleave(repeats)``: int64 indices, as many as the repeats add up to."""
    repeats = _tensor(_arg(a, k, 0, "repeats", None), "repeat_interleave's repeats")
    return _rounded(_total(repeats) * 8, sizing.block)


def _repeat_interleave_self(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
    """``repeat_interleave(self, repeats, dim)``: the repeated input, and its int64 index."""
    x = _tensor(_arg(a, k, 0, "self", None), "repeat_interleave's input")
    repeats = _tensor(_arg(a, k, 1, "repeats", None), "repeat_interleave's repeats")
    dim = _arg(a, k, 2, "dim", None)
    if dim is None:
        along, rest = x.numel(), 1
    else:
        if type(dim) is not int or not -max(x.dim(), 1) <= dim < max(x.dim(), 1):
            raise OpError(f"repeat_interleave: dimension {dim!r} is out of range")
        along = x.shape[dim] if x.dim() else 1
        rest = x.numel() // along if along else 0
    n = _total(repeats)
    if repeats.numel() == 1:
        n *= along
    return _rounded(n * rest * x.element_size(), sizing.block) + _rounded(n * 8, sizing.block)


def _bincount(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
    """``max(input.max() + 1, minlength)`` counts (int64, or float64 with weights)."""
    x = _tensor(_arg(a, k, 0, "self", None), "bincount's input")
    minlength = _arg(a, k, 2, "minlength", 0)
    n = minlength if type(minlength) is int and minlength > 0 else 0
    if x.numel():
        if x.dtype.is_floating_point or x.dtype.is_complex:
            raise OpError("bincount's input must be an integer tensor")
        n = max(n, int(x.max()) + 1)
    return _rounded(n * 8, sizing.block)


def _histogram_bin_ct(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
    """``bins`` counts and ``bins + 1`` edges, in the input's dtype."""
    x = _tensor(_arg(a, k, 0, "self", None), "histogram's input")
    bins = _arg(a, k, 1, "bins", 100)
    if type(bins) is not int or bins <= 0:
        raise OpError("histogram: bins must be a positive integer")
    size = x.element_size()
    return _rounded(bins * size, sizing.block) + _rounded((bins + 1) * size, sizing.block)


def _histogram_bins_tensor(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
    """As many counts and edges as ``bins`` has edges."""
    x = _tensor(_arg(a, k, 0, "self", None), "histogram's input")
    bins = _tensor(_arg(a, k, 1, "bins", None), "histogram's bins")
    return 2 * _rounded(bins.numel() * x.element_size(), sizing.block)


def _pack_padded_sequence(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
    """At most the whole input, and one int64 batch size per time step."""
    x = _tensor(_arg(a, k, 0, "input", None), "the padded input")
    steps = x.shape[0] if x.dim() else 1
    if x.dim() > 1:
        steps = max(x.shape[0], x.shape[1])
    return _rounded(x.numel() * x.element_size(), sizing.block) + _rounded(steps * 8, sizing.block)


def _index(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
    """``index.Tensor``: a boolean mask picks at most all of its elements, so on meta it is
    replaced by integer indices that many long (one per dimension it spans); cached by
    signature like any op."""
    torch = _t()
    indices = _arg(a, k, 1, "indices", None)
    if type(indices) is not list or not any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    ):
        return sizing.op_bytes(_INDEX, call, a, k)
    key = (call, signature(a), signature(k) if k else None)
    n = sizing.cache.plans.get(key)
    if n is None:
        widened: list[Any] = []
        for i in indices:
            if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
                long = torch.empty(i.numel(), dtype=torch.long, device="meta")
                widened.extend([long] * max(i.dim(), 1))
            else:
                widened.append(i)
        n = sizing._measure(_INDEX, call, [a[0], widened, *a[2:]], k)
        if type(n) is str:
            n = (
                f"{_INDEX}: a boolean mask's largest result cannot be sized with these "
                f"other indices ({n}), so the server does not run it"
            )
        sizing.cache.put(key, n)
    if type(n) is not int:
        raise OpError(n)
    return n


def _like(position: int, name: str) -> Callable[[Sizing, Any, list[Any], dict[str, Any]], int]:
    """An op without a meta kernel whose one result has the shape and dtype of its argument
    ``position`` (``binomial``, gamma and Dirichlet sampling's helpers, masked softmax...)."""

    def bound(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
        x = _tensor(_arg(a, k, position, name, None), f"argument {name!r}")
        return _rounded(x.numel() * x.element_size(), sizing.block)

    bound.__doc__ = _like.__doc__
    return bound


_INDEX = "aten::index.Tensor"


def _cached(bound: Callable[[Sizing, Any, list[Any], dict[str, Any]], int]) -> Any:
    """A bound that depends only on the arguments' signature, cached like a meta size."""

    def sized(sizing: Sizing, call: Any, a: list[Any], k: dict[str, Any]) -> int:
        key = (call, signature(a), signature(k) if k else None)
        n = sizing.cache.plans.get(key)
        if n is None:
            n = bound(sizing, call, a, k)
            sizing.cache.put(key, n)
        return n

    sized.__doc__ = bound.__doc__
    return sized


#: Upper bounds of ops whose output size depends on data, by schema name (all its overloads)
#: or ``name.overload``: ``bound(sizing, call, args, kwargs) -> bytes``.
BOUNDS: dict[str, Callable[[Sizing, Any, list[Any], dict[str, Any]], int]] = {
    "aten::nonzero": _cached(_nonzero),
    "aten::argwhere": _cached(_nonzero),
    "aten::nonzero_numpy": _cached(_nonzero),
    "aten::masked_select": _cached(_masked_select),
    "aten::_unique": _cached(_unique),
    "aten::_unique2": _cached(_unique),
    "aten::unique_consecutive": _cached(_unique),
    "aten::unique_dim": _cached(_unique),
    "aten::unique_dim_consecutive": _cached(_unique),
    "aten::repeat_interleave.Tensor": _repeat_interleave,
    "aten::repeat_interleave.self_Tensor": _repeat_interleave_self,
    "aten::bincount": _bincount,
    "aten::histogram.bin_ct": _cached(_histogram_bin_ct),
    "aten::histogram.bins_tensor": _cached(_histogram_bins_tensor),
    "aten::_pack_padded_sequence": _cached(_pack_padded_sequence),
    "aten::index.Tensor": _index,
    "aten::binomial.default": _cached(_like(0, "count")),
    "aten::_sample_dirichlet.default": _cached(_like(0, "self")),
    "aten::_standard_gamma_grad.default": _cached(_like(0, "self")),
    "aten::_dirichlet_grad.default": _cached(_like(0, "x")),
    "aten::_masked_softmax.default": _cached(_like(0, "self")),
    "aten::_masked_softmax_backward.default": _cached(_like(0, "grad_output")),
    "aten::max_pool2d_backward.default": _cached(_like(1, "self")),
    "aten::batch_norm_elemt.default": _cached(_like(0, "input")),
}


def _flat(value: Any, tensor: type) -> list[Any]:
    if isinstance(value, tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v, tensor)]
    return []


__all__ = ["BOUNDS", "MAX_SIZES", "Sizing", "signature", "sizer"]
