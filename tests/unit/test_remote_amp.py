"""Mixed precision and optimizers on the remote device, against a real server on loopback (CPU
device): CUDA's autocast policy (runtime/client/autocast.py), GradScaler, fused and foreach
optimizers, in explicit mode (``torch.autocast("remote")``) and transparent mode on a CUDA build
without a GPU (tests/cuda_build.py: ``torch.autocast("cuda")``, ``GradScaler("cuda")``). Forwarded
results are compared bitwise with the same computation run locally on the CPU with CUDA's casts
applied by hand."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gpu_trace import runtime
from gpu_trace.runtime.client import autocast, autocast_table, cuda
from gpu_trace.runtime.protocol.errors import OpError
from gpu_trace.runtime.server import allowlist
from tests import serving
from tests.conftest import REPO
from tests.cuda_build import CudaBuild

TOKEN = serving.CPU_TOKEN
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Local references on one intra-op thread, as the server runs (``OMP_NUM_THREADS=1``): a
    CPU reduction's result depends on how many threads split it, so bitwise comparisons need
    the same count on both sides, whatever an earlier test left this process at."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving.cpu_server(tmp_path_factory.mktemp("home")) as address:
        yield address


@pytest.fixture
def dev(served: str) -> Iterator[torch.device]:
    with serving.connected(served) as device:
        yield device
    assert not autocast.is_patched()


@pytest.fixture
def transparent(served: str) -> Iterator[None]:
    """A CUDA build without a GPU, in transparent mode (what ``record --remote`` sets up)."""
    with CudaBuild():
        runtime.connect(served, token=TOKEN)
        cuda.patch()
        try:
            yield
        finally:
            cuda.unpatch()
            runtime.disconnect()


class Forwarded(TorchDispatchMode):
    """The ATen ops that reach the remote tensors (what is forwarded), with their inputs'
    dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat = [*args, *(kwargs or {}).values()]
        flat = [x for v in flat for x in (v if isinstance(v, (list, tuple)) else [v])]
        self.ops.append((func.__name__, [t.dtype for t in flat if isinstance(t, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def _same(remote: torch.Tensor, local: torch.Tensor) -> bool:
    return remote.dtype == local.dtype and torch.equal(remote.cpu(), local)


# ---- the policy table -------------------------------------------------------------------------


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "make_autocast_table", REPO / "scripts" / "make_autocast_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_is_the_installed_headers_and_cudas_registrations() -> None:
    """The committed table is what the generator makes from this torch's ``autocast_mode.h``,
    and names exactly the ops this torch registers an ``AutocastCUDA`` kernel for."""
    gen = _generator()
    parsed = gen.parse(gen.installed_header().read_text())
    for policy, ops in parsed.items():
        assert getattr(autocast_table, policy) == ops, policy
    tabled = {o.split("=")[0] for ops in parsed.values() for o in ops}
    registered = set()
    for full in torch._C._dispatch_get_all_op_names():
        if full.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(
            full, "AutocastCUDA"
        ):
            name = full[len("aten::") :]
            registered.add(name if "." in name else f"{name}.default")
    # A build with cuDNN registers its RNN's own cast too (aten/src/ATen/cudnn/AutocastRNN.cpp):
    # the forwarded LSTM runs whole on the server, outside these lists (docs/remote.md).
    assert tabled == registered - {"_cudnn_rnn.default"}


# ---- explicit mode: torch.autocast("remote") ----------------------------------------------------


def test_ops_under_autocast_run_in_cudas_dtypes(dev: torch.device) -> None:
    """Low-precision ops cast to the autocast dtype, float32 ops to float32, dtype= ops get
    float32, promote ops the widest input; each result bitwise the local op on those casts."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(4, 8, generator=g),
        torch.randn(6, 8, generator=g),
        torch.randn(6, generator=g),
    )
    img, k = torch.randn(1, 2, 5, 5, generator=g), torch.randn(3, 2, 3, 3, generator=g)
    rx, rw, rb, rimg, rk = (t.to(dev) for t in (x, w, b, img, k))
    xb, wb, bb = x.to(BF16), w.to(BF16), b.to(BF16)
    seen = Forwarded()
    with torch.autocast("remote", dtype=BF16):
        with seen:
            lin = F.linear(rx, rw, rb)
        assert _same(lin, F.linear(xb, wb, bb))
        assert _same(F.conv2d(rimg, rk), F.conv2d(img.to(BF16), k.to(BF16)))
        assert _same(rx @ rw.t(), xb @ wb.t())
        low = rx.to(BF16)  # an activation in the low dtype, as a low-precision op leaves it
        assert _same(low.softmax(-1), xb.softmax(-1, dtype=F32))
        assert _same(low.sum(), xb.sum(dtype=F32))
        assert _same(F.layer_norm(low, (8,)), F.layer_norm(xb.float(), (8,)))
        assert _same(F.mse_loss(low, rx), F.mse_loss(xb.float(), x))
        assert _same(low.exp(), xb.float().exp())
        assert _same(torch.ops.aten.norm.Scalar(low, 2), torch.norm(xb, 2, dtype=F32))
        assert _same(torch.addcmul(low, low, rx), torch.addcmul(xb.float(), xb.float(), x))
        assert _same(torch.atan2(low, low), torch.atan2(xb, xb))
        double = rx.double()
        assert _same(double @ double.t(), x.double() @ x.double().t())  # doubles untouched
        with pytest.raises(RuntimeError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(low.sigmoid(), rx.sigmoid())
        with pytest.raises(RuntimeError, match="cannot promote"):
            torch.atan2(low, rx.to(F16))
    casts = [dtypes for name, dtypes in seen.ops if name.startswith("_to_copy")]
    assert casts == [[F32]] * 3  # input, weight and bias cast on the client's side
    assert ("addmm.default", [BF16, BF16, BF16]) in seen.ops


def test_attention_travelling_whole_gets_its_casts(dev: torch.device) -> None:
    """``scaled_dot_product_attention`` runs whole on the server, without autocast: the client
    casts its arguments as the op's autocast kernel would (a float32 mask with bfloat16 queries
    was refused by the server's kernel)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
    rq, rk, rv, rmask = (t.to(dev) for t in (q, k, v, mask))
    with torch.autocast("remote", dtype=BF16):
        out = F.scaled_dot_product_attention(rq, rk, rv.to(BF16), attn_mask=rmask)
    local = F.scaled_dot_product_attention(
        q.to(BF16), k.to(BF16), v.to(BF16), attn_mask=mask.to(BF16)
    )
    assert _same(out, local)


def test_weights_are_cast_once_per_region(dev: torch.device) -> None:
    """A weight (a float32 leaf that requires grad) used twice is cast once, as ATen's cache
    does, and cast again in the next region; activations are cast each time."""
    w = torch.randn(8, 8).to(dev).requires_grad_()
    x = torch.randn(4, 8).to(dev)

    def casts() -> int:
        seen = Forwarded()
        with torch.autocast("remote", dtype=BF16), seen:
            (x @ w @ w).sum()
        return sum(1 for name, _ in seen.ops if name.startswith("_to_copy"))

    assert casts() == 2  # x once, w once (not twice)
    assert casts() == 2  # and again: the cache ended with the region
    w.grad = None
    local_w = w.detach().cpu().requires_grad_()
    with torch.autocast("remote", dtype=BF16):
        remote = (x @ w @ w).float().sum()
    remote.backward()
    wb = local_w.to(BF16)
    (x.cpu().to(BF16) @ wb @ wb).float().sum().backward()
    assert torch.equal(w.grad.cpu(), local_w.grad)  # one cast node: its gradients summed in bf16


def test_autocast_remote_needs_the_backend_module(dev: torch.device) -> None:
    assert torch.remote.get_amp_supported_dtype() == [F16, BF16]  # type: ignore[attr-defined]
    with torch.autocast("remote"):  # CUDA's default dtype
        assert torch.get_autocast_dtype("remote") == F16
        assert (torch.ones(2, 2, device=dev) @ torch.ones(2, 2, device=dev)).dtype == F16


class MLP(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))


def _reference_loss(m: MLP, x: torch.Tensor, y: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """The MLP's loss on the CPU with CUDA's autocast casts written out."""
    h = F.linear(x.to(low), m[0].weight.to(low), m[0].bias.to(low))
    h = F.layer_norm(h.float(), (32,), m[1].weight, m[1].bias).relu()
    out = F.linear(h.to(low), m[3].weight.to(low), m[3].bias.to(low))
    return F.mse_loss(out.float(), y)


def _train(device: Any, kind: str, steps: int, low: torch.dtype | None, **opt: Any) -> dict:
    """A few steps (``low``: under autocast; on the CPU, :func:`_reference_loss`); the losses,
    params and optimizer state, on the CPU."""
    torch.manual_seed(0)
    model = MLP()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    on_cpu = torch.device(device).type == "cpu"
    model, x, y = model.to(device), x.to(device), y.to(device)
    optimizer = getattr(torch.optim, kind)(model.parameters(), lr=0.05, **opt)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        if low is None:
            loss = F.mse_loss(model(x), y)
        elif on_cpu:
            loss = _reference_loss(model, x, y, low)
        else:
            with torch.autocast(torch.device(device).type, dtype=low):
                loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    state = [
        {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for s in optimizer.state.values()
    ]
    return {
        "losses": losses,
        "params": [p.detach().cpu() for p in model.parameters()],
        "state": state,
    }


def _assert_same_run(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"], strict=True))
    assert len(a["state"]) == len(b["state"])
    for s, t in zip(a["state"], b["state"]):
        assert s.keys() == t.keys()
        for key in s:
            assert (
                torch.equal(s[key], t[key])
                if isinstance(s[key], torch.Tensor)
                else s[key] == t[key]
            )


def test_autocast_training_is_bitwise_the_local_casts(dev: torch.device) -> None:
    _assert_same_run(
        _train(dev, "AdamW", 3, BF16, fused=True), _train("cpu", "AdamW", 3, BF16, fused=True)
    )


@pytest.mark.parametrize("kind", ["AdamW", "Adam", "SGD"])
@pytest.mark.parametrize("how", ["fused", "foreach"])
def test_fused_and_foreach_optimizers_are_bitwise_local(
    dev: torch.device, kind: str, how: str
) -> None:
    extra = {"momentum": 0.9} if kind == "SGD" else {}
    _assert_same_run(
        _train(dev, kind, 2, None, **{how: True}, **extra),
        _train("cpu", kind, 2, None, **{how: True}, **extra),
    )


def _scaled(device: Any, scaler_device: str, poisoned: int) -> dict:
    """Steps with a GradScaler (growth every 2 steps) and a fused AdamW (which takes the scale
    and found_inf itself); step ``poisoned``'s loss is infinite: skipped, scale backed off."""
    torch.manual_seed(0)
    model = MLP().to(device)
    x, y = torch.randn(8, 16).to(device), torch.randn(8, 4).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    scaler = torch.amp.GradScaler(scaler_device, init_scale=2.0**10, growth_interval=2)
    losses, scales = [], []
    for step in range(5):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        if step == poisoned:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return {
        "losses": losses,
        "scales": scales,
        "params": [p.detach().cpu() for p in model.parameters()],
        "state": [],
    }


def test_grad_scaler_updates_and_skips_as_locally(dev: torch.device) -> None:
    remote, local = _scaled(dev, "remote", 2), _scaled("cpu", "cpu", 2)
    assert remote["scales"] == local["scales"] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
    assert remote["scales"] == local["scales"]
    _assert_same_run(remote, local)


# ---- transparent mode on a CUDA build without a GPU --------------------------------------------


def test_cuda_autocast_and_grad_scaler_act_on_the_remote_device(transparent: None) -> None:
    """``torch.autocast("cuda")`` (and the deprecated ``torch.cuda.amp.autocast``) cast the
    forwarded ops; ``GradScaler("cuda")`` with a fused AdamW trains as the CPU reference."""
    torch.manual_seed(0)
    model = MLP().cuda()
    x, y = torch.randn(8, 16).cuda(), torch.randn(8, 4).cuda()
    with torch.autocast("cuda", dtype=BF16):
        assert model(x).dtype == BF16
        assert torch.is_autocast_enabled("remote")
    assert not torch.is_autocast_enabled("remote")
    with pytest.warns(FutureWarning), torch.cuda.amp.autocast():
        assert model(x).dtype == F16

    torch.manual_seed(0)
    model = MLP().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
    torch.manual_seed(0)
    ref = MLP()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, fused=True)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for _ in range(3):
        for m, opt, sc, remote in (
            (model, optimizer, scaler, True),
            (ref, ref_opt, ref_scaler, False),
        ):
            opt.zero_grad()
            if remote:
                with torch.autocast("cuda", dtype=F16):
                    loss = F.mse_loss(m(x), y)
                remote_loss = loss
            else:
                loss = _reference_loss(m, x.cpu(), y.cpu(), F16)
                assert remote_loss.item() == loss.item()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
    assert all(
        torch.equal(p.cpu(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())
    )


def test_cuda_autocast_is_left_alone_outside_transparent_mode(dev: torch.device) -> None:
    """Only transparent mode maps ``cuda`` autocast onto the remote device."""
    a = torch.ones(2, 2, device=dev)
    torch.set_autocast_enabled("cuda", True)  # what torch.autocast("cuda") sets, where it can
    try:
        assert not torch.is_autocast_enabled("remote") and (a @ a).dtype == F32
    finally:
        torch.set_autocast_enabled("cuda", False)


# ---- the server's bounds rules --------------------------------------------------------------


def _run(name: str, args: list, kwargs: dict | None = None) -> Any:
    op = allowlist.resolve(name)
    assert op is not None, f"{name} is not allowed"
    kwargs = kwargs or {}
    rule = allowlist.rule(op)
    if rule is not None:
        rule(args, kwargs)
    return op(*args, **kwargs)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ({"grad_scale": torch.empty(0)}, "grad_scale must have one element, not 0"),
        ({"found_inf": torch.zeros(3)}, "found_inf must have one element, not 3"),
        ({"grad_scale": torch.ones((), dtype=torch.float64)}, "grad_scale must be float32"),
    ],
)
def test_fused_optimizers_take_one_element_scales(extra: dict, why: str) -> None:
    """The CPU kernel reads ``grad_scale``/``found_inf`` as one float unchecked (an empty
    ``grad_scale`` was read past its storage: NaN params)."""
    params = [torch.ones(4)]
    kwargs = {"lr": 0.1, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "eps": 1e-8}
    kwargs.update(amsgrad=False, maximize=False, **extra)
    args = [params, [torch.ones(4)], [torch.zeros(4)], [torch.zeros(4)], [], [torch.zeros(())]]
    with pytest.raises(OpError, match=why):
        _run("aten::_fused_adamw_.default", args, kwargs)
    assert torch.equal(params[0], torch.ones(4))


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (
            [torch.ones(0), torch.zeros((), dtype=torch.int32), torch.zeros(())],
            "self must have one",
        ),
        (
            [torch.ones(()), torch.zeros((), dtype=torch.int64), torch.zeros(())],
            "growth_tracker must be int32",
        ),
        (
            [torch.ones(()), torch.zeros((), dtype=torch.int32), torch.zeros(2)],
            "found_inf must have one",
        ),
    ],
)
def test_grad_scaler_update_takes_one_element_tensors(args: list, why: str) -> None:
    with pytest.raises(OpError, match=why):
        _run("aten::_amp_update_scale_.default", [*args, 2.0, 0.5, 2])


def test_grad_scaler_unscale_takes_one_element_tensors() -> None:
    grads = [torch.ones(3)]
    with pytest.raises(OpError, match="inv_scale must have one element"):
        _run(
            "aten::_amp_foreach_non_finite_check_and_unscale_.default",
            [grads, torch.zeros(()), torch.ones(0)],
        )
    _run(
        "aten::_amp_foreach_non_finite_check_and_unscale_.default",
        [grads, torch.zeros(()), torch.full((), 0.5)],
    )
    assert torch.equal(grads[0], torch.full((3,), 0.5))


@pytest.mark.parametrize("which", ["bf16", "fp16"])
def test_the_gpu_tests_program_runs_forwarded_from_a_cuda_build(
    served: str, which: str, tmp_path: Path
) -> None:
    """tests/gpu/test_forward_amp_gpu.py's program, as its GPU-less client runs it (transparent
    mode, a CUDA build without a GPU), against this CPU server: it trains on the server, its
    session opened at the device's first use (it once asserted a session at torch's import)."""
    from tests.gpu.test_forward_amp_gpu import PROGRAM

    prog = tmp_path / "amp.py"
    prog.write_text("from tests.cuda_build import apply; apply()\n" + PROGRAM)
    env = {
        **os.environ,
        "GPU_TRACE_REMOTE": served,
        "GPU_TRACE_REMOTE_TOKEN": TOKEN,
        "GPU_TRACE_HOME": str(tmp_path / "home"),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    out = serving.result(
        subprocess.run(
            [sys.executable, str(prog), which],
            capture_output=True, text=True, env=env, cwd=REPO, timeout=240,
        )
    )  # fmt: skip
    assert len(out["losses"]) == 5
    if which == "fp16":
        assert out["losses"][2] == "inf" and out["scales"][2] < out["scales"][1]
