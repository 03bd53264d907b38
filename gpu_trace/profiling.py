"""``with gpu_trace.profile() as run:``: record a block in this process, store it, read it back.

What `gpu-trace record` does around a whole program, for one block of a program that is already
running (a notebook cell, a training loop in a script):

- before the block: the arguments and every ``GPU_TRACE_*`` setting are checked (a bad one is one
  ``ValueError`` and the block does not run), a run directory is opened, the NVML and host
  samplers start in a process of their own (:mod:`gpu_trace.sampler_process`: nothing of theirs
  runs in the program's threads), and the recorder starts with the same capture as `record`
  (framework patches at the levels asked, NVTX: ``gpu_trace/_capture.py``);
- after it, even when it raised: the recorder stops and flushes, the samplers stop and flush, the
  run is closed in ``run.json`` (``finished``, or ``failed``/``killed`` with the exception's type)
  and ingested into the store (``store/ingest.py``); the block's exception then goes on unchanged.

The ``as`` target is a :class:`~gpu_trace.run_view.Run`, readable once the block has ended. A
store that fails at the end is logged, not raised: the spool stays, and the Run says how to load
it (``gpu-trace ingest DIR``).

One block records at a time in a process: a nested ``profile()``, or one inside `gpu-trace
record` or ``gpu_trace.start()``, is refused before it starts, and so is ``start()`` inside it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import sys
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from gpu_trace import config
from gpu_trace.run_view import Run
from gpu_trace.tracer import context, recorder
from gpu_trace.tracer.clock import anchor, now_ns
from gpu_trace.tracer.run import RunInfo, new_run_id, recorder_attrs, recording_attrs

if TYPE_CHECKING:
    from gpu_trace.sampler_process import SamplerProcess

log = logging.getLogger(__name__)

#: The block recording now in this process, if any.
_active: Profile | None = None


def active_run() -> str | None:
    """The id of the run a ``profile()`` block is recording now, or None."""
    return _active.run.id if _active is not None and _active.run is not None else None


def _rate(what: str, value: bool | float, default: float) -> float:
    """``True``: the configured rate (``GPU_TRACE_NVML_HZ``...), ``False``: off, a number: Hz."""
    if isinstance(value, bool):
        return default if value else 0.0
    if not isinstance(value, (int, float)) or not 0 <= value <= 1000:
        raise ValueError(
            f"profile({what}=...) takes True, False or samples per second in [0, 1000], got {value!r}"
        )
    return float(value)


class Profile:
    """A ``profile()`` block; see :func:`profile`. Entering it returns the block's Run."""

    def __init__(
        self,
        *,
        torch: str | None = None,
        tf: str | None = None,
        nvml: bool | float = True,
        host: bool | float = True,
        nvtx: str | None = None,
        store: str | None = None,
        name: str | None = None,
        ingest: bool = True,
        keep_spool: bool | None = None,
    ) -> None:
        from gpu_trace.store.dsn import parse_dsn
        from gpu_trace.store.embedded import check_writable

        config.check_environment()
        self.torch = config.torch_level(_text("torch", torch))
        self.tf = config.tf_level(_text("tf", tf))
        self.nvtx = (_text("nvtx", nvtx) or str(config.RecorderSettings.from_env().nvtx)).lower()
        if self.nvtx not in ("native", "python", "off"):
            raise ValueError(f"profile(nvtx=...) must be native, python or off, got {nvtx!r}")
        self.nvml_hz = _rate("nvml", nvml, config.nvml_hz())
        self.host_hz = _rate("host", host, config.host_hz())
        if name is not None and not isinstance(name, str):
            raise ValueError(f"profile(name=...) must be a string, got {type(name).__name__}")
        self.name = name
        self.dsn = config.store_dsn(_text("store", store))
        try:
            parse_dsn(self.dsn)
        except ValueError as exc:
            raise ValueError(f"profile(store={self.dsn!r}): {exc}") from None
        self.ingest = bool(ingest)
        if keep_spool is not None and not isinstance(keep_spool, bool):
            raise ValueError(
                f"profile(keep_spool=...) must be True, False or None, got {keep_spool!r}"
            )
        self.keep_spool = keep_spool
        if self.ingest:
            problem = check_writable(self.dsn)
            if problem:
                raise ValueError(f"store {self.dsn} is not usable: {problem}")
        self.run: Run | None = None
        self._info: RunInfo | None = None
        self._samplers: SamplerProcess | None = None

    def __enter__(self) -> Run:
        global _active
        if _active is not None:
            raise ValueError(
                f"gpu_trace.profile() blocks do not nest: run {active_run()} is recording; "
                "end its with block first"
            )
        if recorder.active is not None:
            raise ValueError(
                f"already recording into {recorder.active.run_dir} (gpu-trace record or "
                "gpu_trace.start()): profile() records a run of its own, one run at a time; "
                "inside that recording, mark the part with gpu_trace.range() instead"
            )
        config.check_environment()
        run_id = new_run_id()
        run_dir = config.runs_dir() / run_id
        if run_dir.exists():
            raise ValueError(f"run directory {run_dir} exists already")
        self._info = info = self._new_info(run_id)
        info.save(run_dir)
        _active = self
        try:
            self._samplers = self._start_samplers(run_dir, info)
            sampled = self._samplers.attrs if self._samplers else {}
            info.attrs.update(sampled)
            info.attrs.update(
                recording_attrs(
                    "profile", torch=self.torch, tf=self.tf, nvtx=self.nvtx, samplers=sampled
                )
            )
            from gpu_trace import _capture
            from gpu_trace.tracer.session import start_run

            attach = functools.partial(_capture.attach, torch=self.torch, tf=self.tf)
            start_run(run_dir, attach=attach, nvtx=self.nvtx)
            # The run spans the block: not the samplers' start, nor a first build of the NVTX
            # library in start_run.
            info.started_ns = now_ns()
            info.attrs["nvtx"] = self._nvtx_in_effect()
            info.save(run_dir)
        except BaseException as exc:
            _active = None
            if self._samplers is not None:
                self._samplers.stop()
            info.status, info.ended_ns = "failed", now_ns()  # not left "running" by a live pid
            info.attrs["reason"] = f"could not start: {type(exc).__name__}: {exc}"[:300]
            with contextlib.suppress(OSError):
                info.save(run_dir)
            raise
        notes = self._samplers.notes if self._samplers else []
        for note in notes:
            log.info("gpu-trace: %s", note)
        self.run = Run(run_id, self.dsn, run_dir=run_dir, notes=notes, recording=True)
        return self.run

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop, close and store the run; the block's exception (if any) goes on unchanged."""
        global _active
        if self._info is not None:
            self._info.ended_ns = now_ns()  # the block's end, before the flush
        try:
            self._finish(exc)
        except Exception as error:  # never replace the program's exception, nor raise one of ours
            log.exception("gpu-trace: finishing run %s failed", active_run())
            if self.run is not None and self.run.dir is not None:
                self.run.end_recording(
                    f"not stored: finishing it failed ({type(error).__name__}: {error}); "
                    f"its spool is in {self.run.dir} (gpu-trace ingest {self.run.dir})"
                )
        finally:
            _active = None

    # ---- inside ---------------------------------------------------------------------------------

    def _new_info(self, run_id: str) -> RunInfo:
        a = anchor()
        attrs = {
            "anchor_mono_ns": str(a.mono_ns),
            "anchor_wall_ns": str(a.wall_ns),
            "pid": str(os.getpid()),
            "cwd": os.getcwd(),
            "root_span_id": f"{secrets.randbits(63) | 1:016x}",
            **recording_attrs("profile", torch=self.torch, tf=self.tf, nvtx=self.nvtx),
            **recorder_attrs(),  # this process closes the run; ingest marks it died if it is gone
        }
        if self.name:
            attrs["name"] = self.name
        command = self.name or "gpu_trace.profile() in " + " ".join(sys.argv)[:200]
        trace_id = context.trace_id_from_env() or context.new_trace_id()
        return RunInfo(run_id, trace_id, now_ns(), command=command, attrs=attrs)

    def _nvtx_in_effect(self) -> str:
        """The NVTX capture this block got: ``native`` falls back to ``python`` (the package's
        functions patched) when NVTX was initialized in this process before the first block."""
        patch = sys.modules.get("gpu_trace.collectors.nvtx.patch")
        patched = patch is not None and bool(patch.is_patched())
        if self.nvtx == "off" or (self.nvtx == "python" and not patched):
            return "off"
        return "python" if patched else self.nvtx

    def _start_samplers(self, run_dir: Path, info: RunInfo) -> SamplerProcess | None:
        if not self.nvml_hz and not self.host_hz:
            return None
        from gpu_trace.sampler_process import SamplerProcess

        return SamplerProcess.start(
            run_dir,
            run_id=info.run_id,
            trace_id=info.trace_id,
            pid=os.getpid(),
            nvml_hz=self.nvml_hz,
            host_hz=self.host_hz,
            nvml_replay=config.nvml_replay(),
        )

    def _finish(self, exc: BaseException | None) -> None:
        from gpu_trace import _capture
        from gpu_trace.tracer.session import stop_run

        run, info = self.run, self._info
        if run is None or info is None or run.dir is None:
            return
        if self._samplers is not None:
            self._samplers.ask_to_stop()  # they stop and flush while the recorder does
        try:
            stop_run(detach=_capture.detach)
        finally:
            if self._samplers is not None:
                self._samplers.stop()
                self._samplers = None
        if exc is None:
            info.status = "finished"
        else:
            info.status = "killed" if isinstance(exc, KeyboardInterrupt) else "failed"
            info.attrs["reason"] = _reason(exc)
        try:
            info.save(run.dir)
        except OSError as exc_save:
            log.warning("gpu-trace: %s not updated: %s", run.dir, exc_save)
        if self.ingest:
            run.end_recording(_ingest(run.dir, self.dsn, self.keep_spool))
        else:
            run.end_recording(f"not ingested (ingest=False): gpu-trace ingest {run.dir}")


def _ingest(run_dir: Path, dsn: str, keep_spool: bool | None) -> str | None:
    """Ingest the run, then remove its spool once the store is checked to hold it (as `gpu-trace
    record` does; ``keep_spool``); None when it is stored, else why not (logged; spool kept)."""
    from gpu_trace.store.client import Store, StoreError
    from gpu_trace.store.ingest import ingest
    from gpu_trace.store.retention import release_spool

    try:
        with Store(dsn) as store:
            report = ingest(store, run_dir)
            try:
                release = release_spool(store, run_dir, keep=keep_spool)
                if release.kept:
                    log.info("gpu-trace: run %s: spool kept: %s", run_dir.name, release.kept)
            except StoreError as exc:
                log.warning("gpu-trace: spool kept: its ingest could not be checked (%s)", exc)
    except StoreError as exc:
        why = f"NOT stored: {exc}; the spool is kept: load it later with gpu-trace ingest {run_dir}"
        log.warning("gpu-trace: run %s %s", run_dir.name, why)
        return why
    for problem in report.problems:
        log.warning("gpu-trace: %s", problem)
    log.info("gpu-trace: %s", report.summary())
    return None


def _reason(exc: BaseException) -> str:
    """``Type: first line of the message`` of the block's exception (whatever its ``__str__``)."""
    try:
        lines = str(exc).splitlines()
    except Exception:
        lines = []
    return type(exc).__name__ + (f": {lines[0][:200]}" if lines else "")


def _text(what: str, value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    raise ValueError(f"profile({what}=...) must be a string, got {type(value).__name__}")


def profile(
    *,
    torch: str | None = None,
    tf: str | None = None,
    nvml: bool | float = True,
    host: bool | float = True,
    nvtx: str | None = None,
    store: str | None = None,
    name: str | None = None,
    ingest: bool = True,
    keep_spool: bool | None = None,
) -> Profile:
    """Record the ``with`` block in this process and store it: ``with gpu_trace.profile() as run:``.

    ``torch``: PyTorch ranges, ``module`` (default: ``GPU_TRACE_TORCH`` or module), ``op`` or
    ``off``; ``tf``: TensorFlow's, ``layer``, ``op`` or ``off``; ``nvml``/``host``: the samplers,
    ``True`` (their configured rate), ``False`` or samples per second, run in a process of their
    own; ``nvtx``: ``native``, ``python`` or ``off``; ``store``: a store DSN (default
    ``GPU_TRACE_STORE``, else the embedded one); ``name``: a name for the run (its command in
    ``gpu-trace ls``); ``ingest=False`` keeps the run in its spool only; once the store is
    checked to hold the run its spool is removed, as `gpu-trace record` does (``keep_spool=True``,
    or ``GPU_TRACE_KEEP_SPOOL``, keeps it).

    Bad arguments raise ``ValueError`` here, before the block runs. The ``as`` target is the
    block's :class:`~gpu_trace.run_view.Run`, readable once the block has ended; an exception in
    the block still stores what was recorded, then goes on unchanged. Blocks do not nest.
    """
    return Profile(
        torch=torch,
        tf=tf,
        nvml=nvml,
        host=host,
        nvtx=nvtx,
        store=store,
        name=name,
        ingest=ingest,
        keep_spool=keep_spool,
    )
