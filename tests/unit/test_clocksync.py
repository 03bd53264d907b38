"""Clock sync math on synthetic exchanges: a simulated peer whose true offset and drift we know."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

import gpu_trace
from gpu_trace.tracer.clocksync import ClockModel, Sample, measure
from gpu_trace.tracer.spool import list_spool, read_spool_file

ORIGIN = 1_000_000_000_000  # a CLOCK_MONOTONIC-like client time at the start of the run
US = 1_000
MS = 1_000_000

Delay = Callable[[random.Random], int]


class Peer:
    """A server whose clock runs ``offset_ns`` ahead of ours at ORIGIN and drifts ``drift_ppm``."""

    def __init__(self, offset_ns: int, drift_ppm: float = 0.0) -> None:
        self.offset_ns = offset_ns
        self.drift_ppm = drift_ppm

    def true_offset(self, client_ns: int) -> int:
        return self.offset_ns + round(self.drift_ppm * (client_ns - ORIGIN) / 1e6)

    def server_time(self, client_ns: int) -> int:
        return client_ns + self.true_offset(client_ns)

    def exchange(self, t0: int, out_ns: int, processing_ns: int, back_ns: int) -> Sample:
        t1 = self.server_time(t0 + out_ns)
        t2 = self.server_time(t0 + out_ns + processing_ns)
        return Sample(t0, t1, t2, t0 + out_ns + processing_ns + back_ns)


def run(
    peer: Peer,
    rng: random.Random,
    n: int,
    out: Delay,
    back: Delay,
    interval_ns: int = 10 * MS,
) -> list[tuple[Sample, int, int]]:
    """``n`` exchanges ``interval_ns`` apart: (sample, outbound delay, return delay)."""
    result = []
    for i in range(n):
        o, b = out(rng), back(rng)
        result.append(
            (peer.exchange(ORIGIN + i * interval_ns, o, rng.randrange(1 * US, 50 * US), b), o, b)
        )
    return result


def jitter(base: int, mean: int) -> Delay:
    """A fixed wire delay plus exponential queueing (delays are never below the base)."""
    return lambda rng: base + int(rng.expovariate(1 / mean))


def samples(exchanges: list[tuple[Sample, int, int]]) -> list[Sample]:
    return [s for s, _, _ in exchanges]


# ---- one sample ----------------------------------------------------------------------------------


def test_sample_offset_rtt_and_uncertainty() -> None:
    peer = Peer(offset_ns=7 * MS)
    s = peer.exchange(ORIGIN, out_ns=30 * US, processing_ns=5 * US, back_ns=30 * US)
    assert s.offset_ns == 7 * MS
    assert s.rtt_ns == 60 * US
    assert s.uncertainty_ns == 30 * US
    assert s.ts_ns == ORIGIN + 32_500
    assert s.problem() is None
    assert s.check() is s


def test_a_sample_is_off_by_half_the_asymmetry_and_never_more_than_half_the_rtt() -> None:
    peer = Peer(offset_ns=-3 * MS)
    s = peer.exchange(ORIGIN, out_ns=100 * US, processing_ns=1 * US, back_ns=10 * US)
    assert s.offset_ns - peer.offset_ns == (100 * US - 10 * US) // 2
    assert abs(s.offset_ns - peer.offset_ns) <= s.uncertainty_ns


@pytest.mark.parametrize(
    ("sample", "why"),
    [
        (Sample(100, 5, 6, 50), "client receive before client send"),
        (Sample(0, 10, 5, 100), "server send before server receive"),
        (Sample(0, 10, 500, 100), "negative round trip"),
        (Sample(0, 10, 11, 100.0), "integer"),  # type: ignore[arg-type]
    ],
)
def test_garbage_samples_are_named(sample: Sample, why: str) -> None:
    assert why in (sample.problem() or "")
    with pytest.raises(ValueError, match=why):
        sample.check()
    with pytest.raises(ValueError, match=why):
        ClockModel([sample], strict=True)


# ---- degenerate inputs ---------------------------------------------------------------------------


def test_no_samples_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="no usable clock samples"):
        ClockModel([])


def test_only_garbage_is_a_value_error_that_counts_it() -> None:
    with pytest.raises(ValueError, match="2 rejected"):
        ClockModel([(100, 5, 6, 50), (0, 10, 500, 100)])


def test_samples_from_any_integers_and_nothing_else() -> None:
    np = pytest.importorskip("numpy")
    assert Sample.of(np.array([1, 2, 3, 4], dtype=np.int64)) == Sample(1, 2, 3, 4)
    assert type(Sample.of(np.array([1, 2, 3, 4])).t0) is int
    with pytest.raises(ValueError, match="integer"):
        Sample.of((1.5, 2, 3, 4))
    with pytest.raises(ValueError, match="four timestamps"):
        Sample.of((1, 2, 3))
    with pytest.raises(ValueError, match="integer"):
        Sample.of(None)  # type: ignore[arg-type]


def test_garbage_is_filtered_and_counted() -> None:
    peer = Peer(offset_ns=2 * MS)
    good = [peer.exchange(ORIGIN + i * MS, 20 * US, 2 * US, 20 * US) for i in range(4)]
    model = ClockModel([*good, (100, 5, 6, 50), (0, 10, 500, 100), (1, 2, 3), ("a", "b", "c", "d")])
    assert model.n_rejected == 4
    assert model.n_samples == 4
    assert model.offset_at(ORIGIN) == 2 * MS


def test_one_sample_gives_its_offset_and_no_drift() -> None:
    peer = Peer(offset_ns=123_456_789)
    s = peer.exchange(ORIGIN, out_ns=40 * US, processing_ns=3 * US, back_ns=20 * US)
    model = ClockModel([s])
    assert model.n_samples == model.n_used == 1
    assert model.drift_ppm == 0.0
    assert model.offset_ns == s.offset_ns
    assert model.offset_at(ORIGIN + 10**12) == s.offset_ns
    assert model.uncertainty_ns == s.uncertainty_ns
    assert abs(model.offset_ns - peer.offset_ns) <= model.uncertainty_ns


@pytest.mark.parametrize("kwargs", [{"best_fraction": 0}, {"best_fraction": 1.5}, {"window_ns": 0}])
def test_bad_options_are_value_errors(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ClockModel([Sample(0, 10, 11, 100)], **kwargs)


def test_zero_rtt_samples_do_not_divide_by_zero() -> None:
    model = ClockModel([Sample(t, t + 5, t + 5, t) for t in (0, 10, 20)])
    assert model.offset_ns == 5
    assert model.drift_ppm == 0.0
    assert model.uncertainty_ns >= 1


# ---- recovering offset and drift -----------------------------------------------------------------


def test_fixed_skew_is_recovered_within_the_uncertainty() -> None:
    rng = random.Random(1)
    peer = Peer(offset_ns=-48_123_456_789)
    ex = run(peer, rng, 200, jitter(25 * US, 10 * US), jitter(25 * US, 10 * US))
    model = ClockModel(samples(ex), fit_drift=False)
    assert model.drift_ppm == 0.0
    assert abs(model.offset_ns - peer.offset_ns) <= model.uncertainty_ns
    # The bound is the weighted mean half-RTT of the kept samples: the wire delays' scale.
    assert 25 * US <= model.uncertainty_ns < 40 * US
    assert model.n_used == 100


def test_linear_drift_is_recovered() -> None:
    rng = random.Random(2)
    peer = Peer(offset_ns=5 * MS, drift_ppm=35.0)
    ex = run(peer, rng, 300, jitter(20 * US, 5 * US), jitter(20 * US, 5 * US), interval_ns=100 * MS)
    model = ClockModel(samples(ex))
    span = model.last_ns - model.first_ns
    # The slope's error is at most the sum of the fit's bounds at both ends over the span.
    drift_bound_ppm = (
        (model.uncertainty_at(model.first_ns) + model.uncertainty_at(model.last_ns)) / span * 1e6
    )
    assert abs(model.drift_ppm - peer.drift_ppm) <= drift_bound_ppm
    assert drift_bound_ppm < 5.0  # 30 s of samples with ~25 us RTTs pin the drift well
    for s in samples(ex):
        assert abs(model.offset_at(s.ts_ns) - peer.true_offset(s.ts_ns)) <= model.uncertainty_at(
            s.ts_ns
        )


def test_ignoring_drift_leaves_an_error_that_fitting_it_removes() -> None:
    rng = random.Random(3)
    peer = Peer(offset_ns=0, drift_ppm=50.0)
    ex = run(
        peer, rng, 100, jitter(10 * US, 2 * US), jitter(10 * US, 2 * US), interval_ns=1000 * MS
    )
    end = ORIGIN + 99 * 1000 * MS
    with_drift = ClockModel(samples(ex))
    without = ClockModel(samples(ex), fit_drift=False)
    err_with = abs(with_drift.offset_at(end) - peer.true_offset(end))
    err_without = abs(without.offset_at(end) - peer.true_offset(end))
    assert err_with <= with_drift.uncertainty_at(end)
    assert err_with < err_without


def test_asymmetric_delay_biases_the_offset_by_half_the_asymmetry_inside_the_uncertainty() -> None:
    # 200 us out, 20 us back: no sample can tell, so the estimate is off by about 90 us.
    rng = random.Random(4)
    peer = Peer(offset_ns=1 * MS)
    ex = run(peer, rng, 200, jitter(200 * US, 3 * US), jitter(20 * US, 3 * US))
    model = ClockModel(samples(ex), fit_drift=False)
    error = model.offset_ns - peer.offset_ns
    max_half_asymmetry = max(abs(o - b) for _, o, b in ex) / 2
    assert abs(error) <= max_half_asymmetry
    assert abs(error) <= model.uncertainty_ns
    assert error > 80 * US  # the bias is real: asymmetry is unobservable, only bounded


def test_min_rtt_filtering_beats_the_mean_under_queueing_outliers() -> None:
    rng = random.Random(5)
    peer = Peer(offset_ns=-2 * MS)

    def out(r: random.Random) -> int:  # a quarter of the requests queue behind a big transfer
        return (
            30 * US
            + int(r.expovariate(1 / (5 * US)))
            + (r.randrange(1, 8) * MS if r.random() < 0.25 else 0)
        )

    ex = run(peer, rng, 400, out, jitter(30 * US, 5 * US))
    mean_offset = sum(s.offset_ns for s in samples(ex)) / len(ex)
    model = ClockModel(samples(ex), best_fraction=0.25, fit_drift=False)
    assert abs(model.offset_ns - peer.offset_ns) <= model.uncertainty_ns
    assert abs(model.offset_ns - peer.offset_ns) * 20 < abs(mean_offset - peer.offset_ns)


def test_samples_contradicting_the_fit_are_dropped_as_outliers() -> None:
    # Small RTT but a corrupt server timestamp: the min-RTT filter cannot catch these.
    rng = random.Random(6)
    peer = Peer(offset_ns=9 * MS, drift_ppm=-10.0)
    ex = samples(
        run(peer, rng, 100, jitter(15 * US, 2 * US), jitter(15 * US, 2 * US), interval_ns=50 * MS)
    )
    for i in (10, 40, 77):
        s = ex[i]
        ex[i] = Sample(s.t0, s.t1 + 3 * MS, s.t2 + 3 * MS, s.t3)
    model = ClockModel(ex, best_fraction=1.0)
    assert model.n_outliers == 3
    assert model.n_used == 97
    for s in ex:
        assert abs(model.offset_at(s.ts_ns) - peer.true_offset(s.ts_ns)) <= model.uncertainty_at(
            s.ts_ns
        )


def test_windows_keep_the_best_samples_of_every_period() -> None:
    # A burst at connect with tiny RTTs, then periodic samples with larger ones: a global best
    # fraction would keep only the burst and see no drift; per-window filtering keeps both.
    rng = random.Random(7)
    peer = Peer(offset_ns=0, drift_ppm=20.0)
    burst = [
        peer.exchange(ORIGIN + i * MS, 5 * US + rng.randrange(3 * US), 1 * US, 5 * US)
        for i in range(20)
    ]
    later = [
        peer.exchange(
            ORIGIN + k * 10_000 * MS + i * MS, 40 * US + rng.randrange(10 * US), 1 * US, 40 * US
        )
        for k in range(1, 10)
        for i in range(4)
    ]
    global_best = ClockModel(burst + later, best_fraction=0.25)
    windowed = ClockModel(burst + later, best_fraction=0.25, window_ns=5_000 * MS)
    assert global_best.last_ns < ORIGIN + 100 * MS
    assert windowed.last_ns > ORIGIN + 90_000 * MS
    end = ORIGIN + 90_000 * MS
    assert abs(windowed.offset_at(end) - peer.true_offset(end)) <= windowed.uncertainty_at(end)
    assert abs(windowed.drift_ppm - 20.0) < abs(global_best.drift_ppm - 20.0)


def test_uncertainty_grows_outside_the_measured_span() -> None:
    rng = random.Random(8)
    peer = Peer(offset_ns=0, drift_ppm=5.0)
    model = ClockModel(
        samples(run(peer, rng, 50, jitter(10 * US, 2 * US), jitter(10 * US, 2 * US)))
    )
    far = model.last_ns + 100 * (model.last_ns - model.first_ns)
    assert model.uncertainty_at(far) > model.uncertainty_ns


@pytest.mark.parametrize("seed", range(40))
def test_property_truth_is_inside_the_bound_and_mapping_inverts(seed: int) -> None:
    rng = random.Random(seed)
    # Offsets as large as monotonic-vs-epoch differences, drifts as large as bad crystals.
    peer = Peer(
        offset_ns=rng.randrange(-(2 * 10**18), 2 * 10**18), drift_ppm=rng.uniform(-200, 200)
    )
    out = jitter(rng.randrange(1 * US, 500 * US), rng.randrange(1 * US, 200 * US))
    back = jitter(rng.randrange(1 * US, 500 * US), rng.randrange(1 * US, 200 * US))
    n = rng.randrange(1, 120)
    ex = samples(run(peer, rng, n, out, back, interval_ns=rng.randrange(1 * MS, 2000 * MS)))
    model = ClockModel(
        ex, best_fraction=rng.choice([0.1, 0.5, 1.0]), window_ns=rng.choice([None, 10_000 * MS])
    )
    assert model.n_outliers == 0  # honest samples are never dropped
    assert 1 <= model.n_used <= model.n_samples == n
    for s in ex:
        if model.first_ns <= s.ts_ns <= model.last_ns:
            assert abs(
                model.offset_at(s.ts_ns) - peer.true_offset(s.ts_ns)
            ) <= model.uncertainty_at(s.ts_ns)
        server = model.to_server(s.ts_ns)
        assert abs(model.to_client(server) - s.ts_ns) <= 1


@pytest.mark.parametrize("seed", range(20))
def test_property_without_drift_the_offset_only_model_holds(seed: int) -> None:
    rng = random.Random(1000 + seed)
    peer = Peer(offset_ns=rng.randrange(-(2 * 10**18), 2 * 10**18))
    out = jitter(rng.randrange(1 * US, 500 * US), rng.randrange(1 * US, 200 * US))
    back = jitter(rng.randrange(1 * US, 500 * US), rng.randrange(1 * US, 200 * US))
    ex = samples(run(peer, rng, rng.randrange(1, 120), out, back))
    model = ClockModel(ex, best_fraction=rng.choice([0.1, 0.5, 1.0]), fit_drift=False)
    assert model.n_outliers == 0
    assert model.drift_ppm == 0.0
    assert abs(model.offset_ns - peer.offset_ns) <= model.uncertainty_ns


def test_from_measurements_refits_what_was_recorded() -> None:
    rng = random.Random(9)
    peer = Peer(offset_ns=3 * MS, drift_ppm=12.0)
    ex = samples(
        run(peer, rng, 80, jitter(20 * US, 4 * US), jitter(20 * US, 4 * US), interval_ns=200 * MS)
    )
    direct = ClockModel(ex)
    refit = ClockModel.from_measurements(
        [(s.ts_ns, s.offset_ns, s.rtt_ns) for s in ex] + [(0, 0, -5)]
    )
    assert refit.n_rejected == 1
    assert (refit.offset_ns, refit.drift_ppm, refit.uncertainty_ns) == (
        direct.offset_ns,
        direct.drift_ppm,
        direct.uncertainty_ns,
    )


# ---- measure -------------------------------------------------------------------------------------


def _exchanges(peer: Peer, extra: list[Sample]) -> Callable[[], tuple[int, int, int, int]]:
    rng = random.Random(10)
    queue = list(extra)
    clock = [ORIGIN]

    def exchange() -> tuple[int, int, int, int]:
        if queue:
            return tuple(queue.pop())  # type: ignore[return-value]
        clock[0] += 5 * MS
        return tuple(peer.exchange(clock[0], 20 * US + rng.randrange(5 * US), 2 * US, 20 * US))  # type: ignore[return-value]

    return exchange


def test_measure_without_a_recorder_returns_the_model() -> None:
    peer = Peer(offset_ns=4 * MS)
    model = measure(_exchanges(peer, []), 16)
    assert model.n_samples == 16
    assert abs(model.offset_ns - peer.offset_ns) <= model.uncertainty_ns


def test_measure_needs_an_exchange() -> None:
    with pytest.raises(ValueError):
        measure(_exchanges(Peer(0), []), 0)


def test_measure_records_every_usable_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_TRACE_NVTX", "off")
    run_dir = gpu_trace.start(tmp_path / "run")
    try:
        peer = Peer(offset_ns=-6 * MS)
        model = measure(_exchanges(peer, [Sample(100, 5, 6, 50)]), 10, peer="server-a:7000")
    finally:
        gpu_trace.stop()
    assert model.n_rejected == 1
    assert model.n_samples == 9
    tables = [f.table for f in map(read_spool_file, list_spool(run_dir)) if f.kind == "clock_sync"]
    rows = [row for t in tables for row in t.to_pylist()]
    assert len(rows) == 9
    assert {r["peer"] for r in rows} == {"server-a:7000"}
    for r in rows:
        assert abs(r["offset_ns"] - peer.offset_ns) <= r["uncertainty_ns"] == (r["rtt_ns"] + 1) // 2
    refit = ClockModel.from_measurements((r["ts_ns"], r["offset_ns"], r["rtt_ns"]) for r in rows)
    assert refit.offset_ns == model.offset_ns
