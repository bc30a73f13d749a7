"""Open-loop load: arrival schedules and per-level summaries (pure numpy), shared by the runtime's bench
and the simulator (:mod:`hpcsplit.core.simulator`), so both compute their figures the same way from the same
schedule.

Open loop: request ``i`` *arrives* at ``arrivals_s[i]`` whether or not earlier ones finished; its latency
runs from that arrival to its last output, so queueing in front of a saturated system counts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["ARRIVALS", "BURSTY_CV", "LevelSummary", "alone", "arrival_times", "level_arrivals", "summarize"]

ARRIVALS = ("poisson", "constant", "bursty")
BURSTY_CV = 2.0  # coefficient of variation of the bursty process's gaps (Poisson: 1)


def arrival_times(qps: float, duration_s: float, kind: str = "poisson", seed: int = 0) -> np.ndarray:
    """Arrival offsets (seconds from the start) of an open-loop load at ``qps`` for ``duration_s``.

    ``kind="constant"``: every ``1/qps`` s; ``"poisson"``: exponential gaps with mean ``1/qps``;
    ``"bursty"``: gamma-distributed gaps with the same mean and a coefficient of variation of
    :data:`BURSTY_CV` (clusters of close arrivals, then long pauses).

    Examples
    --------
    >>> arrival_times(4, 1.0, "constant").tolist()
    [0.0, 0.25, 0.5, 0.75]
    >>> len(arrival_times(1000, 2.0, "poisson", seed=1)) in range(1850, 2150)
    True
    >>> len(arrival_times(1000, 2.0, "bursty", seed=1)) in range(1500, 2500)
    True
    """
    if qps <= 0 or duration_s <= 0:
        raise ValueError(f"qps={qps}, duration_s={duration_s}: both need to be > 0")
    if kind == "constant":
        n = max(1, round(qps * duration_s))
        return np.arange(n, dtype=np.float64) / qps
    if kind in ("poisson", "bursty"):
        rng = np.random.default_rng(seed)
        cv = 1.0 if kind == "poisson" else BURSTY_CV
        n_guess = int(qps * duration_s * 1.2 + 10 * cv * cv * np.sqrt(qps * duration_s) + 10)
        while True:
            if kind == "poisson":
                gaps = rng.exponential(1.0 / qps, size=n_guess)
            else:
                shape = 1.0 / (cv * cv)
                gaps = rng.gamma(shape, 1.0 / (qps * shape), size=n_guess)
            t = np.cumsum(gaps)
            t = t - t[0]
            if t[-1] >= duration_s:
                return t[t < duration_s]
            n_guess *= 2  # (never for Poisson at this size; a long bursty pause can need more)
    raise ValueError(f"bench.arrival={kind!r}: use one of {list(ARRIVALS)}")


def level_arrivals(qps: float, index: int, duration_s: float, min_requests: int, kind: str, seed: int) -> np.ndarray:
    """The arrivals of the bench's level ``index`` at ``qps``: ``duration_s`` long, or long enough to offer
    ``min_requests`` (a p50 needs enough requests at a low load), seed ``seed + index``.

    The bench (``runtime.benchmark.run_levels``) and ``stage=simulate`` both take their levels from here.

    >>> len(level_arrivals(2.0, 0, 1.0, 30, "constant", 0))
    30
    """
    return arrival_times(qps, max(duration_s, min_requests / qps), kind, seed + index)


@dataclass(frozen=True, slots=True)
class LevelSummary:
    """One (variant, offered QPS) point."""

    variant: str
    offered_qps: float
    n_requests: int
    n_ok: int
    success_rate: float
    achieved_qps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    span_s: float
    path_p50_ms: float = float("nan")  # compute on the critical path, measured in the run (median)
    over_path_p50: float = float("nan")  # median over requests of latency / their critical-path compute
    cpu_cores: float = float("nan")  # CPU the ranks on the frontend's node used over the level, in cores

    def to_dict(self) -> dict[str, float | int | str]:
        return asdict(self)


def summarize(variant: str, offered_qps: float, arrival_s: np.ndarray, done_s: np.ndarray,
              ok: np.ndarray, path_ms: np.ndarray | None = None) -> LevelSummary:
    """Summarise one level: success rate, achieved QPS (completions per second of the level), percentiles.

    ``done_s`` is NaN for failed requests.  Achieved QPS = successes / (last completion - first arrival).

    Examples
    --------
    >>> s = summarize("split", 10.0, np.array([0.0, 0.1, 0.2]), np.array([0.05, 0.16, np.nan]),
    ...               np.array([True, True, False]))
    >>> s.n_ok, round(s.success_rate, 3), round(s.p50_ms, 1), round(s.achieved_qps, 2)
    (2, 0.667, 55.0, 12.5)
    """
    n = len(arrival_s)
    ok = np.asarray(ok, dtype=bool)
    lat = (np.asarray(done_s) - np.asarray(arrival_s))[ok] * 1e3
    n_ok = int(ok.sum())
    if n_ok:
        span = float(np.nanmax(np.asarray(done_s)[ok]) - np.min(arrival_s))
        p50, p90, p99 = (float(x) for x in np.percentile(lat, [50, 90, 99]))
        mean = float(lat.mean())
    else:
        span, p50, p90, p99, mean = float("nan"), float("nan"), float("nan"), float("nan"), float("nan")
    achieved = n_ok / span if n_ok and span > 0 else float("nan")
    path = ratio = float("nan")
    if path_ms is not None and n_ok:
        v = np.asarray(path_ms)[ok]
        good = np.isfinite(v) & (v > 0)
        if good.any():
            path = float(np.median(v[good]))
            ratio = float(np.median(lat[good] / v[good]))
    return LevelSummary(variant, float(offered_qps), n, n_ok, n_ok / n if n else float("nan"), achieved,
                        p50, p90, p99, mean, span, path, ratio)


def alone(arrival_s: np.ndarray, done_s: np.ndarray) -> np.ndarray:
    """Which requests were the only one in the system from their arrival to their answer (no other request
    arrived before and answered after their arrival, nor arrived before their answer); a request not answered
    (``done_s`` NaN) is in the system to the end.

    Such a request ran every component as a batch of one on a pipeline otherwise idle: its critical-path
    compute is the machine's speed at the time, without queueing or batching.

    Examples
    --------
    >>> alone(np.array([0.0, 1.0, 1.5, 3.0]), np.array([0.5, 2.0, 2.2, 3.1])).tolist()
    [True, False, False, True]
    """
    a = np.asarray(arrival_s, dtype=np.float64)
    d = np.where(np.isfinite(done_s), np.asarray(done_s, dtype=np.float64), np.inf)
    n = len(a)
    if n == 0:
        return np.zeros(0, dtype=bool)
    o = np.argsort(a, kind="stable")
    a, d = a[o], d[o]
    before = np.concatenate([[-np.inf], np.maximum.accumulate(d)[:-1]])  # the latest answer of those before
    after = np.concatenate([a[1:], [np.inf]])  # the next arrival
    out = np.zeros(n, dtype=bool)
    out[o] = (before <= a) & (d <= after)
    return out
