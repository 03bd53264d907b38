"""A forwarded training run's trace nests as a local one does (tests/span_checks.py): batches in
flight on lanes of their own, each batch holding its ops and its send, the server's spans nested
on its threads after clock correction, module backward ranges at module level and one
``Tensor.backward`` range per call. `gpu-trace record --remote` of an LSTM language model and a
small transformer, a real server on loopback (CPU device), the real store."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpu_trace.store.client import Store
from tests import serving
from tests.span_checks import check_stored

TOKEN = "nesting-test-token-0123"
STEPS = 25

PROGRAM = f"""
import torch
import torch.nn.functional as F
from torch import nn


class LM(nn.Module):
    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        return self.head(h)


class GPT(nn.Module):
    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.blocks(self.emb(x)))


torch.manual_seed(0)
for make in (LM, GPT):
    model = make().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 50, (16, 24)).cuda()
    y = torch.randint(0, 50, (16, 24)).cuda()
    for step in range({STEPS}):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(make.__name__, loss.item())
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving.served(tmp_path_factory.mktemp("home"), TOKEN, device="cpu") as (address, _):
        yield address


def test_a_forwarded_training_run_nests(served: str, tmp_path: Path) -> None:
    """Before: 200-300 partial overlaps a run (batches in flight on one lane, sends ending after
    their batch, the server's queued batches on one lane), ``Tensor.backward`` twice per call (the
    cuda mode called the wrapper again) and no module backward range."""
    prog = tmp_path / "train.py"
    prog.write_text(textwrap.dedent(PROGRAM))
    out = subprocess.run(
        [sys.executable, "-m", "gpu_trace", "record", "--remote", served, "--", sys.executable,
         str(prog)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "GPU_TRACE_REMOTE_TOKEN": TOKEN, "GPU_TRACE_NVML_HZ": "0"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    with Store() as store:
        rows = check_stored(store)  # no partial overlap, no negative self time, no stray child
    names = collections.Counter((r["lane"], r["name"]) for r in rows)
    assert names[("nvtx/torch", "Tensor.backward")] == 2 * STEPS
    for module in ("LM", "LM.emb", "LM.lstm", "LM.head", "GPT", "GPT.blocks", "GPT.head"):
        assert names[("nvtx/torch", f"{module}.backward")] == STEPS, module
    lanes = {r["lane"] for r in rows}
    assert {"forward/batch", "forward/op", "server/queue", "server/op"} <= lanes
    # the server's spans are in the run, on its clock mapped to the client's
    server = [r for r in rows if r["category"] == "server"]
    assert server and all("clock_offset_ns" in dict(r["attrs"]) for r in server)
