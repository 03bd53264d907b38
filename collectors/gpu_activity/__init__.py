"""GPU activity: every kernel, copy, memset and CUDA call, tied to the op that launched it.

Captured by CUPTI's Activity API from an injection library the CUDA driver loads in every process
of the run (``injection.c``, ``library.py``); raw records go to the run's spool
(``activity_file.py``) and become spans before ingest (``converter.py``, ``conversion.py``,
``span_columns.py``).
Recorded records replay through the same path (``replay_file.py``). See docs/gpu-activity.md.
"""

from __future__ import annotations

import ctypes.util
import logging

from gpu_trace import config

log = logging.getLogger(__name__)


def driver_present() -> bool:
    """Whether an NVIDIA driver (libcuda) is installed: without one no program here runs CUDA."""
    return ctypes.util.find_library("cuda") is not None


def prepare(setting: str | None = None) -> tuple[dict[str, str], str, str | None]:
    """For ``gpu-trace record``: the variables to add to the program's environment, the state for
    the run's attrs (``on``/``off``), and one line for the user when capture was asked for (or a
    GPU is there) but cannot happen. Never raises: a recording goes on without GPU activity.
    """
    from gpu_trace.collectors.gpu_activity import library

    try:
        mode = config.gpu_activity(setting)
        if mode == "off":
            return {}, "off", None
        if not driver_present():
            line = "GPU activity is off: no NVIDIA driver (libcuda) on this machine"
            return {}, "off", None if mode == "auto" else line
        env, why = library.injection_env(config.home() / "lib", cc=config.c_compiler())
    except Exception as exc:  # a build or lookup failure must never stop a recording
        log.debug("GPU activity unavailable", exc_info=True)
        return {}, "off", f"GPU activity is off: {exc}"
    return (env, "on", None) if env else ({}, "off", why)
