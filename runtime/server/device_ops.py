"""The ``rt::`` ops behind the client's ``torch.cuda`` emulation, and each session's backend
settings.

- ``rt::mark [event]`` records where the session's op stream has got to, for a client-side
  ``torch.cuda.Event``: a CUDA event recorded on the session's stream on a CUDA device, the
  clock read when the op runs on the CPU device (ops there run one after the other, so it is when
  every earlier op has finished). A session keeps its last :data:`MAX_MARKS` events.
- ``rt::elapsed [start, end]``: milliseconds between two marks (``Event.elapsed_time``), waiting
  for the end mark to be reached.
- ``rt::device``: what ``torch.cuda.get_device_properties`` tells about the server's device.
- ``rt::mem_info``: ``torch.cuda.mem_get_info`` as the session sees the device: its tenant's
  quota, where it has one, as the total.
- ``rt::flags [settings]``: the program's backend settings
  (:mod:`gpu_trace.runtime.protocol.backend_flags`); :func:`use_flags` puts a session's in force
  before its ops run and the server's own back for sessions that set none. ``rt::flags []``
  reads back the settings the session's ops run under.
- ``rt::rng_state`` reads the state of the generator the session's device ops draw from (the
  device's: CUDA's on a CUDA device, the CPU's on the CPU device), as hex;
  ``rt::rng_state [hex]`` sets it (``torch.cuda.get_rng_state``/``set_rng_state``, which
  ``torch.utils.checkpoint`` and ``torch.random.fork_rng`` call to replay dropout when they
  recompute). The state is the session's own: a server switches generators between sessions.
"""

from __future__ import annotations

import os
import platform
import time
import weakref
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from gpu_trace.runtime.protocol import backend_flags
from gpu_trace.runtime.protocol.backend_flags import Flags
from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.protocol.wire import ProtocolError
from gpu_trace.runtime.sharing.sessions import Session

if TYPE_CHECKING:
    from torch import device as TorchDevice

    from gpu_trace.runtime.sharing.memory import Memory

#: Events a session keeps on the server (the oldest are forgotten first).
MAX_MARKS = 1024
NAMES = frozenset(
    {"rt::mark", "rt::elapsed", "rt::device", "rt::mem_info", "rt::flags", "rt::rng_state"}
)
#: The largest generator state ``rt::rng_state`` takes (the CPU's is 5,056 bytes, CUDA's 16).
MAX_RNG_STATE_BYTES = 1 << 16

_marks: weakref.WeakKeyDictionary[Session, dict[int, Any]] = weakref.WeakKeyDictionary()
_flags: weakref.WeakKeyDictionary[Session, Flags] = weakref.WeakKeyDictionary()
_baseline: Flags | None = None  # the server's own settings, read at first use
_in_force: Flags | None = None
_owner: Session | None = None  # whose settings were put in force last


class Runner(Protocol):
    """What these ops read of the executor that runs them
    (:class:`~gpu_trace.runtime.server.executor.Executor`)."""

    @property
    def torch(self) -> ModuleType: ...

    @property
    def device(self) -> TorchDevice: ...

    @property
    def memory(self) -> Memory: ...


def run(ex: Runner, session: Session, name: str, args: list[object]) -> Any:
    """One of :data:`NAMES`."""
    if name == "rt::mark":
        if len(args) != 1 or type(args[0]) is not int:
            raise ProtocolError("rt::mark takes [event id]")
        marks = _marks.setdefault(session, {})
        marks.pop(args[0], None)  # recorded again: now the newest
        if len(marks) >= MAX_MARKS:
            del marks[next(iter(marks))]
        marks[args[0]] = _mark(ex)
        return None
    if name == "rt::elapsed":
        first, last = args if len(args) == 2 else (None, None)
        if type(first) is not int or type(last) is not int:
            raise ProtocolError("rt::elapsed takes [start event id, end event id]")
        marks = _marks.get(session, {})
        start, end = marks.get(first), marks.get(last)
        if start is None or end is None:
            raise OpError(
                "an event was not recorded on the server, or is older than the session's last "
                f"{MAX_MARKS} recorded events"
            )
        if ex.device.type == "cuda":
            end.synchronize()
            return float(start.elapsed_time(end))
        return (end - start) / 1e6
    if name == "rt::device":
        return _device(ex)
    if name == "rt::mem_info":
        memory = ex.memory
        tenant = memory.tenant_of(session)
        free_device = max(0, memory.capacity_bytes - memory.used_bytes)
        if tenant.limit_bytes is None:
            return [free_device, memory.capacity_bytes]
        return [
            min(free_device, max(0, tenant.limit_bytes - tenant.used_bytes)),
            tenant.limit_bytes,
        ]
    if name == "rt::flags":
        if not args:  # what this session's ops run under, read back from torch
            return backend_flags.read(ex.torch)
        if len(args) != 1:
            raise ProtocolError("rt::flags takes [settings], or [] to read them back")
        try:
            flags = backend_flags.check(args[0])
        except ValueError as exc:
            raise ProtocolError(f"rt::flags: {exc}") from None
        own = _server_own(ex.torch)
        flags = {**own, **flags}  # what a client's torch lacks stays the server's own
        if flags == own:  # the usual case: nothing to switch between it and other sessions
            flags = own
        _flags[session] = flags
        _put_in_force(ex.torch, session, flags)
        return None
    if name == "rt::rng_state":
        if not args:
            return _generator_state(ex).hex()
        state = args[0] if len(args) == 1 else None
        if type(state) is not str or len(state) > 2 * MAX_RNG_STATE_BYTES:
            raise ProtocolError("rt::rng_state takes [], or [state as hex] to set it")
        try:
            data = bytes.fromhex(state)
        except ValueError:
            raise ProtocolError("rt::rng_state: the state is not hex") from None
        _set_generator_state(ex, data)
        return None
    raise OpError(f"unknown runtime op {name[:100]!r}")


def _generator_state(ex: Runner) -> bytes:
    torch = ex.torch
    if ex.device.type == "cuda":
        state = torch.cuda.get_rng_state(ex.device)
    else:
        state = torch.get_rng_state()
    return bytes(state.numpy().tobytes())


def _set_generator_state(ex: Runner, data: bytes) -> None:
    torch = ex.torch
    size = len(_generator_state(ex))
    if len(data) != size:
        raise OpError(f"the server's device has a {size}-byte RNG state, not {len(data)} bytes")
    state = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    try:
        if ex.device.type == "cuda":
            torch.cuda.set_rng_state(state, ex.device)
        else:
            torch.set_rng_state(state)
    except (RuntimeError, ValueError) as exc:
        raise OpError(f"rt::rng_state: {exc}") from None


def use_flags(torch: ModuleType, session: Session) -> None:
    """Put ``session``'s backend settings in force (the server's own if it set none) before its
    ops run; nothing to do when it was the last session to run."""
    if session is _owner:
        return
    flags = _flags.get(session)
    _put_in_force(torch, session, flags if flags is not None else _server_own(torch))


def _server_own(torch: ModuleType) -> Flags:
    """The server's own settings, read once, before any session's were put in force."""
    global _baseline, _in_force
    if _baseline is None:
        _baseline = backend_flags.read(torch)
        if _in_force is None:  # what is in force now: nothing to apply for it
            _in_force = _baseline
    return _baseline


def _put_in_force(torch: ModuleType, session: Session, flags: Flags) -> None:
    global _in_force, _owner
    if flags is not _in_force:
        if flags != _in_force:
            backend_flags.apply(torch, flags)
        _in_force = flags
    _owner = session


def _mark(ex: Runner) -> object:
    if ex.device.type == "cuda":
        event = ex.torch.cuda.Event(enable_timing=True)
        event.record()  # the current stream: the session's, while its batch runs
        return event
    return time.perf_counter_ns()


def _device(ex: Runner) -> list[str | int]:
    """[name, major, minor, total memory, multiprocessors]; the CPU device: the machine's
    processor, capability (0, 0), physical memory and CPU count."""
    if ex.device.type == "cuda":
        p = ex.torch.cuda.get_device_properties(ex.device)
        return [str(p.name), int(p.major), int(p.minor), int(p.total_memory),
                int(p.multi_processor_count)]  # fmt: skip
    name = platform.processor() or platform.machine() or "cpu"
    return [f"cpu ({name})", 0, 0, int(ex.memory.capacity_bytes), os.cpu_count() or 1]
