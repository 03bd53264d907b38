"""Step cost of small models with gpu-trace's framework patches, next to their peers, in one run.

    python bench/patch_overhead.py [--rounds 30] [--round-s 0.25] [--models CNN,LSTM,Keras]

PyTorch (a small CNN, an LSTM, and an MLP of 33 tiny layers whose step is mostly per-module
framework work, so its figures show the cost per module call most clearly): unpatched, gpu-trace recording with the PyTorch patches off
(the recorder's own cost), gpu-trace module level, gpu-trace op level (and op level with module
backward ranges from hooks, as before they came from the collected ops), torch.profiler (CPU
activities) and torch.autograd.profiler.emit_nvtx (only where the PyTorch build has NVTX).
TensorFlow (a Keras model, eager training steps): unpatched, layer level, op level.

Made for a shared, noisy machine:

- Each step is timed three ways: wall time, CPU time of the training thread
  (``time.thread_time_ns``) and CPU time of the process (``time.process_time_ns``, which adds the
  recorder's flusher and any other thread). PyTorch runs with ``torch.set_num_threads(1)``: its
  ops and the CPU autograd engine then run on the calling thread, so the thread's CPU time is the
  whole of the training work, and CPU time does not count the time the machine gave to others.
- Configurations are interleaved in short rounds (``--round-s`` of steps each, the order rotated
  every round), many rounds; each round compares every configuration with the unpatched steps of
  the same round. Reported: the median over rounds of each configuration's median step, its ratio
  to unpatched, and the 25th-75th percentile of that ratio over rounds (the spread).
- Overhead per module call (µs): (configuration - unpatched) / forward module calls per step, so
  the figure does not depend on how long the model's ops take.
- ``stop ms``: the time leaving the configuration took (the recorder's last flush, the
  profiler building its results); it is not in the step times.
- glibc is told to keep freed memory (``mallopt``): otherwise the CNN's activations come from
  fresh ``mmap``s in some steps and not in others (hundreds of page faults, a millisecond and
  more, depending on the allocator's state rather than on the configuration).
  ``--default-malloc`` leaves the allocator as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import gpu_trace

Step = Callable[[], None]


@contextlib.contextmanager
def recording(env: str, level: str) -> Iterator[None]:
    old = os.environ.get(env)
    os.environ[env] = level
    with tempfile.TemporaryDirectory() as d:
        gpu_trace.start(os.path.join(d, "run"))
        try:
            yield
        finally:
            gpu_trace.stop()
            if old is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = old


# ---- models -------------------------------------------------------------------------------------


def torch_cases() -> dict[str, Callable[[], tuple[Step, int]]]:
    """Name -> setup, which returns a training step and its forward module calls per step."""
    import torch
    from torch import nn

    torch.set_num_threads(1)

    def cnn():
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10),
        )  # fmt: skip
        x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
        return model, lambda: nn.functional.cross_entropy(model(x), y)

    def lstm():
        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(100, 32)
                self.rnn = nn.LSTM(32, 64, batch_first=True)
                self.out = nn.Linear(64, 100)

            def forward(self, t):
                return self.out(self.rnn(self.emb(t))[0][:, -1])

        model = Net()
        t, y = torch.randint(0, 100, (16, 20)), torch.randint(0, 100, (16,))
        return model, lambda: nn.functional.cross_entropy(model(t), y)

    def mlp():
        layers = [m for _ in range(16) for m in (nn.Linear(32, 32), nn.ReLU())]
        model = nn.Sequential(*layers, nn.Linear(32, 10))
        x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
        return model, lambda: nn.functional.cross_entropy(model(x), y)

    def make(build):
        def setup() -> tuple[Step, int]:
            from torch.nn.modules import module as nn_module

            torch.manual_seed(0)
            model, loss_fn = build()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)

            def step() -> None:
                opt.zero_grad()
                loss_fn().backward()
                opt.step()

            calls = [0]
            handle = nn_module.register_module_forward_pre_hook(
                lambda m, a: calls.__setitem__(0, calls[0] + 1)
            )
            try:
                step()
            finally:
                handle.remove()
            return step, calls[0]

        return setup

    return {"CNN": make(cnn), "LSTM": make(lstm), "MLP": make(mlp)}


@contextlib.contextmanager
def op_with_hooks() -> Iterator[None]:
    """Op level with module backward ranges from autograd hooks, as module level makes them (as
    op level did before they were made from the collected ops): for comparison."""
    from gpu_trace.framework_patches.torch import modules as torch_modules

    with recording("GPU_TRACE_TORCH", "op"):
        torch_modules.backward_from(None)
        yield


def torch_configs() -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    import torch

    configs: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "unpatched": contextlib.nullcontext,
        "gpu-trace, torch off": lambda: recording("GPU_TRACE_TORCH", "off"),
        "gpu-trace module": lambda: recording("GPU_TRACE_TORCH", "module"),
        "gpu-trace op": lambda: recording("GPU_TRACE_TORCH", "op"),
        "gpu-trace op, hooks": op_with_hooks,
        "torch.profiler (CPU)": lambda: torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
        ),
    }
    if hasattr(torch._C, "_nvtx"):
        configs["emit_nvtx"] = lambda: torch.autograd.profiler.emit_nvtx()
    return configs


def keras_case() -> tuple[Step, int]:
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
         keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )  # fmt: skip
    opt = keras.optimizers.SGD()
    x = np.random.default_rng(0).random((64, 32), dtype=np.float32)
    y = np.random.default_rng(1).integers(0, 10, 64)

    def step() -> None:
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
            loss = tf.reduce_mean(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return step, 4  # the Sequential and its three Dense layers


def keras_configs() -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    return {
        "unpatched": contextlib.nullcontext,
        "gpu-trace, tf off": lambda: recording("GPU_TRACE_TF", "off"),
        "gpu-trace layer": lambda: recording("GPU_TRACE_TF", "layer"),
        "gpu-trace op": lambda: recording("GPU_TRACE_TF", "op"),
    }


# ---- measuring ----------------------------------------------------------------------------------


def steady_allocator() -> None:
    """Make glibc serve large blocks from the heap and keep what is freed (see the docstring)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 1 << 25)  # M_MMAP_THRESHOLD: 32 MiB, the most glibc takes
    libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD


METRICS = ("wall", "thread", "process")


def run_round(step: Step, ctx: Any, steps: int) -> tuple[dict[str, float], float]:
    """Median step time (ns) per metric over ``steps`` steps inside ``ctx``; and the exit time."""
    wall, thread, proc = [], [], []
    pc, tt, pt = time.perf_counter_ns, time.thread_time_ns, time.process_time_ns
    cm = ctx()
    cm.__enter__()
    try:
        step()  # the first step after patching names modules, creates buffers
        step()
        for _ in range(steps):
            w, t, p = pc(), tt(), pt()
            step()
            p1, t1, w1 = pt(), tt(), pc()
            wall.append(w1 - w)
            thread.append(t1 - t)
            proc.append(p1 - p)
    finally:
        s = pc()
        cm.__exit__(None, None, None)
        stop_ns = pc() - s
    med = statistics.median
    return {"wall": med(wall), "thread": med(thread), "process": med(proc)}, stop_ns


def measure(
    step: Step, configs: dict[str, Any], rounds: int, round_s: float
) -> tuple[dict[str, dict[str, list[float]]], dict[str, list[float]], int]:
    """Per configuration, per metric, one median step time per round; exit times; steps/round."""
    for _ in range(3):
        step()
    t0 = time.perf_counter_ns()
    for _ in range(5):
        step()
    step_ns = (time.perf_counter_ns() - t0) / 5
    steps = max(5, min(200, round(round_s * 1e9 / step_ns)))
    names = list(configs)
    results = {k: {m: [] for m in METRICS} for k in names}
    stops: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for k in order:
            times, stop_ns = run_round(step, configs[k], steps)
            for m in METRICS:
                results[k][m].append(times[m])
            stops[k].append(stop_ns)
    return results, stops, steps


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def report(
    title: str,
    results: dict[str, dict[str, list[float]]],
    stops: dict[str, list[float]],
    calls: int,
) -> None:
    base = results["unpatched"]
    print(f"\n{title}")
    head = f"  {'configuration':22}"
    for m in METRICS:
        head += f" | {m + ' ms':>10} {'ratio':>6} {'[p25-p75]':>13} {'µs/call':>7}"
    print(head + f" | {'stop ms':>7}")
    for name, res in results.items():
        line = f"  {name:22}"
        for m in METRICS:
            ratios = [a / b for a, b in zip(res[m], base[m])]
            per_call = [(a - b) / calls / 1e3 for a, b in zip(res[m], base[m])]
            lo, mid, hi = quartiles(ratios)
            line += (
                f" | {statistics.median(res[m]) / 1e6:10.3f} {mid:6.3f} [{lo:5.3f}-{hi:5.3f}]"
                f" {statistics.median(per_call):7.1f}"
            )
        print(line + f" | {statistics.median(stops[name]) / 1e6:7.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--round-s", type=float, default=0.25, help="steps per round, in seconds")
    ap.add_argument("--models", default="CNN,LSTM,MLP,Keras", help="comma-separated")
    ap.add_argument("--default-malloc", action="store_true", help="leave glibc's malloc as it is")
    args = ap.parse_args()
    if not args.default_malloc:
        steady_allocator()
    import logging

    logging.basicConfig(level=logging.ERROR)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    cases = torch_cases() if {"CNN", "LSTM", "MLP"} & set(models) else {}
    if cases:
        import torch

        print(
            f"PyTorch {torch.__version__}, intra-op threads {torch.get_num_threads()}, "
            f"{os.cpu_count()} CPUs"
        )
    for name in models:
        if name in cases:
            step, calls = cases[name]()
            configs = torch_configs()
        elif name == "Keras":
            try:
                step, calls = keras_case()
            except ImportError:
                print("\nTensorFlow not installed: no Keras figures", file=sys.stderr)
                continue
            configs = keras_configs()
        else:
            print(f"unknown model {name!r}", file=sys.stderr)
            return 2
        results, stops, steps = measure(step, configs, args.rounds, args.round_s)
        title = (
            f"{name}: {calls} module calls/step, {args.rounds} rounds x {steps} steps; "
            f"median over rounds, ratio to unpatched in the same round [its p25-p75], "
            f"overhead per module call"
        )
        report(title, results, stops, calls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
