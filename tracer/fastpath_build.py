"""Building and loading ``_fastpath.c``, the C twin of ``gpu_trace.range``, with the system C compiler.

Standard library only: ``setup.py`` loads this file by path to prebuild the extension into the
wheel, before ``gpu_trace`` is importable. At run time the extension is looked for next to the
source (a prebuilt copy shipped in the wheel), then in the per-user cache the NVTX library uses
(``GPU_TRACE_HOME/lib``), and built into the cache on first use. The file name carries a hash of
the source and of the Python ABI, so a changed source or another interpreter never loads a stale
build. Anything that goes wrong gives :class:`gpu_trace._cbuild.BuildError`; the caller then uses the Python twin.
How a C file is compiled and cached is :mod:`gpu_trace._cbuild`'s; this file says what to build.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

# No import of gpu_trace at module level: setup.py loads this file by path, where gpu_trace is not
# importable, and passes :mod:`gpu_trace._cbuild` (loaded by path as well) to :func:`build`.

SOURCE = Path(__file__).with_name("_fastpath.c")
MODULE = "gpu_trace.tracer._fastpath"


def helper(cbuild: ModuleType | None = None) -> ModuleType:
    """:mod:`gpu_trace._cbuild`, or the copy of it that setup.py loaded by path and passed in."""
    if cbuild is not None:
        return cbuild
    from gpu_trace import _cbuild

    return _cbuild


def _ext_suffix() -> str:
    return sysconfig.get_config_var("EXT_SUFFIX") or importlib.machinery.EXTENSION_SUFFIXES[0]


def source_hash() -> str:
    """A short hash of the source and the interpreter ABI: the build's identity."""
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{_ext_suffix()}|{sys.version}|{sys.implementation.cache_tag}".encode())
    return h.hexdigest()[:16]


def library_name() -> str:
    return f"_fastpath-{source_hash()}{_ext_suffix()}"


def include_dirs(cbuild: ModuleType | None = None) -> list[Path]:
    """Where ``Python.h`` is (``sysconfig``); raises BuildError when the headers are missing."""
    paths = sysconfig.get_paths()
    dirs = [Path(p) for p in dict.fromkeys((paths.get("include"), paths.get("platinclude"))) if p]
    if not any((d / "Python.h").is_file() for d in dirs):
        raise helper(cbuild).BuildError(
            f"Python headers (Python.h) not found in {', '.join(map(str, dirs)) or '?'}; "
            "install the python3-dev package"
        )
    return dirs


def supported() -> str | None:
    """Why this interpreter can't use the extension, or None if it can."""
    if sys.platform != "linux":
        return f"the C range is built for Linux only, not {sys.platform}"
    if sys.implementation.name != "cpython":
        return f"the C range needs CPython, not {sys.implementation.name}"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return "the C range relies on the GIL; this is a free-threaded build"
    return None


def build(out: Path, *, cc: str | None = None, cbuild: ModuleType | None = None) -> Path:
    """Compile the extension to ``out`` atomically (a temporary file renamed into place)."""
    cb = helper(cbuild)
    reason = supported()
    if reason:
        raise cb.BuildError(reason)
    built: Path = cb.build(SOURCE, out, include_dirs=include_dirs(cb), cc=cc)
    return built


def find_or_build(cache_dir: Path, *, cc: str | None = None) -> Path:
    """The extension for this source and interpreter: prebuilt, cached, or built now."""
    cb = helper()
    reason = supported()
    if reason:
        raise cb.BuildError(reason)
    # include_dirs: fail fast, without running the compiler, where the headers are missing
    found: Path = cb.find_or_build(
        SOURCE, library_name(), cache_dir, lambda out: build(out, cc=cc), check=include_dirs
    )
    return found


def load(path: Path) -> ModuleType:
    """Import the extension at ``path`` as ``gpu_trace.tracer._fastpath``."""
    existing = sys.modules.get(MODULE)
    if existing is not None:
        return existing
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    if spec is None:
        raise helper().BuildError(f"cannot load {path}")
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as exc:
        raise helper().BuildError(f"loading {path} failed: {exc}") from None
    sys.modules[MODULE] = module
    return module
