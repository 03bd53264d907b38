"""What recording costs a GPU training step: every recording level, NVML on and off, next to
torch.profiler and nsys, in interleaved rounds.

    python bench/gpu_overhead.py [--rounds 6] [--steps 60] [--configs none,off,...] [--quick]
                                 [--budget SECONDS] [--json FILE]

The program is the one of ``../shared/gpu/README.md``: a GPT-style language model (token
embedding of 8,192 words, 6 pre-norm ``nn.TransformerEncoderLayer``s, d=512, 8 heads, FFN 2,048,
a linear head), AdamW, batch 16 x 256 tokens, fp32, 10 warm-up steps, then ``--steps`` timed
ones. About 20 ms a step on an H100, launch-bound: a few percent of CPU taken from its launch
thread shows. Step times come from CUDA events (one pair per step, read after each window of 10);
on a machine without a GPU the bench says so and runs a smaller model on the CPU (d=128, 2
layers, batch 4 x 64; wall clock per step), which tells the mechanisms apart but not GPU costs.

Configurations, each a fresh process, interleaved in rounds with the order rotated each round:

- ``none``: the program alone;
- ``off``: ``gpu-trace record --torch off`` (NVML at 10 Hz and host at 2 Hz, the defaults);
- ``off-nonvml``: ``gpu-trace record --torch off --no-nvml``;
- ``off-allnvml``: ``--torch off`` with ``GPU_TRACE_NVML_FAMILIES=all`` (PCIe, the sample
  buffers and XID events too: the families that are off by default, to see what they cost);
- ``off-events``: ``--torch off`` with the default families and XID events (registered with
  the driver: the one thing the old sampler did that per-family polling from another process,
  which cost nothing, did not);
- ``module``, ``op``: ``gpu-trace record --torch module`` / ``--torch op``;
- ``profiler-cpu``, ``profiler-cuda``: ``torch.profiler.profile`` around the timed steps with
  CPU activities, and with CPU and CUDA activities (GPU only);
- ``nsys``: ``nsys profile --trace cuda,nvtx`` (where ``nsys`` is on PATH and a GPU is present).

Recording runs with ``--no-ingest`` (ingest comes after the program and does not touch its
steps). Per configuration: the median over rounds of each run's median 10-step window (ms per
step), the mean ratio to ``none`` of the same round, and the worst window over the median window
(a stall shows there; 1.5 is the bound of issue 17). ``--quick`` is a smoke test: a tiny model on
the CPU, one round of one window, the configurations a CPU has (the figures mean nothing).
``--budget SECONDS`` (the GPU check passes its deadline): no run is started that would end past
it, judged by the slowest run so far; the rounds so far are kept, a partial last one included.

On a GPU machine that reaches no registry (/work/shared/gpu-box/README.md): carry ``.device/``,
then ``. .device/install.sh && timeout -k 5 560 python bench/gpu_overhead.py --rounds 6 >
overhead.txt 2>&1`` (chDB is not needed: nothing is ingested); write to a file, not a pipe.
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
from dataclasses import dataclass
from pathlib import Path

WINDOW = 10
WARMUP = 10
CONFIGS = (
    "none",
    "off",
    "off-nonvml",
    "off-allnvml",
    "off-events",
    "module",
    "op",
    "profiler-cpu",
    "profiler-cuda",
    "nsys",
)
QUICK_CONFIGS = ("none", "off", "off-nonvml", "module", "profiler-cpu")


@dataclass(frozen=True)
class Model:
    """The program's size: the H100 one, or the smaller one for a CPU."""

    vocab: int
    d: int
    heads: int
    ffn: int
    layers: int
    batch: int
    tokens: int


GPU_MODEL = Model(vocab=8192, d=512, heads=8, ffn=2048, layers=6, batch=16, tokens=256)
CPU_MODEL = Model(vocab=8192, d=128, heads=4, ffn=512, layers=2, batch=4, tokens=64)
#: ``--quick``: only that every configuration runs and is measured, in seconds.
QUICK_MODEL = Model(vocab=512, d=32, heads=2, ffn=64, layers=1, batch=2, tokens=16)
MODELS = {"gpu": GPU_MODEL, "cpu": CPU_MODEL, "quick": QUICK_MODEL}


# ---- the worker: one configuration, one process ---------------------------------------------------


def train(model: Model, steps: int, warmup: int, profiler: str, device: str) -> list[float]:
    """Train ``warmup`` + ``steps`` steps; the timed steps' times in ms (CUDA events on a GPU)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # steadier steps, and one core of a shared machine

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(model.vocab, model.d)
            layer = nn.TransformerEncoderLayer(
                model.d, model.heads, model.ffn, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, model.layers, enable_nested_tensor=False)
            self.head = nn.Linear(model.d, model.vocab)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(self.embed(x)))

    lm = LM().to(dev)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randint(0, model.vocab, (model.batch, model.tokens), device=dev)
    y = torch.randint(0, model.vocab, (model.batch, model.tokens), device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(lm(x).reshape(-1, model.vocab), y.reshape(-1))
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    prof = None
    if profiler != "none":
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if profiler == "cuda" else [])
        prof = profile(activities=acts)
        prof.__enter__()
    times: list[float] = []
    try:
        for start in range(0, steps, WINDOW):
            n = min(WINDOW, steps - start)
            if cuda:
                events = [
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in range(n)
                ]
                for a, b in events:
                    a.record()
                    step()
                    b.record()
                torch.cuda.synchronize()
                times += [a.elapsed_time(b) for a, b in events]
            else:
                for _ in range(n):
                    t = time.perf_counter_ns()
                    step()
                    times.append((time.perf_counter_ns() - t) / 1e6)
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
    return times


def worker(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="gpu_overhead.py worker")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=WARMUP)
    ap.add_argument("--profiler", choices=("none", "cpu", "cuda"), default="none")
    ap.add_argument("--model", choices=tuple(MODELS), default="gpu")
    args = ap.parse_args(argv)
    device = "cuda" if args.model == "gpu" else "cpu"
    times = train(MODELS[args.model], args.steps, args.warmup, args.profiler, device)
    args.out.write_text(json.dumps({"step_ms": times, "device": device}))


# ---- figures --------------------------------------------------------------------------------------


def windows(times: list[float], size: int = WINDOW) -> list[float]:
    """Mean step of each whole window of ``size`` steps."""
    return [statistics.fmean(times[i : i + size]) for i in range(0, len(times) - size + 1, size)]


def run_figures(times: list[float]) -> tuple[float, float]:
    """A run's median window (ms per step) and its worst window over that median."""
    w = windows(times)
    median = statistics.median(w)
    return median, max(w) / median


def summarize(
    rounds: list[dict[str, list[float]]],
) -> list[tuple[str, float, float, float, float, int]]:
    """Per configuration: median over rounds of the median window, mean ratio to ``none`` in
    the same round and the half-width of its 95% interval over rounds (2 standard errors; nan
    below two rounds), the worst window/median of any round, and how many rounds it ran."""
    names = [c for c in CONFIGS if any(c in r for r in rounds)]
    rows = []
    for name in names:
        medians, ratios, worst = [], [], 0.0
        for r in rounds:
            if name not in r:
                continue
            median, w = run_figures(r[name])
            medians.append(median)
            worst = max(worst, w)
            if "none" in r:
                ratios.append(median / run_figures(r["none"])[0])
        ratio = statistics.fmean(ratios) if ratios else float("nan")
        spread = (
            2 * statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
        )
        rows.append((name, statistics.median(medians), ratio, spread, worst, len(medians)))
    return rows


# ---- the driver -----------------------------------------------------------------------------------


def command(
    config: str, out: Path, steps: int, model: str, run_dir: Path, warmup: int = WARMUP
) -> list[str]:
    """The command line of one configuration (its environment: :func:`environment`)."""
    me = [sys.executable, str(Path(__file__).resolve()), "worker", "--out", str(out)]
    me += ["--steps", str(steps), "--warmup", str(warmup), "--model", model]
    record = [sys.executable, "-m", "gpu_trace", "record", "--no-ingest", "--run-dir", str(run_dir)]
    if config == "none":
        return me
    if config in ("off", "off-allnvml", "off-events"):
        return [*record, "--torch", "off", "--", *me]
    if config == "off-nonvml":
        return [*record, "--torch", "off", "--no-nvml", "--", *me]
    if config in ("module", "op"):
        return [*record, "--torch", config, "--", *me]
    if config == "profiler-cpu":
        return [*me, "--profiler", "cpu"]
    if config == "profiler-cuda":
        return [*me, "--profiler", "cuda"]
    if config == "nsys":
        report = str(run_dir / "nsys")
        return [
            "nsys",
            "profile",
            "--trace",
            "cuda,nvtx",
            "-o",
            report,
            "--force-overwrite",
            "true",
        ] + me
    raise ValueError(f"unknown configuration {config!r} (known: {', '.join(CONFIGS)})")


def environment(config: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TRACE_NVML_FAMILIES")}
    if config == "off-allnvml":
        env["GPU_TRACE_NVML_FAMILIES"] = "all"
    elif config == "off-events":
        env["GPU_TRACE_NVML_FAMILIES"] = "default,+events"
    return env


def has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def available(configs: list[str], gpu: bool) -> tuple[list[str], list[str]]:
    """The configurations this machine can run, and one note for each it cannot."""
    keep, notes = [], []
    for c in configs:
        if c == "profiler-cuda" and not gpu:
            notes.append("profiler-cuda: no GPU here")
        elif c == "nsys" and (not gpu or shutil.which("nsys") is None):
            notes.append("nsys: " + ("no GPU here" if not gpu else "not on PATH"))
        else:
            keep.append(c)
    return keep, notes


def room_for(elapsed_s: float, slowest_s: float, budget_s: float | None) -> bool:
    """Whether one more run, as long as the slowest so far, ends within ``budget_s`` seconds of
    the start (no budget: always)."""
    return budget_s is None or elapsed_s + slowest_s <= budget_s


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        worker(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--quick", action="store_true", help="smoke test: CPU model, 2 short rounds")
    ap.add_argument("--cpu", action="store_true", help="the CPU model even where there is a GPU")
    ap.add_argument("--timeout", type=float, default=300.0, help="per run (a hang is a failure)")
    ap.add_argument(
        "--json", type=Path, help="also write every run's step times here (after every round)"
    )
    ap.add_argument(
        "--budget",
        type=float,
        help="seconds it has: no run is started that would end later (judged by the slowest"
        " so far); the rounds so far, the last one partial, are kept",
    )
    args = ap.parse_args()
    t0 = time.monotonic()
    gpu = has_gpu() and not args.cpu and not args.quick
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown configuration {c!r} (known: {', '.join(CONFIGS)})")
    warmup = WARMUP
    if args.quick:
        configs = [c for c in configs if c in QUICK_CONFIGS]
        args.rounds, args.steps, warmup = 1, WINDOW, 2
    configs, notes = available(configs, gpu)
    model = "gpu" if gpu else "quick" if args.quick else "cpu"
    where = "GPU (CUDA events per step)" if gpu else "CPU (wall clock per step, 1 thread)"
    if not gpu:
        print(
            "no GPU here: a smaller model on the CPU"
            + (" (--quick: a tiny one, a smoke test)" if args.quick else "")
            + "; these figures tell mechanisms apart, not what recording costs a GPU step",
            flush=True,
        )
    print(f"{MODELS[model]}, {where}; {args.rounds} rounds of {args.steps} steps", flush=True)
    for note in notes:
        print(f"skipped {note}", flush=True)

    rounds: list[dict[str, list[float]]] = []
    slowest = 0.0
    out_of_time = False
    with tempfile.TemporaryDirectory(prefix="gpu-overhead-") as tmp:
        for r in range(args.rounds):
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            got: dict[str, list[float]] = {}
            for config in order:
                if not room_for(time.monotonic() - t0, slowest, args.budget):
                    print(
                        f"round {r + 1} {config}: not started, the --budget of {args.budget:g} s"
                        f" would not hold it (the slowest run so far took {slowest:.0f} s)",
                        flush=True,
                    )
                    out_of_time = True
                    break
                started = time.monotonic()
                out = Path(tmp) / f"{config}-{r}.json"
                run_dir = Path(tmp) / f"run-{config}-{r}"
                cmd = command(config, out, args.steps, model, run_dir, warmup)
                try:
                    done = subprocess.run(
                        cmd,
                        env=environment(config),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        text=True,
                        timeout=args.timeout,
                    )
                except subprocess.TimeoutExpired:
                    print(f"round {r + 1} {config}: no end within {args.timeout:g} s", flush=True)
                    continue
                finally:
                    slowest = max(slowest, time.monotonic() - started)
                if done.returncode != 0 or not out.is_file():
                    tail = done.stderr.strip().splitlines()[-1:] or [""]
                    print(
                        f"round {r + 1} {config}: failed ({done.returncode}) {tail[0]}", flush=True
                    )
                    continue
                got[config] = json.loads(out.read_text())["step_ms"]
                shutil.rmtree(run_dir, ignore_errors=True)
                median, worst = run_figures(got[config])
                print(
                    f"round {r + 1} {config:14} {median:8.2f} ms/step  worst/median {worst:.2f}",
                    flush=True,
                )
            if got or not out_of_time:
                rounds.append(got)
            if args.json is not None:  # after every round: a run cut short keeps its rounds
                args.json.write_text(json.dumps({"model": model, "rounds": rounds}))
            if out_of_time:
                break

    print(
        f"\n{'configuration':14} {'ms/step':>9} {'x none':>8} {'+-95%':>7} {'worst/med':>10}"
        f" {'rounds':>7}"
    )
    for name, median, ratio, spread, worst, n in summarize(rounds):
        print(f"{name:14} {median:9.2f} {ratio:8.3f} {spread:7.3f} {worst:10.2f} {n:7d}")
    print(
        "ms/step: median over rounds of each run's median 10-step window; x none: mean ratio to"
        " `none` of the same round, +-95%: two standard errors of it over rounds (a cost is told"
        " from noise when the ratio minus this stays above 1); worst/med: the worst window over"
        " the median one, any round."
        "\nThe machine may be shared: compare ratios of this run only."
    )


if __name__ == "__main__":
    main()
