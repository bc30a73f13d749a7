"""The per-device formulation: the allocator's solver for small clusters.

Integer replica counts per device and option, with every per-device limit (utilization, slice layout
or capacity, ranks, CPU host memory) written for each device.  It is exact, but symmetric in the
devices, which makes MILP solvers slow beyond a few of them; the allocator therefore uses it in
``mode=auto`` only when a cluster has at most :data:`PER_DEVICE_MAX` devices (one CPU node, the local
and CI case: every pattern is then one device, and column generation's LP says little about it), and
in ``mode=per-device``.  Larger clusters go to the pattern master,
:func:`hpcsplit.allocation.patterns.solve_patterns`; the tests check that both agree.
"""

from __future__ import annotations

import math
import time

import numpy as np
import scipy.sparse as sp

from hpcsplit.allocation.leximin import Solution, _Base, _leximin
from hpcsplit.allocation.packing import Instance, Pattern, pattern_throughputs

__all__ = ["PER_DEVICE_MAX", "solve_per_device"]

PER_DEVICE_MAX = 2  # mode=auto: clusters with at most this many devices (GPUs, or CPU nodes)


def solve_per_device(
    instance: Instance,
    *,
    solver: str = "HIGHS",
    time_limit_s: float = 60.0,
    mip_rel_gap: float = 1e-6,
    tol: float = 1e-6,
    stage_time_limit_s: float = math.inf,
    stage_node_limit: int | None = None,
    levels: int | None = None,
) -> Solution:
    """Leximin over integer replica counts per device and item (small clusters: see the module).

    Raises
    ------
    _Infeasible
        When no integer solution gives every component a replica.
    """
    t0 = time.perf_counter()
    active = instance.active
    var_kind: list[tuple[int, int, int]] = []  # (kind, device, item) ; item -1 -> layout binaries
    rows: list[dict[int, float]] = []
    rhs: list[float] = []
    ub: list[float] = []
    for kk, kind in enumerate(instance.kinds):
        for dev in range(kind.count):
            first = len(var_kind)
            for i in range(len(kind.items)):
                var_kind.append((kk, dev, i))
                ub.append(kind.max_items)
            its = range(first, first + len(kind.items))
            rows.append({v: kind.items[v - first].utilization for v in its})
            rhs.append(kind.util_limit + 1e-9)
            rows.append(dict.fromkeys(its, 1.0))
            rhs.append(kind.max_items)
            if kind.shared_mem_bytes is not None:
                rows.append({v: kind.items[v - first].mem_bytes / kind.shared_mem_bytes for v in its})
                rhs.append(1.0 + 1e-12)
            if kind.layouts is None:
                rows.append({v: kind.slice_units[kind.items[v - first].slice_idx] for v in its})
                rhs.append(kind.capacity_units)
            else:
                lay0 = len(var_kind)
                for li in range(len(kind.layouts)):
                    var_kind.append((kk, dev, -1 - li))
                    ub.append(1.0)
                for s in range(len(kind.slice_sizes)):
                    r = {v: 1.0 for v in its if kind.items[v - first].slice_idx == s}
                    r.update({lay0 + li: -lay[s] for li, lay in enumerate(kind.layouts)})
                    rows.append(r)
                    rhs.append(0.0)
                rows.append({lay0 + li: 1.0 for li in range(len(kind.layouts))})
                rhs.append(1.0)
    n = len(var_kind)
    A = sp.lil_matrix((len(rows), n))
    for ri, r in enumerate(rows):
        for v, a in r.items():
            A[ri, v] = a
    Y = sp.lil_matrix((len(active), n))
    R = sp.lil_matrix((instance.n_comp, n))
    for v, (kk, _dev, i) in enumerate(var_kind):
        if i < 0:
            continue
        it = instance.kinds[kk].items[i]
        R[it.comp, v] = 1.0
        if instance.weights[it.comp] > 0:
            Y[active.index(it.comp), v] = it.throughput_rps / instance.weights[it.comp]
    base = _Base(
        A.tocsr(), np.array(rhs), np.zeros(n), np.array(ub, float), np.ones(n, bool), Y.tocsr(), R.tocsr()
    )
    clock: list[str] = []
    z, stages, hit = _leximin(
        instance,
        lambda: base,
        solver=solver,
        time_limit_s=time_limit_s,
        mip_rel_gap=mip_rel_gap,
        tol=tol,
        stage_time_limit_s=stage_time_limit_s,
        stage_node_limit=stage_node_limit,
        levels=levels,
        clock=clock,
    )
    chosen: list[list[tuple[Pattern, int]]] = [[] for _ in instance.kinds]
    per_dev: dict[tuple[int, int], dict[int, int]] = {}
    for v, (kk, dev, i) in enumerate(var_kind):
        if i >= 0 and z[v] > 0.5:
            per_dev.setdefault((kk, dev), {})[i] = round(z[v])
    for (kk, _dev), cnts in sorted(per_dev.items()):
        chosen[kk].append((tuple(sorted(cnts.items())), 1))
    return Solution(
        chosen=tuple(tuple(c) for c in chosen),
        throughput_rps=pattern_throughputs(instance, chosen),
        stages=tuple(stages),
        mode="per-device",
        solver=solver,
        solve_s=time.perf_counter() - t0,
        n_patterns=0,
        limit_hit=hit,
        clock=tuple(clock),
    )
