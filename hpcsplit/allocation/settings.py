"""The allocate stage's settings (``conf/allocate/default.yaml``) as a frozen dataclass.

Two ways in, one set of checks (:func:`build_settings`, through :class:`hpcsplit.core.settings.Checker`):
the stage builds :class:`AllocateSettings` with :meth:`AllocateSettings.from_config` (one
:class:`~hpcsplit.errors.ConfigError` listing every problem), and the Python API
``hpcsplit.allocate(profile, cluster, **options)`` lays its options over the YAML defaults
(:func:`hpcsplit.core.settings.group_defaults`) and lists these problems together with those that
need the profile (unknown component names, a profile measured on another device kind).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from hpcsplit.core.settings import Checker, group_defaults
from hpcsplit.errors import ConfigError

__all__ = ["MILP_SOLVERS", "MODES", "OBJECTIVES", "AllocateSettings", "build_settings"]

MODES = ("auto", "enumerate", "generate", "per-device")
OBJECTIVES = ("goodput", "devices")
MILP_SOLVERS = ("HIGHS", "SCIPY", "SCIP", "GUROBI", "CPLEX", "CBC", "GLPK_MI")  # named when one is missing


@dataclass(frozen=True, slots=True)
class AllocateSettings:
    """Every allocate setting, checked (meanings: the comments of ``conf/allocate/default.yaml``).

    Examples
    --------
    >>> s = AllocateSettings.defaults(slo_ms=20)
    >>> s.solver, s.slo_ms, s.slo_of("text")
    ('HIGHS', 20.0, 20.0)
    """

    solver: str  # cvxpy MILP solver, upper case
    time_limit_s: float
    stage_time_limit_s: float | None  # None (or 0): only time_limit_s
    stage_node_limit: int | None  # branch-and-bound nodes per stage (stage 1: twice); None: only the clocks
    mip_rel_gap: float
    leximin_tol: float
    leximin_levels: int | None
    slo_ms: float | dict[str, float | None] | None
    slo_quantile: float
    demand_weights: dict[str, float]
    util_limit: float
    frontend_cores: int
    max_ranks_per_gpu: int | None  # None (or 0): from the cores per GPU
    cpu_mem_fraction: float
    cpu_oversubscribe: bool
    cpu_timeshare: bool
    mode: str
    enumerate_limit: int
    max_patterns: int
    max_cg_iters: int
    rate_rps: float | None = None  # a demanded rate: choose the split and plan by simulated goodput (choose.py)
    objective: str = "goodput"  # with rate_rps: "goodput" (the highest) or "devices" (the fewest meeting the SLO)
    sim_workers: int | None = None  # with rate_rps: processes the candidates' simulations are spread over (None: auto)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> AllocateSettings:
        """The settings of ``cfg["allocate"]`` (the whole resolved config).

        Raises
        ------
        ConfigError
            Listing every unknown key (with the closest valid one), wrong type and value out of range.
        """
        node = cfg.get("allocate") or {}
        return cls._raising({**group_defaults("allocate"), **node} if isinstance(node, Mapping) else node)

    @classmethod
    def defaults(cls, **overrides: Any) -> AllocateSettings:
        """``conf/allocate/default.yaml`` with ``overrides`` laid over it (the same checks)."""
        return cls._raising({**group_defaults("allocate"), **overrides})

    @classmethod
    def _raising(cls, values: Mapping[str, Any] | None) -> AllocateSettings:
        settings, problems = build_settings(values)
        if problems:
            raise ConfigError("invalid allocate settings:\n  - " + "\n  - ".join(problems))
        return settings

    def to_values(self) -> dict[str, Any]:
        """The settings as a mapping of YAML keys (what :func:`build_settings` takes)."""
        return asdict(self)

    def slo_of(self, component: str) -> float | None:
        """The latency SLO (ms) of one component, None without one."""
        slo = self.slo_ms
        if isinstance(slo, Mapping):
            v = slo.get(component)
            return None if v is None else float(v)
        return None if slo is None else float(slo)


def build_settings(values: Mapping[str, Any] | None) -> tuple[AllocateSettings, list[str]]:
    """Settings from a mapping of every allocate setting, and every problem found (empty: valid).

    ``values`` holds every key of ``conf/allocate/default.yaml`` (there are no defaults here: lay
    overrides over :func:`~hpcsplit.core.settings.group_defaults`).  Where a value is wrong the returned
    settings hold a placeholder: use them only when there is no problem.
    """
    c = Checker("allocate", values, [f.name for f in fields(AllocateSettings)])
    solver = c.string("solver").upper()
    if solver:
        installed = _installed_solvers()
        if solver not in installed:
            mip = [s for s in MILP_SOLVERS if s in installed]
            c.problem(f"allocate.solver {solver!r} is not installed; MILP solvers here: {mip}")
    settings = AllocateSettings(
        solver=solver,
        time_limit_s=c.number("time_limit_s", lo=0, lo_open=True),
        stage_time_limit_s=c.number("stage_time_limit_s", lo=0, none=True) or None,
        stage_node_limit=c.integer("stage_node_limit", lo=1, none=True),
        mip_rel_gap=c.number("mip_rel_gap", lo=0),
        leximin_tol=c.number("leximin_tol", lo=0),
        leximin_levels=c.integer("leximin_levels", lo=1, none=True),
        slo_ms=_slo(c),
        slo_quantile=c.number("slo_quantile", lo=0, hi=1, lo_open=True),
        demand_weights=_weights(c),
        util_limit=c.number("util_limit", lo=0, lo_open=True),
        frontend_cores=c.integer("frontend_cores", lo=0),
        max_ranks_per_gpu=c.integer("max_ranks_per_gpu", lo=0, none=True) or None,
        cpu_mem_fraction=c.number("cpu_mem_fraction", lo=0, hi=1, lo_open=True),
        cpu_oversubscribe=c.boolean("cpu_oversubscribe"),
        cpu_timeshare=c.boolean("cpu_timeshare"),
        mode=c.choice("mode", MODES),
        enumerate_limit=c.integer("enumerate_limit", lo=0),
        max_patterns=c.integer("max_patterns", lo=1),
        max_cg_iters=c.integer("max_cg_iters", lo=0),
        rate_rps=c.number("rate_rps", lo=0, lo_open=True, none=True),
        objective=c.choice("objective", OBJECTIVES),
        sim_workers=c.integer("sim_workers", lo=1, hi=1024, none=True),
    )
    if settings.rate_rps is not None and not isinstance(settings.slo_ms, float):
        c.problem(f"allocate.rate_rps = {settings.rate_rps:g} chooses the split by the share of requests within "
                  f"allocate.slo_ms, which needs one end-to-end SLO in ms (found {settings.slo_ms!r})")
    return settings, c.problems


def _slo(c: Checker) -> float | dict[str, float | None] | None:
    slo = c.get("slo_ms")
    if isinstance(slo, Mapping):
        if any(not _positive(v) for v in slo.values() if v is not None):
            c.problem(f"allocate.slo_ms {dict(slo)}: each SLO must be a positive number of ms (or null)")
            return None
        return {str(k): None if v is None else float(v) for k, v in slo.items()}
    if slo is None:
        return None
    if not _positive(slo):
        c.problem(
            f"allocate.slo_ms = {slo!r}: give a positive latency in ms, a mapping component -> ms, or null"
        )
        return None
    return float(slo)


def _weights(c: Checker) -> dict[str, float]:
    w = c.get("demand_weights")
    if w is None:
        return {}
    if not isinstance(w, Mapping):
        c.problem(f"allocate.demand_weights = {w!r}: needs a mapping component -> relative request rate")
        return {}
    bad = {k: v for k, v in w.items() if not _finite(v) or v < 0}
    if bad:
        c.problem(f"allocate.demand_weights {bad}: weights must be finite numbers >= 0")
    return {str(k): float(v) for k, v in w.items() if k not in bad}


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _positive(v: Any) -> bool:
    return _finite(v) and v > 0


def _installed_solvers() -> list[str]:
    import cvxpy as cp

    return list(cp.installed_solvers())
