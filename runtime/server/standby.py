"""Worker processes made before they are needed, so a new session's first op does not wait.

A worker (``python -m gpu_trace.runtime.worker``, :mod:`gpu_trace.runtime.worker.process`)
imports torch, makes its device context and warms the allocator, says :class:`Ready`, and waits
for its one session. :class:`Standby` keeps ``size`` of them ready and makes a new one each time
one is taken (PipeSwitch's standby workers: a switch costs milliseconds, not a process start and
a CUDA context). Each worker serves one session and ends with it, so nothing a session leaves in
its process (the caching allocator's blocks, pinned buffers, a broken CUDA context) reaches the
next one.

A worker learns of its front's end through its channel: the socket pair closes however the front
ends (SIGKILL too), and the worker exits, so a front leaves no workers behind. (Not
``PR_SET_PDEATHSIG``: it fires when the thread that started the worker ends, not its process.)
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping

from gpu_trace.runtime.channel.beacon import Beacon
from gpu_trace.runtime.channel.messages import Channel, ChannelClosed, End, Ready

log = logging.getLogger(__name__)

#: Seconds a worker may take to import torch and warm its device before it counts as failed.
READY_S = 180.0


class WorkerFailed(Exception):
    """A worker that could not be started or did not get ready (the message says why)."""


class Worker:
    """One worker process, as the front sees it: its channel, its beacon, its process."""

    def __init__(self, device: str, env: Mapping[str, str] | None = None) -> None:
        self.channel, theirs = Channel.pair()
        self.beacon = Beacon()
        #: Its own temporary folder (the only one it may write to; gone with it).
        self.scratch = tempfile.mkdtemp(prefix="gpu-trace-worker-")
        cmd = [
            sys.executable,
            "-m",
            "gpu_trace.runtime.worker",
            "--channel",
            str(theirs.fileno()),
            "--beacon",
            str(self.beacon.fd),
            "--device",
            device,
            "--scratch",
            self.scratch,
        ]
        try:
            self.proc = subprocess.Popen(
                cmd,
                pass_fds=(theirs.fileno(), self.beacon.fd),
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                close_fds=True,
                # Not in the front's process group: a Ctrl-C (or a SIGINT to the group) is the
                # front's to handle; it ends its workers' sessions in order.
                start_new_session=True,
            )
        except OSError as exc:
            self.close()
            raise WorkerFailed(f"cannot start a worker process: {exc}") from None
        finally:
            theirs.close()
        self.pid = self.proc.pid
        self.ready: Ready | None = None

    @property
    def context_bytes(self) -> int:
        """Device memory its context holds (as it said when ready; 0 before, or unknown)."""
        return self.ready.context_bytes if self.ready is not None else 0

    def wait_ready(self, timeout: float) -> Ready:
        """Its :class:`Ready`; :class:`WorkerFailed` if it ends or says anything else first."""
        try:
            msg, fd = self.channel.recv(timeout)
        except TimeoutError:
            self.kill()
            raise WorkerFailed(f"a worker was not ready after {timeout:.0f} s") from None
        except (ChannelClosed, ValueError):
            rc = self.wait(5)
            raise WorkerFailed(f"a worker ended before it was ready ({exit_text(rc)})") from None
        if fd is not None:
            os.close(fd)
        if not isinstance(msg, Ready):
            self.kill()
            raise WorkerFailed(f"a worker said {msg.kind} before it was ready")
        self.ready = msg
        return msg

    def wait(self, timeout: float) -> int | None:
        """Its exit status (negative: the signal that ended it), or None if it still runs."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> int | None:
        """End it now (SIGKILL) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        return self.wait(10)

    def close(self) -> None:
        self.channel.close()
        self.beacon.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def exit_text(rc: int | None) -> str:
    """``killed by SIGSEGV``, ``exit status 3``... for a worker's exit status."""
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


class Standby:
    """``size`` ready workers for ``device``; :meth:`take` hands one out and makes another."""

    def __init__(self, device: str, size: int = 2, env: Mapping[str, str] | None = None) -> None:
        if size < 0:
            raise ValueError("the standby pool's size is 0 or more")
        self.device = device
        self.size = size
        self.env = env
        self._ready: list[Worker] = []
        self._starting = 0
        self._cond = threading.Condition()
        self._closed = False
        self.started = 0
        self.failed = 0
        #: The last start's failure, said to the next session that finds no worker.
        self.last_error = ""
        #: What the first worker to get ready said (its device, its GPU activity capture).
        self.first: Ready | None = None

    def start(self) -> Standby:
        _undumpable()  # a worker of this uid may not read the front's memory or environment
        for _ in range(self.size):
            self._spawn()
        return self

    def _spawn(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._starting += 1
        threading.Thread(target=self._make, name="gpu-trace-standby", daemon=True).start()

    def _make(self) -> None:
        worker = None
        try:
            t0 = time.monotonic()
            worker = Worker(self.device, self.env)
            ready = worker.wait_ready(READY_S)
            log.debug(
                "gpu-trace serve: worker %d ready in %.2f s (warm %.2f s)",
                worker.pid,
                time.monotonic() - t0,
                ready.warm_s,
            )
        except WorkerFailed as exc:
            if worker is not None:
                worker.close()
            worker = None
            log.error("gpu-trace serve: %s", exc)
            with self._cond:
                self.failed += 1
                self.last_error = str(exc)
        with self._cond:
            self._starting -= 1
            if worker is not None:
                self.started += 1
                if self.first is None:
                    self.first = worker.ready
                if self._closed:
                    self._retire(worker)
                else:
                    self._ready.append(worker)
            self._cond.notify_all()

    def take(self, timeout: float = READY_S) -> Worker:
        """A ready worker (waiting for one being made if need be); another is made in its place.
        :class:`WorkerFailed` if none is ready within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._ready:
                if self._closed:
                    raise WorkerFailed("the server is shutting down")
                if self._starting == 0:  # none on the way (size 0, or they failed): make one
                    self._cond.release()
                    try:
                        self._spawn()
                    finally:
                        self._cond.acquire()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerFailed(
                        f"no worker process was ready within {timeout:.0f} s"
                        + (f" ({self.last_error})" if self.last_error else "")
                    )
                self._cond.wait(left)
            worker = self._ready.pop(0)
        if worker.wait(0) is not None:  # died while standing by: not this one
            worker.close()
            self._spawn()
            return self.take(max(0.0, deadline - time.monotonic()))
        self._spawn()
        return worker

    def wait_first(self, timeout: float = READY_S) -> None:
        """Wait until a worker is ready (a server says it serves only then: its first session
        does not wait for torch to load); :class:`WorkerFailed` if the first ones failed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._ready:
                if self._starting == 0 or self._closed:
                    raise WorkerFailed(self.last_error or "no worker process could be started")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerFailed(f"no worker process was ready within {timeout:.0f} s")
                self._cond.wait(left)

    def context_bytes(self) -> int:
        """Device memory the standby workers' contexts hold."""
        with self._cond:
            return sum(w.context_bytes for w in self._ready)

    def ready_count(self) -> int:
        with self._cond:
            return len(self._ready)

    def close(self) -> None:
        """End every standby worker (they have no session yet)."""
        with self._cond:
            self._closed = True
            workers, self._ready = self._ready, []
            self._cond.notify_all()
        for worker in workers:
            self._retire(worker)

    @staticmethod
    def _retire(worker: Worker) -> None:
        with contextlib.suppress(ChannelClosed):
            worker.channel.send(End("the server is shutting down", "shutdown"))
        if worker.wait(5) is None:
            worker.kill()
        worker.close()


def _undumpable() -> None:
    """``PR_SET_DUMPABLE`` 0 for this process (the front): workers that run as its uid (a server
    not started as root) may then not ptrace it or read its ``/proc/PID/environ`` (tokens from
    ``token_env``) or memory. Linux only; elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
