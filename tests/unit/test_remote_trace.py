"""The forwarding client's spans nest: batches in flight at once on lanes of their own, each batch
holding its ops and its send, and the best batch round trip of each heartbeat kept as a clock
sample (tests/span_checks.py says what nesting means)."""

from __future__ import annotations

from pathlib import Path

import gpu_trace
from gpu_trace.runtime.client.batch import Batch, OpRecord
from gpu_trace.runtime.client.trace import ClientTrace
from gpu_trace.runtime.protocol.span_tables import slot_lane
from tests.conftest import recorded
from tests.span_checks import problems


class Peer:
    """The trace's view of its connection (``trace.Peer``): a server, no exchanges."""

    server_host = "gpu-box"
    server_pid = 4242
    server_device = "cuda:0"
    server_sink = "return"
    session_id = 7

    def ping(self) -> tuple[int, int, int, int]:
        raise AssertionError("no clock exchange in this test")

    def send_clock(self, samples: list[tuple[int, int, int, int]]) -> None:
        raise AssertionError("the server keeps no spans of its own here")


def batch(
    trace: ClientTrace, seq: int, ops: list[tuple[int, int]], sent: tuple[int, int, int]
) -> Batch:
    records = []
    for t0, t1 in ops:
        r = OpRecord("aten::add.Tensor", (), t0)
        r.t1 = t1
        records.append(r)
    b = Batch(seq, trace.new_span_id(), records, ops[0][0])
    b.t_serialize, b.t_send, b.t_sent = sent
    return b


def test_slot_lane_gives_overlapping_spans_lanes_of_their_own() -> None:
    ends: list[int] = []
    assert slot_lane(ends, "q", 0, 10) == "q"
    assert slot_lane(ends, "q", 5, 20) == "q/1"  # q is busy until 10
    assert slot_lane(ends, "q", 8, 30) == "q/2"
    assert slot_lane(ends, "q", 10, 40) == "q"  # q ended at 10: free again
    assert slot_lane(ends, "q", 25, 50) == "q/1"
    assert ends == [40, 50, 30]


def test_batches_in_flight_nest_on_lanes_of_their_own(tmp_path: Path) -> None:
    """Three batches as a pipelined training step sends them: the second and third begin while
    the first is in flight; the first's DONE is read (by the receiver thread) before its sender
    has noted the end of its send; an op of the third began on another thread before the op that
    opened the batch was appended. Before, every batch span went on ``forward/batch`` from its
    first appended op to its DONE: overlapping batches, a send ending after its batch, an op
    starting before it."""
    run = tmp_path / "run"
    gpu_trace.start(run)
    try:
        trace = ClientTrace(Peer(), True)
        server = [0, 0, 0, 0, 0]  # no server times: no breakdown, no clock sample
        b1 = batch(trace, 1, [(100, 110), (110, 120)], (120, 125, 190))
        b2 = batch(trace, 2, [(130, 140), (140, 150)], (150, 152, 160))
        b3 = batch(trace, 3, [(175, 180), (170, 174)], (181, 182, 185))
        trace.batch_done(b1, 180, server, False)  # its send ends at 190, after its DONE
        trace.batch_done(b2, 200, server, False)
        trace.batch_done(b3, 210, server, False)
        b4 = batch(trace, 4, [(300, 310)], (310, 311, 312))
        trace.batch_done(b4, 320, server, False)
    finally:
        gpu_trace.stop()
    rows = [r for r in recorded(run) if r["category"] == "forward"]
    assert problems(rows) == []
    lanes = {r["span_id"]: r["lane"] for r in rows if r["name"] == "batch"}
    assert [lanes[b.span_id] for b in (b1, b2, b3, b4)] == [
        "forward/batch",
        "forward/batch/1",
        "forward/batch/2",
        "forward/batch",  # the first lane is free again
    ]
    spans = {r["span_id"]: (r["start_ns"], r["end_ns"]) for r in rows if r["name"] == "batch"}
    assert spans[b1.span_id] == (100, 190) and spans[b3.span_id] == (170, 210)


def test_the_best_batch_round_trip_of_an_interval_is_a_clock_sample(tmp_path: Path) -> None:
    """A batch's server times lie between its send and its DONE: an exchange as good as a ping's
    (better on a busy server, which answers pings late). The heartbeat's flush records the one
    with the least time on the wire, in the run's clock_sync rows ingest fits the clock to."""
    run = tmp_path / "run"
    gpu_trace.start(run)
    try:
        trace = ClientTrace(Peer(), True)
        slow = batch(trace, 1, [(1_000, 1_100)], (1_100, 1_200, 1_300))
        trace.batch_done(slow, 9_000, [5_000, 5_100, 5_100, 5_200, 5_300], False)
        fast = batch(trace, 2, [(10_000, 10_100)], (10_100, 10_200, 10_300))
        # sent at 10_200, read by the server at 10_700, replied at 11_300, read at 11_000: its
        # clock is 300 to 500 ns ahead (400 +- 100)
        trace.batch_done(fast, 11_000, [10_700, 10_750, 10_750, 11_200, 11_300], False)
        trace.flush()
        assert [tuple(s) for s in trace.samples] == [(10_200, 10_700, 11_300, 11_000)]
    finally:
        gpu_trace.stop()
    (row,) = recorded(run, "clock_sync")
    assert row["peer"] == "gpu-box" and row["offset_ns"] == 400 and row["rtt_ns"] == 200
