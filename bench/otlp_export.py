"""Cost of OpenTelemetry out: the mapping, and what `record --otlp` costs the program.

    python bench/otlp_export.py map [--spans 200000] [--repeats 5]
    python bench/otlp_export.py record [--ranges 200000] [--repeats 3]

``map``: spans per second through the OTLP mapping and encoding (export/otlp.py: SpanMapper,
RequestBuilder, protobuf serialization, 1024 spans a request, every span sent), next to the Chrome
exporter writing the same batch to a file (its peer: the other export of the same spans),
interleaved repeat by repeat; medians.

``record``: a program that opens ``--ranges`` ranges in a loop, recorded with and without
``--otlp`` (to an OTLP/HTTP endpoint on loopback that decodes every request), interleaved; the
program's own loop time (it prints it) is what the stream could slow down. Medians and their ratio.

The machine is shared and noisy: compare within one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def synthetic(n: int) -> pa.Table:
    from gpu_trace.export.exporter import SPAN_BATCH_SCHEMA

    lanes = ["steps", "nvtx/torch", "nvtx/gpu_trace", "torch/ops"]
    cats = ["step", "module", "nvtx", "op"]
    data: dict[str, list[object]] = {
        "run_id": ["r"] * n,
        "trace_id": ["0af7651916cd43dd8448eb211c80319c"] * n,
        "host": ["box"] * n,
        "span_id": list(range(1, n + 1)),
        "parent_span_id": [0 if i % 4 == 0 else i for i in range(n)],
        "pid": [10] * n,
        "tid": [1] * n,
        "lane": [lanes[i % 4] for i in range(n)],
        "category": [cats[i % 4] for i in range(n)],
        "name": [f"name{i % 50}" for i in range(n)],
        "start_ns": [1000 * i for i in range(n)],
        "end_ns": [1000 * i + 500 for i in range(n)],
        "depth": [i % 4 for i in range(n)],
        "attrs": [[("batch", str(i))] if i % 8 == 0 else [] for i in range(n)],
    }
    return pa.table(data, schema=SPAN_BATCH_SCHEMA)


class Discard:
    """An endpoint that serializes every request and keeps only its size."""

    def __init__(self) -> None:
        self.bytes = 0

    def send(self, request: object) -> str | None:
        self.bytes += len(request.SerializeToString())  # type: ignore[attr-defined]
        return None

    def close(self) -> None:
        pass


def bench_map(spans: int, repeats: int) -> None:
    from gpu_trace.export.exporter import export_run, get_exporter
    from gpu_trace.export.otlp import OtlpExporter
    from gpu_trace.export.span_mapping import parse_kinds

    table = synthetic(spans)
    run = {"run_id": "r", "trace_id": "0af7651916cd43dd8448eb211c80319c", "started_ns": 0}
    chrome_run = {**run, "ended_ns": spans * 1000, "command": "bench", "hosts": ["box"]}
    otlp_s, chrome_s = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            sink = Discard()
            t0 = time.perf_counter()
            assert export_run(OtlpExporter(sink, run, parse_kinds("all")), [table])
            otlp_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            chrome = get_exporter("chrome", path=Path(tmp) / "t.json", run=chrome_run, threads=[])
            assert export_run(chrome, [table])
            chrome_s.append(time.perf_counter() - t0)
    o, c = statistics.median(otlp_s), statistics.median(chrome_s)
    print(f"{spans} spans, {repeats} interleaved repeats (medians)")
    print(
        f"  OTLP mapping + protobuf: {spans / o:,.0f} spans/s ({o:.2f} s, {sink.bytes / spans:.0f} B/span)"
    )
    print(f"  Chrome JSON (peer):      {spans / c:,.0f} spans/s ({c:.2f} s)")
    print(f"  OTLP / Chrome time: {o / c:.2f}")


PROGRAM = """
import sys, time, gpu_trace
n = int(sys.argv[1])
t0 = time.perf_counter()
for i in range(n):
    with gpu_trace.range("r"):
        pass
print("LOOP", time.perf_counter() - t0)
"""


def bench_record(ranges: int, repeats: int) -> None:
    from tests.otlp_receiver import otlp_receiver

    with tempfile.TemporaryDirectory() as tmp, otlp_receiver() as receiver:
        prog = Path(tmp) / "prog.py"
        prog.write_text(PROGRAM)
        env = {**os.environ, "GPU_TRACE_HOME": str(Path(tmp) / "home")}
        times: dict[str, list[float]] = {"plain": [], "--otlp": []}
        lines = []
        for _ in range(repeats):
            for mode in times:
                extra = ["--otlp", receiver.url, "--otlp-spans", "all"] if mode == "--otlp" else []
                out = subprocess.run(
                    [sys.executable, "-m", "gpu_trace", "record", "--no-nvml", "--host-hz", "0",
                     "--no-ingest", *extra, "--", sys.executable, str(prog), str(ranges)],
                    capture_output=True, text=True, env=env, check=True,
                )  # fmt: skip
                times[mode].append(float(out.stdout.split("LOOP")[1]))
                lines += [line for line in out.stderr.splitlines() if "spans sent" in line]
    plain, streamed = (statistics.median(v) for v in times.values())
    print(f"{ranges} ranges, {repeats} interleaved rounds (medians of the program's loop)")
    print(f"  plain record:   {plain:.3f} s")
    print(f"  record --otlp:  {streamed:.3f} s   ratio {streamed / plain:.2f}")
    print(f"  last stream: {lines[-1] if lines else '-'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["map", "record"])
    parser.add_argument("--spans", type=int, default=200_000)
    parser.add_argument("--ranges", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.what == "map":
        bench_map(args.spans, args.repeats)
    else:
        bench_record(args.ranges, args.repeats)


if __name__ == "__main__":
    main()
