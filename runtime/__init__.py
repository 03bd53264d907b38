"""Forwarding runtime: run PyTorch ops on a remote GPU server, asynchronously, traced.

Explicit use::

    from gpu_trace import runtime

    dev = runtime.connect("gpu-box:7070")      # torch.device("remote:0")
    model = model.to(dev)
    loss = model(x.to(dev)).sum()
    loss.backward()
    print(loss.item())                          # a sync point: waits for the server

Transparent use: ``gpu-trace record --remote HOST:PORT -- python train.py`` (see docs/remote.md).
The runtime's rooms (``protocol``, ``client``, ``server``, ``sharing``) are subpackages; see
docs/architecture.md and docs/remote.md.
torch is imported only when one of these names is used.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ProtocolMismatch",
    "QuotaExceeded",
    "RemoteError",
    "RemoteOpError",
    "RemoteTensor",
    "Server",
    "ServerGone",
    "connect",
    "current",
    "disconnect",
    "synchronize",
]

_WHERE = {
    "connect": "client.device",
    "current": "client.device",
    "disconnect": "client.device",
    "synchronize": "client.device",
    "RemoteTensor": "client.tensor",
    "Server": "server.server",
    "RemoteError": "protocol.errors",
    "RemoteOpError": "protocol.errors",
    "QuotaExceeded": "protocol.errors",
    "ServerGone": "protocol.errors",
    "ProtocolMismatch": "protocol.errors",
}


def _register_backend(module: object = None) -> None:
    # The autograd engine sizes its device queues at the process's first backward pass, so the
    # remote device must exist before then: register it as soon as torch is imported.
    import sys

    loading = sys.modules.get("gpu_trace.runtime.client.device")
    if loading is not None and not hasattr(loading, "register"):
        # torch is being imported by device.py itself (``runtime.connect`` used before torch was
        # imported): the device is not defined yet, and connect() registers it.
        return
    from gpu_trace.runtime.client import device

    device.register()


def _early_registration() -> None:
    from gpu_trace._imports import when_imported

    when_imported("torch", _register_backend)


_early_registration()


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gpu_trace.runtime' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"gpu_trace.runtime.{module}"), name)
