"""The op a worker is running, where the front can read it after the worker died.

A crash inside a kernel (SIGSEGV, SIGFPE, an abort) ends the worker before any Python runs, so
the worker says what it runs before it runs it: one shared page (``memfd``, mapped by both
sides), written by the worker's executor before each op and read by the front only once the
worker is gone. A write is one slice assignment of a name encoded once per op name; the front
never trusts what it reads beyond printing it (a compromised worker may write anything there).
"""

from __future__ import annotations

import contextlib
import mmap
import os

#: Bytes of an op name kept (longer names are cut).
NAME_BYTES = 120
_SIZE = 8 + NAME_BYTES
_IDLE = bytes(_SIZE)


class Beacon:
    """One worker's page: :meth:`mark` (the worker) and :meth:`read` (the front)."""

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            fd = os.memfd_create("gpu-trace-beacon", os.MFD_CLOEXEC)
            os.ftruncate(fd, mmap.PAGESIZE)
        self.fd = fd
        self._map = mmap.mmap(fd, mmap.PAGESIZE)
        self._names: dict[str, bytes] = {}

    def mark(self, name: str) -> None:
        """Say that op ``name`` runs now."""
        b = self._names.get(name)
        if b is None:
            raw = name.encode("utf-8", "replace")[:NAME_BYTES]
            b = self._names[name] = len(raw).to_bytes(8, "little") + raw.ljust(NAME_BYTES, b"\0")
        self._map[0:_SIZE] = b

    def idle(self) -> None:
        """Say that nothing runs (between batches)."""
        self._map[0:_SIZE] = _IDLE

    def read(self) -> str:
        """The op last marked ("" if none), as printable text."""
        n = min(int.from_bytes(self._map[0:8], "little"), NAME_BYTES)
        text = self._map[8 : 8 + n].decode("utf-8", "replace")
        return "".join(c if c.isprintable() else "?" for c in text)

    def close(self) -> None:
        self._map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)
