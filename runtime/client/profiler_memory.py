"""Remote tensors' memory, told to PyTorch's profiler as a GPU's caching allocator tells it.

A program that profiles itself with ``torch.profiler.profile(profile_memory=True)`` sees, on a
GPU, one ``[memory]`` event per allocation and free of device memory (with the bytes the
device then holds), and each op's ``device_memory_usage``. CUDA's allocator reports them through
``c10::reportMemoryUsageToProfiler``; a remote tensor's bytes are allocated on the server, so
the client reports them itself, when the tensor is made and when it dies, on the device
``remote:0`` (PrivateUse1), which the profiler counts as device memory as it counts CUDA's.

Only results that own new storage count: a view or an in-place result (an op whose schema says
its result aliases an input) adds nothing, as on a GPU. A tensor's bytes are its storage's
extent (offset and strides included), what the server allocates for it.

The function is reached through ``libc10``'s exported symbol with ``ctypes``: its mangled name
spells the parameter types, so a PyTorch whose function differs has no such symbol and nothing
is reported (never a wrong call). ``c10::Device`` (a one-byte type and a one-byte index) is
passed by value in one integer register on x86-64 and AArch64, where this is done; elsewhere
nothing is reported. Nothing is called unless a profiler is on
(``torch.autograd.profiler._is_profiler_enabled``), so a run without one pays an attribute
read per tensor.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from collections.abc import Callable, Sequence

import torch
import torch.autograd.profiler as autograd_profiler

log = logging.getLogger(__name__)

#: ``c10::reportMemoryUsageToProfiler(void*, int64_t, size_t, size_t, c10::Device)``.
SYMBOL = "_ZN3c1027reportMemoryUsageToProfilerEPvlmmNS_6DeviceE"
#: ``c10::Device{PrivateUse1, 0}`` as its two bytes in one register (type low, index high).
DEVICE: int = torch._C._autograd.DeviceType.PrivateUse1.value

_fn: Callable[..., None] | None = None
_resolved = False


def storage_bytes(
    dtype: torch.dtype, shape: Sequence[int], stride: Sequence[int], offset: int
) -> int:
    """The bytes of the storage a new tensor of this layout needs (0 for an empty one)."""
    if any(s == 0 for s in shape):
        return 0
    extent = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride))
    return extent * dtype.itemsize


def allocates(func: object) -> bool:
    """Whether op ``func``'s tensor results own new storage (none aliases an input)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True
    return all(r.alias_info is None for r in schema.returns)


def report(ptr: int, delta: int, total: int) -> None:
    """Tell the profiler that ``delta`` bytes (negative: freed) at ``ptr`` moved the device's
    held bytes to ``total``; nothing when no profiler is on or the function is not there."""
    if not autograd_profiler._is_profiler_enabled:
        return
    fn = _resolve()
    if fn is not None:
        fn(ptr, delta, total, total, DEVICE)


def _resolve() -> Callable[..., None] | None:
    global _fn, _resolved
    if _resolved:
        return _fn
    _resolved = True
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64"):
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        fn = lib[SYMBOL]
    except (OSError, AttributeError) as exc:
        log.info("gpu-trace: remote memory is not reported to the profiler: %s", exc)
        return None
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_size_t,
        ctypes.c_size_t,
        ctypes.c_uint16,
    ]
    fn.restype = None
    _fn = fn
    return _fn
