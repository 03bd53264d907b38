"""The wheel maps the top-level folders into gpu_trace.* and installs a working `gpu-trace`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from gpu_trace import _cbuild
from gpu_trace.collectors.nvtx import build as nvtx_build
from gpu_trace.tracer import fastpath_build
from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_wheel_installs_into_a_clean_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(REPO),
        ],
        check=True,
        cwd=tmp_path,
    )
    wheels = list(dist.glob("gpu_trace-*.whl"))
    assert len(wheels) == 1
    import zipfile

    names = zipfile.ZipFile(wheels[0]).namelist()
    for module in (
        "gpu_trace/cli.py",
        "gpu_trace/tracer/recorder.py",
        "gpu_trace/collectors/nvtx/inject.c",
        "gpu_trace/_boot/sitecustomize.py",
        "gpu_trace/runtime/server/allowed_ops.txt",
    ):
        assert module in names, module
    assert not any(n.startswith(("tracer/", "collectors/", "tests/")) for n in names)
    # setup.py prebuilds the C libraries where a compiler and the headers are here (it loads the
    # builders by path: a broken load is only a warning, so look for what it built).
    for builder, folder in ((nvtx_build, "collectors/nvtx"), (fastpath_build, "tracer")):
        if can_build(builder):
            assert f"gpu_trace/{folder}/{builder.library_name()}" in names, builder.__name__

    env_dir = tmp_path / "clean"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheels[0])], check=True)
    out = subprocess.run(
        [str(env_dir / "bin" / "gpu-trace"), "--help"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert "record" in out.stdout and "export" in out.stdout
    # the API imports from the installed wheel, not from the source tree
    where = subprocess.run(
        [str(py), "-c", "import gpu_trace.tracer.recorder as r; print(r.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert str(env_dir) in where.stdout


def can_build(builder) -> bool:
    """Whether ``builder`` can compile here: a compiler, the headers, a supported platform."""
    try:
        argv = _cbuild.compiler_command(os.environ.get("GPU_TRACE_CC"))
        if shutil.which(argv[0]) is None:
            return False
        if builder is nvtx_build:
            return sys.platform == "linux" and nvtx_build.include_dir() is not None
        fastpath_build.include_dirs()
        return fastpath_build.supported() is None
    except _cbuild.BuildError:
        return False
