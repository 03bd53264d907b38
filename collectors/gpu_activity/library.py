"""Building the CUPTI injection library (``injection.c``) and finding CUPTI on this machine.

The library is compiled like the NVTX one (:mod:`gpu_trace._cbuild`: ``GPU_TRACE_CC``, a hash-named
build cached under ``GPU_TRACE_HOME/lib``) against CUPTI's headers, which come with the CUDA
toolkit (``/usr/local/cuda/include``, ``extras/CUPTI/include``) or the ``nvidia-cuda-cupti`` wheel
(with ``cuda.h`` from ``nvidia-cuda-runtime``). It links nothing of CUDA: libcupti is opened at
run time, found where PyTorch's wheels and the toolkit put it, and named to the library in
``GPU_TRACE_CUPTI_LIBRARY``. A machine without the headers or without libcupti has no GPU activity,
said in one line; nothing else changes.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from gpu_trace import _cbuild

SOURCE = Path(__file__).with_name("injection.c")
#: The variable the CUDA driver reads at cuInit to load an injection library (Nsight sets it too).
ENV = "CUDA_INJECTION64_PATH"
CUPTI_ENV = "GPU_TRACE_CUPTI_LIBRARY"


def _nvidia_roots() -> list[Path]:
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def _cuda_roots() -> list[Path]:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    found = [Path(r) for r in roots if r]
    found += [Path(p) for p in sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    return found


def include_dirs() -> list[Path] | None:
    """Directories holding ``cupti.h`` and ``cuda.h``; None when either is missing."""
    cupti: Path | None = None
    cuda: Path | None = None
    candidates: list[Path] = []
    for root in _nvidia_roots():
        candidates += sorted(root.glob("*/include"))
    for root in _cuda_roots():
        candidates += [root / "include", root / "extras" / "CUPTI" / "include"]
    for d in candidates:
        if cupti is None and (d / "cupti.h").is_file():
            cupti = d
        if cuda is None and (d / "cuda.h").is_file():
            cuda = d
    if cupti is None or cuda is None:
        return None
    return list(dict.fromkeys([cupti, cuda]))


def cupti_library() -> Path | None:
    """libcupti: the wheel PyTorch's CUDA builds depend on, else the CUDA toolkit's."""
    patterns: list[str] = []
    for root in _nvidia_roots():
        patterns += [
            str(root / "cuda_cupti" / "lib" / "libcupti.so*"),
            str(root / "*" / "lib" / "libcupti.so*"),
        ]
    for root in _cuda_roots():
        for sub in ("extras/CUPTI/lib64", "lib64", "lib", "targets/x86_64-linux/lib"):
            patterns.append(str(root / sub / "libcupti.so*"))
    for pattern in patterns:
        hits = sorted(glob.glob(pattern))
        if hits:
            return Path(hits[0])
    return None


def library_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return f"libgpu_trace_cupti-{digest}.so"


def _missing_headers() -> _cbuild.BuildError | None:
    if sys.platform != "linux":
        return _cbuild.BuildError(
            f"GPU activity capture is built for Linux only, not {sys.platform}"
        )
    if include_dirs() is None:
        return _cbuild.BuildError(
            "CUPTI headers (cupti.h, cuda.h) not found: install the CUDA toolkit or the"
            " nvidia-cuda-cupti and nvidia-cuda-runtime packages"
        )
    return None


def build(out: Path, *, cc: str | None = None) -> Path:
    """Compile the library to ``out``; :class:`~gpu_trace._cbuild.BuildError` says why not."""
    missing = _missing_headers()
    if missing is not None:
        raise missing
    inc = include_dirs() or []
    return _cbuild.build(SOURCE, out, include_dirs=inc, libs=["-ldl", "-lpthread"], cc=cc)


def find_or_build(cache_dir: Path, *, cc: str | None = None) -> Path:
    """The library for the current source: prebuilt next to the source, cached, or built now."""

    def check() -> None:
        missing = _missing_headers()
        if missing is not None:
            raise missing

    return _cbuild.find_or_build(
        SOURCE, library_name(), cache_dir, lambda out: build(out, cc=cc), check=check
    )


def injection_env(cache_dir: Path, *, cc: str | None = None) -> tuple[dict[str, str], str | None]:
    """What a recorded program's environment needs for GPU activity, or ``{}`` and why not.

    Another injection already named (Nsight Systems sets ``CUDA_INJECTION64_PATH``) keeps its
    place: a process loads one, and CUPTI serves one tool's activity buffers.
    """
    taken = os.environ.get(ENV)
    if taken:
        return {}, f"GPU activity is off: {ENV} already names {taken} (Nsight?); it keeps CUPTI"
    cupti = cupti_library()
    if cupti is None:
        return (
            {},
            "GPU activity is off: libcupti not found (install nvidia-cuda-cupti or the CUDA toolkit)",
        )
    try:
        lib = find_or_build(cache_dir, cc=cc)
    except (_cbuild.BuildError, OSError) as exc:
        return {}, f"GPU activity is off: {exc}"
    return {ENV: str(lib), CUPTI_ENV: str(cupti)}, None
