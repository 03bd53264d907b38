"""Module backward ranges made from backward-node events (op level), on made-up events."""

from __future__ import annotations

import itertools

from gpu_trace.framework_patches.torch.backward import chain, owners, ranges

# Forward: Net [0, 10) holds a [0, 4) (a.x [1, 3)) and b [5, 9); seq 4 and 9 are Net's own ops.
NET, A, AX, B = "Net", "a", "a.x", "b"
CALLS = [(1, 3, AX, -1), (0, 4, A, -1), (5, 9, B, -1), (0, 10, NET, -1)]  # as calls return


def made(events, passes=(), calls=CALLS):
    ids = itertools.count(100)
    out = ranges(events, calls, passes, ids.__next__)
    by_id = {r[0]: r for r in out}
    return sorted(
        (
            calls[r[3]][2],
            r[4],
            r[5],
            calls[by_id[r[1]][3]][2] if r[1] in by_id else r[1],
            r[6],
        )
        for r in out
    )


def test_chain_finds_the_innermost_call_and_its_parents() -> None:
    index = owners(CALLS)
    names = {s: [CALLS[i][2] for i in chain(s, CALLS, index)] for s in range(12)}
    assert names[0] == [NET, A] and names[2] == [NET, A, AX] and names[3] == [NET, A]
    assert names[4] == [NET] and names[7] == [NET, B] and names[9] == [NET]
    assert names[10] == [] and names[11] == []


def test_nodes_in_reverse_forward_order_nest_like_the_modules() -> None:
    # (thread, start, end, seq): backward runs b, Net's op, a.x, a; AccumulateGrad (-1) between.
    events = [(1, 10, 20, 8), (1, 21, 25, -1), (1, 30, 40, 4), (1, 41, 50, 2), (1, 51, 60, 0)]
    assert made(events) == [
        (NET, 10, 60, 0, 0),
        (A, 41, 60, NET, 1),
        (AX, 41, 50, A, 2),
        (B, 10, 25, NET, 1),  # AccumulateGrad after b's last node is still b's
    ]


def test_nodes_outside_modules_and_forward_ops_end_ranges() -> None:
    events = [
        (1, 0, 5, 11),  # the loss, made outside any module
        (1, 10, 20, 7),
        (1, 30, 35, None),  # a forward op: the next iteration
        (1, 40, 45, -1),  # AccumulateGrad of another pass: extends nothing
        (1, 50, 60, 7),
    ]
    assert made(events) == [
        (NET, 10, 20, 0, 0),
        (NET, 50, 60, 0, 0),
        (B, 10, 20, NET, 1),
        (B, 50, 60, NET, 1),
    ]


def test_a_module_called_twice_gets_a_range_per_call_and_threads_are_apart() -> None:
    calls = [(0, 2, "cell", -1), (2, 4, "cell", -1)]
    events = [(1, 0, 10, 3), (1, 11, 20, 1), (2, 0, 5, 1)]
    assert made(events, calls=calls) == [
        ("cell", 0, 5, 0, 0),
        ("cell", 0, 10, 0, 0),
        ("cell", 11, 20, 0, 0),
    ]


def test_a_pass_puts_its_ranges_under_its_range_and_skips_calls_still_running() -> None:
    # Tensor.backward (span 7, depth 1) called inside Net's forward: Net gets no range.
    passes = [[5, 100, 7, 1, {NET}]]
    events = [(1, 10, 20, 2), (1, 21, 30, 0), (1, 200, 210, 2)]
    assert made(events, passes) == [
        (NET, 200, 210, 0, 0),  # after the pass: a later pass of the same graph, no record
        (A, 10, 30, 7, 1),
        (A, 200, 210, NET, 1),
        (AX, 10, 20, A, 2),
        (AX, 200, 210, A, 2),
    ]


def test_no_calls_no_ranges() -> None:
    assert ranges([(1, 0, 1, 0)], [], [], iter(range(5)).__next__) == []
