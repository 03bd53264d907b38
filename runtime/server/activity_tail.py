"""The GPU activity files of the server's directory, read as the injection library appends to
them: whole chunks only, each once, with the bytes read given back to the disk.

The CUPTI injection library (``collectors/gpu_activity/injection.c``) appends checksummed chunks
to one file per process (``collectors/gpu_activity/activity_file.py``); a server runs for weeks,
so its reader (:class:`FileSource`, the live source of
:class:`~gpu_trace.runtime.server.device_activity.DeviceActivity`) follows the file instead of
reading it once at the end as ``gpu-trace record``'s ingest does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from gpu_trace.collectors.gpu_activity.activity_file import ActivityData

log = logging.getLogger(__name__)


@dataclass
class _Tail:
    """How far one activity file has been read, and what its earlier chunks said."""

    offset: int = 0
    names: dict[int, str] = field(default_factory=dict)
    anchors: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))


class FileSource:
    """The activity files of a directory (``<dir>/spool/gpu_activity-*.bin``), read as they grow.

    The injection library appends whole chunks to one file per process; each read takes the
    chunks complete since the last one (a chunk being written is left for the next read) and
    parses them with the file format's own reader. ``flush``, when given, is called first on a
    read that asks for it (CUPTI hands over the buffers it holds; the library also flushes every
    ``GPU_TRACE_FLUSH_INTERVAL`` seconds on its own). The bytes read are given back to the file
    system (a hole punched where they were), so a server that runs for weeks does not fill its
    disk with records it has already sent.
    """

    def __init__(self, directory: str | Path, flush: Callable[[], None] | None = None) -> None:
        self.directory = Path(directory)
        self.flush = flush
        self._tails: dict[Path, _Tail] = {}
        self.problems: list[str] = []

    @property
    def spool(self) -> Path:
        return self.directory / "spool"

    def read_new(self, flush: bool = False) -> list[ActivityData]:
        from gpu_trace.collectors.gpu_activity import activity_file

        if flush and self.flush is not None:
            try:
                self.flush()
            except Exception:  # a flush that fails only delays the records
                log.debug("gpu-trace serve: flushing GPU activity failed", exc_info=True)
        out = []
        for path in activity_file.activity_files(self.spool):
            data = self._read(path)
            if data is not None:
                out.append(data)
        return out

    def close(self) -> None:
        """Remove the files read (their records have gone out) and the directory if empty."""
        for path in self._tails:
            with contextlib.suppress(OSError):
                path.unlink()
        for d in (self.spool, self.directory):
            with contextlib.suppress(OSError):
                d.rmdir()

    def _read(self, path: Path) -> ActivityData | None:
        from gpu_trace.collectors.gpu_activity import activity_file

        tail = self._tails.setdefault(path, _Tail())
        if tail.offset < 0:  # not an activity file: said once
            return None
        try:
            with open(path, "rb") as f:
                f.seek(tail.offset)
                blob = f.read()
        except OSError as exc:
            self.problems.append(f"{path.name}: unreadable ({exc})")
            return None
        start = len(activity_file.MAGIC) if tail.offset == 0 else 0
        if tail.offset == 0 and not blob.startswith(activity_file.MAGIC):
            if len(blob) >= len(activity_file.MAGIC):
                self.problems.append(f"{path.name}: not a GPU activity file (bad magic)")
                tail.offset = -1  # never read again
            return None
        end = _complete(blob, start, activity_file.HEADER.size, activity_file.HEADER.unpack_from)
        if end == start:
            return None
        _punch(path, tail.offset, end)
        tail.offset += end
        data = _parse(activity_file.MAGIC + blob[start:end], path.name)
        self.problems.extend(data.problems)
        data.problems = []
        tail.names.update(data.names)
        if len(data.anchors):
            tail.anchors = np.concatenate([tail.anchors, data.anchors])
        data.names, data.anchors = dict(tail.names), tail.anchors
        return data


def _punch(path: Path, offset: int, length: int) -> None:
    """Free the disk blocks of bytes already read (``fallocate``'s punch-hole; the file keeps
    its size and the library its offsets). Best effort: where the file system cannot, the file
    only keeps its size."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fd = os.open(path, os.O_WRONLY)
        try:
            punch_hole, keep_size = 0x02, 0x01
            libc.fallocate(fd, punch_hole | keep_size, ctypes.c_long(offset), ctypes.c_long(length))
        finally:
            os.close(fd)
    except (OSError, AttributeError, TypeError):
        log.debug("gpu-trace serve: could not free read GPU activity bytes", exc_info=True)


def _complete(blob: bytes, pos: int, header: int, unpack: Callable) -> int:
    """The end of the last whole chunk in ``blob`` from ``pos``."""
    while pos + header <= len(blob):
        size = unpack(blob, pos)[2]
        if pos + header + size > len(blob):
            break
        pos += header + size
    return pos


def _parse(blob: bytes, name: str) -> ActivityData:
    """Whole chunks read by the format's reader (which reads files: a temporary one)."""
    from gpu_trace.collectors.gpu_activity import activity_file

    with tempfile.TemporaryDirectory(prefix="gpu-trace-activity-") as tmp:
        path = Path(tmp) / name
        path.write_bytes(blob)
        return activity_file.read([path])
