"""Ranges around every ``nn.Module``'s forward and backward, named by the module's path.

Forward: PyTorch's global module hooks (``register_module_forward_pre_hook`` and
``register_module_forward_hook(always_call=True)``), so the range closes even when forward raises
and a module's own hooks keep working unchanged. Names come from ``named_modules()`` of the first
module called with no module around it (the root, named by its class): ``Net.encoder.layers.3``.

Backward: no module backward hooks (their identity functions make in-place ops on a module's
output fail). Instead, after forward, one pre-hook goes on the autograd node that produced each
output and on the node that produced each input: a module's backward starts when the gradient of
its output is about to be computed, and ends when its input's node is about to run (the gradient
of the input is complete) or, for inputs no gradient flows into, when the backward pass ends.
Several modules that share a node open outer-first and close inner-first, so ranges nest.

Inside ``torch.compile`` tracing the hooks do nothing: a compiled module is one range.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from gpu_trace.framework_patches import spans
from gpu_trace.tracer.records import MODULE

log = logging.getLogger(__name__)

DOMAIN = spans.Domain("torch")
_META = "gpu_trace"  # key in an autograd node's metadata dict: [opens, closes]

_handles: list[Any] = []
_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_attrs: dict[str, dict[str, str]] = {}
_local = threading.local()
#: Backward ranges open now, by module path (lists: a module may run more than once per pass).
_open_bw: dict[str, list[list]] = {}
_bw_attrs = {"pass": "backward"}
_torch: Any = None
_is_compiling: Any = None
_engine: Any = None
#: Called before a module runs with no module around it (a new iteration may be starting).
on_root: Any = None


def patch(torch: Any) -> None:
    """Register the global hooks (first undoing an earlier patch)."""
    global _torch, _is_compiling, _engine
    unpatch()
    from torch.nn.modules import module as nn_module

    _torch = torch
    _is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (
        lambda: False
    )
    _engine = torch.autograd.Variable._execution_engine
    _handles.append(nn_module.register_module_forward_pre_hook(_pre))
    _handles.append(nn_module.register_module_forward_hook(_post, always_call=True))


def unpatch() -> None:
    """Remove the hooks. Hooks already on autograd nodes of live graphs turn into no-ops."""
    global _torch
    for handle in _handles:
        handle.remove()
    _handles.clear()
    _open_bw.clear()
    _torch = None


def is_patched() -> bool:
    return bool(_handles)


# ---- names --------------------------------------------------------------------------------------


def name_of(module: Any) -> str:
    """The module's path (its root's class name, then attribute names), assigned on first call."""
    name = _names.get(module)
    if name is not None:
        return name
    stack = getattr(_local, "stack", None)
    parent = stack[-1][0] if stack else None
    if parent is not None:
        pname = _names.get(parent, type(parent).__name__)
        child = next((k for k, m in parent._modules.items() if m is module), None)
        name = f"{pname}.{child}" if child is not None else f"{pname}.{type(module).__name__}"
        _names[module] = name
        return name
    root = type(module).__name__
    for path, sub in module.named_modules(remove_duplicate=True):
        if sub not in _names:
            _names[sub] = f"{root}.{path}" if path else root
    return _names.get(module, root)


def _module_attrs(module: Any) -> dict[str, str]:
    cls = type(module).__name__
    attrs = _attrs.get(cls)
    if attrs is None:
        attrs = _attrs[cls] = {"module": cls}
    return attrs


# ---- forward ------------------------------------------------------------------------------------


def _pre(module: Any, args: tuple) -> None:
    if _torch is None or _is_compiling():
        return
    try:
        stack = _local.stack
    except AttributeError:
        stack = _local.stack = []
    try:
        if not stack and on_root is not None:
            on_root()
        name = _names.get(module) or name_of(module)
        token = spans.begin(DOMAIN, MODULE, name, _module_attrs(module))
        stack.append((module, token))
        if token is not None and _torch.is_grad_enabled():
            _mark_nodes(args, name, 1)
    except Exception:
        spans._warn_once("module forward")


def _post(module: Any, args: tuple, output: Any) -> None:
    if _torch is None or _is_compiling():
        return
    stack = getattr(_local, "stack", None)
    if not stack:
        return
    try:
        # Pop to this module: entries above it belong to modules whose hooks never ran.
        while stack:
            m, token = stack.pop()
            spans.end(token)
            if m is module:
                break
        if token is not None and output is not None and _torch.is_grad_enabled():
            _mark_nodes(output, token[6], 0)
    except Exception:
        spans._warn_once("module forward end")


# ---- backward -----------------------------------------------------------------------------------


def _mark_nodes(value: Any, name: str, which: int) -> None:
    """Note ``name`` on the autograd nodes of the tensors in ``value``: 0 opens, 1 closes there."""
    Tensor = _torch.Tensor
    if isinstance(value, Tensor):
        node = value.grad_fn
        if node is not None:
            _note(node, name, which)
        return
    if isinstance(value, (tuple, list)):
        seen = set()
        for v in value:
            if isinstance(v, Tensor):
                node = v.grad_fn
                if node is not None and id(node) not in seen:
                    seen.add(id(node))
                    _note(node, name, which)
            elif isinstance(v, (tuple, list)):  # LSTM: (output, (h, c))
                for w in v:
                    if isinstance(w, Tensor) and w.grad_fn is not None:
                        _note(w.grad_fn, name, which)
    elif isinstance(value, dict):
        for v in value.values():
            if isinstance(v, Tensor) and v.grad_fn is not None:
                _note(v.grad_fn, name, which)


def _note(node: Any, name: str, which: int) -> None:
    meta = node.metadata
    entry = meta.get(_META)
    if entry is None:
        entry = meta[_META] = ([], [])
        node.register_prehook(_NodeHook(entry))
    names = entry[which]
    if name not in names:
        names.append(name)


class _NodeHook:
    """Runs just before an autograd node: closes the backward ranges of modules whose input it
    produced (innermost first), then opens those of modules whose output it produced
    (outermost first)."""

    __slots__ = ("entry",)

    def __init__(self, entry: tuple[list[str], list[str]]) -> None:
        self.entry = entry

    def __call__(self, grad_outputs: Any) -> None:
        if _torch is None:
            return None
        try:
            opens, closes = self.entry
            if closes:
                for name in sorted(closes, key=_depth, reverse=True):
                    tokens = _open_bw.get(name)
                    if tokens:
                        spans.end(tokens.pop())
            if opens:
                if not any(_open_bw.values()):
                    _engine.queue_callback(_close_all)
                for name in sorted(opens, key=_depth):
                    token = spans.begin(DOMAIN, MODULE, name + ".backward", _bw_attrs)
                    if token is not None:
                        _open_bw.setdefault(name, []).append(token)
        except Exception:
            spans._warn_once("module backward")
        return None


def _depth(name: str) -> int:
    return name.count(".")


def _close_all() -> None:
    """End of a backward pass: close what is still open, innermost first."""
    try:
        tokens = [t for ts in _open_bw.values() for t in ts]
        _open_bw.clear()
        for token in sorted(tokens, key=lambda t: t[3], reverse=True):
            spans.end(token)
    except Exception:
        spans._warn_once("module backward end")
