"""An allocation's plan checked against the profiles and the cluster, and its PNG.

:meth:`hpcsplit.allocation.results.Allocation.to_plan` unfolds an allocation into a
:class:`~hpcsplit.core.plan.Plan`; :func:`validate_plan` recomputes every figure of a plan from the
profiles (the tests call it on every plan they make), :func:`plot_plan` draws devices x slices.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcsplit.allocation.options import as_profiles, component_options, merge_components
from hpcsplit.core.cluster import GIB, ClusterSpec
from hpcsplit.core.plan import Plan, RankEntry, device_key
from hpcsplit.core.profile_format import Profile
from hpcsplit.core.settings import group_defaults
from hpcsplit.errors import PlanError

__all__ = ["plan_problems", "plot_plan", "validate_plan"]


def plan_problems(
    plan: Plan,
    profiles: Profile | Sequence[Profile],
    cluster: ClusterSpec | Mapping[str, Any],
    *,
    util_limit: float | None = None,
    frontend_cores: int | None = None,
    cpu_mem_fraction: float | None = None,
) -> list[str]:
    """Every way the plan breaks memory, utilization, layouts or core budgets (empty when valid).

    Figures are recomputed from the profiles, not taken from the plan.  The limits not given come
    from the plan's ``meta`` (what the allocator used), else from ``conf/allocate/default.yaml``.
    """
    if not isinstance(cluster, ClusterSpec):
        cluster = ClusterSpec.from_config(cluster)
    comps = merge_components(as_profiles(profiles))
    meta = plan.meta or {}
    solve = meta.get("solve", {})
    known = {**solve, "frontend_cores": meta.get("frontend_cores")}
    used = {k: v for k, v in known.items() if v is not None}
    if not {"util_limit", "slo_quantile", "frontend_cores", "cpu_mem_fraction"} <= set(used):
        used = {**group_defaults("allocate"), **used}  # a plan written without them
    ulim = float(util_limit if util_limit is not None else used["util_limit"])
    q = float(used["slo_quantile"])
    fcores = int(frontend_cores if frontend_cores is not None else used["frontend_cores"])
    mem_fraction = float(cpu_mem_fraction if cpu_mem_fraction is not None else used["cpu_mem_fraction"])
    p: list[str] = []
    if plan.device_kind != cluster.device_kind:
        p.append(f"plan is for {plan.device_kind} but cluster {cluster.name!r} is {cluster.device_kind}")
    if plan.nodes > cluster.nodes:
        p.append(f"plan uses {plan.nodes} nodes, cluster has {cluster.nodes}")
    opts = {
        c: {(o.batch_size, o.slice_size): o for o in component_options(cp, cluster, slo_quantile=q)}
        for c, cp in comps.items()
    }
    missing = sorted(set(comps) - {r.component for r in plan.ranks if r.component})
    if missing:
        p.append(f"components without a replica: {missing}")
    dev_util: dict[str, float] = defaultdict(float)
    dev_slices: dict[str, list[float]] = defaultdict(list)
    node_threads: dict[int, int] = defaultdict(int)
    node_mem: dict[int, float] = defaultdict(float)
    thr: dict[str, float] = defaultdict(float)
    for r in plan.ranks[1:]:
        where = f"rank {r.rank} ({r.component}, batch {r.batch_size})"
        if r.component not in comps:
            p.append(f"{where}: component not in the profile")
            continue
        size = float(r.slice_gb or 0.0) if cluster.is_gpu else float(r.threads)
        o = opts[r.component].get((r.batch_size, size))
        if cluster.is_gpu:
            if r.gpu is None or not 0 <= r.gpu < cluster.gpus_per_node:
                p.append(f"{where}: gpu {r.gpu} outside 0..{cluster.gpus_per_node - 1}")
            if size not in cluster.slices_gb:
                p.append(f"{where}: slice {size} GB is not one of {list(cluster.slices_gb)}")
        elif size not in cluster.cpu_threads:
            p.append(f"{where}: {r.threads} threads is not one of cpu_threads {list(cluster.cpu_threads)}")
        if o is None:
            p.append(f"{where}: no usable profile cell at slice {size} (out of memory or not measured)")
            continue
        if cluster.is_gpu and o.mem_bytes > (size or 0) * GIB:
            p.append(f"{where}: needs {o.mem_bytes / GIB:.2f} GB, slice is {size} GB")
        key = device_key(r.node, r.gpu)
        dev_util[key] += o.utilization
        dev_slices[key].append(float(size or 0))
        node_threads[r.node] += r.threads
        node_mem[r.node] += o.mem_bytes
        thr[r.component] += o.throughput_rps
    for key, u in dev_util.items() if cluster.is_gpu else ():
        if u > ulim + 1e-6:
            p.append(f"device {key}: utilization {u:.3f} exceeds the limit {ulim:.3f}")
    if cluster.is_gpu:
        for key, sl in dev_slices.items():
            if cluster.slice_layouts:
                cnt = Counter(sl)
                if not any(all(cnt[s] <= Counter(lay)[s] for s in cnt) for lay in cluster.slice_layouts):
                    p.append(f"device {key}: slices {sorted(sl)} fit none of the allowed layouts")
            elif sum(sl) > cluster.gpu_mem_gb + 1e-6:
                p.append(
                    f"device {key}: slices {sorted(sl)} sum to {sum(sl):g} GB > {cluster.gpu_mem_gb:g} GB"
                )
    else:
        for node, t in node_threads.items():
            cap = cluster.cores_per_node - (fcores if node == 0 else 0)
            if node == 0:
                cap += int(solve.get("oversubscribed_cores", 0) or 0)
            if t > cap:
                p.append(f"node {node}: component ranks use {t} threads, {cap} cores are available")
            if node_mem[node] > cluster.mem_bytes_per_node * mem_fraction * (1 + 1e-9):
                p.append(
                    f"node {node}: ranks need {node_mem[node] / GIB:.2f} GB of host memory, "
                    f"{cluster.mem_gb_per_node * mem_fraction:.2f} GB are usable"
                )
    for c, v in plan.predicted_throughput_rps.items():
        if not math.isclose(v, thr.get(c, 0.0), rel_tol=1e-6, abs_tol=1e-9):
            p.append(f"component {c!r}: plan predicts {v:.6g} req/s, the profile gives {thr.get(c, 0.0):.6g}")
    return p


def validate_plan(
    plan: Plan, profiles: Profile | Sequence[Profile], cluster: ClusterSpec | Mapping[str, Any], **kw: Any
) -> None:
    """Raise :class:`PlanError` listing every violated memory, utilization or layout limit."""
    problems = plan_problems(plan, profiles, cluster, **kw)
    if problems:
        raise PlanError("plan violates the cluster's limits:\n  - " + "\n  - ".join(problems))


def plot_plan(plan: Plan, path: str | Path, *, max_devices: int = 128) -> Path | None:
    """A PNG of devices (rows) x slices (boxes, width = slice size) coloured by component."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError:  # pragma: no cover
        return None
    rows: dict[str, list[RankEntry]] = defaultdict(list)
    for r in plan.ranks[1:]:
        rows[r.device].append(r)
    keys = sorted(rows, key=lambda k: tuple(int(x[1:]) if x[1:].isdigit() else -1 for x in k.split("/")))
    shown = keys[:max_devices]
    comps = list(plan.components)
    cmap = plt.get_cmap("tab20" if len(comps) > 10 else "tab10")
    colour = {c: cmap(i % cmap.N) for i, c in enumerate(comps)}
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.32 * len(shown)))
    width = 0.0
    for y, key in enumerate(shown):
        x = 0.0
        for r in rows[key]:
            w = float(r.slice_gb if r.slice_gb is not None else r.threads)
            ax.add_patch(
                Rectangle(
                    (x, y + 0.1), w, 0.8, facecolor=colour[r.component or ""], edgecolor="black", lw=0.5
                )
            )
            if len(shown) <= 64:
                ax.text(x + w / 2, y + 0.5, f"b{r.batch_size}", ha="center", va="center", fontsize=6)
            x += w
        width = max(width, x)
        ax.text(
            -0.01,
            y + 0.5,
            f"{key} {plan.utilization.get(key, 0):.0%}",
            ha="right",
            va="center",
            fontsize=7,
            transform=ax.get_yaxis_transform(),
        )
    ax.set_xlim(0, max(width, 1))
    ax.set_ylim(len(shown), 0)
    ax.set_yticks([])
    ax.set_xlabel("slice size (GB)" if plan.device_kind == "cuda" else "threads")
    more = f" (first {max_devices} of {len(keys)} devices)" if len(keys) > max_devices else ""
    ax.set_title(f"{plan.model}: {plan.world_size} ranks{more}", fontsize=9)
    ax.legend(
        handles=[Patch(color=colour[c], label=c) for c in comps],
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
