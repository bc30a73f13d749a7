"""Leximin stages over an integer program: Ogryczak's sorted sums, one MILP per stage (internal).

[Note: leximin stages]
Leximin uses Ogryczak's sorted-sum stages: stage k maximises the sum of the k smallest normalised
throughputs ``y_c = T_c / w_c`` (``max k r - sum_c d_c, d_c >= r - y_c, d_c >= 0``) with the sums
of stages 1..k-1 fixed (minus a small tolerance).  This gives the lexicographically largest sorted
vector without guessing which component is the bottleneck.  The program under the stages is a
:class:`_Base` (variables z, rows ``A z <= b``, normalised throughputs ``Y z``, replicas ``R z``):
the pattern master of :mod:`hpcsplit.allocation.patterns`, or the per-device formulation of
:mod:`hpcsplit.allocation.device_solver`.  Each stage's MILP goes through cvxpy and the configured
solver, HiGHS warm-started from the previous stage's solution.

[Note: deterministic limits]
The same profile and cluster must give the same plan on any machine and under any load.  A wall-clock
limit breaks that as soon as it stops a search: a busy login node explores fewer branch-and-bound
nodes in the same second, and keeps another incumbent.  So each stage's MILP is bounded by its
*node* count (``stage_node_limit``; stage 1, which fixes the minimum, gets twice), which is the
same work on any machine, and the wall-clock limits (``stage_time_limit_s``, ``time_limit_s``) sit
well above it as safety nets.  When a wall-clock limit does stop the search (a stage's solver, the
stage loop, stage 1's local search, or an exact pricing), :func:`_leximin` records it in ``clock``,
and the plan says that it may differ on a faster or slower machine (``Solution.clock_hit``).
HiGHS runs on one thread: on several it explores another tree, and the plan would depend on the
machine's core count (at 256 GPUs, 1, 2 and 8 threads gave three different placements).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.sparse as sp

from hpcsplit.allocation.packing import Instance, Pattern

__all__ = ["Solution", "StageInfo"]

log = logging.getLogger(__name__)

PROGRESS_AFTER_S = 2.0  # a solve that has run this long logs a line after each stage
_IMPROVE_ROUNDS = 8  # local-search rounds around stage 1's integer solution
_IMPROVE_GAP = 0.05  # ... when it is this far below the LP bound (few devices per component)


@dataclass(frozen=True, slots=True)
class StageInfo:
    """One leximin stage: the MILP's value, the LP bound, and how the solve ended."""

    k: int
    value: float  # sum of the k smallest normalised throughputs reached
    bound: float  # upper bound (converged LP, or Lagrangian bound); inf if unknown
    status: str
    solve_s: float
    n_patterns: int

    @property
    def gap(self) -> float:
        if not math.isfinite(self.bound) or self.bound <= 0:
            return 0.0
        return max(0.0, (self.bound - self.value) / self.bound)


@dataclass(frozen=True, slots=True)
class Solution:
    """Patterns chosen per kind (with device counts) and the leximin figures."""

    chosen: tuple[tuple[tuple[Pattern, int], ...], ...]  # per kind: (pattern, devices)
    throughput_rps: tuple[float, ...]  # per component
    stages: tuple[StageInfo, ...]
    mode: str  # "enumerate" | "generate" | "per-device"
    solver: str
    solve_s: float
    n_patterns: int
    limit_hit: bool = False  # a stage stopped at a limit (nodes or wall clock) before proving its optimum
    clock: tuple[str, ...] = field(default_factory=tuple)  # what the wall clock stopped ([Note: deterministic limits])
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def clock_hit(self) -> bool:
        """True when a wall-clock limit changed the search: the plan may differ on another machine."""
        return bool(self.clock)

    @property
    def gap(self) -> float:
        """Relative gap of stage 1 (the smallest normalised throughput) to its upper bound."""
        return self.stages[0].gap if self.stages else 0.0

    @property
    def max_gap(self) -> float:
        """Largest relative gap over all stages (later stages sum many components: looser bounds)."""
        return max((s.gap for s in self.stages), default=0.0)


@dataclass(slots=True)
class _Base:
    """A MILP over variables z: base rows A z <= b, bounds, y = Y z (normalised), replicas R z."""

    A: sp.csr_matrix
    b: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integer: np.ndarray  # bool per z
    Y: sp.csr_matrix  # n_active x N0
    R: sp.csr_matrix  # n_comp x N0


def _stage(base: _Base, k: int, fixed: Mapping[int, float], *, slack: float | None):
    """Matrices of leximin stage k (maximise the sum of the k smallest y) with ``fixed`` stages.

    ``fixed`` maps j -> S_j, the sum of the j smallest already reached.  Variables:
    ``[z, r_j for j in ks, d_j (n_act each) for j in ks, (slack s)]`` with ``ks = sorted(fixed) + [k]``.
    Stage 1 alone is the plain max-min ``max r, r <= y_c`` (no d: the same optimum, an easier MILP).
    """
    ks = [*sorted(fixed), k]
    m = len(ks)
    n0 = base.A.shape[1]
    na = base.Y.shape[0]
    nc = base.R.shape[0]
    ns = nc if slack is not None else 0
    nd = 0 if ks == [1] else m * na
    nv = n0 + m + nd + ns
    # assembled as one COO matrix (rows: base, r_t - Y z - d_t <= 0 per stage t, fixed stages, replicas)
    Ac, Yc, Rc = base.A.tocoo(), base.Y.tocoo(), base.R.tocoo()
    nb = base.A.shape[0]
    rows_i = [Ac.row]
    cols_i = [Ac.col]
    vals = [Ac.data]
    ar = np.arange(na)
    for t in range(m):
        off = nb + t * na
        rows_i += [Yc.row + off, ar + off]
        cols_i += [Yc.col, np.full(na, n0 + t)]
        vals += [-Yc.data, np.ones(na)]
        if nd:
            rows_i.append(ar + off)
            cols_i.append(n0 + m + t * na + ar)
            vals.append(-np.ones(na))
    b_parts = [base.b, np.zeros(m * na)]
    row = nb + m * na
    # -(j r_j - sum d_j) <= -S_j  for the fixed stages
    for t, j in enumerate(ks[:-1]):
        rows_i += [np.array([row]), np.full(na, row)]
        cols_i += [np.array([n0 + t]), n0 + m + t * na + ar]
        vals += [np.array([-float(j)]), np.ones(na)]
        b_parts.append(np.array([-fixed[j]]))
        row += 1
    # replicas: -R z (- s) <= -1
    rows_i.append(Rc.row + row)
    cols_i.append(Rc.col)
    vals.append(-Rc.data)
    if ns:
        rows_i.append(np.arange(nc) + row)
        cols_i.append(n0 + m + nd + np.arange(nc))
        vals.append(-np.ones(nc))
    b_parts.append(-np.ones(nc))
    A = sp.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows_i), np.concatenate(cols_i))), shape=(row + nc, nv)
    )
    b = np.concatenate(b_parts)
    c = np.zeros(nv)
    c[n0 + m - 1] = -k
    if nd:
        c[n0 + m + (m - 1) * na : n0 + m + m * na] = 1.0
    if ns:
        c[n0 + m + nd :] = slack
    lb = np.concatenate([base.lb, np.zeros(m + nd + ns)])
    ub = np.concatenate([base.ub, np.full(m + nd + ns, np.inf)])
    rows = {"base": (0, base.A.shape[0]), "d": (base.A.shape[0], base.A.shape[0] + m * na)}
    rows["rep"] = (A.shape[0] - nc, A.shape[0])
    return c, A, b, lb, ub, rows


def _sum_smallest(y: np.ndarray, k: int) -> float:
    return float(np.sort(y)[:k].sum())


def _solver_opts(solver: str, time_limit_s: float, mip_rel_gap: float, node_limit: int | None) -> dict:
    t = max(0.05, float(time_limit_s))
    # (SCIPY gets none: scipy reports a stop at its node limit as an unknown status, which cvxpy takes for an error)
    nodes = {} if node_limit is None else {"HIGHS": {"mip_max_nodes": int(node_limit)},
                                           "SCIP": {"limits/nodes": int(node_limit)}}.get(solver, {})
    if solver == "HIGHS":  # one thread: HiGHS's search, and so the plan, otherwise depends on the core count
        return {"time_limit": t, "mip_rel_gap": mip_rel_gap, "output_flag": False, "threads": 1, **nodes}
    if solver == "SCIPY":
        return {"scipy_options": {"time_limit": t, "mip_rel_gap": mip_rel_gap, **nodes}}
    if solver == "SCIP":
        return {"scip_params": {"limits/time": t, "limits/gap": mip_rel_gap, **nodes}}
    return {}


def _stopped_by_clock(prob: Any, solver: str, node_limit: int | None, elapsed_s: float, time_limit_s: float) -> bool:
    """Whether a solve that did not prove its optimum was stopped by the wall clock, not its node limit.

    HiGHS reports its node count.  For other solvers (SCIP) a solve that ran to (nearly) its time limit counts as
    stopped by it: the solver's own solve time when cvxpy reports it, else ``elapsed_s``.  Without a node limit
    (SCIPY never has one, see :func:`_solve_milp`) any stop is the clock's."""
    if node_limit is None:
        return True
    stats = prob.solver_stats
    if solver == "HIGHS":
        st = stats.extra_stats if stats is not None else None
        raw = st.get("mip_node_count") if isinstance(st, dict) else getattr(st, "mip_node_count", None)
        if isinstance(raw, (int, float, np.integer)):
            return int(raw) < int(node_limit)
    took = stats.solve_time if stats is not None and isinstance(stats.solve_time, (int, float)) else elapsed_s
    return took >= 0.9 * max(0.05, time_limit_s)


def _run_solver(prob: Any, solver: str, warm: bool, opts: dict, extra: dict | None) -> None:
    with warnings.catch_warnings():  # a time-limited solve warns "inaccurate"; we check the point
        warnings.filterwarnings("ignore", message="Solution may be inaccurate")
        prob.solve(solver=solver, warm_start=warm, **opts, **(extra or {}))


def _solve_milp(
    base: _Base,
    k: int,
    fixed: Mapping[int, float],
    solver: str,
    time_limit_s: float,
    mip_rel_gap: float,
    extra: dict | None = None,
    start: np.ndarray | None = None,
    node_limit: int | None = None,
) -> tuple[np.ndarray | None, str, float, bool]:
    """Stage k's MILP with cvxpy; returns (z or None, status, the solver's upper bound or inf, whether
    the wall clock stopped it before ``node_limit`` did: [Note: deterministic limits]).

    ``start``: a point z satisfying stage k's constraints (the previous stage's solution), handed
    to HiGHS as its first incumbent so that it prunes from the start (other solvers ignore it).
    """
    import cvxpy as cp

    c, A, b, lb, ub, _ = _stage(base, k, fixed, slack=None)
    n0 = base.A.shape[1]
    int_idx = np.flatnonzero(base.integer)
    cont_idx = np.setdiff1d(np.arange(len(c)), int_idx)
    xi = cp.Variable(len(int_idx), integer=True) if len(int_idx) else None
    xc = cp.Variable(len(cont_idx)) if len(cont_idx) else None
    perm = np.concatenate([int_idx, cont_idx])
    parts = [v for v in (xi, xc) if v is not None]
    zp = cp.hstack(parts) if len(parts) > 1 else parts[0]
    Ap = A[:, perm]
    cons = [Ap @ zp <= b, zp >= lb[perm]]
    fin = np.isfinite(ub[perm])
    if fin.any():
        sel = np.flatnonzero(fin)
        cons.append(zp[sel] <= ub[perm][sel])
    prob = cp.Problem(cp.Minimize(c[perm] @ zp), cons)
    warm = False
    if start is not None and solver == "HIGHS":
        x0 = _stage_point(base, k, fixed, start, len(c))[perm]
        warm = _seed_highs(prob, parts, x0)
    if solver not in ("HIGHS", "SCIP"):  # no node limit (_solver_opts): only the clock bounds the solve
        node_limit = None
    opts = _solver_opts(solver, time_limit_s, mip_rel_gap, node_limit)
    t0 = time.perf_counter()
    try:
        try:
            _run_solver(prob, solver, warm, opts, extra)
        except cp.error.SolverError:
            if solver != "HIGHS":
                raise
            # HiGHS keeps one thread scheduler per process, and one that an earlier solve (not ours) sized to
            # several threads refuses threads=1: start a new one and solve again, cold
            _reset_highs_scheduler()
            getattr(prob, "_solver_cache", {}).pop("HIGHS", None)
            t0 = time.perf_counter()
            _run_solver(prob, solver, False, opts, extra)
        except Exception:
            if not warm:
                raise
            # the warm start went through cvxpy internals; solve again cold rather than fail
            getattr(prob, "_solver_cache", {}).pop("HIGHS", None)
            t0 = time.perf_counter()
            _run_solver(prob, solver, False, opts, extra)
    except cp.error.SolverError as e:  # (a solver stopped by its time limit with no point may end here too)
        took = time.perf_counter() - t0
        return None, f"solver error: {e}", math.inf, took >= 0.9 * max(0.05, time_limit_s)
    upper = _dual_bound(prob)
    clock = str(prob.status) not in ("optimal", "infeasible", "unbounded") and _stopped_by_clock(
        prob, solver, node_limit, time.perf_counter() - t0, time_limit_s)
    if zp.value is None:
        return None, str(prob.status), upper, clock
    z = np.empty(len(c))
    z[perm] = np.asarray(zp.value).ravel()
    z = z[:n0]
    z[base.integer] = np.round(z[base.integer])
    # a solver stopped by its time limit may hand back a point that is not a solution
    if not _feasible(base, z, k, fixed):
        return None, f"{prob.status} (no feasible integer point)", upper, clock
    return z, str(prob.status), upper, clock


def _stage_point(base: _Base, k: int, fixed: Mapping[int, float], z: np.ndarray, nv: int) -> np.ndarray:
    """Stage k's variables ``[z, r_j, d_j]`` (see :func:`_stage`) at the integer point ``z``:
    r_j is the j-th smallest y, d_jc = max(0, r_j - y_c), so ``j r_j - sum d_j`` is the sum of
    the j smallest."""
    ks = [*sorted(fixed), k]
    m = len(ks)
    n0 = base.A.shape[1]
    y = base.Y @ z
    ys = np.sort(y)
    x = np.zeros(nv)
    x[:n0] = z
    for t, j in enumerate(ks):
        x[n0 + t] = ys[j - 1]
    if nv > n0 + m:
        na = len(y)
        for t, j in enumerate(ks):
            x[n0 + m + t * na : n0 + m + (t + 1) * na] = np.maximum(0.0, ys[j - 1] - y)
    return x


def _reset_highs_scheduler() -> None:
    with contextlib.suppress(Exception):  # an older highspy: the retry fails as the first solve did
        import highspy as hp

        hp.Highs.resetGlobalScheduler(True)


def _seed_highs(prob: Any, parts: Sequence[Any], x0: np.ndarray) -> bool:
    """Put ``x0`` (the values of ``parts``, concatenated) where cvxpy's HiGHS interface looks for
    a warm start: its solver cache, which the first compilation resets, so compile first.

    The constraints are linear, so HiGHS's columns are the variables' entries in the order cvxpy
    lists the problem's variables; no warm start (False) when that is not ``parts``.
    """
    try:
        import highspy as hp
    except ImportError:  # pragma: no cover - cvxpy's HIGHS needs highspy
        return False
    if [v.id for v in prob.variables()] != [v.id for v in parts]:
        return False
    try:  # cvxpy-internal cache (checked on cvxpy 1.9): anything unexpected means no warm start
        prob.get_problem_data("HIGHS")
        sol = hp.HighsSolution()
        sol.col_value = [float(v) for v in x0]
        sol.value_valid = True
        cache = prob._solver_cache
        if not isinstance(cache, dict):
            return False
        cache["HIGHS"] = (None, None, {"model_status": "kOptimal", "solution": sol})
    except Exception:  # noqa: BLE001 - a warm start is an optimisation only
        return False
    return True


def _dual_bound(prob) -> float:
    """The solver's bound on the stage objective (a maximisation), inf when unknown."""
    st = prob.solver_stats.extra_stats if prob.solver_stats is not None else None
    raw: Any = None
    if st is not None:
        raw = st.get("mip_dual_bound") if isinstance(st, dict) else getattr(st, "mip_dual_bound", None)
    try:
        v = float(raw)
    except (TypeError, ValueError):
        return math.inf
    return -v if math.isfinite(v) else math.inf


def _feasible(base: _Base, z: np.ndarray, k: int, fixed: Mapping[int, float]) -> bool:
    if np.any(z < base.lb - 1e-6) or np.any(z > base.ub + 1e-6):
        return False
    if np.any(base.A @ z > base.b + 1e-6 * np.maximum(1.0, np.abs(base.b))):
        return False
    if np.any(base.R @ z < 1 - 1e-6):
        return False
    y = base.Y @ z
    return all(_sum_smallest(y, j) >= f - 1e-6 * max(1.0, abs(f)) for j, f in fixed.items())


def _leximin(
    instance: Instance,
    base_fn: Callable[[], _Base],
    *,
    solver: str,
    time_limit_s: float,
    mip_rel_gap: float,
    tol: float,
    before_stage: Callable[[int, Mapping[int, float]], float] | None = None,
    n_patterns: Callable[[], int] = lambda: 0,
    stage_time_limit_s: float = math.inf,
    stage_node_limit: int | None = None,
    complete: bool = True,
    levels: int | None = None,
    fallback: Callable[[], np.ndarray | None] | None = None,
    improve: Callable[[np.ndarray], bool] | None = None,
    shrink: Callable[[np.ndarray], np.ndarray] | None = None,
    clock: list[str] | None = None,
) -> tuple[np.ndarray, list[StageInfo], bool]:
    """Run the leximin stages; ``before_stage(k, fixed)`` may grow the pool and returns an LP bound.

    ``levels``: solve stages 1..levels exactly, then one last stage (the total) with those fixed;
    None solves every stage (exact leximin).  ``stage_node_limit`` bounds each stage's MILP (stage 1:
    twice); ``clock`` collects what a wall-clock limit stopped ([Note: deterministic limits]).
    """
    na = len(instance.active)
    fixed: dict[int, float] = {}
    stages: list[StageInfo] = []
    t0 = time.perf_counter()
    z_best: np.ndarray | None = None
    hit = False
    clock = clock if clock is not None else []
    m = na if levels is None else max(1, min(int(levels), na))
    seq = list(range(1, m + 1)) + ([na] if m < na else [])
    for pos, k in enumerate(seq):
        if pos and time.perf_counter() - t0 > time_limit_s:
            hit = True
            clock.append(f"time_limit_s={time_limit_s:g} ran out before stage {k} (of {seq[-1]})")
            break
        bound = before_stage(k, fixed) if before_stage else math.inf
        base = base_fn()
        left = time_limit_s - (time.perf_counter() - t0)
        # share what is left over the remaining stages, the earlier ones getting more
        cap = stage_time_limit_s * (2 if pos == 0 else 1)  # stage 1 fixes the minimum: it gets more
        budget = max(0.1, min(cap, left * 2 / (len(seq) - pos + 1)))
        nodes = None if stage_node_limit is None else int(stage_node_limit) * (2 if pos == 0 else 1)
        ts = time.perf_counter()
        if z_best is not None:
            z_best = _pad(z_best, base)
            have = _sum_smallest(base.Y @ z_best, k)
            if have >= bound * (1 - mip_rel_gap):  # the last solution already reaches the LP bound
                stages.append(StageInfo(k, have, bound, "optimal", time.perf_counter() - ts, n_patterns()))
                fixed[k] = have - tol * max(1.0, abs(have))
                continue
        start = z_best
        if start is None and fallback is not None:  # stage 1: the rounded LP solution, if it is one
            start = fallback()
            if start is not None:
                start = _pad(start, base)
                if not _feasible(base, start, k, fixed):
                    start = None
        z, status, upper, stopped = _solve_milp(
            base, k, fixed, solver, budget, mip_rel_gap, start=start, node_limit=nodes)
        if stopped:
            clock.append(f"stage {k} stopped at its wall-clock limit ({budget:.2g} s)"
                         + ("" if nodes is None else f" before its node limit ({nodes})"))
        if complete:  # the solver's bound covers every pattern only when the pool has them all
            bound = min(bound, upper)
        if status != "optimal":
            hit = True
            # a stopped solver may return less than what we already hold: the previous stage's
            # solution (it satisfies every fixed stage) or, at the start, the rounded LP solution
            held = z_best if z_best is not None else (fallback() if fallback else None)
            if held is not None:
                held = _pad(held, base)
            if (
                held is not None
                and _feasible(base, held, k, fixed)
                and (z is None or _sum_smallest(base.Y @ held, k) > _sum_smallest(base.Y @ z, k))
            ):
                z = held
        if z is None:
            raise _Infeasible(status)
        val = _sum_smallest(base.Y @ z, k)
        rounds = 0
        while (
            improve is not None
            and pos == 0
            and rounds < _IMPROVE_ROUNDS
            and bound < math.inf
            and val < bound * (1 - _IMPROVE_GAP)
        ):
            if time.perf_counter() - t0 >= time_limit_s / 2:
                clock.append(f"stage 1's local search stopped at half of time_limit_s={time_limit_s:g}")
                break
            if not improve(z):
                break
            # local search over patterns: widen the pool around this solution, solve stage 1 again
            rounds += 1
            base = base_fn()
            z = _pad(z, base)
            left = time_limit_s - (time.perf_counter() - t0)
            lim = max(0.1, min(cap, left / 2))
            z2, status2, _, stopped = _solve_milp(
                base, k, fixed, solver, lim, mip_rel_gap, start=z, node_limit=nodes
            )
            if stopped:
                clock.append(f"stage 1's local search round {rounds} stopped at its wall-clock limit ({lim:.2g} s)")
            better = z2 is not None and _sum_smallest(base.Y @ z2, k) > val * (1 + 1e-9)
            if better and z2 is not None:
                z, status, val = z2, status2, _sum_smallest(base.Y @ z2, k)
            if shrink is not None:
                z = shrink(z)  # drop the unused new patterns: later stages stay small
            if not better:
                break
        z_best = z
        stages.append(StageInfo(k, val, bound, status, time.perf_counter() - ts, n_patterns()))
        fixed[k] = val - tol * max(1.0, abs(val))
        if (now := time.perf_counter()) - t0 >= PROGRESS_AFTER_S:  # long work shows progress
            log.info("allocate: leximin stage %d of %d (the %d smallest) %s in %.1f s; %.0f s so far (time_limit_s %g)",
                     pos + 1, len(seq), k, status, now - ts, now - t0, time_limit_s)
    assert z_best is not None
    return z_best, stages, hit


def _pad(z: np.ndarray, base: _Base) -> np.ndarray:
    n0 = base.A.shape[1]
    return np.concatenate([z, np.zeros(n0 - len(z))]) if len(z) < n0 else z


class _Infeasible(Exception):
    """Stage 1 had no feasible integer solution."""
