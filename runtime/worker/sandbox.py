"""Containment of a worker process: what the code running one session's ops can reach.

A worker does its setup first (imports torch, makes its device's context, receives its client's
socket), then calls :func:`contain`, which applies five layers to the current process, in this
order, for good:

1. ``rlimits`` (any kernel): ``RLIMIT_DATA`` bounds its private writable memory (``malloc``,
   anonymous ``mmap``, thread stacks: Linux 4.7 and later) to what it uses at that moment plus
   :attr:`Containment.host_memory_bytes`, so a bigger allocation fails (``MemoryError``);
   ``RLIMIT_NOFILE``; no core files; no file written past 64 MiB.
2. ``dumpable`` (any kernel): ``PR_SET_DUMPABLE`` 0, so no other process of its uid may ptrace it
   or read its ``/proc/PID/mem`` or ``environ`` (root still may); ``PR_SET_NO_NEW_PRIVS``, so
   nothing it runs gains privileges (Landlock and seccomp need it without ``CAP_SYS_ADMIN``).
3. ``uid`` (only when running as root): drops to :attr:`Containment.uid`, the same gid and no
   supplementary groups, and with them every capability. Files it needs after that must be
   readable by that uid (the Python install included, for lazy imports); ``/dev/nvidia*`` usually
   are (mode 666). Without a uid it stays root but drops every capability, on the calling thread
   and the threads it starts later: with ``CAP_PERFMON`` or ``CAP_SYS_ADMIN``, root read other
   processes' ``maps`` and ``environ`` past Landlock on the 6.18 kernel of our tests.
4. ``landlock`` (Linux 5.13, Landlock in the kernel's ``lsm=`` list): files: only the readable
   paths (read, list, execute) and the writable ones (all but making device nodes); processes
   outside its domain may not be ptraced, nor their ``/proc/PID/mem`` or ``environ`` read (but
   see ``uid`` about root). ABI 4
   (6.7): no TCP ``bind`` or ``connect`` at all. ABI 6 (6.12): no signals to processes outside
   its domain, no connecting to abstract UNIX sockets outside it. Before ABI 8 (7.0) Landlock
   restricts the calling thread and the threads it starts later, not threads that already run:
   the layer says how many those are, and a worker should call :func:`contain` from the thread
   that will run its session, before it starts the threads that run ops.
5. ``seccomp`` (Linux 3.17, for ``SECCOMP_FILTER_FLAG_TSYNC``): a deny-list filter on every
   thread (:mod:`gpu_trace.runtime.worker.syscall_filter`), complementing the layers above: no
   process creation (``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD``, ``execve``;
   ``clone3`` answers ``ENOSYS``, so glibc uses ``clone`` for threads); no sockets but
   ``AF_UNIX`` (UDP and raw sockets too, which Landlock leaves alone); signals (``kill``,
   ``tgkill``...) to its own process only; no ``ptrace``, ``process_vm_*``, mounts, namespaces,
   keyrings, ``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring``. Everything else is
   allowed. A syscall of a foreign ABI (i386, x32) kills it.

The calls into the kernel, and the syscall numbers they need, are in
:mod:`gpu_trace.runtime.worker.syscalls`.

A layer the kernel lacks is skipped and said so in :class:`Contained`, never raised; so is one
that fails. The caller decides whether to run a worker so contained (:meth:`Contained.held`).

What none of them covers: descriptors it held before (its client's socket, CUDA's device files:
that is how it keeps working); connecting to a named UNIX socket that its uid may write (Landlock
up to ABI 7 does not see those: the uid drop does); reading another process's ``cmdline`` or
``stat`` under ``/proc``; CPU time and device memory (the front and the executor bound those).
"""

from __future__ import annotations

import ctypes
import errno
import glob
import logging
import os
import resource
import stat
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpu_trace.runtime.worker import syscall_filter
from gpu_trace.runtime.worker.syscalls import (
    PR_SET_DUMPABLE,
    PR_SET_NO_NEW_PRIVS,
    SYSCALLS,
    machine,
    prctl,
    syscall,
)

__all__ = ["Contained", "Containment", "contain", "default_paths", "for_worker"]

log = logging.getLogger(__name__)

#: The layers, in the order :func:`contain` applies them.
LAYERS = ("rlimits", "dumpable", "uid", "landlock", "seccomp")
#: RLIMIT_FSIZE: a worker writes spans and scratch files, never big ones. Python ignores SIGXFSZ,
#: so a write past it fails with EFBIG instead of killing the process.
FILE_SIZE_BYTES = 64 << 20
#: The uid and gid of ``nobody`` on most distributions.
NOBODY = 65534


@dataclass(frozen=True)
class Containment:
    """What a contained worker may use. Paths are absolute; an entry with a wildcard
    (``/dev/nvidia*``) stands for what it matches when :func:`contain` runs, and one that does not
    exist is left out."""

    #: Private writable memory it may allocate on top of what it uses when contained; None: no
    #: bound. Not RLIMIT_AS: CUDA reserves far more address space than it uses (its unified
    #: address space, tens of GiB), which RLIMIT_AS counts and RLIMIT_DATA does not.
    host_memory_bytes: int | None
    #: When running as root: the uid (and gid) to drop to, e.g. :data:`NOBODY`; None: stay root
    #: without capabilities. Ignored, and said so, when not root.
    uid: int | None = None
    #: Read-only paths on top of :func:`default_paths`.
    readable: tuple[str, ...] = ()
    #: Read-write paths: device nodes (``/dev/nvidia*``), ``/dev/shm``, a scratch folder.
    writable: tuple[str, ...] = ()
    #: RLIMIT_NOFILE.
    open_files: int = 256

    def __post_init__(self) -> None:
        if self.host_memory_bytes is not None and self.host_memory_bytes < 0:
            raise ValueError(f"host_memory_bytes must be >= 0, got {self.host_memory_bytes}")
        if self.uid is not None and self.uid < 0:
            raise ValueError(f"uid must be >= 0, got {self.uid}")
        if self.open_files < 1:
            raise ValueError(f"open_files must be >= 1, got {self.open_files}")
        for name in ("readable", "writable"):
            paths = tuple(getattr(self, name))
            bad = [p for p in paths if not isinstance(p, str) or not os.path.isabs(p)]
            if bad:
                raise ValueError(f"{name} paths must be absolute, got {bad!r}")
            object.__setattr__(self, name, paths)


@dataclass(frozen=True)
class Contained:
    """What :func:`contain` did: each layer's state, ``held`` (with details in parentheses),
    ``skipped: why``, ``unavailable: why`` (the kernel lacks it) or ``failed: error``."""

    layers: dict[str, str]

    def held(self, layer: str) -> bool:
        """Whether ``layer`` holds."""
        return self.layers.get(layer, "").startswith("held")

    def summary(self) -> str:
        """One line: every layer and its state."""
        return "; ".join(f"{name}: {state}" for name, state in self.layers.items())


def default_paths() -> tuple[str, ...]:
    """The read-only paths every contained worker gets: Python's prefixes and ``sys.path``, the
    folders of gpu_trace's imported packages (an editable install keeps them outside
    ``sys.path``), the system's libraries (``/usr``, ``/lib*``, ``/etc/ld.so.cache``: torch and
    CUDA ``dlopen`` some lazily), ``/dev/urandom``, and ``/proc`` and ``/sys`` (CUDA and torch
    read the machine's description there; Landlock and the uid layer keep other processes' memory
    and environment out of reach)."""
    paths = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    paths += [p for p in sys.path if p and os.path.isabs(p)]
    for name, module in list(sys.modules.items()):
        if name == "gpu_trace" or name.startswith("gpu_trace."):
            paths += [p for p in getattr(module, "__path__", ()) if os.path.isabs(p)]
    paths += ["/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/dev/urandom"]
    paths += ["/proc", "/sys"]
    return tuple(dict.fromkeys(paths))


def for_worker(
    device: str,
    *,
    host_memory_bytes: int | None = None,
    uid: int | None = None,
    writable: tuple[str, ...] = (),
) -> Containment:
    """The containment of a worker that runs ops on ``device`` (``cuda:0``, ``cpu``): writable
    ``/dev/null`` and ``/dev/shm`` (torch's shared memory), and on CUDA the NVIDIA device nodes:
    the context's own are open already, but the driver opens more on demand (``nvidia-uvm``, a MIG
    instance's ``nvidia-caps``). ``writable`` adds paths (where the worker writes its spans)."""
    nodes: tuple[str, ...] = ("/dev/nvidia*",) if device.startswith("cuda") else ()
    return Containment(
        host_memory_bytes=host_memory_bytes,
        uid=uid,
        writable=("/dev/null", "/dev/shm", *nodes, *writable),
    )


def contain(c: Containment) -> Contained:
    """Apply :class:`Containment` ``c`` to the current process, irreversibly (see the module's
    docstring for what each layer holds). Never raises for a missing kernel feature: the answer
    says which layers held."""
    return _apply(c, LAYERS)


def _apply(c: Containment, layers: Iterable[str]) -> Contained:
    """:func:`contain` with only ``layers`` (tests show what each one holds alone)."""
    wanted = set(layers)
    unknown = wanted - set(LAYERS)
    if unknown:
        raise ValueError(f"unknown layers {sorted(unknown)}; known: {LAYERS}")
    states: dict[str, str] = {}
    for name in LAYERS:
        if name not in wanted:
            continue
        try:
            states[name] = _LAYERS[name](c)
        except OSError as e:
            states[name] = f"failed: {e}"
            log.warning("worker containment: %s failed: %s", name, e)
        if name == "uid" and "dumpable" in wanted and states[name].startswith("held"):
            # A change of uid resets the process's dumpable flag to fs.suid_dumpable, which an
            # administrator may have set to 1.
            prctl(PR_SET_DUMPABLE, 0)
    contained = Contained(states)
    log.debug("worker contained: %s", contained.summary())
    return contained


# ---- 1. rlimits ----------------------------------------------------------------------------------


def _data_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError(errno.ENOENT, "no VmData in /proc/self/status")


def _lower(which: int, value: int) -> int:
    """Set soft and hard limit to ``value``, never above the current hard limit (raising it would
    need CAP_SYS_RESOURCE); the limit set."""
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))
    return value


def _rlimits(c: Containment) -> str:
    parts = []
    if c.host_memory_bytes is not None:
        data = _lower(resource.RLIMIT_DATA, _data_bytes() + c.host_memory_bytes)
        parts.append(f"data {data >> 20} MiB")
    parts.append(f"files {_lower(resource.RLIMIT_NOFILE, c.open_files)}")
    _lower(resource.RLIMIT_CORE, 0)
    parts.append(f"file size {_lower(resource.RLIMIT_FSIZE, FILE_SIZE_BYTES) >> 20} MiB")
    return f"held ({', '.join(parts)})"


# ---- 2. dumpable ---------------------------------------------------------------------------------


def _dumpable(c: Containment) -> str:
    prctl(PR_SET_DUMPABLE, 0)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    return "held"


# ---- 3. uid --------------------------------------------------------------------------------------


def _uid(c: Containment) -> str:
    if os.geteuid() != 0:
        return "skipped: not root" if c.uid is not None else "skipped: no uid given"
    if c.uid is None:
        if machine() not in SYSCALLS:
            return f"skipped: no uid given, capabilities kept (no syscall numbers for {machine()})"
        # Root keeps uid 0 but no capability: with CAP_PERFMON or CAP_SYS_ADMIN it reads other
        # processes' maps and environ past Landlock on some kernels (6.18 here).
        _drop_capabilities()
        return "held (stays root, no capabilities: this thread and those it starts)"
    # Real, effective and saved ids, on every thread (glibc signals each): none keeps root, and
    # leaving uid 0 clears the capabilities.
    os.setgroups([])
    os.setresgid(c.uid, c.uid, c.uid)
    os.setresuid(c.uid, c.uid, c.uid)
    return f"held (uid {c.uid}, gid {c.uid})"


_PR_CAPBSET_DROP = 24
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _drop_capabilities() -> None:
    """Empty the calling thread's bounding, effective, permitted and inheritable sets (threads
    it starts later inherit them; capabilities are per thread)."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except OSError:
        last = 63
    for cap in range(last + 1):
        try:
            prctl(_PR_CAPBSET_DROP, cap)
        except OSError as e:
            if e.errno != errno.EINVAL:  # a capability this kernel does not know
                raise
    header = ctypes.create_string_buffer(struct.pack("=Ii", _LINUX_CAPABILITY_VERSION_3, 0), 8)
    data = ctypes.create_string_buffer(24)  # two of {effective, permitted, inheritable}, all 0
    syscall(SYSCALLS[machine()]["capset"], header, data)


# ---- 4. landlock ---------------------------------------------------------------------------------

# The same numbers on x86_64 and aarch64.
_LANDLOCK_CREATE_RULESET = 444
_LANDLOCK_ADD_RULE = 445
_LANDLOCK_RESTRICT_SELF = 446
_LANDLOCK_CREATE_RULESET_VERSION = 1 << 0
_LANDLOCK_RULE_PATH_BENEATH = 1
_LANDLOCK_RESTRICT_SELF_TSYNC = 1 << 3  # ABI 8

_FS_EXECUTE = 1 << 0
_FS_WRITE_FILE = 1 << 1
_FS_READ_FILE = 1 << 2
_FS_READ_DIR = 1 << 3
_FS_MAKE_CHAR = 1 << 6
_FS_MAKE_BLOCK = 1 << 11
_FS_ABI1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM
_FS_REFER = 1 << 13  # ABI 2
_FS_TRUNCATE = 1 << 14  # ABI 3
_FS_IOCTL_DEV = 1 << 15  # ABI 5
#: The rights a rule on a file (not a folder) may name.
_FS_FILE = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV
_FS_READ = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
#: Everything but making device nodes: with CAP_MKNOD, a node for the disk in a writable folder
#: mounted without ``nodev`` would reach any file.
_FS_WRITE = ~(_FS_MAKE_CHAR | _FS_MAKE_BLOCK)
_NET_BIND_TCP = 1 << 0  # ABI 4
_NET_CONNECT_TCP = 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
_SCOPE_SIGNAL = 1 << 1


def _landlock(c: Containment) -> str:
    if machine() not in SYSCALLS:
        return f"unavailable: no syscall numbers for {machine()}"
    try:
        abi = syscall(_LANDLOCK_CREATE_RULESET, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    except OSError as e:
        if e.errno == errno.ENOSYS:
            return "unavailable: the kernel has no Landlock"
        if e.errno == errno.EOPNOTSUPP:
            return "unavailable: Landlock is not enabled (the kernel's lsm= list)"
        raise
    # Handle (deny unless a rule allows) every right this ABI knows, and only those: a newer bit
    # is an EINVAL on an older kernel.
    fs = _FS_ABI1
    fs |= _FS_REFER if abi >= 2 else 0
    fs |= _FS_TRUNCATE if abi >= 3 else 0
    fs |= _FS_IOCTL_DEV if abi >= 5 else 0
    net = _NET_BIND_TCP | _NET_CONNECT_TCP if abi >= 4 else 0  # and no rule: no TCP at all
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8  # struct landlock_ruleset_attr as of that ABI
    attr = ctypes.create_string_buffer(struct.pack("=QQQ", fs, net, scoped)[:size], size)
    prctl(PR_SET_NO_NEW_PRIVS, 1)  # landlock_restrict_self needs it without CAP_SYS_ADMIN
    ruleset = syscall(_LANDLOCK_CREATE_RULESET, attr, size, 0)
    try:
        for path in _expand(default_paths() + c.readable):
            _allow(ruleset, path, _FS_READ & fs)
        for path in _expand(c.writable):
            _allow(ruleset, path, _FS_WRITE & fs)
        earlier = 0 if abi >= 8 else _thread_count() - 1
        syscall(_LANDLOCK_RESTRICT_SELF, ruleset, _LANDLOCK_RESTRICT_SELF_TSYNC if abi >= 8 else 0)
    finally:
        os.close(ruleset)
    what = ["fs"] + (["net"] if net else []) + (["signals"] if scoped else [])
    note = f"; not the {earlier} threads started before" if earlier else ""
    return f"held (ABI {abi}: {', '.join(what)}{note})"


def _allow(ruleset: int, path: str, access: int) -> None:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            access &= _FS_FILE  # a folder's rights on a file are an EINVAL
        if access:
            # struct landlock_path_beneath_attr is packed: u64 allowed_access, s32 parent_fd.
            rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd), 12)
            syscall(_LANDLOCK_ADD_RULE, ruleset, _LANDLOCK_RULE_PATH_BENEATH, rule, 0)
    finally:
        os.close(fd)


def _expand(paths: Iterable[str]) -> list[str]:
    found: list[str] = []
    for path in paths:
        if any(ch in path for ch in "*?["):
            found += sorted(glob.glob(path))
        elif os.path.exists(path):
            found.append(path)
    return list(dict.fromkeys(found))


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


# ---- 5. seccomp ----------------------------------------------------------------------------------


def _seccomp(c: Containment) -> str:
    return syscall_filter.install()


_LAYERS: dict[str, Callable[[Containment], str]] = {
    "rlimits": _rlimits,
    "dumpable": _dumpable,
    "uid": _uid,
    "landlock": _landlock,
    "seccomp": _seccomp,
}
