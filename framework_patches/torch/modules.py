"""Ranges around every ``nn.Module``'s forward and backward, named by the module's path.

Forward: ``nn.Module.__call__`` is wrapped; the range closes when forward returns or raises, and
a module's own hooks run inside it unchanged. Names come from ``named_modules()`` of the first
module called with no module around it (the root, named by its class): ``Net.encoder.layers.3``.

Why a wrapper and not PyTorch's global module hooks: any global hook sends every module call down
``Module._call_impl``'s slow path (a closure, a set, loops over the hook dicts), which costs more
than our own work per call; with the wrapper, modules without hooks of their own keep the fast
path. ``torch._dynamo`` recognizes ``nn.Module.__call__`` by identity with the function it saw
when it was imported; it is pointed at the real one, so it traces through our wrapper while it is
installed (doing nothing inside compiled code) and knows the real one again after :func:`unpatch`.

Backward: no module backward hooks (their identity functions make in-place ops on a module's
output fail). Instead the wrapper notes the autograd node that produced each input (read before
forward: an in-place op may replace it) and each output, and when the outermost module call
returns, one pre-hook goes on each noted node: a module's backward starts when the gradient of
its output is about to be computed, and ends when its input's node is about to run (the gradient
of the input is complete) or, for inputs no gradient flows into, when the backward pass ends
(when ``Tensor.backward`` returns, or the engine's end-of-pass callback for passes started some
other way). Several modules that share a node open outer-first and close inner-first, so ranges
nest. ``Tensor.backward`` called inside a module's forward first places the hooks noted so far.

At op level the profiler's collection already records every backward node as it runs, with the
sequence number of the forward op that made it, so no hooks are placed: the wrapper notes the
range of sequence numbers each module call's forward ops took (two reads of a thread-local
counter), and the op collection makes the backward ranges from them (see
:mod:`.ops`, "Module backward ranges").

Inside ``torch.compile`` tracing the wrapper does nothing: a compiled module is one range.

Cost: every module call runs the wrapper, so it does as little as it can per call. What a
module's ranges need (its name, attrs, backward range name, depth) is worked out once per module
and found again by ``id`` (:class:`_Module`, a weak reference that forgets the entry when the
module dies). Hooks are placed in one batch per outermost call because between module calls the
model's own work evicts this code from the CPU caches: placing a hook right after a module's
compute costs several times what the next one costs. An autograd node gets one pre-hook however
many modules meet there. See docs/frameworks.md, "Cost".
"""

from __future__ import annotations

import logging
import threading
import weakref
from threading import get_ident as _thread_id
from typing import Any

from gpu_trace._imports import discard, when_imported
from gpu_trace.framework_patches import spans
from gpu_trace.tracer import recorder as _recorder
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.records import MODULE

log = logging.getLogger(__name__)

DOMAIN = spans.Domain("torch")
_META = "gpu_trace"  # key in an autograd node's metadata dict: (opens, closes)
#: Where torch._dynamo keeps the ``nn.Module.__call__`` it saw at import.
_DYNAMO = ("torch._dynamo.utils", "torch._dynamo.variables.nn_module")

_attrs: dict[str, dict[str, str]] = {}
_local = threading.local()
#: Backward ranges open now, by module (lists: a module may run more than once per pass). A
#: module's entry is removed when its last range closes, so ``not _open_bw`` means none is open.
_open_bw: dict[_Module, list[list]] = {}
_bw_attrs = {"pass": "backward"}
#: One entry per ``Tensor.backward`` call in progress (list: append and pop are atomic).
_in_backward: list[None] = []
_torch: Any = None
_is_compiling: Any = lambda: False  # noqa: E731 (torch.compiler.is_compiling once patched)
_grad_enabled: Any = None
_Tensor: Any = None
_engine: Any = None
#: (nn.Module, its original __call__, our wrapper) while patched.
_patched: tuple[Any, Any, Any] | None = None
#: Called before a module runs with no module around it (a new iteration may be starting).
on_root: Any = None
#: At op level, the op collection that makes module backward ranges (see :func:`backward_from`).
_calls_sink: Any = None
_seq: Any = None  # torch._C._autograd._get_sequence_nr once patched


def patch(torch: Any) -> None:
    """Wrap ``nn.Module.__call__`` (first undoing an earlier patch)."""
    global _torch, _is_compiling, _grad_enabled, _Tensor, _engine, _patched, _seq
    unpatch()
    module_cls = torch.nn.Module
    original = module_cls.__dict__["__call__"]
    _is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (
        lambda: False
    )
    _grad_enabled = torch.is_grad_enabled
    _Tensor = torch.Tensor
    _engine = torch.autograd.Variable._execution_engine
    _seq = torch._C._autograd._get_sequence_nr
    wrapper = _wrap_call(original)
    _patched = (module_cls, original, wrapper)
    module_cls.__call__ = wrapper
    _torch = torch
    for name in _DYNAMO:
        when_imported(name, _dynamo_sees_original)


def unpatch() -> None:
    """Put ``nn.Module.__call__`` back. Our wrapper, wherever it is still referenced, and hooks
    already on autograd nodes of live graphs turn into no-ops."""
    global _torch, _patched, _calls_sink
    _torch = None
    _calls_sink = None
    _open_bw.clear()
    _in_backward.clear()
    for name in _DYNAMO:
        discard(name, _dynamo_sees_original)
    if _patched is None:
        return
    module_cls, original, wrapper = _patched
    _patched = None
    if module_cls.__dict__.get("__call__") is wrapper:
        module_cls.__call__ = original
    else:  # someone wrapped ours since; they will call ours, which now passes straight through
        log.debug("gpu-trace: nn.Module.__call__ was replaced after ours; left as it is")


def is_patched() -> bool:
    return _patched is not None


def backward_from(sink: Any) -> None:
    """Op level: make module backward ranges from the op collection ``sink`` instead of hooks.

    ``sink`` has ``owner`` (the thread whose ops it collects), ``calls`` (a list the wrapper
    appends ``(first, end, module)`` sequence-number ranges of that thread's module calls to) and
    ``passes`` (one ``[start_ns, end_ns, parent span id, depth, modules running]`` per
    ``Tensor.backward`` on that thread); None goes back to hooks."""
    global _calls_sink
    _calls_sink = sink


def _dynamo_sees_original(module: Any) -> None:
    if _patched is not None and getattr(module, "unpatched_nn_module_call", None) is _patched[2]:
        module.unpatched_nn_module_call = _patched[1]


# ---- names --------------------------------------------------------------------------------------


class _Module(weakref.ref):
    """A module's name and what its ranges carry, computed once; keyed by ``id(module)`` in
    :data:`_modules`, and removed from there when the module is garbage-collected."""

    __slots__ = ("key", "name", "attrs", "bw_name", "depth")
    # By identity, like the modules (a weak reference hashes and compares its referent).
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    def __new__(cls, module: Any, name: str) -> _Module:
        return super().__new__(cls, module, _forget)

    def __init__(self, module: Any, name: str) -> None:
        super().__init__(module, _forget)  # type: ignore[call-arg]  # typeshed's ref has no __init__
        self.key = id(module)
        self.name = name
        self.attrs = _module_attrs(module)
        self.bw_name = name + ".backward"
        self.depth = name.count(".")


#: id(module) -> its :class:`_Module`, for the modules that have been called (and still live).
_modules: dict[int, _Module] = {}


def _forget(ref: _Module) -> None:
    # Runs while the module is being freed, before its id can be reused.
    if _modules.get(ref.key) is ref:
        del _modules[ref.key]


def _name(module: Any, name: str) -> _Module:
    m = _modules[id(module)] = _Module(module, name)
    return m


def _lookup(module: Any) -> _Module:
    """The module's :class:`_Module`, naming it on its first call (see :func:`name_of`)."""
    m = _modules.get(id(module))
    if m is not None:
        return m
    t = getattr(_local, "t", None)
    parent = t.stack[-1] if t is not None and t.stack else None
    if parent is not None:
        p = _modules.get(id(parent))
        pname = p.name if p is not None else type(parent).__name__
        child = next((k for k, sub in parent._modules.items() if sub is module), None)
        return _name(module, f"{pname}.{child if child is not None else type(module).__name__}")
    root = type(module).__name__
    for path, sub in module.named_modules(remove_duplicate=True):
        if id(sub) not in _modules:
            _name(sub, f"{root}.{path}" if path else root)
    return _modules[id(module)]


def name_of(module: Any) -> str:
    """The module's path (its root's class name, then attribute names), assigned on first call."""
    return _lookup(module).name


def _module_attrs(module: Any) -> dict[str, str]:
    cls = type(module).__name__
    attrs = _attrs.get(cls)
    if attrs is None:
        attrs = _attrs[cls] = {"module": cls}
    return attrs


# ---- forward ------------------------------------------------------------------------------------


class _Thread:
    """This thread's module calls in progress, and the autograd nodes noted since the outermost
    began (placed when it returns: see :func:`_place_hooks`)."""

    __slots__ = ("stack", "marks", "calls")

    def __init__(self) -> None:
        self.stack: list[Any] = []
        self.marks: list[tuple[Any, _Module, int]] = []
        #: At op level on the collected thread: where module calls' sequence ranges go.
        self.calls: list | None = None


def _wrap_call(original: Any) -> Any:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling() or _torch is None or _recorder.active is None:
            return original(self, *args, **kwargs)
        try:
            t = _local.t
        except AttributeError:
            t = _local.t = _Thread()
        stack = t.stack
        token = m = calls = None
        try:
            if not stack:
                if on_root is not None:
                    on_root()
                sink = _calls_sink
                t.calls = sink.calls if sink is not None and sink.owner == _thread_id() else None
            m = _modules.get(id(self)) or _lookup(self)
            token = spans.begin(DOMAIN, MODULE, m.name, m.attrs)
            calls = t.calls
            if calls is not None:
                first = _seq()
            elif token is not None and args and _grad_enabled():
                if len(args) == 1 and isinstance(args[0], _Tensor):  # the common case, inline
                    node = args[0].grad_fn
                    if node is not None:
                        t.marks.append((node, m, 1))
                else:
                    _mark_nodes(args, m, 1, t.marks)
        except Exception:
            spans.warn_once("module forward")
        stack.append(self)
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            stack.pop()
            spans.end(token)
            if not stack:
                t.marks.clear()  # a failed forward's graph is not kept alive by us
            raise
        stack.pop()
        spans.end(token)
        try:
            if calls is not None:
                end = _seq()
                if end != first:  # it made autograd nodes
                    calls.append((first, end, m))
            elif token is not None and result is not None and _grad_enabled():
                if isinstance(result, _Tensor):
                    node = result.grad_fn
                    if node is not None:
                        t.marks.append((node, m, 0))
                else:  # m is set whenever token is
                    _mark_nodes(result, m, 0, t.marks)  # type: ignore[arg-type]
            if not stack and t.marks:
                _place_hooks(t.marks)
        except Exception:
            spans.warn_once("module forward end")
        return result

    __call__.__wrapped__ = original  # type: ignore[attr-defined]
    __call__.__doc__ = original.__doc__
    return __call__


def backward_begins() -> None:
    """``Tensor.backward`` starts: place the hooks noted so far on this thread (it may be called
    inside a module's forward, before the outermost module returns)."""
    _in_backward.append(None)
    sink = _calls_sink
    if sink is not None:
        _note_pass(sink)
        return
    t = getattr(_local, "t", None)
    if t is not None and t.marks:
        try:
            _place_hooks(t.marks)
        except Exception:
            spans.warn_once("module backward hooks")


def backward_ends() -> None:
    """``Tensor.backward`` returns: the outermost one closes the backward ranges still open."""
    if _in_backward:
        _in_backward.pop()
    sink = _calls_sink
    if sink is not None and not _in_backward and sink.passes and _thread_id() == sink.owner:
        p = sink.passes[-1]
        if not p[1]:
            p[1] = now_ns()
    if _open_bw and not _in_backward:
        _close_all()


def _note_pass(sink: Any) -> None:
    """Op level: a backward pass starts on the collected thread inside the range open there (the
    ``Tensor.backward`` range): module backward ranges made from its ops go under that range."""
    try:
        if _thread_id() != sink.owner or len(_in_backward) > 1:
            return
        rec = _recorder.active
        buf = getattr(rec._local, "buf", None) if rec is not None else None
        stack = buf.stack if buf is not None else ()
        t = getattr(_local, "t", None)
        running = {_modules.get(id(m)) for m in t.stack} if t is not None else set()
        sink.passes.append([now_ns(), 0, stack[-1] if stack else 0, len(stack), running])
    except Exception:
        spans.warn_once("backward pass")


# ---- backward -----------------------------------------------------------------------------------


def _mark_nodes(value: Any, m: _Module, which: int, marks: list) -> None:
    """Note ``m`` for the autograd nodes of the tensors in ``value`` (0 opens, 1 closes there).

    Only the node is read now (an in-place op may give the tensor another one later); the
    hooks are placed by :func:`_place_hooks`."""
    Tensor = _Tensor
    if isinstance(value, Tensor):
        node = value.grad_fn
        if node is not None:
            marks.append((node, m, which))
        return
    if isinstance(value, (tuple, list)):
        if len(value) == 1:  # most modules' args
            v = value[0]
            if isinstance(v, Tensor):
                node = v.grad_fn
                if node is not None:
                    marks.append((node, m, which))
                return
        for v in value:  # a node seen twice is noted once (_note checks)
            if isinstance(v, Tensor):
                node = v.grad_fn
                if node is not None:
                    marks.append((node, m, which))
            elif isinstance(v, (tuple, list)):  # LSTM: (output, (h, c))
                for w in v:
                    if isinstance(w, Tensor):
                        node = w.grad_fn
                        if node is not None:
                            marks.append((node, m, which))
    elif isinstance(value, dict):
        for v in value.values():
            if isinstance(v, Tensor):
                node = v.grad_fn
                if node is not None:
                    marks.append((node, m, which))


def _place_hooks(marks: list[tuple[Any, _Module, int]]) -> None:
    """Put the noted modules on their nodes, with one pre-hook per node, and forget them (in
    one go per outermost call: see the module docstring, "Cost")."""
    try:
        for node, m, which in marks:
            _note(node, m, which)
    finally:
        marks.clear()


def _outer_first(m: _Module) -> int:
    return m.depth


def _inner_first(m: _Module) -> int:
    return -m.depth


def _note(node: Any, m: _Module, which: int) -> None:
    meta = node.metadata
    entry = meta.get(_META)
    if entry is None:
        meta[_META] = entry = ([], [])
        node.register_prehook(_NodeHook(entry))
    ms = entry[which]
    if m not in ms:
        ms.append(m)
        if len(ms) > 1:  # opens outer-first, closes inner-first (a stable sort keeps call order)
            ms.sort(key=_outer_first if which == 0 else _inner_first)


class _NodeHook:
    """Runs just before an autograd node: closes the backward ranges of modules whose input it
    produced (innermost first), then opens those of modules whose output it produced
    (outermost first)."""

    __slots__ = ("entry",)

    def __init__(self, entry: tuple[list[_Module], list[_Module]]) -> None:
        self.entry = entry

    def __call__(self, grad_outputs: Any) -> None:
        if _torch is None:
            return None
        try:
            opens, closes = self.entry
            for m in closes:
                tokens = _open_bw.get(m)
                if tokens:
                    spans.end(tokens.pop())
                    if not tokens:
                        del _open_bw[m]
            if opens:
                if not _open_bw and not _in_backward:
                    # The pass's first range, outside Tensor.backward: close what is left
                    # when the engine finishes (Tensor.backward does that when it returns).
                    _engine.queue_callback(_close_all)
                for m in opens:
                    token = spans.begin(DOMAIN, MODULE, m.bw_name, _bw_attrs)
                    if token is not None:
                        tokens = _open_bw.get(m)
                        if tokens is None:
                            _open_bw[m] = [token]
                        else:
                            tokens.append(token)
        except Exception:
            spans.warn_once("module backward")
        return None


def _close_all() -> None:
    """End of a backward pass: close what is still open, innermost first."""
    try:
        tokens = [t for ts in _open_bw.values() for t in ts]
        _open_bw.clear()
        for token in sorted(tokens, key=lambda t: t[3], reverse=True):
            spans.end(token)
    except Exception:
        spans.warn_once("module backward end")
