"""A seeded NumPy program (no framework), run plain and under `gpu-trace record` by
tests/integration/test_program_state.py: the output must be identical."""

import hashlib
import random
import threading

import numpy as np

random.seed(1)
np.random.seed(1)
rng = np.random.default_rng(1)
a = np.random.rand(64, 64) @ rng.standard_normal((64, 64))
results = {}


def work() -> None:
    results["t"] = float(np.linalg.norm(a @ a.T)) + random.random()


t = threading.Thread(target=work)
t.start()
t.join()
print("a", hashlib.sha256(a.tobytes()).hexdigest())
print("thread", t.name, results["t"].hex())
print("random", random.random().hex(), np.random.rand().hex(), rng.random().hex())
