"""A run's NVML and host samplers in a process of their own, beside an in-process recording.

`gpu-trace record` samples from its own parent process, outside the program. A block recorded
with ``gpu_trace.profile()`` has no such parent (a notebook's kernel is the program), so the same
samplers (:class:`~gpu_trace.collectors.run_samplers.RunSamplers`) run in a child process started
here: their threads, their spool flushes and their NVML calls stay out of the program's process,
and their samples carry the program's pid as record's do.

The child is told what to do in one JSON argument, says ``{"pid", "notes", "attrs"}`` on one
stdout line once its sources are open, samples until its stdin closes (the parent closes it when
the block ends, or dies), then stops, flushes into the run directory and exits; its stdout closing
tells the parent it is done. It detaches first (a second fork, whose parent exits at once): the
samplers attribute CPU, memory and GPU memory to the program's pid and its descendants, and the
sampler must not count itself among them. It runs in a session of its own, so a notebook's
interrupt (a signal to the kernel's process group) does not cut its flush short.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

#: How long the parent waits for the child to open its sources before the block starts anyway
#: (the samples then begin a little after the block does).
READY_TIMEOUT_S = 15.0
#: How long the parent waits for the child to stop and flush before it kills it.
STOP_TIMEOUT_S = 30.0


@dataclass
class SamplerProcess:
    """The parent's handle on the sampler child; ``notes`` say what is off, ``attrs`` go to run.json."""

    proc: subprocess.Popen[bytes] | None
    notes: list[str] = field(default_factory=list)
    attrs: dict[str, str] = field(default_factory=dict)
    #: The sampler's own pid (it is not the Popen's: it detached).
    sampler_pid: int | None = None

    @classmethod
    def start(
        cls,
        run_dir: Path,
        *,
        run_id: str,
        trace_id: str,
        pid: int,
        nvml_hz: float,
        host_hz: float,
        nvml_replay: Path | None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> SamplerProcess:
        """Start the child sampling ``pid`` (and its descendants) into ``run_dir``; never raises
        for a child that fails (the notes say so and the block runs without samples)."""
        spec = {
            "run_dir": str(run_dir),
            "run_id": run_id,
            "trace_id": trace_id,
            "pid": pid,
            "nvml_hz": nvml_hz,
            "host_hz": host_hz,
            "nvml_replay": str(nvml_replay) if nvml_replay else None,
        }
        env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpu_trace.sampler_process", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        except OSError as exc:
            return cls(None, [f"samplers are off: cannot start their process: {exc}"])
        self = cls(proc)
        try:
            proc.wait(ready_timeout_s)  # the first fork exits as soon as it has forked again
            line = _read_line(proc, ready_timeout_s)
        except subprocess.TimeoutExpired:
            line = None
        except BaseException:  # Ctrl-C while it starts: nothing is left running
            self._abandon()
            raise
        if proc.returncode is None:
            self._abandon()
            return cls(None, ["samplers are off: their process did not start"])
        if line is None:
            self.notes.append("samplers are off: their process did not start")
            self._close()
            return self
        try:
            ready = json.loads(line)
            self.sampler_pid = int(ready.get("pid", 0)) or None
            self.notes.extend(str(n) for n in ready.get("notes", []))
            self.attrs.update({str(k): str(v) for k, v in ready.get("attrs", {}).items()})
            if ready.get("error"):
                self.notes.append(f"samplers are off: {ready['error']}")
        except (ValueError, AttributeError, TypeError):
            self.notes.append(f"samplers said something unexpected: {line[:200]!r}")
        return self

    def ask_to_stop(self) -> None:
        """Tell the child to stop (close its stdin) without waiting: it stops and flushes while
        the caller does its own part (the program's recorder flushes meanwhile)."""
        proc = self.proc
        if proc is not None and proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Tell the child to stop and wait until it has flushed and exited (its stdout closes);
        killed past ``timeout_s``. Idempotent; never raises."""
        proc = self.proc
        if proc is None:
            return
        try:
            self.ask_to_stop()
            if not _drained(proc, timeout_s) and self.sampler_pid:
                log.warning(
                    "gpu-trace: the sampler process did not stop in %.0f s; killed", timeout_s
                )
                with contextlib.suppress(OSError):
                    os.kill(self.sampler_pid, signal.SIGKILL)
        except OSError:
            log.debug("stopping the sampler process", exc_info=True)
        finally:
            self._close()

    def _abandon(self) -> None:
        """Give up on a child that did not start: kill what is left and close the pipes (a
        sampler that got as far as its own fork ends when its stdin closes)."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()
        self._close()

    def _close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


#: Settings of a `gpu-trace record` run that the sampler must not take for its own.
_NOT_INHERITED = ("GPU_TRACE_RUN_DIR", "GPU_TRACE_RUN_ID")


def _read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str | None:
    """The child's first stdout line, or None if it exits or says nothing within ``timeout_s``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    buf = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return None
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                return None
            buf += chunk
    return buf.split(b"\n", 1)[0].decode("utf-8", "replace")


def _drained(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the child's stdout reached its end (the child exited) within ``timeout_s``."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return False
            if not os.read(proc.stdout.fileno(), 4096):
                return True


def main(argv: list[str]) -> int:
    """The child: detach, open the samplers, say so, sample until stdin closes, flush."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends us by closing stdin
    if os.fork():  # before any thread or import: the parent waits for this exit, the rest
        os._exit(0)  # runs in a process that is no longer the program's descendant
    from gpu_trace.collectors.run_samplers import RunSamplers

    try:
        spec = json.loads(argv[1])
        samplers = RunSamplers.prepare(
            Path(spec["run_dir"]),
            run_id=spec["run_id"],
            trace_id=spec["trace_id"],
            nvml_hz=float(spec["nvml_hz"]),
            host_hz=float(spec["host_hz"]),
            nvml_replay=Path(spec["nvml_replay"]) if spec.get("nvml_replay") else None,
        )
    except Exception as exc:  # one line for the parent, which goes on without samples
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 2
    ready = {"pid": os.getpid(), "notes": samplers.notes, "attrs": samplers.attrs}
    print(json.dumps(ready), flush=True)
    samplers.start(int(spec["pid"]))
    try:
        sys.stdin.buffer.read()  # until the parent closes it (or is gone)
    finally:
        samplers.stop()  # flushed and closed: the samples are on disk
    os._exit(0)  # the parent waits for this exit; the interpreter's teardown would only delay it


if __name__ == "__main__":
    sys.exit(main(sys.argv))
