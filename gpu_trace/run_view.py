"""A stored run, read from Python: ``gpu_trace.runs()``, ``gpu_trace.run("last")``, :class:`Run`.

What `gpu-trace ls`, `show`, `sql` and `export` and the dashboard's timeline give on a terminal or
in a browser, as pandas DataFrames and a plotly figure for a notebook, from the same code: the
store's reads (``query/``: runs, the per-lane summary, forwarding, the timeline's windows), its
read-only SQL (``store/guard.py``), the timeline figure the dashboard draws too (``plots/``), the
exporter seam. Nothing of the CLI or the dashboard is imported.

Each call opens the store, reads and closes it again: an embedded chDB store is locked to one
process while it is open, and a notebook that held it would lock `gpu-trace ls` out. Times are
integer nanoseconds on the run's clock (CLOCK_MONOTONIC of the recording host, the ``start_ns``
columns), with relative milliseconds since the run started beside them for reading. pandas and
plotly come with the ``ui`` extra.
"""

from __future__ import annotations

import contextlib
import html
import logging
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from gpu_trace import _format as fmt
from gpu_trace import config
from gpu_trace._summary_text import SAMPLER_NOTE
from gpu_trace.query import frames, reads
from gpu_trace.query.distributed import (
    CollectiveCall,
    RankStats,
    RankSummary,
    collective_calls,
    rank_summary,
)
from gpu_trace.query.rank_time import RankStep
from gpu_trace.query.series import drawable as _drawable
from gpu_trace.query.summary import RangeStats, RunSummary

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

    from gpu_trace.store.client import Store

log = logging.getLogger(__name__)

#: Rows :meth:`Run.spans` returns unless told otherwise.
SPAN_LIMIT = 100_000


def _pd() -> ModuleType:
    """pandas, or an ImportError naming the extra that brings it."""
    try:
        import pandas
    except ImportError:
        raise ImportError(
            "reading runs as DataFrames needs pandas: pip install 'gpu-trace[ui]'"
        ) from None
    return pandas


def _frame(rows: list[dict[str, object]], columns: list[str]) -> pd.DataFrame:
    return _pd().DataFrame(rows, columns=columns)


@contextlib.contextmanager
def _opened(dsn: str) -> Iterator[Store]:
    from gpu_trace.store.client import Store

    with Store(dsn, reading=True) as store:  # a read-only store is read as `ls` reads it
        yield store


def _window(start: int | None, end: int | None) -> None:
    for what, value in (("start", start), ("end", end)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(
                f"{what} is an integer ns on the run's clock (a start_ns value), got {value!r}"
            )
    if start is not None and end is not None and end <= start:
        raise ValueError(f"empty window: end ({end}) is not after start ({start})")


@dataclass(frozen=True)
class RunRow:
    """A run's row in the store: what `gpu-trace ls` shows of it."""

    run_id: str
    trace_id: str
    started_ns: int
    ended_ns: int
    command: str
    hosts: list[str]
    status: str
    attrs: dict[str, str]
    spans: int
    counters: int

    @classmethod
    def of(cls, row: Mapping[str, object]) -> RunRow:
        def num(key: str) -> int:
            value = row.get(key)
            return int(value) if isinstance(value, (int, float, str)) and value != "" else 0

        hosts = row.get("hosts")
        attrs = row.get("attrs")
        return cls(
            run_id=str(row["run_id"]),
            trace_id=str(row.get("trace_id", "")),
            started_ns=num("started_ns"),
            ended_ns=num("ended_ns"),
            command=str(row.get("command", "")),
            hosts=[str(h) for h in hosts] if isinstance(hosts, list) else [],
            status=str(row.get("status", "")),
            attrs={str(k): str(v) for k, v in attrs.items()} if isinstance(attrs, dict) else {},
            spans=num("spans"),
            counters=num("counters"),
        )

    @property
    def duration_ns(self) -> int | None:
        return self.ended_ns - self.started_ns if self.ended_ns else None


@dataclass
class Summary:
    """A run's summary as DataFrames: the numbers `gpu-trace show` prints (``text``), from one
    :class:`~gpu_trace.query.summary.RunSummary` (``data``; docs/cli.md, "show", defines them).

    ``step_stats``: per step kind, count, p50, p90, mean and max step time; ``steps``: each step;
    ``lanes``: spans, busy time (the union of the lane's spans: nested time counted once) and its
    share of the run; ``by_total``/``by_self``: per lane, the top range names by total and by self
    time (a span's duration minus the time its children on its thread cover) with count, median,
    max and share of the run; ``counters``: samples, min, mean, max per metric; ``sampler``: the
    samplers' own metrics (``call_us.<family>``) the same way; ``forwarded``: per forwarded op,
    client, wire, queue and execute time.
    """

    run: RunRow
    data: RunSummary
    step_stats: pd.DataFrame
    steps: pd.DataFrame
    lanes: pd.DataFrame
    by_total: pd.DataFrame
    by_self: pd.DataFrame
    counters: pd.DataFrame
    sampler: pd.DataFrame
    forwarded: pd.DataFrame
    text: str = field(repr=False, default="")

    def __repr__(self) -> str:
        text = self.text
        if len(self.forwarded):
            text += "\n\nforwarded ops:\n" + self.forwarded.to_string(index=False)
        return text

    def _repr_html_(self) -> str:
        parts = [f"<h4>run {html.escape(self.run.run_id)}</h4>"]
        if len(self.step_stats):
            parts.append(
                "<p><b>step times</b></p>" + _durations(self.step_stats).to_html(index=False)
            )
        for lane in self.lanes.itertuples(index=False):
            top = self.by_total[self.by_total["lane"] == lane.lane]
            shown = _durations(
                top[["name", "count", "total_ns", "self_ns", "median_ns", "max_ns", "share"]]
            )
            parts.append(
                f"<p><b>{html.escape(str(lane.lane))}</b> ({fmt.count(int(lane.spans))} spans, "
                f"{fmt.duration(int(lane.busy_ns))} busy, {100 * float(lane.share):.1f}% of the "
                "run)</p>"
            )
            parts.append(shown.to_html(index=False))
        if len(self.counters):
            parts.append("<p><b>counters</b></p>" + self.counters.to_html(index=False))
        if len(self.sampler):
            parts.append(
                f"<p><b>{html.escape(SAMPLER_NOTE)}</b></p>" + self.sampler.to_html(index=False)
            )
        if len(self.forwarded):
            parts.append(
                "<p><b>forwarded ops</b></p>" + _durations(self.forwarded).to_html(index=False)
            )
        return "\n".join(parts)


def _durations(df: pd.DataFrame) -> pd.DataFrame:
    """``*_ns`` columns as durations for reading (a copy, named without ``_ns``)."""
    out = df.copy()
    for col in [c for c in out.columns if str(c).endswith("_ns")]:
        out[str(col)[:-3]] = [fmt.duration(int(v)) for v in out.pop(col)]
    return out


class Run:
    """One run in the store: ``gpu_trace.run("last")``, or the target of ``profile()``'s ``as``.

    ``id``, ``dir`` (the run directory, for a run recorded here), ``notes`` (what was off while
    recording); the stored row is read on first use (``row``). Every read raises ``RuntimeError``
    while the run is still recording, or when it could not be stored (saying how to load it).
    """

    def __init__(
        self,
        run_id: str,
        dsn: str | None = None,
        *,
        run_dir: Path | None = None,
        notes: list[str] | None = None,
        recording: bool = False,
    ) -> None:
        self.id = run_id
        self.dsn = config.store_dsn(dsn)
        self.dir = run_dir
        self.notes = list(notes or [])
        self._recording = recording
        self._problem: str | None = None
        self._row: RunRow | None = None

    def end_recording(self, problem: str | None) -> None:
        """Called by ``profile()`` when its block has ended: stored (``problem`` None), or not and
        why (the reads then raise it)."""
        self._recording, self._problem, self._row = False, problem, None

    def _check(self) -> None:
        if self._recording:
            raise RuntimeError(
                f"run {self.id} is still recording: read it once its profile() block has ended"
            )
        if self._problem:
            raise RuntimeError(f"run {self.id} is {self._problem}")

    @property
    def row(self) -> RunRow:
        """The run's row in the store (read once: a stored run does not change)."""
        self._check()
        if self._row is None:
            with _opened(self.dsn) as store:
                self._row = RunRow.of(reads.run(store, self.id))
        return self._row

    # ---- tables ---------------------------------------------------------------------------------

    def summary(self, top: int = 20) -> Summary:
        """Step-time distributions, lanes, top ranges by total and self time per lane, counters,
        the samplers' own metrics, forwarded ops."""
        from gpu_trace._summary_text import render_summary
        from gpu_trace.query.summary import run_summary, step_times

        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise ValueError(f"top must be a positive int, got {top!r}")
        row = self.row
        with _opened(self.dsn) as store:
            run = reads.run(store, self.id)
            data = run_summary(store, self.id, top=top)
            forwarding = reads.forwarding(store, self.id, top=top)
            steps = step_times(store, self.id)
        ranked = ["lane", "name", "category", "count", "total_ns", "self_ns", "median_ns",
                  "mean_ns", "max_ns", "share"]  # fmt: skip

        def ranges(rows: list[RangeStats]) -> list[dict[str, object]]:
            return [{**asdict(r), "mean_ns": r.mean_ns} for r in rows]

        lanes = [{"lane": lane.lane, "spans": lane.spans, "busy_ns": lane.busy_ns,
                  "share": lane.share} for lane in data.lanes]  # fmt: skip
        for s in steps:
            s["start_ms"] = (int(s["start_ns"]) - row.started_ns) / 1e6
            s["dur_ms"] = int(s["dur_ns"]) / 1e6
        counter_columns = ["host", "source", "device", "metric", "count", "min", "mean", "max"]
        return Summary(
            run=row,
            data=data,
            step_stats=_frame(
                [asdict(s) for s in data.steps],
                ["kind", "count", "p50_ns", "p90_ns", "mean_ns", "max_ns"],
            ),
            steps=_frame(
                steps, ["name", "pid", "index", "start_ns", "dur_ns", "start_ms", "dur_ms"]
            ),
            lanes=_frame(lanes, ["lane", "spans", "busy_ns", "share"]),
            by_total=_frame([r for lane in data.lanes for r in ranges(lane.ranges)], ranked),
            by_self=_frame([r for lane in data.lanes for r in ranges(lane.by_self)], ranked),
            counters=_frame([asdict(c) for c in data.counters], counter_columns),
            sampler=_frame([asdict(c) for c in data.sampler], counter_columns),
            forwarded=_frame(
                forwarding["ops"],
                ["name", "count", "client_ns", "wire_ns", "queue_ns", "execute_ns"],
            ),
            text=render_summary(run, data),
        )

    def ranks(self) -> pd.DataFrame:
        """One row per rank of a distributed run (empty for a run without ranks): its process,
        host, busy time, collectives, the waiting it did (``waited_ns``), how often it entered a
        collective last and the waiting that caused (``entered_last``, ``caused_ns``: sorted by
        them, the straggler ranking), and sums over its steps of step time, computation,
        communication, their overlap and idle time (docs/distributed.md defines each)."""
        rows = [asdict(r) for r in self._rank_summary().ranks]
        return _frame(rows, list(RankStats.__dataclass_fields__))

    def rank_steps(self) -> pd.DataFrame:
        """One row per step of each rank (its own process's steps, ``step`` numbering them in
        time order from 0): ``step_ns``, ``compute_ns``, ``comm_ns``, ``overlap_ns``, ``idle_ns``,
        where ``compute_ns + comm_ns - overlap_ns + idle_ns == step_ns``; empty without ranks."""
        rows = [asdict(s) for s in self._rank_summary().steps]
        return _frame(rows, list(RankStep.__dataclass_fields__))

    def collectives(self) -> pd.DataFrame:
        """One row per rank and collective, in time order (empty without ranks): the
        collective (``op``, ``pg``, ``seq``: the same on every rank's row of it), the rank, when
        it entered and ended (``enter_ns``, ``end_ns``), how long it waited for the last rank to
        enter (``wait_ns``), whether it was that last rank (``last``) and how many ranks took part
        (``ranks``). ``df.groupby(["op", "pg", "seq"])`` gives each collective; the skew is its
        largest ``wait_ns``."""
        self._check()
        with _opened(self.dsn) as store:
            rows = [asdict(c) for c in collective_calls(store, self.id)]
        return _frame(rows, list(CollectiveCall.__dataclass_fields__))

    def compare_ranks(self, a: int, b: int) -> pd.DataFrame:
        """Ranks ``a`` and ``b`` side by side, one row per step (their i-th steps matched):
        each figure of :meth:`rank_steps` as ``<figure>_<a>`` and ``<figure>_<b>``, and
        ``<figure>_diff`` (a's minus b's) for the times. ValueError for a rank the run lacks."""
        for rank in (a, b):
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise ValueError(f"a rank is an int, got {rank!r}")
        if a == b:
            raise ValueError(f"compare two different ranks, got {a} twice")
        summary = self._rank_summary()
        known = [r.rank for r in summary.ranks]
        missing = [r for r in (a, b) if r not in known]
        if missing:
            raise ValueError(
                f"run {self.id} has no rank {missing[0]}; its ranks: {known or 'none'}"
            )
        steps = self.rank_steps()
        times = ["step_ns", "compute_ns", "comm_ns", "overlap_ns", "idle_ns"]
        mine = [steps[steps["rank"] == r].drop(columns="rank") for r in (a, b)]
        out = mine[0].merge(mine[1], on="step", how="outer", suffixes=(f"_{a}", f"_{b}"))
        for col in times:
            out[f"{col}_diff"] = out[f"{col}_{a}"] - out[f"{col}_{b}"]
        return out

    def _rank_summary(self) -> RankSummary:
        self._check()
        with _opened(self.dsn) as store:
            found = rank_summary(store, self.id)
        return found or RankSummary(0, "", "", [], [], None, 0, 0)

    def spans(
        self,
        lane: str | None = None,
        name: str | None = None,
        category: str | None = None,
        start: int | None = None,
        end: int | None = None,
        limit: int | None = SPAN_LIMIT,
    ) -> pd.DataFrame:
        """Spans overlapping ``[start, end)`` (ns on the run's clock), in start order.

        ``lane`` and ``name`` are exact, or globs with ``*`` and ``?`` (``lane="nvtx/*"``);
        ``category`` is exact (``module``, ``op``, ``step``, ``nvtx``...). At most ``limit`` rows
        (None: all); a cut result is logged. Columns: the store's, ``dur_ns``, and ``start_ms``
        and ``dur_ms`` relative to the run's start.
        """
        _window(start, end)
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ValueError(f"limit must be a positive int or None, got {limit!r}")
        for col, value in (("lane", lane), ("name", name), ("category", category)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{col} must be a string, got {type(value).__name__}")
        base = self.row.started_ns
        with _opened(self.dsn) as store:
            table = frames.spans(
                store, self.id, lane=lane, name=name, category=category, start=start, end=end,
                limit=limit,
            )  # fmt: skip
        if limit is not None and table.num_rows >= limit:
            log.warning(
                "gpu-trace: run %s: showing the first %d spans; pass limit=None for all",
                self.id,
                limit,
            )
        _pd()
        df = table.to_pandas()
        df["attrs"] = [dict(a) for a in df["attrs"]]
        df["dur_ns"] = df["end_ns"] - df["start_ns"]
        df["start_ms"] = (df["start_ns"] - base) / 1e6
        df["dur_ms"] = df["dur_ns"] / 1e6
        return df

    def counters(
        self, name: str | None = None, start: int | None = None, end: int | None = None
    ) -> pd.DataFrame:
        """Counter samples in ``[start, end)`` (ns on the run's clock), in time order.

        ``name`` matches ``source/metric`` (``nvml/gpu_util_pct``, ``user/loss``) or the metric
        alone, exactly or as a glob. Columns: the store's, ``series`` (``source/metric``) and
        ``t_ms`` since the run's start.
        """
        _window(start, end)
        if name is not None and not isinstance(name, str):
            raise ValueError(f"name must be a string, got {type(name).__name__}")
        base = self.row.started_ns
        with _opened(self.dsn) as store:
            table = frames.counters(store, self.id, name=name, start=start, end=end)
        _pd()
        df = table.to_pandas()
        df["labels"] = [dict(a) for a in df["labels"]]
        df["series"] = df["source"] + "/" + df["metric"]
        df["t_ms"] = (df["ts_ns"] - base) / 1e6
        return df

    def sql(self, query: str, **parameters: object) -> pd.DataFrame:
        """One read-only query, the rules of `gpu-trace sql` (``SELECT``, ``SHOW``, ``DESCRIBE``
        of the store's tables; anything else is refused with the reason). The database
        ``gpu_trace`` is the default; ``{run_id:String}`` is this run's id; other values go in as
        ``{name:Type}`` parameters given by keyword."""
        from gpu_trace.store.client import StoreError

        if not isinstance(query, str):
            raise ValueError(f"query must be a string, got {type(query).__name__}")
        self._check()
        params = {"run_id": self.id, **parameters}
        with _opened(self.dsn) as store:
            try:
                columns, rows = store.sql(query, parameters=params)
            except StoreError as exc:
                raise ValueError(str(exc)) from None
        return _pd().DataFrame.from_records(rows, columns=columns)

    # ---- pictures and files ---------------------------------------------------------------------

    def timeline(
        self,
        start: int | None = None,
        end: int | None = None,
        *,
        width: int = 1200,
        counters: list[str] | None = None,
        static: bool = False,
    ) -> go.Figure:
        """The dashboard's timeline of ``[start, end)`` (ns on the run's clock; the whole run by
        default) as a plotly Figure, shown inline by Jupyter. ``counters``: ``source/metric``
        names drawn under it (default: up to four of the run's that have samples to draw in the
        window). ``static``: the figure also carries a PNG picture of itself (``figure.png``,
        drawn with matplotlib), shown where plotly's JavaScript is not run (nbconvert's HTML,
        GitHub) while Jupyter still shows the interactive figure."""
        import plotly.graph_objects as go

        from gpu_trace.plots import figures, picture
        from gpu_trace.query import overview, relatives, series, timeline_tracks, windows

        _window(start, end)
        if isinstance(width, bool) or not isinstance(width, int) or not 200 <= width <= 20000:
            raise ValueError(f"width must be an int of pixels in [200, 20000], got {width!r}")
        row = self.row
        t0 = row.started_ns if start is None else start
        t1 = end if end is not None else max(row.ended_ns or t0 + 1, t0 + 1000)
        with _opened(self.dsn) as store:
            run = reads.run(store, self.id)
            names = series.counter_series(store, self.id)
            picked = series.counters_to_draw(
                [f"{c['source']}/{c['metric']}" for c in names], counters
            )
            ov = overview.overview(
                store, self.id, int(run["started_ns"]), int(run["ended_ns"] or 0)
            )
            found = timeline_tracks.tracks(store, self.id, ov)
            win = windows.window(store, self.id, t0, t1, width, ov, found)
            flows = relatives.flows(store, self.id, t0, t1, found)
            lines = series.counters(store, self.id, picked, t0, t1, width)
            clock = [c for c in reads.clock_sync(store, self.id) if t0 <= c["ts_ns"] < t1]
        if counters is None:
            lines = {k: v for k, v in lines.items() if _drawable(v, t0)}
            lines = dict(list(lines.items())[:4])
        figure = figures.timeline(run, found, win, flows, lines, clock, width)
        picture.labels_as_text(figure)
        figure["layout"]["width"] = width
        plotly_figure = go.Figure(figure)
        if not static:
            return plotly_figure
        return picture.figure_with_picture()(plotly_figure, picture.picture(plotly_figure))

    def export(self, path: str | Path, *, rank: int = 0, world_size: int | None = None) -> Path:
        """Write the run as Chrome trace JSON (``.json`` or ``.json.gz``) for Perfetto and HTA,
        as `gpu-trace export` does (``world_size`` defaults to ``rank + 1``); returns the path.
        OSError when it can't be written."""
        from gpu_trace.export.exporter import export_run, get_exporter

        out = Path(path)
        if out.suffix not in (".json", ".gz"):
            raise ValueError(f"export path must end in .json or .json.gz, got {out}")
        if not out.parent.is_dir():
            raise ValueError(f"cannot write {out}: there is no directory {out.parent}")
        self._check()
        with _opened(self.dsn) as store:
            counts = reads.counts(store, self.id)
            exporter = get_exporter(
                "chrome",
                path=out,
                run=reads.run(store, self.id),
                threads=reads.threads(store, self.id),
                total_spans=counts.get("spans"),
                rank=rank,
                world_size=rank + 1 if world_size is None else world_size,
            )
            ok = export_run(
                exporter, reads.iter_spans(store, self.id), reads.iter_counters(store, self.id)
            )
        if not ok:
            reason = getattr(exporter, "error", None) or "the exporter failed"
            raise OSError(f"cannot write {out}: {reason}")
        return out

    # ---- what it is -------------------------------------------------------------------------------

    def _describe(self) -> list[tuple[str, str]]:
        if self._recording:
            return [("status", "recording")]
        if self._problem:
            return [("status", self._problem)]
        try:
            row = self.row
        except Exception as exc:  # a repr never raises
            return [("status", f"unreadable: {exc}")]
        duration = row.duration_ns
        out = [
            (
                "status",
                row.status + (f" ({row.attrs['reason']})" if row.attrs.get("reason") else ""),
            ),
            ("duration", fmt.duration(duration) if duration else "-"),
            ("spans", fmt.count(row.spans)),
            ("counters", fmt.count(row.counters)),
            ("command", row.command),
            ("store", self.dsn),
        ]
        out += [("note", note) for note in self.notes]
        return out

    def __repr__(self) -> str:
        facts = ", ".join(f"{k} {v}" for k, v in self._describe())
        return f"<gpu_trace.Run {self.id}: {facts}>"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th><td style='text-align:left'>"
            f"{html.escape(v)}</td></tr>"
            for k, v in self._describe()
        )
        return f"<b>gpu-trace run {html.escape(self.id)}</b><table>{rows}</table>"


def runs(limit: int = 50, search: str | None = None, store: str | None = None) -> pd.DataFrame:
    """Stored runs, newest first, as a DataFrame (what `gpu-trace ls` lists): ``search`` keeps
    runs whose id, command, status or a host contains it."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    with _opened(config.store_dsn(store)) as opened:
        found = [RunRow.of(r) for r in reads.runs(opened, limit=limit, search=search)]
    rows: list[dict[str, object]] = [
        {
            "run_id": r.run_id,
            "status": r.status,
            "duration_ms": r.duration_ns / 1e6 if r.duration_ns else None,
            "spans": r.spans,
            "counters": r.counters,
            "name": r.attrs.get("name", ""),
            "command": r.command,
            "hosts": ",".join(r.hosts),
            "started_ns": r.started_ns,
        }
        for r in found
    ]
    columns = ["run_id", "status", "duration_ms", "spans", "counters", "name", "command",
               "hosts", "started_ns"]  # fmt: skip
    return _frame(rows, columns)


def run(ref: str = "last", store: str | None = None) -> Run:
    """The stored run ``ref``: an id, a unique prefix of one, or ``last`` (the run stored most
    recently: recorded, imported or ingested). LookupError (naming the recent runs) when there is
    none."""
    if not isinstance(ref, str):
        raise ValueError(f"run() takes a run id, a prefix or 'last', got {type(ref).__name__}")
    dsn = config.store_dsn(store)
    with _opened(dsn) as opened:
        run_id = reads.resolve_run(opened, ref)
        row = RunRow.of(reads.run(opened, run_id))
    found = Run(run_id, dsn)
    found._row = row
    return found
