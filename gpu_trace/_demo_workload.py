"""The workload `gpu-trace demo` records: a small training-shaped loop on the CPU.

It uses the public API (steps, ranges, counters, marks), the ``nvtx`` package in its own domain
(captured by the NVTX collector), a background data-loading thread and a worker process, so the
demo shows every kind of lane. NumPy stands in for GPU work; nothing is downloaded.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading

import numpy as np
import nvtx

import gpu_trace

STEPS = 20
BATCH = 64


def _loader(out: queue.Queue, steps: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(steps):
        with nvtx.annotate("load_batch", domain="dataloader", color="green"):
            x = rng.standard_normal((BATCH, 256)).astype(np.float32)
            y = rng.integers(0, 10, BATCH)
        out.put((i, x, y))


def _evaluate(weights: np.ndarray) -> float:
    with gpu_trace.range("evaluate", rows=512):
        rng = np.random.default_rng(1)
        x = rng.standard_normal((512, 256)).astype(np.float32)
        return float(np.abs(x @ weights).mean())


def main() -> None:
    rng = np.random.default_rng(42)
    w1 = rng.standard_normal((256, 512)).astype(np.float32) * 0.05
    w2 = rng.standard_normal((512, 10)).astype(np.float32) * 0.05
    batches: queue.Queue = queue.Queue(maxsize=4)
    loader = threading.Thread(target=_loader, args=(batches, STEPS), name="loader")
    loader.start()
    for step in range(STEPS):
        with gpu_trace.step(step):
            train_step(step, batches, w1, w2)
    loader.join()
    with mp.get_context("spawn").Pool(1) as pool:
        score = pool.apply(_evaluate, (w1[:, :10].copy(),))
    print(f"demo: {STEPS} steps, eval {score:.3f}")


def train_step(step: int, batches: queue.Queue, w1: np.ndarray, w2: np.ndarray) -> None:
    """One iteration: wait for a batch, forward, loss, backward, update."""
    with gpu_trace.range("dataloader.wait"):
        _, x, y = batches.get()
    with gpu_trace.range("forward", batch=BATCH):
        with nvtx.annotate("linear1", domain="model"):
            h = np.maximum(x @ w1, 0)
        with nvtx.annotate("linear2", domain="model"):
            logits = h @ w2
    with gpu_trace.range("loss"):
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        loss = float(-np.log(p[np.arange(BATCH), y] + 1e-9).mean())
    with gpu_trace.range("backward"):
        g = p
        g[np.arange(BATCH), y] -= 1
        gw2 = h.T @ g / BATCH
        gh = g @ w2.T * (h > 0)
        gw1 = x.T @ gh / BATCH
    with gpu_trace.range("optimizer.step"):
        w1 -= 0.1 * gw1
        w2 -= 0.1 * gw2
    gpu_trace.counter("loss", loss)
    if step % 5 == 4:
        gpu_trace.mark("checkpoint", step=step)


if __name__ == "__main__":
    main()
