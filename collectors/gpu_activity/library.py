"""Building the CUPTI injection library (``injection.c``) and finding CUPTI on this machine.

The library is compiled like the NVTX one (:mod:`gpu_trace._cbuild`: ``GPU_TRACE_CC``, a hash-named
build cached under ``GPU_TRACE_HOME/lib``) against CUPTI's headers, which come with the CUDA
toolkit (``/usr/local/cuda/include``, ``extras/CUPTI/include``) or the ``nvidia-cuda-cupti`` wheel
(with ``cuda.h`` from ``nvidia-cuda-runtime`` and, from CUDA 13, ``crt/`` from ``nvidia-cuda-crt``
or the toolkit). It links nothing of CUDA: libcupti is opened at
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


def _candidates(nvidia_roots: list[Path], cuda_roots: list[Path]) -> list[Path]:
    """Include directories to look in: the wheels' (``nvidia/*/include``), then the toolkits'."""
    found: list[Path] = []
    for root in nvidia_roots:
        found += sorted(root.glob("*/include"))
    for root in cuda_roots:
        found += [root / "include", root / "extras" / "CUPTI" / "include"]
        found += sorted(root.glob("targets/*/include"))
    return found


#: The headers injection.c needs, each found in the first directory that has it. CUDA 13 moved
#: ``crt/`` (which ``cupti.h`` reaches through ``builtin_types.h``) out of the runtime wheel into
#: ``nvidia-cuda-crt``; the toolkit has it beside ``cuda.h``.
HEADERS = ("cupti.h", "cuda.h", "crt/host_defines.h")


def include_dirs(
    nvidia_roots: list[Path] | None = None, cuda_roots: list[Path] | None = None
) -> list[Path] | None:
    """Directories holding :data:`HEADERS`; None when one of them is nowhere."""
    found = _find_headers(nvidia_roots, cuda_roots)
    if any(d is None for d in found.values()):
        return None
    return list(dict.fromkeys(d for d in found.values() if d is not None))


def _find_headers(
    nvidia_roots: list[Path] | None, cuda_roots: list[Path] | None
) -> dict[str, Path | None]:
    candidates = _candidates(
        _nvidia_roots() if nvidia_roots is None else nvidia_roots,
        _cuda_roots() if cuda_roots is None else cuda_roots,
    )
    found: dict[str, Path | None] = dict.fromkeys(HEADERS)
    for header in HEADERS:
        found[header] = next((d for d in candidates if (d / header).is_file()), None)
    return found


def missing_headers_message(
    nvidia_roots: list[Path] | None = None, cuda_roots: list[Path] | None = None
) -> str:
    """The one line that says which CUPTI build headers are missing and what provides them."""
    missing = [h for h, d in _find_headers(nvidia_roots, cuda_roots).items() if d is None]
    return (
        f"CUPTI headers not found ({', '.join(missing)}): install the CUDA toolkit (CUDA_HOME),"
        " or the nvidia-cuda-cupti, nvidia-cuda-runtime and (CUDA 13) nvidia-cuda-crt packages"
    )


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
        return _cbuild.BuildError(missing_headers_message())
    return None


def build(out: Path, *, cc: str | None = None, include: list[Path] | None = None) -> Path:
    """Compile the library to ``out`` (against ``include``, else the headers found here);
    :class:`~gpu_trace._cbuild.BuildError` says why not."""
    if include is None:
        missing = _missing_headers()
        if missing is not None:
            raise missing
        include = include_dirs() or []
    return _cbuild.build(SOURCE, out, include_dirs=include, libs=["-ldl", "-lpthread"], cc=cc)


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
