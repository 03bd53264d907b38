"""The seccomp layer of a worker's containment: a deny-list filter on every thread.

:func:`install` puts a BPF program (:func:`program`) on every thread of the process (``TSYNC``):
no process creation (``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD``, ``execve``;
``clone3`` answers ``ENOSYS``, so glibc uses ``clone`` for threads); no sockets but ``AF_UNIX``;
signals to its own process only; no ``ptrace``, ``process_vm_*``, mounts, namespaces, keyrings,
``bpf``, ``perf_event_open``, ``userfaultfd``, ``io_uring``. Everything else is allowed; a syscall
of a foreign ABI (i386, x32) kills the process. What it complements, and the order the layers
go on in, is :mod:`gpu_trace.runtime.worker.sandbox`'s; this is the filter, instruction by
instruction.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

from gpu_trace.runtime.worker.syscalls import PR_SET_NO_NEW_PRIVS, SYSCALLS, machine, prctl, syscall

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_SYSCALL_BIT = 0x40000000
#: Refused with EPERM, whatever their arguments.
_DENIED = (
    "fork",
    "vfork",
    "execve",
    "execveat",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_getfd",
    "pidfd_send_signal",
    "process_madvise",
    "mount",
    "umount2",
    "mount_setattr",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "pivot_root",
    "chroot",
    "unshare",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    # io_uring does socket and file work without the syscalls this filter sees.
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
)
#: Signals: allowed when the first argument (a pid or tgid) is this process.
_OWN_PID = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")


_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_FILTER_FLAG_TSYNC = 1
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K
# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]. The low 32 bits
# of args[0] (little-endian) hold an int argument whatever the caller left in the upper ones.
_NR, _ARCH, _ARG0 = 0, 4, 16
_AF_UNIX = 1
_CLONE_THREAD = 0x00010000
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET: not even for a thread.
_CLONE_NAMESPACES = 0x7E020000


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def program(arch: str, pid: int) -> bytes:
    """The BPF program for ``arch`` and process ``pid``: a deny-list (see the module's docstring),
    everything else allowed."""
    nrs = SYSCALLS[arch]
    eperm = _op(_RET, _RET_ERRNO | errno.EPERM)
    allow = _op(_RET, _RET_ALLOW)
    prog = [
        _op(_LD_W_ABS, _ARCH),
        _op(_JEQ, _AUDIT_ARCH[arch], 1, 0),
        _op(_RET, _RET_KILL_PROCESS),  # another ABI's numbers would dodge this list
        _op(_LD_W_ABS, _NR),
    ]
    if arch == "x86_64":
        prog += [_op(_JGE, _X32_SYSCALL_BIT, 0, 1), _op(_RET, _RET_KILL_PROCESS)]

    def case(nr: int, block: list[bytes]) -> None:
        # Every path through a block returns, so the next case still sees the number in A.
        prog.append(_op(_JEQ, nr, 0, len(block)))
        prog.extend(block)

    for name in _DENIED:
        if name in nrs:
            case(nrs[name], [eperm])
    case(nrs["clone3"], [_op(_RET, _RET_ERRNO | errno.ENOSYS)])  # its flags are out of reach
    for name in _OWN_PID:
        own = [_op(_LD_W_ABS, _ARG0), _op(_JEQ, pid & 0xFFFFFFFF, 0, 1), allow, eperm]
        case(nrs[name], own)
    case(nrs["socket"], [_op(_LD_W_ABS, _ARG0), _op(_JEQ, _AF_UNIX, 0, 1), allow, eperm])
    thread = [
        _op(_LD_W_ABS, _ARG0),
        _op(_JSET, _CLONE_THREAD, 0, 2),
        _op(_JSET, _CLONE_NAMESPACES, 1, 0),
        allow,
        eperm,
    ]
    case(nrs["clone"], thread)
    prog.append(allow)
    return b"".join(prog)


def install() -> str:
    """Put the filter on every thread; what happened, in :class:`~.sandbox.Contained`'s words."""
    arch = machine()
    if arch not in SYSCALLS or sys.byteorder != "little":
        return f"unavailable: no syscall numbers for {arch}"
    code = program(arch, os.getpid())
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    prctl(PR_SET_NO_NEW_PRIVS, 1)  # a filter needs it without CAP_SYS_ADMIN
    # The seccomp() call, not prctl(PR_SET_SECCOMP): TSYNC puts the filter on every thread (torch
    # and CUDA started some), where prctl would filter the calling thread only.
    try:
        tid = syscall(
            SYSCALLS[arch]["seccomp"],
            _SECCOMP_SET_MODE_FILTER,
            _SECCOMP_FILTER_FLAG_TSYNC,
            ctypes.byref(prog),
        )
    except OSError as e:
        if e.errno == errno.ENOSYS:
            return "unavailable: the kernel has no seccomp()"
        raise
    if tid:
        return f"failed: thread {tid} has a seccomp filter of its own"
    return "held (deny-list, every thread)"
