"""Transparent mode: an unmodified program's ``cuda`` work runs on the forwarding server.

`gpu-trace record --remote HOST:PORT` sets ``GPU_TRACE_REMOTE``; the traced interpreter's startup
calls :func:`install_from_env`, which waits for the program to import torch and then connects,
maps the ``cuda`` device onto ``remote`` (a torch-function mode rewrites ``device="cuda"``,
``.cuda()`` and ``.to("cuda")``) and answers ``torch.cuda``'s questions from the session:
``is_available()``, ``device_count()``, ``synchronize()``, seeding, memory queries.

What this does not emulate: CUDA streams and events, CUDA graphs, ``torch.autocast("cuda")``,
``.is_cuda`` on tensors the program creates on the CPU, and ``cuda`` devices named in threads the
program starts itself (the mode is per thread).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_patched: dict[str, Any] = {}
_mode: Any = None


def install_from_env() -> None:
    """Called at interpreter start when ``GPU_TRACE_REMOTE`` is set; connects once torch loads."""
    from gpu_trace import config
    from gpu_trace._imports import when_imported

    address = config.remote_address()
    if address:
        when_imported("torch", lambda module: _start(address))


def _start(address: str) -> None:
    from gpu_trace.runtime.client import device

    try:
        device.connect(address)
    except Exception as exc:
        log.error("gpu-trace: cannot forward CUDA work to %s: %s", address, exc)
        return
    patch()


def _is_cuda(value: Any) -> bool:
    import torch

    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:")
    if isinstance(value, int) and not isinstance(value, bool):
        return False
    return False


def _mode_class() -> Any:
    import torch
    from torch.overrides import TorchFunctionMode

    from gpu_trace.runtime.client import tensor as rt

    cuda_methods = {torch.Tensor.cuda}
    positional = {
        torch.Tensor.to,
        torch.Tensor.new_empty,
        torch.Tensor.new_zeros,
        torch.Tensor.new_ones,
        torch.Tensor.new_full,
        torch.Tensor.new_tensor,
    }

    class CudaToRemote(TorchFunctionMode):
        """Rewrites ``cuda`` devices to the remote device in every torch call."""

        def __torch_function__(
            self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            if func in cuda_methods:
                non_blocking = kwargs.get("non_blocking", False)
                return args[0].to(rt.DEVICE, non_blocking=non_blocking)
            device = kwargs.get("device")
            if device is not None and _is_cuda(device):
                kwargs = {**kwargs, "device": rt.DEVICE}
            if func in positional and any(_is_cuda(a) for a in args[1:]):
                args = tuple(rt.DEVICE if _is_cuda(a) else a for a in args)
            return func(*args, **kwargs)

    return CudaToRemote


def patch() -> None:
    """Map ``cuda`` onto the remote device in this thread and patch ``torch.cuda``."""
    global _mode
    import torch

    from gpu_trace.runtime.client import device
    from gpu_trace.runtime.client import tensor as rt

    unpatch()

    def memory(key: str) -> Any:
        def query(device_: Any = None) -> int:
            return int(device.RemoteModule.memory_stats()[key])

        return query

    replacements = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device_: None,
        "_lazy_init": lambda: None,
        "synchronize": lambda device_=None: device.synchronize(),
        "manual_seed": lambda seed: device.RemoteModule.manual_seed_all(seed),
        "manual_seed_all": lambda seed: device.RemoteModule.manual_seed_all(seed),
        "get_device_name": lambda device_=None: f"remote {_server_device()}",
        "memory_allocated": memory("allocated_bytes"),
        "max_memory_allocated": memory("peak_bytes"),
        "memory_reserved": memory("allocated_bytes"),
        "max_memory_reserved": memory("peak_bytes"),
        "reset_peak_memory_stats": lambda device_=None: None,
        "empty_cache": lambda: None,
    }
    for name, fn in replacements.items():
        _patched[name] = getattr(torch.cuda, name, None)
        setattr(torch.cuda, name, fn)
    _mode = _mode_class()()
    _mode.__enter__()
    rt.cuda_alias = True


def unpatch() -> None:
    global _mode
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return
    for name, original in list(_patched.items()):
        if original is None:
            delattr(torch.cuda, name)
        else:
            setattr(torch.cuda, name, original)
        del _patched[name]
    from gpu_trace.runtime.client import tensor as rt

    rt.cuda_alias = False
    if _mode is not None:
        try:
            _mode.__exit__(None, None, None)
        except Exception:  # not this thread's innermost mode any more
            log.debug("gpu-trace: could not pop the cuda mode", exc_info=True)
        _mode = None


def is_patched() -> bool:
    return bool(_patched)


def _server_device() -> str:
    from gpu_trace.runtime.client import tensor as rt

    return rt.conn.server_device if rt.conn is not None else "?"
