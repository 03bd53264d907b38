"""Training structure in PyTorch: ``optimizer.step``, ``loss.backward``, DataLoader waits, steps.

- ``Optimizer.step``: PyTorch's global optimizer step hooks; the range is named as the profiler
  names it (``Optimizer.step#SGD.step``). A step that raises leaves its range to be closed by the
  next step's pre-hook or when recording stops.
- ``Tensor.backward``: wrapped; the range closes in ``finally``.
- ``_BaseDataLoaderIter.__next__``: wrapped, named as the profiler names it
  (``enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__``): the time spent waiting.
- Steps: unless the program calls ``gpu_trace.step`` itself, each ``optimizer.step`` ends a step
  ``ProfilerStep#N`` that began at the first DataLoader wait or top-level module call after the
  previous step ended, so step-based analyses (HTA) find the iterations.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from gpu_trace.framework_patches import spans
from gpu_trace.framework_patches.steps import Steps
from gpu_trace.framework_patches.torch import modules as torch_modules
from gpu_trace.tracer.records import MODULE

log = logging.getLogger(__name__)

DOMAIN = spans.Domain("torch")

_handles: list[Any] = []
_originals: dict[tuple[Any, str], Any] = {}
_optimizer_token: list | None = None
_names: dict[type, str] = {}
_steps = Steps()
#: Something that begins an iteration happened (a DataLoader wait, a top-level module call).
iteration_starts = _steps.iteration_starts


def patch(torch: Any) -> None:
    """Hook the optimizer, wrap backward and the DataLoader (first undoing an earlier patch)."""
    unpatch()
    from torch.optim import optimizer

    _handles.append(optimizer.register_optimizer_step_pre_hook(_opt_pre))
    _handles.append(optimizer.register_optimizer_step_post_hook(_opt_post))
    _wrap(torch.Tensor, "backward", _backward)
    try:
        from torch.utils.data import dataloader

        _wrap(dataloader._BaseDataLoaderIter, "__next__", _next)
    except Exception:
        log.warning("gpu-trace: DataLoader waits are not captured in this PyTorch version")


def unpatch() -> None:
    global _optimizer_token
    for handle in _handles:
        handle.remove()
    _handles.clear()
    for (owner, attr), original in _originals.items():
        setattr(owner, attr, original)
    _originals.clear()
    spans.end(_optimizer_token)
    _optimizer_token = None
    _steps.reset()


def is_patched() -> bool:
    return bool(_handles or _originals)


def in_optimizer_step() -> bool:
    """Whether an ``optimizer.step`` is running (or raised: until the next step ends)."""
    return _optimizer_token is not None


def _wrap(owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
    original = owner.__dict__[attr]
    _originals[(owner, attr)] = original
    setattr(owner, attr, make(original))


# ---- hooks and wrappers -------------------------------------------------------------------------


def _opt_pre(opt: Any, args: Any, kwargs: Any) -> None:
    global _optimizer_token
    try:
        spans.end(_optimizer_token)  # a previous step that raised
        cls = type(opt)
        name = _names.get(cls)
        if name is None:
            name = _names[cls] = f"Optimizer.step#{cls.__name__}.step"
        _optimizer_token = spans.begin(DOMAIN, MODULE, name)
    except Exception:
        spans.warn_once("optimizer step")


def _opt_post(opt: Any, args: Any, kwargs: Any) -> None:
    global _optimizer_token
    token, _optimizer_token = _optimizer_token, None
    spans.end(token)
    try:
        _steps.end()
    except Exception:
        spans.warn_once("step")


def _backward(original: Any) -> Any:
    from torch.overrides import handle_torch_function, has_torch_function_unary

    @functools.wraps(original)
    def backward(self, *args: Any, **kwargs: Any) -> Any:
        if has_torch_function_unary(self):
            # A torch-function mode or subclass (a forwarding client's ``cuda`` mode) handles
            # the call and calls this wrapper again, with itself off: one range, that call's.
            return handle_torch_function(backward, (self,), self, *args, **kwargs)
        token = spans.begin(DOMAIN, MODULE, "Tensor.backward")
        torch_modules.backward_begins()
        try:
            return original(self, *args, **kwargs)
        finally:
            torch_modules.backward_ends()
            spans.end(token)

    return backward


def _next(original: Any) -> Any:
    names: dict[type, str] = {}

    @functools.wraps(original)
    def __next__(self) -> Any:
        iteration_starts()
        cls = type(self)
        name = names.get(cls)
        if name is None:
            name = names[cls] = f"enumerate(DataLoader)#{cls.__name__}.__next__"
        token = spans.begin(DOMAIN, MODULE, name)
        try:
            return original(self)
        finally:
            spans.end(token)

    return __next__
