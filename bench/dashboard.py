"""Dashboard speed on big runs: the first figure of a run against a plain chDB query, window
query + figure build per zoom level, first page load and browser memory in headless Chromium.

    python bench/dashboard.py [--spans 10000000] [--lanes 100] [--rounds 5]
                              [--baseline CHECKOUT] [--no-browser] [--loads N]

Writes two synthetic runs straight into a fresh embedded store as Arrow (no spool, no recorder):
``bench-small`` with a tenth of ``--spans`` and ``bench`` with all of them, both over ``--lanes``
tracks (4 hosts x 5 processes x ``lanes/20`` threads) and the same time span, so the big run is
10x denser. Each track holds back-to-back spans of 1-100 µs at depths 0-2 and one "step" span of
about a second every second.

First figure, ``--rounds`` rounds: each round a fresh process opens the store (nothing of the run
kept yet; the one-time imports a running server has made already are made first) and times
what the dashboard does for a run's first view (``callbacks.open_run``'s
reads): the run's row and steps, the first (uncached) track query with the overview preparation,
the first window (the run's steps, plot width 1270 px) with its flows and counters, and the
figure build with its JSON. Then, in the same process on the same store, the chDB peer: one plain
``GROUP BY`` giving the same level of detail (spans and busy time per track, depth and 3 px bucket
of that window); then what the dashboard reads ahead on its own thread once a first view is out
(the fine overview, ``timeline.prepare_zoom``; nothing where a checkout lacks it); then each zoom
level of the window table below. With ``--baseline CHECKOUT`` (a
directory holding another checkout, e.g. ``git worktree add /tmp/base HEAD~3``), every round runs
that checkout's dashboard code too, interleaved (the order alternating), on the same store:
before/after from one run. Medians and ranges; the ratio to the peer is what compares across
machines.

Then, for this checkout, the window table: for zoom levels from the whole run down to 1/100000 of
it the window query (bars + density), the flow and counter queries and the figure build (with its
JSON, what the server sends), and how many spans were bars and density cells (medians over the
rounds). With Chromium (``/usr/bin/chromium`` and playwright), the first page load (navigation
until the timeline's bars are drawn; when the page's scripts, plotly.js included, had run and when
the layout with the first figure had arrived) on each run, and the page's JS heap after loading and
after zooming, for both runs: the page holds what is on screen, so 10x more spans should not mean
more memory; with ``--loads N``, N-1 more first loads per run after that (a fresh browser context
each), their median and range. No thresholds: figures only, like every bench here (the machine is
shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import checkout
import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUN_NS = 10_000_000_000  # 10 s
CHUNK = 1_000_000
NAMES = [f"aten::op_{i}" for i in range(300)]


def _dict(values: list[str], codes: np.ndarray) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(codes.astype(np.int32)), pa.array(values))


def make_run(store: Any, run_id: str, spans: int, lanes: int, seed: int = 0) -> float:
    """Insert ``spans`` synthetic spans over ``lanes`` tracks; returns seconds taken."""
    from gpu_trace.tracer.run import RunInfo

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    threads = max(1, lanes // 20)
    tracks = [(h, p, t, lane) for h in range(4) for p in range(5) for t in range(threads)
              for lane in ("nvtx/model",)][:lanes]  # fmt: skip
    per = spans // len(tracks)
    steps_per_track = RUN_NS // 1_000_000_000
    sid = 1
    batch: list[pa.Table] = []
    rows = 0

    def flush() -> None:
        nonlocal batch, rows
        if batch:
            store.insert_arrow("spans", pa.concat_tables(batch))
        batch, rows = [], 0

    for host, pid, tid, lane in tracks:
        n = per
        gap = RUN_NS // max(1, n)
        start = np.arange(n, dtype=np.int64) * gap + rng.integers(0, max(1, gap // 4), n)
        dur = rng.integers(1_000, min(100_000, gap) + 1, n, dtype=np.int64)
        step_start = np.arange(steps_per_track, dtype=np.int64) * 1_000_000_000
        start = np.concatenate([start, step_start])
        dur = np.concatenate([dur, np.full(steps_per_track, 950_000_000, dtype=np.int64)])
        m = len(start)
        cat = np.concatenate([np.zeros(n, np.int32), np.ones(steps_per_track, np.int32)])
        names = np.concatenate(
            [rng.integers(0, len(NAMES), n), np.full(steps_per_track, len(NAMES))]
        )
        depth = np.concatenate([rng.integers(1, 3, n), np.zeros(steps_per_track, np.int64)])
        table = pa.table(
            {
                "run_id": _dict([run_id], np.zeros(m, np.int32)),
                "trace_id": _dict(["0" * 32], np.zeros(m, np.int32)),
                "span_id": pa.array(np.arange(sid, sid + m, dtype=np.uint64)),
                "parent_span_id": pa.array(np.zeros(m, np.uint64)),
                "host": _dict([f"host{host}"], np.zeros(m, np.int32)),
                "pid": pa.array(np.full(m, 1000 + pid, np.uint32)),
                "tid": pa.array(np.full(m, 1000 + pid * 100 + tid, np.uint64)),
                "lane": _dict([lane], np.zeros(m, np.int32)),
                "category": _dict(["op", "step"], cat),
                "name": _dict(NAMES + ["ProfilerStep"], names),
                "start_ns": pa.array(start),
                "end_ns": pa.array(start + dur),
                "depth": pa.array(depth.astype(np.uint16)),
                "attrs": pa.array([[]] * m, pa.map_(pa.string(), pa.string())),
            }
        )
        sid += m
        batch.append(table)
        rows += m
        if rows >= CHUNK:
            flush()
    flush()
    ts = np.arange(0, RUN_NS, 100_000_000, dtype=np.int64)
    k = len(ts)
    store.insert_arrow(
        "counters",
        pa.table(
            {
                "run_id": pa.array([run_id] * k),
                "host": pa.array(["host0"] * k),
                "source": pa.array(["nvml"] * k),
                "device": pa.array(["gpu0"] * k),
                "metric": pa.array(["gpu_util_pct"] * k),
                "ts_ns": pa.array(ts),
                "value": pa.array(rng.random(k) * 100),
                "labels": pa.array([[]] * k, pa.map_(pa.string(), pa.string())),
            }
        ),
    )
    store.upsert_run(
        RunInfo(run_id=run_id, trace_id="0" * 32, started_ns=0, ended_ns=RUN_NS,
                command=f"bench {spans:,} spans", hosts=[f"host{h}" for h in range(4)],
                status="finished", attrs={"anchor_mono_ns": "0", "anchor_wall_ns": str(time.time_ns())})
    )  # fmt: skip
    return time.perf_counter() - t0


#: The chDB peer: the first window's level of detail (spans and busy time per track, depth and
#: bucket), one plain query.
PEER = """
SELECT host, pid, tid, lane, depth,
       intDiv(greatest(start_ns, {t0:Int64}) - {t0:Int64}, {bucket:Int64}) AS bucket,
       count() AS n, sum(least(end_ns, {t1:Int64}) - greatest(start_ns, {t0:Int64})) AS busy_ns
FROM __db__.spans
WHERE run_id = {run:String} AND start_ns < {t1:Int64} AND end_ns >= {t0:Int64}
GROUP BY host, pid, tid, lane, depth, bucket
"""
WIDTH = 1270  # the plot of a 1600 px browser window
ZOOMS = (1, 4, 10, 100, 1_000, 10_000, 100_000)  # 4: the fine overview (read then)


def first_figure(root: Path, store_dir: str, run_id: str) -> dict[str, Any]:
    """One round in a fresh process: the first figure of ``run_id`` with ``root``'s dashboard
    code, the chDB peer, then the zoom levels (seconds each)."""
    checkout.use_tree(root)
    from plotly.io.json import to_json_plotly as to_json

    from gpu_trace.dashboard import timeline
    from gpu_trace.dashboard.readonly_store import ReadOnlyStore
    from gpu_trace.plots import figures
    from gpu_trace.store.client import Store

    # What a running server has paid before any run's first figure (once per process): pyarrow's
    # to_numpy imports pandas (0.2-0.4 s here), plotly's JSON encoder its modules.
    pa.array([0]).to_numpy()
    to_json(figures.empty("warm-up"))
    source = ReadOnlyStore(store=Store(f"chdb://{store_dir}"))
    out: dict[str, Any] = {}
    queries = _time_queries(source)
    a, cpu = time.perf_counter(), time.process_time()
    run = timeline.run(source, run_id)
    steps = timeline.steps_extent(source, run_id)
    t0, t1 = (steps[0], steps[1]) if steps else (int(run["started_ns"]), int(run["ended_ns"]))
    b = time.perf_counter()
    tr = timeline.prepare(source, run_id)
    c = time.perf_counter()
    w = timeline.window(source, run_id, t0, t1, WIDTH)
    fl = timeline.flows(source, run_id, t0, t1)
    cs = timeline.counters(source, run_id, ["nvml/gpu_util_pct"], t0, t1, WIDTH)
    d = time.perf_counter()
    to_json(figures.timeline(run, tr, w, fl, cs, [], WIDTH))
    e = time.perf_counter()
    out["cpu"] = time.process_time() - cpu
    out["queries"] = list(queries)
    queries.clear()
    out["first"] = {"run+steps": b - a, "tracks+overview": c - b, "window": d - c,
                    "figure": e - d, "total": e - a}  # fmt: skip
    out["shown"] = [len(w.bars), w.density_spans, w.density_cells]
    bucket = max(1, -(-(t1 - t0) // max(1, WIDTH // 3)))
    p, cpu = time.perf_counter(), time.process_time()
    peer = source.query_arrow(PEER, {"run": run_id, "t0": t0, "t1": t1, "bucket": bucket})
    out["peer"] = time.perf_counter() - p
    out["peer_cpu"] = time.process_time() - cpu
    out["peer_cells"] = peer.num_rows
    # What the dashboard reads ahead after a first view, on its own thread (not in the first
    # figure): the fine overview, for zooms past the coarse one (none before it existed).
    ahead = getattr(timeline, "prepare_zoom", None)
    p = time.perf_counter()
    if ahead is not None:
        ahead(source, run_id)
    out["ahead"] = time.perf_counter() - p
    out["zooms"] = []
    span = int(run["ended_ns"]) - int(run["started_ns"])
    for frac in ZOOMS:
        z0 = int(run["started_ns"]) + span // 3
        z1 = z0 + span // frac
        a = time.perf_counter()
        w = timeline.window(source, run_id, z0, z1, WIDTH)
        b = time.perf_counter()
        fl = timeline.flows(source, run_id, z0, z1)
        cs = timeline.counters(source, run_id, ["nvml/gpu_util_pct"], z0, z1, WIDTH)
        c = time.perf_counter()
        to_json(figures.timeline(run, tr, w, fl, cs, [], WIDTH))
        d = time.perf_counter()
        out["zooms"].append([span // frac, b - a, c - b, d - c, d - a, len(w.bars),
                             w.density_spans, w.density_cells])  # fmt: skip
    source.close()
    return out


def _time_queries(source: Any) -> list[tuple[str, float]]:
    """Every query ``source`` answers from now on, timed: (its first words, seconds), in order."""
    timed: list[tuple[str, float]] = []
    for name in ("query", "query_arrow"):
        method = getattr(source, name)

        def timing(template: str, params: Any = None, _method: Any = method) -> Any:
            t = time.perf_counter()
            try:
                return _method(template, params)
            finally:
                timed.append((" ".join(template.split())[:90], time.perf_counter() - t))

        setattr(source, name, timing)
    return timed


def _round(root: Path, store_dir: str, run_id: str) -> dict[str, Any]:
    found = subprocess.run(
        [sys.executable, __file__, "--round", str(root), store_dir, run_id],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if found.returncode:
        raise RuntimeError(f"round with {root} failed:\n{found.stderr[-3000:]}")
    return dict(json.loads(found.stdout.strip().splitlines()[-1]))


def _spread(values: list[float], scale: float = 1e3) -> str:
    v = sorted(values)
    return f"{scale * statistics.median(v):6.0f} ({scale * v[0]:.0f}-{scale * v[-1]:.0f})"


def bench_first_figure(
    store_dir: str, run_id: str, rounds: int, baseline: Path | None
) -> dict[str, Any]:
    """Rounds of :func:`first_figure` in fresh processes, this checkout and ``baseline``
    interleaved; prints medians and ranges (ms) and the ratios to the chDB peer."""
    sides = [("this checkout", ROOT)] + ([("baseline", baseline)] if baseline else [])
    found: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in sides}
    before = os.getloadavg()
    for i in range(rounds):
        for name, root in sides if i % 2 else sides[::-1]:
            found[name].append(_round(root, store_dir, run_id))
    load = os.getloadavg()
    print(f"load average {before[0]:.1f} {before[1]:.1f} {before[2]:.1f} before the rounds")
    print(f"first figure of {run_id!r}, {rounds} rounds (a fresh process each), median (range) in"
          f" ms; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} CPUs:")  # fmt: skip
    parts = ("run+steps", "tracks+overview", "window", "figure", "total")
    print(f"  {'':>14} " + " ".join(f"{k:>17}" for k in parts) + f" {'chDB peer':>17} {'/peer':>6}")
    for name, _ in sides[::-1]:
        rs = found[name]
        ratio = [r["first"]["total"] / r["peer"] for r in rs]
        print(f"  {name:>14} " + " ".join(f"{_spread([r['first'][k] for r in rs]):>17}"
              for k in parts) + f" {_spread([r['peer'] for r in rs]):>17}"
              f" {statistics.median(ratio):5.1f}x")  # fmt: skip
    print("  CPU time of the process (chDB's threads included; what other work on the machine moves"
          " least), median (range) in ms:")  # fmt: skip
    for name, _ in sides[::-1]:
        rs = found[name]
        ratio = [r["cpu"] / r["peer_cpu"] for r in rs]
        print(f"  {name:>14}  first figure {_spread([r['cpu'] for r in rs])}, chDB peer"
              f" {_spread([r['peer_cpu'] for r in rs])}, ratio {statistics.median(ratio):.1f}x")  # fmt: skip
    print("  the first figure's queries, this checkout, median (range) in ms and their share of"
          " the total:")  # fmt: skip
    rs = found["this checkout"]
    totals = [r["first"]["total"] for r in rs]
    for k, (text, _) in enumerate(rs[0]["queries"]):
        took = [r["queries"][k][1] for r in rs if len(r["queries"]) > k]
        share = statistics.median(t / total for t, total in zip(took, totals))
        print(f"    {_spread(took):>17} {100 * share:3.0f}%  {text}")
    for name, _ in sides[::-1]:
        print(f"  {name:>14}  read ahead after the first view (its own thread: the fine overview):"
              f" {_spread([r.get('ahead', 0.0) for r in found[name]])} ms")  # fmt: skip
    shown = found["this checkout"][0]
    print(
        f"  (first window: {shown['shown'][0]:,} bars, {shown['shown'][1]:,} spans in "
        f"{shown['shown'][2]:,} density cells; the peer: {shown['peer_cells']:,} cells)"
    )
    print(f"  windows after it, median over the rounds (ms), plot width {WIDTH} px:")
    print(f"  {'window':>12} {'':>13} {'query':>8} {'flows+ctr':>9} {'figure':>8} {'total':>8}"
          f" {'bars':>6} {'density spans':>14} {'cells':>7}")  # fmt: skip
    for z in range(len(ZOOMS)):
        for name, _ in sides[::-1]:
            rows = [r["zooms"][z] for r in found[name]]
            med = [statistics.median(r[k] for r in rows) for k in (1, 2, 3, 4)]
            last = rows[-1]
            print(f"  {figures_duration(last[0]):>12} {name:>13} {1e3 * med[0]:6.0f}ms"
                  f" {1e3 * med[1]:7.0f}ms {1e3 * med[2]:6.0f}ms {1e3 * med[3]:6.0f}ms"
                  f" {last[5]:6,} {last[6]:14,} {last[7]:7,}")  # fmt: skip
    return found


def figures_duration(ns: int) -> str:
    from gpu_trace import _format

    return _format.duration(ns)


def bench_browser(source: Any, runs: list[str], loads: int = 1) -> None:
    from gpu_trace.dashboard.app import Server
    from gpu_trace.query import reads

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("browser: playwright is not installed; skipped")
        return
    if not Path("/usr/bin/chromium").exists():
        print("browser: no /usr/bin/chromium; skipped")
        return
    server = Server(source, "127.0.0.1", 0).start()
    flags = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=flags)
            for run_id in runs:
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                cdp = page.context.new_cdp_session(page)
                cdp.send("Performance.enable")
                t = time.perf_counter()
                page.goto(f"{server.url}/?run={run_id}")
                try:
                    page.locator("#timeline g.barlayer g.point path").first.wait_for(
                        state="attached", timeout=120_000
                    )
                except Exception as exc:
                    said = " | ".join(
                        page.inner_text(s) for s in ("#message", "#timeline-message", "#lod")
                    )
                    print(f"  {run_id:>12}: no bars after 120 s ({type(exc).__name__}); "
                          f"the page says: {said!r}")  # fmt: skip
                    page.close()
                    continue
                load = time.perf_counter() - t
                nav = page.evaluate(
                    "() => { const n = performance.getEntriesByType('navigation')[0];"
                    " const l = performance.getEntriesByType('resource')"
                    ".filter(e => e.name.includes('_dash-layout'))[0];"
                    " return [n.domContentLoadedEventEnd, n.loadEventEnd, l ? l.responseEnd : 0]; }"
                )

                def heap(cdp=cdp) -> float:
                    cdp.send("HeapProfiler.collectGarbage")
                    metrics = {m["name"]: m["value"] for m in
                               cdp.send("Performance.getMetrics")["metrics"]}  # fmt: skip
                    return metrics["JSHeapUsedSize"] / 2**20

                page.wait_for_function("document.querySelector('#lod').innerText.length > 0")
                page.wait_for_timeout(1000)  # let Dash settle before zooming
                loaded = heap()
                before = page.inner_text("#window-text")
                page.evaluate(
                    """() => { const gd = document.querySelector('#timeline .js-plotly-plot');
                       const [a, b] = gd.layout.xaxis.range;
                       Plotly.relayout(gd, {'xaxis.range[0]': a + (b - a) * 0.3,
                                            'xaxis.range[1]': a + (b - a) * 0.31}); }"""
                )
                page.wait_for_function(
                    "t => document.querySelector('#window-text').innerText !== t",
                    arg=before,
                    timeout=120_000,
                )
                page.wait_for_timeout(500)
                zoomed = heap()
                spans = reads.run(source, run_id)["spans"]
                print(f"  {run_id:>12}: {spans:>11,} spans: first page load {load:5.2f} s (scripts"
                      f" run by {nav[1] / 1e3:.2f} s, layout in by {nav[2] / 1e3:.2f} s);"
                      f" JS heap {loaded:6.1f} MiB loaded, {zoomed:6.1f} MiB after a zoom")  # fmt: skip
                page.close()
                # More first loads, now that the server has read the run (as the bench run was).
                times = [_load_once(browser, server.url, run_id) for _ in range(loads - 1)]
                if times:
                    times.sort()
                    print(f"  {'':>12}  then {len(times)} more (a fresh browser context each): median"
                          f" {statistics.median(times):.2f} s, {times[0]:.2f}-{times[-1]:.2f} s")  # fmt: skip
            browser.close()
    finally:
        server.close()


def _load_once(browser: Any, url: str, run_id: str) -> float:
    """Seconds from navigation until the timeline's bars are in a fresh page (nan if never)."""
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    try:
        t = time.perf_counter()
        page.goto(f"{url}/?run={run_id}")
        page.locator("#timeline g.barlayer g.point path").first.wait_for(
            state="attached", timeout=120_000
        )
        return time.perf_counter() - t
    except Exception:
        return float("nan")
    finally:
        page.close()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--round"]:  # one round of bench_first_figure, in its own process
        print(json.dumps(first_figure(Path(argv[1]), argv[2], argv[3])))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spans", type=int, default=10_000_000)
    p.add_argument("--lanes", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5, help="first-figure rounds (fresh processes)")
    p.add_argument("--baseline", type=Path, help="another checkout to time in the same rounds")
    p.add_argument("--no-browser", action="store_true")
    p.add_argument("--loads", type=int, default=1,
                   help="page loads per run: the first, then N-1 more (median and range)")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep the temporary store")
    args = p.parse_args(argv)
    if args.baseline and not (args.baseline / "query").is_dir():
        p.error(f"--baseline {args.baseline}: not a checkout of gpu-trace")
    from gpu_trace.dashboard.readonly_store import ReadOnlyStore
    from gpu_trace.store.client import Store

    tmp = Path(tempfile.mkdtemp(prefix="gpu-trace-bench-dashboard-"))
    try:
        store = Store(f"chdb://{tmp / 'store'}")
        small = make_run(store, "bench-small", args.spans // 10, args.lanes, seed=1)
        big = make_run(store, "bench", args.spans, args.lanes)
        store.close()  # an embedded store is one process's at a time: the rounds open it
        print(f"generated {args.spans // 10:,} + {args.spans:,} spans over {args.lanes} tracks "
              f"in {small:.1f} + {big:.1f} s (Arrow straight into chDB)")  # fmt: skip
        bench_first_figure(str(tmp / "store"), "bench", max(1, args.rounds), args.baseline)
        if not args.no_browser:
            source = ReadOnlyStore(store=Store(f"chdb://{tmp / 'store'}"))
            print("headless Chromium (first page load includes Dash's and plotly's scripts):")
            bench_browser(source, ["bench-small", "bench"], max(1, args.loads))
            source.close()
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
