"""The timeline's reads as the dashboard asks them: :mod:`gpu_trace.query`'s, kept per run.

A stored run does not change, so what a run's windows are answered from (its row, overview,
tracks, the overview cells' rows, steps, counter names, clock offsets) is read once and kept in
the :class:`~gpu_trace.dashboard.readonly_store.ReadOnlyStore`'s cache; the windows, counters,
flows and span details themselves are read per request (:mod:`gpu_trace.query.windows`,
:mod:`gpu_trace.query.series`, :mod:`gpu_trace.query.relatives`). No SQL is written here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpu_trace.dashboard.readonly_store import ReadOnlyStore
from gpu_trace.query import overview, reads, relatives, series, windows
from gpu_trace.query import timeline_tracks as run_tracks
from gpu_trace.query.relatives import MAX_FLOWS, Flows, SpanDetail, StepCounterpart
from gpu_trace.query.series import CounterPoint, CounterSeries
from gpu_trace.query.timeline_tracks import MAX_LEVELS, OverviewRows, TrackInfo, Tracks, track_rows
from gpu_trace.query.windows import (
    BUCKET_PX,
    MAX_BARS,
    MAX_PINNED_KINDS,
    PINS_PER_ROW,
    Window,
)

__all__ = [
    "BUCKET_PX",
    "MAX_BARS",
    "MAX_FLOWS",
    "MAX_LEVELS",
    "MAX_PINNED_KINDS",
    "PINS_PER_ROW",
    "TrackInfo",
    "Tracks",
    "Window",
    "clock_sync",
    "counter_series",
    "counters",
    "flows",
    "prepare",
    "prepare_zoom",
    "prepared",
    "run",
    "same_range_in_steps",
    "span",
    "steps_extent",
    "track_rows",
    "tracks",
    "window",
]


def run(source: ReadOnlyStore, run_id: str) -> dict[str, Any]:
    """The run's row with its counts (cached: an ingested run does not change)."""
    return source.cached(("run", run_id), lambda: reads.run(source, run_id))


def _overview(source: ReadOnlyStore, run_id: str, cells: int = overview.CELLS) -> overview.Overview:
    """The run's overview in ``cells`` cells (kept)."""

    def compute() -> overview.Overview:
        r = run(source, run_id)
        return overview.overview(
            source, run_id, int(r["started_ns"]), int(r["ended_ns"] or 0), cells
        )

    key = ("overview", run_id) if cells == overview.CELLS else ("overview", run_id, cells)
    return source.cached(key, compute)


def _overview_rows(source: ReadOnlyStore, run_id: str, cells: int = overview.CELLS) -> OverviewRows:
    """Timeline rows of the overview's grid cells and long spans (once per run and grid)."""
    key = ("overview_rows", run_id) if cells == overview.CELLS else ("overview_rows", run_id, cells)
    return source.cached(
        key,
        lambda: run_tracks.overview_rows(
            _overview(source, run_id, cells), tracks(source, run_id)["tracks"]
        ),
    )


def steps_extent(source: ReadOnlyStore, run_id: str) -> tuple[int, int, int] | None:
    """:func:`gpu_trace.query.windows.steps_extent`, cached per run."""
    return source.cached(("steps_extent", run_id), lambda: windows.steps_extent(source, run_id))


def prepare(source: ReadOnlyStore, run_id: str) -> Tracks:
    """Read what a run's first figure is answered from, once: the coarse overview (one grouped
    scan, :data:`~gpu_trace.query.overview.COARSE_CELLS`), the tracks, and the timeline row of
    each of its cells. Returns the tracks. (The fine overview is read when a window first needs
    it: one zoomed in by more than the coarse grid's cells allow, less than the store's path.)"""
    found = tracks(source, run_id)
    _overview_rows(source, run_id, overview.COARSE_CELLS)
    return found


def prepare_zoom(source: ReadOnlyStore, run_id: str) -> None:
    """Read the fine overview and its rows ahead of the first zoom that needs them (a window
    zoomed in past the coarse grid's cells): ``gpu-trace ui``'s background threads call it once
    a run's first figure is drawn, so that zoom is quick too."""
    _overview_rows(source, run_id)


def prepared(source: ReadOnlyStore, run_id: str) -> bool:
    """Whether :func:`prepare` (or a first window) has read this run: its tracks and a grid's
    rows (its first windows are then quick)."""
    return ("tracks", run_id) in source.cache and (
        ("overview_rows", run_id, overview.COARSE_CELLS) in source.cache
        or ("overview_rows", run_id) in source.cache
    )


def tracks(source: ReadOnlyStore, run_id: str) -> Tracks:
    """:func:`gpu_trace.query.timeline_tracks.tracks`, cached per run: of the overview read already,
    else the coarse one (every span is counted in either grid, so the tracks are the same)."""

    def compute() -> Tracks:
        fine = source.cache.get(("overview", run_id))
        found = fine if fine is not None else _overview(source, run_id, overview.COARSE_CELLS)
        return run_tracks.tracks(source, run_id, found)

    return source.cached(("tracks", run_id), compute)


def window(source: ReadOnlyStore, run_id: str, t0: int, t1: int, width_px: int = 1600) -> Window:
    """:func:`gpu_trace.query.windows.window` of the run's kept overview and tracks: the coarse
    overview where the window's buckets are at least its cell wide, the fine one where they are
    at least the fine cell wide (read at the first such window), else the store."""
    r = run(source, run_id)
    start, end = int(r["started_ns"]), int(r["ended_ns"] or 0)
    bucket = windows.bucket_size(int(t0), int(t1), width_px)
    cells = overview.COARSE_CELLS
    if overview.cell_size(start, end, cells) > bucket >= overview.cell_size(start, end):
        cells = overview.CELLS
    return windows.window(
        source,
        run_id,
        t0,
        t1,
        width_px,
        _overview(source, run_id, cells),
        tracks(source, run_id),
        lambda: _overview_rows(source, run_id, cells),
    )


def flows(source: ReadOnlyStore, run_id: str, t0: int, t1: int) -> Flows:
    """:func:`gpu_trace.query.relatives.flows` (none read where the run's tracks, when read
    already, hold no server span)."""
    return relatives.flows(source, run_id, t0, t1, source.cache.get(("tracks", run_id)))


def counter_series(source: ReadOnlyStore, run_id: str) -> list[CounterSeries]:
    """Counter metrics of a run: source, metric, samples (cached per run)."""
    return source.cached(("counter_series", run_id), lambda: series.counter_series(source, run_id))


def counters(
    source: ReadOnlyStore, run_id: str, metrics: list[str], t0: int, t1: int, width_px: int = 1600
) -> dict[str, list[CounterPoint]]:
    """:func:`gpu_trace.query.series.counters`."""
    return series.counters(source, run_id, metrics, t0, t1, width_px)


def clock_sync(source: ReadOnlyStore, run_id: str) -> list[dict[str, Any]]:
    """Clock-offset measurements of a run (remote hosts): ``peer, ts_ns, offset_ns,
    uncertainty_ns`` (cached per run)."""
    return source.cached(("clock", run_id), lambda: reads.clock_sync(source, run_id))


def span(
    source: ReadOnlyStore, run_id: str, span_id: str, start_ns: int | None = None
) -> SpanDetail | None:
    """:func:`gpu_trace.query.relatives.span`."""
    return relatives.span(source, run_id, span_id, start_ns)


def same_range_in_steps(
    source: ReadOnlyStore, run_id: str, s: Mapping[str, Any]
) -> list[StepCounterpart]:
    """:func:`gpu_trace.query.relatives.same_range_in_steps`."""
    return relatives.same_range_in_steps(source, run_id, s)
