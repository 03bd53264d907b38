"""Test-only: code an attacker runs inside their worker, as the pseudo-op ``rt::worker_probe``.

Installed only when the worker's environment has ``GPU_TRACE_WORKER_PROBES=1`` (the tests' servers
set it; ``gpu-trace serve`` never does). Each probe tries one thing a compromised worker would try
and says what happened, so that a test can check the containment from outside
(:mod:`gpu_trace.runtime.worker.sandbox`), or ends the worker as a crash in a kernel would.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpu_trace.runtime.server.executor import Executor
    from gpu_trace.runtime.sharing.sessions import Session


class Worker(Protocol):
    """What the probes change of :class:`~gpu_trace.runtime.worker.process.Worker` (named by
    shape: the worker imports this module)."""

    context_lost: Callable[[], bool]


#: What CUDA says after a kernel's out-of-range index (the text a worker looks for).
DEVICE_ASSERT = "CUDA error: device-side assert triggered (a test probe's stand-in)"


def install(executor: Executor, worker: Worker) -> None:
    executor.extra_ops["rt::worker_probe"] = probe
    executor.extra_ops["rt::context_fault"] = _ContextFault(executor, worker)


class _ContextFault:
    """``rt::context_fault [where]``: the CPU's stand-in for a kernel that fails this worker's
    CUDA context. From then on the worker's context check says it is lost; the error comes
    back from the op itself (``"op"``) or, as CUDA reports a bad index, at the batch's sync
    (``"sync"``: the batch's next stream sync raises it)."""

    def __init__(self, executor: Executor, worker: Worker) -> None:
        self.executor, self.worker = executor, worker

    def __call__(self, session: Session, args: list[object]) -> object:
        self.worker.context_lost = lambda: True
        if args and args[0] == "sync":
            after = self.executor._after_ops

            def failing(*a: object, **k: object) -> None:
                self.executor._after_ops = after  # type: ignore[method-assign]
                raise RuntimeError(DEVICE_ASSERT)

            self.executor._after_ops = failing  # type: ignore[method-assign]
            return None
        raise RuntimeError(DEVICE_ASSERT)


def probe(session: Session, args: list[object]) -> object:
    """``[what, arg]``: ``segv``, ``fpe``, ``abort``, ``exit`` end the worker as a crash would;
    ``pid`` returns this worker's; ``open PATH``, ``connect HOST:PORT``, ``signal PID``, ``read-mem PID``, ``alloc BYTES``,
    ``spawn`` try one thing and return ``"ok"`` or ``"refused: ..."``."""
    what = str(args[0]) if args else ""
    arg = str(args[1]) if len(args) > 1 else ""
    if what == "segv":
        ctypes.string_at(0)  # a real SIGSEGV, as a kernel's wild pointer would raise
    if what == "fpe":
        os.kill(os.getpid(), signal.SIGFPE)
    if what == "abort":
        os.abort()
    if what == "exit":
        os._exit(1)
    if what == "pid":
        return os.getpid()
    try:
        if what == "open":
            with open(arg, "rb") as f:
                f.read(1)
        elif what == "connect":
            host, port = arg.rsplit(":", 1)
            with socket.create_connection((host, int(port)), timeout=2):
                pass
        elif what == "signal":
            os.kill(int(arg), 0)
        elif what == "read-mem":
            with open(f"/proc/{int(arg)}/mem", "rb") as f:
                f.read(1)
        elif what == "alloc":
            block = bytearray(int(arg))
            block[::4096] = b"x" * len(block[::4096])  # touch every page
        elif what == "spawn":
            subprocess.run(["/bin/true"], check=True, timeout=5)
        else:
            return f"unknown probe {what!r}"
    except (OSError, MemoryError, ValueError, subprocess.SubprocessError) as exc:
        return f"refused: {type(exc).__name__}: {exc}"[:300]
    return "ok"
