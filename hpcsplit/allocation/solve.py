"""ALLOCATE stage: from profiles and a cluster to replicas, slices and batch sizes per device.

``allocate(profiles, cluster, **options) -> Allocation`` maximises throughput leximin-fairly over the
components (normalised by optional demand weights), honouring per-device memory, utilization and
slice layouts exactly, with an optional latency SLO that restricts batch sizes.  Options
(``[Note: allocation options]`` in :mod:`hpcsplit.allocation.options`) become packing items; the
pattern master (:mod:`hpcsplit.allocation.patterns`) or, on small clusters, the per-device
formulation (:mod:`hpcsplit.allocation.device_solver`) runs the leximin stages
(:mod:`hpcsplit.allocation.leximin`); see docs/allocate.md.  The results are the dataclasses of
:mod:`hpcsplit.allocation.results`; plan checks and plots are in :mod:`hpcsplit.allocation.to_plan`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from hpcsplit.allocation import device_solver
from hpcsplit.allocation.leximin import Solution, _Infeasible
from hpcsplit.allocation.options import (
    as_profiles,
    build_instance,
    check_slots,
    component_options,
    cpu_deficit,
    merge_components,
    option_table,
    prune_dominated,
)
from hpcsplit.allocation.packing import Instance
from hpcsplit.allocation.patterns import solve_patterns
from hpcsplit.allocation.results import Allocation, Option, Replica
from hpcsplit.allocation.settings import AllocateSettings, build_settings
from hpcsplit.allocation.timeshare import FRONTEND_S_PER_REQUEST, add_timeshared_replicas
from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.plan import device_key
from hpcsplit.core.profile_format import ComponentProfile, Profile
from hpcsplit.core.settings import group_defaults
from hpcsplit.errors import AllocationError, AllocationInfeasibleError

__all__ = [
    "Allocation",
    "Option",
    "Replica",
    "allocate",
    "build_instance",
    "component_options",
    "prune_dominated",
]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ input checks
def _input_problems(
    comps: Mapping[str, ComponentProfile], profiles: list[Profile], cluster: ClusterSpec, s: AllocateSettings
) -> list[str]:
    """What the settings contradict in these profiles and this cluster (the settings alone are checked
    by :func:`~hpcsplit.allocation.settings.build_settings`)."""
    errs: list[str] = []
    names = list(comps)
    for p in profiles:
        kind = getattr(p.meta, "device_kind", cluster.device_kind)
        if kind != cluster.device_kind:
            way = (
                "choose a cluster with GPUs (cluster=perlmutter)"
                if kind == "cuda"
                else "re-profile on the GPUs (profile.device=cuda) or choose a CPU cluster (cluster=local)"
            )
            errs.append(
                f"profile of {p.meta.model!r} was measured on {kind} but cluster {cluster.name!r} is "
                f"{cluster.device_kind}: {way}"
            )
    w = s.demand_weights
    unknown = sorted(set(w) - set(names))
    if unknown:
        errs.append(f"demand_weights names {unknown}, which are not components; components are {names}")
    if names and all(w.get(c, 1.0) == 0 for c in names):
        errs.append("every demand weight is 0: give at least one component a positive weight")
    if isinstance(s.slo_ms, Mapping):
        unknown = sorted(set(s.slo_ms) - set(names))
        if unknown:
            errs.append(f"slo_ms names {unknown}, which are not components; components are {names}")
    fc = s.frontend_cores
    if fc >= cluster.cores_per_node and cluster.nodes == 1 and not cluster.is_gpu:
        errs.append(
            f"frontend_cores = {fc} leaves none of the node's {cluster.cores_per_node} cores for "
            "components: lower frontend_cores or set cluster.cores_per_node"
        )
    return errs


# ----------------------------------------------------------------------------------------- allocate
def allocate(
    profiles: Profile | Sequence[Profile],
    cluster: ClusterSpec | Mapping[str, Any],
    settings: AllocateSettings | None = None,
    *,
    frontend_s_per_request: float | None = None,
    **options: Any,
) -> Allocation:
    """Place replicas of every component on the cluster, leximin-fair in throughput.

    Parameters
    ----------
    profiles : Profile or sequence of Profile
        From :func:`hpcsplit.core.profile_format.read_profile`; several profiles are merged (distinct names).
    cluster : ClusterSpec or mapping
        The site (a mapping goes through :meth:`ClusterSpec.from_config`).
    settings : AllocateSettings, optional
        Every setting at once (the stage's); default ``conf/allocate/default.yaml``.
    frontend_s_per_request : float, optional
        The frontend's CPU seconds per request in the CPU time-sharing pass (a calibration's); default
        :data:`~hpcsplit.allocation.timeshare.FRONTEND_S_PER_REQUEST`.
    **options
        Settings laid over ``settings`` (keys of ``conf/allocate/default.yaml``; meanings there and in
        docs/allocate.md), e.g. ``demand_weights`` (component -> relative request rate; leximin runs on
        throughput / weight, a weight of 0 only asks for one replica), ``slo_ms`` (latency SLO per
        component batch at quantile ``slo_quantile``: a number for every component, or a mapping),
        ``solver`` and ``time_limit_s`` (cvxpy MILP solver; limit for the whole leximin solve),
        ``mode`` (auto | enumerate | generate | per-device).

    Returns
    -------
    Allocation

    Raises
    ------
    AllocationError
        Invalid or contradictory settings (every problem in one message), or a profile missing a
        batch size the SLO needs.
    AllocationInfeasibleError
        A component fits no slice, more components than slots, or no placement at all.

    Examples
    --------
    >>> from hpcsplit.allocation.synthetic import synthetic_cluster, synthetic_profile
    >>> al = allocate(synthetic_profile(2, seed=1), synthetic_cluster(2), time_limit_s=5)
    >>> sorted(al.throughput_rps) == ["c00", "c01"] and al.to_plan().world_size == len(al.replicas) + 1
    True
    """
    t0 = time.perf_counter()
    problems: list[str] = []
    if settings is None or options:
        base = settings.to_values() if settings is not None else group_defaults("allocate")
        settings, problems = build_settings({**base, **options})
    if not isinstance(cluster, ClusterSpec):
        cluster = ClusterSpec.from_config(cluster)
    plist = as_profiles(profiles)
    comps = merge_components(plist)
    problems += _input_problems(comps, plist, cluster, settings)
    if problems:
        raise AllocationError("allocate: contradictory or invalid settings:\n  - " + "\n  - ".join(problems))
    s = settings
    table = option_table(comps, cluster, s)
    names = list(table)
    weights = {c: float(s.demand_weights.get(c, 1.0)) for c in names}
    extra = cpu_deficit(table, cluster, s.frontend_cores) if s.cpu_oversubscribe else 0
    if extra:
        log.warning(
            "cluster %r: %d core(s) per node (%d kept for the frontend) cannot give each of the %d components a "
            "rank; oversubscribing node 0 by %d core(s): ranks will share cores and predicted throughputs are "
            "optimistic (set cluster.cores_per_node or allocate.cpu_oversubscribe=false)",
            cluster.name,
            cluster.cores_per_node,
            s.frontend_cores,
            len(names),
            extra,
        )
    instance, where = build_instance(table, cluster, weights, s, extra_cores_node0=extra)
    check_slots(instance, names, cluster, s.frontend_cores)
    sol = _solve(instance, table, cluster, s)
    alloc = _to_allocation(plist, cluster, table, instance, where, sol, weights, s, time.perf_counter() - t0)
    alloc.solve["oversubscribed_cores"] = extra
    if sol.clock_hit:  # [Note: deterministic limits] in hpcsplit.allocation.leximin
        more = f" and {len(sol.clock) - 2} more" if len(sol.clock) > 2 else ""
        msg = (f"a wall-clock limit stopped the search ({'; '.join(sol.clock[:2])}{more}): this plan may differ on a "
               f"faster or slower machine; raise allocate.stage_time_limit_s (now {s.stage_time_limit_s}) and "
               f"allocate.time_limit_s (now {s.time_limit_s:g}), or "
               + ("set allocate.stage_node_limit (the default 1000 is the same work on any machine)"
                  if s.stage_node_limit is None else f"lower allocate.stage_node_limit (now {s.stage_node_limit})"))
        alloc.solve["notes"].append(msg)
        log.warning("%s", msg)
    if extra:
        alloc.solve["notes"].append(
            f"node 0 oversubscribed by {extra} core(s): throughput predictions optimistic"
        )
        if s.cpu_timeshare and cluster.nodes == 1:  # (a node short of cores among several: not modelled)
            alloc = _timeshare(alloc, cluster, weights, s.cpu_mem_fraction,
                               FRONTEND_S_PER_REQUEST if frontend_s_per_request is None else frontend_s_per_request)
    if not alloc.replicas:  # never hand back an empty plan
        raise AllocationInfeasibleError(_infeasible_message(table, cluster, "no replica placed"))
    return alloc


def _solve(
    instance: Instance, table: Mapping[str, Sequence[Option]], cluster: ClusterSpec, s: AllocateSettings
) -> Solution:
    """The per-device formulation on small clusters (``mode=auto``) or when asked, else the pattern master."""
    stage_s = s.stage_time_limit_s or math.inf
    devices = sum(k.count for k in instance.kinds)
    try:
        if s.mode == "per-device" or (s.mode == "auto" and devices <= device_solver.PER_DEVICE_MAX):
            return device_solver.solve_per_device(
                instance,
                solver=s.solver,
                time_limit_s=s.time_limit_s,
                mip_rel_gap=s.mip_rel_gap,
                tol=s.leximin_tol,
                stage_time_limit_s=4 * stage_s,
                stage_node_limit=None if s.stage_node_limit is None else 4 * s.stage_node_limit,
                levels=s.leximin_levels,
            )
        return solve_patterns(
            instance,
            solver=s.solver,
            time_limit_s=s.time_limit_s,
            mip_rel_gap=s.mip_rel_gap,
            tol=s.leximin_tol,
            mode=s.mode,
            enumerate_limit=s.enumerate_limit,
            max_patterns=s.max_patterns,
            max_cg_iters=s.max_cg_iters,
            stage_time_limit_s=stage_s,
            stage_node_limit=s.stage_node_limit,
            levels=s.leximin_levels,
        )
    except _Infeasible as e:
        if "limit" in str(e):
            raise AllocationError(
                f"no placement found within the limits (stage 1 status {e}); raise allocate.stage_node_limit "
                f"(now {s.stage_node_limit}), allocate.time_limit_s (now {s.time_limit_s:g}) or "
                f"allocate.stage_time_limit_s (now {s.stage_time_limit_s}), or try allocate.solver=SCIPY"
            ) from e
        raise AllocationInfeasibleError(_infeasible_message(table, cluster, str(e))) from e
    except Exception as e:  # cvxpy / scipy failures
        if e.__class__.__module__.startswith(("cvxpy", "scipy")):
            raise AllocationError(f"solver {s.solver} failed: {e}; try allocate.solver=SCIPY or HIGHS") from e
        raise


def _timeshare(
    alloc: Allocation, cluster: ClusterSpec, weights: dict[str, float], mem_fraction: float, frontend_s: float
) -> Allocation:
    """Node 0's ranks share its cores: add replicas of the bottleneck while that pays (``_timeshare``)."""
    reps, ts = add_timeshared_replicas(
        alloc.replicas, weights, float(cluster.cores_per_node), cluster.mem_bytes_per_node * mem_fraction,
        frontend_s=frontend_s,
    )
    if ts is None:
        return alloc
    thr = {
        c: float(sum(r.option.throughput_rps for r in reps if r.option.component == c))
        for c in alloc.components
    }
    threads0 = sum(int(r.option.slice_size) for r in reps if r.node == 0)
    added_threads = threads0 - sum(int(r.option.slice_size) for r in alloc.replicas if r.node == 0)
    solve = dict(alloc.solve)
    solve["oversubscribed_cores"] = int(solve.get("oversubscribed_cores", 0)) + added_threads
    solve["notes"] = [*solve.get("notes", []), ts.note()]
    solve["timeshare"] = {
        "added": ts.added,
        "rate_before_rps": ts.rate_before,
        "rate_after_rps": ts.rate_after,
        "core_ceiling_rps": ts.core_ceiling,
        "frontend_us_per_request": frontend_s * 1e6,
    }
    log.info("%s", ts.note())
    util = dict(alloc.device_utilization)
    util[device_key(0, None)] = threads0 / cluster.cores_per_node
    return replace(
        alloc,
        replicas=tuple(reps),
        throughput_rps=thr,
        leximin=tuple(sorted(thr[c] / weights[c] for c in alloc.components if weights[c] > 0)),
        device_utilization=util,
        solve=solve,
    )


def _infeasible_message(table: Mapping[str, Sequence[Option]], cluster: ClusterSpec, status: str) -> str:
    need = {c: min(o.utilization for o in opts) for c, opts in table.items()}
    tot = sum(need.values())
    devices = cluster.total_gpus if cluster.is_gpu else cluster.nodes
    return (
        f"no placement gives every component a replica (solver: {status}). The components need at least "
        f"{tot:.2f} device(s) of utilization together ({', '.join(f'{c}: {u:.2f}' for c, u in need.items())}) "
        f"and the cluster has {devices} device(s); add nodes, raise allocate.util_limit, or relax slo_ms"
    )


def _to_allocation(
    plist: list[Profile],
    cluster: ClusterSpec,
    table: Mapping[str, Sequence[Option]],
    instance: Instance,
    where: list[list[tuple[int, int]]],
    sol: Solution,
    weights: dict[str, float],
    s: AllocateSettings,
    elapsed: float,
) -> Allocation:
    names = list(table)
    opt_of: dict[tuple[int, int, int], Option] = {}
    for c in names:
        for opt in table[c]:
            sizes = cluster.slices_gb if cluster.is_gpu else tuple(float(t) for t in cluster.cpu_threads)
            opt_of[(names.index(c), opt.batch_size, sizes.index(opt.slice_size))] = opt
    reps: list[Replica] = []
    util: dict[str, float] = {}
    for kind, chosen, devs in zip(instance.kinds, sol.chosen, where, strict=True):
        # patterns with more items first, so the busiest devices come first
        expanded = [
            pat for pat, n in sorted(chosen, key=lambda pn: -sum(k for _, k in pn[0])) for _ in range(n)
        ]
        for (node, gpu), pat in zip(devs, expanded, strict=False):
            items = sorted(
                ((kind.items[i], k) for i, k in pat),
                key=lambda t: (-kind.slice_sizes[t[0].slice_idx], t[0].comp),
            )
            slot = 0
            g = None if gpu < 0 else gpu
            for it, k in items:
                for _ in range(k):
                    reps.append(Replica(node, g, slot, opt_of[(it.comp, it.batch_size, it.slice_idx)]))
                    slot += 1
            util[device_key(node, g)] = float(sum(kind.items[i].utilization * k for i, k in pat))
    thr = {c: float(sol.throughput_rps[i]) for i, c in enumerate(names)}
    lex = tuple(sorted(thr[c] / weights[c] for c in names if weights[c] > 0))
    meta = plist[0].meta
    solve = {
        "solver": sol.solver,
        "mode": sol.mode,
        "solve_s": sol.solve_s,
        "total_s": elapsed,
        "gap": sol.gap,
        "max_gap": sol.max_gap,
        "limit_hit": sol.limit_hit,
        "clock_hit": sol.clock_hit,
        "clock": list(sol.clock),
        "n_patterns": sol.n_patterns,
        "stages": [
            {
                "k": st.k,
                "value": st.value,
                "bound": st.bound if math.isfinite(st.bound) else None,
                "status": st.status,
                "solve_s": st.solve_s,
            }
            for st in sol.stages
        ],
        "notes": list(sol.notes),
        "util_limit": s.util_limit,
        "slo_ms": s.slo_ms,
        "slo_quantile": s.slo_quantile,
        "cpu_mem_fraction": s.cpu_mem_fraction,
    }
    sha = getattr(meta, "switchboard_sha256", None)
    model = "+".join(dict.fromkeys(getattr(p.meta, "model", "model") for p in plist))
    return Allocation(
        model=model,
        switchboard_sha256=sha if len(plist) == 1 else None,
        cluster=cluster,
        components=tuple(names),
        weights=weights,
        replicas=tuple(reps),
        throughput_rps=thr,
        leximin=lex,
        device_utilization=util,
        solve=solve,
        frontend_cores=s.frontend_cores,
    )
