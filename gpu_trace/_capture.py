"""What a run records besides its explicit ranges, attached when recording starts in a process.

PyTorch and TensorFlow ranges (``framework_patches``) and NVTX ranges (``collectors.nvtx``) sit
above the tracer, which imports nothing above it (see ``tracer/session.py``): so the layer that starts
a session, ``gpu_trace.start()`` and ``sitecustomize`` under `gpu-trace record`, hands these two
functions to ``tracer/session.py``. Neither raises into the traced program.
"""

from __future__ import annotations

import logging
import sys

from gpu_trace.config import RecorderSettings
from gpu_trace.tracer.recorder import Recorder

log = logging.getLogger(__name__)


def attach(
    rec: Recorder, settings: RecorderSettings, *, torch: str | None = None, tf: str | None = None
) -> None:
    """Patch in the framework ranges (when and if the program imports a framework) and NVTX.

    ``torch``/``tf``: the patch levels (``gpu_trace.profile(torch=...)``); None reads
    ``GPU_TRACE_TORCH``/``GPU_TRACE_TF`` as `gpu-trace record` sets them.
    """
    try:
        from gpu_trace.framework_patches import hooks

        hooks.install(rec, torch=torch, tf=tf)
    except Exception:
        log.exception("gpu-trace: framework ranges are off")
    if settings.nvtx == "off":
        return
    try:
        from gpu_trace.collectors import nvtx

        nvtx.attach(rec, settings.nvtx)
    except Exception:
        log.exception("gpu-trace: NVTX capture is off")


def detach() -> None:
    """Undo the framework patches (NVTX patches are undone by their source's close)."""
    hooks = sys.modules.get("gpu_trace.framework_patches.hooks")
    if hooks is not None:
        hooks.uninstall()
