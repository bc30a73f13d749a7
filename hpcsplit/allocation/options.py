"""Allocation inputs: the profiles, options from them, SLO filtering, dominance, the solver instance.

[Note: allocation options]
An *option* is one way to run a replica: (component, batch size, cluster slice), with throughput
``batch / p50 latency``, peak memory and utilization taken from the profile.  A cluster slice uses
the profile column of the same size; when the profile lacks it, the largest profiled slice below
it (memory slices: also a larger one when the measured peak memory fits; never for MIG).  On CPU
the slices are thread counts, utilization is ``threads / cores_per_node`` and memory is shared by
the node (``cpu_mem_fraction`` of it).  Node 0 keeps ``frontend_cores`` cores for the frontend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import cast

import numpy as np

from hpcsplit.allocation import packing as _P
from hpcsplit.allocation.results import Option
from hpcsplit.allocation.settings import AllocateSettings
from hpcsplit.core.cluster import GIB, ClusterSpec
from hpcsplit.core.profile_format import ComponentProfile, Profile
from hpcsplit.errors import AllocationError, AllocationInfeasibleError

__all__ = [
    "as_profiles",
    "build_instance",
    "check_slots",
    "component_options",
    "cpu_deficit",
    "merge_components",
    "option_table",
    "prune_dominated",
]


# ------------------------------------------------------------------------------------------ profiles
def as_profiles(profiles: Profile | Sequence[Profile]) -> list[Profile]:
    """One profile or several as a non-empty list.

    Raises
    ------
    AllocationError
        When there is none.
    """
    out: list[Profile] = list(profiles) if isinstance(profiles, list | tuple) else [cast(Profile, profiles)]
    if not out:
        raise AllocationError(
            "allocate() got no profile; pass the Profile read by hpcsplit.read_profile(path)"
        )
    return out


def merge_components(profiles: Sequence[Profile]) -> dict[str, ComponentProfile]:
    """The components of every profile, by name.

    Raises
    ------
    AllocationError
        When two profiles name the same component, or there is no component at all.
    """
    comps: dict[str, ComponentProfile] = {}
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


# ------------------------------------------------------------------------------------------ options
def _usable_columns(cp: ComponentProfile, b: int) -> list[int]:
    """Profile slice columns measured, not out of memory and with a finite median at batch index b."""
    return [
        j
        for j, s in enumerate(cp.slices)
        if bool(cp.measured[b, j]) and not bool(cp.oom[b, j]) and math.isfinite(cp.latency_p50_ms(b, j))
    ]


def _pick_column(
    cp: ComponentProfile,
    b: int,
    s_target: float,
    slice_bytes: float | None,
    allow_larger: bool,
    usable: list[int] | None = None,
) -> int | None:
    """Profile slice column for a cluster slice (see ``[Note: allocation options]``)."""
    if usable is None:
        usable = _usable_columns(cp, b)
    exact = [j for j in usable if abs(cp.slices[j] - s_target) < 1e-6]
    if exact:
        return exact[0]
    below = [j for j in usable if cp.slices[j] < s_target]
    if below:
        return max(below, key=lambda j: cp.slices[j])
    if allow_larger and slice_bytes is not None:
        above = [j for j in usable if _mem(cp, b, j) <= slice_bytes]
        if above:
            return min(above, key=lambda j: cp.slices[j])
    return None


def _mem(cp: ComponentProfile, b: int, j: int) -> float:
    v = float(cp.peak_mem_bytes[b, j])
    return v if math.isfinite(v) else 0.0


def component_options(cp: ComponentProfile, cluster: ClusterSpec, *, slo_quantile: float) -> list[Option]:
    """Every usable (batch, cluster slice) option of one component, ignoring SLOs."""
    out: list[Option] = []
    sizes = cluster.slices_gb if cluster.is_gpu else tuple(float(t) for t in cluster.cpu_threads)
    for b, batch in enumerate(cp.batch_sizes):
        usable = _usable_columns(cp, b)
        for size in sizes:
            sb = size * GIB if cluster.is_gpu else None
            j = _pick_column(
                cp, b, size, sb, allow_larger=cluster.is_gpu and not cluster.mig_profiles, usable=usable
            )
            if j is None:
                continue
            mem = _mem(cp, b, j)
            if sb is not None and mem > sb:
                continue
            if cluster.is_gpu:
                u = float(cp.utilization[b, j])
                util = u if math.isfinite(u) else 1.0  # unknown: assume it needs the whole GPU
            else:
                util = size / cluster.cores_per_node
            thr = float(cp.throughput_rps(b, j))
            if not (math.isfinite(thr) and thr > 0):
                continue
            lat = float(cp.latency_quantile_ms(b, j, slo_quantile))
            out.append(Option(cp.name, int(batch), float(size), float(cp.slices[j]), thr, lat, mem, util))
    return out


def option_table(
    comps: Mapping[str, ComponentProfile], cluster: ClusterSpec, settings: AllocateSettings
) -> dict[str, list[Option]]:
    """Per component, its usable options under ``util_limit`` and the SLO, dominated ones dropped.

    Raises
    ------
    AllocationInfeasibleError
        A component fits no slice, is above ``util_limit`` on its own or cannot meet its SLO.
    AllocationError
        An SLO needs a batch size below the profiled ones.
    """
    table: dict[str, list[Option]] = {}
    errs: list[AllocationError] = []
    unit = "GB" if cluster.is_gpu else "threads"
    for name, cp in comps.items():
        opts = component_options(cp, cluster, slo_quantile=settings.slo_quantile)
        if not opts:
            errs.append(AllocationInfeasibleError(_no_slice_message(name, cp, cluster, unit)))
            continue
        fits = [x for x in opts if x.utilization <= settings.util_limit + 1e-9]
        if not fits:
            lo = min(opts, key=lambda x: x.utilization)
            errs.append(
                AllocationInfeasibleError(
                    f"component {name!r} fits no GPU: its lowest utilization is {lo.utilization:.0%} (batch "
                    f"{lo.batch_size}, {lo.slice_size:g} {unit}) above util_limit {settings.util_limit:.0%}; "
                    "raise allocate.util_limit or re-partition this component into smaller ones"
                )
            )
            continue
        slo = settings.slo_of(name)
        if slo is not None:
            ok = [x for x in fits if x.latency_ms <= slo]
            if not ok:
                fastest = min(fits, key=lambda x: x.latency_ms)
                smallest = min(cp.batch_sizes)
                if smallest > 1:
                    errs.append(
                        AllocationError(
                            f"component {name!r}: the latency SLO {slo:g} ms needs a batch size below the profiled "
                            f"ones: its smallest profiled batch {smallest} takes {fastest.latency_ms:.3g} ms "
                            f"(q={settings.slo_quantile}); profile smaller batches (profile.batch_sizes=[1, ...]) "
                            "or raise allocate.slo_ms"
                        )
                    )
                else:
                    errs.append(
                        AllocationInfeasibleError(
                            f"component {name!r} cannot meet the latency SLO {slo:g} ms: its fastest option "
                            f"(batch {fastest.batch_size}, {fastest.slice_size:g} {unit}) takes "
                            f"{fastest.latency_ms:.3g} ms (q={settings.slo_quantile}); raise allocate.slo_ms to at "
                            f"least {math.ceil(fastest.latency_ms * 100) / 100:g} or split the component further"
                        )
                    )
                continue
            fits = ok
        table[name] = prune_dominated(fits)
    if errs:
        if len(errs) == 1:
            raise errs[0]
        cls = (
            AllocationInfeasibleError
            if all(isinstance(e, AllocationInfeasibleError) for e in errs)
            else AllocationError
        )
        raise cls("\n".join(str(e) for e in errs))
    return table


def _no_slice_message(name: str, cp: ComponentProfile, cluster: ClusterSpec, unit: str) -> str:
    meas = np.asarray(cp.measured, bool) & ~np.asarray(cp.oom, bool)
    if not meas.any():
        big = max(cp.slices) if cp.slices else 0
        return (
            f"component {name!r} fits no slice: it ran out of memory at every profiled batch size (smallest "
            f"{min(cp.batch_sizes)}) even in the largest profiled slice ({big:g} {unit}; parameters "
            f"{cp.param_bytes / GIB:.2f} GB); add a larger slice to cluster.slices_gb (up to gpu_mem_gb = "
            f"{cluster.gpu_mem_gb:g}) and profile it, or split the component further"
        )
    mems = np.where(meas, np.nan_to_num(np.asarray(cp.peak_mem_bytes, float), nan=0.0), np.inf)
    need = float(mems.min()) / GIB
    have = list(cluster.slices_gb if cluster.is_gpu else cluster.cpu_threads)
    if cluster.is_gpu:
        return (
            f"component {name!r} fits no slice: it needs at least {need:.2f} GB (smallest batch) but the "
            f"cluster's slices are {have} GB and the profile measured slices {list(cp.slices)}; add a larger "
            "slice to cluster.slices_gb (up to gpu_mem_gb) or split the component further"
        )
    return (
        f"component {name!r} fits no thread count: the profile measured threads {list(cp.slices)} and the "
        f"cluster allows cpu_threads {have}; profile with those thread counts (profile.threads) or change "
        "cluster.cpu_threads"
    )


# ------------------------------------------------------------------------------------- device kinds
def _units(sizes: Sequence[float], capacity: float) -> tuple[tuple[int, ...], int]:
    fr = [Fraction(s).limit_denominator(1000) for s in sizes]
    den = math.lcm(*(f.denominator for f in fr))
    nums = [int(f * den) for f in fr]
    g = math.gcd(*nums)
    unit = Fraction(g, den)
    return tuple(int(f / unit) for f in fr), int(Fraction(capacity).limit_denominator(1000) / unit)


def prune_dominated(opts: Sequence[Option]) -> list[Option]:
    """Drop options another option of the same component and slice beats in every figure.

    j dominates i when ``throughput_j >= throughput_i``, ``utilization_j <= utilization_i`` and
    ``mem_j <= mem_i``: swapping i for j in any placement keeps it valid and loses nothing, so
    the optimum is unchanged (ties keep the smaller batch, i.e. the lower latency).
    """
    keep: list[Option] = []
    for i, a in enumerate(opts):
        dominated = False
        for j, b in enumerate(opts):
            if i == j or b.component != a.component or b.slice_size != a.slice_size:
                continue
            no_worse = (
                b.throughput_rps >= a.throughput_rps
                and b.utilization <= a.utilization
                and b.mem_bytes <= a.mem_bytes
            )
            better = (
                b.throughput_rps > a.throughput_rps
                or b.utilization < a.utilization
                or b.mem_bytes < a.mem_bytes
                or (b.batch_size, j) < (a.batch_size, i)
            )
            if no_worse and better:
                dominated = True
                break
        if not dominated:
            keep.append(a)
    return keep


def _items(
    table: Mapping[str, Sequence[Option]],
    names: Sequence[str],
    idx: Mapping[str, int],
    sizes: tuple[float, ...],
) -> tuple[_P.Item, ...]:
    """Every usable (component, batch, slice) option as a packing item, slices indexed into ``sizes``."""
    return tuple(
        _P.Item(
            idx[o.component],
            o.batch_size,
            sizes.index(o.slice_size),
            o.throughput_rps,
            o.utilization,
            o.mem_bytes,
            o.latency_ms,
        )
        for c in names
        for o in table[c]
    )


def build_instance(
    table: Mapping[str, Sequence[Option]],
    cluster: ClusterSpec,
    weights: Mapping[str, float],
    settings: AllocateSettings,
    *,
    extra_cores_node0: int = 0,
) -> tuple[_P.Instance, list[list[tuple[int, int]]]]:
    """The solver's instance, and per device kind the ``(node, gpu or -1)`` of its devices in order.

    ``settings`` gives ``util_limit``, ``frontend_cores``, ``max_ranks_per_gpu`` and ``cpu_mem_fraction``;
    ``extra_cores_node0`` oversubscribes CPU node 0 (see :func:`cpu_deficit`).
    """
    util_limit, frontend_cores = settings.util_limit, settings.frontend_cores
    max_ranks_per_gpu, cpu_mem_fraction = settings.max_ranks_per_gpu, settings.cpu_mem_fraction
    names = list(table)
    idx = {c: i for i, c in enumerate(names)}
    w = tuple(float(weights.get(c, 1.0)) for c in names)
    kinds: list[_P.DeviceKind] = []
    where: list[list[tuple[int, int]]] = []
    if cluster.is_gpu:
        sizes = cluster.slices_gb
        units, cap = _units(sizes, cluster.gpu_mem_gb)
        layouts = None
        if cluster.slice_layouts:
            layouts = tuple(
                tuple(sum(1 for x in lay if abs(x - s) < 1e-9) for s in sizes)
                for lay in cluster.slice_layouts
            )
        per_gpu = max(1, (cluster.cores_per_node - frontend_cores) // cluster.gpus_per_node)
        if max_ranks_per_gpu:
            per_gpu = int(max_ranks_per_gpu)
        items = _items(table, names, idx, sizes)
        kinds.append(
            _P.DeviceKind("gpu", cluster.total_gpus, sizes, units, cap, util_limit, per_gpu, items, layouts)
        )
        where.append([(n, g) for n in range(cluster.nodes) for g in range(cluster.gpus_per_node)])
    else:
        sizes = tuple(float(t) for t in cluster.cpu_threads)
        items = _items(table, names, idx, sizes)
        mem = cluster.mem_bytes_per_node * cpu_mem_fraction
        units = tuple(int(t) for t in cluster.cpu_threads)
        cap0 = cluster.cores_per_node - frontend_cores + extra_cores_node0
        if cap0 > 0:
            # on CPU the thread budget is the limit (utilization = threads / cores says the same)
            kinds.append(_P.DeviceKind("cpu-node0", 1, sizes, units, cap0, math.inf, cap0, items, None, mem))
            where.append([(0, -1)])
        if cluster.nodes > 1:
            cap = cluster.cores_per_node
            kinds.append(
                _P.DeviceKind("cpu", cluster.nodes - 1, sizes, units, cap, math.inf, cap, items, None, mem)
            )
            where.append([(n, -1) for n in range(1, cluster.nodes)])
    return _P.Instance(len(names), w, tuple(kinds)), where


def _max_slots(kind: _P.DeviceKind) -> int:
    if kind.layouts is not None:
        per = max(sum(lay) for lay in kind.layouts)
    else:
        per = kind.capacity_units // min(kind.slice_units)
    return kind.count * min(per, kind.max_items)


def cpu_deficit(table: Mapping[str, Sequence[Option]], cluster: ClusterSpec, frontend_cores: int) -> int:
    """Cores missing on a CPU cluster for one smallest rank per component (0 when they fit)."""
    if cluster.is_gpu:
        return 0
    need = sum(min(int(o.slice_size) for o in opts) for opts in table.values())
    have = max(0, cluster.cores_per_node - frontend_cores) + (cluster.nodes - 1) * cluster.cores_per_node
    return max(0, need - have)


def check_slots(instance: _P.Instance, names: list[str], cluster: ClusterSpec, frontend_cores: int) -> None:
    slots = sum(_max_slots(k) for k in instance.kinds)
    if slots >= len(names):
        return
    if cluster.is_gpu:
        what = (
            f"{cluster.total_gpus} GPU(s) x at most {_max_slots(instance.kinds[0]) // max(1, cluster.total_gpus)} "
            f"slice(s) of {min(cluster.slices_gb):g} GB"
        )
        way = "add nodes (cluster.nodes), allow smaller slices (cluster.slices_gb), or partition into fewer components"
    else:
        what = (
            f"{cluster.nodes} node(s) x {cluster.cores_per_node} cores, {frontend_cores} kept for the frontend, "
            f"at least {min(cluster.cpu_threads)} thread(s) per rank"
        )
        way = (
            "set cluster.cores_per_node higher (oversubscribe), allocate.frontend_cores=0, add nodes, "
            "or partition into fewer components"
        )
    raise AllocationInfeasibleError(
        f"{len(names)} components {names} but only {slots} slot(s) for replicas: {what}; {way}"
    )
