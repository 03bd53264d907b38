"""CUDA's autocast policy on the remote device.

Autocast sits above autograd, one dispatch key per backend: ``torch.autocast("cuda")`` enables
``AutocastCUDA``, which only CUDA tensors carry. Remote tensors carry ``AutocastPrivateUse1``, for
which ATen registers no kernel, so without this module nothing is cast and a program that trains
with ``torch.autocast("cuda", torch.bfloat16)`` runs in float32 when forwarded.

:func:`register` gives ``AutocastPrivateUse1`` a Python kernel for every op CUDA's autocast handles
(:mod:`gpu_trace.runtime.client.autocast_table`, ATen's own lists), each applying CUDA's rule for
its op: the low-precision ops cast their floating inputs to the autocast dtype, the float32 ops
to float32, the ``dtype=`` ops (softmax, sum...) get ``dtype=float32``, ``norm`` is redispatched
with a dtype, the promote ops run in their inputs' widest type, ``binary_cross_entropy`` is
refused. Casts of float32 leaves that require grad (weights) are cached until the outermost
autocast region ends, as ATen's ``cached_cast`` does, so a weight used twice is cast once and its
gradient accumulates as on CUDA. The kernels redispatch with their key excluded, as ATen's do; the
casts and the op are forwarded as ordinary ops, so the server sees the dtypes CUDA would.

:func:`patch` (at connect) makes ``torch.clear_autocast_cache`` clear these casts too and, while
the ``cuda`` device is mapped onto ``remote`` (transparent mode), mirrors ``torch.autocast("cuda")``
(``set_autocast_enabled``/``set_autocast_dtype`` for ``cuda``) onto ``remote``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

import torch

from gpu_trace.runtime.client import autocast_table
from gpu_trace.runtime.client import tensor as rt

log = logging.getLogger(__name__)

BACKEND = "remote"
_KEY = torch._C.DispatchKey.AutocastPrivateUse1  # type: ignore[attr-defined]  # stubs lack it
_EXCLUDED = torch._C.DispatchKeySet(_KEY)
_F32 = torch.float32
_F64 = torch.float64
_BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are refused under autocast "
    "(as on CUDA): compute the loss from logits with binary_cross_entropy_with_logits or "
    "BCEWithLogitsLoss, which autocast runs in float32"
)

_lock = threading.Lock()
_libs: list[torch.library.Library] = []
_local = threading.local()
_patched: dict[str, Callable[..., object]] = {}

Kernel = Callable[..., object]
Op = torch._ops.OpOverload


def _casts() -> dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor]]:
    """This thread's cached casts (ATen's cache is thread-local too): id -> (weakref, cast)."""
    casts = getattr(_local, "casts", None)
    if casts is None:
        casts = _local.casts = {}
    return casts


def clear_cache() -> None:
    """Drop this thread's cached casts (what leaving the outermost autocast region does)."""
    _casts().clear()


def _cast(to: torch.dtype, t: object) -> object:
    """ATen's ``cached_cast`` for one argument on the remote device."""
    if type(t) is not rt.RemoteTensor or not t.is_floating_point():
        return t
    dtype = t.dtype
    if dtype is to or dtype is _F64:
        return t
    if (
        dtype is _F32
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
        and to is torch.get_autocast_dtype(BACKEND)
        and torch.is_autocast_cache_enabled()
    ):
        casts = _casts()
        hit = casts.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        out = t.to(to)
        casts[id(t)] = (weakref.ref(t), out)
        return out
    return t.to(to)


def _cast_value(to: torch.dtype, value: object) -> object:
    if type(value) is list or type(value) is tuple:
        return [_cast(to, v) for v in value]
    return _cast(to, value)


def _eligible(t: object) -> bool:
    return type(t) is rt.RemoteTensor and t.is_floating_point() and t.dtype is not _F64


def _promote(lower: torch.dtype, values: list[object]) -> torch.dtype:
    """ATen's ``promote_type``: float32 if any eligible input is, else the low dtype (doubles
    are ignored; another low dtype is an error, as in ATen)."""
    current = lower
    for t in values:
        if type(t) is not rt.RemoteTensor or not t.is_floating_point():
            continue
        dtype = t.dtype
        if dtype is _F64:
            continue
        if current is _F32 or dtype is _F32:
            current = _F32
        elif not (current is lower and dtype is lower):
            raise RuntimeError(
                f"autocast cannot promote {dtype} with autocast dtype {lower} "
                "(Unexpected floating ScalarType in at::autocast::prioritize)"
            )
    return current


def _tensor_args(op: Op) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """The arguments ``cached_cast`` reaches (Tensor, Tensor?, Tensor[]) and those
    ``prioritize`` reads (Tensor, Tensor[]: ATen has no overload for an optional tensor), as
    ``(position, name)``."""
    cast, promote = [], []
    for i, a in enumerate(op._schema.arguments):
        ty = str(a.type)
        if ty in ("Tensor", "List[Tensor]"):
            cast.append((i, a.name))
            promote.append((i, a.name))
        elif ty == "Optional[Tensor]":
            cast.append((i, a.name))
    return cast, promote


Caster = Callable[[tuple[object, ...], dict[str, object]], list[object]]


def _caster(op: Op, policy: str) -> Caster:
    """Lower precision, float32 and promote: ``cast(args, kwargs)`` casts the tensor arguments
    (the positional ones returned as a list, keyword ones in place)."""
    cast, promote = _tensor_args(op)

    def cast_args(args: tuple[object, ...], kwargs: dict[str, object]) -> list[object]:
        if policy == "FP32":
            to = _F32
        else:
            to = torch.get_autocast_dtype(BACKEND)
            if policy == "PROMOTE":
                values: list[object] = []
                for i, name in promote:
                    v = args[i] if i < len(args) else kwargs.get(name)
                    if type(v) is list or type(v) is tuple:
                        values.extend(v)
                    else:
                        values.append(v)
                to = _promote(to, values)
        n = len(args)
        args_ = list(args)
        for i, name in cast:
            if i < n:
                args_[i] = _cast_value(to, args_[i])
            elif name in kwargs:
                kwargs[name] = _cast_value(to, kwargs[name])
        return args_

    return cast_args


def _casting_kernel(op: Op, policy: str) -> Kernel:
    cast_args = _caster(op, policy)

    def kernel(*args: object, **kwargs: object) -> object:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
            return op(*cast_args(args, kwargs), **kwargs)

    return kernel


#: Functions that travel whole (:mod:`gpu_trace.runtime.protocol.functions`) and the op whose
#: policy applies to them: their call never reaches the dispatcher on the client, and the server
#: runs them without autocast, so their arguments are cast here (what the op's kernel would do).
WHOLE = {"sdpa": "scaled_dot_product_attention.default"}
_whole: dict[str, Caster] = {}


def cast_whole(
    name: str, args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[object, ...]:
    """The arguments of a function that travels whole, cast as CUDA's autocast casts its op's
    while autocast is on for the remote device (``kwargs`` in place)."""
    if not torch.is_autocast_enabled(BACKEND):
        return args
    caster = _whole.get(name)
    if caster is None:
        op = _overload(WHOLE.get(name, ""))
        if op is None:
            return args
        caster = _whole[name] = _caster(op, "LOWER_PRECISION_FP")
    with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
        return tuple(caster(args, kwargs))


def _set_opt_dtype_kernel(op: Op) -> Kernel:
    """softmax, sum...: ``dtype=float32`` unless given, when the first argument is eligible
    (inputs are not cast)."""
    position = next(i for i, a in enumerate(op._schema.arguments) if a.name == "dtype")

    def kernel(*args: object, **kwargs: object) -> object:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
            if args and _eligible(args[0]):
                if position < len(args):
                    if args[position] is None:
                        args = (*args[:position], _F32, *args[position + 1 :])
                elif kwargs.get("dtype") is None:
                    kwargs["dtype"] = _F32
            return op(*args, **kwargs)

    return kernel


def _append_dtype_kernel(op: Op, target: Op) -> Kernel:
    """``norm`` without a dtype: redispatched to its overload with one, float32 for an
    eligible input, else the input's own."""
    defaults = [a.default_value for a in op._schema.arguments]

    def kernel(*args: object, **kwargs: object) -> object:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDED):
            full = [*args, *defaults[len(args) :]]
            first = full[0]
            out_type = (
                _F32 if _eligible(first) or not isinstance(first, torch.Tensor) else first.dtype
            )
            return target(*full, dtype=out_type, **kwargs)

    return kernel


def _banned_kernel(*args: object, **kwargs: object) -> object:
    raise RuntimeError(_BANNED_MESSAGE)


def _overload(name: str) -> Op | None:
    base, _, overload = name.partition(".")
    try:
        return getattr(getattr(torch.ops.aten, base), overload)
    except (AttributeError, RuntimeError):
        return None


def kernels() -> dict[str, Kernel]:
    """Every ``name.overload`` this torch has from the table, with its kernel."""
    out: dict[str, Kernel] = {}
    for policy in ("LOWER_PRECISION_FP", "FP32", "PROMOTE"):
        for name in getattr(autocast_table, policy):
            op = _overload(name)
            if op is not None:
                out[name] = _casting_kernel(op, policy)
    for name in autocast_table.FP32_SET_OPT_DTYPE:
        op = _overload(name)
        if op is not None:
            out[name] = _set_opt_dtype_kernel(op)
    for pair in autocast_table.APPEND_DTYPE:
        name, _, target = pair.partition("=")
        op, redispatch = _overload(name), _overload(target)
        if op is not None and redispatch is not None:
            out[name] = _append_dtype_kernel(op, redispatch)
    for name in autocast_table.BANNED:
        if _overload(name) is not None:
            out[name] = _banned_kernel
    return out


def register() -> None:
    """Give ``AutocastPrivateUse1`` CUDA's kernels (once per process; idempotent). They run
    only while autocast is enabled for the remote device: otherwise the key is excluded."""
    with _lock:
        if _libs:
            return
        # Every other op falls through, as ATen makes every other backend's autocast key do
        # (with one kernel registered and no fallback, all others would fail on the key).
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
        lib = torch.library.Library("aten", "IMPL")
        for name, kernel in kernels().items():
            lib.impl(name.removesuffix(".default"), kernel, "AutocastPrivateUse1")
        _libs.extend((fallback, lib))


def patch() -> None:
    """Clear the remote casts with ATen's; mirror ``cuda`` autocast onto ``remote`` while
    ``rt.cuda_alias`` (transparent mode) is set. Undone by :func:`unpatch`."""
    unpatch()
    clear: Callable[..., object] = torch.clear_autocast_cache
    set_enabled: Callable[..., object] = torch.set_autocast_enabled
    set_dtype: Callable[..., object] = torch.set_autocast_dtype

    def clear_autocast_cache() -> None:
        clear()
        clear_cache()

    def set_autocast_enabled(*args: object) -> None:
        set_enabled(*args)
        if rt.cuda_alias and (len(args) == 1 or args[0] == "cuda"):
            set_enabled(BACKEND, args[-1])

    def set_autocast_dtype(device_type: str, dtype: torch.dtype) -> None:
        set_dtype(device_type, dtype)
        if rt.cuda_alias and device_type == "cuda":
            set_dtype(BACKEND, dtype)

    wrappers: dict[str, Callable[..., object]] = {
        "clear_autocast_cache": clear_autocast_cache,
        "set_autocast_enabled": set_autocast_enabled,
        "set_autocast_dtype": set_autocast_dtype,
    }
    for name, fn in wrappers.items():
        _patched[name] = getattr(torch, name)
        fn.__wrapped__ = _patched[name]  # type: ignore[attr-defined]
        setattr(torch, name, fn)


def unpatch() -> None:
    for name, original in list(_patched.items()):
        setattr(torch, name, original)
        del _patched[name]
    clear_cache()


def is_patched() -> bool:
    return bool(_patched)
