"""Open-loop load: arrival schedules, per-level summaries and the split-vs-whole table (pure numpy).

Open loop: request ``i`` *arrives* at ``arrivals_s[i]`` whether or not earlier ones finished; its latency
runs from that arrival to its last output, so queueing in front of a saturated system counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["LevelSummary", "arrival_times", "format_table", "improvement_rows", "summarize"]


def arrival_times(qps: float, duration_s: float, kind: str = "poisson", seed: int = 0) -> np.ndarray:
    """Arrival offsets (seconds from the start) of an open-loop load at ``qps`` for ``duration_s``.

    ``kind="constant"``: every ``1/qps`` s; ``"poisson"``: exponential gaps with mean ``1/qps``.

    Examples
    --------
    >>> arrival_times(4, 1.0, "constant").tolist()
    [0.0, 0.25, 0.5, 0.75]
    >>> len(arrival_times(1000, 2.0, "poisson", seed=1)) in range(1850, 2150)
    True
    """
    if qps <= 0 or duration_s <= 0:
        raise ValueError(f"qps={qps}, duration_s={duration_s}: both need to be > 0")
    if kind == "constant":
        n = max(1, round(qps * duration_s))
        return np.arange(n, dtype=np.float64) / qps
    if kind == "poisson":
        rng = np.random.default_rng(seed)
        n_guess = int(qps * duration_s * 1.2 + 10 * np.sqrt(qps * duration_s) + 10)
        t = np.cumsum(rng.exponential(1.0 / qps, size=n_guess))
        t = t - t[0]
        return t[t < duration_s]
    raise ValueError(f"bench.arrival={kind!r}: use 'poisson' or 'constant'")


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


def improvement_rows(whole: Sequence[LevelSummary], split: Sequence[LevelSummary]) -> list[dict[str, float]]:
    """Per QPS: latency improvement % (p50, whole vs split) and throughput improvement % (achieved).

    Latency improvement = (whole - split) / whole * 100; throughput improvement =
    (split / whole - 1) * 100, as in the prototype's table.
    """
    by_q = {s.offered_qps: s for s in whole}
    rows = []
    for s in split:
        w = by_q.get(s.offered_qps)
        if w is None:
            continue
        rows.append({
            "qps": s.offered_qps,
            "latency_improvement_pct": (w.p50_ms - s.p50_ms) / w.p50_ms * 100 if w.p50_ms else float("nan"),
            "p99_improvement_pct": (w.p99_ms - s.p99_ms) / w.p99_ms * 100 if w.p99_ms else float("nan"),
            "throughput_improvement_pct": (s.achieved_qps / w.achieved_qps - 1) * 100
            if w.achieved_qps else float("nan"),
            "whole_p50_ms": w.p50_ms,
            "split_p50_ms": s.p50_ms,
            "whole_qps": w.achieved_qps,
            "split_qps": s.achieved_qps,
            "whole_ok": w.success_rate,
            "split_ok": s.success_rate,
        })
    return rows


def format_table(rows: Sequence[dict[str, float]]) -> str:
    """The prototype's summary table, with the measured figures beside the ratios."""
    head = (f"{'QPS':<8} {'Latency Improvement (%)':>24} {'Throughput Improvement (%)':>27} | "
            f"{'whole p50 ms':>12} {'split p50 ms':>12} {'whole req/s':>11} {'split req/s':>11} "
            f"{'ok whole/split':>15}")
    lines = ["Performance Improvement Summary:", head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['qps']:<8g} {r['latency_improvement_pct']:>24.2f} {r['throughput_improvement_pct']:>27.2f} | "
            f"{r['whole_p50_ms']:>12.2f} {r['split_p50_ms']:>12.2f} {r['whole_qps']:>11.2f} "
            f"{r['split_qps']:>11.2f} {r['whole_ok']:>7.0%}/{r['split_ok']:<7.0%}"
        )
    lines.append("-" * len(head))
    return "\n".join(lines)
