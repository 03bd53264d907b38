"""The backend settings a program sets travel as one value (runtime/protocol/backend_flags.py):
read, checked and applied, they make another process's ``at::Context`` the program's, legacy and
``fp32_precision`` APIs mixed or not; the client follows the legacy switches as they are set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gpu_trace.runtime.client import cuda_flags
from gpu_trace.runtime.protocol import backend_flags

SCENARIOS = {
    "defaults": lambda: None,
    "legacy TF32": lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "precision medium": lambda: torch.set_float32_matmul_precision("medium"),
    "cuDNN": lambda: (
        setattr(torch.backends.cudnn, "allow_tf32", False),
        setattr(torch.backends.cudnn, "benchmark", True),
        setattr(torch.backends.cudnn, "deterministic", True),
    ),
    "new API": lambda: (
        setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
        setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
    ),
    "generic": lambda: setattr(torch.backends, "fp32_precision", "tf32"),
    "mixed": lambda: (
        torch.set_float32_matmul_precision("high"),
        setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee"),
    ),
    "deterministic": lambda: torch.use_deterministic_algorithms(True, warn_only=True),
    "reductions": lambda: setattr(
        torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", False
    ),
}
#: The legacy getters that raise once the APIs are mixed.
GETTERS = (
    torch.get_float32_matmul_precision,
    torch._C._get_cublas_allow_tf32,
    torch._C._get_cudnn_allow_tf32,
)


def _raising() -> list[str]:
    out = []
    for getter in GETTERS:
        try:
            getter()
        except RuntimeError:
            out.append(getter.__name__)
    return out


@pytest.fixture
def restored() -> Iterator[backend_flags.Flags]:
    """This process's settings before the test, put back after it."""
    before = backend_flags.read(torch)
    yield before
    cuda_flags.uninstall()
    backend_flags.apply(torch, before)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_applied_elsewhere_the_settings_are_the_programs(
    name: str, restored: backend_flags.Flags
) -> None:
    cuda_flags.install()  # no session: the setters are followed, nothing is sent
    SCENARIOS[name]()
    program = backend_flags.check(backend_flags.read(torch, cuda_flags._legacy))
    raising = _raising()
    cuda_flags.uninstall()
    backend_flags.apply(torch, restored)  # "the server", as it was
    assert backend_flags.read(torch) == restored and _raising() == []
    backend_flags.apply(torch, program)
    assert backend_flags.read(torch, cuda_flags._legacy) == program
    assert _raising() == raising  # mixed APIs are mixed there too (CUDA's kernels would say so)


def test_the_client_follows_the_legacy_switches() -> None:
    try:
        cuda_flags.install()
        torch.set_float32_matmul_precision("medium")
        torch.backends.cudnn.allow_tf32 = False
        assert cuda_flags._legacy == {"matmul_precision": "medium", "cudnn_allow_tf32": False}
        torch.backends.cuda.matmul.allow_tf32 = False
        assert cuda_flags._legacy["matmul_precision"] == "highest"
    finally:
        cuda_flags.uninstall()
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = True
    assert not hasattr(torch._C._set_cudnn_allow_tf32, "__wrapped__")  # uninstalled


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "an object with keys among"),
        ({"cuda_graphs": True}, "an object with keys among"),
        ({"matmul_precision": "low"}, "matmul_precision is one of"),
        ({"cudnn_benchmark": 1}, "cudnn_benchmark is a boolean"),
        ({"fp16_reduction": [True]}, "fp16_reduction is two booleans"),
        ({"fp16_reduction": [True, "no"]}, "fp16_reduction is two booleans"),
        ({"fp32:cuda:matmul": "fp8"}, "fp32:cuda:matmul is one of"),
    ],
)
def test_bad_settings_are_one_clear_message(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        backend_flags.check(value)


def test_a_peer_may_send_some_of_the_settings() -> None:
    """A torch without some of them (older, or newer on the other side) sends what it has."""
    assert backend_flags.check({"cudnn_benchmark": True}) == {"cudnn_benchmark": True}
