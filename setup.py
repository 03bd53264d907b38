"""Build hook: prebuild the NVTX injection library and the C ``gpu_trace.range`` into the wheel
where a C compiler is present.

Everything else about the package is in pyproject.toml. The prebuilds are optional: if one fails
(no compiler, no NVTX or Python headers) the install goes on and it is built on first use instead
(``gpu_trace.collectors.nvtx.library_path``, ``gpu_trace._api``), or the Python twin is used.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent

#: The name the package's source folders are importable under here (see :func:`_load`).
SOURCE_PACKAGE = "_gpu_trace_src"


def _load(module: str):
    """Import ``gpu_trace.<module>`` from the source tree as ``_gpu_trace_src.<module>``.

    gpu_trace is not importable while it is being built (and importing it would run its
    ``__init__``), so its folders are mapped as in pyproject.toml's package-dir onto bare packages
    that run no ``__init__.py``: the builders' relative imports (``from .. import _cbuild``) then
    work here as in the installed package.
    """
    for name, folder in (
        (SOURCE_PACKAGE, "gpu_trace"),
        (f"{SOURCE_PACKAGE}.collectors", "collectors"),
        (f"{SOURCE_PACKAGE}.tracer", "tracer"),
    ):
        if name not in sys.modules:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = [str(HERE / folder)]
            sys.modules[name] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{SOURCE_PACKAGE}.{module}")


#: (builder module, package folder in the wheel, what it builds)
PREBUILDS = [
    ("collectors.nvtx_build", "collectors", "NVTX injection library"),
    ("tracer.fastpath_build", "tracer", "C gpu_trace.range"),
]


class BuildPyWithNvtx(build_py):
    """build_py, then compile ``nvtx_inject.c`` and ``_fastpath.c`` next to the copied sources
    (a failure is a warning)."""

    def run(self) -> None:
        super().run()
        if self.dry_run:
            return
        for module, folder, what in PREBUILDS:
            try:
                builder = _load(module)
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
