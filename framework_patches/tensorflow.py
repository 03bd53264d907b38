"""TensorFlow patches: Keras layers, tf.Module and tf.function calls, gradients, steps, eager ops.

``layer`` (the default):

- Keras layer calls (``keras.src.layers.layer.Layer.__call__``) executed eagerly, named by their
  path in the call (``sequential.dense_1``). Inside a ``tf.function`` (``model.fit`` compiles its
  step) layers run as graph ops, which Python never sees: there the tf.function call is the range.
- ``__call__`` of every ``tf.Module`` subclass (existing ones and those defined later), eagerly.
- ``tf.function`` calls (``Function.__call__``), named ``tf.function:<name>``.
- ``GradientTape.gradient``.
- Steps ``ProfilerStep#N`` (unless the program calls ``gpu_trace.step``): one per ``model.fit``
  batch (``on_train_batch_begin`` to ``on_train_batch_end``), and in custom loops one per
  optimizer update, from the first tape, layer or ``tf.function`` call after the previous step:
  an eager ``optimizer.apply`` or ``apply_gradients`` (Keras 3's own guide uses ``apply``, which
  ``apply_gradients`` calls: one range and one step for both), or a call of a ``tf.function``
  that applies an optimizer inside (the guide's compiled ``train_step``; seen while TensorFlow
  traces it, as ``apply`` then runs in graph mode: every later call of that function is a step).

``op`` adds every eagerly executed op (``pywrap_tfe.TFE_Py_FastPathExecute`` and the
``execute.execute`` fallback), category ``op``. Ops inside a ``tf.function`` run in TensorFlow's
executor and are not captured.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from gpu_trace._imports import discard, when_imported
from gpu_trace.framework_patches import spans
from gpu_trace.framework_patches.steps import Steps
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.records import MODULE, OP

log = logging.getLogger(__name__)

LEVELS = ("layer", "op", "off")
DOMAIN = spans.Domain("tensorflow")

_originals: dict[tuple[Any, str], Any] = {}
_local = threading.local()
_eager: Callable[[], bool] = lambda: True  # noqa: E731
_level = "off"
_failed: list[str] = []
_steps = Steps()
#: tf.functions seen applying an optimizer while traced: each call of one is a training step.
_step_functions: weakref.WeakSet[object] = weakref.WeakSet()
#: A model.fit batch is in progress: its callbacks make the step (not the optimizer, nor its
#: train function's call).
_fit_batch = False


def patch(tf: Any, level: str = "layer") -> list[str]:
    """Patch TensorFlow at ``level`` (first undoing an earlier patch); returns what failed."""
    global _eager, _level
    if level not in LEVELS:
        raise ValueError(f"TensorFlow level must be one of {', '.join(LEVELS)}, got {level!r}")
    unpatch()
    if level == "off":
        return []
    _level = level
    _failed.clear()
    spans.mirror(DOMAIN, spans.external_nvtx_tool() is not None)
    try:
        from tensorflow.python.eager import context

        _eager = context.executing_eagerly
    except Exception as exc:
        _failed.append(f"eager detection ({exc})")
    _try("tf.function calls", _patch_function)
    _try("GradientTape.gradient", lambda: _wrap(tf.GradientTape, "gradient", _gradient))
    _try("GradientTape steps", lambda: _wrap(tf.GradientTape, "__enter__", _tape_enter))
    _try("tf.Module calls", lambda: _patch_modules(tf))
    if level == "op":
        _try("eager ops", _patch_ops)
    # Keras may be imported later, or be what is importing TensorFlow right now (``import keras``
    # loads its TensorFlow backend before its layers): hook the modules that define what we wrap.
    for module, fn in _KERAS.items():
        when_imported(module, fn)
    _report(tf)
    return list(_failed)


def unpatch() -> None:
    """Undo :func:`patch`. Idempotent."""
    global _level
    for module, fn in _KERAS.items():
        discard(module, fn)
    for (owner, attr), original in reversed(list(_originals.items())):
        if original is None:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
    _originals.clear()
    _steps.reset()
    _step_functions.clear()
    spans.mirror(DOMAIN, False)
    _level = "off"


def is_patched() -> bool:
    return bool(_originals) or _level != "off"


def _try(what: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception as exc:
        log.debug("gpu-trace: patching TensorFlow %s failed", what, exc_info=True)
        _failed.append(f"{what} ({type(exc).__name__}: {exc})")


def _report(module: Any) -> None:
    if _failed:
        log.warning(
            "gpu-trace: TensorFlow/Keras %s: not captured: %s",
            getattr(module, "__version__", "?"),
            "; ".join(_failed),
        )
        _failed.clear()


def _wrap(owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
    original = owner.__dict__.get(attr)
    if original is None:
        raise AttributeError(f"{owner.__name__}.{attr} not found")
    _originals[(owner, attr)] = original
    setattr(owner, attr, make(original))


def _ranged(name_of: Callable[..., str], category: str = MODULE, eager_only: bool = True):
    """A wrapper factory: a range named ``name_of(self, *args)`` around the call."""

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if eager_only and not _eager():
                return original(*args, **kwargs)
            token = spans.begin(DOMAIN, category, name_of(*args))
            try:
                return original(*args, **kwargs)
            finally:
                spans.end(token)

        return wrapper

    return make


# ---- parts ----------------------------------------------------------------------------------------


def _patch_function() -> None:
    from tensorflow.python.eager.polymorphic_function import polymorphic_function as pf

    def make(original: Callable[..., object]) -> Callable[..., object]:
        @functools.wraps(original)
        def __call__(self: object, *args: object, **kwargs: object) -> object:
            try:
                calls = _local.functions
            except AttributeError:
                calls = _local.functions = []
            if not _eager():  # traced into another function's graph: no range of its own
                calls.append(self)
                try:
                    return original(self, *args, **kwargs)
                finally:
                    calls.pop()
            top = not calls
            if top:
                _steps.iteration_starts()
            token = spans.begin(DOMAIN, MODULE, f"tf.function:{getattr(self, '_name', '') or '?'}")
            calls.append(self)
            try:
                return original(self, *args, **kwargs)
            finally:
                calls.pop()
                spans.end(token)
                if top and not _fit_batch and self in _step_functions:
                    _steps.end()

        return __call__

    _wrap(pf.Function, "__call__", make)


def _applies_in_graph() -> None:
    """An optimizer applies its update in graph mode: the tf.function being traced on this
    thread (the outermost) is a training step's."""
    calls = getattr(_local, "functions", None)
    if calls:
        _step_functions.add(calls[0])


def _gradient(original: Any) -> Any:
    return _ranged(lambda *_: "GradientTape.gradient")(original)


def _tape_enter(original: Any) -> Any:
    @functools.wraps(original)
    def __enter__(self: Any) -> Any:
        if _eager():
            _steps.iteration_starts()
        return original(self)

    return __enter__


def _patch_modules(tf: Any) -> None:
    """Wrap ``__call__`` of every tf.Module subclass, and of those defined from now on."""
    base = tf.Module

    def visit(cls: type) -> None:
        if "__call__" in cls.__dict__ and (cls, "__call__") not in _originals:
            _wrap(cls, "__call__", _ranged(_module_name))
        subclasses: list[type] = cls.__subclasses__()
        for sub in subclasses:
            visit(sub)

    visit(base)
    previous = base.__dict__.get("__init_subclass__")

    @classmethod  # type: ignore[misc]
    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        super(base, cls).__init_subclass__(**kwargs)
        try:
            if "__call__" in cls.__dict__ and _level != "off":
                _wrap(cls, "__call__", _ranged(_module_name))
        except Exception:
            spans.warn_once("tf.Module patch")

    _originals[(base, "__init_subclass__")] = previous
    base.__init_subclass__ = __init_subclass__


def _module_name(self: Any, *_: Any) -> str:
    return getattr(self, "name", None) or type(self).__name__


def _patch_ops() -> None:
    from tensorflow.python import pywrap_tfe
    from tensorflow.python.eager import execute

    fast = pywrap_tfe.TFE_Py_FastPathExecute

    @functools.wraps(fast)
    def fast_path(*args: Any) -> Any:
        token = spans.begin(DOMAIN, OP, args[1])
        try:
            return fast(*args)
        finally:
            spans.end(token)

    _originals[(pywrap_tfe, "TFE_Py_FastPathExecute")] = fast
    pywrap_tfe.TFE_Py_FastPathExecute = fast_path

    def op_name(op: Any, *_: Any) -> str:
        return op.decode() if isinstance(op, bytes) else str(op)

    make = _ranged(op_name, OP, eager_only=False)
    for attr in ("execute", "quick_execute"):
        original = execute.__dict__[attr]
        _originals[(execute, attr)] = original
        setattr(execute, attr, make(original))


# ---- Keras and steps ------------------------------------------------------------------------------


def _keras_part(what: str, fn: Callable[[Any], None]) -> Callable[[Any], None]:
    def hook(module: Any) -> None:
        if _level != "off":
            _try(what, lambda: fn(module))
            _report(sys.modules.get("keras"))

    hook.__name__ = fn.__name__
    return hook


def _patch_layers(module: Any) -> None:
    Layer = module.Layer

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not _eager():
                return original(self, *args, **kwargs)
            try:
                stack = _local.stack
            except AttributeError:
                stack = _local.stack = []
            if stack:
                name = f"{stack[-1]}.{self.name}"
            else:
                name = self.name
                _steps.iteration_starts()
            token = spans.begin(DOMAIN, MODULE, name, {"layer": type(self).__name__})
            stack.append(name)
            try:
                return original(self, *args, **kwargs)
            finally:
                stack.pop()
                spans.end(token)

        return __call__

    _wrap(Layer, "__call__", make)


def _patch_fit(module: Any) -> None:
    CallbackList = module.CallbackList

    def begin(original: Any) -> Any:
        @functools.wraps(original)
        def on_train_batch_begin(self: Any, batch: Any, logs: Any = None) -> Any:
            global _fit_batch
            _steps.start_ns = now_ns()
            _fit_batch = True
            return original(self, batch, logs)

        return on_train_batch_begin

    def end(original: Any) -> Any:
        @functools.wraps(original)
        def on_train_batch_end(self: Any, batch: Any, logs: Any = None) -> Any:
            global _fit_batch
            _fit_batch = False
            _steps.end()
            return original(self, batch, logs)

        return on_train_batch_end

    _wrap(CallbackList, "on_train_batch_begin", begin)
    _wrap(CallbackList, "on_train_batch_end", end)


def _patch_optimizer(module: Any) -> None:
    BaseOptimizer = module.BaseOptimizer

    def make(method: str) -> Callable[[Callable[..., object]], Callable[..., object]]:
        def wrap(original: Callable[..., object]) -> Callable[..., object]:
            @functools.wraps(original)
            def wrapper(self: object, *args: object, **kwargs: object) -> object:
                if not _eager():
                    _applies_in_graph()
                    return original(self, *args, **kwargs)
                if getattr(_local, "applying", False):  # apply, inside apply_gradients
                    return original(self, *args, **kwargs)
                _local.applying = True
                token = spans.begin(DOMAIN, MODULE, f"Optimizer.{method}#{type(self).__name__}")
                try:
                    return original(self, *args, **kwargs)
                finally:
                    _local.applying = False
                    spans.end(token)
                    if not _fit_batch:
                        _steps.end()

            return wrapper

        return wrap

    _wrap(BaseOptimizer, "apply_gradients", make("apply_gradients"))
    _wrap(BaseOptimizer, "apply", make("apply"))


_KERAS = {
    "keras.src.layers.layer": _keras_part("Keras layer calls", _patch_layers),
    "keras.src.callbacks.callback_list": _keras_part("Keras fit steps", _patch_fit),
    "keras.src.optimizers.base_optimizer": _keras_part("Keras optimizer steps", _patch_optimizer),
}
