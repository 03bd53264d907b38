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


def _load(path: str):
    """The module in the source file ``path``, loaded by path as a module of its own.

    gpu_trace is not importable while it is being built (and importing it would run its
    ``__init__``): the builders and :mod:`gpu_trace._cbuild` are standard library only at module
    level and import nothing of gpu_trace there, so they load alone; ``_cbuild`` is passed to the
    builders' ``build``.
    """
    name = "_gpu_trace_setup_" + Path(path).with_suffix("").as_posix().replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, HERE / path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


#: (builder file, package folder in the wheel, what it builds)
PREBUILDS = [
    ("collectors/nvtx/build.py", "collectors/nvtx", "NVTX injection library"),
    ("tracer/fastpath_build.py", "tracer", "C gpu_trace.range"),
]


class BuildPyWithNvtx(build_py):
    """build_py, then compile ``collectors/nvtx/inject.c`` and ``tracer/_fastpath.c`` next to the
    copied sources (a failure is a warning)."""

    def run(self) -> None:
        super().run()
        if self.dry_run:
            return
        for path, folder, what in PREBUILDS:
            try:
                cbuild = _load("gpu_trace/_cbuild.py")
                builder = _load(path)
                out = Path(self.build_lib) / "gpu_trace" / folder / builder.library_name()
                builder.build(out, cc=os.environ.get("GPU_TRACE_CC"), cbuild=cbuild)
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
