"""Modules moved to or from the remote device keep their parameters, as on a GPU.

On a GPU, ``model.to("cuda")``, ``.cuda()`` and ``.cpu()`` keep each parameter object: PyTorch's
``Module._apply`` sets the moved tensor into it (``param.data = moved``), which works between
CPU and CUDA tensors. A remote tensor is a tensor subclass, which ``param.data =`` cannot take
from a CPU tensor, so ``_apply`` made a new parameter for each module that holds one: a weight
two modules share (GPT-2's embedding and output layer, tied) became two parameters, each with its
own gradient and optimizer state, and the model trained differently from step 1; an optimizer
made before the move held parameters the model no longer used.

:func:`patch` wraps ``Module._apply`` so that the function it applies, where it moves a parameter
between the CPU and the remote device, puts the moved tensor into the same parameter object
(``torch.utils.swap_tensors``: its class, attributes and tensor are exchanged, its identity is
kept), with its gradient moved too. The parameter's other holders (a second module, an optimizer)
then see the moved one, and ``_apply`` finds it already moved (a no-op) where it meets it again.
Where a parameter cannot be swapped (a weak reference to it, another holder of its tensor), the
move is left to ``_apply`` and each of that parameter's holders is then given the one new
parameter, so ties hold even then. Buffers are moved as ``_apply`` moves them (on a GPU too, a
buffer two modules share becomes two).

Moves between two remote tensors (``.half()`` on a remote module) take ``_apply``'s own
``param.data =`` path, which :class:`~gpu_trace.runtime.client.tensor.RemoteTensor`'s ``data``
setter follows with the new tensor's server handle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from gpu_trace.runtime.client import tensor as rt

log = logging.getLogger(__name__)

_original: Callable[..., nn.Module] | None = None


def patch() -> None:
    """Wrap ``nn.Module._apply`` (first undoing an earlier patch)."""
    global _original
    unpatch()
    original = nn.Module.__dict__["_apply"]

    def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        if isinstance(fn, _Move):  # a submodule, inside a call already wrapped
            return original(self, fn, recurse)
        holders = [
            (module, key, p)
            for module in (self.modules() if recurse else (self,))
            for key, p in module._parameters.items()
            if p is not None
        ]
        move = _Move(fn)
        result = original(self, move, recurse)
        if move.unswapped:
            _tie(holders, move.unswapped)
        return result

    _apply.__wrapped__ = original  # type: ignore[attr-defined]
    _original = original
    nn.Module._apply = _apply  # type: ignore[method-assign]


def unpatch() -> None:
    global _original
    if _original is not None:
        nn.Module._apply = _original  # type: ignore[method-assign]
        _original = None


def is_patched() -> bool:
    return _original is not None


def _host(t: torch.Tensor) -> bool:
    return type(t) is not rt.RemoteTensor and t.device.type == "cpu" and t.layout == torch.strided


def _moves(t: torch.Tensor, moved: torch.Tensor) -> bool:
    """Whether ``t`` -> ``moved`` goes between the CPU and the remote device (where a GPU's
    ``_apply`` keeps the parameter: ``param.data =`` between CPU and CUDA tensors)."""
    remote, to_remote = type(t) is rt.RemoteTensor, type(moved) is rt.RemoteTensor
    if remote == to_remote:
        return False
    return _host(moved) if remote else _host(t)


class _Move:
    """The function ``_apply`` applies, keeping each parameter it moves (module docstring).

    ``unswapped``: by ``id``, parameters that could not be swapped and what each was moved to
    (once: every holder's new parameter is made of that one tensor)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn
        self.unswapped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        seen = self.unswapped.get(id(t))
        if seen is not None and seen[0] is t:
            return seen[1]
        moved = self.fn(t)
        if moved is t or not isinstance(t, nn.Parameter) or not _moves(t, moved):
            return moved
        grad = t.grad
        try:
            if grad is not None:
                t.grad = None  # swapping needs t's tensor to have no other holder
            torch.utils.swap_tensors(t, nn.Parameter(moved, requires_grad=t.requires_grad))
        except (RuntimeError, TypeError) as exc:
            if grad is not None:
                t.grad = grad
            log.debug("gpu-trace: a moved parameter could not keep its identity: %s", exc)
            self.unswapped[id(t)] = (t, moved)
            return moved
        if grad is not None:
            t.grad = self.fn(grad)
        return t


def _tie(
    holders: Sequence[tuple[nn.Module, str, torch.Tensor]],
    unswapped: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Give every module that held one of the ``unswapped`` parameters the same new parameter
    (``_apply`` made one for each of them)."""
    chosen: dict[int, torch.Tensor] = {}
    for module, key, old in holders:
        if id(old) not in unswapped or unswapped[id(old)][0] is not old:
            continue
        new = module._parameters.get(key)
        if new is None or new is old:
            continue
        first = chosen.setdefault(id(old), new)
        if new is not first:
            module._parameters[key] = first  # type: ignore[assignment]
