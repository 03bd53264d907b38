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
output fail). Instead the wrapper notes, per call, the range of autograd sequence numbers its
forward took (two reads of a thread-local counter) and the autograd nodes of its inputs (read
before forward: an in-place op may replace them) and outputs. When the outermost module call
returns, one pre-hook goes on each noted node, carrying the calls that node was made in,
outermost first (found by its sequence number). In backward each hook makes this thread's open
module ranges that list: ranges of calls not in it close (innermost first), the missing ones open
(outermost first). So ranges are per call, not per module, and nest by construction: a cell
called in a loop gets one range per call, whichever of its outputs' nodes runs first; a module's
range ends when a node made outside it is about to run (its input's, usually), or when the
engine finishes the pass (a callback queued on each pass, graph task, whose nodes the hooks
see). A call whose range has closed is not opened again in the same pass: where the engine
interleaves two calls' nodes, the second part gets no range rather than a second one. A forward
run during a backward (activation checkpointing's recomputation) puts its calls under the ranges
open when it ran; a pass run inside a node (reentrant checkpointing, ``Tensor.backward`` in a
custom Function's backward) closes none of the ranges open when it began, and its own when it
ends. ``Tensor.backward`` called inside a module's forward first places the hooks noted so far.

At op level the profiler's collection already records every backward node as it runs, with the
sequence number of the forward op that made it, so no hooks are placed: the wrapper notes the
range of sequence numbers each module call's forward ops took (two reads of a thread-local
counter), and the op collection makes the backward ranges from them (see
:mod:`.ops`, "Module backward ranges"). Module level does the same where the native observer is
built (:mod:`.ops_native`, recording autograd nodes only): a hook costs the program's thread
several µs per module call (placing it, and the engine calling Python for it), the observer
about a quarter of a µs per node, and the matching runs in the flusher. The hooks stay for a
machine without the build (and with ``GPU_TRACE_TORCH_OPS=kineto``), and for forwards on threads
other than the one that started recording.

The forward range is opened and closed by the tracer's C ``call_in_range`` around the call where
``gpu_trace.range``'s C type is loaded (``tracer/_fastpath.c``; :func:`spans.begin` and
:func:`spans.end` are its Python twin, used when an NVTX tool mirrors the ranges).

Inside ``torch.compile`` tracing the wrapper does nothing: a compiled module is one range.

Cost: every module call runs the wrapper, so it does as little as it can per call. What a
module's ranges need (its name, attrs, backward range name, depth) is worked out once per module
and found again by ``id`` (:class:`ModuleRef`, a weak reference that forgets the entry when the
module dies). Hooks are placed in one batch per outermost call because between module calls the
model's own work evicts this code from the CPU caches: placing a hook right after a module's
compute costs several times what the next one costs. An autograd node gets one pre-hook however
many calls meet there. See docs/frameworks.md, "Cost".
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Callable
from threading import get_ident as _thread_id
from typing import Any

from gpu_trace._imports import discard, when_imported
from gpu_trace.framework_patches import spans
from gpu_trace.framework_patches.torch.backward import chain as _chain
from gpu_trace.framework_patches.torch.backward import owners as _owners
from gpu_trace.tracer import fastpath_build
from gpu_trace.tracer import recorder as _recorder
from gpu_trace.tracer.buffer import FOREIGN
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.records import MODULE

log = logging.getLogger(__name__)

DOMAIN = spans.Domain("torch")
_LANE = DOMAIN.lane
#: The tracer's C call inside a range (``_fastpath.call_in_range``), where it is built; else the
#: ranges go through :func:`spans.begin` and :func:`spans.end`, its Python twin.
_in_range: Callable[..., object] | None = None
_META = "gpu_trace"  # key in an autograd node's metadata dict: set once the node is hooked
#: Where torch._dynamo keeps the ``nn.Module.__call__`` it saw at import.
_DYNAMO = ("torch._dynamo.utils", "torch._dynamo.variables.nn_module")

_attrs: dict[str, dict[str, str]] = {}
_local = threading.local()
_bw_attrs = {"pass": "backward"}
#: One entry per ``Tensor.backward`` call in progress (list: append and pop are atomic).
_in_backward: list[None] = []
#: Each thread's module backward ranges open now (see :class:`_Backward`), by thread id.
_bw_threads: dict[int, _Backward] = {}
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
_current_node: Any = None  # torch._C._current_autograd_node once patched
#: The graph task (backward pass) running on this thread: torch._C._current_graph_task_id once
#: patched (0 where PyTorch lacks it: passes nested in a node are then not told apart).
_graph_task: Callable[[], int] = lambda: 0  # noqa: E731


def patch(torch: Any) -> None:
    """Wrap ``nn.Module.__call__`` (first undoing an earlier patch)."""
    global _torch, _is_compiling, _grad_enabled, _Tensor, _engine, _patched, _seq, _current_node
    global _graph_task
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
    _current_node = getattr(torch._C, "_current_autograd_node", None) or (lambda: None)
    _graph_task = getattr(torch._C, "_current_graph_task_id", None) or (lambda: 0)
    _use_native_range()
    wrapper = _wrap_call(original)
    _patched = (module_cls, original, wrapper)
    module_cls.__call__ = wrapper
    _torch = torch
    for name in _DYNAMO:
        when_imported(name, _dynamo_sees_original)


def _use_native_range() -> None:
    """Take the tracer's C call inside a range where ``gpu_trace.range`` loaded it (the C
    ``range``: :mod:`gpu_trace._api`), unless the ranges are mirrored to another NVTX tool
    (:func:`spans.begin` does that); else the Python twin."""
    global _in_range
    native = sys.modules.get(fastpath_build.MODULE)
    _in_range = getattr(native, "call_in_range", None) if native is not None else None
    if spans.mirrored(DOMAIN):
        _in_range = None


def unpatch() -> None:
    """Put ``nn.Module.__call__`` back. Our wrapper, wherever it is still referenced, and hooks
    already on autograd nodes of live graphs turn into no-ops."""
    global _torch, _patched, _calls_sink
    _torch = None
    _calls_sink = None
    for b in _bw_threads.values():
        b.open.clear()
    _bw_threads.clear()
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
    appends ``(first, end, module, anchor)`` sequence-number ranges of that thread's module calls
    to: see :func:`.backward.owners`) and
    ``passes`` (one ``[start_ns, end_ns, parent span id, depth, modules running]`` per
    ``Tensor.backward`` on that thread); None goes back to hooks."""
    global _calls_sink
    _calls_sink = sink


def _dynamo_sees_original(module: Any) -> None:
    if _patched is not None and getattr(module, "unpatched_nn_module_call", None) is _patched[2]:
        module.unpatched_nn_module_call = _patched[1]


# ---- names --------------------------------------------------------------------------------------


class ModuleRef(weakref.ref):
    """A module's name and what its ranges carry, computed once; keyed by ``id(module)`` in
    :data:`_modules`, and removed from there when the module is garbage-collected."""

    __slots__ = ("key", "name", "attrs", "bw_name", "depth")
    # By identity, like the modules (a weak reference hashes and compares its referent).
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    def __new__(cls, module: Any, name: str) -> ModuleRef:
        return super().__new__(cls, module, _forget)

    def __init__(self, module: Any, name: str) -> None:
        super().__init__(module, _forget)  # type: ignore[call-arg]  # typeshed's ref has no __init__
        self.key = id(module)
        self.name = name
        self.attrs = _module_attrs(module)
        self.bw_name = name + ".backward"
        self.depth = name.count(".")


#: id(module) -> its :class:`ModuleRef`, for the modules that have been called (and still live).
_modules: dict[int, ModuleRef] = {}


def _forget(ref: ModuleRef) -> None:
    # Runs while the module is being freed, before its id can be reused.
    if _modules.get(ref.key) is ref:
        del _modules[ref.key]


def _name(module: Any, name: str) -> ModuleRef:
    m = _modules[id(module)] = ModuleRef(module, name)
    return m


def _lookup(module: Any) -> ModuleRef:
    """The module's :class:`ModuleRef`, naming it on its first call (see :func:`name_of`)."""
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
    """This thread's module calls in progress, and since the outermost began the autograd nodes
    noted and the calls that made nodes (hooked when it returns: see :func:`_place_hooks`)."""

    __slots__ = ("stack", "marks", "made", "calls", "anchor")

    def __init__(self) -> None:
        self.stack: list[Any] = []
        self.marks: list[Any] = []
        #: Module level: ``[first, end, ModuleRef, -1, pass its range closed in]`` per call, as
        #: they return (sequence numbers ``[first, end)``; see :mod:`.backward`).
        self.made: list[list] = []
        #: At op level on the collected thread: where module calls' sequence ranges go.
        self.calls: list | None = None
        #: The sequence number of the backward node the outermost call runs in, else -1.
        self.anchor = -1


def _wrap_call(original: Any) -> Any:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling() or _torch is None or _recorder.active is None:
            return original(self, *args, **kwargs)
        try:
            t = _local.t
        except AttributeError:
            t = _local.t = _Thread()
        stack = t.stack
        token = m = calls = first = None
        fast: ModuleRef | None = None  # the range is opened and closed in C, around the call
        try:
            if not stack:
                node = _current_node()  # a backward node (checkpointing recomputes forward)
                if node is None:
                    t.anchor = -1
                    if _bw_threads:
                        b = _bw_threads.get(_thread_id())
                        if b is not None and b.open:  # left by a pass that raised
                            b.close_all()
                    if on_root is not None:  # no op in flight: may cycle sessions
                        on_root()
                else:
                    t.anchor = node._sequence_nr()
                sink = _calls_sink
                t.calls = sink.calls if sink is not None and sink.owner == _thread_id() else None
            m = _modules.get(id(self)) or _lookup(self)
            calls = t.calls
            if calls is None or t.anchor < 0:
                if _in_range is not None:
                    fast = m
                else:
                    token = spans.begin(DOMAIN, MODULE, m.name, m.attrs)
            # else op level inside a backward node: its backward ranges, made later, could not
            # hold a forward range recorded now (they would overlap under the pass's range)
            if calls is not None:
                first = _seq()
            elif (token is not None or fast is not None) and _grad_enabled():
                first = _seq()
                if args:
                    if len(args) == 1 and isinstance(args[0], _Tensor):  # the common case, inline
                        node = args[0].grad_fn
                        if node is not None:
                            t.marks.append(node)
                    else:
                        _mark_nodes(args, t.marks)
        except Exception:
            spans.warn_once("module forward")
        stack.append(self)
        try:
            if fast is not None and _in_range is not None:
                result = _in_range(
                    original, _LANE, MODULE, fast.name, fast.attrs, self, *args, **kwargs
                )
            else:
                result = original(self, *args, **kwargs)
        except BaseException:
            stack.pop()
            spans.end(token)
            if not stack:
                t.marks.clear()  # a failed forward's graph is not kept alive by us
                t.made.clear()
            raise
        stack.pop()
        if token is not None:
            spans.end(token)
        try:
            if calls is not None:
                end = _seq()
                if end != first:  # it made autograd nodes
                    calls.append((first, end, m, t.anchor if not stack else -1))
            elif first is not None:
                end = _seq()
                if end != first:  # it made autograd nodes (else its outputs' are not its own)
                    t.made.append([first, end, m, -1, -1])
                    if isinstance(result, _Tensor):
                        node = result.grad_fn
                        if node is not None:
                            t.marks.append(node)
                    elif result is not None:
                        _mark_nodes(result, t.marks)
            if not stack and (t.marks or t.made):
                _place_hooks(t)
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
    if sink is not None and sink.owner == _thread_id():
        _note_pass(sink)
        return
    t = getattr(_local, "t", None)
    if t is not None and t.marks:
        try:
            _place_hooks(t)
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
            if p[5] is not None:
                p[5] = _python_ranges() != p[5]
    if not _in_backward:  # the engine's end-of-pass callback closed them, unless it raised
        b = _bw_threads.get(_thread_id())
        if b is not None and b.open:
            b.close_all()


def _note_pass(sink: Any) -> None:
    """Op level (and module level from the observer): a backward pass starts on the collected
    thread inside the range open there (the ``Tensor.backward`` range): module backward ranges
    made from its nodes go under that range, unless a range opens from Python inside one of its
    nodes (:func:`_python_ranges`)."""
    try:
        if _thread_id() != sink.owner or len(_in_backward) > 1:
            return
        rec = _recorder.active
        buf = getattr(rec._local, "buf", None) if rec is not None else None
        stack = buf.stack if buf is not None else ()
        t = getattr(_local, "t", None)
        running = {_modules.get(id(m)) for m in t.stack} if t is not None else set()
        before = _python_ranges()
        sink.passes.append([now_ns(), 0, stack[-1] if stack else 0, len(stack), running, before])
    except Exception:
        spans.warn_once("backward pass")


def _python_ranges() -> int:
    """Ranges begun so far on this thread and on threads ``threading`` did not start (the
    autograd engine's device threads): with the ranges made from autograd nodes (op level, and
    module level from the observer), a pass during which this grows opened a range from Python
    inside a node (a ``Tensor.backward`` there, as Reformer's reversible layers run; an
    optimizer stepping in a gradient hook; ``gpu_trace.range`` in a custom Function's backward).
    Module backward ranges, made later by the flusher, could not hold that range (it is a child
    of the pass), so that pass gets none: no range rather than ranges overlapping it (see
    :mod:`.backward`)."""
    rec = _recorder.active
    if rec is None:
        return 0
    own = getattr(rec._local, "buf", None)
    n = own.seq if own is not None else 0
    for _, buf in list(rec._buffers):
        if buf.owner is FOREIGN and buf is not own:
            n += buf.seq
    return n


# ---- backward -----------------------------------------------------------------------------------


def _mark_nodes(value: Any, marks: list) -> None:
    """Note the autograd nodes of the tensors in ``value`` (a module's inputs or outputs).

    Only the node is read now (an in-place op may give the tensor another one later); the
    hooks are placed by :func:`_place_hooks`."""
    Tensor = _Tensor
    if isinstance(value, Tensor):
        node = value.grad_fn
        if node is not None:
            marks.append(node)
        return
    if isinstance(value, (tuple, list)):
        if len(value) == 1:  # most modules' args
            v = value[0]
            if isinstance(v, Tensor):
                node = v.grad_fn
                if node is not None:
                    marks.append(node)
                return
        for v in value:  # a node seen twice is hooked once (_place_hooks checks)
            if isinstance(v, Tensor):
                node = v.grad_fn
                if node is not None:
                    marks.append(node)
            elif isinstance(v, (tuple, list)):  # LSTM: (output, (h, c))
                for w in v:
                    if isinstance(w, Tensor):
                        node = w.grad_fn
                        if node is not None:
                            marks.append(node)
    elif isinstance(value, dict):
        for v in value.values():
            if isinstance(v, Tensor):
                node = v.grad_fn
                if node is not None:
                    marks.append(node)


def _place_hooks(t: _Thread) -> None:
    """Hook the noted nodes, each with the calls it was made in, outermost first, and forget
    them (in one go per outermost call: see the module docstring, "Cost").

    A node's calls are found by its sequence number among this forward's calls (a node made
    before them, or outside every module, has none: its hook closes the ranges open). A forward
    run inside a backward node (checkpointing recomputes one there) is part of the ranges open
    on this thread then: its nodes' lists start with those calls."""
    marks, made = t.marks, t.made
    try:
        index = _owners(made) if made else None
        b = _bw_threads.get(_thread_id()) if t.anchor >= 0 else None
        prefix = tuple(o[0] for o in b.open) if b is not None and b.open else ()
        for node in marks:
            meta = node.metadata
            if _META in meta:
                continue
            meta[_META] = True
            calls = prefix
            if index is not None:
                found = _chain(node._sequence_nr(), made, index)
                if found:
                    calls = prefix + tuple(made[i] for i in found)
            node.register_prehook(_NodeHook(calls))
    finally:
        marks.clear()
        if not t.stack:
            made.clear()


class _Backward:
    """One thread's module backward ranges open now: ``open`` holds ``(call, token)``,
    outermost first, and ``pass_no`` counts the backward passes that ended (a call's range is
    opened at most once per pass).

    ``tasks``: ``[graph task, floor]`` of each pass whose nodes ran on this thread and has not
    ended, outermost first: a pass run inside a node of another (reentrant checkpointing's
    recomputation, a ``Tensor.backward`` in a custom Function's backward) closes none of the
    ranges open when it began (its floor), and its own close when the engine finishes it (a
    callback queued on it), inside the node, before what runs next in the outer pass finds them
    open (the next layer's recomputation nested under them, a ``Tensor.backward`` range ending
    before them)."""

    __slots__ = ("open", "pass_no", "tasks")

    def __init__(self) -> None:
        self.open: list[tuple[list, list | None]] = []
        self.pass_no = 0
        self.tasks: list[list[int]] = []

    def enter(self, calls: tuple[list, ...]) -> None:
        """A node made in ``calls`` is about to run: close the ranges of calls not in them,
        open the missing ones (not those already closed in this pass)."""
        open_, tasks = self.open, self.tasks
        task = _graph_task()
        if not tasks or tasks[-1][0] != task:
            if any(t[0] == task for t in tasks):
                while tasks[-1][0] != task:  # passes nested in this one that raised
                    self.leave()
            else:
                tasks.append([task, len(open_)])
                _engine.queue_callback(self.leave)  # run when the engine finishes the pass
        n = len(calls)
        keep = 0
        while keep < len(open_) and keep < n and open_[keep][0] is calls[keep]:
            keep += 1
        if keep < tasks[-1][1]:  # a nested pass's node made outside the ranges it runs in
            return
        pass_no = self.pass_no
        while len(open_) > keep:
            call, token = open_.pop()
            call[4] = pass_no
            spans.end(token)
        for call in calls[keep:]:
            if call[4] == pass_no:  # its range closed in this pass: no second one
                return
            open_.append((call, spans.begin(DOMAIN, MODULE, call[2].bw_name, _bw_attrs)))

    def leave(self) -> None:
        """The engine finished the innermost pass: close the ranges it opened, innermost first
        (all of them, and count the pass, when it was the outermost)."""
        try:
            floor = self.tasks.pop()[1] if self.tasks else 0
            open_ = self.open
            while len(open_) > floor:
                call, token = open_.pop()
                call[4] = self.pass_no
                spans.end(token)
            if not self.tasks:
                self.pass_no += 1
        except Exception:
            spans.warn_once("module backward end")

    def close_all(self) -> None:
        """A pass that raised (the engine runs no callback then): close what is still open."""
        try:
            while self.tasks:
                self.leave()
            if self.open:
                self.leave()
        except Exception:
            spans.warn_once("module backward end")


class _NodeHook:
    """Runs just before an autograd node: makes this thread's open module backward ranges the
    calls the node was made in (see :meth:`_Backward.enter`)."""

    __slots__ = ("calls",)

    def __init__(self, calls: tuple[list, ...]) -> None:
        self.calls = calls

    def __call__(self, grad_outputs: Any) -> None:
        if _torch is None:
            return None
        try:
            tid = _thread_id()
            b = _bw_threads.get(tid)
            if b is None:
                b = _bw_threads[tid] = _Backward()
            b.enter(self.calls)
        except Exception:
            spans.warn_once("module backward")
        return None
