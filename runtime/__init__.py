"""Forwarding runtime: run PyTorch ops on a remote GPU server, asynchronously, traced.

Explicit use::

    from gpu_trace import runtime

    dev = runtime.connect("gpu-box:7070")      # torch.device("remote:0")
    model = model.to(dev)
    loss = model(x.to(dev)).sum()
    loss.backward()
    print(loss.item())                          # a sync point: waits for the server

Transparent use: ``gpu-trace record --remote HOST:PORT -- python train.py`` (see docs/remote.md).
The runtime's rooms (``protocol``, ``client``, ``server``, ``sharing``, ``channel``, ``worker``)
are subpackages; see docs/architecture.md and docs/remote.md.
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
    "serving_process",
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
    # remote device must exist before then: register it as soon as torch is imported. Not in a
    # server's own process (serving_process() takes this hook away): see there.
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


def serving_process() -> None:
    """Declare this process a server's own (``gpu-trace serve`` does, first thing): the
    ``remote`` backend is not registered in it when torch is imported.

    Registering a PrivateUse1 backend makes it the process's accelerator (``at::getAccelerator``,
    ``torch.accelerator.current_accelerator()``), and the autograd engine then finds no stream on
    CUDA nodes: every CUDA backward in that process fails (``opt_ready_stream &&
    opt_parent_stream INTERNAL ASSERT FAILED``, pytorch/pytorch#161129), the server's whole-op
    autograd (``rt::fn``, ``rt::backward``) included. A registration cannot be undone, so this
    comes before torch is imported; a server in a process that is also a client (tests) keeps
    the backend, and refuses whole-op autograd on CUDA with an error that says why.
    """
    from gpu_trace._imports import discard

    discard("torch", _register_backend)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gpu_trace.runtime' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"gpu_trace.runtime.{module}"), name)
