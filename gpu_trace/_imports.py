"""Post-import hooks: run a callback right after a module is imported, without importing it.

``when_imported("torch", patch_torch)`` patches PyTorch if and when the program imports it, and
costs nothing otherwise. A finder at the front of ``sys.meta_path`` answers only for hooked module
names: it asks the finders behind it for the real spec and wraps the spec's loader so that the
callbacks run as soon as ``exec_module`` returns, before the importer gets the module. The wrapper
puts the real loader back on the module first, so afterwards nothing of it is visible.

Callbacks run each time the module is executed: normally once, again after a reload or after it
is removed from ``sys.modules`` and imported anew (a new module object that needs patching too).
A callback that raises is logged (once per callback) and never breaks the import.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["discard", "remove_hooks", "when_imported"]

Callback = Callable[[ModuleType], object]

_lock = threading.RLock()
_hooks: dict[str, list[Callback]] = {}
_failed: set[tuple[str, int]] = set()
_loading: set[str] = set()  # modules executing through our loader right now
_local = threading.local()


def when_imported(module_name: str, callback: Callback) -> None:
    """Call ``callback(module)`` right after ``module_name`` is imported.

    If the module is already imported the callback runs now. Registering the same callback for
    the same module again does nothing. Only modules loaded through a loader with
    ``exec_module`` (every ordinary source, bytecode and extension module) can be hooked.
    """
    if not module_name or not isinstance(module_name, str):
        raise ValueError(f"module name must be a non-empty string, got {module_name!r}")
    if not callable(callback):
        raise ValueError(f"callback must be callable, got {callback!r}")
    with _lock:
        callbacks = _hooks.setdefault(module_name, [])
        if callback in callbacks:
            return
        callbacks.append(callback)
        _install_finder()
        module = sys.modules.get(module_name)
        pending = module_name in _loading
    if module is not None and not pending:
        _call(module_name, callback, module)


def discard(module_name: str, callback: Callback) -> None:
    """Forget one callback (it does not undo what the callback did)."""
    with _lock:
        callbacks = _hooks.get(module_name, [])
        if callback in callbacks:
            callbacks.remove(callback)
        if not callbacks:
            _hooks.pop(module_name, None)


def remove_hooks() -> None:
    """Forget every callback and take the finder off ``sys.meta_path`` (for tests)."""
    with _lock:
        _hooks.clear()
        _failed.clear()
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _HookFinder)]


def hooked() -> dict[str, list[Callback]]:
    """A copy of the registered callbacks by module name (for tests and diagnostics)."""
    with _lock:
        return {name: list(callbacks) for name, callbacks in _hooks.items()}


def _install_finder() -> None:
    if not any(isinstance(f, _HookFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _HookFinder())


def _call(module_name: str, callback: Callback, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:  # never break the program's import (STYLE.md 6)
        key = (module_name, id(callback))
        with _lock:
            first = key not in _failed
            _failed.add(key)
        if first:
            log.exception("gpu-trace: post-import hook %r for %s failed", callback, module_name)


def _fire(module_name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = list(_hooks.get(module_name, ()))
    for callback in callbacks:
        _call(module_name, callback, module)


class _HookFinder:
    """Finds nothing itself: wraps the loader of hooked modules that the other finders find."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in _hooks:
            return None
        busy = getattr(_local, "busy", None)
        if busy is None:
            busy = _local.busy = set()
        if fullname in busy:  # a finder behind us asked the import system again
            return None
        busy.add(fullname)
        try:
            spec = _find_behind(self, fullname, path, target)
        except Exception:
            log.debug(
                "gpu-trace: finding %s for its post-import hook failed", fullname, exc_info=True
            )
            return None
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # let the import system find it the ordinary way
        if not isinstance(spec.loader, _HookLoader):
            # duck-typed: it forwards to the loader it wraps rather than subclass Loader, whose
            # default methods would shadow the wrapped loader's
            spec.loader = _HookLoader(spec.loader, fullname)  # type: ignore[assignment]
        return spec

    def invalidate_caches(self) -> None:
        pass


def _find_behind(
    me: _HookFinder, fullname: str, path: Sequence[str] | None, target: ModuleType | None
) -> ModuleSpec | None:
    for finder in list(sys.meta_path):
        if finder is me or isinstance(finder, _HookFinder):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


class _HookLoader:
    """Delegates to the real loader; runs the callbacks after ``exec_module``."""

    def __init__(self, loader: Any, name: str) -> None:
        self.loader = loader
        self.name = name

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back first, so the module (and pkgutil, importlib.resources,
        # pickle...) never sees this wrapper.
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.loader is self:
            spec.loader = self.loader
        if getattr(module, "__loader__", None) is self:
            module.__loader__ = self.loader
        with _lock:
            _loading.add(self.name)
        try:
            self.loader.exec_module(module)
        finally:
            with _lock:
                _loading.discard(self.name)
        # A module may replace itself in sys.modules while it executes; the importer returns that.
        _fire(self.name, sys.modules.get(self.name, module))

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (copy, pickle): don't recurse
            raise AttributeError(name)
        return getattr(self.loader, name)
