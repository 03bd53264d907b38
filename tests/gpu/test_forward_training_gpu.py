"""Training forwarded to a CUDA server, bitwise equal to the same program run on the GPU locally
(skipped without a GPU).

The server is `gpu-trace serve` in its own process, on cuda:0; the client sees no GPU
(``CUDA_VISIBLE_DEVICES=""``) and uses ``runtime.connect``. Three models, each a few AdamW steps:
a GPT-style transformer (embedding, two pre-norm ``nn.TransformerEncoderLayer``s, causal
attention, a linear head), an LSTM and a CNN. The transformer's attention
(``scaled_dot_product_attention``) and the LSTM run whole on the server with autograd
(``rt::fn``, ``rt::backward``): their decomposition on the client's ``remote`` device would not be
the kernels a local run uses, so only whole are they bitwise the same. Their backward failed inside
PyTorch when the server's process had the ``remote`` backend registered (issue 16:
``opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED``).

Deterministic settings on both sides, since some of these kernels are not by default (the
memory-efficient attention's backward splits keys with atomics, cuDNN may pick nondeterministic
convolution algorithms): ``torch.use_deterministic_algorithms(True)`` in the program and in the
server's process (set when the server imports torch), ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` for both.
Dropout 0; weights and data drawn on the CPU, so both runs start from the same bytes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import serving

TOKEN = "forward-training-gpu-token-01"
PROGRAM = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch, torch.nn as nn, torch.nn.functional as F

    torch.use_deterministic_algorithms(True)
    which, where = sys.argv[1], sys.argv[2]
    if where == "local":
        device = torch.device("cuda")
    else:
        from gpu_trace import runtime  # before any backward: the remote device is registered
        assert not torch.cuda.is_available()  # the client sees no GPU
        device = runtime.connect(where)

    class GPT(nn.Module):
        def __init__(self, vocab=512, d=128, heads=4, t=32):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.pos = nn.Parameter(torch.randn(t, d) * 0.02)
            self.layers = nn.ModuleList(
                nn.TransformerEncoderLayer(
                    d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(2)
            )
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab)

        def forward(self, idx, mask):
            x = self.emb(idx) + self.pos
            for layer in self.layers:
                x = layer(x, src_mask=mask, is_causal=True)
            return self.head(self.norm(x))

    class LSTMNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(16, 64, num_layers=2, batch_first=True)
            self.head = nn.Linear(64, 8)

        def forward(self, x):
            out, _ = self.lstm(x)
            return self.head(out[:, -1])

    def cnn():
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
            nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
        )

    def xent(logits, onehot):  # cross-entropy without nll_loss, whose CUDA kernels may use atomics
        return -(F.log_softmax(logits, -1) * onehot).sum(-1).mean()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if which == "gpt":
        model = GPT()
        tokens = torch.randint(0, 512, (8, 33), generator=g)
        mask = nn.Transformer.generate_square_subsequent_mask(32).to(device)
        x = tokens[:, :-1].to(device)
        y = F.one_hot(tokens[:, 1:], 512).float().to(device)
        def loss_of(m):
            return xent(m(x, mask), y)
    elif which == "lstm":
        model = LSTMNet()
        x = torch.randn(16, 12, 16, generator=g).to(device)
        y = torch.randn(16, 8, generator=g).to(device)
        def loss_of(m):
            return F.mse_loss(m(x), y)
    else:
        model = cnn()
        x = torch.randn(16, 3, 16, 16, generator=g).to(device)
        y = F.one_hot(torch.randint(0, 10, (16,), generator=g), 10).float().to(device)
        def loss_of(m):
            return xent(m(x), y)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    print("RESULT " + json.dumps({"losses": losses, "params": digest.hexdigest()}), flush=True)
    """
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    with serving.served(tmp_path_factory.mktemp("home"), TOKEN, deterministic=True) as server:
        yield server


@pytest.mark.parametrize("which", ["gpt", "lstm", "cnn"])
def test_forwarded_training_is_bitwise_the_local_one(
    served: tuple[str, dict[str, str]], which: str, tmp_path: Path
) -> None:
    address, env = served
    prog = tmp_path / "train.py"
    prog.write_text(PROGRAM)
    local = serving.result(
        subprocess.run(
            [sys.executable, str(prog), which, "local"],
            capture_output=True, text=True, env=env, timeout=300,
        )
    )  # fmt: skip
    gpu_less = {**env, "CUDA_VISIBLE_DEVICES": ""}
    forwarded = serving.result(
        subprocess.run(
            [sys.executable, str(prog), which, address],
            capture_output=True, text=True, env=gpu_less, timeout=300,
        )
    )  # fmt: skip
    assert len(local["losses"]) == 4
    assert forwarded == local


def test_whole_op_autograd_beside_a_client_in_one_process_is_a_clear_error() -> None:
    # A server sharing its process with a forwarding client (this test process has `remote`
    # registered) cannot run CUDA autograd: the LSTM's backward says so, and the session lives on.
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    import torch.nn as nn

    from gpu_trace import runtime
    from gpu_trace.runtime.server.server import Server

    with Server("127.0.0.1:0", token=TOKEN, device="cuda:0", idle_s=None) as server:
        dev = runtime.connect(server.address, token=TOKEN)
        try:
            lstm = nn.LSTM(4, 8, batch_first=True).to(dev)
            x = torch.ones(2, 3, 4).to(dev)
            with pytest.raises(runtime.RemoteOpError, match="gpu-trace serve"):
                lstm(x)[0].sum().backward()
                runtime.synchronize()
            assert torch.equal((x * 2).cpu(), torch.full((2, 3, 4), 2.0))
        finally:
            runtime.disconnect()
