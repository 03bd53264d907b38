"""`gpu-trace record` of unmodified training scripts: module tree, steps and ops in `gpu-trace show`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.test_record import gpu_trace, last_run, script, sql_json

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
