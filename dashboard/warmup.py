"""Reading a run ahead of its first view, on a background thread of ``gpu-trace ui``.

The page's first figure of a run is drawn from the run's coarse overview and tracks
(:func:`~gpu_trace.dashboard.timeline.prepare`): for a 10M-span run a grouped scan of one to two
seconds here. ``gpu-trace ui`` reads it ahead for the run its page opens on (the newest, or the
one it was given), with the fine overview its zooms need after it; and while the page stays open,
for each run stored meanwhile, as soon as the page's periodic check sees the store's runs change
(``callbacks.list_runs``): a run recorded while the viewer is open, the usual way to try change
after change, is then drawn from what was read ahead when it is clicked.

One :class:`Warmer` per dashboard, one thread at a time: a run wanted while another is read waits
for it, and of several wanted meanwhile only the newest wish is kept (a job's ranks ingesting one
after the other read the job's run once). A run read already is not read again. A failure is the
page's to report: logged at debug level here.
"""

from __future__ import annotations

import logging
import threading

from gpu_trace.dashboard import timeline
from gpu_trace.dashboard.readonly_store import ReadOnlyStore
from gpu_trace.query import reads

log = logging.getLogger(__name__)


def warm(source: ReadOnlyStore, run: str | None = None, zoom: bool = True) -> None:
    """Read run ``run`` (``last`` by default) ahead of its first page: its coarse overview and
    tracks, then with ``zoom`` what its zooms need (the fine overview). Never raises."""
    try:
        run_id = reads.resolve_run(source, run or "last")
        if not timeline.prepared(source, run_id):
            timeline.prepare(source, run_id)
        if zoom:
            timeline.prepare_zoom(source, run_id)
    except Exception as exc:  # the page shows store errors; nothing to do here
        log.debug("gpu-trace: reading a run ahead for the dashboard failed: %s", exc)


class Warmer:
    """Runs :func:`warm` for the runs wanted, one at a time, on a thread of its own."""

    def __init__(self, source: ReadOnlyStore) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._wanted: tuple[str | None, bool] | None = None
        self._thread: threading.Thread | None = None

    def want(self, run: str | None = None, zoom: bool = False) -> None:
        """Read ``run`` (``last`` when None: resolved when its turn comes) ahead; returns at
        once."""
        with self._lock:
            self._wanted = (run, zoom)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="gpu-trace-ui-warm", daemon=True
                )
                self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is wanted or being read; False if ``timeout`` passed first."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _loop(self) -> None:
        while True:
            with self._lock:
                job, self._wanted = self._wanted, None
                if job is None:
                    self._thread = None
                    return
            warm(self.source, *job)
