"""The pure-Python twin of native NVTX capture: patches of the ``nvtx`` package.

Used where the injection library can't be loaded (no compiler, no headers, another NVTX tool such
as Nsight attached). The ``nvtx`` package's public functions (``push_range``, ``pop_range``,
``start_range``, ``end_range``, ``mark``, ``annotate``, ``get_domain`` and the returned domains'
methods) record into the active recorder with the lanes, categories, names, nesting and attrs the
native path gives, then call the original so an attached tool still sees every call.

Nesting follows NVTX: push/pop ranges nest per thread and per domain; start/end ranges are
process-wide (depth 0, no parent); a mark is a child of the innermost open range of its domain.
Patching is symmetric and idempotent; nothing here raises into the program.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any

from gpu_trace.tracer import recorder as _recorder
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.failure import WarnOnce
from gpu_trace.tracer.records import MARK, NVTX, nvtx_lane

log = logging.getLogger(__name__)

NAMES = ("push_range", "pop_range", "start_range", "end_range", "mark", "annotate", "get_domain")
_originals: dict[str, Any] = {}
_local = threading.local()
_warn_once = WarnOnce(log, "gpu-trace: recording an NVTX %s failed; the program goes on")


def _after_fork_in_child() -> None:
    # Like the injection library: ranges the parent opened are not the child's to close.
    global _local
    _local = threading.local()


os.register_at_fork(after_in_child=_after_fork_in_child)


# ---- attrs as the native path formats them ---------------------------------------------------


_colors: dict[Any, str] = {}
_lanes: dict[str | None, str] = {}


def _color(color: Any) -> str:
    try:
        return _colors[color]
    except (KeyError, TypeError):
        from nvtx.colors import color_to_hex

        text = f"#{color_to_hex(color) & 0xFFFFFFFF:08x}"
        if len(_colors) < 4096 and isinstance(color, (str, int, type(None))):
            _colors[color] = text
        return text


def _lane(domain: str | None) -> str:
    lane = _lanes.get(domain)
    if lane is None:
        lane = _lanes[domain] = nvtx_lane(domain)
    return lane


def make_attrs(
    color: Any, category: Any, payload: Any, categories: dict[int, str] | None = None
) -> dict[str, str]:
    """``{"category", "color", "payload"}`` strings, as the injection library reports them."""
    attrs: dict[str, str] = {}
    if isinstance(category, str):
        attrs["category"] = category
    elif isinstance(category, int) and category:
        attrs["category"] = (categories or {}).get(category, str(category))
    attrs["color"] = _color(color)
    if type(payload) in (int, float):
        attrs["payload"] = str(payload)
    return attrs


# ---- recording -------------------------------------------------------------------------------


def _stack(domain: str | None) -> list[tuple]:
    stacks = getattr(_local, "stacks", None)
    if stacks is None:
        stacks = _local.stacks = {}
    s = stacks.get(domain)
    if s is None:
        s = stacks[domain] = []
    return s


def push(domain: str | None, name: str, attrs: dict[str, str] | None) -> None:
    rec = _recorder.active
    if rec is None:
        return
    try:
        buf = rec.buffer()
        stack = _stack(domain or None)
        parent = stack[-1][0] if stack else 0
        stack.append((buf.next_id(), parent, len(stack), name, attrs, now_ns()))
    except Exception:
        _warn_once("push")


def pop(domain: str | None) -> None:
    end = now_ns()
    rec = _recorder.active
    if rec is None:
        return
    try:
        stack = _stack(domain or None)
        if stack:
            sid, parent, depth, name, attrs, start = stack.pop()
            rec.buffer().add_span(
                (sid, parent, _lane(domain), NVTX, name, start, end, depth, attrs)
            )
    except Exception:
        _warn_once("pop")


def mark_event(domain: str | None, name: str, attrs: dict[str, str] | None) -> None:
    rec = _recorder.active
    if rec is None:
        return
    try:
        t = now_ns()
        buf = rec.buffer()
        stack = _stack(domain or None)
        parent = stack[-1][0] if stack else 0
        buf.add_span((buf.next_id(), parent, _lane(domain), MARK, name, t, t, len(stack), attrs))
    except Exception:
        _warn_once("mark")


def start(domain: str | None, name: str, attrs: dict[str, str] | None) -> tuple | None:
    rec = _recorder.active
    if rec is None:
        return None
    try:
        buf = rec.buffer()
        return (buf, buf.next_id(), _lane(domain), name, attrs, now_ns())
    except Exception:
        _warn_once("start")
        return None


def end(token: tuple | None) -> None:
    if token is None:
        return
    t = now_ns()
    try:
        buf, sid, lane, name, attrs, begin = token
        buf.add_span((sid, 0, lane, NVTX, name, begin, t, 0, attrs))  # the starting thread's buffer
    except Exception:
        _warn_once("end")


class _Token:
    """A range id carrying our open span next to the original's id."""

    __slots__ = ("original", "span")

    def __init__(self, original: Any, span: tuple | None) -> None:
        self.original = original
        self.span = span

    def __iter__(self):  # ``nvtx.end_range`` unpacks the original ``(id, handle)`` tuple
        return iter(self.original or ())


# ---- the patched API -------------------------------------------------------------------------


def _msg(message: Any) -> str:
    if message is None:
        return ""
    return message if isinstance(message, str) else str(getattr(message, "string", message))


def push_range(message=None, color="blue", domain=None, category=None, payload=None):
    try:
        push(domain, _msg(message), make_attrs(color, category, payload))
    except Exception:
        _warn_once("push")
    return _originals["push_range"](message, color, domain, category, payload)


def pop_range(domain=None):
    try:
        return _originals["pop_range"](domain)
    finally:
        pop(domain)


def start_range(message=None, color=None, domain=None, category=None, payload=None):
    span = None
    try:
        span = start(domain, _msg(message), make_attrs(color, category, payload))
    except Exception:
        _warn_once("start")
    original = _originals["start_range"](message, color, domain, category, payload)
    return _Token(original, span)


def end_range(range_id):
    if isinstance(range_id, _Token):
        try:
            if range_id.original is not None:
                _originals["end_range"](range_id.original)
        finally:
            end(range_id.span)
        return None
    return _originals["end_range"](range_id)


def mark(message=None, color="blue", domain=None, category=None, payload=None):
    try:
        mark_event(domain, _msg(message), make_attrs(color, category, payload))
    except Exception:
        _warn_once("mark")
    return _originals["mark"](message, color, domain, category, payload)


class annotate:
    """``nvtx.annotate`` recording into the active run, as context manager and decorator."""

    def __init__(self, message=None, color=None, domain=None, category=None, payload=None):
        self._orig = _originals["annotate"](message, color, domain, category, payload)
        self.message = message
        self.domain = domain
        try:
            self.attrs: dict[str, str] | None = make_attrs(color, category, payload)
        except Exception:
            self.attrs = None

    def __enter__(self):
        push(self.domain, _msg(self.message), self.attrs)
        try:
            self._orig.__enter__()
        except BaseException:
            pop(self.domain)
            raise
        return self

    def __exit__(self, *exc):
        try:
            return self._orig.__exit__(*exc)
        finally:
            pop(self.domain)

    def __call__(self, func):
        name = _msg(self.message) if self.message is not None else getattr(func, "__name__", "")
        inner = self._orig(func)
        domain, attrs = self.domain, self.attrs

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            push(domain, name, attrs)
            try:
                return inner(*args, **kwargs)
            finally:
                pop(domain)

        return wrapper


class _Attributes:
    """Event attributes of a disabled domain (no NVTX tool attached), kept for our recording."""

    __slots__ = ("message", "color", "category", "payload")

    def __init__(self, message=None, color=None, category=None, payload=None):
        self.message, self.color, self.category, self.payload = message, color, category, payload


class _RegisteredString:
    __slots__ = ("string",)

    def __init__(self, string: str) -> None:
        self.string = string


class DomainProxy:
    """What the patched ``nvtx.get_domain`` returns: records, then forwards to the real domain."""

    def __init__(self, name: str | None, real: Any) -> None:
        self.name = name
        self._real = real
        self._enabled = type(real).__name__ != "DummyDomain"
        self._names: dict[int, str] = {}
        self._ids: dict[str, int] = {}

    def __getattr__(self, item: str) -> Any:
        return getattr(self._real, item)

    def get_registered_string(self, string):
        return (
            self._real.get_registered_string(string) if self._enabled else _RegisteredString(string)
        )

    def get_category_id(self, name):
        if self._enabled:
            cid = self._real.get_category_id(name)
        else:
            cid = self._ids.get(name) or len(self._ids) + 1
        self._ids[name] = cid
        self._names[cid] = name
        return cid

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        if isinstance(category, str):
            category = self.get_category_id(category)
        if self._enabled:
            return self._real.get_event_attributes(message, color, category, payload)
        if isinstance(message, str):
            message = self.get_registered_string(message)
        return _Attributes(message, color, category, payload)

    def set_event_attributes(self, attributes, **kwargs):
        if isinstance(kwargs.get("category"), str):
            kwargs["category"] = self.get_category_id(kwargs["category"])
        if self._enabled:
            return self._real.set_event_attributes(attributes, **kwargs)
        for k, v in kwargs.items():
            setattr(
                attributes,
                k,
                self.get_registered_string(v) if k == "message" and isinstance(v, str) else v,
            )
        return None

    def _resolve(self, attributes, kwargs):
        if attributes is None:
            attributes = self.get_event_attributes(**kwargs)
        elif kwargs:
            self.set_event_attributes(attributes, **kwargs)
        return attributes

    def _describe(self, attributes) -> tuple[str, dict[str, str] | None]:
        try:
            return _msg(attributes.message), make_attrs(
                attributes.color, attributes.category, attributes.payload, self._names
            )
        except Exception:
            _warn_once("attribute read")
            return "", None

    def push_range(self, attributes=None, **kwargs):
        attributes = self._resolve(attributes, kwargs)
        push(self.name, *self._describe(attributes))
        if self._enabled:
            return self._real.push_range(attributes)
        return None

    def pop_range(self):
        try:
            if self._enabled:
                return self._real.pop_range()
            return None
        finally:
            pop(self.name)

    def mark(self, attributes=None, **kwargs):
        attributes = self._resolve(attributes, kwargs)
        mark_event(self.name, *self._describe(attributes))
        if self._enabled:
            return self._real.mark(attributes)
        return None

    def start_range(self, attributes=None, **kwargs):
        attributes = self._resolve(attributes, kwargs)
        span = start(self.name, *self._describe(attributes))
        original = self._real.start_range(attributes) if self._enabled else 0
        return _Token(original, span)

    def end_range(self, range_id):
        if isinstance(range_id, _Token):
            try:
                if self._enabled:
                    self._real.end_range(range_id.original)
            finally:
                end(range_id.span)
            return None
        return self._real.end_range(range_id)


_proxies: dict[str | None, DomainProxy] = {}


def get_domain(name=None):
    proxy = _proxies.get(name)
    if proxy is None:
        proxy = _proxies[name] = DomainProxy(name, _originals["get_domain"](name))
    return proxy


_PATCHES = {
    "push_range": push_range,
    "pop_range": pop_range,
    "start_range": start_range,
    "end_range": end_range,
    "mark": mark,
    "annotate": annotate,
    "get_domain": get_domain,
}


def patch() -> bool:
    """Patch the ``nvtx`` package (first undoing an earlier patch). False if it is not installed."""
    unpatch()
    try:
        import nvtx
    except Exception:
        return False
    for name in NAMES:
        if hasattr(nvtx, name):
            _originals[name] = getattr(nvtx, name)
            setattr(nvtx, name, _PATCHES[name])
    return True


def unpatch() -> None:
    """Restore the ``nvtx`` package's originals. Idempotent."""
    if not _originals:
        return
    import nvtx

    for name, original in _originals.items():
        setattr(nvtx, name, original)
    _originals.clear()
    _proxies.clear()


def is_patched() -> bool:
    return bool(_originals)


def original_get_domain(name: str | None) -> Any:
    """The ``nvtx`` package's own domain ``name``, patched or not: a mirror of gpu-trace's ranges
    into NVTX (``framework_patches/spans.py``) must not be recorded a second time by this twin."""
    import nvtx

    return _originals.get("get_domain", nvtx.get_domain)(name)
