"""Transparent mode: an unmodified program's ``cuda`` work runs on the forwarding server.

`gpu-trace record --remote HOST:PORT` sets ``GPU_TRACE_REMOTE``; the traced interpreter's startup
calls :func:`install_from_env`, which waits for the program to import torch and then readies the
session (opened at the device's first use), maps the ``cuda`` device onto ``remote`` (a torch-function mode rewrites ``device="cuda"``,
``.cuda()`` and ``.to("cuda")``) and answers ``torch.cuda``'s questions from the session, so that
a CPU-only build of torch and a CUDA build on a machine without a GPU (pip's default on Linux,
whose ``torch.cuda`` calls raise there: tests/cuda_build.py mimics it) both work:

- ``is_available()``, ``device_count()``, ``current_device()``, ``set_device``, ``device(i)``:
  one device, index 0; ``synchronize()``, seeding and ``memory_allocated``/``memory_reserved``
  (and their peaks) ask the session;
- ``is_current_stream_capturing()`` is False (nothing is captured: optimizers ask it);
- ``Stream``, ``Event``, ``current_stream``/``default_stream``/``set_stream``, ``stream()``
  contexts: :mod:`~gpu_trace.runtime.client.cuda_streams` (one session stream on the server;
  events timed there);
- ``get_device_properties``/``get_device_name``/``get_device_capability``: the server's device
  (``rt::device``, asked once per session); ``mem_get_info``: free and total as the session sees
  them (its tenant's quota as the total where it has one); ``empty_cache`` does nothing (the
  server keeps its allocator's cache);
- backend settings (TF32, cuDNN, matmul precision, deterministic algorithms) go with the ops:
  :mod:`~gpu_trace.runtime.client.cuda_flags`;
- CUDA graphs (``CUDAGraph``, ``graph``, so ``make_graphed_callables``) raise a RuntimeError
  naming gpu-trace: a graph captures kernels launched locally.

Not emulated: ``torch.autocast("cuda")``, ``.is_cuda`` on tensors the program creates on the CPU,
CUDA tensors' ``record_stream``, ``torch.accelerator``/``torch.Stream`` (the remote device
answers those as itself) and ``cuda`` devices named in threads the program starts itself (the
mode is per thread).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_ABSENT = object()
_patched: list[tuple[object, str, object]] = []
_mode: Any = None
_properties_cache: dict[int, DeviceProperties] = {}  # by connection epoch


def install_from_env() -> None:
    """Called at interpreter start when ``GPU_TRACE_REMOTE`` is set: transparent mode once torch
    loads (:func:`_start`)."""
    from gpu_trace import config
    from gpu_trace._imports import when_imported

    address = config.remote_address()
    if address:
        when_imported("torch", lambda module: _start(address))


def _start(address: str) -> None:
    """Transparent mode from torch's import on; the session opens at the device's first use
    (``device.defer``: a process that never uses the device, a DataLoader worker, holds none),
    with the backend settings the program made until then. A server that cannot be reached is
    an error at that use, never a quiet local run (`record --remote` checks it before the
    program starts; running locally instead is ``--fallback-local``, decided there)."""
    from gpu_trace.runtime.client import cuda_flags, device

    device.defer(address, on_open=cuda_flags.send)
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

    from gpu_trace.runtime.client import pinned
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
            if kwargs.get("pin_memory") is True and _is_cpu(kwargs.get("device")):
                # torch.empty(..., pin_memory=True) and the like: an ordinary CPU tensor, marked
                # pinned (the accelerator has no pinned allocator to give: see pinned.py)
                out = func(*args, **{**kwargs, "pin_memory": False})
                return pinned.mark(out) if isinstance(out, torch.Tensor) else out
            return func(*args, **kwargs)

    return CudaToRemote


def _is_cpu(device: object) -> bool:
    if device is None:
        return True
    if isinstance(device, str):
        return device == "cpu"
    return getattr(device, "type", None) == "cpu"


#: What CUDA graphs get: they cannot be forwarded.
GRAPHS_MESSAGE = (
    "gpu-trace: CUDA graphs (torch.cuda.graph, torch.cuda.CUDAGraph, make_graphed_callables) "
    "cannot run in gpu-trace's transparent mode (record --remote): a graph captures kernels "
    "launched on a local GPU, and forwarded ops run one by one on the server. Run the program "
    "without --remote, or without CUDA graphs."
)


class _NoGraphs:
    """``torch.cuda.CUDAGraph`` / ``torch.cuda.graph`` in transparent mode: a clear error
    (``make_graphed_callables`` makes a ``CUDAGraph`` first, so it gets it too)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(GRAPHS_MESSAGE)


def patch() -> None:
    """Map ``cuda`` onto the remote device in this thread and patch ``torch.cuda``."""
    global _mode
    import torch
    import torch.cuda.graphs

    from gpu_trace.runtime.client import cuda_flags, cuda_streams, device
    from gpu_trace.runtime.client import tensor as rt

    unpatch()

    def memory(key: str) -> Any:
        def query(device_: Any = None) -> int:
            return int(device.RemoteModule.memory_stats()[key])

        return query

    def exchange(index: int) -> int:  # torch.cuda.device(i): one device, index 0
        return -1 if index is None or index < 0 else 0

    replacements = {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device_: None,
        "_lazy_init": lambda: None,
        "_exchange_device": exchange,
        "_maybe_exchange_device": exchange,
        "synchronize": lambda device_=None: device.synchronize(),
        "manual_seed": lambda seed: device.RemoteModule.manual_seed_all(seed),
        "manual_seed_all": lambda seed: device.RemoteModule.manual_seed_all(seed),
        "get_rng_state": lambda device_="cuda": device.RemoteModule.get_rng_state(),
        "set_rng_state": lambda state, device_="cuda": device.RemoteModule.set_rng_state(state),
        "get_rng_state_all": lambda: [device.RemoteModule.get_rng_state()],
        "set_rng_state_all": lambda states: device.RemoteModule.set_rng_state(list(states)[0]),
        "get_device_properties": lambda device_=None: _properties(),
        "get_device_name": lambda device_=None: _properties().name,
        "get_device_capability": lambda device_=None: (_properties().major, _properties().minor),
        "mem_get_info": lambda device_=None: _mem_info(),
        "memory_allocated": memory("allocated_bytes"),
        "max_memory_allocated": memory("peak_bytes"),
        "memory_reserved": memory("allocated_bytes"),
        "max_memory_reserved": memory("peak_bytes"),
        "reset_peak_memory_stats": lambda device_=None: None,
        "empty_cache": lambda: None,
        "is_current_stream_capturing": lambda: False,
        "CUDAGraph": _NoGraphs,
        "graph": _NoGraphs,
        **cuda_streams.REPLACEMENTS,
    }
    for name, fn in replacements.items():
        _replace(torch.cuda, name, fn)
    _replace(torch.cuda.graphs, "is_current_stream_capturing", replacements[
        "is_current_stream_capturing"])  # fmt: skip
    _mode = _mode_class()()
    _mode.__enter__()
    rt.cuda_alias = True
    cuda_flags.install()


def _replace(owner: object, name: str, value: object) -> None:
    _patched.append((owner, name, owner.__dict__.get(name, _ABSENT)))
    setattr(owner, name, value)


def unpatch() -> None:
    global _mode
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return
    from gpu_trace.runtime.client import cuda_flags

    cuda_flags.uninstall()
    for owner, name, original in reversed(_patched):
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _patched.clear()
    _properties_cache.clear()
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


class DeviceProperties:
    """``torch.cuda.get_device_properties()``'s answer: the server's device, as its ``rt::device``
    op says (a CUDA device's own properties; for the CPU device, the machine's processor,
    capability (0, 0), the memory the server shares and its CPU count)."""

    def __init__(self, name: str, major: int, minor: int, total: int, sms: int) -> None:
        self.name = name
        self.major = major
        self.minor = minor
        self.total_memory = total
        self.multi_processor_count = sms

    def __repr__(self) -> str:
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // (1 << 20)}MB, "
            f"multi_processor_count={self.multi_processor_count})"
        )


def _ask(name: str) -> Any:
    from gpu_trace.runtime.client import cuda_streams

    return cuda_streams._call(name, [], wait=name.removeprefix("rt::"))


def _properties() -> DeviceProperties:
    """The server's device, asked once per session (it does not change)."""
    from gpu_trace.runtime.client import tensor as rt

    epoch = rt.conn.epoch if rt.conn is not None else 0
    props = _properties_cache.get(epoch)
    if props is None:
        name, major, minor, total, sms = _ask("rt::device")
        props = _properties_cache[epoch] = DeviceProperties(
            str(name), int(major), int(minor), int(total), int(sms)
        )
    return props


def _mem_info() -> tuple[int, int]:
    """(free, total) bytes as the session sees the device: its tenant's quota as the total
    where it has one."""
    free, total = _ask("rt::mem_info")
    return int(free), int(total)
