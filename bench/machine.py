"""What this machine has for gpu-trace's GPU parts: the GPU, driver, CUDA, torch and CUPTI
versions, which tools and packages are there, and whether each C part builds and loads here.

    python bench/machine.py [--json FILE] [--no-build]

Prints one JSON object (with ``--json FILE``: writes it there and prints a few lines). Each probe is caught on its own: one that
fails says why in its place and the rest still answer. The C parts are built as a program would
build them on first use (``GPU_TRACE_HOME/lib``; op level's observer next to its source, as
tests/conftest.py builds it, so that tests with a fresh ``GPU_TRACE_HOME`` find it too), so a
later bench or test finds them ready; ``--no-build`` only looks. ``scripts/gpu_check.py`` runs it
first on a lent GPU machine; ``gpu`` (torch sees a CUDA device) decides whether the GPU parts run.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def guarded(fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``{"error": ...}`` where it raised."""
    try:
        return fn()
    except Exception as exc:  # a probe's failure is an answer, not the end of the probe
        return {"error": f"{type(exc).__name__}: {exc}"[:500]}


def host() -> dict[str, Any]:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        mem = round(kb / (1 << 20), 1)
    except (OSError, StopIteration, ValueError):
        pass
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "memory_gib": mem,
    }


def torch_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cuda_available": bool(torch.cuda.is_available()),
        "devices": [],
    }
    if info["cuda_available"]:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append(
                {
                    "name": p.name,
                    "capability": f"{p.major}.{p.minor}",
                    "memory_gib": round(p.total_memory / (1 << 30), 1),
                    "multiprocessors": p.multi_processor_count,
                }
            )
    return info


def nvml_info() -> dict[str, Any]:
    import pynvml

    pynvml.nvmlInit()
    try:

        def text(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)

        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        return {
            "driver": text(pynvml.nvmlSystemGetDriverVersion()),
            "nvml": text(pynvml.nvmlSystemGetNVMLVersion()),
            "cuda_driver": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "devices": [
                text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(pynvml.nvmlDeviceGetCount())
            ],
        }
    finally:
        pynvml.nvmlShutdown()


def cupti_info() -> dict[str, Any]:
    from gpu_trace.collectors.gpu_activity import library

    lib = library.cupti_library()
    info: dict[str, Any] = {
        "library": str(lib) if lib else None,
        "headers": [str(d) for d in library.include_dirs() or []],
    }
    if lib is not None:
        try:
            cupti = ctypes.CDLL(str(lib))
            version = ctypes.c_uint32()
            if cupti.cuptiGetVersion(ctypes.byref(version)) == 0:
                info["api_version"] = version.value  # CUPTI_API_VERSION of that library
        except OSError as exc:
            info["load_error"] = str(exc)
    return info


def tool(name: str, *version_args: str) -> str | None:
    """The tool's path and the last line of its version output, or None if it is not on PATH."""
    path = shutil.which(name)
    if path is None or not version_args:
        return path
    try:
        out = subprocess.run(
            [path, *version_args],
            capture_output=True,
            text=True,
            timeout=20,
            stdin=subprocess.DEVNULL,
        )
        lines = [x for x in (out.stdout + out.stderr).splitlines() if x.strip()]
        return f"{path}: {lines[-1].strip()}" if lines else path
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{path}: {exc}"


def packages() -> dict[str, str | None]:
    """Installed version of each package gpu-trace's GPU parts and tests touch (None: absent)."""
    out: dict[str, str | None] = {}
    for dist in (
        "chdb",
        "chdb-core",
        "clickhouse-connect",
        "nvidia-ml-py",
        "nvtx",
        "nvidia-nvtx",
        "nvidia-cuda-cupti",
        "opentelemetry-sdk",
        "pyarrow",
        "numpy",
        "psutil",
        "pytest",
        "pytest-timeout",
        "gpu-trace",
    ):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    out["chdb (importable)"] = "yes" if importlib.util.find_spec("chdb") else None
    return out


def c_parts(build: bool) -> dict[str, str]:
    """Each C part: ``built: PATH`` (or ``found``), else why not."""
    from gpu_trace import _cbuild, config

    home_lib = config.home() / "lib"
    cc = config.c_compiler()
    parts: dict[str, str] = {}

    def part(name: str, fn: Callable[[], Path | str]) -> None:
        t = time.monotonic()
        try:
            where = fn()
            parts[name] = f"ok: {where} ({time.monotonic() - t:.1f} s)"
        except Exception as exc:
            parts[name] = f"not available: {type(exc).__name__}: {exc}"[:500]

    def fastpath() -> Path | str:
        from gpu_trace.tracer import fastpath_build

        if not build:
            return "C range in use" if _c_range() else "Python twin in use"
        path = fastpath_build.find_or_build(home_lib, cc=cc)
        fastpath_build.load(path)
        return path

    def nvtx() -> Path | str:
        from gpu_trace.collectors import nvtx

        path = nvtx.library_path() if build else None
        if path is None and build:
            raise _cbuild.BuildError(nvtx.build_error() or "no library")
        return path or "not built (--no-build)"

    def cupti() -> Path | str:
        from gpu_trace.collectors.gpu_activity import library

        if not build:
            return "not built (--no-build)"
        env, why = library.injection_env(home_lib, cc=cc)
        if not env:
            raise _cbuild.BuildError(why or "no library")
        return env[library.ENV]

    def observer() -> Path | str:
        from gpu_trace.framework_patches.torch import ops_native

        out = ops_native.SOURCE.with_name(ops_native.library_name())
        if build and not out.is_file():
            ops_native.build(out)
        if ops_native.library() is None:
            raise _cbuild.BuildError("built but not loadable (see the log)")
        return out

    part("C range (tracer/_fastpath.c)", fastpath)
    part("NVTX injection library (collectors/nvtx/inject.c)", nvtx)
    part("CUPTI injection library (collectors/gpu_activity/injection.c)", cupti)
    part("op observer (framework_patches/torch/observer.cpp)", observer)
    return parts


def _c_range() -> bool:
    import gpu_trace
    from gpu_trace import _api

    return gpu_trace.range is not _api.PyRange


def probe(build: bool = True) -> dict[str, Any]:
    """Everything this module reports, as one JSON-able dict."""
    info: dict[str, Any] = {"host": guarded(host)}
    info["torch"] = guarded(torch_info)
    info["nvml"] = guarded(nvml_info)
    info["cupti"] = guarded(cupti_info)
    info["tools"] = {
        "nvcc": guarded(lambda: tool("nvcc", "--version")),
        "nvidia-smi": guarded(lambda: tool("nvidia-smi")),
        "nsys": guarded(lambda: tool("nsys", "--version")),
        "cc": guarded(lambda: tool("cc")),
        "c++": guarded(lambda: tool("g++") or tool("c++")),
    }
    info["packages"] = guarded(packages)
    info["c_parts"] = guarded(lambda: c_parts(build))
    torch = info["torch"]
    info["gpu"] = bool(isinstance(torch, dict) and torch.get("cuda_available"))
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the JSON here")
    ap.add_argument("--no-build", action="store_true", help="look for the C parts, build none")
    args = ap.parse_args()
    info = probe(build=not args.no_build)
    text = json.dumps(info, indent=1)
    if args.json is None:
        print(text, flush=True)
        return 0
    args.json.write_text(text)
    torch = info["torch"]
    print(f"torch {torch.get('version', torch.get('error'))}; GPU: {info['gpu']}", flush=True)
    for name, state in (info["c_parts"] if "error" not in info["c_parts"] else {}).items():
        print(f"{name}: {state}", flush=True)
    print(f"wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
