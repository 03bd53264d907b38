"""The details panel's parent and children on a real chDB store: a span that names no parent (a
step, a top-level range, module or op) is the child of the innermost span of its thread enclosing
it, as the OTLP export has it (query/nesting.py); a step's children were "children (0)"."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("dash")

from gpu_trace.dashboard import panels, timeline  # noqa: E402
from gpu_trace.dashboard.readonly_store import ReadOnlyStore  # noqa: E402
from gpu_trace.query import relatives
from gpu_trace.query.source import rows as query_rows
from gpu_trace.store.client import Store  # noqa: E402
from tests.dashboard_data import add_run  # noqa: E402
from tests.unit.test_dashboard import text_of  # noqa: E402

MS = 1_000_000

#: One thread of a training loop as the store holds it: only what a producer knew names a parent.
SPANS = [
    {"span_id": 1, "name": "ProfilerStep#0", "lane": "steps", "category": "step",
     "start_ns": 0, "end_ns": MS},
    {"span_id": 2, "name": "ProfilerStep#1", "lane": "steps", "category": "step",
     "start_ns": MS, "end_ns": 2 * MS},
    {"span_id": 3, "name": "forward", "lane": "nvtx/gpu_trace", "start_ns": 100_000,
     "end_ns": 600_000},
    {"span_id": 4, "name": "Net", "lane": "nvtx/torch", "category": "module", "parent_span_id": 3,
     "start_ns": 150_000, "end_ns": 500_000},
    {"span_id": 5, "name": "aten::linear", "lane": "torch/ops", "category": "op",
     "start_ns": 200_000, "end_ns": 300_000},
    {"span_id": 6, "name": "aten::addmm", "lane": "torch/ops", "category": "op",
     "parent_span_id": 5, "start_ns": 210_000, "end_ns": 290_000},
    {"span_id": 7, "name": "aten::zero_", "lane": "torch/ops", "category": "op",
     "start_ns": 700_000, "end_ns": 750_000},
    # A forwarded batch across the step boundary: in no step, holding only its ops.
    {"span_id": 8, "name": "batch", "lane": "forward/batch", "category": "forward",
     "start_ns": 650_000, "end_ns": 1_500_000},
    {"span_id": 9, "name": "aten::mm", "lane": "forward/op", "category": "forward",
     "parent_span_id": 8, "start_ns": 1_100_000, "end_ns": 1_110_000},
    # Device work names its launch (here none): never placed by time.
    {"span_id": 10, "name": "gemm", "lane": "gpu0/stream7", "category": "kernel", "tid": 0,
     "start_ns": 710_000, "end_ns": 720_000},
    {"span_id": 11, "name": "boundary", "lane": "nvtx/gpu_trace", "category": "mark",
     "start_ns": MS, "end_ns": MS},
    {"span_id": 12, "name": "backward", "lane": "nvtx/gpu_trace", "start_ns": 1_200_000,
     "end_ns": 1_300_000},
    {"span_id": 13, "name": "loader", "lane": "nvtx/gpu_trace", "tid": 11, "start_ns": 300_000,
     "end_ns": 400_000},
]  # fmt: skip


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadOnlyStore]:
    store = Store(f"chdb://{tmp_path_factory.mktemp('nest') / 'store'}")
    add_run(store, "nest", SPANS, 0, 2 * MS)
    src = ReadOnlyStore(store=store)
    yield src
    src.close()


def details(source: ReadOnlyStore, span_id: int) -> dict:
    start = next(s["start_ns"] for s in SPANS if s["span_id"] == span_id)
    found = timeline.span(source, "nest", str(span_id), start)
    assert found is not None
    return found


def kids(s: dict) -> list[str]:
    return [c["name"] for c in s["children"]]


def test_a_step_lists_what_it_encloses_as_its_children(source: ReadOnlyStore) -> None:
    step = details(source, 1)
    assert step["parent"] is None and kids(step) == ["forward", "aten::zero_"]
    assert step["children_total"] == 2 and not step["children_partial"]
    assert "children (2)" in text_of(panels.details(step, [], 0))
    # A zero-length span at the boundary belongs to the step starting there.
    assert kids(details(source, 2)) == ["boundary", "backward"]


def test_parents_by_time_and_by_name_chain_up_to_the_step(source: ReadOnlyStore) -> None:
    forward, net, linear = details(source, 3), details(source, 4), details(source, 5)
    assert forward["parent"]["name"] == "ProfilerStep#0" and kids(forward) == ["Net"]
    assert net["parent"]["name"] == "forward" and kids(net) == ["aten::linear"]
    assert linear["parent"]["name"] == "Net" and kids(linear) == ["aten::addmm"]
    shown = text_of(panels.details(linear, [], 0))
    assert "Net" in shown and "none (a root span)" not in shown


def test_batches_device_work_and_other_threads_are_not_nested(source: ReadOnlyStore) -> None:
    batch = details(source, 8)
    assert batch["parent"] is None and kids(batch) == ["aten::mm"]
    assert details(source, 9)["parent"]["name"] == "batch"
    assert details(source, 10)["parent"] is None
    assert details(source, 13)["parent"] is None


def test_a_span_with_more_inside_than_is_read_says_its_count_is_a_floor(
    source: ReadOnlyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relatives, "MAX_NESTED_SCAN", 3)  # the step, forward, Net
    step = details(source, 1)
    assert kids(step) == ["forward"] and step["children_partial"]
    assert "children (1+)" in text_of(panels.details(step, [], 0))


def test_the_store_keeps_the_parents_as_recorded(source: ReadOnlyStore) -> None:
    """The rule is applied when read: the spans table keeps the parent ids its producers named."""
    rows = query_rows(
        source,
        "SELECT span_id, parent_span_id FROM __db__.spans WHERE run_id = {r:String}",
        {"r": "nest"},
    )
    assert {r["span_id"]: r["parent_span_id"] for r in rows} == {
        s["span_id"]: s.get("parent_span_id", 0) for s in SPANS
    }
