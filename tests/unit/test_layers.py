"""The import rules between the package's layers, read from the source (no module is imported).

tracer/ is the bottom layer (capture -> record -> store -> query -> views/export): it imports
nothing above it, so what a run records besides its own ranges is handed to it
(``gpu_trace/_capture.py``). store/ sits on the tracer, query/ on the store, export/ on both; SQL
is written only in store/ and query/, and the public ``Run`` reads through query/ without the CLI
or the dashboard. Collectors and framework patches use each other's public names only.
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


def package_dirs() -> dict[str, str]:
    """pyproject.toml's [tool.setuptools.package-dir]: each top-level folder's package."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f)["tool"]["setuptools"]["package-dir"])


ROOT = Path(__file__).resolve().parents[2]
#: The folders mapped into gpu_trace.* besides gpu_trace/ itself.
TOP_LEVEL = tuple(p for p in package_dirs() if p != "gpu_trace")


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
        if len(owners) > 1 and any(m.startswith(UNIQUE_NAMES) for m in owners)
    }
    assert found == {}


#: Packages whose file names are unique across the package (the others predate the rule).
UNIQUE_NAMES = (
    "gpu_trace.collectors.",
    "gpu_trace.framework_patches.",
    "gpu_trace.store.",
    "gpu_trace.query.",
    "gpu_trace.export.",
)


#: The read side's layers, bottom up, and what each may import from the package besides itself
#: (settings and standard-library-only helpers are everyone's).
COMMON = ("gpu_trace.config", "gpu_trace._imports", "gpu_trace._progress", "gpu_trace._format")
LAYERS = {
    "gpu_trace.store": ("gpu_trace.tracer",),
    "gpu_trace.query": ("gpu_trace.tracer", "gpu_trace.store"),
    "gpu_trace.export": ("gpu_trace.tracer", "gpu_trace.store", "gpu_trace.query"),
}


def _allowed(target: str, names: list[str], allowed: tuple[str, ...]) -> bool:
    if target == "gpu_trace":  # `from gpu_trace import config`
        return all(f"gpu_trace.{n}".startswith(allowed) for n in names)
    return any(target == a or target.startswith(a + ".") for a in allowed)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_read_layer_imports_only_the_layers_below_it(layer: str) -> None:
    allowed = (layer, *LAYERS[layer], *COMMON)
    found = [
        f"{module}:{line} imports {target}"
        for module, path in modules(layer)
        for target, names, line in imports(module, path)
        if target.startswith("gpu_trace") and not _allowed(target, names, allowed)
    ]
    assert found == []


def test_sql_is_written_only_in_the_store_and_the_query_layer() -> None:
    # Every query template names its tables ``__db__.<table>`` (the store swaps in the checked
    # database name); the CLI, the dashboard, Run, the exporters and everything else format what
    # query/ returns and write none.
    found = []
    for package in ("gpu_trace", *TOP_LEVEL):
        if package in ("gpu_trace.store", "gpu_trace.query"):
            continue
        for module, path in modules(package):
            if module.startswith(("gpu_trace.store", "gpu_trace.query")):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and "__db__." in node.value
                ):
                    found.append(f"{module}:{node.lineno}")
    assert found == []


def _reached(start: str) -> dict[str, str]:
    """Every gpu_trace module ``start`` imports, directly or not (nested imports included), each
    with the module that imports it."""
    files = {m: p for package in ("gpu_trace", *TOP_LEVEL) for m, p in modules(package)}
    seen = {start: start}
    todo = [start]
    while todo:
        module = todo.pop()
        for target, names, _ in imports(module, files[module]):
            for name in (target, *(f"{target}.{n}" for n in names)):
                if name in files and name not in seen:
                    seen[name] = module
                    todo.append(name)
    return seen


@pytest.mark.parametrize("public", ["gpu_trace.run_view", "gpu_trace.profiling"])
def test_the_public_run_needs_neither_the_cli_nor_the_dashboard(public: str) -> None:
    # gpu_trace.runs(), run(), Run and profile() read through query/ and draw with plots/: a
    # notebook loads neither the CLI's commands nor the Dash app.
    reached = _reached(public)
    found = sorted(
        f"{m} (imported by {by})"
        for m, by in reached.items()
        if m.startswith(("gpu_trace.cli", "gpu_trace.commands", "gpu_trace.dashboard"))
    )
    assert found == []
