"""A worker process: one session's ops, in a process of its own.

Started by the front's standby pool (:mod:`gpu_trace.runtime.server.standby`) as
``python -m gpu_trace.runtime.worker --channel FD --beacon FD --device DEV``. Before it is needed
it imports torch, makes its device's context and warms the allocator, then says ``Ready`` and
waits. Given a session (``Assign``, the client's socket with it) it contains itself
(:mod:`gpu_trace.runtime.worker.sandbox`: no network, no files outside its own, no signals or
ptrace to other processes, a host-memory allowance), then runs the session with the server's own
machinery (:class:`~gpu_trace.runtime.server.server.Server`, one session, no listening socket):
the same executor, memory account, pager and sink as a single-process server. It reports its
session's usage to the front while it changes and ends with the session.

On CUDA, an error that leaves the context unusable (a device-side assert, an illegal address) is
noticed after the op that raised it: the client gets that op's error, the front is told
(``Ended``, ``device-failed``), and the worker exits; the front tells the client its session is
over, and the other sessions, each with its own context, go on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpu_trace.runtime.channel.beacon import Beacon
from gpu_trace.runtime.channel.messages import (
    REPORT_S,
    Assign,
    Channel,
    ChannelClosed,
    End,
    Ended,
    Limits,
    PagedOut,
    PageOut,
    Ready,
    Report,
)
from gpu_trace.runtime.worker import sandbox

if TYPE_CHECKING:
    from collections.abc import Callable

    from gpu_trace.runtime.server.device_activity import DeviceActivity

log = logging.getLogger(__name__)

#: Exit status of a worker whose CUDA context failed, and of one whose batch ran too long.
DEVICE_FAILED = 3
BATCH_LIMIT = 4
#: Host memory a worker may use beyond its session's bytes: kernels' temporaries, the runtime.
HOST_SLACK = 1 << 30

#: Text of CUDA errors after which a context is not to be trusted.
_STICKY = (
    "device-side assert",
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction",
    "uncorrectable ECC",
)
#: A worker's log level (``debug``, ``info``: which containment layers held; default warning).
LOG_ENV = "GPU_TRACE_WORKER_LOG"
#: Set (by tests only) to let the pseudo-op ``rt::worker_probe`` act as code run by an attacker
#: inside the worker (:mod:`gpu_trace.runtime.worker.probes`).
PROBES_ENV = "GPU_TRACE_WORKER_PROBES"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_trace.runtime.worker")
    ap.add_argument("--channel", type=int, required=True)
    ap.add_argument("--beacon", type=int, required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--scratch", required=True, help="its own temporary folder")
    args = ap.parse_args(argv)
    os.environ["TMPDIR"] = args.scratch
    tempfile.tempdir = args.scratch
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front ends this worker's session
    level = os.environ.get(LOG_ENV, "WARNING").upper()
    logging.basicConfig(
        level=level if level in ("DEBUG", "INFO", "WARNING", "ERROR") else "WARNING",
        format="gpu-trace serve: worker %(process)d: %(message)s",
    )
    from gpu_trace import runtime

    runtime.serving_process()  # before torch: CUDA stays this process's accelerator
    t0 = time.monotonic()
    activity, activity_state = None, "off"
    if args.device.startswith("cuda"):  # before CUDA initializes here: the injection library
        from gpu_trace.runtime.server.device_activity import start_capture

        activity, note = start_capture(None, Path(args.scratch) / "activity")
        activity_state = "on" if activity is not None else (note or "off")
    warm(args.device)
    channel = Channel(socket.socket(fileno=args.channel))
    beacon = Beacon(args.beacon)
    try:
        ready = Ready(os.getpid(), args.device, time.monotonic() - t0, activity_state)
        ready.context_bytes = context_bytes(args.device)
        channel.send(ready)
        msg, fd = channel.recv(None)
    except ChannelClosed:
        return 0  # the front went away while this worker stood by
    if not isinstance(msg, Assign) or fd is None:
        return 0  # End: the server stops before this worker was needed
    conn = socket.socket(fileno=fd)
    return Worker(channel, beacon, args.device, msg, conn, args.scratch, activity).run()


def warm(device: str) -> None:
    """Import torch and make ``device`` ready: its context, its allocator's first blocks, a
    kernel run; and what a server process does once, at its first op (the allow-list's table
    of every ATen overload, the meta kernels the executor sizes ops with): a session's first
    ops then cost what a shared server's do."""
    import torch

    from gpu_trace.runtime.protocol.shapes import meta_like, on_meta
    from gpu_trace.runtime.server import allowlist, executor  # noqa: F401 (its imports)

    d = torch.device(device)
    if d.type == "cuda":
        torch.cuda.set_device(d)
        torch.cuda.init()
    a = torch.ones((256, 256), device=d)
    (a @ a).sum().item()
    allowlist.allowed()
    aten = torch.ops.aten
    on_meta(aten.addmm.default, [a, a, a], {}, meta_like)
    on_meta(aten.relu.default, [a], {}, meta_like)
    del a
    if d.type == "cuda":
        torch.cuda.synchronize(d)


def context_bytes(device: str) -> int:
    """Device memory this process holds on a CUDA device (its context, the warm-up's blocks),
    as NVML sees it; 0 on the CPU or where NVML cannot say."""
    if not device.startswith("cuda"):
        return 0
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        try:
            index = torch.device(device).index or 0
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    return int(proc.usedGpuMemory)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or refusing: the front counts none
        log.debug("no context size from NVML", exc_info=True)
    return 0


class Worker:
    """One session in this process: the server's machinery for it, and the front's channel."""

    def __init__(
        self,
        channel: Channel,
        beacon: Beacon,
        device: str,
        assign: Assign,
        conn: socket.socket,
        scratch: str,
        activity: DeviceActivity | None = None,
    ) -> None:
        from gpu_trace.runtime.server.server import Server
        from gpu_trace.runtime.sharing.sessions import Session
        from gpu_trace.runtime.sharing.tenants import Tenant

        self.channel = channel
        self.beacon = beacon
        self.assign = assign
        self.conn = conn
        self.scratch = scratch
        fields = dict(assign.tenant)
        fields.update(
            token=secrets.token_hex(16),  # never used: the front authenticated the client
            memory_bytes=assign.limit_bytes,
            memory_fraction=None,
            admin=False,
        )
        tenant = Tenant(**fields)
        self.server = Server(
            "127.0.0.1:0",
            device=device,
            tenants=[tenant],
            device_memory=max(1, assign.capacity_bytes),
            max_sessions=1,
            idle_timeout_s=assign.idle_timeout_s,
            sink=_sink(assign.sink),
            idle_s=assign.idle_s,
            spin_us=assign.spin_us,
            delay_ms=assign.delay_ms,
            gpu_activity=activity,
        )
        session = Session(dict(assign.client), lambda *_: None, tenant)
        session.id = assign.session
        session.trace = assign.trace
        session.binary = assign.binary
        self.session = session
        self.cuda = str(self.server.device).startswith("cuda")
        #: Whether this process's device context is gone (after an error whose text says it may
        #: be); on CUDA a synchronize and a small op say, elsewhere it never is. The test probes
        #: replace it to stand for a failed CUDA context on the CPU.
        self.context_lost: Callable[[], bool] = lambda: (
            self.cuda and _context_lost(self.server.device)
        )
        self.failed: str | None = None
        self._reported: tuple[Any, ...] = ()
        self._send_lock = threading.Lock()

    def run(self) -> int:
        if self.assign.flags is not None:  # before anything reads this process's own
            _adopt_flags(self.assign.flags)
        server = self.server
        executor = server.executor
        executor.mark = self.beacon.mark
        executor.on_error = self._on_error
        if os.environ.get(PROBES_ENV) == "1":
            from gpu_trace.runtime.worker import probes

            probes.install(executor, self)
        writer = server.adopt(self.conn, self.session)
        contained = sandbox.contain(self._containment())
        log.info("contained: %s", contained.summary())
        server.start_engine()
        threading.Thread(target=self._listen, name="gpu-trace-channel", daemon=True).start()
        threading.Thread(target=self._report_loop, name="gpu-trace-report", daemon=True).start()
        if self.session.tenant.batch_s is not None:
            threading.Thread(target=self._watch, name="gpu-trace-watch", daemon=True).start()
        server.serve_session(self.conn, self.session, writer)
        # The executor closes the session (its "close" work) and flushes its spans; then go.
        server.executor.stop()
        server.pager.stop()
        if server.gpu_activity is not None:  # its last records, into the session's spans
            with contextlib.suppress(Exception):
                server.gpu_activity.close()
        with contextlib.suppress(Exception):
            server.sink.shutdown()
        self._report(force=True)
        if self.failed is not None:
            self._send(Ended("device-failed", self.failed))
            return DEVICE_FAILED
        self._send(Ended("closed"))
        return 0

    def _containment(self) -> sandbox.Containment:
        """What this worker may do once it runs its session (:mod:`.sandbox`)."""
        assign = self.assign
        held = assign.limit_bytes if assign.limit_bytes is not None else assign.capacity_bytes
        spool = (assign.sink[len("spool:") :],) if assign.sink.startswith("spool:") else ()
        uid = sandbox.NOBODY if os.geteuid() == 0 and not spool and _others_may_read() else None
        if uid is not None:
            os.chown(self.scratch, uid, uid)
        return sandbox.for_worker(
            str(self.server.device),
            # the session's own bytes (device memory is host memory on the CPU device; pinned
            # page-out buffers on a GPU), and room for kernels' temporaries and the runtime
            host_memory_bytes=held + HOST_SLACK,
            uid=uid,
            writable=(self.scratch, *spool),
        )

    # ---- the front's messages --------------------------------------------------------------------

    def _listen(self) -> None:
        server = self.server
        while True:
            try:
                msg, fd = self.channel.recv(None)
            except (ChannelClosed, ValueError):
                os._exit(0)  # the front is gone: so is this session
            if fd is not None:
                os.close(fd)
            if isinstance(msg, End):
                server.end_session(self.session, msg.message, msg.reason)
            elif isinstance(msg, Limits):
                memory = server.memory
                tm = memory.tenant_of(self.session)
                tm.limit_bytes = msg.limit_bytes
                memory.capacity_bytes = max(1, msg.capacity_bytes)
                memory.changed(self.session)  # waiters may retry
            elif isinstance(msg, PageOut):
                moved = server.pager.request_page_out(self.session, reason="admin")
                self._send(PagedOut(moved))

    def _send(self, msg: Any) -> None:
        with self._send_lock, contextlib.suppress(ChannelClosed):
            self.channel.send(msg)

    def _report_loop(self) -> None:
        while not self.session.closed:
            time.sleep(REPORT_S)
            self._report()

    def _report(self, force: bool = False) -> None:
        session, server = self.session, self.server
        account = session.account
        usage = session.usage.snapshot()
        state = _state(server, session)
        activity = dataclasses.asdict(server.gpu_activity.counts) if server.gpu_activity else {}
        key = (tuple(usage.values()), account.bytes, account.paged_bytes, state,
               tuple(activity.values()))  # fmt: skip
        if key == self._reported and not force:
            return
        self._reported = key
        dirty: list[str] = []
        take = getattr(server.sink, "take_dirty", None)
        if take is not None:
            dirty = [str(p) for p in take()]
        self._send(
            Report(
                usage=usage,
                memory_bytes=int(account.bytes),
                memory_peak_bytes=int(account.peak_bytes),
                paged_bytes=int(account.paged_bytes),
                state=state,
                batches=int(session.batches),
                dirty=dirty,
                gpu_activity=activity,
            )
        )

    def _watch(self) -> None:
        """A batch that runs past its tenant's ``batch_s`` ends the session: the front is told
        why (naming the op that runs) and this worker exits, whatever the kernel is doing."""
        limit = self.session.tenant.batch_s
        assert limit is not None
        executor, session = self.server.executor, self.session
        seen, since = -1, time.monotonic()
        while not session.closed:
            time.sleep(min(0.1, limit / 4))
            now = time.monotonic()
            if executor.current is None or session.batches != seen:
                seen, since = session.batches, now
                continue
            if now - since > limit:
                op = self.beacon.read() or "a batch"
                message = (
                    f"a batch of the session ran past its tenant's limit of {limit:g} s (running"
                    f" {op}); the session is over, the server and the other sessions go on"
                )
                log.info("%s", message)  # the front logs it
                self._send(Ended("batch-limit", message))
                os._exit(BATCH_LIMIT)

    # ---- faults ----------------------------------------------------------------------------------

    def _on_error(self, exc: Exception, op: str) -> None:
        """After an op's error: on CUDA, if the context is gone, this worker's session is over
        (the op's error still reaches the client; then the front says why it ends)."""
        if self.failed is not None:
            return
        text = str(exc)
        if not any(s in text for s in _STICKY) or not self.context_lost():
            return
        first = text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__
        self.failed = (
            f"the session's CUDA context failed ({first}) running {op or 'a batch'}; the session"
            " is over, the server and the other sessions go on"
        )
        log.info("%s", self.failed)  # the front logs it
        self.server.executor.context_lost = True
        self.session.closed = True
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RD)  # the read loop ends; the reply still goes


def _others_may_read() -> bool:
    """Whether a user with no rights of its own may read Python's install and gpu_trace (every
    folder on the way open to others): a worker started as root drops to ``nobody`` only then,
    since its lazy imports would fail otherwise (an install under ``/root``, mode 700, is not)."""
    import gpu_trace

    roots = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(gpu_trace.__file__))}
    roots.update(p for p in sys.path if p and os.path.isabs(p) and "site-packages" in p)
    for root in roots:
        path = os.path.realpath(root)
        while True:
            try:
                mode = os.stat(path).st_mode
            except OSError:
                return False
            if not mode & stat.S_IXOTH or not mode & stat.S_IROTH:
                return False
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
    return True


def _adopt_flags(flags: dict[str, Any]) -> None:
    """The front's backend settings as this process's own: the session's ops run under them
    unless it sets others, as in a server of one process (:attr:`Assign.flags`)."""
    import torch

    from gpu_trace.runtime.protocol import backend_flags

    try:
        backend_flags.apply(torch, backend_flags.check(flags))
    except (ValueError, TypeError, RuntimeError):  # a front's torch this one cannot follow
        log.warning("the server's backend settings could not be applied", exc_info=True)


def _context_lost(device: Any) -> bool:
    import torch

    try:
        torch.cuda.synchronize(device)
        torch.empty(1, device=device).fill_(0).item()
    except Exception:
        return True
    return False


def _state(server: Any, session: Any) -> str:
    if server.executor.current is session:
        return "running"
    if server.scheduler.queued(session):
        return "queued"
    if session.usage.evicted_bytes > 0:
        return "paged-out"
    return "idle"


def _sink(spec: str) -> Any:
    from gpu_trace.runtime.server.sink import ReturnSink, SpoolSink

    if spec.startswith("spool:"):
        return SpoolSink(spec[len("spool:") :])
    return ReturnSink()
