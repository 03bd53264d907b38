"""Applying the framework patches when, and only if, the program imports the framework.

:func:`install` (called by the session when recording starts) registers post-import hooks for
``torch`` and ``tensorflow`` (:mod:`gpu_trace._imports`): nothing is imported here, and a program
that never imports a framework never pays for its patch. :func:`uninstall` forgets the hooks and
undoes whatever was patched.
"""

from __future__ import annotations

import logging
import sys
from types import ModuleType
from typing import Any

from gpu_trace import config
from gpu_trace._imports import discard, when_imported

log = logging.getLogger(__name__)

_state: dict[str, Any] = {"rec": None, "torch": "off", "tf": "off", "shapes": False}


def install(rec: Any, *, torch: str | None = None, tf: str | None = None) -> None:
    """Patch PyTorch and TensorFlow at their levels: ``torch``/``tf`` when given (as
    ``gpu_trace.profile()`` does), else ``GPU_TRACE_TORCH``, ``GPU_TRACE_TF``."""
    uninstall()
    try:
        _state.update(
            rec=rec,
            torch=config.torch_level(torch),
            tf=config.tf_level(tf),
            shapes=config.torch_shapes(),
        )
    except ValueError as exc:
        log.warning("gpu-trace: framework patches are off: %s", exc)
        return
    if _state["torch"] != "off":
        when_imported("torch", _patch_torch)
    if _state["tf"] != "off":
        when_imported("tensorflow", _patch_tf)


def uninstall() -> None:
    """Forget the hooks and undo the patches. Idempotent."""
    discard("torch", _patch_torch)
    discard("tensorflow", _patch_tf)
    for name in ("gpu_trace.framework_patches.torch", "gpu_trace.framework_patches.tensorflow"):
        module = sys.modules.get(name)
        if module is not None:
            module.unpatch()
    _state["rec"] = None


def is_patched() -> bool:
    """Whether any framework is patched now (the test suite's leak check asks)."""
    for name in ("gpu_trace.framework_patches.torch", "gpu_trace.framework_patches.tensorflow"):
        module = sys.modules.get(name)
        if module is not None and module.is_patched():
            return True
    return False


def _patch_torch(torch: ModuleType) -> None:
    from gpu_trace.framework_patches import torch as pytorch

    pytorch.patch(torch, _state["torch"], shapes=_state["shapes"], rec=_state["rec"])


def _patch_tf(tf: ModuleType) -> None:
    from gpu_trace.framework_patches import tensorflow

    tensorflow.patch(tf, _state["tf"])
