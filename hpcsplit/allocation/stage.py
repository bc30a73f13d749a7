"""Stage ``allocate``: a profile and a cluster in, ``plan.json`` (and its picture) out.

The one place of the allocation folder that reads the config dict: ``cfg["allocate"]`` becomes
:class:`~hpcsplit.allocation.settings.AllocateSettings`, ``cfg["cluster"]`` a
:class:`~hpcsplit.core.cluster.ClusterSpec`, the file names a :class:`~hpcsplit.core.paths.RunPaths`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hpcsplit.allocation.settings import AllocateSettings
from hpcsplit.allocation.solve import allocate
from hpcsplit.allocation.to_plan import plot_plan
from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.profile_format import read_profile

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
    alloc = allocate([read_profile(p) for p in paths.profiles], cluster, settings)
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
        "time_limit_hit": alloc.solve.get("time_limit_hit"),
        "solver": alloc.solve.get("solver"),
    }
