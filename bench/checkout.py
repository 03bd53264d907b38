"""Another checkout of gpu-trace for a bench's before/after rounds: imported in place of this
one (:func:`use_tree`), checked out from a revision (:func:`worktree`), named (:func:`describe`).

The benches that time a change against an earlier commit (ingest.py, dashboard.py,
executor_overhead.py) run each tree in child processes of their own; a child calls
:func:`use_tree` before it imports ``gpu_trace``. Run as scripts, the benches find this module
beside them (``python bench/ingest.py`` puts ``bench/`` first on ``sys.path``).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

#: This checkout.
TREE = Path(__file__).resolve().parents[1]


def use_tree(tree: str | Path) -> None:
    """Import ``gpu_trace`` and its folders from ``tree``, mapped as that tree's
    ``pyproject.toml`` maps them (``[tool.setuptools] package-dir``), ahead of the installed
    package."""
    with open(os.path.join(tree, "pyproject.toml"), "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    mapping = {name: os.path.join(tree, path) for name, path in dirs.items()}

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
            if fullname in mapping:
                init = os.path.join(mapping[fullname], "__init__.py")
                return importlib.util.spec_from_file_location(
                    fullname, init, submodule_search_locations=[mapping[fullname]]
                )
            return None

    sys.meta_path.insert(0, Finder())


def worktree(baseline: str, tmp: Path) -> tuple[Path, str | None]:
    """The baseline's tree: ``baseline`` itself if it is a directory, else a ``git worktree`` of
    that revision made in ``tmp``; and the worktree to remove after (None for a directory)."""
    if Path(baseline).is_dir():
        return Path(baseline).resolve(), None
    tree = tmp / "baseline"
    subprocess.run(
        ["git", "-C", str(TREE), "worktree", "add", "--detach", "-q", str(tree), baseline],
        check=True,
    )
    return tree, str(tree)


def remove(worktree_path: str | None) -> None:
    """Remove a worktree :func:`worktree` made (nothing for None)."""
    if worktree_path:
        subprocess.run(
            ["git", "-C", str(TREE), "worktree", "remove", "--force", worktree_path],
            check=False,
        )


def describe(tree: Path) -> str:
    """``tree``'s commit, ``+ working tree`` where tracked files changed since."""
    rev = subprocess.run(
        ["git", "-C", str(tree), "log", "-1", "--format=%h"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"{rev}{' + working tree' if dirty else ''}" if rev else str(tree)
