"""Op ranges in PyTorch from a native RecordFunction observer (``observer.cpp``).

Why: op level's Kineto sessions (:mod:`.ops`) have PyTorch process each session's events inside
the stop, on the program's thread, 2-5 µs an event, and their conversion to spans costs the
flusher about 3 µs a span holding the GIL. A global RecordFunction callback written in C++ writes
each op's record (name id, start and end on CLOCK_MONOTONIC, autograd sequence number, thread,
nesting) to a per-thread buffer as it ends; the flusher takes them in bulk as a NumPy array.

The library is compiled with the system C++ compiler against the installed torch's headers and
libraries (a few seconds), cached under ``GPU_TRACE_HOME/lib`` by source hash, torch version and
C++ ABI.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from gpu_trace import _cbuild, config

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("observer.cpp")
#: One record of observer.cpp (struct Rec), field for field.
RECORD = np.dtype(
    [
        ("start", "<i8"),
        ("end", "<i8"),
        ("seq", "<i8"),
        ("id", "<u8"),
        ("parent", "<u8"),
        ("fwd_tid", "<u8"),
        ("name", "<i4"),
        ("tid", "<i4"),
        ("depth", "<i4"),
        ("scope", "<i4"),
    ]
)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None


def library_name() -> str:
    import torch

    key = f"{torch.__version__}|{torch.compiled_with_cxx11_abi()}|".encode() + SOURCE.read_bytes()
    return f"libgpu_trace_ops-{hashlib.sha256(key).hexdigest()[:16]}.so"


def build(out: Path) -> Path:
    """Compile the observer to ``out`` (atomically); :class:`_cbuild.BuildError` says why not."""
    from torch.utils import cpp_extension

    cxx = shlex.split(os.environ.get("CXX", "") or "g++")
    abi = int(__import__("torch").compiled_with_cxx11_abi())
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    cmd = [*cxx, "-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-w"]
    cmd += [f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    for d in cpp_extension.include_paths():
        cmd += ["-I", d]
    cmd += [str(SOURCE), "-o", tmp]
    for d in cpp_extension.library_paths():
        cmd += ["-L", d, f"-Wl,-rpath,{d}"]
    cmd += ["-lc10", "-ltorch_cpu"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_cbuild.BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.unlink(tmp)
        raise _cbuild.BuildError(f"running the C++ compiler {cxx[0]!r} failed: {exc}") from None
    if proc.returncode != 0:
        os.unlink(tmp)
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise _cbuild.BuildError(f"compiling {SOURCE.name} failed: {tail}")
    os.replace(tmp, out)
    return out


def library() -> ctypes.CDLL | None:
    """The loaded observer library, built first if needed; None (logged once) if it cannot be."""
    global _lib, _failed
    with _lock:
        if _lib is not None or _failed is not None:
            return _lib
        try:
            path = _cbuild.find_or_build(SOURCE, library_name(), config.home() / "lib", build)
            lib = ctypes.CDLL(str(path))
            lib.gt_record_size.restype = ctypes.c_size_t
            if lib.gt_record_size() != RECORD.itemsize:
                raise _cbuild.BuildError("the observer's record layout differs from RECORD")
            lib.gt_start.argtypes = [ctypes.c_int]
            lib.gt_drain.restype = ctypes.c_size_t
            lib.gt_drain.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.gt_dropped.restype = ctypes.c_uint64
            lib.gt_set_capacity.argtypes = [ctypes.c_size_t]
            lib.gt_name_count.restype = ctypes.c_int32
            lib.gt_name.restype = ctypes.c_int64
            lib.gt_name.argtypes = [ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]
        except (_cbuild.BuildError, OSError, ImportError, AttributeError) as exc:
            _failed = str(exc)
            log.warning("gpu-trace: the native op observer is not available: %s", exc)
            return None
        _lib = lib
        return lib
