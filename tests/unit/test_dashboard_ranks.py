"""The dashboard's Ranks tab (dashboard/rank_view.py, plots/rank_charts.py) on a real chDB store:
a two-rank run's ranks, steps, collectives and stragglers as `show` gives them, its charts, and a
note for a run without ranks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("dash")

from gpu_trace.dashboard import rank_view  # noqa: E402
from gpu_trace.dashboard.layout import TABS  # noqa: E402
from gpu_trace.dashboard.readonly_store import ReadOnlyStore  # noqa: E402
from gpu_trace.query.distributed import rank_summary  # noqa: E402
from gpu_trace.store.client import Store  # noqa: E402
from tests.dashboard_data import XSS, minute_run, ranked_run  # noqa: E402


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadOnlyStore]:
    store = Store(f"chdb://{tmp_path_factory.mktemp('ranks-tab') / 'store'}")
    ranked_run(store)
    minute_run(store)
    src = ReadOnlyStore(store=store)
    yield src
    src.close()


def texts(node: object) -> list[str]:
    """Every string in a component tree, in order."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, (list, tuple)):
        return [s for n in node for s in texts(n)]
    children = getattr(node, "children", None)
    return texts(children) if children is not None else []


def find(node: object, id_: str) -> object | None:
    if getattr(node, "id", None) == id_:
        return node
    children = node if isinstance(node, (list, tuple)) else getattr(node, "children", None)
    for child in children if isinstance(children, (list, tuple)) else [children]:
        if child is not None and not isinstance(child, str):
            got = find(child, id_)
            if got is not None:
                return got
    return None


def test_the_ranks_tab_is_a_tab() -> None:
    assert ("ranks", "Ranks") in TABS


def test_a_two_rank_run_shows_its_ranks_steps_collectives_and_stragglers(
    source: ReadOnlyStore,
) -> None:
    summary = rank_summary(source, "ranked")
    assert summary is not None
    view = rank_view.ranks(summary)
    text = " ".join(texts(view))
    assert "world size 2, backend gloo" in text
    assert "straggler: rank 1, last to enter 3 collectives; the others waited 600 µs" in text
    table = " ".join(texts(find(view, "ranks-table")))
    assert "NCCL overlap" in table and "20.0%" in table  # rank 0's kernels: 50 of 250 µs
    stragglers = texts(find(view, "ranks-step-stragglers"))
    assert [s for s in stragglers if s in ("0", "1", "2")][:2] == ["0", "1"]  # step 0, rank 1
    assert "1:200 µs" in stragglers
    step_time = find(view, "ranks-step-time").figure  # type: ignore[union-attr]
    assert [t.name for t in step_time.data] == [p for p, _ in rank_view.rank_charts.PARTS]
    assert [t.x for t in step_time.data][0] == ("rank 0", "rank 1")
    for r, rank in enumerate(summary.ranks):  # the four parts add up to each rank's step time
        total = sum(t.y[r] for t in step_time.data)
        assert total == pytest.approx(rank.step_ns / 1e6)
    comm = find(view, "ranks-comm").figure  # type: ignore[union-attr]
    assert [t.name for t in comm.data] == ["rank 0", "rank 1"]
    assert list(comm.data[0].x) == [0, 1, 2]
    assert "collectives" in text and "all_reduce" in " ".join(
        texts(find(view, "ranks-collectives"))
    )


def test_a_run_without_ranks_says_so(source: ReadOnlyStore) -> None:
    assert rank_summary(source, "minute") is None
    view = rank_view.ranks(None)
    assert view.id == "ranks-none" and "This run has no ranks" in " ".join(texts(view))


def test_names_are_text_in_the_charts() -> None:
    from gpu_trace.plots.figures import esc

    assert "<" not in esc(XSS)  # the charts draw ranks by number, names through esc
