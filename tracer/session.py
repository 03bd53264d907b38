"""Starting and stopping recording in a process: from `gpu-trace record`'s environment or by hand.

tracer/ is the bottom layer (capture -> record -> store -> views) and imports nothing above it:
what else a run records (framework ranges, NVTX) is handed in as ``attach``/``detach`` by the layer
that starts the session (``gpu_trace/_capture.py``). Only the program's OpenTelemetry spans, which
``tracer/otel.py`` turns into records, are attached here.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_trace import config
from gpu_trace._imports import discard, when_imported
from gpu_trace.tracer import context, recorder
from gpu_trace.tracer.clock import anchor, now_ns
from gpu_trace.tracer.run import RunInfo, new_run_id, recorder_attrs, recording_attrs

log = logging.getLogger(__name__)

#: Attaches a run's further sources to its recorder; never raises (see ``gpu_trace/_capture.py``).
Attach = Callable[[recorder.Recorder, config.RecorderSettings], None]
#: Undoes what an :data:`Attach` patched.
Detach = Callable[[], None]

_owned_run: Path | None = None  # set when this process created the run (programmatic start)


def start_from_env(attach: Attach | None = None) -> recorder.Recorder | None:
    """Start recording if `gpu-trace record` asked for it (``GPU_TRACE_RUN_DIR``)."""
    settings = config.RecorderSettings.from_env()
    if settings.run_dir is None or recorder.active is not None:
        return recorder.active
    run_id = settings.run_id or settings.run_dir.name
    trace_id = context.trace_id_from_env() or ""
    # `gpu-trace record` reports a full disk in its closing line, from the stats file.
    rec = recorder.start(settings, trace_id=trace_id, run_id=run_id, warn_write_errors=False)
    _attach(rec, attach)
    return rec


def start_run(
    run_dir: Path | None = None,
    *,
    attach: Attach | None = None,
    started_by: str = "start",
    **overrides: Any,
) -> Path:
    """Start a run in this process (see :func:`gpu_trace.start`); ``started_by`` names the entry
    point in the run's attrs (:func:`~gpu_trace.tracer.run.recording_attrs`)."""
    global _owned_run
    if recorder.active is not None:
        raise ValueError(f"already recording into {recorder.active.run_dir}")
    config.check_environment()  # a bad setting is refused here, not by recording nothing later
    run_id = new_run_id() if run_dir is None else Path(run_dir).name
    run_dir = Path(run_dir) if run_dir is not None else config.runs_dir() / run_id
    settings = config.RecorderSettings.from_env(run_dir=run_dir, run_id=run_id, **overrides)
    trace_id = context.trace_id_from_env() or context.new_trace_id()
    if not RunInfo.exists(run_dir):
        a = anchor()
        info = RunInfo(
            run_id=run_id,
            trace_id=trace_id,
            started_ns=now_ns(),
            command=" ".join(sys.argv) or sys.executable,
            attrs={
                "anchor_mono_ns": str(a.mono_ns),
                "anchor_wall_ns": str(a.wall_ns),
                "pid": str(os.getpid()),
                # This process closes the run: if it dies first, ingest marks the run died.
                **recorder_attrs(),
                **recording_attrs(started_by, nvtx=settings.nvtx),
            },
        )
        info.save(run_dir)
        _owned_run = run_dir
    else:
        trace_id = RunInfo.load(run_dir).trace_id
    rec = recorder.start(settings, trace_id=trace_id, run_id=run_id)
    _attach(rec, attach)
    return run_dir


def stop_run(detach: Detach | None = None) -> Path | None:
    """Stop recording, flush, and close the run if this process started it."""
    global _owned_run
    rec = recorder.stop()
    _detach(detach)
    if rec is None:
        return None
    if _owned_run is not None and _owned_run == rec.run_dir:
        info = RunInfo.load(rec.run_dir)
        info.ended_ns = now_ns()
        info.status = "finished"
        info.save(rec.run_dir)
        _owned_run = None
    return rec.run_dir


def _attach(rec: recorder.Recorder, attach: Attach | None) -> None:
    # The program's OpenTelemetry spans, if it uses the SDK (not imported otherwise).
    when_imported("opentelemetry.sdk.trace", _install_otel)
    if attach is None:
        return
    try:
        attach(rec, rec.settings)
    except Exception:  # never break the traced program
        log.exception("gpu-trace: attaching collectors failed")


def _detach(detach: Detach | None) -> None:
    """Undo what _attach patched (NVTX patches are undone by their source's close)."""
    discard("opentelemetry.sdk.trace", _install_otel)
    if detach is not None:
        try:
            detach()
        except Exception:
            log.exception("gpu-trace: detaching collectors failed")
    otel = sys.modules.get("gpu_trace.tracer.otel")
    if otel is not None:
        otel.uninstall()


def _install_otel(module: object) -> None:
    from gpu_trace.tracer import otel

    otel.install()
