"""The ``remote`` device: PyTorch's PrivateUse1 backend, renamed, backed by a forwarding session.

:func:`connect` registers the backend once per process (device guard, hooks, ``torch.remote``
module, ``Tensor.remote()``), connects, and returns ``torch.device("remote:0")``. Tensors and
modules moved there are :class:`~gpu_trace.runtime.client.tensor.RemoteTensor`\\ s. Factory
functions (``torch.zeros(..., device="remote")``, ``arange``, ``randn``...) get PrivateUse1 kernels
that forward them as one op; ``copy_`` gets one for the paths that bypass ``__torch_dispatch__``
(``torch.tensor(data, device=...)``).
"""

from __future__ import annotations

import atexit
import logging
import threading
from typing import Any

import torch

from gpu_trace.runtime.client import autocast, composites
from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.client.connection import Connection, OpRecord, now_ns

log = logging.getLogger(__name__)

BACKEND = "remote"
_lock = threading.Lock()
_registered = False
_libs: list[Any] = []
_last_seed: int | None = None

#: Factory ops forwarded whole when their device is the remote one.
FACTORIES = (
    "empty.memory_format",
    "empty_strided",
    "arange",
    "arange.start",
    "arange.start_step",
    "full",
    "zeros",
    "ones",
    "rand",
    "randn",
    "randint",
    "randint.low",
    "randperm",
    "linspace",
    "logspace",
    "eye",
    "eye.m",
    "scalar_tensor",
    "normal.float_float",
)


class RemoteModule:
    """``torch.remote``: what PyTorch asks a backend module, answered by the session."""

    @staticmethod
    def is_available() -> bool:
        return rt.conn is not None and not rt.conn.broken

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def synchronize(device: Any = None) -> None:
        if rt.conn is not None:
            rt.conn.synchronize()

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        global _last_seed
        _last_seed = int(seed)
        c = rt.conn
        if c is not None and not c.broken:
            c.issue(
                ["rt::seed", [_last_seed & ((1 << 63) - 1)], {}, None],
                OpRecord("rt::seed", [], now_ns()),
            )

    manual_seed = manual_seed_all

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        """What ``torch.autocast("remote", dtype=...)`` accepts: CUDA's autocast dtypes (the
        policy is CUDA's: :mod:`gpu_trace.runtime.client.autocast`)."""
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return True

    @staticmethod
    def memory_stats() -> dict[str, int]:
        """Bytes the session holds on the server now and at peak, and its tensor count."""
        c = rt.conn
        if c is None:
            return {"allocated_bytes": 0, "peak_bytes": 0, "tensors": 0}
        record = OpRecord("rt::memory", [], now_ns())
        seq = c.issue(["rt::memory", [], {}, None], record)
        c.wait(seq, "memory")
        current, peak, count = record.result
        return {"allocated_bytes": current, "peak_bytes": peak, "tensors": count}


def register() -> None:
    """Make ``remote`` a device type of this process (once; idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", BACKEND):
            raise RuntimeError(f"the PrivateUse1 backend is already taken by {current!r}")
        if current == "privateuseone":
            _setup_privateuseone_for_python_backend(BACKEND, backend_module=RemoteModule())
        rt.DEVICE = torch.device(BACKEND, 0)
        lib = torch.library.Library("aten", "IMPL")
        for name in FACTORIES:
            base, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, base), overload or "default")
            lib.impl(name, _factory(op), "PrivateUse1")
        lib.impl("copy_", _copy_kernel, "PrivateUse1")
        _libs.append(lib)
        _registered = True


def _factory(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return rt.dispatch(op, args, kwargs)

    return kernel


def _copy_kernel(dst: Any, src: Any, non_blocking: bool = False) -> Any:
    return rt.dispatch(torch.ops.aten.copy_.default, (dst, src, non_blocking), {})


def connect(
    address: str,
    *,
    token: str | None = None,
    sync: bool | None = None,
    timeout_s: float | None = None,
    **options: Any,
) -> torch.device:
    """Connect to a `gpu-trace serve` server; returns the ``remote`` device.

    ``token`` defaults to ``GPU_TRACE_REMOTE_TOKEN`` or the token file of a server on this
    machine; ``sync=True`` waits for every op (for comparison); ``timeout_s`` is how long the
    server may stay silent. Other options go to
    :class:`~gpu_trace.runtime.client.connection.Connection`. One session per process: connecting
    again first closes the previous session.
    """
    register()
    if rt.conn is not None:
        disconnect()
    c = Connection(address, token=token, sync=sync, timeout_s=timeout_s, **options)
    rt.conn = c
    composites.patch()
    autocast.register()
    autocast.patch()
    if _last_seed is not None:
        RemoteModule.manual_seed_all(_last_seed)
    return rt.DEVICE


def current() -> Connection | None:
    """The active session, or None."""
    return rt.conn


def synchronize() -> None:
    """Wait for every forwarded op; raises the first asynchronous error, if any."""
    c = rt.conn
    if c is not None:
        c.synchronize()


def disconnect() -> None:
    """Close the session: the server frees everything it held for this client."""
    c, rt.conn = rt.conn, None
    composites.unpatch()
    autocast.unpatch()
    if c is not None:
        c.close()


@atexit.register
def _close_at_exit() -> None:
    try:
        disconnect()
    except Exception:
        log.debug("gpu-trace: closing the remote session at exit failed", exc_info=True)
