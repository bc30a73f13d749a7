"""ALLOCATE stage: from profiles and a cluster to replicas, slices and batch sizes per device.

``allocate(profiles, cluster, ...) -> Allocation`` maximises throughput leximin-fairly over the
components (normalised by optional demand weights), honouring per-device memory, utilization and
slice layouts exactly, with an optional latency SLO that restricts batch sizes.  The formulation
(packing patterns, column generation, Ogryczak leximin stages) lives in :mod:`hpcsplit._patterns`
and docs/allocate.md; plans, validation and plots in :mod:`hpcsplit._allocate_plan`.

[Note: allocation options]
An *option* is one way to run a replica: (component, batch size, cluster slice), with throughput
``batch / p50 latency``, peak memory and utilization taken from the profile.  A cluster slice uses
the profile column of the same size; when the profile lacks it, the largest profiled slice below
it (memory slices: also a larger one when the measured peak memory fits; never for MIG).  On CPU
the slices are thread counts, utilization is ``threads / cores_per_node`` and memory is shared by
the node (``cpu_mem_fraction`` of it).  Node 0 keeps ``frontend_cores`` cores for the frontend.
"""

from __future__ import annotations

import logging
import math
import sys as _sys
import time
import types as _types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hpcsplit import _patterns as _P
from hpcsplit._allocate_options import (
    Option,
    _check_slots,
    _cpu_deficit,
    _options,
    build_instance,
    component_options,
    prune_dominated,
)
from hpcsplit.cluster import ClusterSpec
from hpcsplit.errors import AllocationError, AllocationInfeasibleError

__all__ = [
    "Allocation",
    "Option",
    "Replica",
    "allocate",
    "build_instance",
    "component_options",
    "prune_dominated",
    "run_allocate",
]

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "solver": "HIGHS",
    "time_limit_s": 30.0,
    "mip_rel_gap": 1e-4,
    "leximin_tol": 1e-6,
    "slo_ms": None,
    "slo_quantile": 0.99,
    "demand_weights": {},
    "util_limit": 1.0,
    "frontend_cores": 1,
    "max_ranks_per_gpu": None,
    "cpu_mem_fraction": 0.9,
    "mode": "auto",
    "enumerate_limit": 3000,
    "max_patterns": 5000,
    "max_cg_iters": 200,
    "stage_time_limit_s": 0.5,
    "leximin_levels": None,
    "cpu_oversubscribe": True,
    "cpu_timeshare": True,
}


@dataclass(frozen=True, slots=True)
class Replica:
    """One placed replica: where it runs and what it predicts."""

    node: int
    gpu: int | None
    slot: int
    option: Option


@dataclass(frozen=True, slots=True)
class Allocation:
    """The allocator's answer: replicas per device and predicted figures."""

    model: str
    switchboard_sha256: str | None
    cluster: ClusterSpec
    components: tuple[str, ...]
    weights: dict[str, float]
    replicas: tuple[Replica, ...]
    throughput_rps: dict[str, float]
    leximin: tuple[float, ...]  # sorted throughput / weight of weighted components
    device_utilization: dict[str, float]
    solve: dict[str, Any] = field(default_factory=dict)
    frontend_cores: int = 1

    @property
    def min_normalised_throughput(self) -> float:
        return self.leximin[0] if self.leximin else 0.0

    def to_plan(self) -> Any:
        """The :class:`~hpcsplit.runtime.plan.Plan` (rank 0 frontend, then replicas by node/GPU/slot)."""
        from hpcsplit._allocate_plan import allocation_to_plan

        return allocation_to_plan(self)

    def summary(self) -> str:
        """A few readable lines: throughput per component, replicas, solve figures."""
        s = self.solve
        lines = [
            f"allocation on {self.cluster.name} ({self.cluster.device_kind}, {self.cluster.nodes} node(s)): "
            f"{len(self.replicas)} replicas, solver {s.get('solver')} ({s.get('mode')}), "
            f"{s.get('solve_s', 0):.2f} s, gap {s.get('gap', 0):.2%}"
            + (" [time limit hit]" if s.get("time_limit_hit") else ""),
        ]
        for c in self.components:
            n = sum(1 for r in self.replicas if r.option.component == c)
            w = self.weights.get(c, 1.0)
            lines.append(f"  {c:<24} {self.throughput_rps[c]:>12.1f} req/s  weight {w:g}  {n} replica(s)")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------ input checks
def _as_profiles(profiles: Any) -> list[Any]:
    if isinstance(profiles, list | tuple):
        out = list(profiles)
    else:
        out = [profiles]
    if not out:
        raise AllocationError(
            "allocate() got no profile; pass the Profile read by hpcsplit.read_profile(path)"
        )
    return out


def _merge_components(profiles: list[Any]) -> dict[str, Any]:
    comps: dict[str, Any] = {}
    for p in profiles:
        for name, cp in p.components.items():
            if name in comps:
                raise AllocationError(
                    f"component {name!r} appears in two profiles; allocate models with distinct component "
                    "names (re-export one with another model name) or pass one profile"
                )
            comps[name] = cp
    if not comps:
        raise AllocationError("the profile has no components; profile the switchboard first")
    return comps


def _check_config(
    comps: Mapping[str, Any], profiles: list[Any], cluster: ClusterSpec, o: dict[str, Any]
) -> None:
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
    w = o["demand_weights"] or {}
    unknown = sorted(set(w) - set(names))
    if unknown:
        errs.append(f"demand_weights names {unknown}, which are not components; components are {names}")
    bad = {k: v for k, v in w.items() if not (isinstance(v, int | float) and v >= 0 and math.isfinite(v))}
    if bad:
        errs.append(f"demand_weights {bad}: weights must be finite numbers >= 0")
    if names and all(float(w.get(c, 1.0)) == 0 for c in names if c not in bad):
        errs.append("every demand weight is 0: give at least one component a positive weight")
    slo = o["slo_ms"]
    if isinstance(slo, Mapping):
        unknown = sorted(set(slo) - set(names))
        if unknown:
            errs.append(f"slo_ms names {unknown}, which are not components; components are {names}")
        if any(v is not None and not (isinstance(v, int | float) and v > 0) for v in slo.values()):
            errs.append(f"slo_ms {dict(slo)}: each SLO must be a positive number of ms (or null)")
    elif slo is not None and not (isinstance(slo, int | float) and slo > 0):
        errs.append(f"slo_ms = {slo!r}: give a positive latency in ms, a mapping component -> ms, or null")
    if not 0 < float(o["slo_quantile"]) <= 1:
        errs.append(f"slo_quantile = {o['slo_quantile']}, needs 0 < q <= 1 (0.5: median, 0.99: p99)")
    if not float(o["util_limit"]) > 0:
        errs.append(f"util_limit = {o['util_limit']}, needs > 0 (1.0: the whole GPU)")
    if not float(o["time_limit_s"]) > 0:
        errs.append(f"time_limit_s = {o['time_limit_s']}, needs > 0")
    fc = o["frontend_cores"]
    if not isinstance(fc, int) or fc < 0:
        errs.append(f"frontend_cores = {fc!r}, needs an integer >= 0")
    elif fc >= cluster.cores_per_node and cluster.nodes == 1 and not cluster.is_gpu:
        errs.append(
            f"frontend_cores = {fc} leaves none of the node's {cluster.cores_per_node} cores for "
            "components: lower frontend_cores or set cluster.cores_per_node"
        )
    if o["mode"] not in ("auto", "enumerate", "generate", "per-device"):
        errs.append(f"mode = {o['mode']!r}, needs one of auto, enumerate, generate, per-device")
    import cvxpy as cp

    if o["solver"] not in cp.installed_solvers():
        mip = [
            s
            for s in ("HIGHS", "SCIPY", "SCIP", "GUROBI", "CPLEX", "CBC", "GLPK_MI")
            if s in cp.installed_solvers()
        ]
        errs.append(f"solver {o['solver']!r} is not installed; MILP solvers here: {mip}")
    if errs:
        raise AllocationError("allocate: contradictory or invalid settings:\n  - " + "\n  - ".join(errs))


# ----------------------------------------------------------------------------------------- allocate
def allocate(
    profiles: Any,
    cluster: ClusterSpec | Mapping[str, Any],
    *,
    demand_weights: Mapping[str, float] | None = None,
    slo_ms: float | Mapping[str, float] | None = None,
    solver: str = "HIGHS",
    time_limit_s: float = 30.0,
    **options: Any,
) -> Allocation:
    """Place replicas of every component on the cluster, leximin-fair in throughput.

    Parameters
    ----------
    profiles : Profile or sequence of Profile
        From :func:`hpcsplit.profile_io.read_profile`; several profiles are merged (distinct names).
    cluster : ClusterSpec or mapping
        The site (a mapping goes through :meth:`ClusterSpec.from_config`).
    demand_weights : mapping, optional
        Component -> relative request rate (default 1).  Leximin runs on throughput / weight; a
        weight of 0 only asks for one replica.
    slo_ms : float or mapping, optional
        Latency SLO per component batch (ms, at quantile ``slo_quantile``): options slower than
        it are not used.  A number applies to every component.
    solver, time_limit_s
        cvxpy MILP solver and the time limit for the whole leximin solve.
    **options
        ``stage_time_limit_s``, ``mip_rel_gap``, ``leximin_tol``, ``leximin_levels``, ``slo_quantile``,
        ``util_limit``, ``frontend_cores``, ``max_ranks_per_gpu``, ``cpu_mem_fraction``,
        ``cpu_oversubscribe``, ``mode`` (auto | enumerate | generate), ``enumerate_limit``,
        ``max_patterns``, ``max_cg_iters`` (see conf/allocate/default.yaml and docs/allocate.md).

    Returns
    -------
    Allocation

    Raises
    ------
    AllocationError
        Invalid or contradictory settings, or a profile missing a batch size the SLO needs.
    AllocationInfeasibleError
        A component fits no slice, more components than slots, or no placement at all.
    """
    t0 = time.perf_counter()
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise AllocationError(f"allocate() got unknown options {unknown}; valid: {sorted(DEFAULTS)}")
    o = dict(DEFAULTS)
    o.update(options)
    o.update(
        solver=str(solver).upper(),
        time_limit_s=float(time_limit_s),
        slo_ms=slo_ms,
        demand_weights=dict(demand_weights or {}),
    )
    if not isinstance(cluster, ClusterSpec):
        cluster = ClusterSpec.from_config(cluster)
    plist = _as_profiles(profiles)
    comps = _merge_components(plist)
    _check_config(comps, plist, cluster, o)
    table = _options(comps, cluster, o)
    names = list(table)
    weights = {c: float(o["demand_weights"].get(c, 1.0)) for c in names}
    extra = _cpu_deficit(table, cluster, int(o["frontend_cores"])) if o["cpu_oversubscribe"] else 0
    if extra:
        log.warning(
            "cluster %r: %d core(s) per node (%d kept for the frontend) cannot give each of the %d components a "
            "rank; oversubscribing node 0 by %d core(s): ranks will share cores and predicted throughputs are "
            "optimistic (set cluster.cores_per_node or allocate.cpu_oversubscribe=false)",
            cluster.name,
            cluster.cores_per_node,
            int(o["frontend_cores"]),
            len(names),
            extra,
        )
    instance, where = build_instance(
        table,
        cluster,
        weights,
        util_limit=float(o["util_limit"]),
        frontend_cores=int(o["frontend_cores"]),
        max_ranks_per_gpu=o["max_ranks_per_gpu"],
        cpu_mem_fraction=float(o["cpu_mem_fraction"]),
        extra_cores_node0=extra,
    )
    _check_slots(instance, names, cluster, int(o["frontend_cores"]))
    from hpcsplit import _patterns_ref

    stage_s = float(o["stage_time_limit_s"] or math.inf)
    devices = sum(k.count for k in instance.kinds)
    try:
        if o["mode"] == "per-device" or (o["mode"] == "auto" and devices <= _patterns_ref.PER_DEVICE_MAX):
            sol = _patterns_ref.solve_per_device(
                instance,
                solver=o["solver"],
                time_limit_s=o["time_limit_s"],
                mip_rel_gap=float(o["mip_rel_gap"]),
                tol=float(o["leximin_tol"]),
                stage_time_limit_s=4 * stage_s,
                levels=o["leximin_levels"],
            )
        else:
            sol = _P.solve_patterns(
                instance,
                solver=o["solver"],
                time_limit_s=o["time_limit_s"],
                mip_rel_gap=float(o["mip_rel_gap"]),
                tol=float(o["leximin_tol"]),
                mode=o["mode"],
                enumerate_limit=int(o["enumerate_limit"]),
                max_patterns=int(o["max_patterns"]),
                max_cg_iters=int(o["max_cg_iters"]),
                stage_time_limit_s=stage_s,
                levels=o["leximin_levels"],
            )
    except _P._Infeasible as e:
        if "limit" in str(e):
            raise AllocationError(
                f"no placement found within the time limit (stage 1 status {e}); raise allocate.time_limit_s "
                f"(now {o['time_limit_s']:g}) or allocate.stage_time_limit_s (now {o['stage_time_limit_s']}), "
                "or try allocate.solver=SCIPY"
            ) from e
        raise AllocationInfeasibleError(_infeasible_message(table, cluster, str(e))) from e
    except Exception as e:  # cvxpy / scipy failures
        if e.__class__.__module__.startswith(("cvxpy", "scipy")):
            raise AllocationError(
                f"solver {o['solver']} failed: {e}; try allocate.solver=SCIPY or HIGHS"
            ) from e
        raise
    alloc = _to_allocation(plist, cluster, table, instance, where, sol, weights, o, time.perf_counter() - t0)
    alloc.solve["oversubscribed_cores"] = extra
    if extra:
        alloc.solve["notes"].append(
            f"node 0 oversubscribed by {extra} core(s): throughput predictions optimistic"
        )
        if o["cpu_timeshare"] and cluster.nodes == 1:  # (a node short of cores among several: not modelled)
            alloc = _timeshare(alloc, cluster, weights, float(o["cpu_mem_fraction"]))
    if not alloc.replicas:  # never hand back an empty plan
        raise AllocationInfeasibleError(_infeasible_message(table, cluster, "no replica placed"))
    return alloc


def _timeshare(alloc: Allocation, cluster: ClusterSpec, weights: dict[str, float], mem_fraction: float) -> Allocation:
    """Node 0's ranks share its cores: add replicas of the bottleneck while that pays (``_timeshare``)."""
    from hpcsplit._timeshare import add_timeshared_replicas

    reps, ts = add_timeshared_replicas(
        alloc.replicas, weights, float(cluster.cores_per_node), cluster.mem_bytes_per_node * mem_fraction
    )
    if ts is None:
        return alloc
    thr = {c: float(sum(r.option.throughput_rps for r in reps if r.option.component == c)) for c in alloc.components}
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
    }
    log.info("%s", ts.note())
    util = dict(alloc.device_utilization)
    from hpcsplit.runtime.plan import device_key

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
    plist: list[Any],
    cluster: ClusterSpec,
    table: Mapping[str, Sequence[Option]],
    instance: _P.Instance,
    where: list[list[tuple[int, int]]],
    sol: _P.Solution,
    weights: dict[str, float],
    o: dict[str, Any],
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
    from hpcsplit.runtime.plan import device_key

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
        "time_limit_hit": sol.time_limit_hit,
        "n_patterns": sol.n_patterns,
        "stages": [
            {
                "k": s.k,
                "value": s.value,
                "bound": s.bound if math.isfinite(s.bound) else None,
                "status": s.status,
                "solve_s": s.solve_s,
            }
            for s in sol.stages
        ],
        "notes": list(sol.notes),
        "util_limit": float(o["util_limit"]),
        "slo_ms": o["slo_ms"],
        "slo_quantile": float(o["slo_quantile"]),
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
        frontend_cores=int(o["frontend_cores"]),
    )


# ------------------------------------------------------------------------------------------- stage
def run_allocate(cfg: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """``python -m hpcsplit stage=allocate profile=PATH cluster=NAME``: write the plan and its PNG.

    The profile comes from ``cfg['profile']['path']`` (a path or a list of paths) or
    ``run_dir / cfg['paths']['profile_filename']``; the plan goes to
    ``run_dir / cfg['paths']['plan_filename']`` with ``plan.png`` beside it.
    """
    from hpcsplit._allocate_plan import plot_plan
    from hpcsplit.profile_io import read_profile

    run_dir = Path(run_dir)
    paths = cfg.get("paths") or {}
    src = (cfg.get("profile") or {}).get("path") or run_dir / paths.get("profile_filename", "profile.h5")
    srcs = [Path(p) for p in (src if isinstance(src, list | tuple) else [src])]
    profiles = [read_profile(p) for p in srcs]
    cluster = ClusterSpec.from_config(cfg.get("cluster") or {})
    acfg = dict(cfg.get("allocate") or {})
    o = {k: acfg[k] for k in DEFAULTS if k in acfg}
    unknown = sorted(set(acfg) - set(DEFAULTS))
    if unknown:
        raise AllocationError(f"allocate config has unknown keys {unknown}; valid: {sorted(DEFAULTS)}")
    solver = o.pop("solver", DEFAULTS["solver"])
    tl = o.pop("time_limit_s", DEFAULTS["time_limit_s"])
    weights = o.pop("demand_weights", None)
    slo = o.pop("slo_ms", None)
    alloc = allocate(
        profiles, cluster, demand_weights=weights, slo_ms=slo, solver=solver, time_limit_s=tl, **o
    )
    plan = alloc.to_plan()
    plan_path = plan.save(run_dir / paths.get("plan_filename", "plan.json"))
    png = plot_plan(plan, run_dir / "plan.png")
    log.info("%s", alloc.summary())
    log.info("plan written to %s\n%s", plan_path, plan.format())
    return {
        "plan": str(plan_path),
        "plot": str(png) if png else None,
        "world_size": plan.world_size,
        "throughput_rps": alloc.throughput_rps,
        "min_normalised_throughput": alloc.min_normalised_throughput,
        "solve_s": alloc.solve.get("solve_s"),
        "gap": alloc.solve.get("gap"),
        "time_limit_hit": alloc.solve.get("time_limit_hit"),
        "solver": alloc.solve.get("solver"),
    }


# [Note: callable stage modules]
# `hpcsplit.allocate` is both this module and the public function of the same name. Once the module
# has been imported, the package attribute `hpcsplit.allocate` is the module, so we make the module
# callable: `hpcsplit.allocate(profiles, cluster)` works whatever was imported first.
class _CallableModule(_types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Allocation:
        return allocate(*args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
