"""Packing data and patterns: items, device kinds, pattern checks, enumeration and pricing.

Internal to the allocator; see ``[Note: packing patterns]`` in :mod:`hpcsplit.allocation.patterns`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import LinearConstraint, milp

__all__ = [
    "DeviceKind",
    "Instance",
    "Item",
    "Pattern",
    "enumerate_patterns",
    "neighbour_columns",
    "pattern_fits",
    "pattern_throughputs",
    "price_pattern",
    "seed_pool",
]

_GRID = 1000  # steps of the second knapsack resource in DP pricing
_GRID_FINE = 4000  # for the optimistic DP that bounds the LP once column generation converged
Pattern = tuple[tuple[int, int], ...]  # ((item index in kind.items, count), ...), sorted


@dataclass(frozen=True, slots=True)
class Item:
    """One way to run one replica: component, batch size and slice, with its predicted figures."""

    comp: int
    batch_size: int
    slice_idx: int  # index into DeviceKind.slice_sizes
    throughput_rps: float
    utilization: float
    mem_bytes: float
    latency_ms: float


@dataclass(frozen=True, slots=True)
class DeviceKind:
    """A group of interchangeable devices and what fits on one of them."""

    name: str
    count: int
    slice_sizes: tuple[float, ...]  # GB (GPU) or threads (CPU)
    slice_units: tuple[int, ...]  # each slice's size in integer capacity units
    capacity_units: int  # sum of slice units per device (when layouts is None)
    util_limit: float
    max_items: int  # ranks per device
    items: tuple[Item, ...]
    layouts: tuple[tuple[int, ...], ...] | None = None  # allowed layouts: count per slice index
    shared_mem_bytes: float | None = None  # CPU: host memory all items share


@dataclass(frozen=True, slots=True)
class Instance:
    """A whole allocation problem: components (with weights) and device kinds."""

    n_comp: int
    weights: tuple[float, ...]  # 0: the component needs a replica but has no throughput target
    kinds: tuple[DeviceKind, ...]

    @property
    def active(self) -> tuple[int, ...]:
        return tuple(c for c in range(self.n_comp) if self.weights[c] > 0)


def _usage(kind: DeviceKind, counts: dict[int, int]) -> tuple[tuple[int, ...], float, float, int]:
    slice_counts = [0] * len(kind.slice_sizes)
    util = mem = 0.0
    n = 0
    for i, k in counts.items():
        it = kind.items[i]
        slice_counts[it.slice_idx] += k
        util += k * it.utilization
        mem += k * it.mem_bytes
        n += k
    return tuple(slice_counts), util, mem, n


def _layout_ok(kind: DeviceKind, slice_counts: Sequence[int]) -> bool:
    if kind.layouts is None:
        return sum(c * u for c, u in zip(slice_counts, kind.slice_units, strict=True)) <= kind.capacity_units
    return any(all(c <= lc for c, lc in zip(slice_counts, lay, strict=True)) for lay in kind.layouts)


def pattern_fits(kind: DeviceKind, counts: dict[int, int]) -> bool:
    """Whether items ``{item index: count}`` fit one device of ``kind`` (layout, utilization, memory)."""
    slice_counts, util, mem, n = _usage(kind, counts)
    if n > kind.max_items or util > kind.util_limit + 1e-9:
        return False
    if kind.shared_mem_bytes is not None and mem > kind.shared_mem_bytes * (1 + 1e-12):
        return False
    return _layout_ok(kind, slice_counts)


def enumerate_patterns(kind: DeviceKind, limit: int, *, maximal_only: bool = True) -> list[Pattern] | None:
    """All (maximal) patterns of ``kind``, or None when there are more than ``limit``.

    Maximal: no further item fits. Since adding a replica never lowers a throughput, an optimum
    over maximal patterns is an optimum over all patterns.  The search also gives up (None) after
    visiting ``3 * limit`` partial patterns.
    """
    items = kind.items
    n_it = len(items)
    units = np.array([kind.slice_units[it.slice_idx] for it in items], float)
    util = np.array([it.utilization for it in items])
    mem = np.array([it.mem_bytes for it in items])
    shared = kind.shared_mem_bytes
    out: list[Pattern] = []
    counts: list[int] = [0] * n_it
    slice_counts = [0] * len(kind.slice_sizes)
    state = {"u": 0.0, "units": 0, "mem": 0.0, "n": 0, "visits": 0}

    def fits_more(i: int) -> bool:
        if state["n"] + 1 > kind.max_items or state["u"] + util[i] > kind.util_limit + 1e-9:
            return False
        if shared is not None and state["mem"] + mem[i] > shared * (1 + 1e-12):
            return False
        if kind.layouts is None:
            return state["units"] + units[i] <= kind.capacity_units
        slice_counts[items[i].slice_idx] += 1
        ok = _layout_ok(kind, slice_counts)
        slice_counts[items[i].slice_idx] -= 1
        return ok

    def maximal() -> bool:
        room = (util <= kind.util_limit + 1e-9 - state["u"]) & (state["n"] < kind.max_items)
        if shared is not None:
            room &= mem <= shared * (1 + 1e-12) - state["mem"]
        if kind.layouts is None:
            room &= units <= kind.capacity_units - state["units"]
            return not room.any()
        return not any(fits_more(int(i)) for i in np.flatnonzero(room))

    def add(i: int, sign: int) -> None:
        counts[i] += sign
        slice_counts[items[i].slice_idx] += sign
        state["u"] += sign * util[i]
        state["units"] += sign * int(units[i])
        state["mem"] += sign * mem[i]
        state["n"] += sign

    def rec(j: int) -> bool:
        state["visits"] += 1
        if state["visits"] > 3 * limit:
            return False
        if j == n_it:
            if state["n"] == 0 and maximal_only:
                return True
            if not maximal_only or maximal():
                out.append(tuple((i, c) for i, c in enumerate(counts) if c))
                if len(out) > limit:
                    return False
            return True
        added = 0
        ok = True
        while True:
            if not rec(j + 1):
                ok = False
                break
            if not fits_more(j):
                break
            add(j, +1)
            added += 1
        for _ in range(added):
            add(j, -1)
        return ok

    return out if rec(0) else None


def _can_add(kind: DeviceKind, counts: dict[int, int], i: int) -> bool:
    counts[i] = counts.get(i, 0) + 1
    ok = pattern_fits(kind, counts)
    counts[i] -= 1
    if counts[i] == 0:
        del counts[i]
    return ok


def _undominated(kind: DeviceKind, values: np.ndarray) -> np.ndarray:
    """Items with positive value not dominated by another item of the same slice.

    j dominates i when it uses no more utilization and memory and is worth at least as much; any
    pattern using i stays valid with j instead, so pricing may ignore i.
    """
    pos = np.flatnonzero(values > 1e-12)
    keep = []
    by_slice: dict[int, list[int]] = {}
    for i_np in pos:
        by_slice.setdefault(kind.items[int(i_np)].slice_idx, []).append(int(i_np))
    for group in by_slice.values():
        group.sort(key=lambda i: (kind.items[i].utilization, kind.items[i].mem_bytes, -values[i]))
        front: list[int] = []
        for i in group:
            it = kind.items[i]
            if any(values[j] >= values[i] and kind.items[j].mem_bytes <= it.mem_bytes for j in front):
                continue
            front.append(i)
        keep.extend(front)
    return np.array(sorted(keep), int)


def _dp_price(
    kind: DeviceKind, values: np.ndarray, *, grid: int, optimistic: bool
) -> tuple[float, Pattern] | None:
    """Unbounded 2-D knapsack by dynamic programming: exact over slice units, the second resource
    (utilization on GPU, host memory on CPU) on a grid of ``grid`` steps.

    Item weights are rounded up (every pattern found fits) or, with ``optimistic``, down (the value
    is an upper bound of the exact pricing problem; no pattern is returned).  None when the kind
    needs the MILP (explicit layouts, or both utilization and shared memory binding).
    """
    if kind.layouts is not None:
        return None
    use = _undominated(kind, values)
    if use.size == 0:
        return 0.0, ()
    if kind.shared_mem_bytes is None:
        res = np.array([kind.items[i].utilization for i in use]) / kind.util_limit
    else:
        # the DP drops utilization: only valid when it cannot bind (CPU: util = threads / cores)
        dens = max(kind.items[i].utilization / kind.slice_units[kind.items[i].slice_idx] for i in use)
        if dens * kind.capacity_units > kind.util_limit + 1e-9:
            return None
        res = np.array([kind.items[i].mem_bytes for i in use]) / max(kind.shared_mem_bytes, 1.0)
    w = np.floor(res * grid + 1e-9) if optimistic else np.ceil(res * grid - 1e-9)
    w = np.maximum(w, 0).astype(int)
    units = np.array([kind.slice_units[kind.items[i].slice_idx] for i in use], int)
    vals = values[use]
    cap = kind.capacity_units
    dp = np.full((cap + 1, grid + 1), -np.inf)
    dp[0, 0] = 0.0
    choice = np.full((cap + 1, grid + 1), -1, int)
    keep = w <= grid
    groups = []
    for u in np.unique(units[keep]):
        js = np.flatnonzero(keep & (units == u))
        # source column g - w_j, shifted by grid + 1 into a -inf pad: window grid + 1 - w_j of the pad
        groups.append((int(u), js, grid + 1 - w[js], vals[js][:, None]))
    pad = np.full(2 * (grid + 1), -np.inf)
    windows = np.lib.stride_tricks.sliding_window_view(pad, grid + 1)  # views: follow pad's updates
    cols = np.arange(grid + 1)
    for m in range(cap):
        row = dp[m]
        if not np.isfinite(row).any():
            continue
        pad[grid + 1 :] = row
        for u, js, src, v in groups:
            t = m + u
            if t > cap:
                continue
            cand = windows[src] + v
            arg = np.argmax(cand, axis=0)
            best_c = cand[arg, cols]
            better = best_c > dp[t] + 1e-12
            if better.any():
                dp[t, better] = best_c[better]
                choice[t, better] = js[arg[better]]
    flat = int(np.argmax(dp))
    best = float(dp.flat[flat])
    if optimistic:
        return best, ()
    m, g = divmod(flat, grid + 1)
    counts: dict[int, int] = {}
    while m > 0 or g > 0:
        j = choice[m, g]
        if j < 0:
            break
        counts[int(use[j])] = counts.get(int(use[j]), 0) + 1
        m -= units[j]
        g -= w[j]
    pat = tuple(sorted(counts.items()))
    if not pattern_fits(kind, counts):  # e.g. max_items binds: let the MILP decide
        return None
    return best, pat


def price_pattern(
    kind: DeviceKind,
    values: np.ndarray,
    *,
    time_limit_s: float | None = None,
    node_limit: int | None = None,
    with_bound: bool = False,
):
    """The pattern of ``kind`` with the largest total item value (a small knapsack MILP, exact).

    ``values[i]`` is item i's value; items with value <= 0 are left out.  Returns
    ``(value, pattern)``, or ``(value, pattern, upper bound, clock)`` with ``with_bound``: the bound
    is the value unless a limit stopped the search, and ``clock`` says whether ``time_limit_s``
    (not ``node_limit``) did ([Note: deterministic limits] in :mod:`hpcsplit.allocation.leximin`).
    """
    use = _undominated(kind, values)
    if use.size == 0:
        return (0.0, (), 0.0, False) if with_bound else (0.0, ())
    items = [kind.items[i] for i in use]
    n_it = len(items)
    rows: list[np.ndarray] = []
    ub: list[float] = []
    n_lay = 0 if kind.layouts is None else len(kind.layouts)
    width = n_it + n_lay

    def row(vals: np.ndarray, bound: float) -> None:
        r = np.zeros(width)
        r[: len(vals)] = vals
        rows.append(r)
        ub.append(bound)

    row(np.array([it.utilization for it in items]), kind.util_limit + 1e-9)
    row(np.ones(n_it), kind.max_items)
    if kind.shared_mem_bytes is not None:
        row(np.array([it.mem_bytes for it in items]) / max(kind.shared_mem_bytes, 1.0), 1.0 + 1e-12)
    if kind.layouts is None:
        row(np.array([kind.slice_units[it.slice_idx] for it in items], float), kind.capacity_units)
    else:
        for s in range(len(kind.slice_sizes)):
            r = np.zeros(width)
            r[:n_it] = [1.0 if it.slice_idx == s else 0.0 for it in items]
            r[n_it:] = [-lay[s] for lay in kind.layouts]
            rows.append(r)
            ub.append(0.0)
        r = np.zeros(width)
        r[n_it:] = 1.0
        rows.append(r)
        ub.append(1.0)
    c = np.zeros(width)
    c[:n_it] = -values[use]
    ubx = np.full(width, float(kind.max_items))
    ubx[n_it:] = 1.0
    res = milp(
        c,
        integrality=np.ones(width),
        bounds=(np.zeros(width), ubx),
        constraints=LinearConstraint(np.array(rows), -np.inf, np.array(ub)),
        options={"mip_rel_gap": 1e-7, **({"time_limit": time_limit_s} if time_limit_s else {}),
                 **({"node_limit": int(node_limit)} if node_limit is not None else {})},
    )
    # stopped: 1 at the time limit, 4 at the node limit (scipy has no status of its own for that one); the
    # clock's when the node count did not reach the limit
    nodes = getattr(res, "mip_node_count", None)
    clock = res.status in (1, 4) and (node_limit is None or nodes is None or int(nodes) < int(node_limit))
    if res.x is None:  # pragma: no cover - the empty pattern is always feasible
        return (0.0, (), math.inf, clock) if with_bound else (0.0, ())
    upper = -float(getattr(res, "mip_dual_bound", None) or res.fun) if res.status != 0 else -float(res.fun)
    cnt = np.round(res.x[:n_it]).astype(int)
    pat = tuple((int(use[j]), int(cnt[j])) for j in range(n_it) if cnt[j] > 0)
    if not pattern_fits(kind, dict(pat)):  # rounding safety: drop items until it fits
        d = dict(pat)
        while d and not pattern_fits(kind, d):
            j = min(d, key=lambda i: values[i])
            d[j] -= 1
            if d[j] == 0:
                del d[j]
        pat = tuple(sorted(d.items()))
    val = float(sum(values[i] * k for i, k in pat))
    return (val, pat, max(val, upper), clock) if with_bound else (val, pat)


# ------------------------------------------------------------------------------------ pattern pools
def seed_pool(instance: Instance) -> list[list[Pattern]]:
    pools: list[list[Pattern]] = []
    for kind in instance.kinds:
        pool: list[Pattern] = []
        for c in range(instance.n_comp):
            v = np.array([it.throughput_rps if it.comp == c else 0.0 for it in kind.items])
            if v.any():
                v = v / max(v.max(), 1e-12)
                fast = _dp_price(kind, v, grid=_GRID, optimistic=False)
                _, pat = fast if fast is not None else price_pattern(kind, v)
                if pat and pat not in pool:
                    pool.append(pat)
        # one replica of every component, if that fits: keeps small instances feasible
        mix: dict[int, int] = {}
        for c in range(instance.n_comp):
            for i in sorted(
                (i for i, it in enumerate(kind.items) if it.comp == c),
                key=lambda i: kind.items[i].utilization,
            ):
                mix[i] = 1
                if pattern_fits(kind, mix):
                    break
                del mix[i]
        if mix and tuple(sorted(mix.items())) not in pool:
            pool.append(tuple(sorted(mix.items())))
        pools.append(pool)
    return pools


def neighbour_columns(
    instance: Instance,
    cols: list[tuple[int, Pattern]],
    seen: set[tuple[int, Pattern]],
    z: np.ndarray,
    *,
    limit: int,
) -> int:
    """Add the patterns one swap (or one addition) away from those the integer solution uses.

    LP pricing only finds patterns the LP likes; the integer optimum often needs a near miss.
    """
    added = 0
    for j in np.flatnonzero(z > 0.5):
        kk, pat = cols[int(j)]
        kind = instance.kinds[kk]
        base = dict(pat)
        for drop in [None, *base]:
            cand = dict(base)
            if drop is not None:
                cand[drop] -= 1
                if not cand[drop]:
                    del cand[drop]
            for i in range(len(kind.items)):
                if i == drop:
                    continue
                cand[i] = cand.get(i, 0) + 1
                key = (kk, tuple(sorted(cand.items())))
                if key not in seen and pattern_fits(kind, cand):
                    if added >= limit:
                        return added
                    cols.append(key)
                    seen.add(key)
                    added += 1
                cand[i] -= 1
                if not cand[i]:
                    del cand[i]
    return added


def pattern_throughputs(
    instance: Instance, chosen: Sequence[Sequence[tuple[Pattern, int]]]
) -> tuple[float, ...]:
    """Throughput per component of ``chosen``: per kind, (pattern, devices running it)."""
    thr = [0.0] * instance.n_comp
    for kind, ch in zip(instance.kinds, chosen, strict=True):
        for pat, n in ch:
            for i, cnt in pat:
                thr[kind.items[i].comp] += n * cnt * kind.items[i].throughput_rps
    return tuple(thr)
