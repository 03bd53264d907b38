"""Mixed-precision training forwarded to a CUDA server in transparent mode, bitwise equal to the
same program run on the GPU locally (skipped without a GPU).

The server is `gpu-trace serve` in its own process, on cuda:0. The client is the same program with
``CUDA_VISIBLE_DEVICES=""`` (the machine's torch is a CUDA build: a CUDA build without a GPU, as
on a CPU-only machine) and ``GPU_TRACE_REMOTE`` set, in transparent mode: it says ``cuda``,
``torch.autocast("cuda", ...)``, ``torch.amp.GradScaler("cuda")`` and ``AdamW(fused=True)``
unchanged, and the runtime maps them onto the server (runtime/client/autocast.py applies CUDA's
autocast policy on the client's side; the casts and ops run on the server's GPU). Two runs: bf16
autocast, and fp16 autocast with a GradScaler whose third step's loss is infinite (skipped, scale
backed off). Deterministic settings on both sides, as in test_forward_training_gpu.py.
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

TOKEN = "forward-amp-gpu-token-0123"

PROGRAM = textwrap.dedent(
    """
    import hashlib, json, os, sys
    if os.environ.get("GPU_TRACE_REMOTE"):  # what `gpu-trace record --remote` starts with
        from gpu_trace.runtime.client import cuda as forwarding
        forwarding.install_from_env()
    import torch, torch.nn as nn, torch.nn.functional as F

    torch.use_deterministic_algorithms(True)
    which = sys.argv[1]
    forwarded = bool(os.environ.get("GPU_TRACE_REMOTE"))
    # Transparent mode answers for the GPU the client lacks; its session opens at the device's
    # first use (runtime/client/device.py `defer`), so it is checked for after the run.
    assert torch.cuda.is_available(), "no CUDA, and transparent mode is not on"

    class Net(nn.Module):
        def __init__(self, vocab=256, d=128):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.norm = nn.LayerNorm(d)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)
            self.head = nn.Linear(d, vocab)

        def forward(self, idx):
            x = self.emb(idx)
            x = x + self.down(F.gelu(self.up(self.norm(x))))
            return self.head(x)

    def xent(logits, onehot):  # log_softmax runs in float32 under autocast; no nll_loss atomics
        return -(F.log_softmax(logits, -1) * onehot).sum(-1).mean()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = Net().to("cuda")
    tokens = torch.randint(0, 256, (16, 33), generator=g)
    x = tokens[:, :-1].to("cuda")
    y = F.one_hot(tokens[:, 1:], 256).float().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    low = torch.bfloat16 if which == "bf16" else torch.float16
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**14, growth_interval=2,
                                  enabled=which == "fp16")
    losses, scales = [], []
    for step in range(5):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=low):
            logits = model(x)
            loss = xent(logits, y)
        assert logits.dtype == low and loss.dtype == torch.float32
        if which == "fp16" and step == 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item().hex())
        scales.append(scaler.get_scale())
    if forwarded:
        from gpu_trace.runtime.client import tensor as rt
        assert rt.conn is not None, "transparent mode did not connect"
        assert all(p.device.type == "remote" for p in model.parameters()), "trained locally"
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    out = {"losses": losses, "scales": scales, "params": digest.hexdigest()}
    print("RESULT " + json.dumps(out), flush=True)
    """
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    with serving.served(tmp_path_factory.mktemp("home"), TOKEN, deterministic=True) as server:
        yield server


@pytest.mark.parametrize("which", ["bf16", "fp16"])
def test_forwarded_mixed_precision_is_bitwise_the_local_run(
    served: tuple[str, dict[str, str]], which: str, tmp_path: Path
) -> None:
    address, env = served
    prog = tmp_path / "amp.py"
    prog.write_text(PROGRAM)
    local = serving.result(
        subprocess.run(
            [sys.executable, str(prog), which],
            capture_output=True, text=True, env=env, timeout=300,
        )
    )  # fmt: skip
    gpu_less = {**env, "CUDA_VISIBLE_DEVICES": "", "GPU_TRACE_REMOTE": address}
    forwarded = serving.result(
        subprocess.run(
            [sys.executable, str(prog), which],
            capture_output=True, text=True, env=gpu_less, timeout=300,
        )
    )  # fmt: skip
    assert len(local["losses"]) == 5
    if which == "fp16":
        assert local["losses"][2] == "inf" and local["scales"][2] < local["scales"][1]
    assert forwarded == local
