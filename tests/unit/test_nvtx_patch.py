"""The pure-Python NVTX path: patches of the nvtx package, in process, through the real recorder."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest

import gpu_trace
from gpu_trace.collectors import nvtx as nvtx_collector
from gpu_trace.collectors.nvtx import patch as nvtx_patch
from tests.conftest import recorded

nvtx = pytest.importorskip("nvtx")


@pytest.fixture(autouse=True)
def _nothing_left_patched():
    yield
    leaked = nvtx_patch.is_patched()
    nvtx_patch.unpatch()
    assert not leaked, "nvtx was left patched"


def test_patch_is_symmetric_and_idempotent() -> None:
    originals = {name: getattr(nvtx, name) for name in nvtx_patch.NAMES}
    assert nvtx_patch.patch()
    assert nvtx.push_range is nvtx_patch.push_range
    assert nvtx_patch.patch()  # again: undoes the first, same result
    assert nvtx.annotate is nvtx_patch.annotate
    nvtx_patch.unpatch()
    nvtx_patch.unpatch()
    assert {name: getattr(nvtx, name) for name in nvtx_patch.NAMES} == originals


def test_records_nesting_lanes_and_attrs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    gpu_trace.start(run, nvtx="python")
    try:
        with nvtx.annotate("outer", domain="A", category="io", payload=7):
            nvtx.push_range("inner", domain="A", color=0xFF112233)
            nvtx.mark("tick", domain="A")
            nvtx.pop_range(domain="A")
            nvtx.push_range("other-domain")
            nvtx.pop_range()

        @nvtx.annotate(domain="B")
        def decorated() -> int:
            return 3

        assert decorated() == 3
        d = nvtx.get_domain("B")
        attrs = d.get_event_attributes(message="reg", category="cat")
        d.push_range(attrs)
        rid = d.start_range(message="cross")
        d.pop_range()
        t = threading.Thread(target=d.end_range, args=(rid,))
        t.start()
        t.join()
        token = nvtx.start_range("global")
        nvtx.end_range(token)
    finally:
        gpu_trace.stop()
    rows = recorded(run)
    got = Counter((r["lane"], r["category"], r["name"], r["depth"]) for r in rows)
    assert got == Counter(
        {
            ("nvtx/A", "nvtx", "outer", 0): 1,
            ("nvtx/A", "nvtx", "inner", 1): 1,
            ("nvtx/A", "mark", "tick", 2): 1,
            ("nvtx/default", "nvtx", "other-domain", 0): 1,
            ("nvtx/B", "nvtx", "decorated", 0): 1,
            ("nvtx/B", "nvtx", "reg", 0): 1,
            ("nvtx/B", "nvtx", "cross", 0): 1,
            ("nvtx/default", "nvtx", "global", 0): 1,
        }
    )
    by_name = {r["name"]: r for r in rows}
    assert by_name["inner"]["parent_span_id"] == by_name["outer"]["span_id"]
    assert by_name["tick"]["parent_span_id"] == by_name["inner"]["span_id"]
    assert by_name["other-domain"]["parent_span_id"] == 0  # nesting is per domain
    assert dict(by_name["outer"]["attrs"]) == {
        "category": "io",
        "color": "#000000ff",
        "payload": "7",
    }
    assert dict(by_name["inner"]["attrs"])["color"] == "#ff112233"
    assert dict(by_name["reg"]["attrs"])["category"] == "cat"
    assert by_name["tick"]["start_ns"] == by_name["tick"]["end_ns"]
    assert by_name["cross"]["tid"] == threading.get_native_id()
    assert not nvtx_patch.is_patched()  # stop() unpatched


def test_malformed_calls_never_raise(tmp_path: Path) -> None:
    gpu_trace.start(tmp_path / "run", nvtx="python")
    try:
        nvtx.pop_range()  # nothing open
        nvtx.pop_range(domain="never-pushed")
        nvtx.end_range(None)
        nvtx.push_range(None)
        nvtx.pop_range()
        nvtx.mark()
        with nvtx.annotate():
            pass
        d = nvtx.get_domain("D")
        d.pop_range()
        d.end_range(d.start_range())
    finally:
        gpu_trace.stop()


def test_without_recorder_the_patches_only_forward() -> None:
    nvtx_patch.patch()
    try:
        with nvtx.annotate("x"):
            nvtx.mark("m")
        nvtx.end_range(nvtx.start_range("s"))
    finally:
        nvtx_patch.unpatch()


def test_attach_modes(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        nvtx_collector.attach(object(), "bogus")
    assert nvtx_collector.attach(object(), "off") == "off"
    assert nvtx_collector.injection_env("python") == {}
    assert nvtx_collector.injection_env("off") == {}
