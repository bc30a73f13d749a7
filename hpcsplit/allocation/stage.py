"""Stage ``allocate``: a profile and a cluster in, ``plan.json`` (and its picture) out.

The one place of the allocation folder that reads the config dict: ``cfg["allocate"]`` becomes
:class:`~hpcsplit.allocation.settings.AllocateSettings`, ``cfg["cluster"]`` a
:class:`~hpcsplit.core.cluster.ClusterSpec`, the file names a :class:`~hpcsplit.core.paths.RunPaths`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hpcsplit.allocation.choose import choose, frontend_s_per_request
from hpcsplit.allocation.settings import AllocateSettings
from hpcsplit.allocation.solve import allocate
from hpcsplit.allocation.to_plan import plot_plan
from hpcsplit.core.calibration import Calibration, calibration_for
from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.profile_format import Profile, read_profile
from hpcsplit.core.sim_model import SimGraph, binds_cores
from hpcsplit.core.simulator import ServePolicy
from hpcsplit.errors import AllocationError
from hpcsplit.switchboard.layout import LAYOUT_FILE, load_layout

__all__ = ["SETTINGS", "run_allocate"]

log = logging.getLogger(__name__)

SETTINGS: dict[str, type | dict[str, type]] = {"allocate": AllocateSettings}


def run_allocate(cfg: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """``python -m hpcsplit stage=allocate profile=PATH cluster=NAME``: write the plan and its PNG.

    Parameters
    ----------
    cfg : dict
        The resolved config: ``allocate``, ``cluster``, ``paths`` and ``profile.path`` (a path, a list of
        paths to allocate several models together, or null for the run folder's profile).
    run_dir : Path
        The run folder; the plan goes to :attr:`RunPaths.own_plan`, its picture to :attr:`RunPaths.plan_png`.

    Returns
    -------
    dict
        Plan path, plot path, world size and the solve's figures (JSON-able).

    Raises
    ------
    ConfigError
        Invalid ``allocate`` or ``cluster`` settings (every problem in one message).
    AllocationError, AllocationInfeasibleError
        See :func:`hpcsplit.allocation.solve.allocate`.
    """
    settings = AllocateSettings.from_config(cfg)
    cluster = ClusterSpec.from_config(cfg.get("cluster") or {})
    paths = RunPaths.from_config(cfg, run_dir)
    cal = calibration_for(paths.calibration, paths.calibration_given)
    profiles = [read_profile(p) for p in paths.profiles]
    if settings.rate_rps is not None:  # [Note: choosing by prediction] in hpcsplit.allocation.choose
        return _choose(cfg, settings, cluster, paths, cal, profiles)
    alloc = allocate(profiles, cluster, settings, frontend_s_per_request=frontend_s_per_request(cal))
    plan = alloc.to_plan()
    plan_path = plan.save(paths.own_plan)
    png = plot_plan(plan, paths.plan_png)
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
        "limit_hit": alloc.solve.get("limit_hit"),
        "clock_hit": alloc.solve.get("clock_hit"),
        "solver": alloc.solve.get("solver"),
    }


def _choose(cfg: dict[str, Any], settings: AllocateSettings, cluster: ClusterSpec, paths: RunPaths,
            cal: Calibration, profiles: list[Profile]) -> dict[str, Any]:
    """``allocate.rate_rps``: the candidate split and plan with the best simulated goodput (or fewest devices)."""
    if len(profiles) != 1:
        raise AllocationError(f"allocate.rate_rps chooses the split of one switchboard; found {len(profiles)} "
                              "profiles (profile.path): allocate one model at a time")
    if not (paths.switchboard / LAYOUT_FILE).is_file():
        raise AllocationError(f"allocate.rate_rps simulates the switchboard's dataflow: {paths.switchboard} has no "
                              f"{LAYOUT_FILE}; pass switchboard=PATH (the one the profile was measured on)")
    layout, sha = load_layout(paths.switchboard)
    if profiles[0].meta.switchboard_sha256 and profiles[0].meta.switchboard_sha256 != sha:
        raise AllocationError(f"the profile was measured on switchboard {profiles[0].meta.switchboard_sha256[:12]} "
                              f"but {paths.switchboard} is {sha[:12]}; pass the matching switchboard=PATH")
    bind = binds_cores(cfg)
    cores = ("" if cluster.gpus_per_node else "; ranks simulated bound to cores (simulate.bind, launcher.mpiexec_args)"
             if bind else "; ranks simulated as the kernel places them (simulate.bind=core to bind them)")
    log.info("choosing the split by prediction at %g req/s within %g ms; %s%s", settings.rate_rps, settings.slo_ms,
             cal.describe(), cores)
    choice = choose(profiles[0], cluster, settings, SimGraph.from_layout(layout), cal, ServePolicy.from_config(cfg),
                    sha, log=lambda m: log.info("%s", m), bind_cores=bind)
    plan_path = choice.plan.save(paths.own_plan)
    png = plot_plan(choice.plan, paths.plan_png)
    text = choice.table()
    print(f"candidate splits at {settings.rate_rps:g} req/s, SLO {settings.slo_ms:g} ms "
          f"({settings.objective}):\n{text}", flush=True)
    log.info("plan written to %s\n%s", plan_path, choice.plan.format())
    return {"plan": str(plan_path), "plot": str(png) if png else None, "world_size": choice.plan.world_size,
            "chosen": choice.chosen, "why": choice.why, "candidates": list(choice.rows), "table": text}
