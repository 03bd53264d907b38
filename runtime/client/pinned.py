"""Pinned host memory in a process whose accelerator is the remote device.

``Tensor.pin_memory()`` asks the process's accelerator for its pinned-memory allocator. Once
``remote`` is registered that accelerator is the remote device (PrivateUse1, see docs/remote.md,
"Which process registers remote"), which has none that Python can give: every ``pin_memory()``
raised ``NotImplementedError`` (nanoGPT's ``get_batch``, minGPT, ``DataLoader(pin_memory=True)``).

Pinning buys a GPU asynchronous host-to-device copies. A forwarded copy reads its bytes when it
is issued and sends them (later ops cannot change what was sent), so it is asynchronous from any
memory: a pinned tensor here is an ordinary CPU copy, as ``pin_memory()`` makes one, marked so
that ``is_pinned()`` is true for it and for its views (the mark is on its storage, as pinning is).
:func:`register` gives ``_pin_memory`` and ``is_pinned`` kernels for CPU tensors; a call naming
another device (a local GPU, outside transparent mode) goes to PyTorch's own kernel.
``torch.empty(..., pin_memory=True)`` and the other factories are pinned this way in transparent
mode (:mod:`~gpu_trace.runtime.client.cuda`'s mode calls :func:`mark`).
"""

from __future__ import annotations

import torch

from gpu_trace.runtime.client import tensor as rt

#: The attribute that marks a storage as pinned (a storage keeps its Python object while it lives).
PINNED = "_gpu_trace_pinned"
_libs: list[torch.library.Library] = []


def register() -> None:
    """Give CPU tensors the kernels (once per process: the backend's registration, which this
    completes, is never undone either)."""
    if _libs:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_pin_memory", _pin_memory, "CPU")
    lib.impl("is_pinned", _is_pinned, "CPU")
    _libs.append(lib)


def mark(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t``'s storage as pinned; returns ``t``."""
    setattr(t.untyped_storage(), PINNED, True)
    return t


def _ours(device: torch.device | None) -> bool:
    """Whether pinning for ``device`` is for the remote device (what the accelerator means)."""
    if device is None or device.type == rt.DEVICE.type:
        return True
    return device.type == "cuda" and rt.cuda_alias


def _composite(op: torch._ops.OpOverload, t: torch.Tensor, device: torch.device) -> object:
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    return op.redispatch(keys, t, device)


def _pin_memory(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    if not _ours(device):
        return _composite(torch.ops.aten._pin_memory.default, t, device)  # type: ignore[arg-type,return-value]
    # As ATen's: a new storage sized for t's strides, its values copied.
    out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="cpu")
    out.copy_(t)
    return mark(out)


def _is_pinned(t: torch.Tensor, device: torch.device | None = None) -> bool:
    if not _ours(device):
        return bool(_composite(torch.ops.aten.is_pinned.default, t, device))  # type: ignore[arg-type]
    return bool(getattr(t.untyped_storage(), PINNED, False))
