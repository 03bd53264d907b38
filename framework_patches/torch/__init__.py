"""PyTorch patches: module, training-structure and op ranges, at the level asked for.

``module`` (the default): forward and backward of every ``nn.Module`` named by its path,
``optimizer.step``, ``loss.backward``, DataLoader waits and a step range per iteration. ``op``:
all of that plus every ATen op (:mod:`.ops_native`, a RecordFunction observer in C++, where
its library is built, else :mod:`.ops`, the profiler's collection in sessions; chosen by
``GPU_TRACE_TORCH_OPS``). At both, once the program makes a process group, its collectives
(:mod:`.collectives`). ``off``: nothing.

Each part is patched on its own: a PyTorch version where one can't be patched still gets the
others, and one warning says what is not captured.
"""

from __future__ import annotations

import logging
from typing import Any

from gpu_trace import config
from gpu_trace.framework_patches import spans
from gpu_trace.framework_patches.torch import collectives, ops_native, program_profiler
from gpu_trace.framework_patches.torch import modules as torch_modules
from gpu_trace.framework_patches.torch import training as torch_training
from gpu_trace.framework_patches.torch.ops import OpSource
from gpu_trace.framework_patches.torch.ops_native import NativeOpSource

log = logging.getLogger(__name__)

LEVELS = ("module", "op", "off")

_ops: OpSource | NativeOpSource | None = None
_patched = False


def patch(torch: Any, level: str = "module", *, shapes: bool = False, rec: Any = None) -> list[str]:
    """Patch ``torch`` at ``level`` (first undoing an earlier patch); returns what failed."""
    global _ops, _patched
    if level not in LEVELS:
        raise ValueError(f"PyTorch level must be one of {', '.join(LEVELS)}, got {level!r}")
    unpatch()
    if level == "off":
        return []
    _patched = True
    failed: list[str] = []
    spans.mirror(torch_modules.DOMAIN, spans.external_nvtx_tool() is not None)
    for what, part in (
        ("module ranges", torch_modules),
        ("optimizer, backward and DataLoader ranges and steps", torch_training),
    ):
        try:
            part.patch(torch)
        except Exception as exc:
            log.debug("gpu-trace: patching PyTorch %s failed", what, exc_info=True)
            failed.append(f"{what} ({type(exc).__name__}: {exc})")
    if level == "module" and rec is not None:  # its records need a recorder to drain them
        nodes = backward_source()
        if nodes is not None and nodes.start():
            _ops = nodes
            torch_modules.backward_from(nodes)  # module backward ranges from its nodes
            if rec is not None:
                rec.add_source(nodes)
    if level == "op":
        try:
            ops = op_source(torch, shapes)
            if ops.start():
                _ops = ops
                torch_modules.backward_from(ops)  # module backward ranges from its ops
                if rec is not None:
                    rec.add_source(ops)
            else:
                failed.append("op ranges (the profiler could not start)")
        except Exception as exc:
            log.debug("gpu-trace: PyTorch op collection failed", exc_info=True)
            failed.append(f"op ranges ({type(exc).__name__}: {exc})")
    if rec is not None:  # collectives at module and op level, once a process group exists
        try:
            collectives.patch(torch, rec)
        except Exception as exc:
            log.debug("gpu-trace: patching torch.distributed failed", exc_info=True)
            failed.append(f"collectives ({type(exc).__name__}: {exc})")
    torch_modules.on_root = _on_root
    # the program's own torch.profiler: the flusher held while it starts, the sessions aside
    program_profiler.watch(torch, rec, _ops if isinstance(_ops, OpSource) else None)
    if failed:
        log.warning(
            "gpu-trace: PyTorch %s: not captured: %s",
            getattr(torch, "__version__", "?"),
            "; ".join(failed),
        )
    return failed


def op_source(torch: object, shapes: bool) -> OpSource | NativeOpSource:
    """The native observer where its library is built (or ``GPU_TRACE_TORCH_OPS=native``
    builds it), else the profiler's sessions; input shapes come from the sessions only."""
    choice = config.torch_ops()
    if not shapes and choice != "kineto":
        lib = ops_native.library() if choice == "native" else None
        if lib is None and choice is None and ops_native.available():
            lib = ops_native.library()
        if lib is not None:
            return NativeOpSource(lib)
    return OpSource(torch, shapes=shapes)


def backward_source() -> NativeOpSource | None:
    """Module level: the native observer recording autograd nodes only, from which the module
    backward ranges are made off the program's thread, where its library is built (as
    :func:`op_source` chooses it; ``GPU_TRACE_TORCH_OPS=kineto`` keeps the hooks); None: the
    wrapper places Python hooks on the nodes (:mod:`.modules`)."""
    choice = config.torch_ops()
    if choice == "kineto":
        return None
    try:
        lib = ops_native.library() if choice == "native" or ops_native.available() else None
    except Exception:
        log.debug("gpu-trace: the native observer is not available", exc_info=True)
        return None
    return NativeOpSource(lib, nodes_only=True) if lib is not None else None


def unpatch() -> None:
    """Undo :func:`patch`. Idempotent."""
    global _ops, _patched
    torch_modules.on_root = None
    program_profiler.unwatch()
    collectives.unpatch()
    torch_modules.unpatch()
    torch_training.unpatch()
    if _ops is not None:
        _ops.close()
        _ops = None
    spans.mirror(torch_modules.DOMAIN, False)
    _patched = False


def is_patched() -> bool:
    return (
        _patched
        or torch_modules.is_patched()
        or torch_training.is_patched()
        or program_profiler.is_watching()
        or collectives.is_patched()
    )


def _on_root() -> None:
    # A top-level module call is where a session is cycled: no op is in flight there, unless
    # it runs inside an optimizer step (an LBFGS closure). PyTorch's range around the step,
    # opened in this session, would end in the next one, which writes its end into another
    # op's event (seen: ops ending seconds after their parent) or crashes.
    torch_training.iteration_starts()
    if program_profiler.held_since:  # the program's profiler is starting: see if it has
        program_profiler.on_root()
    # The native observer has no session: its cuts are bookkeeping, made inside a step too (a
    # program whose every module call runs in LBFGS's closure had none, and its nodes waited
    # past MAX_WAIT_S, then were matched to no call: no module backward ranges).
    if _ops is not None and (
        isinstance(_ops, NativeOpSource) or not torch_training.in_optimizer_step()
    ):
        _ops.harvest()
