"""Build hook: prebuild the NVTX injection library and the C ``gpu_trace.range`` into the wheel
where a C compiler is present.

Everything else about the package is in pyproject.toml. The prebuilds are optional: if one fails
(no compiler, no NVTX or Python headers) the install goes on and it is built on first use instead
(``gpu_trace.collectors.nvtx.library_path``, ``gpu_trace._api``), or the Python twin is used.
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


def _load(relpath: str, name: str):
    # Loaded by path: gpu_trace is not importable while it is being built.
    spec = importlib.util.spec_from_file_location(name, HERE / relpath)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: (builder module, its name while loaded here, package folder in the wheel, what it builds)
PREBUILDS = [
    ("collectors/nvtx_build.py", "_gpu_trace_nvtx_build", "collectors", "NVTX injection library"),
    ("tracer/fastpath_build.py", "_gpu_trace_fastpath_build", "tracer", "C gpu_trace.range"),
]


class BuildPyWithNvtx(build_py):
    """build_py, then compile ``nvtx_inject.c`` and ``_fastpath.c`` next to the copied sources
    (a failure is a warning)."""

    def run(self) -> None:
        super().run()
        if self.dry_run:
            return
        for relpath, name, folder, what in PREBUILDS:
            try:
                builder = _load(relpath, name)
                out = Path(self.build_lib) / "gpu_trace" / folder / builder.library_name()
                builder.build(out, cc=os.environ.get("GPU_TRACE_CC"))
            except Exception as exc:  # never fail the install over an optional prebuild
                sys.stderr.write(
                    f"warning: gpu-trace: prebuilding the {what} failed ({exc}); "
                    "it will be built on first use\n"
                )


class PlatformDistribution(Distribution):
    """On Linux the wheel may carry a native library, so it is tagged for the platform."""

    def has_ext_modules(self) -> bool:
        return sys.platform.startswith("linux")


setup(cmdclass={"build_py": BuildPyWithNvtx}, distclass=PlatformDistribution)
