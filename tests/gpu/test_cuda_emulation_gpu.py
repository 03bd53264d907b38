"""Transparent mode from a CUDA build of torch that sees no GPU, forwarded to a CUDA server, bitwise
equal to the same program run on the GPU locally (skipped without a GPU).

The real thing that tests/cuda_build.py mimics on CI: the client is ``gpu-trace record --remote``
with ``CUDA_VISIBLE_DEVICES=""`` (its torch is the machine's CUDA build, so every ``torch.cuda``
call that reaches the runtime would raise), the server `gpu-trace serve` on cuda:0 in its own
process. The program is an ordinary one: AdamW (foreach, the default on CUDA), CUDA events
around each step, a side stream, device queries, and TF32 on then off: its losses are the local
run's in both, so the settings reached the server's matmuls (and TF32 does change them here).
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

TOKEN = "cuda-emulation-gpu-token-01"

PROGRAM = textwrap.dedent(
    """
    import json
    import torch, torch.nn as nn, torch.nn.functional as F

    torch.use_deterministic_algorithms(True)

    def train(tf32):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16)).cuda()
        x = torch.randn(256, 512, generator=g).cuda()
        y = torch.randn(256, 16, generator=g).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        side = torch.cuda.Stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        losses, ms = [], []
        for _ in range(3):
            start.record()
            side.wait_stream(torch.cuda.current_stream())  # x and the weights were made there
            with torch.cuda.stream(side):
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                opt.step()
            torch.cuda.current_stream().wait_stream(side)
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
            losses.append(loss.item().hex())
        return losses, ms

    tf32, ms = train(True)
    fp32, _ = train(False)
    props = torch.cuda.get_device_properties(0)
    print("RESULT " + json.dumps({
        "tf32": tf32,
        "fp32": fp32,
        "timed": all(m > 0 for m in ms),
        "capturing": torch.cuda.is_current_stream_capturing(),
        "name": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "memory": props.total_memory,
        "sms": props.multi_processor_count,
    }), flush=True)
    """
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, str]]]:
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    with serving.served(tmp_path_factory.mktemp("home"), TOKEN) as server:
        yield server


def test_a_gpu_less_cuda_build_trains_as_the_gpu_does(
    served: tuple[str, dict[str, str]], tmp_path: Path
) -> None:
    address, env = served
    prog = tmp_path / "train.py"
    prog.write_text(PROGRAM)
    local = serving.result(
        subprocess.run(
            [sys.executable, str(prog)], capture_output=True, text=True, env=env, timeout=300
        )
    )
    gpu_less = {**env, "CUDA_VISIBLE_DEVICES": ""}
    forwarded = serving.result(
        subprocess.run(
            # --no-ingest: GPU machines may have no store (chDB cannot travel to them), and
            # record's status is 75 when a run that was to be stored could not be
            [sys.executable, "-m", "gpu_trace", "record", "--no-ingest", "--remote", address, "--",
             sys.executable, str(prog)],
            capture_output=True, text=True, env=gpu_less, timeout=300,
        )
    )  # fmt: skip
    assert local["tf32"] != local["fp32"]  # TF32 changes these losses: the check can fail
    assert forwarded == local
    assert forwarded["timed"] and forwarded["capturing"] is False
