"""Build hook: prebuild the NVTX injection library into the wheel where a C compiler is present.

Everything else about the package is in pyproject.toml. The prebuild is optional: if it fails (no
compiler, no NVTX headers) the install goes on and the library is built on first use instead
(``gpu_trace.collectors.nvtx.library_path``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent


def _nvtx_build():
    # Loaded by path: gpu_trace is not importable while it is being built.
    path = HERE / "collectors" / "nvtx_build.py"
    spec = importlib.util.spec_from_file_location("_gpu_trace_nvtx_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithNvtx(build_py):
    """build_py, then compile ``nvtx_inject.c`` next to the copied sources (failure is a warning)."""

    def run(self) -> None:
        super().run()
        if self.dry_run:
            return
        try:
            builder = _nvtx_build()
            out = Path(self.build_lib) / "gpu_trace" / "collectors" / builder.library_name()
            builder.build(out, cc=os.environ.get("GPU_TRACE_CC"))
        except Exception as exc:  # never fail the install over the optional prebuild
            sys.stderr.write(
                f"warning: gpu-trace: prebuilding the NVTX injection library failed ({exc}); "
                "it will be built on first use\n"
            )


class PlatformDistribution(Distribution):
    """On Linux the wheel may carry a native library, so it is tagged for the platform."""

    def has_ext_modules(self) -> bool:
        return sys.platform.startswith("linux")


setup(cmdclass={"build_py": BuildPyWithNvtx}, distclass=PlatformDistribution)
