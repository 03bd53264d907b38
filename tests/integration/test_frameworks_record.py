"""`gpu-trace record` of unmodified training scripts: module tree, steps and ops in `gpu-trace show`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gpu_trace.query import reads
from gpu_trace.query.source import rows as query_rows
from gpu_trace.store.client import Store
from tests.integration.test_record import (
    cpu_hog,  # noqa: F401 (a fixture)
    gpu_trace,
    last_run,
    script,
    sql_json,
)
from tests.span_checks import check_stored


@pytest.fixture(autouse=True)
def _every_run_nests():
    """Every run a test here records nests as it ran: no partial overlap on a thread, no
    negative self time in the spans or in what `gpu-trace show` prints (tests/span_checks.py)."""
    yield
    with Store() as store:
        for run in reads.runs(store, limit=1000):
            check_stored(store, run["run_id"])


TORCH_TRAIN = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2))
            self.classifier = nn.Linear(4 * 5 * 5, 10)

        def forward(self, x):
            return self.classifier(torch.flatten(self.features(x), 1))

    data = TensorDataset(torch.randn(64, 1, 12, 12), torch.randint(0, 10, (64,)))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(1):
        for x, y in loader:
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
    print("done", loss.item())
"""


# PyTorch's time-sequence-prediction example, smaller: two LSTMCells and a Linear called per time
# step in a Python loop, trained with LBFGS (several forward and backward passes per step).
CELL_LOOP = """
    import torch
    from torch import nn

    class Sequence(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm1 = nn.LSTMCell(1, 16)
            self.lstm2 = nn.LSTMCell(16, 16)
            self.linear = nn.Linear(16, 1)

        def forward(self, input):
            outputs = []
            h_t = c_t = torch.zeros(input.size(0), 16)
            h_t2 = c_t2 = torch.zeros(input.size(0), 16)
            for input_t in input.split(1, dim=1):
                h_t, c_t = self.lstm1(input_t, (h_t, c_t))
                h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
                outputs.append(self.linear(h_t2))
            return torch.cat(outputs, dim=1)

    torch.manual_seed(0)
    x = torch.sin(torch.arange(21.0).repeat(4, 1) / 3 + torch.arange(4.0)[:, None])
    seq = Sequence()
    optimizer = torch.optim.LBFGS(seq.parameters(), lr=0.8, max_iter=3)

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(seq(x[:, :-1]), x[:, 1:])
        loss.backward()
        return loss

    for i in range(2):
        print("loss", optimizer.step(closure).item())
"""


@pytest.mark.usefixtures("cpu_hog")
@pytest.mark.parametrize("level", ["module", "op"])
def test_record_cells_called_in_a_loop(tmp_path: Path, level: str) -> None:
    """One module backward range per cell call (not one per output), each inside the model's,
    beside busy processes on every core (where it failed before: 11 ``Sequence.backward`` for
    6 passes)."""
    pytest.importorskip("torch")
    out = gpu_trace(
        "record", "--torch", level, "--", sys.executable, str(script(tmp_path, CELL_LOOP))
    )
    assert out.returncode == 0, out.stderr
    with Store() as store:
        rows = query_rows(
            store,
            "SELECT name, count() AS n FROM __db__.spans WHERE run_id = {run:String} "
            "AND category = 'module' GROUP BY name",
            {"run": reads.resolve_run(store, "last")},
        )
    got = {r["name"]: int(r["n"]) for r in rows}
    assert got["Sequence.lstm1"] == got["Sequence.lstm2"] == 20 * got["Sequence"] > 0
    for name in ("Sequence", "Sequence.lstm1", "Sequence.lstm2", "Sequence.linear"):
        assert got[name + ".backward"] == got[name], name


# The time-sequence example nearer its real size (60 time steps, 32 units, one LBFGS step):
# backward passes of about a second on a loaded 2-core machine.
LONG_CELL_LOOP = (
    CELL_LOOP.replace("16", "32")
    .replace(
        "torch.arange(21.0).repeat(4, 1) / 3 + torch.arange(4.0)",
        "torch.arange(61.0).repeat(8, 1) / 7 + torch.arange(8.0)",
    )
    .replace("for i in range(2):", "for i in range(1):")
)

# A small causal language model trained with AdamW (pre-norm transformer blocks, dropout).
TRANSFORMER_LM = """
    import torch
    from torch import nn

    class LM(nn.Module):
        def __init__(self, vocab=200, d=64):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            layer = nn.TransformerEncoderLayer(
                d, 4, 4 * d, dropout=0.1, batch_first=True, norm_first=True
            )
            self.blocks = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens):
            mask = nn.Transformer.generate_square_subsequent_mask(tokens.size(1))
            return self.head(self.blocks(self.embed(tokens), mask=mask, is_causal=True))

    torch.manual_seed(0)
    model = LM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, 200, (16, 65))
    for step in range(3):
        optimizer.zero_grad()
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 200), data[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        print("loss", loss.item())
"""


@pytest.mark.usefixtures("cpu_hog")
@pytest.mark.parametrize("level", ["module", "op"])
@pytest.mark.parametrize("program", ["cells", "lm"])
def test_backward_ranges_beside_a_cpu_hog_are_one_per_call_in_every_run(
    tmp_path: Path, program: str, level: str
) -> None:
    """Beside busy processes on every core, the cell loop and the transformer, each recorded
    twice: every module call gets one backward range (each made a graph that one pass ran) and
    the two runs hold the same ranges, name by name. Before, the flusher matched the nodes it
    had whenever a second passed with no cut, which on a loaded machine fell inside passes:
    each part of a pass got ranges of its own, so counts changed from run to run (6-21
    ``Sequence.backward`` for 3 passes, 4-6 ``LM.blocks.layers.1.backward`` for 3)."""
    pytest.importorskip("torch")
    body = {"cells": LONG_CELL_LOOP, "lm": TRANSFORMER_LM}[program]
    prog = script(tmp_path, body, name=f"{program}.py")
    runs = []
    for _ in range(2):
        out = gpu_trace(
            "record", "--torch", level, "--", sys.executable, str(prog),
            env={"GPU_TRACE_FLUSH_INTERVAL": "0.1"},
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        rows = sql_json(
            "SELECT name, count() AS n FROM gpu_trace.spans WHERE run_id = {run:String} "
            "AND category = 'module' GROUP BY name",
            run=last_run()["run"]["run_id"],
        )
        got = {r["name"]: int(r["n"]) for r in rows}
        forward = {n: c for n, c in got.items() if n + ".backward" in got}
        assert forward and len(forward) == sum(n.endswith(".backward") for n in got) - 1
        assert {n: got[n + ".backward"] for n in forward} == forward, got
        runs.append(got)
    assert runs[0] == runs[1]


def names(shown: dict) -> set[str]:
    """Every span name of the run `gpu-trace show` showed."""
    rows = sql_json(
        "SELECT DISTINCT name FROM gpu_trace.spans WHERE run_id = {run:String}",
        run=shown["run"]["run_id"],
    )
    return {r["name"] for r in rows}


def test_record_torch_training_script_at_op_level(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    prog = script(tmp_path, TORCH_TRAIN)
    out = gpu_trace("record", "--torch", "op", "--", sys.executable, str(prog))
    assert out.returncode == 0, out.stderr
    assert "done" in out.stdout
    shown = last_run()
    run_id = shown["run"]["run_id"]
    assert {"Net", "Net.features", "Net.features.0", "Net.classifier"} <= names(shown)
    rows = sql_json(
        "SELECT category, name, count() AS n FROM gpu_trace.spans WHERE run_id = {run:String} "
        "GROUP BY category, name",
        run=run_id,
    )
    got = {(r["category"], r["name"]): int(r["n"]) for r in rows}
    assert got[("step", "ProfilerStep#3")] == 1 and ("step", "ProfilerStep#4") not in got
    assert got[("module", "Net.features.0.backward")] == 4
    assert got[("module", "Optimizer.step#SGD.step")] == 4
    assert got[("op", "aten::conv2d")] == 4
    assert any(c == "op" and n.startswith("autograd::engine::evaluate_function") for c, n in got)


def test_record_torch_off_and_program_without_torch(tmp_path: Path) -> None:
    prog = script(tmp_path, TORCH_TRAIN)
    out = gpu_trace("record", "--torch", "off", "--", sys.executable, str(prog))
    assert out.returncode == 0, out.stderr
    assert "Net" not in names(last_run())
    plain = script(
        tmp_path,
        """
        import sys
        import gpu_trace
        with gpu_trace.range("work"):
            pass
        assert "torch" not in sys.modules and "tensorflow" not in sys.modules, "imported"
        """,
        name="plain.py",
    )
    out = gpu_trace("record", "--", sys.executable, str(plain))
    assert out.returncode == 0, out.stderr


def test_record_keras_fit_script(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    prog = script(
        tmp_path,
        """
        import numpy as np
        import keras

        x = np.random.rand(64, 8).astype("float32")
        y = np.random.randint(0, 3, 64)
        model = keras.Sequential([
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(3, name="logits"),
        ], name="classifier")
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        print(model(x[:2]).shape)
        """,
    )
    out = gpu_trace("record", "--tf", "op", "--", sys.executable, str(prog))
    assert out.returncode == 0, out.stderr
    got = names(last_run())
    assert {"classifier", "classifier.hidden", "classifier.logits"} <= got
    assert {f"ProfilerStep#{i}" for i in range(8)} <= got
    assert any(n.startswith("tf.function:") for n in got)
    assert "MatMul" in got


# Keras's guide "Writing a training loop from scratch" (TensorFlow backend), 6 batches: the
# eager loop with optimizer.apply, then the same step compiled with tf.function.
KERAS_GUIDE_LOOP = """
    import numpy as np
    import keras
    import tensorflow as tf

    inputs = keras.Input(shape=(8,), name="digits")
    x1 = keras.layers.Dense(16, activation="relu")(inputs)
    outputs = keras.layers.Dense(4, name="predictions")(x1)
    model = keras.Model(inputs=inputs, outputs=outputs)
    optimizer = keras.optimizers.Adam(learning_rate=1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    dataset = tf.data.Dataset.from_tensor_slices(
        (rng.random((48, 8), dtype=np.float32), rng.integers(0, 4, 48))
    ).batch(8)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss_value = loss_fn(y, logits)
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply(grads, model.trainable_weights)
        return loss_value

    step = tf.function(train_step) if COMPILED else train_step
    for x_batch, y_batch in dataset:
        step(x_batch, y_batch)
    print("done")
"""


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf.function"])
def test_record_keras_custom_loop_steps(tmp_path: Path, compiled: bool) -> None:
    pytest.importorskip("tensorflow")
    prog = script(tmp_path, KERAS_GUIDE_LOOP.replace("COMPILED", str(compiled)))
    out = gpu_trace("record", "--", sys.executable, str(prog))
    assert out.returncode == 0, out.stderr
    rows = sql_json(
        "SELECT name, start_ns, end_ns FROM gpu_trace.spans WHERE run_id = {r:String}"
        " AND lane = 'steps' ORDER BY start_ns",
        r=last_run()["run"]["run_id"],
    )
    assert [r["name"] for r in rows] == [f"ProfilerStep#{i}" for i in range(6)]
