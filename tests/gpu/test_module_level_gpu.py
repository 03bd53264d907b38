"""Module level on a CUDA model: backward ranges from the autograd nodes the native observer
records (the nodes run on the autograd engine's CUDA device thread, not the recording thread),
one per forward module call, the same modules as with Python hooks, and nothing overlapping."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn


def record(tmp_path, monkeypatch, ops: str | None) -> list[dict]:
    import gpu_trace
    from tests.conftest import recorded

    monkeypatch.setenv("GPU_TRACE_TORCH", "module")
    if ops is None:
        monkeypatch.delenv("GPU_TRACE_TORCH_OPS", raising=False)
    else:
        monkeypatch.setenv("GPU_TRACE_TORCH_OPS", ops)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16, device="cuda")
    run = tmp_path / f"run-{ops}"
    gpu_trace.start(run)
    try:
        for _ in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()
    finally:
        gpu_trace.stop()
    return recorded(run)


def test_cuda_backward_ranges_one_per_call_from_the_observer_as_from_hooks(tmp_path, monkeypatch):
    from gpu_trace.framework_patches.torch import ops_native
    from tests.span_checks import problems

    if not ops_native.available():
        pytest.skip("the native observer is not built here (no C++ compiler?)")
    native = record(tmp_path, monkeypatch, None)
    hooks = record(tmp_path, monkeypatch, "kineto")
    for rows in (native, hooks):
        assert problems(rows) == []
    names = {
        n: sorted(r["name"] for r in rows if r["name"].endswith(".backward"))
        for n, rows in (("native", native), ("hooks", hooks))
    }
    assert names["native"] == names["hooks"]
    assert names["native"].count("Sequential.backward") == 3
    assert names["native"].count("Sequential.2.backward") == 3
