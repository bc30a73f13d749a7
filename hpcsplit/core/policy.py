"""Policies the runtime serves by and the simulator (:mod:`hpcsplit.core.simulator`) follows: one code for both.

``ReplicaRouter`` is the frontend's router (``hpcsplit.runtime.routing.Router`` adapts it to a dataflow);
``ServePolicy`` the runtime settings the simulation follows.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpcsplit.core.settings import Checker, group_defaults

__all__ = ["BUCKET_MIN", "ReplicaRouter", "ServePolicy", "backoff_wakes_ms"]

BUCKET_MIN = 9  # components with at least this many replicas keep them ordered (no scan per request)
# runtime.mailbox.Backoff's schedule (defined here, read there and by the simulator: one source for both)
BACKOFF_FIRST_S = 20e-6  # its first sleep after the spin, doubling ...
BACKOFF_MAX_S = 1e-3  # ... to this (its default max_sleep_s)
QUIET_AFTER_S = 1e-3  # (mailbox.QUIET_AFTER_S) then a quiet rank sleeps on its doorbell until rung


def backoff_wakes_ms(spin_us: float) -> tuple[float, ...]:
    """When a quiet rank's backoff wakes it (ms after its work): after its spin, sleeps of 20 us doubling (at most
    1 ms) until it has been idle 1 ms; then it sleeps on its doorbell until a message rings it
    (``runtime.mailbox.Backoff.plan``; the quiet sleep's 100 ms timeout is not counted).  A spin of 1 ms or more
    goes straight to the quiet sleep.

    Not covered: a rank with no doorbell that sleeps until rung (it wakes every 1 ms, then every 2 ms from 50 ms
    idle), and one with a message half-way (it sleeps at most 50 us, off the doorbell); both take more wake-ups.

    >>> backoff_wakes_ms(50.0), backoff_wakes_ms(2000.0)
    ((0.07, 0.11, 0.19, 0.35, 0.67, 1.31), ())
    """
    t, s = spin_us * 1e-6, BACKOFF_FIRST_S
    out = []
    while t < QUIET_AFTER_S:
        t += s
        out.append(round(t * 1e3, 9))
        s = min(2 * s, BACKOFF_MAX_S)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ServePolicy:
    """The runtime settings the simulation follows (``conf/runtime/default.yaml``'s values by default)."""

    max_inflight: int = 64
    max_wait_ms: float = 0.0
    request_timeout_s: float = 60.0
    max_admit: int = 256  # runtime.frontend.Frontend.run's max_admit
    spin_us: float = 50.0  # a rank polls back to back this long after work (runtime.mailbox.SPIN_S, runtime.spin_us)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ServePolicy:
        """``runtime.max_inflight``, ``max_wait_ms``, ``request_timeout_s`` of a resolved config (over the defaults).

        For stages that cannot import the runtime's settings (the allocator): the runtime checks its group itself.

        >>> ServePolicy.from_config({"runtime": {"max_inflight": 8}}).max_inflight
        8
        """
        node = cfg.get("runtime")
        values = {**group_defaults("runtime"), **(node if isinstance(node, Mapping) else {})}
        c = Checker("runtime", values, list(values))
        spin = c.number("spin_us", lo=0, none=True)
        out = cls(c.integer("max_inflight", lo=1), c.number("max_wait_ms", lo=0),
                  c.number("request_timeout_s", lo=0, lo_open=True), spin_us=50.0 if spin is None else spin)
        c.done()
        return out


class ReplicaRouter:
    """Join-shortest-queue routing over the replicas of each component (``runtime.routing.Router`` is this).

    :meth:`assign` picks one rank per component and counts it outstanding: the replica with the fewest
    outstanding requests; ties to one that has not timed out since its last success (``release(failed=True)``
    makes a route's replicas lose ties until one succeeds), then to the bigger replica (GPU slice or CPU threads,
    ``sizes``), then to the one used least recently.  :meth:`release` un-counts a finished (or failed) request.
    Pure bookkeeping: the runtime's frontend and the simulator route with it.

    A component with few replicas is scanned per request (``min`` over them); one with at least
    :data:`BUCKET_MIN` (a simulated 256-GPU plan) keeps its replicas ordered instead (:class:`_Ordered`), which
    picks the same replica: ``tests/unit/test_simulator.py`` checks the two on random traces.

    Examples
    --------
    >>> r = ReplicaRouter([(1, 2), (3,)], {1: 0.0, 2: 0.0, 3: 0.0})
    >>> r.assign(), r.assign(), r.assign()
    ((1, 3), (2, 3), (1, 3))
    >>> r.release((1, 3)); r.assign()
    (2, 3)
    """

    __slots__ = ("_big", "_bucket_min", "_last", "_neg_size", "_ordered", "_replicas", "_suspect", "_tick",
                 "outstanding")

    def __init__(self, replicas: Sequence[Sequence[int]], sizes: Mapping[int, float],
                 bucket_min: int = BUCKET_MIN) -> None:
        self._replicas = [tuple(r) for r in replicas]
        self.outstanding = {r: 0 for reps in self._replicas for r in reps}
        self._last = dict.fromkeys(self.outstanding, -1)
        self._neg_size = {r: -float(sizes.get(r, 0.0)) for r in self.outstanding}
        self._suspect: set[int] = set()
        self._tick = 0
        self._bucket_min = bucket_min
        self._ordered = [_Ordered(reps, self) if len(reps) >= bucket_min else None for reps in self._replicas]
        self._big = {r: o for o in self._ordered if o is not None for r in o.pos}

    def assign(self) -> tuple[int, ...]:
        out, last, neg, sus = self.outstanding, self._last, self._neg_size, self._suspect
        route = []
        for reps, ordered in zip(self._replicas, self._ordered, strict=True):
            if len(reps) == 1:
                best = reps[0]
            elif ordered is not None:
                best = ordered.take(self._tick + 1)
            elif not sus:
                best = min(reps, key=lambda r: (out[r], neg[r], last[r]))
            else:
                best = min(reps, key=lambda r: (out[r], r in sus, neg[r], last[r]))
            out[best] += 1
            self._tick += 1
            last[best] = self._tick
            route.append(best)
        return tuple(route)

    def drop(self, rank: int) -> int:
        """Route nothing more to ``rank`` (its replica was lost); returns how many replicas of its component are
        left (0: none, and :meth:`assign` then keeps routing to it: the job cannot go on, the caller ends it).

        Examples
        --------
        >>> r = ReplicaRouter([(1, 2)], {})
        >>> r.drop(1), r.assign(), r.assign(), r.drop(2)
        (1, (2,), (2,), 0)
        """
        for k, reps in enumerate(self._replicas):
            if rank in reps:
                left = tuple(r for r in reps if r != rank)
                if left:
                    self._replicas[k] = left
                    if self._ordered[k] is not None:  # rebuilt from the replicas left (a rare event)
                        for r in reps:
                            self._big.pop(r, None)
                        o = _Ordered(left, self) if len(left) >= self._bucket_min else None
                        self._ordered[k] = o
                        if o is not None:
                            self._big.update((r, o) for r in left)
                return len(left)
        return 0

    def live(self, k: int) -> tuple[int, ...]:
        """The replicas component ``k`` (dataflow order) is routed to."""
        return self._replicas[k]

    def release(self, route: Sequence[int], failed: bool = False) -> None:
        """Un-count a request; ``failed`` (it timed out) makes its replicas lose ties until one succeeds."""
        for r in route:
            self.outstanding[r] -= 1
        if failed:
            self._suspect.update(route)
        elif self._suspect:
            self._suspect.difference_update(route)
        if self._big:
            for r in route:
                o = self._big.get(r)
                if o is not None:
                    o.moved(r, self)


class _Ordered:
    """One component's replicas in the order ``ReplicaRouter`` picks them: buckets keyed by (outstanding, suspect,
    -size), each a sorted list of (last used, position, rank); the first of the smallest bucket is the pick."""

    __slots__ = ("buckets", "entry", "key", "pos")

    def __init__(self, reps: Sequence[int], router: ReplicaRouter) -> None:
        self.pos = {r: i for i, r in enumerate(reps)}
        self.buckets: dict[tuple[int, bool, float], list[tuple[int, int, int]]] = {}
        self.key: dict[int, tuple[int, bool, float]] = {}
        self.entry: dict[int, tuple[int, int, int]] = {}
        for r in reps:
            self._put(r, router)

    def _put(self, r: int, rt: ReplicaRouter) -> None:
        k = (rt.outstanding[r], r in rt._suspect, rt._neg_size[r])
        e = (rt._last[r], self.pos[r], r)
        lst = self.buckets.get(k)
        if lst is None:
            self.buckets[k] = [e]
        else:
            bisect.insort(lst, e)
        self.key[r], self.entry[r] = k, e

    def take(self, tick: int) -> int:
        """The pick, moved to the end of the next bucket up as used at ``tick`` (the newest: no search)."""
        buckets = self.buckets
        k = min(buckets)
        lst = buckets[k]
        e = lst.pop(0)
        if not lst:
            del buckets[k]
        r = e[2]
        k = (k[0] + 1, k[1], k[2])
        e = (tick, e[1], r)
        up = buckets.get(k)
        if up is None:
            buckets[k] = [e]
        else:
            up.append(e)
        self.key[r], self.entry[r] = k, e
        return r

    def moved(self, r: int, rt: ReplicaRouter) -> None:
        """``r``'s outstanding count, suspicion or last use changed: put it where it now belongs."""
        buckets = self.buckets
        k = self.key[r]
        lst = buckets[k]
        if len(lst) == 1:
            del buckets[k]
        else:
            del lst[bisect.bisect_left(lst, self.entry[r])]
        k = (rt.outstanding[r], r in rt._suspect, rt._neg_size[r])
        e = (rt._last[r], self.pos[r], r)
        to = buckets.get(k)
        if to is None:
            buckets[k] = [e]
        else:
            bisect.insort(to, e)
        self.key[r], self.entry[r] = k, e
