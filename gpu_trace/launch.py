"""`gpu-trace record`'s runner: prepare a run, start the program with recording in place, wait.

The program gets, through its environment, the run directory, the run's W3C trace context, a
PYTHONPATH entry whose ``sitecustomize`` starts the recorder before the program's first line (in
every Python process it starts, too) and the NVTX injection library. The runner itself only
forwards signals and waits; the only thing recorded in this process is what its samplers read
(NVML and host counters, ``collectors/run_samplers.py``), into the same run directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_trace import config
from gpu_trace.signal_echo import Echo
from gpu_trace.tracer import context, ranks
from gpu_trace.tracer.clock import anchor, now_ns
from gpu_trace.tracer.files import disk_full
from gpu_trace.tracer.run import RUN_FILE, RunInfo, new_run_id, recorder_attrs, recording_attrs

log = logging.getLogger(__name__)

BOOT_DIR = Path(__file__).resolve().parent / "_boot"


class LaunchError(Exception):
    """The program could not be started; the message is one line for the user."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Launch:
    run_dir: Path
    info: RunInfo
    argv: list[str]
    env: dict[str, str]
    nvtx_mode: str
    notes: list[str] = field(default_factory=list)
    #: The NVML and host samplers (a ``collectors.run_samplers.RunSamplers``), or None.
    samplers: Any = None
    #: Why run.json could not be closed (a full disk), or "": `gpu-trace record` says so.
    save_error: str = ""


def prepare(
    argv: list[str],
    *,
    run_dir: Path | None = None,
    job: str | None = None,
    nvtx: str | None = None,
    torch: str | None = None,
    tf: str | None = None,
    environ: dict[str, str] | None = None,
    nvml_hz: float | None = None,
    host_hz: float | None = None,
    nvml_replay: Path | None = None,
    nvml_fallback: Path | None = None,
    remote: str | None = None,
    remote_sync: bool = False,
    gpu_activity: str | None = None,
    fallback_local: bool = False,
) -> Launch:
    """Create the run directory and the program's environment. Raises LaunchError.

    ``remote`` (or ``GPU_TRACE_REMOTE`` in ``environ``): the program's CUDA work is forwarded
    there, and a server that cannot be reached stops the run before it starts
    (:data:`SERVER_UNREACHABLE`), unless ``fallback_local``: then the program runs locally, the
    run is recorded as local, and a note says so.

    ``job`` (or ``GPU_TRACE_JOB``, or the launcher's job id: :func:`ranks.job_from_env`): this
    record is one part of a job; every part records into the run ``job-<ID>`` under the job's
    trace id, each in a run directory of its own (``<run id>.<host>.<pid>``), and ingest merges
    them (docs/distributed.md, "One run per job").
    """
    if not argv:
        raise LaunchError("no command given: gpu-trace record [OPTIONS] -- COMMAND [ARGS...]", 2)
    environ = dict(os.environ if environ is None else environ)
    try:
        config.check_environment(environ)
    except ValueError as exc:
        raise LaunchError(str(exc), 2) from None
    executable = shutil.which(argv[0], path=environ.get("PATH"))
    if executable is None:
        raise LaunchError(f"command not found: {argv[0]}", 127)
    remote = remote or environ.get("GPU_TRACE_REMOTE") or None
    fallback = ""
    if remote:
        unreachable = _unreachable(remote)
        if unreachable and not fallback_local:
            raise LaunchError(
                f"cannot reach the forwarding server at {remote}: {unreachable} (nothing was "
                "run; --fallback-local runs the program locally instead)",
                SERVER_UNREACHABLE,
            )
        if unreachable:
            fallback, remote = f"{remote}: {unreachable}", None
            environ.pop("GPU_TRACE_REMOTE", None)
    job = (job or "").strip() or ranks.job_from_env(environ)
    if job:
        run_id = ranks.job_run_id(job)
        part = f"{run_id}.{socket.gethostname()}.{os.getpid()}"
        run_dir = Path(run_dir) if run_dir is not None else config.runs_dir() / part
    else:
        run_id = new_run_id() if run_dir is None else Path(run_dir).name
        run_dir = Path(run_dir) if run_dir is not None else config.runs_dir() / run_id
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise LaunchError(
            f"run directory {run_dir} is not writable: {exc.strerror or exc}", 2
        ) from None
    if any(run_dir.iterdir()):
        raise LaunchError(f"run directory {run_dir} is not empty; give a new one", 2)

    incoming = context.extract(environ)
    if incoming:
        trace_id = incoming.trace_id
    else:
        trace_id = ranks.job_trace_id(job) if job else context.new_trace_id()
    # The run's root: the parent of everything the program records across processes and hosts.
    root_span_id = secrets.randbits(63) | 1
    a = anchor()
    info = RunInfo(
        run_id=run_id,
        trace_id=trace_id,
        started_ns=now_ns(),
        command=" ".join(argv),
        hosts=[socket.gethostname()],
        attrs={
            "anchor_mono_ns": str(a.mono_ns),
            "anchor_wall_ns": str(a.wall_ns),
            "cwd": os.getcwd(),
        },
    )
    info.attrs["root_span_id"] = f"{root_span_id:016x}"
    if job:
        info.attrs[ranks.JOB_ATTR] = job
    info.attrs.update(recorder_attrs())  # who closes the run; ingest marks it died if gone
    if incoming:
        info.attrs["parent_span_id"] = f"{incoming.parent_span_id:016x}"
    _save_or_refuse(info, run_dir, remove=created)

    mode = (nvtx or environ.get("GPU_TRACE_NVTX") or "native").lower()
    if mode not in ("native", "python", "off"):
        raise LaunchError(f"--nvtx must be native, python or off, got {mode!r}", 2)
    env = context.child_env(environ, trace_id, root_span_id)
    env["GPU_TRACE_RUN_DIR"] = str(run_dir.resolve())
    env["GPU_TRACE_RUN_ID"] = run_id
    if remote:
        env["GPU_TRACE_REMOTE"] = remote
        if remote_sync or "GPU_TRACE_REMOTE_SYNC" not in env:
            env["GPU_TRACE_REMOTE_SYNC"] = "1" if remote_sync else "0"
        info.attrs["remote"] = remote
    notes: list[str] = []
    if fallback:
        info.attrs["remote_fallback"] = fallback
        notes.append(
            f"WARNING: cannot reach the forwarding server at {fallback}; running the program "
            "LOCALLY, as --fallback-local asks: its CUDA work, if any, runs on this machine, "
            "and the run is recorded as local"
        )
    env["GPU_TRACE_NVTX"] = mode
    # Framework patch levels: applied in the program if and when it imports the framework.
    try:
        env["GPU_TRACE_TORCH"] = config.torch_level(torch or environ.get("GPU_TRACE_TORCH"))
        env["GPU_TRACE_TF"] = config.tf_level(tf or environ.get("GPU_TRACE_TF"))
    except ValueError as exc:
        raise LaunchError(str(exc), 2) from None
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(BOOT_DIR), environ.get("PYTHONPATH", "")) if p
    )
    _build_fast_range()
    if env["GPU_TRACE_TORCH"] != "off" and environ.get("GPU_TRACE_TORCH_OPS") != "kineto":
        _build_op_observer()
    if mode == "native":
        from gpu_trace.collectors import nvtx as nvtx_collector

        try:
            inject = nvtx_collector.injection_env()
        except Exception as exc:  # the build must never stop a recording
            inject = {}
            log.debug("NVTX injection unavailable", exc_info=True)
            notes.append(
                f"native NVTX capture is off ({exc}); Python NVTX ranges are still recorded"
            )
        if inject:
            env.update(inject)
        elif not notes:
            reason = nvtx_collector.build_error() or "the injection library is unavailable"
            notes.append(
                f"native NVTX capture is off ({reason}); Python NVTX ranges are still recorded"
            )
        if not inject:
            env["GPU_TRACE_NVTX"] = "python"
    info.attrs["nvtx"] = env["GPU_TRACE_NVTX"]
    # GPU activity: CUPTI's injection library in every CUDA process of the run (gpu-activity.md).
    from gpu_trace.collectors import gpu_activity as activity

    setting = gpu_activity or environ.get("GPU_TRACE_GPU_ACTIVITY")
    inject, info.attrs["gpu_activity"], line = activity.prepare(setting)
    env.update(inject)
    notes.extend([line] if line else [])
    samplers = _prepare_samplers(info, run_dir, nvml_hz, host_hz, nvml_replay, nvml_fallback)
    notes.extend(samplers.notes)
    info.attrs.update(samplers.attrs)
    # How the run is recorded, the same keys every entry point writes (ls, show).
    info.attrs.update(recording_attrs("record", environ=env, samplers=samplers.attrs))
    _save_or_refuse(info, run_dir)
    return Launch(
        run_dir, info, [executable, *argv[1:]], env, env["GPU_TRACE_NVTX"], notes, samplers
    )


#: `gpu-trace record`'s exit status when the forwarding server cannot be reached (sysexits.h's
#: EX_UNAVAILABLE): the program did not run.
SERVER_UNREACHABLE = 69


def _unreachable(address: str) -> str:
    """Why the server at ``address`` cannot be reached ("" if it can): a TCP connection, closed
    at once (the server counts nothing for it). Raises LaunchError for a malformed address."""
    from gpu_trace.runtime.protocol.addresses import parse_address

    try:
        host, port = parse_address(address)
    except ValueError as exc:
        raise LaunchError(f"--remote: {exc}", 2) from None
    timeout = min(10.0, config.remote_timeout())
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return ""
    except TimeoutError:
        return f"no answer in {timeout:g} s"
    except OSError as exc:
        return str(exc.strerror or exc)


def _save_or_refuse(info: RunInfo, run_dir: Path, *, remove: bool = False) -> None:
    """Write run.json before the program starts; a disk too full for it stops the run here
    (``remove``: and the run directory this run made goes, if nothing is in it)."""
    try:
        info.save(run_dir)
    except OSError as exc:
        if remove:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise LaunchError(f"cannot write {run_dir / RUN_FILE}: {_reason(exc)}", 2) from None


def _reason(exc: OSError) -> str:
    return "the disk is full" if disk_full(exc) else str(exc.strerror or exc)


def _prepare_samplers(
    info: RunInfo,
    run_dir: Path,
    nvml_hz: float | None,
    host_hz: float | None,
    nvml_replay: Path | None,
    nvml_fallback: Path | None = None,
) -> Any:
    from gpu_trace.collectors.run_samplers import RunSamplers

    try:
        return RunSamplers.prepare(
            run_dir,
            run_id=info.run_id,
            trace_id=info.trace_id,
            nvml_hz=config.nvml_hz(nvml_hz),
            host_hz=config.host_hz(host_hz),
            nvml_replay=config.nvml_replay(nvml_replay),
            nvml_fallback=nvml_fallback,
        )
    except ValueError as exc:
        raise LaunchError(str(exc), 2) from None


def _build_fast_range() -> None:
    """Build the C ``gpu_trace.range`` into the per-user cache now, so the program (and each
    process it starts) finds it there instead of compiling it; without it, the Python twin runs."""
    from gpu_trace.tracer import fastpath_build

    try:
        fastpath_build.find_or_build(config.home() / "lib", cc=config.c_compiler())
    except Exception:
        log.debug(
            "the C gpu_trace.range is unavailable; the program uses the Python one", exc_info=True
        )


def _build_op_observer() -> None:
    """Build the native op observer into the per-user cache now (once per torch, a few seconds),
    so the program records with it from the start (op level: ops; module level: the autograd
    nodes its module backward ranges come from) rather than with the profiler's sessions or
    Python hooks while it builds in the program (framework_patches/torch/ops_native.py)."""
    if importlib.util.find_spec("torch") is None:
        return
    try:
        from gpu_trace.framework_patches.torch import ops_native

        ops_native.find_or_build()
    except Exception:
        log.debug("the native op observer is unavailable; op level uses sessions", exc_info=True)


def run(launch: Launch) -> int:
    """Run the program to completion, forwarding SIGINT and SIGTERM; returns its exit status.

    A program killed by a signal gives 128 + the signal number, as a shell reports it.
    """
    samplers = launch.samplers
    echo = Echo() if _block_possible() else None
    try:
        if echo is None:
            proc = subprocess.Popen(launch.argv, env=launch.env)
        else:
            env = {**launch.env, **echo.env}
            proc = subprocess.Popen(launch.argv, env=env, pass_fds=(echo.write_fd,))
            echo.started()
    except OSError as exc:
        if echo is not None:
            echo.close()
        if samplers is not None:
            samplers.stop()
        finish(launch, 126, f"could not start: {exc.strerror or exc}")
        raise LaunchError(f"cannot run {launch.argv[0]}: {exc.strerror or exc}", 126) from None

    def forward(signum: int, _frame: object = None) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    # Blocked before the samplers' threads start, so they inherit the mask and every forwarded
    # signal reaches _wait's sigtimedwait, which says who sent it.
    blocked = _block_signals()
    try:
        if samplers is not None:
            samplers.start(proc.pid)
        returncode = _wait(proc, forward, echo) if blocked else _wait_plain(proc)
    finally:
        if echo is not None:
            echo.close()
        if blocked:  # a signal still pending now goes to `forward` (the program has ended)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _WATCHED)
        if samplers is not None:  # stopped and flushed before anything is ingested
            samplers.stop()
        for s, h in previous.items():
            signal.signal(s, h)
    if returncode < 0:
        name = signal.Signals(-returncode).name
        finish(launch, 128 - returncode, f"killed by {name}")
        return 128 - returncode
    finish(launch, returncode, "" if returncode == 0 else f"exited with status {returncode}")
    return returncode


#: What `gpu-trace record` passes on to the program.
FORWARDED = (signal.SIGINT, signal.SIGTERM)
_WATCHED = {*FORWARDED, signal.SIGCHLD}
#: ``si_code`` of a signal the kernel sent: a terminal's ^C goes to its whole foreground process
#: group, the program included (Linux ``SI_KERNEL``).
SI_KERNEL = 0x80


def _block_possible() -> bool:
    """Whether :func:`_block_signals` can block (so :func:`_wait` sees who sent what)."""
    return hasattr(signal, "sigtimedwait") and threading.current_thread() is (
        threading.main_thread()
    )


def _block_signals() -> bool:
    """Block the forwarded signals and SIGCHLD in this thread, for :func:`_wait`; False where
    that is not possible (no ``sigtimedwait``, or not the main thread)."""
    if not _block_possible():
        return False
    signal.pthread_sigmask(signal.SIG_BLOCK, _WATCHED)
    return True


def _wait(
    proc: subprocess.Popen[bytes], forward: Callable[[int], None], echo: Echo | None = None
) -> int:
    """Wait for the program, forwarding each SIGINT and SIGTERM sent to this process alone.

    One that the kernel sent (a terminal's ^C) reached the program too, since it shares our
    process group: forwarding it as well gave the program two, so a program cleaning up after
    its first ``KeyboardInterrupt`` (saving a checkpoint) was interrupted again. One sent to the
    whole group with ``kill`` looks like one sent to us alone; the program's ``echo`` (a Python
    program's own account of the signals it got: :mod:`gpu_trace.signal_echo`) tells them apart.
    """
    while (returncode := proc.poll()) is None:
        info = signal.sigtimedwait(_WATCHED, 1.0)  # SIGCHLD wakes it when the program ends
        if info is None or info.si_signo not in FORWARDED:
            if echo is not None:
                echo.read()  # noted with the time: what it says long before a signal is not it
            continue
        name = signal.Signals(info.si_signo).name
        if info.si_code == SI_KERNEL:
            log.debug("%s from the terminal reached the program too: not forwarded", name)
        elif echo is not None and echo.program_got(info.si_signo):
            log.debug(
                "%s (sent by pid %d) reached the program too: not forwarded", name, info.si_pid
            )
        else:
            log.debug("forwarding %s (sent by pid %d) to the program", name, info.si_pid)
            forward(info.si_signo)
    return returncode


def _wait_plain(proc: subprocess.Popen[bytes]) -> int:
    """:func:`_wait` where signals cannot be examined: each one is forwarded by the handler."""
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # pragma: no cover - the handler replaces it
            continue


def finish(launch: Launch, exit_code: int, reason: str) -> None:
    """Close the run in run.json: status finished, failed or killed, with the exit code."""
    info = launch.info
    info.ended_ns = now_ns()
    info.status = (
        "finished" if exit_code == 0 else "killed" if reason.startswith("killed") else "failed"
    )
    info.attrs["exit_code"] = str(exit_code)
    if reason:
        info.attrs["reason"] = reason
    try:
        info.save(launch.run_dir)
    except OSError as exc:  # the program's status stands; the closing line says run.json is stale
        launch.save_error = f"{launch.run_dir / RUN_FILE} not updated: {_reason(exc)}"
