"""CUDA's build headers for the tests that compile the CUPTI injection library without CUDA.

A machine with the CUDA toolkit or PyTorch's CUDA wheels has them where
:func:`gpu_trace.collectors.gpu_activity.library.include_dirs` looks; elsewhere
``scripts/cuda_headers.sh`` (run by ``scripts/setup.sh``) puts CUDA 13's under
``build/cuda-headers/include``, headers only, so the library is built as a GPU machine with
CUDA 13 wheels builds it (whose ``crt/`` the first H100 check found missing).
"""

from __future__ import annotations

from pathlib import Path

from gpu_trace.collectors.gpu_activity import library

FETCHED = Path(__file__).resolve().parent.parent / "build" / "cuda-headers"


def include_dirs() -> list[Path] | None:
    """This machine's CUDA headers, else the fetched ones; None when there are neither."""
    return library.include_dirs() or library.include_dirs(nvidia_roots=[], cuda_roots=[FETCHED])
