"""The allocator: leximin = brute force, pattern = per-GPU formulation, exact per-GPU limits, errors."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest

from hpcsplit.allocation import device_solver as R
from hpcsplit.allocation import leximin as L
from hpcsplit.allocation import patterns as P
from hpcsplit.allocation.options import build_instance, option_table
from hpcsplit.allocation.packing import Instance, Pattern, enumerate_patterns, pattern_throughputs
from hpcsplit.allocation.settings import AllocateSettings
from hpcsplit.allocation.solve import allocate
from hpcsplit.allocation.stage import SETTINGS, run_allocate
from hpcsplit.allocation.synthetic import make_profile, synthetic_cluster, synthetic_profile
from hpcsplit.allocation.to_plan import plan_problems, plot_plan, validate_plan
from hpcsplit.bench.allocate import main as bench_main
from hpcsplit.core.cluster import GIB, ClusterSpec, slice_fraction
from hpcsplit.core.plan import Plan
from hpcsplit.core.settings import group_defaults
from hpcsplit.errors import AllocationError, AllocationInfeasibleError, ConfigError, PlanError

GPU_SLICES = (10.0, 20.0)


def gpu_profile(spec: dict[str, list[tuple[int, float, float, float]]], slices=GPU_SLICES, model="toy"):
    """spec: component -> [(batch, latency_ms, mem_gb, utilization)], same on every slice, OOM beyond."""
    comps = {}
    batches = tuple(b for b, *_ in next(iter(spec.values())))
    for name, rows in spec.items():
        assert tuple(b for b, *_ in rows) == batches
        lat = np.array([[r[1]] * len(slices) for r in rows], float)
        mem = np.array([[r[2] * GIB] * len(slices) for r in rows], float)
        util = np.array([[r[3]] * len(slices) for r in rows], float)
        lat = np.where(mem > np.array(slices)[None, :] * GIB, np.nan, lat)
        comps[name] = {"latency_ms": lat, "peak_mem_bytes": mem, "utilization": util}
    return make_profile(comps, batch_sizes=batches, slices=slices, model=model)


def gpu_cluster(gpus=2, gpu_mem_gb=40, slices=GPU_SLICES, cores=16, **kw):
    cfg = {
        "name": "t",
        "nodes": 1,
        "gpus_per_node": gpus,
        "gpu_mem_gb": gpu_mem_gb,
        "slices_gb": list(slices),
        "cores_per_node": cores,
        "mem_gb_per_node": 64,
        "cpu_threads": [1, 2],
    }
    cfg.update(kw)
    return ClusterSpec.from_config(cfg)


def instance_of(prof, cluster, **opts):
    s = AllocateSettings.defaults(**opts)
    table = option_table(prof.components, cluster, s)
    weights = {c: float(s.demand_weights.get(c, 1.0)) for c in table}
    inst, _ = build_instance(table, cluster, weights, s)
    return inst


# ------------------------------------------------------------------------------------- brute force
def leximin_key(instance: Instance, thr: Sequence[float]) -> tuple[float, ...]:
    """Sorted normalised throughputs of the active components (compare lexicographically)."""
    return tuple(sorted(thr[c] / instance.weights[c] for c in instance.active))


def brute_force_leximin(instance: Instance, *, limit: int = 200_000) -> tuple[float, ...]:
    """The leximin-optimal sorted vector by trying every assignment of patterns to devices (tiny
    instances only: ValueError beyond ``limit`` combinations)."""
    per_kind: list[list[tuple[tuple[Pattern, int], ...]]] = []
    total = 1
    for kind in instance.kinds:
        pats = enumerate_patterns(kind, limit, maximal_only=False)
        if pats is None:
            raise ValueError("too many patterns for brute force")
        combos = list(itertools.combinations_with_replacement(range(len(pats)), kind.count))
        total *= len(combos)
        if total > limit:
            raise ValueError(f"more than {limit} combinations for brute force")
        per_kind.append([tuple((pats[i], 1) for i in combo) for combo in combos])
    best: tuple[float, ...] | None = None
    for choice in itertools.product(*per_kind):
        reps = [0] * instance.n_comp
        for kind, ch in zip(instance.kinds, choice, strict=True):
            for pat, _ in ch:
                for i, cnt in pat:
                    reps[kind.items[i].comp] += cnt
        if min(reps) < 1:
            continue
        key = leximin_key(instance, pattern_throughputs(instance, choice))
        if best is None or key > best:
            best = key
    if best is None:
        raise ValueError("no assignment gives every component a replica")
    return best


EXACT = {"mip_rel_gap": 1e-9, "time_limit_s": 120, "stage_time_limit_s": None, "stage_node_limit": None}

# three components with different shapes: a heavy one, a light one, a memory-hungry one
SPEC = {
    "enc": [(1, 4.0, 3.0, 0.35), (4, 9.0, 6.0, 0.55)],
    "dec": [(1, 2.0, 2.0, 0.20), (4, 5.0, 4.0, 0.30)],
    "head": [(1, 1.0, 12.0, 0.25), (4, 2.5, 14.0, 0.40)],
}


@pytest.mark.parametrize("mode", ["auto", "enumerate"])  # auto: per-device formulation on 2 GPUs
@pytest.mark.parametrize("weights", [{}, {"dec": 2.0}, {"head": 0.5, "enc": 1.5}])
def test_leximin_equals_brute_force(weights, mode):
    prof, cl = gpu_profile(SPEC), gpu_cluster(gpus=2)
    al = allocate(prof, cl, demand_weights=weights, mode=mode, **EXACT)
    assert al.solve["mode"] == ("per-device" if mode == "auto" else "enumerate")
    brute = brute_force_leximin(instance_of(prof, cl, demand_weights=weights))
    np.testing.assert_allclose(al.leximin, brute, rtol=1e-5)
    validate_plan(al.to_plan(), prof, cl)


def test_pattern_and_per_gpu_formulations_agree():
    prof, cl = gpu_profile(SPEC), gpu_cluster(gpus=3)
    inst = instance_of(prof, cl)
    per_gpu = R.solve_per_device(inst, mip_rel_gap=1e-9)
    enum = P.solve_patterns(inst, mode="enumerate", mip_rel_gap=1e-9)
    gen = P.solve_patterns(inst, mode="generate", mip_rel_gap=1e-9)
    ref = leximin_key(inst, per_gpu.throughput_rps)
    np.testing.assert_allclose(leximin_key(inst, enum.throughput_rps), ref, rtol=1e-5)
    # column generation keeps only priced patterns: never better than exact, within its reported gap
    key = leximin_key(inst, gen.throughput_rps)
    assert key[0] <= ref[0] * (1 + 1e-6)
    assert key[0] >= ref[0] * (1 - gen.gap) - 1e-6


def test_cpu_nodes_equal_brute_force_and_keep_a_core_for_the_frontend():
    bs, th = (1, 4), (1.0, 2.0)
    comps = {}
    for i, (l0, mem_gb) in enumerate([(2.0, 1.0), (6.0, 2.0), (1.0, 0.5)]):
        b = np.array(bs, float)[:, None]
        t = np.array(th)[None, :]
        comps[f"p{i}"] = {
            "latency_ms": l0 * b**0.7 / t**0.8,
            "peak_mem_bytes": np.full((2, 2), mem_gb * GIB),
            "utilization": np.full((2, 2), 0.5),
        }
    prof = make_profile(comps, batch_sizes=bs, slices=th, device_kind="cpu")
    cl = ClusterSpec.from_config(
        {
            "name": "c",
            "nodes": 2,
            "gpus_per_node": 0,
            "cores_per_node": 4,
            "mem_gb_per_node": 4,
            "cpu_threads": [1, 2],
        }
    )
    al = allocate(prof, cl, mode="enumerate", **EXACT)
    np.testing.assert_allclose(al.leximin, brute_force_leximin(instance_of(prof, cl)), rtol=1e-5)
    np.testing.assert_allclose(allocate(prof, cl, **EXACT).leximin, al.leximin, rtol=1e-5)
    plan = al.to_plan()
    validate_plan(plan, prof, cl)
    threads = {n: sum(r.threads for r in plan.ranks[1:] if r.node == n) for n in (0, 1)}
    assert threads[0] <= 3 and threads[1] <= 4
    assert all(r.gpu is None and r.slice_gb is None for r in plan.ranks)
    # host memory binds: 0.9 * 4 GB per node
    mem = {
        n: sum(comps[r.component]["peak_mem_bytes"][0, 0] for r in plan.ranks[1:] if r.node == n)
        for n in (0, 1)
    }
    assert max(mem.values()) <= 0.9 * 4 * GIB


def test_per_gpu_utilization_limit_binds_and_changes_the_answer():
    # Two components at 0.6 utilization: a GPU holds only one of them under the limit, although its
    # memory would take three.  Summed over both GPUs (2.0) four replicas "fit" in aggregate.
    spec = {"a": [(1, 2.0, 5.0, 0.6)], "b": [(1, 4.0, 5.0, 0.6)]}
    prof, cl = gpu_profile(spec, slices=(10.0,)), gpu_cluster(gpus=2, gpu_mem_gb=30, slices=(10.0,))
    limited = allocate(prof, cl, **EXACT)
    free = allocate(prof, cl, util_limit=10.0, **EXACT)
    assert len(limited.replicas) == 2
    assert limited.leximin == pytest.approx((250.0, 500.0))
    assert free.leximin[0] > limited.leximin[0] * 1.5
    assert all(u <= 1.0 + 1e-9 for u in limited.device_utilization.values())
    validate_plan(limited.to_plan(), prof, cl)
    # the unlimited plan breaks the per-GPU limit, and the validator says where
    problems = plan_problems(free.to_plan(), prof, cl, util_limit=1.0)
    assert problems and all("utilization" in p for p in problems)
    # an aggregated model (utilization summed over GPUs <= 2) would allow 3 replicas of 'b': not placeable
    inst = instance_of(prof, cl)
    assert brute_force_leximin(inst) == pytest.approx(limited.leximin)


def test_slice_layouts_are_respected():
    spec = {"a": [(1, 2.0, 4.0, 0.2)], "b": [(1, 3.0, 8.0, 0.2)]}
    slices = (5.0, 10.0, 20.0)
    cl = gpu_cluster(gpus=1, gpu_mem_gb=40, slices=slices, slice_layouts=[[20, 10, 10], [20, 5, 5, 5]])
    prof = gpu_profile(spec, slices=slices)
    al = allocate(prof, cl, **EXACT)
    np.testing.assert_allclose(al.leximin, brute_force_leximin(instance_of(prof, cl)), rtol=1e-5)
    plan = al.to_plan()
    validate_plan(plan, prof, cl)
    used = sorted(r.slice_gb for r in plan.ranks[1:])
    assert any(all(used.count(s) <= lay.count(s) for s in used) for lay in ([20, 10, 10], [20, 5, 5, 5]))


def test_slo_restricts_batch_sizes():
    prof, cl = gpu_profile(SPEC), gpu_cluster(gpus=2)
    free = allocate(prof, cl, **EXACT)
    assert max(r.option.batch_size for r in free.replicas) == 4
    al = allocate(prof, cl, slo_ms=4.5, slo_quantile=0.5, **EXACT)
    assert all(r.option.latency_ms <= 4.5 for r in al.replicas)
    assert {r.option.component: r.option.batch_size for r in al.replicas}["enc"] == 1
    per = allocate(prof, cl, slo_ms={"dec": 3.0}, slo_quantile=0.5, **EXACT)
    assert all(r.option.batch_size == 1 for r in per.replicas if r.option.component == "dec")


def test_plan_file_png_and_summary(tmp_path, monkeypatch):
    prof, _cl = gpu_profile(SPEC), gpu_cluster(gpus=2)
    monkeypatch.setattr("hpcsplit.allocation.stage.read_profile", lambda path, **kw: prof)
    cfg = {
        "profile": {"path": str(tmp_path / "p.h5")},
        "paths": {"plan_filename": "plan.json"},
        "cluster": {
            "name": "t",
            "nodes": 1,
            "gpus_per_node": 2,
            "gpu_mem_gb": 40,
            "slices_gb": [10, 20],
            "cores_per_node": 16,
            "mem_gb_per_node": 64,
            "cpu_threads": [1],
        },
        "allocate": {**group_defaults("allocate"), "time_limit_s": 30},
    }
    out = run_allocate(cfg, tmp_path)
    plan = Plan.load(out["plan"])
    assert plan.world_size == out["world_size"] == len(plan.ranks)
    assert plan.ranks[0].role == "frontend" and plan.device_kind == "cuda"
    assert set(plan.predicted_throughput_rps) == set(SPEC)
    assert (tmp_path / "plan.png").stat().st_size > 1000
    json.dumps(out)
    validate_plan(plan, prof, cfg["cluster"])


def test_stage_checks_settings_first_and_merges_several_profiles(tmp_path, monkeypatch):
    parts = {"m1.h5": gpu_profile({k: SPEC[k] for k in ("enc", "dec")}, model="m1"),
             "m2.h5": gpu_profile({"head": SPEC["head"]}, model="m2")}
    read: list[str] = []

    def fake_read(path, **kw):
        read.append(str(path))
        return parts[path.name]

    monkeypatch.setattr("hpcsplit.allocation.stage.read_profile", fake_read)
    cluster = {"name": "t", "nodes": 1, "gpus_per_node": 2, "gpu_mem_gb": 40, "slices_gb": [10, 20],
               "cores_per_node": 16, "mem_gb_per_node": 64, "cpu_threads": [1]}
    cfg = {"profile": {"path": [str(tmp_path / n) for n in parts]}, "cluster": cluster,
           "allocate": {**group_defaults("allocate"), "util_limt": 0.5, "slo_quantile": 2}}
    with pytest.raises(ConfigError) as e:
        run_allocate(cfg, tmp_path)
    assert "util_limt is not a setting (did you mean 'util_limit'?)" in str(e.value)
    assert "slo_quantile = 2" in str(e.value) and not read  # nothing read before the settings hold
    cfg["allocate"] = group_defaults("allocate")
    out = run_allocate(cfg, tmp_path)
    assert len(read) == 2 and out["plan"] == str(tmp_path / "plan.json")
    assert set(Plan.load(out["plan"]).predicted_throughput_rps) == set(SPEC)


def test_validator_catches_memory_and_layout_violations():
    prof, cl = gpu_profile(SPEC), gpu_cluster(gpus=2)
    plan = allocate(prof, cl, **EXACT).to_plan()
    head = next(r for r in plan.ranks if r.component == "head")
    ranks = tuple(replace(r, slice_gb=10.0) if r.rank == head.rank else r for r in plan.ranks)
    with pytest.raises(PlanError, match="head"):
        validate_plan(replace(plan, ranks=ranks), prof, cl)
    last = plan.ranks[-1]
    n = len(plan.replicas(last.component))
    more = [replace(last, rank=len(plan.ranks) + i, replica=n + i) for i in range(4)]
    crowded = replace(plan, ranks=(*plan.ranks, *more))
    problems = plan_problems(crowded, prof, cl)
    assert any("exceeds the limit" in p or "sum to" in p for p in problems)


def test_plot_has_one_row_per_device(tmp_path):
    prof, cl = gpu_profile(SPEC), gpu_cluster(gpus=2)
    path = plot_plan(allocate(prof, cl, **EXACT).to_plan(), tmp_path / "x.png")
    assert path is not None and path.read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------------------------------- errors
def test_component_that_fits_no_slice():
    spec = dict(SPEC, huge=[(1, 1.0, 30.0, 0.2), (4, 2.0, 35.0, 0.3)])
    with pytest.raises(AllocationInfeasibleError, match=r"'huge' fits no slice.*20 GB.*slices_gb"):
        allocate(gpu_profile(spec), gpu_cluster())
    # measured in a 20 GB slice, but the cluster only offers 10 GB slices
    spec = dict(SPEC, big=[(1, 1.0, 15.0, 0.2), (4, 2.0, 18.0, 0.3)])
    with pytest.raises(
        AllocationInfeasibleError, match=r"'big' fits no slice.*at least 15\.00 GB.*\[10\.0\] GB"
    ):
        allocate(gpu_profile(spec), gpu_cluster(slices=(10.0,)))


def test_component_above_the_utilization_limit():
    spec = dict(SPEC, busy=[(1, 1.0, 1.0, 0.9), (4, 2.0, 2.0, 0.95)])
    with pytest.raises(AllocationInfeasibleError, match=r"'busy'.*90%.*util_limit"):
        allocate(gpu_profile(spec), gpu_cluster(), util_limit=0.8)


def test_more_components_than_slots():
    spec = {f"c{i}": [(1, 1.0, 8.0, 0.1)] for i in range(5)}
    with pytest.raises(AllocationInfeasibleError, match=r"5 components.*only 4 slot.*add nodes"):
        allocate(gpu_profile(spec, slices=(10.0,)), gpu_cluster(gpus=2, gpu_mem_gb=20, slices=(10.0,)))


def test_cpu_too_few_cores_names_the_way_out():
    prof = make_profile(
        {
            f"p{i}": {"latency_ms": [[1.0]], "peak_mem_bytes": [[1e6]], "utilization": [[0.5]]}
            for i in range(3)
        },
        batch_sizes=(1,),
        slices=(1.0,),
        device_kind="cpu",
    )
    cl = ClusterSpec.from_config(
        {
            "name": "l",
            "nodes": 1,
            "gpus_per_node": 0,
            "cores_per_node": 2,
            "mem_gb_per_node": 8,
            "cpu_threads": [1],
        }
    )
    with pytest.raises(AllocationInfeasibleError, match=r"frontend.*cores_per_node"):
        allocate(prof, cl, cpu_oversubscribe=False)
    # by default a too-small CPU node is oversubscribed (one 1-thread rank per component), and said so
    al = allocate(prof, cl)
    assert al.solve["oversubscribed_cores"] == 2 and len(al.replicas) == 3
    assert any("oversubscribed" in n for n in al.solve["notes"])
    validate_plan(al.to_plan(), prof, cl)


def test_slo_needs_a_batch_size_the_profile_lacks():
    spec = {"a": [(4, 8.0, 2.0, 0.3), (8, 12.0, 3.0, 0.4)], "b": [(4, 2.0, 2.0, 0.3), (8, 3.0, 3.0, 0.4)]}
    with pytest.raises(AllocationError, match=r"'a'.*smallest profiled batch 4.*profile.batch_sizes") as e:
        allocate(gpu_profile(spec), gpu_cluster(), slo_ms=5.0, slo_quantile=0.5)
    assert not isinstance(e.value, AllocationInfeasibleError)


def test_slo_below_the_fastest_batch_one():
    with pytest.raises(AllocationInfeasibleError, match=r"'enc' cannot meet.*4 ms.*raise allocate.slo_ms"):
        allocate(gpu_profile(SPEC), gpu_cluster(), slo_ms=3.0, slo_quantile=0.5)


def test_contradictory_settings_are_listed_together():
    with pytest.raises(AllocationError) as e:
        allocate(
            gpu_profile(SPEC),
            gpu_cluster(),
            demand_weights={"audio": 1.0, "enc": -1},
            slo_ms={"nope": 3},
            solver="NOSUCH",
        )
    msg = str(e.value)
    for needle in ("'audio'", "'enc': -1", "'nope'", "NOSUCH", "HIGHS"):
        assert needle in msg


def test_profile_and_cluster_device_mismatch():
    cpu = ClusterSpec.from_config(
        {
            "name": "l",
            "nodes": 1,
            "gpus_per_node": 0,
            "cores_per_node": 4,
            "mem_gb_per_node": 8,
            "cpu_threads": [1],
        }
    )
    with pytest.raises(AllocationError, match=r"measured on cuda.*cluster 'l' is cpu"):
        allocate(gpu_profile(SPEC), cpu)


def test_unknown_option_is_rejected():
    with pytest.raises(AllocationError, match=r"allocate\.max_gpus is not a setting.*valid: "):
        allocate(gpu_profile(SPEC), gpu_cluster(), max_gpus=3)
    with pytest.raises(AllocationError, match=r"max_patern is not a setting \(did you mean 'max_patterns'\?\)"):
        allocate(gpu_profile(SPEC), gpu_cluster(), max_patern=3)


def test_time_limit_keeps_a_valid_plan_and_says_it_may_differ_elsewhere():
    prof, cl = synthetic_profile(3, seed=1), synthetic_cluster(4)
    al = allocate(prof, cl, time_limit_s=1e-3)
    assert al.solve["limit_hit"] and al.solve["clock_hit"] and len(al.solve["stages"]) < 3
    assert any("time_limit_s=0.001 ran out before stage" in c for c in al.solve["clock"]), al.solve["clock"]
    assert any("may differ on a faster or slower machine" in n for n in al.solve["notes"]), al.solve["notes"]
    assert "wall clock: may differ" in al.summary()
    assert al.replicas and set(al.throughput_rps) == set(prof.components)
    validate_plan(al.to_plan(), prof, cl)


def _placement(al) -> list[tuple]:
    return [(r.node, r.gpu, r.slot, r.option.component, r.option.batch_size, r.option.slice_size) for r in al.replicas]


def test_node_limit_gives_the_same_plan_on_a_busy_machine():
    """[Note: deterministic limits]: a stage stopped by its node count, not the clock, so a loaded machine and a
    ten times longer wall-clock limit give the same plan."""
    prof, cl = synthetic_profile(6, seed=6), synthetic_cluster(64)
    quiet = allocate(prof, cl, stage_node_limit=30, leximin_levels=1)
    assert quiet.solve["limit_hit"] and not quiet.solve["clock_hit"], quiet.solve
    assert quiet.solve["stages"][0]["status"] == "user_limit"  # stage 1 did stop at its node limit (60)
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        busy = allocate(prof, cl, stage_node_limit=30, leximin_levels=1, stage_time_limit_s=50)
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert not busy.solve["clock_hit"], busy.solve["clock"]
    assert _placement(busy) == _placement(quiet)
    assert busy.throughput_rps == quiet.throughput_rps
    # and one thread: HiGHS's tree on several threads depends on the machine's core count
    opts = L._solver_opts("HIGHS", 5.0, 1e-4, 1000)
    assert opts["threads"] == 1 and opts["mip_max_nodes"] == 1000, opts


def test_a_stage_the_clock_stopped_is_named_and_the_plan_says_so(monkeypatch):
    """A stage's solver stopped by its wall-clock limit (here one microsecond, past on any machine) before its
    node limit: recorded in ``clock``, and the plan's notes and summary say it may differ elsewhere."""
    real = L._solver_opts
    monkeypatch.setattr(L, "_solver_opts", lambda *a: {**real(*a), "time_limit": 1e-6})
    prof, cl = synthetic_profile(6, seed=6), synthetic_cluster(64)
    al = allocate(prof, cl, leximin_levels=1)
    assert al.solve["clock_hit"] and any("stopped at its wall-clock limit" in c and "before its node limit" in c
                                         for c in al.solve["clock"]), al.solve["clock"]
    assert any("lower allocate.stage_node_limit" in n for n in al.solve["notes"]), al.solve["notes"]
    assert "wall clock: may differ" in al.summary()
    validate_plan(al.to_plan(), prof, cl)
    # without a node limit, any stop is the clock's, and the note names the node limit as the way out
    al = allocate(prof, cl, leximin_levels=1, stage_node_limit=None)
    assert al.solve["clock_hit"] and any("set allocate.stage_node_limit" in n for n in al.solve["notes"])


def test_allocate_after_a_highs_solve_on_several_threads():
    """HiGHS keeps one thread scheduler per process: after someone's solve on two threads, the allocator's
    one-thread solves start a new scheduler instead of failing."""
    import cvxpy as cp
    import highspy

    highspy.Highs.resetGlobalScheduler(True)  # as in a fresh process (earlier tests sized it to one thread)
    x = cp.Variable(3, integer=True)
    cp.Problem(cp.Maximize(cp.sum(x)), [x <= 2.5]).solve(solver="HIGHS", threads=2)
    prof, cl = synthetic_profile(3, seed=1), synthetic_cluster(4)
    al = allocate(prof, cl)
    assert not al.solve["limit_hit"] and al.solve["stages"][0]["status"] == "optimal", al.solve
    validate_plan(al.to_plan(), prof, cl)


def test_a_long_solve_logs_each_stage(monkeypatch, caplog):
    monkeypatch.setattr(L, "PROGRESS_AFTER_S", 0.0)  # (2 s: a small solve stays quiet)
    with caplog.at_level("INFO", logger="hpcsplit.allocation.leximin"):
        al = allocate(synthetic_profile(3, seed=1), synthetic_cluster(4))
    lines = [r.getMessage() for r in caplog.records if "leximin stage" in r.getMessage()]
    assert len(lines) == len(al.solve["stages"]) == 3, lines
    assert lines[0].startswith("allocate: leximin stage 1 of 3 (the 1 smallest) optimal in "), lines


def test_scipy_runs_without_a_node_limit():
    """scipy reports a stop at its node limit as an unknown status (cvxpy: a solver error): SCIPY gets no node limit
    and still finds the plan HiGHS finds on a small case."""
    prof, cl = synthetic_profile(3, seed=1), synthetic_cluster(4)
    assert "node_limit" not in L._solver_opts("SCIPY", 5.0, 1e-4, 1)["scipy_options"]
    sc = allocate(prof, cl, solver="SCIPY", stage_node_limit=1)
    hi = allocate(prof, cl)
    validate_plan(sc.to_plan(), prof, cl)
    assert sc.min_normalised_throughput == pytest.approx(hi.min_normalised_throughput, rel=1e-6)


# ------------------------------------------------------------------------------------------ cluster
def test_cluster_config_errors_are_collected():
    with pytest.raises(ConfigError) as e:
        ClusterSpec.from_config(
            {
                "name": "x",
                "nodes": 0,
                "gpus_per_node": 2,
                "gpu_mem_gb": 40,
                "slices_gb": [50],
                "mig_profiles": ["1g.5gb", "2g.10gb"],
                "scheduler": "pbs",
                "colour": 1,
            }
        )
    msg = str(e.value)
    for needle in (
        "nodes = 0",
        "slices_gb [50.0] exceed",
        "mig_profiles has 2",
        "scheduler = 'pbs'",
        "colour",
    ):
        assert needle in msg


def test_cluster_defaults_to_this_machine():
    spec = ClusterSpec.from_config(
        {
            "name": "l",
            "nodes": 1,
            "gpus_per_node": 0,
            "cpu_threads": [1],
            "cores_per_node": None,
            "mem_gb_per_node": None,
        }
    )
    assert spec.cores_per_node >= 1 and spec.mem_gb_per_node > 0 and spec.device_kind == "cpu"


def test_settings_come_from_the_yaml_and_list_every_problem():
    assert SETTINGS == {"allocate": AllocateSettings}
    yaml_values = group_defaults("allocate")
    s = AllocateSettings.from_config({"allocate": yaml_values})
    assert s.to_values() == {**yaml_values, "time_limit_s": float(yaml_values["time_limit_s"])}
    assert AllocateSettings.defaults() == s
    # a partial group is completed from the YAML (the Python API's way too)
    assert AllocateSettings.from_config({"allocate": {"solver": "highs"}}).solver == "HIGHS"
    with pytest.raises(ConfigError) as e:
        AllocateSettings.from_config(
            {"allocate": {"time_limit_s": 0, "mode": "fast", "cpu_timeshare": "yes", "leximin_levels": 0,
                          "slo_ms": -2, "demand_weights": {"a": -1}, "util_limt": 1.0, "stage_node_limit": 2.5}}
        )
    msg = str(e.value)
    for needle in ("time_limit_s = 0", "mode = 'fast'", "cpu_timeshare = 'yes'", "leximin_levels = 0",
                   "stage_node_limit = 2.5",
                   "slo_ms = -2", "{'a': -1}", "util_limt is not a setting (did you mean 'util_limit'?)"):
        assert needle in msg, needle


def test_zero_weight_gets_one_replica_and_no_say():
    prof, cl = gpu_profile(SPEC), gpu_cluster(gpus=2)
    al = allocate(prof, cl, demand_weights={"head": 0}, **EXACT)
    assert sum(1 for r in al.replicas if r.option.component == "head") >= 1
    assert len(al.leximin) == 2
    np.testing.assert_allclose(
        al.leximin, brute_force_leximin(instance_of(prof, cl, demand_weights={"head": 0})), rtol=1e-5
    )


def test_several_profiles_are_merged_and_names_must_differ():
    a = gpu_profile({k: SPEC[k] for k in ("enc", "dec")}, model="m1")
    b = gpu_profile({"head": SPEC["head"]}, model="m2")
    al = allocate([a, b], gpu_cluster(gpus=2), **EXACT)
    assert set(al.throughput_rps) == {"enc", "dec", "head"} and al.model == "m1+m2"
    with pytest.raises(AllocationError, match="'enc' appears in two profiles"):
        allocate([a, a], gpu_cluster(gpus=2))


def test_bench_runs_on_a_small_case(capsys):
    assert bench_main(["--gpus", "4", "--components", "3", "--solvers", "HIGHS,NOSUCH"]) == 0
    out = capsys.readouterr().out
    assert "NOSUCH" in out and "    4     3  HIGHS" in out


def test_slice_cap_is_the_same_gib_for_profile_and_serve() -> None:
    # profiling (apply_slice) and serving (_bind_device) both cap a rank at this share of the GPU: a
    # 40 GB slice of an 80 GiB H100 is half of it, not 40e9 bytes (a 7% smaller cap than was profiled)
    assert slice_fraction(40, 80 * GIB) == 0.5
    assert slice_fraction(141, 80 * GIB) == 1.0
