"""Modules moved to a remote device keep their parameters as on a GPU: tied and shared weights stay
one parameter through ``.to("cuda")``, ``.cuda()``, ``.cpu()`` and ``load_state_dict``, the
parameter objects are the ones the program made (an optimizer made before the move trains the
moved model), and a GPT-2-like model trains bitwise as it does on the CPU. A real server on
loopback (CPU device), transparent mode as `record --remote` sets it up."""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gpu_trace import runtime
from gpu_trace.runtime.client import cuda, parameters
from gpu_trace.runtime.client import tensor as rt
from tests import serving

TOKEN = "parameters-test-token-0123"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving.served(tmp_path_factory.mktemp("home"), TOKEN, device="cpu") as (address, _):
        yield address


@pytest.fixture
def transparent(served: str) -> Iterator[None]:
    runtime.connect(served, token=TOKEN)
    cuda.patch()
    try:
        yield
    finally:
        cuda.unpatch()
        runtime.disconnect()
    assert not parameters.is_patched()


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-2's shape, small: token and position embeddings, pre-norm blocks, and an output layer
    whose weight is the token embedding's (tied, as GPT-2, nanoGPT and minGPT tie them)."""

    def __init__(self, vocab: int = 48, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(16, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def tied(model: TinyGPT) -> bool:
    return model.lm_head.weight is model.wte.weight


def train(model: TinyGPT, device: str, opt: torch.optim.Optimizer | None = None) -> list[float]:
    """Five AdamW steps on fixed batches; the losses."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 48, (6, 8, 13), generator=g)
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in data:
        x, y = batch[:, :-1].to(device), batch[:, 1:].to(device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def local_run() -> tuple[int, list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyGPT()
    assert tied(model)
    return len(list(model.parameters())), train(model, "cpu"), model.state_dict()


@pytest.mark.usefixtures("transparent")
@pytest.mark.parametrize("move", ["to", "cuda"])
def test_a_tied_model_moved_to_cuda_keeps_its_parameters_and_trains_as_on_the_cpu(
    move: str,
) -> None:
    """Before, the move made a parameter per module holding one: the tied weight became two
    (29 parameters instead of 28), each trained on its own."""
    cuda.unpatch()
    count, expected, _ = local_run()
    cuda.patch()
    torch.manual_seed(0)
    model = TinyGPT()
    before = list(model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # made before the move, as some do
    moved = model.to("cuda") if move == "to" else model.cuda()
    assert moved is model and tied(model)
    after = list(model.parameters())
    assert len(after) == count and all(a is b for a, b in zip(after, before))
    assert all(type(p) is rt.RemoteTensor and isinstance(p, nn.Parameter) for p in after)
    assert all(p.is_cuda and p.requires_grad for p in after)
    assert train(model, "cuda", opt) == expected  # bitwise


@pytest.mark.usefixtures("transparent")
def test_load_state_dict_cpu_and_half_keep_ties_and_the_servers_tensors() -> None:
    cuda.unpatch()
    count, _, trained = local_run()
    x = torch.randint(0, 48, (2, 12))
    local = TinyGPT()
    local.load_state_dict(trained)
    expected = local(x)
    cuda.patch()

    model = TinyGPT().to("cuda")
    model.load_state_dict(trained)  # CPU tensors into the remote parameters
    assert tied(model) and len(list(model.parameters())) == count
    assert torch.equal(model(x.cuda()).cpu(), expected.detach())

    # a state dict of remote tensors (a checkpoint of the moved model) into a fresh one
    again = TinyGPT().cuda()
    again.load_state_dict(model.state_dict())
    assert tied(again) and torch.equal(again(x.cuda()).cpu(), expected.detach())

    # and back: .cpu() keeps the parameters too, as on a GPU
    weight = model.wte.weight
    model.cpu()
    assert tied(model) and model.wte.weight is weight and weight.device.type == "cpu"
    assert torch.equal(model(x), expected)

    # .half() replaces each parameter's tensor in place (param.data = ...): the server's tensor
    # must follow, not only the client's dtype (before: a float16 parameter whose server tensor
    # was still float32, and addmm failed with "mat1 and mat2 must have the same dtype")
    torch.manual_seed(5)
    plain = nn.Linear(8, 4).half()
    torch.manual_seed(5)
    remote = nn.Linear(8, 4).cuda()
    w = remote.weight
    remote.half()
    assert remote.weight is w and w.dtype == torch.float16 and w.is_cuda
    assert torch.equal(w.cpu(), plain.weight.detach())
    xh = torch.randn(3, 8).half()
    assert torch.equal(remote(xh.cuda()).cpu(), plain(xh).detach())


def test_a_parameter_that_cannot_be_swapped_is_still_one_parameter(served: str) -> None:
    """Where a parameter cannot keep its object (``swap_tensors`` refuses one with a weak
    reference), every module that held it is given the one new parameter: still tied."""
    dev = runtime.connect(served, token=TOKEN)
    try:
        torch.manual_seed(0)
        model = TinyGPT()
        old = model.wte.weight
        ref = weakref.ref(old)
        count = len(list(model.parameters()))
        model.to(dev)
        assert tied(model) and len(list(model.parameters())) == count
        assert model.wte.weight is not old and ref() is old
        assert type(model.wte.weight) is rt.RemoteTensor
        assert torch.equal(model.wte.weight.cpu(), old.detach())
    finally:
        runtime.disconnect()
