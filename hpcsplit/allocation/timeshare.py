"""Replicas for CPU nodes whose ranks share cores (see ``[Note: CPU time-sharing]``).

[Note: CPU time-sharing]
The MILP gives every CPU replica its threads as cores of its own.  When a node has fewer cores than the
plan has ranks (``cpu_oversubscribe``: each component must get a rank), the ranks share the cores
instead, and that model is wrong both ways: a rank of a tiny component (CLIP's head: 0.2 ms a request)
holds a core it hardly uses, while the slowest component gets one replica because no core is left for
a second.  At a pipeline rate of ``T`` requests/s (normalised by demand weight), component ``c`` takes
``T * weight_c`` requests/s spread over its replicas, so a replica of it is busy a fraction
``T * weight_c / X_c`` of the time (``X_c``: the component's summed replica throughput) and uses that
fraction of its threads.  A node then carries ``T`` only while

    sum over its ranks of  threads_r * T * weight_c / X_c   +   T * FRONTEND_S_PER_REQUEST   <=  cores,

and the plan reaches ``T = min(min_c X_c / weight_c, core ceiling)``.  :func:`add_timeshared_replicas`
adds replicas of the bottleneck component to node 0 while that raises ``T``: it stops as soon as the
cores, not the replicas, are the limit, or memory would not hold another replica.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpcsplit.allocation.results import Replica
from hpcsplit.core.calibration import DEFAULT_FRONTEND_US_PER_REQUEST

__all__ = ["FRONTEND_S_PER_REQUEST", "TimeShare", "add_timeshared_replicas", "pipeline_rate"]

# frontend CPU per request (s) without a calibration: the frontend ceiling is 5,000-8,000 requests/s on one
# core (python -m hpcsplit.bench cpu), so 200 us is a safe upper figure (core.calibration's documented default)
FRONTEND_S_PER_REQUEST = DEFAULT_FRONTEND_US_PER_REQUEST / 1e6


@dataclass(frozen=True, slots=True)
class TimeShare:
    """What the pass did: added replicas per component and the rate before and after."""

    added: dict[str, int]
    rate_before: float
    rate_after: float
    core_ceiling: float

    def note(self) -> str:
        add = ", ".join(f"{n} x {c}" for c, n in self.added.items())
        return (
            f"CPU time-sharing: ranks share node 0's cores; added {add} (the bottleneck) while that raised the "
            f"pipeline rate: {self.rate_before:.3g} -> {self.rate_after:.3g} req/s predicted, the cores carry "
            f"at most {self.core_ceiling:.3g} req/s"
        )


def pipeline_rate(
    replicas: Sequence[tuple[str, float, int]], weights: Mapping[str, float], cores: float,
    frontend_s: float = FRONTEND_S_PER_REQUEST,
) -> tuple[float, float, float]:
    """(rate, replica bound, core ceiling) for replicas ``(component, throughput req/s, threads)`` on one node.

    Examples
    --------
    Two cores, a 10 req/s component and a 1,000 req/s one, one thread each: the replicas allow 10 req/s,
    the cores 19.8 (each req/s costs 0.1 + 0.001 + 0.0002 core-seconds).

    >>> [round(x, 1) for x in pipeline_rate([("a", 10.0, 1), ("b", 1000.0, 1)], {"a": 1, "b": 1}, 2)]
    [10.0, 10.0, 19.8]
    """
    cap: dict[str, float] = {}
    threads: dict[str, int] = {}
    for c, x, t in replicas:
        cap[c] = cap.get(c, 0.0) + x
        threads[c] = threads.get(c, 0) + t
    bound = min((cap[c] / w for c, w in weights.items() if w > 0 and c in cap), default=math.inf)
    # core-seconds per unit of pipeline rate: every rank busy in proportion to its component's share
    per_rate = frontend_s + sum(
        threads[c] * _load(weights, c) / cap[c] for c in cap if cap[c] > 0
    )
    ceiling = cores / per_rate if per_rate > 0 else math.inf
    return min(bound, ceiling), bound, ceiling


def _load(weights: Mapping[str, float], c: str) -> float:
    """Requests a component takes per unit of pipeline rate (weight 0: one replica only, counted as 1)."""
    w = float(weights.get(c, 1.0))
    return w if w > 0 else 1.0


def add_timeshared_replicas(
    replicas: Sequence[Replica],
    weights: Mapping[str, float],
    cores: float,
    mem_bytes: float,
    *,
    max_added: int = 64,
    min_gain: float = 0.02,
    frontend_s: float = FRONTEND_S_PER_REQUEST,
) -> tuple[list[Replica], TimeShare | None]:
    """Add replicas of the bottleneck to node 0 while the predicted pipeline rate rises.

    Parameters
    ----------
    replicas : sequence of :class:`~hpcsplit.allocation.results.Replica`
        The MILP's answer on a one-node CPU cluster whose node is oversubscribed.
    weights : demand weights (0: one replica only, never added to).
    cores : node 0's cores (the frontend's share is ``frontend_s`` per request).
    mem_bytes : host memory the node's replicas may use together.
    max_added : at most this many ranks are added.
    min_gain : a replica is added only if the rate rises by at least this fraction.
    frontend_s : the frontend's CPU seconds per request: a calibration's (``stage=calibrate``), else
        :data:`FRONTEND_S_PER_REQUEST`.

    Returns
    -------
    (replicas, TimeShare or None)
        The replicas with the added ones last; None when nothing was added.
    """
    reps = list(replicas)

    def rate(rs: list[Replica]) -> tuple[float, float, float]:
        node0 = [
            (r.option.component, r.option.throughput_rps, int(r.option.slice_size)) for r in rs if r.node == 0
        ]
        return pipeline_rate(node0, weights, cores, frontend_s)

    before, _bound, ceiling = rate(reps)
    cur = before
    added: dict[str, int] = {}
    mem = sum(r.option.mem_bytes for r in reps if r.node == 0)
    for _ in range(max_added):
        cap: dict[str, float] = {}
        for r in reps:
            cap[r.option.component] = cap.get(r.option.component, 0.0) + r.option.throughput_rps
        live = [c for c, w in weights.items() if w > 0 and c in cap]
        if not live:
            break
        b = min(live, key=lambda c: cap[c] / weights[c])
        # the bottleneck's most efficient option already in the plan (throughput per thread)
        best = max(
            (r for r in reps if r.option.component == b),
            key=lambda r: r.option.throughput_rps / max(1.0, r.option.slice_size),
        )
        if mem + best.option.mem_bytes > mem_bytes:
            break
        slot = 1 + max((r.slot for r in reps if r.node == 0), default=-1)
        trial = [*reps, Replica(0, None, slot, best.option)]
        new, _bound, ceiling = rate(trial)
        if new < cur * (1 + min_gain):
            break
        reps, cur, mem = trial, new, mem + best.option.mem_bytes
        added[b] = added.get(b, 0) + 1
    if not added:
        return list(replicas), None
    return reps, TimeShare(added, before, cur, ceiling)
