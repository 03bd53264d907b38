"""Where the CUPTI injection library's build headers are found, in the layouts GPU machines have.

The first H100 check (docs/gpu-results/2026-11-27-*) had PyTorch's CUDA 13 wheels, whose
``nvidia/cu13/include`` holds ``cupti.h`` and ``cuda.h`` but not ``crt/`` (``cupti.h`` reaches
``crt/host_defines.h`` through ``builtin_types.h``); the toolkit beside it had ``crt/``. The
library did not build there and GPU activity was off for the whole check.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpu_trace import _cbuild
from gpu_trace.collectors.gpu_activity import library
from tests import cuda_headers


def _wheel_and_toolkit(tmp_path: Path, source: Path) -> tuple[Path, Path]:
    """CUDA 13 headers split as on that machine: the wheel's folder without crt/, a toolkit's
    ``include`` with it."""
    wheel = tmp_path / "site" / "nvidia"
    shutil.copytree(source, wheel / "cu13" / "include", ignore=shutil.ignore_patterns("crt"))
    toolkit = tmp_path / "cuda"
    shutil.copytree(source / "crt", toolkit / "include" / "crt")
    return wheel, toolkit


def test_crt_from_the_toolkit_completes_the_wheels_headers(tmp_path: Path) -> None:
    for name in ("cupti.h", "cuda.h", "crt/host_defines.h"):
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_text("")
    wheel, toolkit = _wheel_and_toolkit(tmp_path, tmp_path / "src")
    found = library.include_dirs(nvidia_roots=[wheel], cuda_roots=[toolkit])
    assert found == [wheel / "cu13" / "include", toolkit / "include"]
    assert library.include_dirs(nvidia_roots=[wheel], cuda_roots=[]) is None
    message = library.missing_headers_message(nvidia_roots=[wheel], cuda_roots=[])
    assert message.startswith("CUPTI headers not found (crt/host_defines.h): ")
    assert "nvidia-cuda-crt" in message


def test_the_library_builds_against_the_split_cuda_13_headers(tmp_path: Path) -> None:
    inc = cuda_headers.include_dirs()
    if inc is None or not (inc[0] / "crt" / "host_defines.h").is_file():
        pytest.skip("no CUDA 13 headers here (scripts/cuda_headers.sh fetches them)")
    wheel, toolkit = _wheel_and_toolkit(tmp_path, inc[0])
    split = library.include_dirs(nvidia_roots=[wheel], cuda_roots=[toolkit])
    assert split is not None
    try:
        built = library.build(tmp_path / library.library_name(), include=split)
    except _cbuild.BuildError as exc:
        if "not found" in str(exc) and "cc" in str(exc).split(":")[0]:
            pytest.skip(f"no C compiler: {exc}")
        raise
    assert built.is_file()
