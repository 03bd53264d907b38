"""Opening and closing the framework patches' ranges: an append into the recorder, NVTX if watched.

Every range a framework patch makes (a module's forward, ``optimizer.step``, a Keras layer call)
goes through :func:`begin` and :func:`end`. They record straight into the calling thread's
:class:`~gpu_trace.tracer.buffer.ThreadBuffer`, the way ``gpu_trace.range`` does, with the
category the range has in the store (``module``, ``op``, ``step``) and the lane of its NVTX domain
(``nvtx/torch``, ``nvtx/tensorflow``). They nest in the same per-thread stack as
``gpu_trace.range``, so user ranges and module ranges nest in each other.

Why not emit NVTX and let the collector record it: NVTX has no field for our category, and a call
into the ``nvtx`` package from Python costs more than the append itself (see docs/frameworks.md
and ``bench/patch_overhead.py``). So NVTX is emitted as well only when another NVTX tool, such as
Nsight Systems, is attached to the process (``NVTX_INJECTION64_PATH`` names a library that is not
ours): then the ranges also show in that tool, in the same domains, with NVTX categories named
``module``, ``op``, ``step`` (``nvtxDomainNameCategory``). Under our own injection library the
NVTX copy would only be a duplicate, so it is not emitted.

Nothing here raises into the program.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from gpu_trace.tracer import recorder as _recorder
from gpu_trace.tracer.clock import now_ns
from gpu_trace.tracer.failure import WarnOnce
from gpu_trace.tracer.records import nvtx_lane

log = logging.getLogger(__name__)

warn_once = WarnOnce(log, "gpu-trace: recording a framework %s failed; the program goes on")
#: The ``nvtx`` domains to mirror ranges into (name -> real domain); empty unless a tool watches.
_mirrors: dict[str, Any] = {}
_attributes: dict[tuple[str, str, str], Any] = {}


def external_nvtx_tool(environ: dict[str, str] | None = None) -> str | None:
    """The NVTX tool attached to this process if it is not gpu-trace's own library, else None."""
    path = (os.environ if environ is None else environ).get("NVTX_INJECTION64_PATH") or ""
    if not path or path == "./.":
        return None
    if os.path.basename(path).startswith("libgpu_trace_nvtx-"):
        return None
    return path


class Domain:
    """One NVTX domain's lane (``nvtx/<name>``), and its mirror into a watching NVTX tool."""

    __slots__ = ("name", "lane")

    def __init__(self, name: str) -> None:
        self.name = name
        self.lane = nvtx_lane(name)


def mirror(domain: Domain, on: bool) -> None:
    """Emit ``domain``'s ranges as NVTX too (on) or not (off); see the module docstring."""
    if not on:
        _mirrors.pop(domain.name, None)
        return
    try:
        from gpu_trace.collectors.nvtx import patch as nvtx_patch

        _mirrors[domain.name] = nvtx_patch.original_get_domain(domain.name)
    except Exception:
        log.debug("gpu-trace: no NVTX mirror for domain %s", domain.name, exc_info=True)


def mirrored(domain: Domain) -> bool:
    """Whether ``domain``'s ranges are emitted as NVTX too (see :func:`mirror`)."""
    return domain.name in _mirrors


def clear_mirrors() -> None:
    _mirrors.clear()
    _attributes.clear()


def _mirror_push(domain: str, name: str, category: str) -> None:
    real = _mirrors.get(domain)
    if real is None:
        return
    try:
        key = (domain, name, category)
        attrs = _attributes.get(key)
        if attrs is None:
            attrs = real.get_event_attributes(message=name, category=real.get_category_id(category))
            if len(_attributes) < 65536:
                _attributes[key] = attrs
        real.push_range(attrs)
    except Exception:
        warn_once("NVTX push")


def _mirror_pop(domain: str) -> None:
    real = _mirrors.get(domain)
    if real is not None:
        try:
            real.pop_range()
        except Exception:
            warn_once("NVTX pop")


def begin(
    domain: Domain, category: str, name: str, attrs: dict[str, str] | None = None
) -> list | None:
    """Open a range on this thread; returns the token :func:`end` closes (None: not recording)."""
    rec = _recorder.active
    if rec is None:
        return None
    try:
        try:
            buf = rec._local.buf
        except AttributeError:
            buf = rec.buffer()
        stack = buf.stack
        buf.seq = seq = buf.seq + 1
        sid = buf.prefix + seq
        token = [buf, sid, stack[-1] if stack else 0, len(stack), domain, category, name, attrs, 0]
        stack.append(sid)
        if _mirrors:
            _mirror_push(domain.name, name, category)
        token[8] = now_ns()
        return token
    except Exception:
        warn_once("range start")
        return None


def end(token: list | None, end_ns: int | None = None) -> None:
    """Close a range :func:`begin` opened (on any thread: it lands in the opener's buffer)."""
    t = now_ns() if end_ns is None else end_ns
    if token is None:
        return
    try:
        buf, sid, parent, depth, domain, category, name, attrs, start = token
        token[0] = None  # closed: a second end() is a no-op
        if buf is None:
            return
        stack = buf.stack
        if stack and stack[-1] == sid:
            stack.pop()
        elif sid in stack:
            stack.remove(sid)
        if _mirrors:
            _mirror_pop(domain.name)
        buf.add_span((sid, parent, domain.lane, category, name, start, t, depth, attrs))
    except Exception:
        warn_once("range end")


def add(
    domain: Domain,
    category: str,
    name: str,
    start_ns: int,
    end_ns: int,
    attrs: dict[str, str] | None = None,
) -> None:
    """A finished range with known times (a detected step), recorded as a root of its lane.

    Not under this thread's innermost open range: that may have begun after this one (a user
    range around the loop's body; a backward range when an optimizer steps in a gradient hook),
    and the ranges recorded meanwhile are not this one's children, so a parent would get them
    twice in its self time (negative) or this one would lie outside it. PyTorch's profiler also
    writes ``ProfilerStep#N`` as a root."""
    rec = _recorder.active
    if rec is None:
        return
    try:
        buf = rec.buffer()
        buf.add_span((buf.next_id(), 0, domain.lane, category, name, start_ns, end_ns, 0, attrs))
    except Exception:
        warn_once("range")
