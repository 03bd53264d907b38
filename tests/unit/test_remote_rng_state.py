"""The remote device's generator state (``torch.remote.get_rng_state``/``set_rng_state``, and
``torch.cuda``'s in transparent mode), against a real server on loopback (CPU device).

``torch.utils.checkpoint`` saves the device's RNG state in the forward pass and restores it to
recompute in backward, so dropout draws the same masks twice; ``torch.random.fork_rng`` does the
same. Without the state the recomputed masks differ and checkpointed training diverges from the
same training without checkpointing (tests/thirdparty's tiny GPT found it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from gpu_trace import runtime
from gpu_trace.runtime.client import cuda
from tests import serving
from tests.cuda_build import CudaBuild
from tests.integration.test_remote_server import Raw

TOKEN = serving.CPU_TOKEN


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving.cpu_server(tmp_path_factory.mktemp("home")) as address:
        yield address


@pytest.fixture
def dev(served: str) -> Iterator[torch.device]:
    with serving.connected(served) as device:
        yield device


def test_a_saved_state_replays_the_same_draws(dev: torch.device) -> None:
    torch.manual_seed(3)
    state = torch.remote.get_rng_state()  # type: ignore[attr-defined]
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    first = torch.rand(8, device=dev).cpu()
    torch.remote.set_rng_state(state)  # type: ignore[attr-defined]
    again = torch.rand(8, device=dev).cpu()
    assert torch.equal(first, again)
    assert not torch.equal(first, torch.rand(8, device=dev).cpu())


def test_fork_rng_leaves_the_device_generator_as_it_was(dev: torch.device) -> None:
    torch.manual_seed(5)
    with torch.random.fork_rng(device_type="remote"):
        torch.rand(4, device=dev)
    after_fork = torch.rand(4, device=dev).cpu()
    torch.manual_seed(5)
    assert torch.equal(after_fork, torch.rand(4, device=dev).cpu())


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_dropout_trains_as_without_checkpointing(
    dev: torch.device, reentrant: bool
) -> None:
    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(0)
        block = Block().to(dev)
        x = torch.randn(4, 16, device=dev, requires_grad=True)
        y = checkpoint(block, x, use_reentrant=reentrant) if use_checkpoint else block(x)
        y.square().sum().backward()
        grads.append([p.grad.cpu() for p in block.parameters()] + [x.grad.cpu()])
    for plain, checkpointed in zip(*grads):
        assert torch.equal(plain, checkpointed)


def test_torch_cuda_reads_and_sets_it_in_transparent_mode(served: str) -> None:
    """A CUDA build without a GPU (tests/cuda_build.py), as `record --remote` sets it up: the
    program's ``torch.cuda.get_rng_state``/``set_rng_state`` (and the ``_all`` forms) are the
    session's generator."""
    with CudaBuild():
        runtime.connect(served, token=TOKEN)
        cuda.patch()
        try:
            torch.manual_seed(11)
            state = torch.cuda.get_rng_state()
            first = torch.rand(6, device="cuda").cpu()
            torch.cuda.set_rng_state(state)
            assert torch.equal(first, torch.rand(6, device="cuda").cpu())
            (every,) = torch.cuda.get_rng_state_all()
            second = torch.rand(6, device="cuda").cpu()
            torch.cuda.set_rng_state_all([every])
            assert torch.equal(second, torch.rand(6, device="cuda").cpu())
        finally:
            cuda.unpatch()
            runtime.disconnect()


def test_a_state_not_of_the_devices_size_is_refused(served: str) -> None:
    raw = Raw(served, token=TOKEN)
    done = raw.batch([["rt::rng_state", ["00" * 7], {}, None]])
    assert not done["ok"]
    assert "5056-byte RNG state, not 7 bytes" in done["error"]["message"]
    done = raw.batch([["rt::rng_state", ["zz"], {}, None]])
    assert not done["ok"]
    assert done["error"]["message"] == "rt::rng_state: the state is not hex"
    assert raw.batch([["rt::rng_state", [], {}, None]])["ok"]  # the session goes on
