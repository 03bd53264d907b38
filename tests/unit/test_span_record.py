"""One span record, one push, one conversion to Arrow (docs/api.md).

Every producer appends span tuples laid out as ``tracer.records.Span`` through
``ThreadBuffer.add_span`` (the C range is its native twin and mirrors the layout in ``SPAN_*``
indices), and every ``spans`` table is built by ``tracer/columns.py``. These tests hold that: from
the source for the rules, and from a real recorder's buffers for the records.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import gpu_trace
from gpu_trace import _api
from gpu_trace.framework_patches import spans as framework_spans
from gpu_trace.tracer import recorder
from gpu_trace.tracer.records import SPAN_FIELDS, Span
from tests.unit.test_layers import modules

PACKAGES = (
    "gpu_trace",
    "gpu_trace.tracer",
    "gpu_trace.collectors",
    "gpu_trace.framework_patches",
    "gpu_trace.runtime",
    "gpu_trace.dashboard",
)
#: The one home of span tables, and the one of the per-thread append.
CONVERSION = "gpu_trace.tracer.columns"
PUSH = "gpu_trace.tracer.buffer"
TABLE_BUILDERS = {"table", "from_arrays", "from_pydict", "from_pylist", "from_batches"}


def sources() -> Iterator[tuple[str, Path, ast.AST]]:
    seen: set[Path] = set()
    for package in PACKAGES:
        for module, path in modules(package):
            if path not in seen:
                seen.add(path)
                yield module, path, ast.parse(path.read_text(), str(path))


def _names(node: ast.AST) -> set[str]:
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            found.add(n.value)
    return found


def test_only_the_conversion_builds_span_tables() -> None:
    found = []
    for module, _path, tree in sources():
        if module == CONVERSION:
            continue
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in TABLE_BUILDERS
                and _names(node) & {"SPAN_SCHEMA", "span_id", "parent_span_id"}
            ):
                found.append(f"{module}:{node.lineno}")
            named = isinstance(node, ast.Name) and node.id == "SPAN_SCHEMA"
            if named and module != "gpu_trace.tracer.records":
                found.append(f"{module}:{node.lineno} names SPAN_SCHEMA")
    assert not found, f"spans tables built outside {CONVERSION}: {sorted(set(found))}"


def _buffer_spans(node: ast.AST) -> bool:
    """``<x>.spans`` for an ``x`` other than ``self`` (a SpanLog's own list is another thing)."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "spans"
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    )


def test_only_the_buffer_appends_to_a_thread_buffer() -> None:
    found = []
    for module, _path, tree in sources():
        if module == PUSH:
            continue
        for node in ast.walk(tree):
            appends = (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("append", "extend")
                and _buffer_spans(node.func.value)
            )
            aliases = isinstance(node, ast.Assign) and _buffer_spans(node.value)
            if appends or aliases:
                found.append(f"{module}:{node.lineno}")
    assert not found, f"spans appended outside {PUSH}.ThreadBuffer.add_span: {found}"


def test_the_c_range_mirrors_the_record_layout() -> None:
    source = (Path(recorder.__file__).parent / "_fastpath.c").read_text()
    enum = re.search(r"enum \{\s*(SPAN_ID,.*?)\}", source, re.S)
    assert enum is not None, "_fastpath.c has no SPAN_* field indices"
    names = [n.strip() for n in enum.group(1).split(",") if n.strip()]
    expected = ["SPAN_ID" if f == "span_id" else f"SPAN_{f.upper()}" for f in SPAN_FIELDS]
    assert names == [*expected, "SPAN_NFIELDS"]
    assert "PyTuple_New(SPAN_NFIELDS)" in source


def _check(record: object) -> None:
    assert type(record) is tuple and len(record) == len(SPAN_FIELDS), record
    span = Span(*record)
    assert all(isinstance(v, int) for v in (span.span_id, span.parent_span_id, span.depth))
    assert all(isinstance(v, int) for v in (span.start_ns, span.end_ns))
    assert all(isinstance(v, str) for v in (span.lane, span.category, span.name))
    assert span.attrs is None or all(
        isinstance(k, str) and isinstance(v, str) for k, v in span.attrs.items()
    )


@pytest.mark.parametrize("impl", ["c", "python"])
def test_every_python_producer_appends_the_declared_record(tmp_path: Path, impl: str) -> None:
    rng = gpu_trace.range if impl == "c" else _api.PyRange
    if impl == "c" and rng is _api.PyRange:
        pytest.skip("the C range did not build here")
    gpu_trace.start(tmp_path / "run", nvtx="off", flush_interval_s=60)
    try:
        rec = recorder.active
        assert rec is not None
        with rng("outer", k=1):
            gpu_trace.mark("m", why="test")
            framework_spans.add(framework_spans.Domain("t"), "op", "added", 1, 2, {"a": "b"})
            token = framework_spans.begin(framework_spans.Domain("t"), "module", "m", None)
            framework_spans.end(token)
        gpu_trace.step(1)
        gpu_trace.step(2)
        buf = rec.buffer()
        records = list(buf.spans)
    finally:
        gpu_trace.stop()
    assert {Span(*r).name for r in records} >= {"outer", "m", "added", "ProfilerStep#1"}
    for r in records:
        _check(r)
