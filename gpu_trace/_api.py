"""The public recording API: ``range``, ``mark``, ``counter``, ``step``, ``start``, ``stop``
(``profile()``, which records a block and stores it, is in ``profiling.py``).

Every call is safe with no active recorder (it then only emits NVTX for an attached tool) and
never raises into the program once constructed.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from gpu_trace.tracer import recorder as _recorder
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.failure import WarnOnce
from gpu_trace.tracer.records import API_DOMAIN, MARK, NVTX, nvtx_lane

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_LANE = nvtx_lane(API_DOMAIN)
#: Shared with the C range, which calls it as ``warn(what, exc)`` with the exception it caught.
_warn_once = WarnOnce(log, "gpu-trace: %s failed; the program goes on without this event")


def _attrs(attrs: dict[str, Any]) -> dict[str, str] | None:
    return {str(k): str(v) for k, v in attrs.items()} if attrs else None


class PyRange:
    """A named range: ``with gpu_trace.range("load", batch=3): ...`` or ``@gpu_trace.range("f")``.

    Recorded on this thread's lane ``nvtx/gpu_trace`` with its attributes as strings, nested in the
    ranges open around it. The hot path is kept to a few attribute reads and one append.

    This is the pure-Python twin of the C type in ``tracer/_fastpath.c``, which ``gpu_trace.range``
    is wherever that extension builds and loads; the two record the same spans (a parity test
    holds them together).
    """

    __slots__ = ("name", "attrs", "_buf", "_sid", "_parent", "_depth", "_start")

    def __init__(self, name: str, /, **attrs: Any) -> None:
        if name.__class__ is not str:
            raise ValueError(f"range name must be a string, got {type(name).__name__}")
        self.name = name
        self.attrs = {str(k): str(v) for k, v in attrs.items()} if attrs else None
        self._buf = None

    def __enter__(self) -> PyRange:
        rec = _recorder.active
        if rec is not None:
            try:
                try:
                    buf = rec._local.buf
                except AttributeError:
                    buf = rec.buffer()
                stack = buf.stack
                buf.seq = seq = buf.seq + 1
                self._sid = sid = buf.prefix + seq
                self._parent = stack[-1] if stack else 0
                self._depth = len(stack)
                stack.append(sid)
                self._buf = buf
            except Exception:
                _warn_once("range enter")
        self._start = now_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        end = now_ns()
        buf = self._buf
        if buf is not None:
            try:
                stack = buf.stack
                sid = self._sid
                if stack and stack[-1] == sid:
                    stack.pop()
                elif sid in stack:
                    stack.remove(sid)
                buf.add_span(
                    (
                        sid,
                        self._parent,
                        _LANE,
                        NVTX,
                        self.name,
                        self._start,
                        end,
                        self._depth,
                        self.attrs,
                    )
                )
            except Exception:
                _warn_once("range exit")

    def __call__(self, fn: F) -> F:
        name, attrs = self.name, self.attrs

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            r = PyRange(name)
            r.attrs = attrs
            r.__enter__()
            try:
                return fn(*args, **kwargs)
            finally:
                r.__exit__()

        return wrapper  # type: ignore[return-value]


def _native_range() -> type | None:
    """The C ``range`` type: prebuilt, cached, or compiled now; None (the twin is used) if not."""
    try:
        from gpu_trace import config
        from gpu_trace.tracer import buffer, columns, fastpath_build

        path = fastpath_build.find_or_build(config.home() / "lib", cc=config.c_compiler())
        native = fastpath_build.load(path)
        native.configure(
            _recorder, buffer.ThreadBuffer, _LANE, NVTX, _warn_once, functools.update_wrapper
        )
        columns.use_native(native.span_columns)  # the flusher's side: one pass, in C
        return native.range
    except Exception as exc:  # not an error: the Python twin records the same spans
        log.debug("gpu-trace: using the Python range (the C one is unavailable: %s)", exc)
        return None


#: ``gpu_trace.range``: the C type where it can be built and loaded, else the Python twin.
range = _native_range() or PyRange  # noqa: A001 - the public name mirrors NVTX's "range"


def mark(name: str, /, **attrs: Any) -> None:
    """An instant event on this thread's ``nvtx/gpu_trace`` lane."""
    rec = _recorder.active
    if rec is None:
        return
    try:
        t = now_ns()
        buf = rec.buffer()
        stack = buf.stack
        buf.add_span(
            (
                buf.next_id(),
                stack[-1] if stack else 0,
                _LANE,
                MARK,
                str(name),
                t,
                t,
                len(stack),
                _attrs(attrs),
            )
        )
    except Exception:
        _warn_once("mark")


def counter(name: str, value: float, /, *, device: str = "", **labels: Any) -> None:
    """A sample of a user metric: ``gpu_trace.counter("loss", 0.42)``."""
    rec = _recorder.active
    if rec is None:
        return
    try:
        rec.buffer().add_counter(
            ("user", device, str(name), now_ns(), float(value), _attrs(labels))
        )
    except Exception:
        _warn_once("counter")


class step:
    """Start training step ``n`` (``ProfilerStep#n``); the previous step ends here.

    ``gpu_trace.step(n)`` at the top of each iteration, or ``with gpu_trace.step(n): ...`` to end
    the step with the block. With no ``n`` the step after the last one is started.
    """

    __slots__ = ("number",)

    def __init__(self, n: int | None = None) -> None:
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ValueError(f"step number must be a non-negative int, got {n!r}")
        self.number = n
        rec = _recorder.active
        if rec is not None:
            try:
                self.number = rec.begin_step(n)
            except Exception:
                _warn_once("step")

    def __enter__(self) -> step:
        return self

    def __exit__(self, *exc: object) -> None:
        rec = _recorder.active
        if rec is not None:
            try:
                rec.end_step(self.number)
            except Exception:
                _warn_once("step end")


def start(run_dir: str | Path | None = None, **settings: Any) -> Path:
    """Start recording this process into ``run_dir`` (a new run under GPU_TRACE_HOME by default).

    `gpu-trace record` does this for you before the program's first line; call it to record a
    part of a program yourself, then ``stop()`` and ``gpu-trace ingest RUN_DIR``.
    """
    from gpu_trace import _capture, profiling
    from gpu_trace.tracer.session import start_run

    block = profiling.active_run()
    if block is not None:
        raise ValueError(
            f"gpu_trace.profile() is recording run {block}: start() records a run of its own; "
            "end the profile() block first (ranges inside it are recorded already)"
        )
    run = Path(run_dir) if run_dir is not None else None
    return start_run(run_dir=run, attach=_capture.attach, **settings)


def stop() -> Path | None:
    """Stop recording and flush; returns the run directory (None if nothing was recording).

    A ``gpu_trace.profile()`` block's recording is not stopped here (ValueError): it ends with
    its block, which then stores it.
    """
    from gpu_trace import _capture, profiling
    from gpu_trace.tracer.session import stop_run

    block = profiling.active_run()
    if block is not None:
        raise ValueError(
            f"gpu_trace.profile() is recording run {block}; it stops when its with block ends"
        )

    return stop_run(detach=_capture.detach)
