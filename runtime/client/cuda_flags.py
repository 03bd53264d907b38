"""Transparent mode: the program's backend settings (TF32, cuDNN, matmul precision,
deterministic algorithms) follow its ops to the server.

The settings are ``at::Context`` state of the client's process, which runs none of the ops. So
while transparent mode is on, the setters PyTorch's Python API calls are wrapped: after each, the
settings (:mod:`gpu_trace.runtime.protocol.backend_flags`) go to the server as an ``rt::flags``
op, in program order, when they differ from the last sent; the server runs the session's later
ops under them and other sessions' under their own. Nothing is sent per op. The legacy switches
are followed here as they are set, because PyTorch cannot read them back once a program mixed
them with the ``fp32_precision`` API.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from gpu_trace.runtime.client import tensor as rt
from gpu_trace.runtime.client.connection import OpRecord, now_ns
from gpu_trace.runtime.protocol import backend_flags

log = logging.getLogger(__name__)

#: ``torch._C`` setters that torch's Python code looks up when it calls them.
SETTERS = (
    "_set_cublas_allow_tf32",
    "_set_float32_matmul_precision",
    "_set_fp32_precision_setter",
    "_set_cudnn_enabled",
    "_set_cudnn_benchmark",
    "_set_cudnn_deterministic",
    "_set_cudnn_allow_tf32",
    "_set_deterministic_algorithms",
    "_set_deterministic_fill_uninitialized_memory",
    "_set_cublas_allow_fp16_reduced_precision_reduction",
    "_set_cublas_allow_bf16_reduced_precision_reduction",
)
#: ``torch.backends.cudnn``'s properties, which hold their setter from import time.
CUDNN_PROPS = ("enabled", "benchmark", "deterministic", "allow_tf32")

_wrapped: list[tuple[object, str, Callable[..., object]]] = []
_legacy: dict[str, str | bool] = {}
_sent: backend_flags.Flags | None = None


def install() -> None:
    """Wrap the setters and send the settings as they are now (a failure is logged: the
    program runs on, its settings not forwarded)."""
    try:
        _install()
    except Exception:
        uninstall()
        log.warning("gpu-trace: backend settings will not follow the program", exc_info=True)


def _install() -> None:
    global _sent
    import torch

    uninstall()
    _legacy.clear()
    for name, getter in (
        ("matmul_precision", lambda: str(torch.get_float32_matmul_precision())),
        ("cudnn_allow_tf32", lambda: bool(torch._C._get_cudnn_allow_tf32())),
    ):
        with contextlib.suppress(RuntimeError):  # already mixed: read from the table
            _legacy[name] = getter()
    for name in SETTERS:
        original = getattr(torch._C, name, None)
        if original is not None:  # an older torch may lack some
            _wrap(torch._C, name, original)
    props: dict[str, object] = dict(vars(type(torch.backends.cudnn)))
    for name in CUDNN_PROPS:
        prop = props.get(name)
        setter = getattr(prop, "setter", None)
        if prop is not None and callable(setter):
            _wrap(prop, "setter", setter, track=f"_set_cudnn_{name}")
    _sent = None
    send()


def uninstall() -> None:
    for owner, name, original in reversed(_wrapped):
        setattr(owner, name, original)
    _wrapped.clear()


def send() -> None:
    """Send the settings if they changed since last sent (never raises into the program)."""
    global _sent
    c = rt.conn
    if c is None or c.broken:
        return
    try:
        import torch

        flags = backend_flags.read(torch, _legacy)
        if flags == _sent:
            return
        c.issue(["rt::flags", [flags], {}, None], OpRecord("rt::flags", [], now_ns()))
        _sent = flags
    except Exception:
        log.warning("gpu-trace: could not send the backend settings to the server", exc_info=True)


def _wrap(
    owner: object, name: str, original: Callable[..., object], track: str | None = None
) -> None:
    which = track or name

    def setter(*args: object, **kwargs: object) -> object:
        result = original(*args, **kwargs)
        _follow(which, args)
        send()
        return result

    setter.__wrapped__ = original  # type: ignore[attr-defined]
    _wrapped.append((owner, name, original))
    setattr(owner, name, setter)


def _follow(name: str, args: tuple) -> None:
    """Keep the legacy switches as the program set them (see the module's docstring)."""
    if not args:
        return
    if name == "_set_float32_matmul_precision":
        _legacy["matmul_precision"] = str(args[0])
    elif name == "_set_cublas_allow_tf32":
        _legacy["matmul_precision"] = "high" if args[0] else "highest"
    elif name == "_set_cudnn_allow_tf32":
        _legacy["cudnn_allow_tf32"] = bool(args[0])
