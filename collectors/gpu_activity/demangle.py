"""Kernel names as people read them: C++ symbols demangled, as PyTorch's profiler shows them.

CUPTI reports a kernel by its mangled symbol (``_ZN2at6native...``); PyTorch's profiler and HTA
show ``void at::native::elementwise_kernel<...>(...)``. The C++ runtime's ``__cxa_demangle``
(libstdc++, loaded with ctypes) does it, once per distinct name (a run has hundreds, not millions).
Where libstdc++ is missing, or a name is not a C++ symbol (a C kernel, a Triton kernel), the name
is kept as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


@functools.cache
def _cxa_demangle() -> Callable[..., int | None] | None:
    for name in (ctypes.util.find_library("stdc++"), "libstdc++.so.6"):
        if not name:
            continue
        try:
            fn = ctypes.CDLL(name).__cxa_demangle
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_void_p
        fn.argtypes = [
            ctypes.c_char_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_int),
        ]
        demangler: Callable[..., int | None] = fn
        return demangler
    log.info("gpu-trace: libstdc++ not found; kernel names stay mangled")
    return None


@functools.cache
def _libc_free() -> Callable[[int], None]:
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    release: Callable[[int], None] = free
    return release


def demangle(name: str) -> str:
    """``name`` demangled, or ``name`` itself when it is not a C++ symbol."""
    if not name.startswith("_Z"):
        return name
    fn = _cxa_demangle()
    if fn is None:
        return name
    status = ctypes.c_int(0)
    ptr = fn(name.encode("utf-8", "surrogateescape"), None, None, ctypes.byref(status))
    if status.value != 0 or not ptr:
        return name
    try:
        return ctypes.string_at(ptr).decode("utf-8", "replace")
    finally:
        _libc_free()(ptr)
