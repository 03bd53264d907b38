"""One run per job (store/jobs.py, tracer/ranks.py): which records are parts of a job, the run id
and trace id they share, each part merged into the run's row, and another host's clock bounded by
the job's collectives."""

from __future__ import annotations

import pyarrow as pa

from gpu_trace.store import jobs
from gpu_trace.tracer import ranks
from gpu_trace.tracer.records import SPAN_SCHEMA
from gpu_trace.tracer.run import RunInfo

S = 1_000_000_000


def part(host: str, pid: int, status: str = "finished", *, mono: int = 0, wall: int = 0,
         start: int = 10 * S, end: int = 20 * S, events: int = 5) -> RunInfo:  # fmt: skip
    return RunInfo(
        run_id="job-j",
        trace_id=ranks.job_trace_id("j"),
        started_ns=start,
        ended_ns=end,
        command="python train.py",
        hosts=[host],
        status=status,
        attrs={"job": "j", "recorder_pid": str(pid), "anchor_mono_ns": str(mono),
               "anchor_wall_ns": str(wall), "events": str(events), "dropped": "0",
               "processes": "1"},
    )  # fmt: skip


def test_job_from_env_only_where_asked_or_several_records_were_started() -> None:
    assert ranks.job_from_env({"GPU_TRACE_JOB": "exp-7"}) == "exp-7"
    assert ranks.job_from_env({"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "4"}) == "4242"
    # A record alone in an allocation is not a part of a job.
    assert ranks.job_from_env({"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1"}) is None
    assert ranks.job_from_env({"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "2"}) is None
    assert ranks.job_from_env({"TORCHELASTIC_RUN_ID": "abc", "WORLD_SIZE": "2"}) == "abc"
    assert ranks.job_from_env({"PMIX_NAMESPACE": "ns@1", "OMPI_COMM_WORLD_SIZE": "8"}) == "ns@1"
    assert ranks.job_from_env({}) is None


def test_job_run_ids_are_safe_and_distinct() -> None:
    assert ranks.job_run_id("exp-7") == "job-exp-7"
    odd = ranks.job_run_id("a/b c")
    assert odd.startswith("job-a-b-c-") and "/" not in odd and " " not in odd
    assert ranks.job_run_id("a/b c") != ranks.job_run_id("a b/c")  # replaced characters: hashed
    assert len(ranks.job_run_id("x" * 300)) <= 4 + 64
    assert ranks.job_trace_id("j") == ranks.job_trace_id("j") != ranks.job_trace_id("k")
    assert len(ranks.job_trace_id("j")) == 32 and int(ranks.job_trace_id("j"), 16)


def test_parts_merge_into_one_row_and_again_replaces_not_adds() -> None:
    first = jobs.merge(None, part("a", 1, events=5), None)
    assert first.attrs[jobs.CLOCK_HOST] == "a" and first.attrs[jobs.PARTS] == "1"
    second = part("b", 2, "failed", start=5 * S, end=30 * S, events=7)
    clock = jobs.PartClock("b", "a", 2 * S, 1000, 2 * S, 3)
    merged = jobs.merge(first, second, clock)
    assert merged.hosts == ["a", "b"] and merged.status == "failed"  # the worst part's
    assert merged.started_ns == 7 * S and merged.ended_ns == 32 * S  # b's times on a's clock
    assert merged.attrs["events"] == "12" and merged.attrs[jobs.PARTS] == "2"
    assert "+/- 1,000 ns as 3 collectives bound it" in merged.attrs["clock.b"]
    again = jobs.merge(merged, second, clock)  # the same part ingested once more
    assert again.attrs["events"] == "12" and again.attrs[jobs.PARTS] == "2"
    assert again.run_id == "job-j" and again.command == "python train.py"


def collective_spans(rows: list[tuple[str, str, int, int]]) -> pa.Table:
    """Spool spans: ``(name, seq, start, end)`` on the collectives' lane."""
    n = len(rows)
    cols = {f.name: pa.nulls(n, f.type) for f in SPAN_SCHEMA}
    cols.update(
        name=pa.array([r[0] for r in rows]).dictionary_encode(),
        lane=pa.array([ranks.COLLECTIVE_LANE] * n).dictionary_encode(),
        category=pa.array(["collective"] * n).dictionary_encode(),
        start_ns=pa.array([r[2] for r in rows], pa.int64()),
        end_ns=pa.array([r[3] for r in rows], pa.int64()),
        attrs=pa.array(
            [[("pg", ""), ("seq", r[1])] for r in rows], pa.map_(pa.string(), pa.string())
        ),
    )
    return pa.table({f.name: cols[f.name].cast(f.type) for f in SPAN_SCHEMA})


def test_collectives_bound_the_offset_the_wall_clocks_give() -> None:
    # Host b's monotonic clock is 100 s behind a's; its wall clock 3 ms off (bad NTP).
    stored = jobs.merge(None, part("a", 1, mono=200 * S, wall=1000 * S), None)
    b = part("b", 2, mono=100 * S, wall=1000 * S + 3_000_000)
    true = 100 * S  # a = b + 100 s
    # Two all-reduces: on a, [enter, end] of (1000, 1400) and (2000, 2300) µs; on b the same
    # moments (minus 100 s), b entering 200 µs later in the first.
    run = {
        ("", "1", "all_reduce"): (1000_000, 1400_000),
        ("", "2", "all_reduce"): (2000_000, 2300_000),
    }
    spans = collective_spans(
        [("all_reduce", "1", 1200_000 - true, 1400_000 - true),
         ("all_reduce", "2", 2000_000 - true, 2300_000 - true),
         ("broadcast", "3", 0, 1)]  # not every rank must enter it: no bound
    )  # fmt: skip
    clock = jobs.part_clock(run, stored, b, [spans])
    assert clock is not None and clock.collectives == 2
    # lo = true + max(1000 - 1400, 2000 - 2300) µs, hi = true + min(1400 - 1200, 2300 - 2000) µs
    assert true - 300_000 <= clock.offset_ns <= true + 200_000
    assert clock.offset_ns == true + 200_000  # the wall clocks' 3 ms error moved to the bound
    assert clock.uncertainty_ns == 500_000
    assert abs(clock.offset_ns - true) <= clock.uncertainty_ns  # the truth within the bound
    (_, theta, rtt), _ = sorted(clock.samples(b.started_ns, b.ended_ns))
    assert theta == -clock.offset_ns and rtt == 2 * clock.uncertainty_ns


def test_without_a_linked_collective_the_wall_clocks_and_an_unknown_uncertainty() -> None:
    stored = jobs.merge(None, part("a", 1, mono=200 * S, wall=1000 * S), None)
    b = part("b", 2, mono=100 * S, wall=1000 * S)
    clock = jobs.part_clock({}, stored, b, [collective_spans([])])
    assert clock is not None and clock.offset_ns == 100 * S and clock.uncertainty_ns is None
    assert "uncertainty unknown" in clock.describe()
    # The run's own host, or a record that is not a part, needs no mapping.
    assert jobs.part_clock({}, stored, part("a", 3), []) is None
    alone = part("b", 4)
    alone.attrs.pop("job")
    assert jobs.part_clock({}, stored, alone, []) is None
