"""The import rules between the package's layers, read from the source (no module is imported).

tracer/ is the bottom layer (capture -> record -> store -> views): it imports nothing above it, so
what a run records besides its own ranges is handed to it (``gpu_trace/_capture.py``). Collectors
and framework patches use each other's public names only.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

#: What tracer/ may import from the package besides itself: configuration and standard-library-only helpers.
TRACER_MAY_IMPORT = (
    "gpu_trace.tracer",
    "gpu_trace.config",
    "gpu_trace._imports",
    "gpu_trace._cbuild",
)


def modules(package: str) -> Iterator[tuple[str, Path]]:
    """(dotted name, file) of every module in ``package`` and its subpackages."""
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations
    for folder in map(Path, spec.submodule_search_locations):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join((package, *parts)), path


def imports(module: str, path: Path) -> Iterator[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for every import, nested ones included."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            yield base, [a.name for a in node.names], node.lineno


def test_tracer_imports_nothing_above_it() -> None:
    found = [
        f"{module}:{line} imports {target}"
        for module, path in modules("gpu_trace.tracer")
        for target, names, line in imports(module, path)
        if target.startswith("gpu_trace")
        and not any(
            target == allowed or target.startswith(allowed + ".") for allowed in TRACER_MAY_IMPORT
        )
        and not (
            target == "gpu_trace"
            and all(f"gpu_trace.{n}".startswith(TRACER_MAY_IMPORT) for n in names)
        )
    ]
    assert found == []


def private_uses(module: str, path: Path) -> Iterator[str]:
    """Private names of other gpu_trace modules that ``module`` uses: imported or as attributes."""
    tree = ast.parse(path.read_text(), str(path))
    aliases: dict[str, str] = {}
    for target, names, line in imports(module, path):
        if not target.startswith("gpu_trace") or target == module:
            continue
        for name in names:
            if (
                name.startswith("_")
                and not name.startswith("__")
                and f"{target}.{name}" not in ALLOWED_PRIVATE_MODULES
            ):
                yield f"{module}:{line} imports {target}.{name}"
            aliases[name] = f"{target}.{name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            yield f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}"


#: Private modules of the package meant for its own use (the leading underscore keeps them off
#: the public API, not away from the package).
ALLOWED_PRIVATE_MODULES = {
    "gpu_trace._imports",
    "gpu_trace._cbuild",
    "gpu_trace._capture",
    "gpu_trace._format",
    "gpu_trace._api",
}


def test_collectors_and_framework_patches_use_no_private_name_of_another_module() -> None:
    found = [
        use
        for package in ("gpu_trace.collectors", "gpu_trace.framework_patches")
        for module, path in modules(package)
        for use in private_uses(module, path)
    ]
    assert found == []


def load_by_path(path: Path) -> ModuleType:
    """``path`` as a module of its own, as setup.py loads the builders: no package around it."""
    name = f"_by_path_{path.parent.name}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


@pytest.mark.parametrize(
    "builder", ["gpu_trace.collectors.nvtx.build", "gpu_trace.tracer.fastpath_build"]
)
def test_builders_load_by_path_and_build_with_the_helper_passed_in(
    builder: str, tmp_path: Path
) -> None:
    # setup.py prebuilds the C libraries before gpu_trace is importable: the builders and
    # _cbuild must load alone, with no import that works only through a mapping of the package.
    spec = importlib.util.find_spec(builder)
    cbuild_spec = importlib.util.find_spec("gpu_trace._cbuild")
    assert spec and spec.origin and cbuild_spec and cbuild_spec.origin
    cbuild = load_by_path(Path(cbuild_spec.origin))
    module = load_by_path(Path(spec.origin))
    assert module.library_name()
    with pytest.raises(cbuild.BuildError):  # the helper passed in is the one used
        module.build(tmp_path / "x.so", cc=str(tmp_path / "no-such-cc"), cbuild=cbuild)


#: The folders mapped into gpu_trace.* besides gpu_trace/ itself.
TOP_LEVEL = (
    "gpu_trace.tracer",
    "gpu_trace.collectors",
    "gpu_trace.framework_patches",
    "gpu_trace.runtime",
    "gpu_trace.dashboard",
)


def test_collectors_and_framework_patches_share_no_file_name_with_another_module() -> None:
    # One meaning per file name: a folder says the family (nvtx/, nvml/, torch/), not a prefix.
    everywhere: dict[str, set[str]] = {}
    # gpu_trace's top-level folders are mapped in one by one (pyproject.toml's package-dir)
    for package in ("gpu_trace", *TOP_LEVEL):
        for module, path in modules(package):
            if path.stem not in ("__init__", "__main__"):
                everywhere.setdefault(path.name, set()).add(module)
    found = {
        name: owners
        for name, owners in everywhere.items()
        if len(owners) > 1
        and any(
            m.startswith(("gpu_trace.collectors.", "gpu_trace.framework_patches.")) for m in owners
        )
    }
    assert found == {}
