"""The traced processes: a root process and its descendants, found with psutil.

Both samplers attribute what they read to the run's processes: the host sampler their CPU and
RSS, the NVML sampler their GPU memory. The set is refreshed at most every ``refresh_s``, since
walking the process table costs far more than one sample. A process that exits simply leaves the
set; nothing here raises.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import psutil

log = logging.getLogger(__name__)


class ProcessTree:
    """The pids of ``root`` and its descendants, cached for ``refresh_s`` seconds.

    Walking /proc for descendants costs ~2 ms of CPU here, more than a whole sample, hence the
    cache: a new process is attributed within a second.
    """

    def __init__(
        self,
        root: int | None = None,
        *,
        refresh_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._root = root
        self.refresh_s = refresh_s
        self.clock = clock
        self._lock = threading.Lock()
        self._pids: frozenset[int] = frozenset()
        self._at = float("-inf")

    @property
    def root(self) -> int | None:
        return self._root

    @root.setter
    def root(self, pid: int | None) -> None:
        with self._lock:
            self._root = pid
            self._at = float("-inf")

    def pids(self) -> frozenset[int]:
        """The root (while it lives) and every live descendant; empty when there is no root."""
        with self._lock:
            now = self.clock()
            if now - self._at >= self.refresh_s:
                self._pids = _walk(self._root)
                self._at = now
            return self._pids

    def labels(self, pid: int) -> dict[str, str] | None:
        """Attribution of ``pid``: ``{"pid": ...}`` for one of ours, None for anyone else's."""
        return {"pid": str(pid)} if pid in self.pids() else None


def _walk(root: int | None) -> frozenset[int]:
    if root is None:
        return frozenset()
    try:
        proc = psutil.Process(root)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return frozenset()
        children = proc.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return frozenset()
    except Exception:  # psutil on an odd platform: attribution is lost, the run is not
        log.debug("gpu-trace: walking the process tree of %s failed", root, exc_info=True)
        return frozenset()
    return frozenset([root, *(c.pid for c in children if _alive(c))])


def _alive(proc: psutil.Process) -> bool:
    """False for a process that exited but was not reaped yet (a zombie): it is gone for us."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
