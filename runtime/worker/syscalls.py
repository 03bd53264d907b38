"""The system calls a worker's containment makes, and their numbers.

:mod:`gpu_trace.runtime.worker.sandbox` and :mod:`gpu_trace.runtime.worker.syscall_filter` call
the kernel through libc (``syscall``, ``prctl``) with :mod:`ctypes`, and need the numbers of the
syscalls libc has no wrapper for, or that the seccomp filter names: :data:`SYSCALLS`, per machine.
Apart from both, since both use them.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int) -> int:
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def syscall(nr: int, *args: Any) -> int:
    """``syscall(nr, *args)`` through libc; OSError from errno when it returns -1."""
    # Python ints would go as C ints: the syscall's arguments are longs or pointers.
    fn = _libc().syscall
    fn.restype = ctypes.c_long
    cargs = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    return _check(fn(ctypes.c_long(nr), *cargs))


def prctl(option: int, value: int) -> None:
    """``prctl(option, value, 0, 0, 0)``; OSError from errno when it fails."""
    fn = _libc().prctl
    fn.restype = ctypes.c_int
    zero = ctypes.c_ulong(0)
    _check(fn(ctypes.c_int(option), ctypes.c_ulong(value), zero, zero, zero))


PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38


# fork and vfork exist on x86_64 only; everything from pidfd_send_signal (424) on is numbered
# alike everywhere.
_COMMON = {
    "pidfd_send_signal": 424,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_tree": 428,
    "move_mount": 429,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "clone3": 435,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "mount_setattr": 442,
}
#: Syscall numbers by machine, for the calls libc has no wrapper for and those the filter names.
SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "seccomp": 317,
        "capset": 126,
        "socket": 41,
        "clone": 56,
        "fork": 57,
        "vfork": 58,
        "execve": 59,
        "execveat": 322,
        "kill": 62,
        "tkill": 200,
        "tgkill": 234,
        "rt_sigqueueinfo": 129,
        "rt_tgsigqueueinfo": 297,
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "kcmp": 312,
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "chroot": 161,
        "unshare": 272,
        "setns": 308,
        "keyctl": 250,
        "add_key": 248,
        "request_key": 249,
        "bpf": 321,
        "perf_event_open": 298,
        "userfaultfd": 323,
        "init_module": 175,
        "finit_module": 313,
        "delete_module": 176,
        "kexec_load": 246,
        "kexec_file_load": 320,
        **_COMMON,
    },
    "aarch64": {
        "seccomp": 277,
        "capset": 91,
        "socket": 198,
        "clone": 220,
        "execve": 221,
        "execveat": 281,
        "kill": 129,
        "tkill": 130,
        "tgkill": 131,
        "rt_sigqueueinfo": 138,
        "rt_tgsigqueueinfo": 240,
        "ptrace": 117,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "kcmp": 272,
        "mount": 40,
        "umount2": 39,
        "pivot_root": 41,
        "chroot": 51,
        "unshare": 97,
        "setns": 268,
        "keyctl": 219,
        "add_key": 217,
        "request_key": 218,
        "bpf": 280,
        "perf_event_open": 241,
        "userfaultfd": 282,
        "init_module": 105,
        "finit_module": 273,
        "delete_module": 106,
        "kexec_load": 104,
        "kexec_file_load": 294,
        **_COMMON,
    },
}


def machine() -> str:
    """This machine's architecture as :data:`SYSCALLS` names it (``x86_64``, ``aarch64``)."""
    return os.uname().machine
