"""TensorFlow patches: Keras results unchanged, layer tree, steps, eager ops, symmetry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import gpu_trace  # noqa: E402
from gpu_trace.framework_patches import tensorflow as tf_patch  # noqa: E402
from tests.conftest import recorded  # noqa: E402
from tests.span_checks import problems  # noqa: E402


def spans(run_dir: Path) -> list[dict]:
    return sorted(recorded(run_dir), key=lambda r: (r["start_ns"], -r["end_ns"]))


def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([keras.layers.Dense(8, activation="relu", name="dense")], name="block")
    return keras.Sequential(
        [keras.Input((4,)), inner, keras.layers.Dropout(0.2), keras.layers.Dense(1, name="out")],
        name="net",
    )


def step(m: keras.Model, x: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    keras.utils.set_random_seed(1)
    with tf.GradientTape() as tape:
        out = m(x, training=True)
        loss = tf.reduce_mean(out**2)
    grads = tape.gradient(loss, m.trainable_variables)
    return out.numpy(), [g.numpy() for g in grads]


@pytest.fixture
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def start(level: str = "layer") -> Path:
        monkeypatch.setenv("GPU_TRACE_TF", level)
        run = tmp_path / f"run-{level}"
        gpu_trace.start(run)
        return run

    yield start
    gpu_trace.stop()
    for run in tmp_path.glob("run-*"):  # every run nests (tests/span_checks.py)
        assert problems(recorded(run)) == [], run.name


@pytest.mark.parametrize("level", ["layer", "op"])
def test_keras_outputs_and_gradients_are_bitwise_equal(level: str, record) -> None:
    x = np.random.default_rng(0).random((16, 4), dtype=np.float32)
    m = model()
    state = [v.numpy() for v in m.variables]  # weights and the dropout's seed state
    out0, grads0 = step(m, x)
    for v, value in zip(m.variables, state):
        v.assign(value)
    run = record(level)
    out1, grads1 = step(m, x)
    gpu_trace.stop()
    assert np.array_equal(out0, out1)
    assert all(np.array_equal(a, b) for a, b in zip(grads0, grads1))
    rows = spans(run)
    by_id = {r["span_id"]: r for r in rows}
    names = {r["name"]: r for r in rows}
    assert {"net", "net.block", "net.block.dense", "net.out", "GradientTape.gradient"} <= set(
        names
    ), sorted(names)
    assert by_id[names["net.block.dense"]["parent_span_id"]]["name"] == "net.block"
    assert names["net.block.dense"]["lane"] == "nvtx/tensorflow"
    ops = [r for r in rows if r["category"] == "op"]
    if level == "op":
        assert {"MatMul", "Relu"} <= {r["name"] for r in ops}
    else:
        assert not ops


def test_fit_batches_are_steps_and_tf_functions_ranges(record) -> None:
    m = model()
    m.compile(optimizer="sgd", loss="mse")
    x = np.random.default_rng(0).random((32, 4), dtype=np.float32)
    run = record()
    m.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    gpu_trace.stop()
    rows = spans(run)
    steps = [r["name"] for r in rows if r["category"] == "step"]
    assert steps == [f"ProfilerStep#{i}" for i in range(4)]
    assert any(r["name"].startswith("tf.function:") for r in rows)


def test_custom_loop_steps_from_apply_gradients(record) -> None:
    m = model()
    opt = keras.optimizers.SGD()
    x = np.ones((4, 4), dtype=np.float32)
    run = record()
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(m(x))
        opt.apply_gradients(zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables))
    gpu_trace.stop()
    rows = spans(run)
    assert [r["name"] for r in rows if r["category"] == "step"] == [
        "ProfilerStep#0",
        "ProfilerStep#1",
    ]
    assert sum(r["name"] == "Optimizer.apply_gradients#SGD" for r in rows) == 2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("update", ["apply", "apply_gradients"])
def test_custom_loop_one_step_per_iteration(record, update: str, compiled: bool) -> None:
    """Keras's guide "Writing a training loop from scratch" (TensorFlow): a tape, then
    ``optimizer.apply(grads, weights)``, in an eager loop and with the step compiled by
    ``tf.function``. ``apply`` made no step (only ``apply_gradients`` did: 0 or 3 steps for 6
    iterations), nor did a compiled step, whose optimizer runs in TensorFlow's graph."""
    m = model()
    opt = keras.optimizers.SGD(learning_rate=1e-3)
    x = np.random.default_rng(0).random((48, 4), dtype=np.float32)
    dataset = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8)

    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(xb, training=True) - yb) ** 2)
        grads = tape.gradient(loss, m.trainable_weights)
        if update == "apply":
            opt.apply(grads, m.trainable_weights)
        else:
            opt.apply_gradients(zip(grads, m.trainable_weights))
        return loss

    if compiled:
        train_step = tf.function(train_step)
    run = record()
    for xb, yb in dataset:
        train_step(xb, yb)
    gpu_trace.stop()
    rows = spans(run)
    steps = [r for r in rows if r["category"] == "step"]
    assert [r["name"] for r in steps] == [f"ProfilerStep#{i}" for i in range(6)]
    # each step holds its iteration: one optimizer update, or one call of the compiled step
    unit = "tf.function:train_step" if compiled else f"Optimizer.{update}#SGD"
    units = [r for r in rows if r["name"] == unit]
    assert len(units) == 6
    for s_, u in zip(steps, units):
        assert s_["start_ns"] <= u["start_ns"] and u["end_ns"] <= s_["end_ns"]
    assert not any(r["name"].startswith("Optimizer.apply#") for r in rows if update != "apply")


def test_tf_module_calls_and_exceptions(record) -> None:
    class Scale(tf.Module):
        def __call__(self, x):
            if x is None:
                raise ValueError("no input")
            return x * 2.0

    s = Scale(name="scale")
    run = record()
    assert float(s(tf.constant(1.0))) == 2.0
    with pytest.raises(ValueError, match="no input"):
        s(None)
    gpu_trace.stop()
    assert [r["name"] for r in spans(run)].count("scale") == 2


def test_patch_is_idempotent_and_symmetric() -> None:
    from keras.src.layers.layer import Layer
    from tensorflow.python import pywrap_tfe

    call, fast, grad = Layer.__call__, pywrap_tfe.TFE_Py_FastPathExecute, tf.GradientTape.gradient
    tf_patch.patch(tf, "op")
    tf_patch.patch(tf, "layer")
    assert Layer.__call__ is not call and pywrap_tfe.TFE_Py_FastPathExecute is fast
    tf_patch.unpatch()
    tf_patch.unpatch()
    assert Layer.__call__ is call and tf.GradientTape.gradient is grad
    assert pywrap_tfe.TFE_Py_FastPathExecute is fast and not tf_patch.is_patched()
    assert "__init_subclass__" not in tf.Module.__dict__
