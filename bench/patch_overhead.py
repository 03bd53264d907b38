"""Step time of small models with gpu-trace's framework patches, next to their peers, in one run.

    python bench/patch_overhead.py [--steps 60] [--repeats 5]

PyTorch (a small CNN and an LSTM): unpatched, gpu-trace module level, gpu-trace op level,
torch.profiler (CPU activities) and torch.autograd.profiler.emit_nvtx (only where the PyTorch
build has NVTX). TensorFlow (a Keras model, eager training steps): unpatched, layer level, op
level. Each configuration runs ``--steps`` training steps ``--repeats`` times, interleaved; the
median step time is reported with its ratio to unpatched. The machine is noisy: compare ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import gpu_trace


@contextlib.contextmanager
def recording(env: str, level: str) -> Iterator[None]:
    os.environ[env] = level
    with tempfile.TemporaryDirectory() as d:
        gpu_trace.start(os.path.join(d, "run"))
        try:
            yield
        finally:
            gpu_trace.stop()


def torch_cases() -> dict[str, Callable[[], tuple[Callable[[], None], Callable[[], None]]]]:
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

    def make(build):
        def setup():
            torch.manual_seed(0)
            model, loss_fn = build()
            opt = torch.optim.SGD(model.parameters(), lr=0.01)

            def step() -> None:
                opt.zero_grad()
                loss_fn().backward()
                opt.step()

            return step

        return setup

    return {"CNN": make(cnn), "LSTM": make(lstm)}


def torch_configs() -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    import torch

    configs = {
        "unpatched": contextlib.nullcontext,
        "gpu-trace module": lambda: recording("GPU_TRACE_TORCH", "module"),
        "gpu-trace op": lambda: recording("GPU_TRACE_TORCH", "op"),
        "torch.profiler (CPU)": lambda: torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
        ),
    }
    if hasattr(torch._C, "_nvtx"):
        configs["emit_nvtx"] = lambda: torch.autograd.profiler.emit_nvtx()
    return configs


def keras_case() -> Callable[[], None]:
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

    return step


def measure(step: Callable[[], None], ctx, steps: int) -> float:
    with ctx():
        for _ in range(3):
            step()
        t0 = time.perf_counter_ns()
        for _ in range(steps):
            step()
        return (time.perf_counter_ns() - t0) / steps


def table(title: str, results: dict[str, list[float]]) -> None:
    base = statistics.median(results["unpatched"])
    print(f"\n{title}")
    print(f"  {'configuration':24} {'step (ms)':>10} {'ratio':>7}")
    for name, times in results.items():
        med = statistics.median(times)
        print(f"  {name:24} {med / 1e6:10.3f} {med / base:7.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-tf", action="store_true")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)
    for name, setup in torch_cases().items():
        step = setup()
        configs = torch_configs()
        results: dict[str, list[float]] = {k: [] for k in configs}
        for _ in range(args.repeats):
            for k, ctx in configs.items():
                results[k].append(measure(step, ctx, args.steps))
        table(f"PyTorch {name}, {args.steps} steps x {args.repeats}", results)
    if not args.no_tf:
        try:
            step = keras_case()
        except ImportError:
            print("\nTensorFlow not installed: no Keras figures", file=sys.stderr)
            return 0
        configs = {
            "unpatched": contextlib.nullcontext,
            "gpu-trace layer": lambda: recording("GPU_TRACE_TF", "layer"),
            "gpu-trace op": lambda: recording("GPU_TRACE_TF", "op"),
        }
        results = {k: [] for k in configs}
        for _ in range(args.repeats):
            for k, ctx in configs.items():
                results[k].append(measure(step, ctx, args.steps))
        table(f"Keras MLP (eager steps), {args.steps} steps x {args.repeats}", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
