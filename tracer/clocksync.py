"""Clock synchronisation with a peer: NTP-style samples, a min-RTT filter and an offset+drift fit.

A sample is one request/response exchange with four timestamps: ``t0`` client send and ``t3``
client receive on the client's clock, ``t1`` server receive and ``t2`` server send on the server's
clock. With ``offset`` meaning *server clock minus client clock*::

    offset = ((t1 - t0) + (t2 - t3)) / 2
    rtt    = (t3 - t0) - (t2 - t1)

If the one-way delays are ``d_out`` and ``d_back`` the sample's error is ``(d_out - d_back) / 2``,
so whatever the asymmetry, the true offset lies within ``rtt / 2`` of the sample's offset (delays
are never negative). That half-RTT is each sample's uncertainty. Asymmetry itself cannot be
observed from the four timestamps: a constant asymmetry biases every sample the same way, and no
amount of averaging removes it; only a smaller RTT bounds it more tightly. See docs/clock-sync.md.

:class:`ClockModel` keeps the lowest-RTT samples (queueing only ever adds delay), fits offset and
drift by weighted least squares (weights ``1/uncertainty**2``), drops samples inconsistent with the
fit, and states a worst-case bound on the fitted offset. Everything is integer nanoseconds at the
edges; floats are used only inside the fit.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)

__all__ = ["ClockModel", "Sample", "measure"]

#: Floor of a sample's uncertainty: a zero RTT (synthetic data) must not mean infinite weight.
MIN_UNCERTAINTY_NS = 1


class Sample(NamedTuple):
    """One exchange: ``t0``/``t3`` on the client's clock, ``t1``/``t2`` on the server's (ns)."""

    t0: int
    t1: int
    t2: int
    t3: int

    @property
    def offset_ns(self) -> int:
        """Server clock minus client clock, assuming symmetric one-way delays."""
        return ((self.t1 - self.t0) + (self.t2 - self.t3)) // 2

    @property
    def rtt_ns(self) -> int:
        """Round trip spent on the wire: the client's wait minus the server's processing."""
        return (self.t3 - self.t0) - (self.t2 - self.t1)

    @property
    def uncertainty_ns(self) -> int:
        """Half the RTT (rounded up): the true offset lies within this of :attr:`offset_ns`."""
        return max(MIN_UNCERTAINTY_NS, -(-self.rtt_ns // 2))

    @property
    def ts_ns(self) -> int:
        """When the sample was taken, on the client's clock: the exchange's midpoint."""
        return (self.t0 + self.t3) // 2

    @classmethod
    def of(cls, raw: Iterable[object]) -> Sample:
        """A sample from any four integers (numpy's too); ``ValueError`` for anything else."""
        try:
            values = tuple(operator.index(t) for t in raw)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(
                f"clock sample timestamps must be integer nanoseconds, got {raw!r}"
            ) from None
        if len(values) != 4:
            raise ValueError(
                f"a clock sample has four timestamps (t0, t1, t2, t3), got {len(values)}"
            )
        return cls(*values)

    def problem(self) -> str | None:
        """Why this sample is unusable, or None if it is fine."""
        if not all(isinstance(t, int) for t in self):
            return "timestamps must be integer nanoseconds"
        if self.t3 < self.t0:
            return f"client receive before client send (t3 - t0 = {self.t3 - self.t0} ns)"
        if self.t2 < self.t1:
            return f"server send before server receive (t2 - t1 = {self.t2 - self.t1} ns)"
        if self.rtt_ns < 0:
            return (
                f"negative round trip ({self.rtt_ns} ns): the server took longer than the exchange"
            )
        return None

    def check(self) -> Sample:
        """This sample, or ``ValueError`` saying what is wrong with it."""
        problem = self.problem()
        if problem is not None:
            raise ValueError(f"bad clock sample {tuple(self)}: {problem}")
        return self


class _Point(NamedTuple):
    x: int  # client time (ns)
    y: int  # offset (ns)
    u: int  # uncertainty (ns), >= MIN_UNCERTAINTY_NS
    rtt: int


class ClockModel:
    """Offset and drift of a peer's clock relative to ours, fitted from exchange samples.

    ``offset_at(t) = offset_ns + drift * (t - ref_ns)``, with ``drift = drift_ppm / 1e6``, maps a
    client time to how far ahead the server's clock is at that moment.

    Parameters:
        samples: :class:`Sample` objects or ``(t0, t1, t2, t3)`` tuples. Unusable ones (``t3 <
            t0``, ``t2 < t1``, negative RTT, non-integers) are left out and counted in
            :attr:`n_rejected`; ``strict=True`` raises ``ValueError`` on the first one instead.
        best_fraction: the share of samples kept, lowest RTT first, in each window (at least one
            per window).
        window_ns: split the samples into windows of this many ns of client time and keep the best
            of each, so periodic re-measurement keeps counting for drift. None: one window.
        fit_drift: fit a drift (needs samples at two or more distinct times); else offset only.

    Raises ``ValueError`` when no usable sample is left, or on bad parameters.
    """

    def __init__(
        self,
        samples: Iterable[Sample | tuple[int, int, int, int]],
        *,
        best_fraction: float = 0.5,
        window_ns: int | None = None,
        fit_drift: bool = True,
        strict: bool = False,
    ) -> None:
        valid: list[_Point] = []
        rejected = 0
        for raw in samples:
            try:
                s = Sample.of(raw)
            except ValueError:
                if strict:
                    raise
                rejected += 1
                continue
            problem = s.problem()
            if problem is not None:
                if strict:
                    raise ValueError(f"bad clock sample {tuple(s)}: {problem}")
                rejected += 1
                continue
            valid.append(_Point(s.ts_ns, s.offset_ns, s.uncertainty_ns, s.rtt_ns))
        if rejected:
            log.debug("gpu-trace: %d of %d clock samples rejected", rejected, rejected + len(valid))
        self.n_rejected = rejected
        self._init(valid, best_fraction, window_ns, fit_drift)

    @classmethod
    def from_measurements(
        cls,
        rows: Iterable[tuple[int, int, int]],
        *,
        best_fraction: float = 0.5,
        window_ns: int | None = None,
        fit_drift: bool = True,
    ) -> ClockModel:
        """A model from recorded ``(ts_ns, offset_ns, rtt_ns)`` rows (the ``clock_sync`` table).

        Rows with a negative RTT are rejected and counted, as in the constructor.
        """
        self = cls.__new__(cls)
        valid: list[_Point] = []
        rejected = 0
        for ts, offset, rtt in rows:
            ts, offset, rtt = int(ts), int(offset), int(rtt)
            if rtt < 0:
                rejected += 1
                continue
            valid.append(_Point(ts, offset, max(MIN_UNCERTAINTY_NS, -(-rtt // 2)), rtt))
        self.n_rejected = rejected
        self._init(valid, best_fraction, window_ns, fit_drift)
        return self

    # ---- fitting ------------------------------------------------------------------------------

    def _init(
        self, points: list[_Point], best_fraction: float, window_ns: int | None, fit_drift: bool
    ) -> None:
        if not 0 < best_fraction <= 1:
            raise ValueError(f"best_fraction must be in (0, 1], got {best_fraction}")
        if window_ns is not None and window_ns <= 0:
            raise ValueError(f"window_ns must be positive, got {window_ns}")
        if not points:
            what = f" ({self.n_rejected} rejected as malformed)" if self.n_rejected else ""
            raise ValueError(f"no usable clock samples{what}")
        #: Usable samples given (malformed ones are in n_rejected).
        self.n_samples = len(points)
        kept = _min_rtt_filter(points, best_fraction, window_ns)
        used, outliers = _robust_fit(kept, fit_drift)
        #: Samples the min-RTT filter kept but that contradicted the fit beyond their uncertainty.
        self.n_outliers = outliers
        #: Samples the final fit rests on.
        self.n_used = len(used)
        fit, _, _ = _fit(used, fit_drift)
        self._fit = fit
        #: Reference time of the fit (client clock, ns): the weighted centre of the samples used.
        self.ref_ns = fit.ref
        #: Offset (server minus client) at ``ref_ns``.
        self.offset_ns = fit.y0 + round(fit.a)
        #: Server clock rate minus client clock rate, in parts per million.
        self.drift_ppm = fit.b * 1e6
        #: Client-time span of the samples used.
        self.first_ns = min(p.x for p in used)
        self.last_ns = max(p.x for p in used)
        #: Worst-case error of ``offset_at`` anywhere between first_ns and last_ns.
        self.uncertainty_ns = max(
            self.uncertainty_at(self.first_ns), self.uncertainty_at(self.last_ns)
        )
        #: The smallest RTT seen among the samples used.
        self.min_rtt_ns = min(p.rtt for p in used)

    # ---- using the model ----------------------------------------------------------------------

    def offset_at(self, client_ns: int) -> int:
        """Server clock minus client clock at client time ``client_ns``."""
        return self.offset_ns + round(self._fit.b * (client_ns - self.ref_ns))

    def uncertainty_at(self, client_ns: int) -> int:
        """A bound on the error of :meth:`offset_at` at ``client_ns``.

        The fitted offset is a linear combination ``sum(h_i * offset_i)`` of the samples' offsets;
        each of those is off by at most its uncertainty, whatever the delay asymmetry, so the fit
        is off by at most ``sum(|h_i| * uncertainty_i)``. It grows outside the measured span.
        """
        return max(
            MIN_UNCERTAINTY_NS, math.ceil(float(self._fit.bound(client_ns - self.ref_ns)[0]))
        )

    def to_server(self, client_ns: int) -> int:
        """A client-clock time on the server's clock."""
        return client_ns + self.offset_at(client_ns)

    def to_client(self, server_ns: int) -> int:
        """A server-clock time on the client's clock (the inverse of :meth:`to_server`)."""
        # server = c + offset + b (c - ref)  =>  c - ref = delta / (1 + b) with
        # delta = server - ref - offset; written as delta - delta b / (1 + b) so that only the
        # small correction passes through a float.
        b = self._fit.b
        delta = server_ns - self.ref_ns - self.offset_ns
        return self.ref_ns + delta - round(delta * b / (1.0 + b))

    def map_to_client(self, server_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`to_client` of many int64 times at once: ``(client_ns, offset_ns, uncertainty_ns)``.

        ``offset_ns`` is what was subtracted from each time, ``uncertainty_ns`` the bound of
        :meth:`uncertainty_at` there (ingest maps a server's spans with it and keeps both).
        """
        server = np.asarray(server_ns, dtype=np.int64)
        b = self._fit.b
        delta = server - self.ref_ns - self.offset_ns
        client = self.ref_ns + delta - np.round(delta * (b / (1.0 + b))).astype(np.int64)
        bound = self._fit.bound(client - self.ref_ns) if len(client) else np.zeros(0)
        unc = np.maximum(MIN_UNCERTAINTY_NS, np.ceil(bound)).astype(np.int64)
        return client, server - client, unc

    def __repr__(self) -> str:
        return (
            f"ClockModel(offset_ns={self.offset_ns}, drift_ppm={self.drift_ppm:.3f}, "
            f"uncertainty_ns={self.uncertainty_ns}, n_used={self.n_used}/{self.n_samples})"
        )


class _Fit(NamedTuple):
    """``offset = y0 + a + b * (x - ref)``, and what the error bound is made of."""

    ref: int
    y0: int
    a: float
    b: float
    # For the bound: positions relative to the weighted mean x, weights, uncertainties.
    cx: np.ndarray
    w: np.ndarray
    u: np.ndarray
    x_mean: float  # the weighted mean of x, relative to ref (|x_mean| <= 0.5: ref is rounded)
    sxx: float

    def predict(self, dx: np.ndarray | float) -> np.ndarray | float:
        """The offset minus ``y0`` at ``dx = x - ref``."""
        return self.a + self.b * dx

    def bound(self, dx: np.ndarray | float) -> np.ndarray:
        """Worst-case error of the fit at ``dx``: ``sum(|h_i| * u_i)``.

        The hat weight of sample i at ``t = dx - x_mean`` is ``h_i = alpha_i + beta_i * t``, so the
        bound is piecewise linear in ``t`` with a kink where each ``h_i`` changes sign; summing by
        prefix sums over the sorted kinks keeps it O(n log n) rather than O(n^2).
        """
        t = np.atleast_1d(np.asarray(dx, dtype=np.float64)) - self.x_mean
        alpha = self.w / self.w.sum()
        beta = self.w * self.cx / self.sxx if self.sxx > 0 else np.zeros_like(alpha)
        flat = beta == 0
        total = np.full(t.shape, float(alpha[flat] @ self.u[flat]))
        if flat.all():
            return total
        a, b, u = alpha[~flat], beta[~flat], self.u[~flat]
        kink = -a / b
        order = np.argsort(kink)
        kink = kink[order]
        sign = np.sign(b[order])
        ca = np.concatenate(([0.0], np.cumsum(sign * u[order] * a[order])))
        cb = np.concatenate(([0.0], np.cumsum(sign * u[order] * b[order])))
        # Terms whose kink lies below t have sign(h_i) == sign(beta_i); the others the opposite.
        k = np.searchsorted(kink, t, side="left")
        below = ca[k] + cb[k] * t
        above = (ca[-1] - ca[k]) + (cb[-1] - cb[k]) * t
        value: np.ndarray = total + below - above
        return value


def _min_rtt_filter(
    points: list[_Point], best_fraction: float, window_ns: int | None
) -> list[_Point]:
    """The lowest-RTT ``best_fraction`` of the samples of each window (at least one per window)."""
    if window_ns is None:
        windows = [points]
    else:
        start = min(p.x for p in points)
        groups: dict[int, list[_Point]] = {}
        for p in points:
            groups.setdefault((p.x - start) // window_ns, []).append(p)
        windows = [groups[k] for k in sorted(groups)]
    kept: list[_Point] = []
    for group in windows:
        n = max(1, math.ceil(len(group) * best_fraction))
        kept.extend(sorted(group, key=lambda p: (p.rtt, p.x))[:n])
    kept.sort(key=lambda p: p.x)
    return kept


def _fit(points: list[_Point], fit_drift: bool) -> tuple[_Fit, np.ndarray, np.ndarray]:
    """Weighted least squares of offset against client time, weights ``1/u**2``.

    Returns the fit and each point's ``dx = x - ref`` and ``y - y0``. Large absolute times and
    offsets are made relative to integers first so that no float carries them.
    """
    x0, y0 = points[0].x, points[0].y
    xr = np.array([p.x - x0 for p in points], dtype=np.float64)
    yr = np.array([p.y - y0 for p in points], dtype=np.float64)
    u = np.array([p.u for p in points], dtype=np.float64)
    w = 1.0 / (u * u)
    w_sum = w.sum()
    ref = x0 + round(float(w @ xr) / w_sum)
    dx = np.array([p.x - ref for p in points], dtype=np.float64)
    x_mean = float(w @ dx) / w_sum
    y_mean = float(w @ yr) / w_sum
    cx = dx - x_mean
    sxx = float(w @ (cx * cx)) if fit_drift else 0.0
    b = float(w @ (cx * (yr - y_mean))) / sxx if sxx > 0 else 0.0
    fit = _Fit(ref, y0, y_mean - b * x_mean, b, cx, w, u, x_mean, sxx)
    return fit, dx, yr


def _robust_fit(points: list[_Point], fit_drift: bool) -> tuple[list[_Point], int]:
    """Drop, worst first, samples whose residual exceeds their own bound plus the fit's bound.

    An honest sample is never dropped once the outliers are gone: its offset is within ``u`` of
    the truth and the fit within its bound of the truth, so their difference is within the sum.
    What is dropped contradicts the model (a clock step, a corrupt timestamp). At most half the
    samples are ever dropped.
    """
    used = list(points)
    dropped = 0
    while len(used) > 2 and dropped < len(points) // 2:
        fit, dx, yr = _fit(used, fit_drift)
        residual = np.abs(yr - fit.predict(dx))
        excess = (residual - fit.u - fit.bound(dx)) / fit.u
        worst = int(np.argmax(excess))
        if excess[worst] <= 1e-9:
            break
        del used[worst]
        dropped += 1
    return used, dropped


def measure(
    exchange: Callable[[], tuple[int, int, int, int]],
    n: int,
    *,
    peer: str = "",
    **model_options: object,
) -> ClockModel:
    """Run ``exchange`` ``n`` times and fit a :class:`ClockModel` to the samples.

    ``exchange()`` performs one request/response with the peer and returns ``(t0, t1, t2, t3)``
    (the forwarding runtime passes its transport). Every usable sample is recorded through the
    active recorder's ``add_clock_sample`` (the ``clock_sync`` table) under ``peer``, so the fit can
    be redone at ingest. An exception from ``exchange`` propagates; recording never raises.
    ``model_options`` go to :class:`ClockModel`.
    """
    if n < 1:
        raise ValueError(f"need at least one exchange, got n={n}")
    from gpu_trace.tracer import recorder

    samples: list[object] = []
    for _ in range(n):
        raw = exchange()
        samples.append(raw)
        try:
            s = Sample.of(raw)
        except ValueError:
            continue
        if s.problem() is not None:
            continue
        rec = recorder.active
        if rec is not None:
            try:
                rec.add_clock_sample(peer, s.ts_ns, s.offset_ns, s.rtt_ns, s.uncertainty_ns)
            except Exception:
                log.exception("gpu-trace: recording a clock sample failed")
    return ClockModel(samples, **model_options)  # type: ignore[arg-type]
