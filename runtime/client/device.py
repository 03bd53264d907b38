"""The ``remote`` device: PyTorch's PrivateUse1 backend, renamed, backed by a forwarding session.

:func:`connect` registers the backend once per process (device guard, hooks, ``torch.remote``
module, ``Tensor.remote()``), connects, and returns ``torch.device("remote:0")``; :func:`defer`
(transparent mode) does the same but connects at the device's first use. Tensors and
modules moved there are :class:`~gpu_trace.runtime.client.tensor.RemoteTensor`\\ s, and keep
their parameters as on a GPU (:mod:`~gpu_trace.runtime.client.parameters`). Factory
functions (``torch.zeros(..., device="remote")``, ``arange``, ``randn``...) get PrivateUse1 kernels
that forward them as one op; ``copy_`` gets one for the paths that bypass ``__torch_dispatch__``
(``torch.tensor(data, device=...)``); pinned host memory gets its CPU kernels
(:mod:`~gpu_trace.runtime.client.pinned`).

A process forked from one with an open session (a DataLoader worker) inherits its socket and its
state but not its threads: after the fork the child lets the session go without touching the
socket, and has no remote device unless it connects itself (:func:`_forked`), as a child forked
after its parent used CUDA cannot use it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from gpu_trace.runtime.client import autocast, composites, parameters, pinned
from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.client.connection import Connection, OpRecord, now_ns
from gpu_trace.runtime.protocol.errors import ServerGone

log = logging.getLogger(__name__)

BACKEND = "remote"
_lock = threading.Lock()
_registered = False
_libs: list[Any] = []
_last_seed: int | None = None
#: What :func:`defer` connects to at the device's first use: ``(address, on_open)``.
_deferred: tuple[str, Callable[[], object] | None] | None = None
_opening = threading.Lock()

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


def _session() -> Connection:
    """The open session, opened now if it waits for the device's first use."""
    c = rt.conn
    if c is None and rt.on_demand is not None:
        c = rt.on_demand()
    if c is None:
        raise RuntimeError("no gpu-trace forwarding session is open (gpu_trace.runtime.connect)")
    return c


class RemoteModule:
    """``torch.remote``: what PyTorch asks a backend module, answered by the session."""

    @staticmethod
    def is_available() -> bool:
        if rt.conn is None:
            return rt.on_demand is not None
        return not rt.conn.broken

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        """True in a process forked from one with an open session (torch then leaves the
        device alone, e.g. ``torch.manual_seed`` in a DataLoader worker), as for CUDA."""
        return rt.forked_from is not None and rt.conn is None

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

    #: ``torch.utils.checkpoint`` saves and restores a device's RNG state (to replay dropout in
    #: its recomputation) only where the device module says it is initialized, as ``torch.cuda``
    #: does once used.
    _initialized = True

    @staticmethod
    def device(index: int | str | torch.device | None) -> contextlib.AbstractContextManager[None]:
        """``with torch.remote.device(i)``: one device, nothing to switch to."""
        return contextlib.nullcontext()

    @staticmethod
    def get_rng_state(device: int | str | torch.device | None = None) -> torch.Tensor:
        """The session's device generator state on the server, as ``torch.cuda.get_rng_state``
        gives it: a uint8 CPU tensor (a round trip: the state is the server's)."""
        c = _session()
        record = OpRecord("rt::rng_state", [], now_ns())
        seq = c.issue(["rt::rng_state", [], {}, None], record)
        c.wait(seq, "rng state")
        return torch.frombuffer(bytearray(bytes.fromhex(record.result)), dtype=torch.uint8)

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: int | str | torch.device | None = None) -> None:
        """Set the session's device generator on the server (in op order: ops issued after
        this draw from it)."""
        data = state.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes().hex()
        _session().issue(
            ["rt::rng_state", [data], {}, None], OpRecord("rt::rng_state", [], now_ns())
        )

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
        pinned.register()
        os.register_at_fork(after_in_child=_forked)
        _registered = True


def _forked() -> None:
    """In a forked child: the parent's session is the parent's. The child has no remote device
    unless it connects itself (as CUDA in a child forked after the parent used it); a session
    not opened yet (:func:`defer`) stays to be opened, by the child, at its first use."""
    global _opening
    _opening = threading.Lock()  # a parent's thread may have held it: it is not here to let go
    c = rt.conn
    if c is None:
        return
    rt.conn = None
    rt.on_demand = None
    parent = os.getppid()
    rt.forked_from = parent
    c.abandon(parent)


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
    if rt.conn is not None or rt.on_demand is not None:
        disconnect()
    rt.conn = Connection(address, token=token, sync=sync, timeout_s=timeout_s, **options)
    _patch()
    _opened()
    return rt.DEVICE


def defer(address: str, on_open: Callable[[], object] | None = None) -> torch.device:
    """Make the ``remote`` device ready and connect to ``address`` at its first use (an op on
    it, a CUDA event, the device's properties), then call ``on_open``.

    Transparent mode does this in every process of a `record --remote` run, so that only those
    that use the device hold a session: not DataLoader workers, nor other helper processes.
    A failed connection is raised to the op that wanted it (``ServerGone``).
    """
    global _deferred
    register()
    if rt.conn is not None or rt.on_demand is not None:
        disconnect()
    _deferred = (address, on_open)
    _patch()
    rt.on_demand = _open_deferred
    return rt.DEVICE


def _open_deferred() -> Connection:
    with _opening:
        c = rt.conn
        if c is not None or _deferred is None:
            if c is None:
                raise ServerGone("no remote session: it was closed")
            return c
        address, on_open = _deferred
        c = Connection(address)
        rt.conn = c
        rt.on_demand = None
        _opened()
        if on_open is not None:
            on_open()
        return c


def _patch() -> None:
    composites.patch()
    autocast.register()
    autocast.patch()
    parameters.patch()


def _opened() -> None:
    if _last_seed is not None:
        RemoteModule.manual_seed_all(_last_seed)


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
    global _deferred
    c, rt.conn = rt.conn, None
    rt.on_demand = None
    _deferred = None
    composites.unpatch()
    autocast.unpatch()
    parameters.unpatch()
    if c is not None:
        c.close()


@atexit.register
def _close_at_exit() -> None:
    try:
        disconnect()
    except Exception:
        log.debug("gpu-trace: closing the remote session at exit failed", exc_info=True)
