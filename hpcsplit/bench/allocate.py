"""``python -m hpcsplit.bench allocate``: allocator solve time and objective vs cluster size.

Synthetic profiles with realistic shapes (:mod:`hpcsplit.allocation.synthetic`: latency grows
sub-linearly with batch, utilization 0.1-0.6 rising with batch, memory = parameters + activations x
batch, out-of-memory where it does not fit) on GPUs with 5 slice sizes, the utilization limit
enforced per GPU.  Prints, per
(GPUs, components, solver): solve time, the leximin minimum, the gap to the LP bound, patterns.

``agg/min``: the max-min of the aggregated model (utilization and slices summed over the cluster)
divided by the plan's minimum: above 1 where the aggregated model promises what no GPU can hold.

Options: ``--gpus 4,16,64,256 --components 3,8,12 --solvers HIGHS,SCIPY,SCIP --time-limit 60``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from hpcsplit.allocation.options import build_instance, option_table
from hpcsplit.allocation.settings import AllocateSettings
from hpcsplit.allocation.solve import allocate
from hpcsplit.allocation.synthetic import synthetic_cluster, synthetic_profile
from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.profile_format import Profile

__all__ = ["aggregated_min", "main"]


def aggregated_min(prof: Profile, cluster: ClusterSpec) -> float:
    """Max-min throughput of the *aggregated* model (replica counts per option over the whole
    cluster, slices and utilization summed over all GPUs): an upper bound that may not fit GPUs."""
    from scipy.optimize import LinearConstraint, milp

    settings = AllocateSettings.defaults()
    table = option_table(prof.components, cluster, settings)
    inst, _ = build_instance(table, cluster, dict.fromkeys(table, 1.0), settings)
    kind = inst.kinds[0]
    n, g = len(kind.items), kind.count
    rows = [
        np.array([kind.slice_units[it.slice_idx] for it in kind.items], float),
        np.array([it.utilization for it in kind.items]),
        np.ones(n),
    ]
    ub = [g * kind.capacity_units, g * kind.util_limit, g * kind.max_items]
    for c in range(inst.n_comp):  # t - T_c <= 0
        rows.append(-np.array([it.throughput_rps if it.comp == c else 0.0 for it in kind.items]))
        ub.append(0.0)
    a = np.column_stack([np.array(rows), np.r_[0.0, 0.0, 0.0, np.ones(inst.n_comp)]])
    cost = np.r_[np.zeros(n), -1.0]
    res = milp(
        cost,
        integrality=np.r_[np.ones(n), 0.0],
        bounds=(0, np.inf),
        constraints=LinearConstraint(a, -np.inf, np.array(ub)),
        options={"time_limit": 10.0},
    )
    return -float(res.fun) if res.x is not None else float("nan")


def main(argv: list[str]) -> int:
    import cvxpy as cp

    ap = argparse.ArgumentParser(
        prog="python -m hpcsplit.bench allocate", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--gpus", default="4,16,64,256")
    ap.add_argument("--components", default="3,8,12")
    ap.add_argument("--solvers", default="HIGHS,SCIPY,SCIP")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--mip-rel-gap", type=float, default=None)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--levels", type=int, default=None, help="leximin stages solved exactly (default: all)")
    ap.add_argument("--stage-time-limit", type=float, default=None)
    ap.add_argument("--stage-node-limit", type=int, default=None,
                    help="branch-and-bound nodes per leximin stage (default: allocate.stage_node_limit); 0: none")
    ap.add_argument(
        "--no-aggregated",
        dest="aggregated",
        action="store_false",
        help="skip the aggregated (per-cluster utilization) upper bound column agg/min",
    )
    a = ap.parse_args(argv)
    installed = set(cp.installed_solvers())
    solvers = [s for s in a.solvers.split(",") if s in installed]
    skipped = [s for s in a.solvers.split(",") if s not in installed]
    print(
        f"allocate bench: 5 slice sizes (5..80 GB), util limit 1.0 per GPU, time limit {a.time_limit:g} s, "
        f"leximin stages {'all' if a.levels is None else a.levels}"
    )
    allocate(synthetic_profile(2, seed=99), synthetic_cluster(2), time_limit_s=5)  # imports, first-call costs
    if skipped:
        print(f"solvers not installed (skipped): {', '.join(skipped)}")
    head = (
        f"{'gpus':>5} {'comps':>5} {'solver':>6} {'mode':>9} {'wall_s':>7} {'cpu_s':>7} {'min_rps':>10} "
        f"{'gap':>7} {'pats':>5} {'ranks':>6} {'agg/min':>7} note"
    )
    print(head)
    print("-" * len(head))
    extra: dict[str, Any] = {} if a.mip_rel_gap is None else {"mip_rel_gap": a.mip_rel_gap}
    if a.levels is not None:
        extra["leximin_levels"] = a.levels
    if a.stage_time_limit is not None:
        extra["stage_time_limit_s"] = a.stage_time_limit
    if a.stage_node_limit is not None:
        extra["stage_node_limit"] = a.stage_node_limit or None
    for g in (int(x) for x in a.gpus.split(",")):
        for c in (int(x) for x in a.components.split(",")):
            prof = synthetic_profile(c, seed=a.seed + c)
            cl = synthetic_cluster(g)
            base: float | None = None
            agg = aggregated_min(prof, cl) if a.aggregated else float("nan")
            for s in solvers:
                t = time.perf_counter()
                tc = time.process_time()
                try:
                    al = allocate(prof, cl, solver=s, time_limit_s=a.time_limit, mode=a.mode, **extra)
                except Exception as e:  # noqa: BLE001 - report and continue with the next case
                    print(f"{g:>5} {c:>5} {s:>6} {'-':>9} {time.perf_counter() - t:>8.2f} failed: {e}")
                    continue
                dt = time.perf_counter() - t
                dc = time.process_time() - tc
                base = base or al.min_normalised_throughput
                ratio = al.min_normalised_throughput / base if base else float("nan")
                # NODES: a stage stopped at its node limit (the same plan anywhere); CLOCK: a wall-clock limit
                # stopped the search, and the plan may differ on another machine; STOPPED: a stage ended otherwise
                # (a solver error: the previous stage's solution kept)
                at_nodes = any(st["status"] == "user_limit" for st in al.solve["stages"])
                note = ("CLOCK" if al.solve["clock_hit"] else "NODES" if al.solve["limit_hit"] and at_nodes
                        else "STOPPED" if al.solve["limit_hit"] else "")
                if len(solvers) > 1 and s != solvers[0]:
                    note += f" min/{solvers[0]}={ratio:.4f}"
                print(
                    f"{g:>5} {c:>5} {s:>6} {al.solve['mode']:>9} {dt:>7.2f} {dc:>7.2f} {al.min_normalised_throughput:>10.1f} "
                    f"{al.solve['gap']:>7.2%} {al.solve['n_patterns']:>5} {len(al.replicas) + 1:>6} "
                    f"{agg / al.min_normalised_throughput:>7.3f} {note}",
                    flush=True,
                )
    return 0
