"""PyTorch patches: results unchanged, module tree, backward, training structure, ops, symmetry."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import gpu_trace  # noqa: E402
from gpu_trace import _api  # noqa: E402
from gpu_trace.framework_patches import hooks  # noqa: E402
from gpu_trace.framework_patches import torch as pytorch  # noqa: E402
from tests.conftest import recorded  # noqa: E402
from tests.span_checks import problems  # noqa: E402


def spans(run_dir: Path) -> list[dict]:
    return sorted(recorded(run_dir), key=lambda r: (r["start_ns"], -r["end_ns"]))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.ReLU(inplace=True), nn.MaxPool2d(2), nn.Conv2d(4, 8, 3)
        )
        self.head = nn.Linear(8 * 3 * 3, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(6, 12, num_layers=2, batch_first=True)
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        y, (h, c) = self.rnn(x)
        return self.out(y[:, -1])


def transformer() -> nn.Module:
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    return nn.Sequential(nn.Linear(8, 16), nn.TransformerEncoder(layer, num_layers=2))


MODELS = {
    "cnn": (CNN, lambda: torch.randn(4, 1, 12, 12)),
    "lstm": (LSTM, lambda: torch.randn(4, 5, 6)),
    "transformer": (transformer, lambda: torch.randn(2, 7, 8)),
}


def train_once(name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    make, data = MODELS[name]
    torch.manual_seed(0)
    model = make()
    x = data()
    out = model(x)  # dropout in the transformer draws from the RNG: the patches must not
    out.square().mean().backward()
    return out.detach(), [p.grad for p in model.parameters()]


@pytest.fixture
def record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def start(level: str = "module", **env: str) -> Path:
        monkeypatch.setenv("GPU_TRACE_TORCH", level)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        run = tmp_path / f"run-{level}"
        gpu_trace.start(run)
        return run

    yield start
    gpu_trace.stop()
    for run in tmp_path.glob("run-*"):  # every run nests (tests/span_checks.py)
        assert problems(recorded(run)) == [], run.name


@pytest.mark.parametrize("level", ["module", "op"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_outputs_and_gradients_are_bitwise_equal(name: str, level: str, record) -> None:
    out0, grads0 = train_once(name)
    run = record(level)
    assert pytorch.is_patched()
    out1, grads1 = train_once(name)
    gpu_trace.stop()
    assert torch.equal(out0, out1)
    assert len(grads0) == len(grads1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    names = {s["name"] for s in spans(run)}
    assert {"Tensor.backward"} <= names
    assert any(n.endswith(".backward") and n != "Tensor.backward" for n in names)


def test_module_tree_forward_and_backward_nest(record) -> None:
    run = record()
    train_once("cnn")
    gpu_trace.stop()
    rows = spans(run)
    by_id = {r["span_id"]: r for r in rows}
    mods = {r["name"]: r for r in rows if r["category"] == "module"}
    assert {"CNN", "CNN.features", "CNN.features.0", "CNN.features.3", "CNN.head"} <= set(mods)
    assert by_id[mods["CNN.features.0"]["parent_span_id"]]["name"] == "CNN.features"
    assert by_id[mods["CNN.features"]["parent_span_id"]]["name"] == "CNN"
    assert mods["CNN.features.0"]["lane"] == "nvtx/torch"
    assert mods["CNN.head"]["attrs"] == [("module", "Linear")]
    bw = mods["CNN.features.3.backward"]
    assert by_id[bw["parent_span_id"]]["name"] == "CNN.features.backward"
    assert by_id[mods["CNN.backward"]["parent_span_id"]]["name"] == "Tensor.backward"
    for r in rows:  # children lie inside their parents
        p = by_id.get(r["parent_span_id"])
        if p is not None:
            assert p["start_ns"] <= r["start_ns"] <= r["end_ns"] <= p["end_ns"], r["name"]


class TrainStep(nn.Module):
    """Calls backward inside its forward (module level: before its hooks are placed)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))

    def forward(self, x):
        self.net(x).sum().backward()
        return x


@pytest.mark.parametrize("thread", ["recording", "another"])
def test_backward_called_inside_a_module_has_module_backward_ranges(record, thread) -> None:
    """Also on a thread other than the one that started recording (its calls place hooks,
    before the backward inside the forward runs)."""
    import threading

    run = record()
    if thread == "another":
        t = threading.Thread(target=lambda: TrainStep()(torch.randn(2, 3)))
        t.start()
        t.join()
    else:
        TrainStep()(torch.randn(2, 3))
    gpu_trace.stop()
    rows = spans(run)
    by_id = {r["span_id"]: r for r in rows}
    mods = {r["name"]: r for r in rows}
    assert {"TrainStep.net.0.backward", "TrainStep.net.2.backward"} <= set(mods)
    assert by_id[mods["TrainStep.net.2.backward"]["parent_span_id"]]["name"] == (
        "TrainStep.net.backward"
    )
    assert by_id[mods["TrainStep.net.backward"]["parent_span_id"]]["name"] == "Tensor.backward"


def test_training_loop_gives_steps_optimizer_and_dataloader(record) -> None:
    run = record()
    torch.manual_seed(0)
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(12, 1, 12, 12), torch.randint(0, 10, (12,)))
    for x, y in torch.utils.data.DataLoader(data, batch_size=4):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    gpu_trace.stop()
    rows = spans(run)
    steps = [r for r in rows if r["category"] == "step"]
    assert [s["name"] for s in steps] == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    assert all(s["lane"] == "steps" for s in steps)
    names = [r["name"] for r in rows]
    assert names.count("Optimizer.step#SGD.step") == 3
    assert "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__" in names
    for s in steps:  # each step holds its forward, backward and optimizer step
        inside = {r["name"] for r in rows if s["start_ns"] <= r["start_ns"] <= s["end_ns"]}
        assert {"CNN", "Tensor.backward", "Optimizer.step#SGD.step"} <= inside


def test_user_steps_win(record) -> None:
    run = record()
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(2):
        gpu_trace.step(10 + i)
        model(torch.randn(1, 1, 12, 12)).sum().backward()
        opt.step()
    gpu_trace.stop()
    steps = [r["name"] for r in spans(run) if r["category"] == "step"]
    assert steps == ["ProfilerStep#10", "ProfilerStep#11"]


def test_op_level_records_aten_and_backward_ops_with_shapes(record) -> None:
    run = record("op", GPU_TRACE_TORCH_SHAPES="1")
    train_once("cnn")
    gpu_trace.stop()
    ops = [r for r in spans(run) if r["category"] == "op"]
    names = {r["name"] for r in ops}
    assert {"aten::conv2d", "aten::linear", "aten::relu_"} <= names
    assert any(n.startswith("autograd::engine::evaluate_function: ") for n in names)
    conv = next(r for r in ops if r["name"] == "aten::conv2d")
    attrs = dict(conv["attrs"])
    assert attrs["input_shapes"].startswith("[[4, 1, 12, 12], [4, 1, 3, 3]")
    assert attrs["input_dtypes"].startswith("float32,float32")
    mods = [r for r in spans(run) if r["name"] == "CNN.features.0"]
    assert mods and mods[0]["start_ns"] <= conv["start_ns"] <= conv["end_ns"] <= mods[0]["end_ns"]


def module_backward(rows: list[dict]) -> list[tuple]:
    by_id = {r["span_id"]: r for r in rows}
    return [
        (r["name"], by_id[r["parent_span_id"]]["name"], r["depth"], r["lane"])
        for r in rows
        if r["category"] == "module"
        and r["name"].endswith(".backward")
        and r["name"] != "Tensor.backward"
    ]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_op_level_makes_module_backward_ranges_from_ops_without_hooks(name: str, record) -> None:
    """The same module backward ranges as module level's hooks, made from the collected ops."""
    expected = {}
    for level in ("module", "op"):
        run = record(level)
        torch.manual_seed(0)
        model = MODELS[name][0]()
        x = MODELS[name][1]()
        for _ in range(2):
            out = model(x)
            if level == "op":  # no hook was placed on the graph
                assert "gpu_trace" not in out.grad_fn.metadata
            out.square().mean().backward()
        gpu_trace.stop()
        rows = spans(run)
        expected[level] = module_backward(rows)
    assert expected["op"] == expected["module"]
    assert len(expected["op"]) >= 4
    by_id = {r["span_id"]: r for r in rows}
    for r in rows:  # children lie inside their parents, across module ranges and ops
        p = by_id.get(r["parent_span_id"])
        if p is not None:
            assert p["start_ns"] <= r["start_ns"] <= r["end_ns"] <= p["end_ns"], r["name"]
    if name == "cnn":  # each module's backward holds its own nodes
        ranges = [r for r in rows if r["name"] == "CNN.head.backward"]
        nodes = [r for r in rows if r["name"].endswith("evaluate_function: AddmmBackward0")]
        assert len(ranges) == len(nodes) == 2
        for rng, node in zip(ranges, nodes):
            assert rng["start_ns"] <= node["start_ns"] <= node["end_ns"] <= rng["end_ns"]


def test_op_level_module_backward_across_sessions_and_inside_a_module(record, monkeypatch):
    """A forward and its backward in different op sessions; backward called inside forward."""
    from gpu_trace.framework_patches.torch import ops as torch_ops

    monkeypatch.setattr(torch_ops, "HARVEST_INTERVAL_S", 0.0)  # every top-level call cycles
    run = record("op")
    model, loss = CNN(), nn.CrossEntropyLoss()
    out = model(torch.randn(2, 1, 12, 12))
    loss(out, torch.tensor([1, 2])).backward()  # the loss module started a new session
    TrainStep()(torch.randn(2, 3))
    gpu_trace.stop()
    got = set(module_backward(spans(run)))
    assert ("CNN.features.0.backward", "CNN.features.backward", 3, "nvtx/torch") in got
    assert ("CNN.backward", "Tensor.backward", 1, "nvtx/torch") in got
    assert ("TrainStep.net.2.backward", "TrainStep.net.backward", 3, "nvtx/torch") in got


def module_rows(run: Path) -> list[tuple]:
    rows = spans(run)
    by_id = {r["span_id"]: r for r in rows}
    return [
        (r["name"], by_id.get(r["parent_span_id"], {}).get("name"), r["depth"], r["lane"])
        + (r["category"], r["attrs"])
        for r in rows
    ]


def test_module_ranges_from_the_c_call_equal_the_python_ones(record, monkeypatch) -> None:
    """The wrapper's range opened and closed by the tracer's C call (``call_in_range``) is the
    one ``spans.begin``/``end`` (its Python twin) record: same names, nesting, lane, category,
    attributes, next to a user range."""
    from gpu_trace.framework_patches.torch import modules as torch_modules

    got = []
    for native in (True, False):
        run = record(TAG=str(native))
        assert (torch_modules._in_range is not None) == (gpu_trace.range is not _api.PyRange)
        if not native:
            monkeypatch.setattr(torch_modules, "_in_range", None)
        with gpu_trace.range("user"):
            train_once("cnn")
        gpu_trace.stop()
        got.append(module_rows(run))
        run.rename(run.with_name(f"run-{native}"))
    assert got[0] == got[1]
    assert ("CNN.head", "CNN", 2, "nvtx/torch", "module", [("module", "Linear")]) in got[0]


@pytest.mark.parametrize("native", [True, False])
def test_exception_in_forward_propagates_and_ranges_close(record, monkeypatch, native) -> None:
    from gpu_trace.framework_patches.torch import modules as torch_modules

    class Boom(nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    model = nn.Sequential(nn.Linear(2, 2), Boom())
    run = record()
    if not native:
        monkeypatch.setattr(torch_modules, "_in_range", None)
    with pytest.raises(KeyError, match="boom"):
        model(torch.randn(1, 2))
    with gpu_trace.range("after"):
        model[0](torch.randn(1, 2))
    gpu_trace.stop()
    rows = {r["name"]: r for r in spans(run)}
    assert rows["Sequential.1"]["parent_span_id"] == rows["Sequential"]["span_id"]
    assert rows["Sequential"]["depth"] == 0
    assert rows["Sequential.0"]["depth"] == 1 and rows["after"]["depth"] == 0


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_own_hooks_scripted_and_compiled_modules_keep_working(record) -> None:
    seen = []
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    model[0].register_forward_hook(lambda m, a, o: seen.append(o.shape))
    model[0].register_full_backward_hook(lambda m, gi, go: seen.append("bw"))
    scripted = torch.jit.script(nn.Sequential(nn.Linear(3, 3)))
    compiled = torch.compile(nn.Sequential(nn.Linear(3, 3)), backend="eager")
    x = torch.randn(2, 3, requires_grad=True)
    expected = (scripted(x), compiled(x))
    run = record()
    model(x).sum().backward()
    assert torch.equal(scripted(x), expected[0]) and torch.equal(compiled(x), expected[1])
    gpu_trace.stop()
    assert seen == [torch.Size([2, 3]), "bw"]
    names = {r["name"] for r in spans(run)}
    assert {"Sequential.0", "RecursiveScriptModule", "OptimizedModule"} <= names


def test_patch_is_idempotent_and_symmetric() -> None:
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o

    def hooks() -> list[int]:
        return [
            len(d)
            for d in (
                m._global_forward_pre_hooks,
                m._global_forward_hooks,
                m._global_backward_hooks,
                o._global_optimizer_pre_hooks,
            )
        ]

    hooks_before = hooks()
    call, backward = nn.Module.__call__, torch.Tensor.backward
    pytorch.patch(torch, "op")
    pytorch.patch(torch, "module")
    assert nn.Module.__call__ is not call and nn.Module.__call__.__wrapped__ is call
    assert len(m._global_forward_hooks) == hooks_before[1]  # module calls keep the fast path
    assert pytorch._ops is None  # no recorder: no observer filling buffers nobody drains
    pytorch.unpatch()
    pytorch.unpatch()
    assert nn.Module.__call__ is call and torch.Tensor.backward is backward
    assert hooks() == hooks_before
    assert not pytorch.is_patched()


def test_module_compiled_while_recording_traces_without_graph_breaks(record) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    expected = model(x)
    run = record()
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # a graph break raises
    assert torch.equal(compiled(x), expected)
    gpu_trace.stop()
    names = [r["name"] for r in spans(run) if r["category"] == "module"]
    assert "OptimizedModule" in names
    assert not any(n.startswith("Sequential") for n in names)  # inside the compiled graph


def test_dynamo_imported_while_patched_knows_the_real_module_call(tmp_path: Path) -> None:
    """torch._dynamo keeps the nn.Module.__call__ it sees at import: it must be the real one."""
    prog = textwrap.dedent(
        """
        import sys
        import gpu_trace

        gpu_trace.start(sys.argv[1])
        import torch
        from torch import nn

        assert "torch._dynamo" not in sys.modules
        real = nn.Module.__call__.__wrapped__
        model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
        x = torch.randn(2, 3)
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        assert torch.equal(compiled(x), model(x))
        from torch._dynamo import utils
        from torch._dynamo.variables import nn_module

        assert utils.unpatched_nn_module_call is real
        assert nn_module.unpatched_nn_module_call is real
        gpu_trace.stop()
        assert nn.Module.__call__ is real
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_TRACE_")}
    env.update(GPU_TRACE_HOME=str(tmp_path / "home"), GPU_TRACE_TORCH="module")
    out = subprocess.run(
        [sys.executable, "-c", prog, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_off_and_bad_levels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert pytorch.patch(torch, "off") == [] and not pytorch.is_patched()
    with pytest.raises(ValueError):
        pytorch.patch(torch, "kernel")
    monkeypatch.setenv("GPU_TRACE_TORCH", "off")
    gpu_trace.start(tmp_path / "run")
    assert not pytorch.is_patched()
    gpu_trace.stop()
    assert not hooks.is_patched()


def test_unpatchable_part_is_reported_once(monkeypatch, caplog) -> None:
    from gpu_trace.framework_patches.torch import training as torch_training

    def broken(torch):
        raise AttributeError("no optimizer hooks in this version")

    monkeypatch.setattr(torch_training, "patch", broken)
    failed = pytorch.patch(torch, "module")
    try:
        assert len(failed) == 1 and "no optimizer hooks" in failed[0]
        assert sum("not captured" in r.getMessage() for r in caplog.records) == 1
        assert pytorch.is_patched()  # module ranges still work
    finally:
        pytorch.unpatch()
