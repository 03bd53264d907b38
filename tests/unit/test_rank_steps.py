"""Per step and rank: computation, communication, their overlap and idle time (query/rank_time.py),
on a real chDB store holding spans whose figures are known exactly, and the interval arithmetic
they rest on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpu_trace._summary_text import render_ranks
from gpu_trace.query import distributed as ranks
from gpu_trace.query import rank_time
from gpu_trace.run_view import Run
from gpu_trace.store.client import Store
from gpu_trace.tracer.ranks import COLLECTIVE_LANE
from tests.dashboard_data import add_run

US = 1000


def two_ranks(store: Store) -> None:
    """Two ranks (pids 100 and 200), two steps of 1000 µs each on each.

    Rank 0, step 0 ``[0, 1000)``: a ``backward`` module ``[100, 700)`` on the main thread with an
    all_reduce called inside it ``[400, 600)``: it holds the wait, so it computes only outside
    the call, ``[100, 400) + [600, 700)``; the layer's backward under it ``[150, 380)`` counts,
    and so does the next layer's ``[420, 480)``, run while the all_reduce is in flight, and an op
    on a second thread ``[500, 650)``. So compute ``[100, 400) + [420, 480) + [500, 700)`` = 560,
    comm 200, overlap ``[420, 480) + [500, 600)`` = 160, idle 1000 - ``|[100, 700)|`` = 400.
    Step 1 ``[1000, 2000)``: a GPU kernel ``[1100, 1500)`` and an NCCL kernel ``[1300, 1800)`` on
    another stream: compute 400, comm 500, overlap 200, idle 300.
    Rank 1: step 0 nothing but an all_reduce ``[550, 600)``; step 1 an op ``[1000, 1900)``.
    A process without a rank (pid 300) has a step and spans that count for no rank."""
    spans: list[dict[str, Any]] = []

    def add(pid: int, name: str, lane: str, cat: str, t0: int, t1: int, tid: int = 1) -> None:
        spans.append({"name": name, "lane": lane, "category": cat, "start_ns": t0 * US,
                      "end_ns": t1 * US, "pid": pid, "tid": tid})  # fmt: skip

    for pid in (100, 200, 300):
        add(pid, "ProfilerStep#0", "steps", "step", 0, 1000)
        add(pid, "ProfilerStep#1", "steps", "step", 1000, 2000)
    add(100, "backward", "torch/modules", "module", 100, 700)
    add(100, "all_reduce", COLLECTIVE_LANE, "collective", 400, 600)
    add(100, "Linear.backward", "torch/modules", "module", 150, 380)
    add(100, "Linear2.backward", "torch/modules", "module", 420, 480)
    add(100, "gloo:all_reduce", f"{COLLECTIVE_LANE}/gloo", "collective", 410, 590, tid=9)
    add(100, "aten::add", "torch/ops", "op", 500, 650, tid=2)
    add(100, "sgemm", "gpu0/stream7", "kernel", 1100, 1500, tid=0)
    add(100, "ncclDevKernel_AllReduce_Sum_f32", "gpu0/stream13", "kernel", 1300, 1800, tid=0)
    add(200, "all_reduce", COLLECTIVE_LANE, "collective", 550, 600)
    add(200, "aten::mm", "torch/ops", "op", 1000, 1900)
    add(300, "aten::mm", "torch/ops", "op", 0, 2000)
    add_run(store, "ranked", spans, 0, 2000 * US)
    facts = {100: {"rank": "0", "world_size": "2"}, 200: {"rank": "1", "world_size": "2"}}
    store.insert_rows(
        "threads",
        ["run_id", "host", "pid", "tid", "process_name", "thread_name", "updated_ns",
         "process_attrs"],
        [["ranked", "client", pid, 1, "python", "main", 1, facts.get(pid, {})]
         for pid in (100, 200, 300)],
    )  # fmt: skip


@pytest.fixture(scope="module")
def dsn(tmp_path_factory: pytest.TempPathFactory) -> str:
    dsn = f"chdb://{tmp_path_factory.mktemp('ranks') / 'store'}"
    with Store(dsn) as opened:
        two_ranks(opened)
        add_run(opened, "single", [{"name": "ProfilerStep#0", "lane": "steps",
                                    "category": "step", "start_ns": 0, "end_ns": 10}], 0, 10)  # fmt: skip
    return dsn


@pytest.fixture
def store(dsn: str) -> Iterator[Store]:
    with Store(dsn, reading=True) as opened:
        yield opened


def figures(step: rank_time.RankStep) -> tuple[int, ...]:
    return tuple(v // US for v in (step.compute_ns, step.comm_ns, step.overlap_ns, step.idle_ns))


def test_each_steps_figures_are_exact_and_add_up(store: Store) -> None:
    summary = ranks.rank_summary(store, "ranked")
    assert summary is not None
    got = {(s.rank, s.step): (s.name, figures(s)) for s in summary.steps}
    assert got == {
        (0, 0): ("ProfilerStep#0", (560, 200, 160, 400)),
        (0, 1): ("ProfilerStep#1", (400, 500, 200, 300)),
        (1, 0): ("ProfilerStep#0", (0, 50, 0, 950)),
        (1, 1): ("ProfilerStep#1", (900, 0, 0, 100)),
    }
    for s in summary.steps:
        assert s.compute_ns + s.comm_ns - s.overlap_ns + s.idle_ns == s.step_ns


def test_per_rank_totals_are_the_sums_of_its_steps(store: Store) -> None:
    summary = ranks.rank_summary(store, "ranked")
    assert summary is not None
    totals = {
        r.rank: (r.steps, r.step_ns // US, r.compute_ns // US, r.comm_ns // US,
                 r.overlap_ns // US, r.idle_ns // US)
        for r in summary.ranks
    }  # fmt: skip
    assert totals == {0: (2, 2000, 960, 700, 360, 700), 1: (2, 2000, 900, 50, 0, 1050)}
    # rank 1 entered the one collective last: it made rank 0 wait 150 µs
    by_rank = {r.rank: r for r in summary.ranks}
    assert (by_rank[1].entered_last, by_rank[1].caused_ns) == (1, 150 * US)
    assert (by_rank[0].entered_last, by_rank[0].caused_ns) == (0, 0)
    assert summary.as_dict()["steps"][0]["compute_ns"] == 560 * US


def test_a_run_without_ranks_has_no_rank_summary(store: Store) -> None:
    assert ranks.rank_summary(store, "single") is None


def test_the_shown_table_has_each_ranks_totals(store: Store) -> None:
    summary = ranks.rank_summary(store, "ranked")
    assert summary is not None
    text = render_ranks(summary)
    assert "steps per rank" in text
    table = text.split("steps per rank")[1].split("collectives (")[0].splitlines()
    assert table[1].split() == ["RANK", "STEPS", "STEP", "TIME", "MEAN", "COMPUTE", "%", "COMM",
                                "%", "OVERLAP", "%", "IDLE", "%", "LAST", "CAUSED"]  # fmt: skip
    assert table[3].split() == ["0", "2", "2", "ms", "1", "ms", "960", "µs", "48", "700", "µs",
                                "35", "360", "µs", "18", "700", "µs", "35", "0", "0", "ns"]  # fmt: skip


def test_run_reads_ranks_steps_and_compares_two_ranks(dsn: str) -> None:
    run = Run("ranked", dsn)
    table = run.ranks()
    assert list(table["rank"]) == [0, 1]
    assert list(table["compute_ns"]) == [960 * US, 900 * US]
    assert list(table.sort_values("caused_ns", ascending=False)["rank"])[0] == 1
    steps = run.rank_steps()
    assert len(steps) == 4
    assert (steps["compute_ns"] + steps["comm_ns"] - steps["overlap_ns"] + steps["idle_ns"]
            == steps["step_ns"]).all()  # fmt: skip
    side = run.compare_ranks(0, 1)
    assert list(side["step"]) == [0, 1]
    assert list(side["comm_ns_0"]) == [200 * US, 500 * US]
    assert list(side["comm_ns_1"]) == [50 * US, 0]
    assert list(side["comm_ns_diff"]) == [150 * US, 500 * US]
    assert list(side["name_0"]) == ["ProfilerStep#0", "ProfilerStep#1"]
    with pytest.raises(ValueError, match="no rank 5"):
        run.compare_ranks(0, 5)
    with pytest.raises(ValueError, match="twice"):
        run.compare_ranks(1, 1)
    single = Run("single", dsn)
    assert single.ranks().empty and single.rank_steps().empty


Pairs = st.lists(st.tuples(st.integers(0, 300), st.integers(1, 60)), max_size=25)


def points(intervals: list[tuple[int, int]]) -> set[int]:
    return {t for lo, hi in intervals for t in range(lo, hi)}


@given(Pairs, Pairs, st.integers(0, 200), st.integers(1, 200))
def test_interval_arithmetic_matches_sets_of_points(
    a: list[tuple[int, int]], b: list[tuple[int, int]], lo: int, width: int
) -> None:
    ua = rank_time._union([[(s, s + d) for s, d in a]])
    ub = rank_time._union([[(s, s + d) for s, d in b]])
    pa, pb = points(ua), points(ub)
    assert pa == {t for s, d in a for t in range(s, s + d)}
    assert all(x[1] < y[0] for x, y in zip(ua, ua[1:]))  # disjoint, in order, not touching
    assert points(rank_time._minus(ua, ub)) == pa - pb
    assert points(rank_time._both(ua, ub)) == pa & pb
    window = set(range(lo, lo + width))
    assert rank_time._Covered(ua).within(lo, lo + width) == len(pa & window)


def test_each_step_names_the_rank_that_made_the_others_wait_most() -> None:
    def step(rank: int, i: int, start: int) -> rank_time.RankStep:
        return rank_time.RankStep(rank, i, f"ProfilerStep#{i}", start, 1000, 0, 0, 0, 1000)

    steps = [step(r, i, 1000 * i + 10 * r) for r in (0, 1, 2) for i in range(3)]
    lates = [
        (1, 100, 50),  # step 0: rank 1 late twice (80 in all), rank 2 once (70)
        (1, 900, 30),
        (2, 500, 70),
        (0, 2500, 5),  # step 2: rank 0
        (2, 3500, 99),  # after every step of rank 2: the run's ranking only
    ]
    got = rank_time.step_stragglers(steps, lates)
    assert [(s.step, s.rank, s.entered_last, s.caused_ns) for s in got] == [
        (0, 1, 2, 80),
        (2, 0, 1, 5),
    ]
    assert got[0].caused == {1: 80, 2: 70}
