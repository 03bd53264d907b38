"""CPU cost of the samplers: per sample, and the highest rate that stays under 1% of a core.

    python bench/collectors.py [--ticks 3000] [--seconds 3] [--nvml-file FILE] [--real-nvml]
                               [--families default,+pcie] [--timeout 300] [--json FILE]

For each sampler, two measurements on this machine:

- per sample: ``sample_once`` called ``--ticks`` times on this thread, CPU time of the thread
  (``time.thread_time_ns``), plus the recorder's flush of what they recorded (formatting Arrow
  columns, writing spool files), also CPU time; the sum is the cost of one sample end to end;
- sustained: the sampler's own threads at 10 Hz for ``--seconds`` (after ``--warmup``) with
  the recorder's flusher at the record process's interval (2 s), process CPU time over wall time,
  as a share of one core: thread wake-ups and the flusher's fixed cost (~1.5 ms per flush here)
  included.

The highest rate under 1% of a core is given two ways: ``10 ms / cost per sample`` (hot loop, a
ceiling) and from the live runs at 10 and 50 Hz (a line through both, where it crosses 1%: cold
caches on each wake-up and the flusher's fixed cost count there). The NVML sampler reads the
replay source (the real H100 recording, ``sample_traces/nvml-h100.jsonl``), so NVML's own call
latency is not in these figures; ``--real-nvml`` uses the real source where a GPU is present, and
then the per-family call latencies the sampler measured (``call_stats``) are printed too: that is
the table in docs/collectors.md (``--json FILE`` writes both tables' figures as JSON too). The host sampler reads this machine through psutil with a child
process tree of two.

It ends on its own, under a pipe too (``timeout 90 python bench/collectors.py --real-nvml | tail``):
the traced stand-in runs in a session of its own with no handle on our output, and the whole
session is killed at the end (a grandchild that outlived it used to keep the pipe open for ten
minutes, so ``tail`` printed nothing); lines are flushed as they are written; ``--timeout``
dumps every thread's stack and exits if anything blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gpu_trace.collectors.host import HostSampler
from gpu_trace.collectors.nvml import NvmlSampler, wants_buffers
from gpu_trace.collectors.nvml.families import parse as parse_families
from gpu_trace.collectors.periodic import Sampler
from gpu_trace.collectors.processes import ProcessTree
from gpu_trace.collectors.run_samplers import FLUSH_INTERVAL_S
from gpu_trace.config import RecorderSettings
from gpu_trace.tracer.recorder import Recorder

REPO = Path(__file__).resolve().parents[1]
H100 = REPO / "sample_traces" / "nvml-h100.jsonl"


def per_sample(make: Callable[[Recorder], Sampler], ticks: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        rec = Recorder(RecorderSettings(run_dir=Path(d), run_id="bench"))
        sampler = make(rec)
        sampler.sample_once()  # warm-up: baselines, first buffers
        rec.flush()
        records = 0
        sample_ns = flush_ns = 0
        for _ in range(ticks // 100):
            t = time.thread_time_ns()
            for _ in range(100):
                sampler.sample_once()
            sample_ns += time.thread_time_ns() - t
            buf = rec.buffer()
            records += len(buf.counters) + len(buf.spans)
            t = time.thread_time_ns()
            rec.flush()
            flush_ns += time.thread_time_ns() - t
        sampler.stop()
        rec.close()
    n = (ticks // 100) * 100
    return {
        "sample_us": sample_ns / n / 1e3,
        "flush_us": flush_ns / n / 1e3,
        "records": records / n,
    }


@contextlib.contextmanager
def traced_program() -> Iterator[subprocess.Popen]:
    """A stand-in for the traced program with a child, so the host sampler has a tree to walk.

    It runs in a session of its own with no handle on our stdout/stderr, and the whole session
    is killed at the end: its grandchild must not outlive us holding a pipe we write into.
    """
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "time.sleep(600)",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield child
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def say(text: str) -> None:
    print(text, flush=True)


def sustained(
    make: Callable[[Recorder], Sampler],
    seconds: float,
    hz: float,
    flush_s: float,
    warmup: float = 1.0,
) -> float:
    with tempfile.TemporaryDirectory() as d:
        settings = RecorderSettings(run_dir=Path(d), run_id="bench", flush_interval_s=flush_s)
        rec = Recorder(settings)
        sampler = make(rec)
        sampler.hz, sampler.period_ns = hz, int(1e9 / hz)
        rec.start()
        sampler.start()
        time.sleep(warmup)  # past the first flush: spool files opened, baselines set
        c0, w0 = time.process_time(), time.perf_counter()
        time.sleep(seconds)
        share = (time.process_time() - c0) / (time.perf_counter() - w0)
        sampler.stop()
        rec.close()
        return share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds before each live figure")
    ap.add_argument("--nvml-file", type=Path, default=H100)
    ap.add_argument(
        "--flush-interval",
        type=float,
        default=FLUSH_INTERVAL_S,
        help=f"the recorder's flush interval in the live runs (default {FLUSH_INTERVAL_S:g}, as in record)",
    )
    ap.add_argument("--real-nvml", action="store_true", help="the real NVML source (needs a GPU)")
    ap.add_argument("--families", default="default", help="NVML families (GPU_TRACE_NVML_FAMILIES)")
    ap.add_argument("--timeout", type=float, default=300.0, help="give up (with stacks) after this")
    ap.add_argument("--json", type=Path, help="also write the figures here, as JSON")
    args = ap.parse_args()
    families = parse_families(args.families)
    faulthandler.dump_traceback_later(args.timeout, exit=True)

    last: list[NvmlSampler] = []

    with traced_program() as child:
        tree = ProcessTree(child.pid)
        time.sleep(0.5)

        def nvml(rec: Recorder) -> Sampler:
            if args.real_nvml:
                from gpu_trace.collectors.nvml.live import PynvmlSource

                source = PynvmlSource(buffers=wants_buffers(families))
            else:
                from gpu_trace.collectors.nvml.replay import ReplaySource

                source = ReplaySource(args.nvml_file, root_pid=lambda: child.pid)
            sampler = NvmlSampler(rec, source, 10, attribute=tree.labels, families=families)
            last[:] = [sampler]
            return sampler

        def host(rec: Recorder) -> Sampler:
            return HostSampler(rec, 10, tree=tree)

        nvml_label = "nvml (real)" if args.real_nvml else f"nvml (replay {args.nvml_file.name})"
        rows = []
        calls: dict[str, dict[str, float]] = {}
        for label, make in ((nvml_label, nvml), ("host (psutil)", host)):
            print(f"measuring {label} ...", file=sys.stderr, flush=True)
            cost = per_sample(make, args.ticks)
            if make is nvml and last:
                calls = last[0].call_stats()
            total_us = cost["sample_us"] + cost["flush_us"]
            s10 = sustained(make, args.seconds, 10.0, args.flush_interval, args.warmup)
            s50 = sustained(make, args.seconds, 50.0, args.flush_interval, args.warmup)
            # share = fixed + per_hz * hz: the rate at which the thread reaches 1% of a core
            per_hz = max((s50 - s10) / 40.0, 1e-9)
            fixed = s10 - 10.0 * per_hz
            sustained_hz = max(0.0, (0.01 - fixed) / per_hz)
            rows.append((label, cost, total_us, 1e4 / total_us, s10, s50, sustained_hz))

    say(
        f"{'sampler':40} {'rec/smpl':>8} {'sample':>9} {'flush':>9} {'total':>9} {'Hz@1% hot':>10}"
        f" {'10 Hz':>7} {'50 Hz':>7} {'Hz@1% live':>10}"
    )
    for label, cost, total_us, max_hz, s10, s50, live_hz in rows:
        say(
            f"{label:40} {cost['records']:8.1f} {cost['sample_us']:7.1f}us {cost['flush_us']:7.1f}us"
            f" {total_us:7.1f}us {max_hz:10.0f} {s10 * 100:6.2f}% {s50 * 100:6.2f}% {live_hz:10.0f}"
        )
    say(
        "rec/smpl: records per sample. sample, flush, total: CPU time per sample in a hot loop;"
        " Hz@1% hot = 10 ms / total.\n10 Hz, 50 Hz: share of one core with the sampler threads and"
        " the recorder's flusher running; Hz@1% live: the rate where that line crosses 1%."
    )
    say(f"\nNVML calls by family (families: {','.join(sorted(families))}), wall time per call:")
    say(f"{'device/family':24} {'calls':>7} {'mean':>9} {'p50':>9} {'p99':>9} {'max':>9}")
    for name, st in sorted(calls.items()):
        say(
            f"{name:24} {int(st['n']):7d} {st['mean_us']:7.1f}us {st['p50_us']:7.1f}us"
            f" {st['p99_us']:7.1f}us {st['max_us']:7.1f}us"
        )
    if not args.real_nvml:
        say("(replayed: these are the replay source's costs, not NVML's; --real-nvml on a GPU)")
    if args.json is not None:
        keys = ("records", "sample_us", "flush_us", "total_us", "hz_at_1pct_hot")
        keys += ("share_10hz", "share_50hz", "hz_at_1pct_live")
        samplers = [
            {"sampler": label, **dict(zip(keys, (cost["records"], cost["sample_us"],
                                                 cost["flush_us"], *rest)))}
            for label, cost, *rest in rows
        ]  # fmt: skip
        figures = {"nvml": "real" if args.real_nvml else "replay", "families": sorted(families)}
        args.json.write_text(json.dumps({**figures, "samplers": samplers, "calls": calls}))
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
