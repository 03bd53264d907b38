"""Type-check the package with mypy under the module names it is installed as.

pyproject.toml maps top-level folders into ``gpu_trace.*`` (``tracer/`` is ``gpu_trace.tracer``),
and the editable install resolves them through an import hook that mypy does not run. So this
builds the installed layout as a tree of symlinks under ``build/typecheck/`` (git-ignored, rebuilt
on every run, so new files are seen) and runs ``mypy -p gpu_trace`` over it; the settings are in
pyproject.toml's ``[tool.mypy]``, the cache in ``.mypy_cache/``. Extra arguments go to mypy.
Exits with mypy's status.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"


def package_dirs() -> dict[str, str]:
    """[tool.setuptools.package-dir]: package name to source folder."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["setuptools"]["package-dir"])


def build_tree(package_dir: dict[str, str]) -> Path:
    """The installed layout of gpu_trace as symlinks under TREE."""
    package_dir = dict(package_dir)
    shutil.rmtree(TREE, ignore_errors=True)
    top = TREE / "gpu_trace"
    top.mkdir(parents=True)
    for entry in (ROOT / package_dir.pop("gpu_trace")).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for package, folder in package_dir.items():
        parent, _, name = package.rpartition(".")
        if parent != "gpu_trace":
            raise SystemExit(f"typecheck: package-dir {package!r} is not a child of gpu_trace")
        link = top / name
        if link.is_symlink():
            link.unlink()  # a subpackage folder named like an entry of gpu_trace/
        link.symlink_to(ROOT / folder, target_is_directory=True)
    return TREE


def main(argv: list[str]) -> int:
    package_dir = package_dirs()
    tree = build_tree(package_dir)
    env = dict(os.environ, MYPYPATH=str(tree))
    command = [sys.executable, "-m", "mypy", "-p", "gpu_trace", *argv]
    done = subprocess.run(
        command, cwd=ROOT, env=env, check=False, stdout=subprocess.PIPE, text=True
    )
    # Name the files as they are in the checkout (store/client.py), not as linked in the tree.
    linked = tree.relative_to(ROOT).as_posix()
    renames = sorted(
        ((f"{linked}/{p.replace('.', '/')}/", f"{d}/") for p, d in package_dir.items()),
        key=lambda pair: -len(pair[0]),
    )
    for line in done.stdout.splitlines():
        for old, new in renames:
            if line.startswith(old):
                line = new + line[len(old) :]
                break
        print(line)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
