"""Post-import hooks on real modules written to a temporary directory."""

from __future__ import annotations

import importlib
import importlib.resources
import logging
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from gpu_trace import _imports
from gpu_trace._imports import discard, remove_hooks, when_imported


@pytest.fixture(autouse=True)
def _clean_hooks() -> Iterator[None]:
    yield
    remove_hooks()
    assert not any(isinstance(f, _imports._HookFinder) for f in sys.meta_path)


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path; modules imported from it are forgotten afterwards."""
    root = tmp_path / "mods"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    before = set(sys.modules)
    yield root
    for name in set(sys.modules) - before:
        del sys.modules[name]


def write(root: Path, name: str, source: str) -> None:
    path = root.joinpath(*name.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    importlib.invalidate_caches()


class Calls:
    def __init__(self) -> None:
        self.modules: list[ModuleType] = []

    def __call__(self, module: ModuleType) -> None:
        self.modules.append(module)


def test_callback_runs_after_the_first_import_with_the_finished_module(modules: Path) -> None:
    write(modules, "hooked_a", "VALUE = 42\n")
    seen: list[int] = []
    when_imported("hooked_a", lambda m: seen.append(m.VALUE))
    assert "hooked_a" not in sys.modules  # registering does not import
    assert seen == []
    import hooked_a  # noqa: F401

    assert seen == [42]


def test_the_wrapper_leaves_no_trace_on_the_module(modules: Path) -> None:
    write(modules, "hooked_b", "X = 1\n")
    when_imported("hooked_b", Calls())
    import hooked_b

    assert type(hooked_b.__loader__).__name__ == "SourceFileLoader"
    assert hooked_b.__spec__.loader is hooked_b.__loader__


def test_already_imported_module_runs_the_callback_now(modules: Path) -> None:
    write(modules, "hooked_c", "X = 1\n")
    import hooked_c

    calls = Calls()
    when_imported("hooked_c", calls)
    assert calls.modules == [hooked_c]


def test_a_module_imported_twice_runs_the_callback_once(modules: Path) -> None:
    write(modules, "hooked_d", "X = 1\n")
    calls = Calls()
    when_imported("hooked_d", calls)
    when_imported("hooked_d", calls)  # registering twice is one registration
    import hooked_d  # noqa: F401

    importlib.import_module("hooked_d")
    __import__("hooked_d")
    assert len(calls.modules) == 1


def test_a_new_module_object_is_hooked_again(modules: Path) -> None:
    write(modules, "hooked_e", "X = 1\n")
    calls = Calls()
    when_imported("hooked_e", calls)
    first = importlib.import_module("hooked_e")
    del sys.modules["hooked_e"]
    second = importlib.import_module("hooked_e")
    assert calls.modules == [first, second]
    importlib.reload(second)
    assert calls.modules == [first, second, second]


def test_a_module_that_fails_to_import_runs_no_callback_until_it_imports(modules: Path) -> None:
    write(modules, "hooked_f", "raise RuntimeError('broken module')\n")
    calls = Calls()
    when_imported("hooked_f", calls)
    with pytest.raises(RuntimeError, match="broken module"):
        import hooked_f  # noqa: F401
    assert calls.modules == []
    assert "hooked_f" not in sys.modules
    write(modules, "hooked_f", "X = 2\n")
    module = importlib.import_module("hooked_f")
    assert calls.modules == [module]


def test_a_missing_module_is_an_ordinary_import_error(modules: Path) -> None:
    when_imported("hooked_missing", Calls())
    with pytest.raises(ModuleNotFoundError, match="hooked_missing"):
        import hooked_missing  # noqa: F401


def test_a_raising_callback_never_breaks_the_import_and_is_logged_once(
    modules: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write(modules, "hooked_g", "X = 3\n")

    def broken(module: ModuleType) -> None:
        raise KeyError("callback bug")

    after = Calls()
    when_imported("hooked_g", broken)
    when_imported("hooked_g", after)
    with caplog.at_level(logging.ERROR, logger="gpu_trace._imports"):
        module = importlib.import_module("hooked_g")
        importlib.reload(module)
    assert module.X == 3
    assert after.modules == [module, module]  # later callbacks still run
    records = [r for r in caplog.records if "post-import hook" in r.getMessage()]
    assert len(records) == 1
    assert "hooked_g" in records[0].getMessage()


def test_a_raising_callback_on_an_imported_module_is_caught(modules: Path) -> None:
    write(modules, "hooked_h", "X = 1\n")
    importlib.import_module("hooked_h")
    when_imported("hooked_h", lambda m: 1 / 0)  # runs now, raises, is logged


def test_submodules_are_hooked_by_their_full_name(modules: Path) -> None:
    write(modules, "hooked_pkg.__init__", "")
    write(modules, "hooked_pkg.sub", "Y = 'sub'\n")
    calls = Calls()
    when_imported("hooked_pkg.sub", calls)
    import hooked_pkg

    assert calls.modules == []
    import hooked_pkg.sub

    assert calls.modules == [hooked_pkg.sub]


def test_package_resources_still_work(modules: Path) -> None:
    write(modules, "hooked_res.__init__", "")
    (modules / "hooked_res" / "data.txt").write_text("payload")
    when_imported("hooked_res", Calls())
    importlib.import_module("hooked_res")
    assert importlib.resources.files("hooked_res").joinpath("data.txt").read_text() == "payload"


def test_a_callback_may_import_another_hooked_module(modules: Path) -> None:
    write(modules, "hooked_i", "X = 1\n")
    write(modules, "hooked_j", "Y = 2\n")
    inner = Calls()
    when_imported("hooked_j", inner)
    when_imported("hooked_i", lambda m: importlib.import_module("hooked_j"))
    importlib.import_module("hooked_i")
    assert [m.__name__ for m in inner.modules] == ["hooked_j"]


def test_discard_and_remove_hooks(modules: Path) -> None:
    write(modules, "hooked_k", "X = 1\n")
    calls = Calls()
    when_imported("hooked_k", calls)
    discard("hooked_k", calls)
    assert _imports.hooked() == {}
    importlib.import_module("hooked_k")
    assert calls.modules == []
    when_imported("hooked_l", calls)
    remove_hooks()
    assert _imports.hooked() == {}
    assert not any(isinstance(f, _imports._HookFinder) for f in sys.meta_path)


def test_concurrent_imports_run_the_callback_once(modules: Path) -> None:
    write(modules, "hooked_m", "import time\nX = 1\n")
    calls = Calls()
    when_imported("hooked_m", calls)
    barrier = threading.Barrier(8)

    def worker() -> None:
        barrier.wait()
        importlib.import_module("hooked_m")

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls.modules) == 1


@pytest.mark.parametrize("name", ["", None, 3])
def test_bad_module_names_are_value_errors(name: object) -> None:
    with pytest.raises(ValueError):
        when_imported(name, Calls())  # type: ignore[arg-type]


def test_a_callback_must_be_callable() -> None:
    with pytest.raises(ValueError):
        when_imported("json", "not callable")  # type: ignore[arg-type]
