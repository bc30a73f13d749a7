"""Policies the runtime serves by and the simulator (:mod:`hpcsplit.core.simulator`) follows: one code for both.

``ReplicaRouter`` is the frontend's router (``hpcsplit.runtime.routing.Router`` adapts it to a dataflow).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["ReplicaRouter"]


class ReplicaRouter:
    """Join-shortest-queue routing over the replicas of each component (``runtime.routing.Router`` is this).

    :meth:`assign` picks one rank per component and counts it outstanding: the replica with the fewest
    outstanding requests; ties to one that has not timed out since its last success (``release(failed=True)``
    makes a route's replicas lose ties until one succeeds), then to the bigger replica (GPU slice or CPU threads,
    ``sizes``), then to the one used least recently.  :meth:`release` un-counts a finished (or failed) request.
    Pure bookkeeping: the runtime's frontend and the simulator route with it.

    Examples
    --------
    >>> r = ReplicaRouter([(1, 2), (3,)], {1: 0.0, 2: 0.0, 3: 0.0})
    >>> r.assign(), r.assign(), r.assign()
    ((1, 3), (2, 3), (1, 3))
    >>> r.release((1, 3)); r.assign()
    (2, 3)
    """

    __slots__ = ("_last", "_neg_size", "_replicas", "_suspect", "_tick", "outstanding")

    def __init__(self, replicas: Sequence[Sequence[int]], sizes: Mapping[int, float]) -> None:
        self._replicas = [tuple(r) for r in replicas]
        self.outstanding = {r: 0 for reps in self._replicas for r in reps}
        self._last = dict.fromkeys(self.outstanding, -1)
        self._neg_size = {r: -float(sizes.get(r, 0.0)) for r in self.outstanding}
        self._suspect: set[int] = set()
        self._tick = 0

    def assign(self) -> tuple[int, ...]:
        out, last, neg, sus = self.outstanding, self._last, self._neg_size, self._suspect
        route = []
        for reps in self._replicas:
            if len(reps) == 1:
                best = reps[0]
            elif not sus:
                best = min(reps, key=lambda r: (out[r], neg[r], last[r]))
            else:
                best = min(reps, key=lambda r: (out[r], r in sus, neg[r], last[r]))
            out[best] += 1
            self._tick += 1
            last[best] = self._tick
            route.append(best)
        return tuple(route)

    def release(self, route: Sequence[int], failed: bool = False) -> None:
        """Un-count a request; ``failed`` (it timed out) makes its replicas lose ties until one succeeds."""
        for r in route:
            self.outstanding[r] -= 1
        if failed:
            self._suspect.update(route)
        elif self._suspect:
            self._suspect.difference_update(route)
