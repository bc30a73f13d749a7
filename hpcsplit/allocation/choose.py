"""Choosing the split and the plan by prediction: ``allocate.rate_rps`` with ``allocate.slo_ms``.

[Note: choosing by prediction]
With a demanded rate and a latency SLO, the allocate stage does not stop at the throughput-optimal plan of the
exported split.  It considers candidate splits of the switchboard (:func:`candidates`):

- ``split``: every component on ranks of its own, as exported;
- ``whole``: the unsplit model (the switchboard's whole program) on every rank;
- for each set of parallel branches (components with the same sources, none reaching another), those
  branches as one group (``[Note: component groups]``): that region left unsplit;
- for each pair of consecutive stages (a component whose only consumer has it as its only source), the two as
  one group: one stage fewer;
- for each chain of three or more such stages, every other stage count: the chain cut into ``m`` contiguous
  groups (``m`` from 1 to the chain's length less 2), the cuts that make the slowest group fastest (profiled
  batch-1 latency at the fewest threads or smallest slice; the earliest cuts on a tie).

Each candidate is allocated as the allocator always does (its groups profiled as the sum of their members at
each batch size and slice, :func:`merged_profile`), on every device count from one device up to the cluster's.
The allocator maximises throughput, which on CPU favours one thread per rank; so each candidate gets several
plans, made with the SLO applied to each component at 1, 0.7, 0.5 and 0.35 times the end-to-end SLO (a tighter
one leaves only faster options: more threads, larger slices, smaller batches), and every distinct plan is
simulated at the demanded rate with Poisson arrivals (:mod:`hpcsplit.core.simulator`, the calibration's costs);
a candidate's figures are those of its best plan.  The plans of every candidate at one device count are
simulated together, spread over ``allocate.sim_workers`` processes (``[Note: simulations in parallel]``).
``objective: goodput`` picks the highest goodput (requests done within the SLO per second of the offered
schedule: candidates that meet the SLO for the same requests tie) on the
whole cluster, then the lowest p50, then the fewest devices; ``objective: devices`` the fewest devices
whose simulated share of requests within the SLO reaches ``slo_quantile``, then the highest goodput.  The plan
carries the table of candidates and the reason in ``meta.choice``; the stage prints it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcsplit.allocation.settings import AllocateSettings
from hpcsplit.allocation.solve import allocate
from hpcsplit.core.calibration import Calibration
from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.grouping import group_name
from hpcsplit.core.load import arrival_times
from hpcsplit.core.plan import Plan
from hpcsplit.core.profile_format import ComponentProfile, Profile
from hpcsplit.core.sim_model import WHOLE, SimGraph, build_system
from hpcsplit.core.sim_pool import simulate_many
from hpcsplit.core.simulator import ServePolicy
from hpcsplit.errors import AllocationError, HpcsplitError

__all__ = ["Candidate", "Choice", "candidates", "choose", "frontend_s_per_request", "merged_profile"]

MIN_REQUESTS = 300  # simulated requests per candidate at the demanded rate (at least)
RUNS = 3  # simulations per candidate (jitter seeds); figures are their medians
PLAN_SLO_FACTORS = (1.0, 0.7, 0.5, 0.35)  # per-component SLOs (x the end-to-end one) a candidate's plans are made under


@dataclass(frozen=True, slots=True)
class Candidate:
    """One way to split the switchboard: ``groups`` of components one rank runs together (``("whole",)``: all)."""

    name: str
    groups: tuple[tuple[str, ...], ...]

    def served(self, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """Served name -> members, for every component of ``names``."""
        if self.groups == ((WHOLE,),):
            return {WHOLE: tuple(names)}
        out: dict[str, tuple[str, ...]] = {}
        grouped = {c for g in self.groups for c in g}
        for g in self.groups:
            out[group_name(g, names)] = tuple(c for c in names if c in g)
        for c in names:
            if c not in grouped:
                out[c] = (c,)
        return dict(sorted(out.items(), key=lambda kv: names.index(kv[1][0])))


def candidates(graph: SimGraph, weights: Mapping[str, float] | None = None) -> list[Candidate]:
    """``[Note: choosing by prediction]``'s candidates for a dataflow, in a fixed order (whole first); ``weights``
    (component -> batch-1 ms) balance a chain's stages (equal without)."""
    names = list(graph.names)
    out = [Candidate("whole", ((WHOLE,),))] if len(names) > 1 else []
    srcs: dict[str, set[str]] = {c: set() for c in names}
    dsts: dict[str, set[str]] = {c: set() for c in names}
    for s, _, d, _ in graph.edges:
        if d in srcs:
            srcs[d].add(s)
        if s in dsts:
            dsts[s].add(d)
    reach = {c: _reach(c, dsts) for c in names}
    by_src: dict[frozenset[str], list[str]] = {}
    for c in names:
        by_src.setdefault(frozenset(srcs[c]), []).append(c)
    for sib in by_src.values():
        par = [c for c in sib if not any(o in reach[c] for o in sib if o != c)]
        if 2 <= len(par) < len(names):
            out.append(Candidate(f"{group_name(par, names)} unsplit", (tuple(par),)))
    nxt: dict[str, str] = {}  # a -> b: consecutive stages (b is a's only consumer, a is b's only source)
    for a in names:
        if len(dsts[a]) == 1:
            (b,) = dsts[a]
            if b in srcs and srcs[b] == {a} and len(names) > 2:
                nxt[a] = b
                out.append(Candidate(f"{a}+{b} as one stage", ((a, b),)))
    w = weights or {}
    for a in names:
        if a in nxt.values():
            continue  # not the start of a chain
        chain = [a]
        while chain[-1] in nxt:
            chain.append(nxt[chain[-1]])
        for m in range(1, len(chain) - 1):
            if m == 1 and len(chain) == len(names):
                continue  # the whole model
            groups = tuple(g for g in _balanced(chain, [float(w.get(c, 1.0)) for c in chain], m) if len(g) > 1)
            out.append(Candidate(f"{chain[0]}..{chain[-1]} in {m} stage{'s' if m > 1 else ''}", groups))
    out.append(Candidate("split", ()))
    return out


def _balanced(chain: Sequence[str], w: Sequence[float], m: int) -> list[tuple[str, ...]]:
    """``chain`` cut into ``m`` contiguous groups whose largest total weight is the smallest (earliest cuts on ties).

    >>> _balanced("abcde", [1, 1, 1, 1, 4], 2)
    [('a', 'b', 'c', 'd'), ('e',)]
    """
    n = len(chain)
    pre = [0.0]
    for x in w:
        pre.append(pre[-1] + x)
    inf = math.inf
    best = [[inf] * (m + 1) for _ in range(n + 1)]  # best[j][k]: the first j cut into k groups
    cut = [[0] * (m + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, m + 1):
        for j in range(k, n - (m - k) + 1):
            for i in range(k - 1, j):
                v = max(best[i][k - 1], pre[j] - pre[i])
                if v < best[j][k]:
                    best[j][k], cut[j][k] = v, i
    groups, j = [], n
    for k in range(m, 0, -1):
        i = cut[j][k]
        groups.append(tuple(chain[i:j]))
        j = i
    return groups[::-1]


def _reach(c: str, dsts: Mapping[str, set[str]]) -> set[str]:
    seen, todo = set(), list(dsts.get(c, ()))
    while todo:
        x = todo.pop()
        if x not in seen and x in dsts:
            seen.add(x)
            todo.extend(dsts[x])
    return seen


def merged_profile(parts: Sequence[ComponentProfile], name: str) -> ComponentProfile:
    """A group's profile: its members one after the other on the same grid (``[Note: choosing by prediction]``).

    Latency: the sum of the members' runs, cell by cell and run by run; memory: the parameters of all and the
    largest member's activations; utilization (GPU): the members' weighted by their time; a cell is measured only
    where every member's is, out of memory where any member's is.
    """
    first = parts[0]
    for p in parts[1:]:
        if p.batch_sizes != first.batch_sizes or p.slices != first.slices or p.latency_ms.shape != first.latency_ms.shape:
            raise AllocationError(f"cannot group {[q.name for q in parts]}: their profiles have different grids; "
                                  "profile them together (one profile stage)")
    lat = np.sum([p.latency_ms for p in parts], axis=0)
    med = [np.nanmedian(np.where(np.isfinite(p.latency_ms), p.latency_ms, np.nan), axis=2)
           if np.isfinite(p.latency_ms).any() else np.full(p.latency_ms.shape[:2], np.nan) for p in parts]
    tot = np.sum(med, axis=0)
    util = np.sum([np.nan_to_num(p.utilization, nan=1.0) * m for p, m in zip(parts, med, strict=True)], axis=0)
    util = np.where(tot > 0, util / np.where(tot > 0, tot, 1.0), np.nan)
    if all(np.isnan(p.utilization).all() for p in parts):
        util = np.full_like(util, np.nan)
    params = sum(p.param_bytes for p in parts)
    act = np.max([p.peak_mem_bytes - p.param_bytes for p in parts], axis=0)
    return dataclasses.replace(
        first, name=name, latency_ms=lat, peak_mem_bytes=params + act, utilization=util,
        oom=np.any([p.oom for p in parts], axis=0), measured=np.all([p.measured for p in parts], axis=0),
        param_bytes=params, input_bytes_per_sample=first.input_bytes_per_sample,
        output_bytes_per_sample=parts[-1].output_bytes_per_sample,
        cpu_busy_fraction=first.cpu_busy_fraction, oom_inferred=np.any([p.oom_inferred for p in parts], axis=0))


@dataclass(frozen=True, slots=True)
class Choice:
    """The chosen plan and the table that says why."""

    plan: Plan
    rows: tuple[dict[str, Any], ...]
    chosen: str
    why: str

    def table(self) -> str:
        head = (f"{'candidate':<34} {'devices':>7} {'ranks':>5} {'within SLO':>10} {'goodput/s':>9} "
                f"{'p50 ms':>9} {'p99 ms':>9}  ")
        lines = [head, "-" * len(head)]
        for r in self.rows:
            if r.get("error"):
                lines.append(f"{r['candidate']:<34} {r['devices']:>7} {'-':>5}  not feasible: {r['error'][:80]}")
                continue
            lines.append(f"{r['candidate']:<34} {r['devices']:>7} {r['ranks']:>5} {r['within_slo']:>10.1%} "
                         f"{r['goodput_rps']:>9.2f} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f}  "
                         + ("<- chosen" if r.get("chosen") else ""))
        return "\n".join(lines) + f"\n{self.why}"


def device_counts(cluster: ClusterSpec) -> list[ClusterSpec]:
    """The cluster cut to 1, 2, ... devices (GPUs of one node, then whole nodes; CPU: nodes)."""
    if not cluster.is_gpu:
        return [dataclasses.replace(cluster, nodes=n) for n in range(1, cluster.nodes + 1)]
    out = [dataclasses.replace(cluster, nodes=1, gpus_per_node=k) for k in range(1, cluster.gpus_per_node + 1)]
    out += [dataclasses.replace(cluster, nodes=n) for n in range(2, cluster.nodes + 1)]
    return out


def _devices(c: ClusterSpec) -> int:
    return c.nodes * c.gpus_per_node if c.is_gpu else c.nodes


def choose(profile: Profile, cluster: ClusterSpec, settings: AllocateSettings, graph: SimGraph,
           calibration: Calibration, policy: ServePolicy, switchboard_sha256: str | None = None,
           log: Any = None, bind_cores: bool = False) -> Choice:
    """``[Note: choosing by prediction]``: the candidate split and plan to serve ``rate_rps`` within ``slo_ms`` (its
    ranks simulated bound to cores with ``bind_cores``: :func:`~hpcsplit.core.sim_model.binds_cores`)."""
    rate, slo = settings.rate_rps, settings.slo_ms
    if rate is None or not isinstance(slo, int | float):
        raise AllocationError(f"choosing by prediction needs allocate.rate_rps (found {rate!r}) and one end-to-end "
                              f"allocate.slo_ms in ms (found {slo!r})")
    names = list(graph.names)
    missing = [c for c in names if c not in profile.components]
    if missing:
        raise AllocationError(f"the profile has no figures for {missing}: profile the switchboard the plan is for")
    counts = device_counts(cluster) if settings.objective == "devices" else [cluster]
    duration_s = max(MIN_REQUESTS / rate, 10.0)
    arr = arrival_times(rate, duration_s, "poisson", 0)
    frontend_s = frontend_s_per_request(calibration)
    base = dataclasses.replace(settings, rate_rps=None)
    cands = []
    for cand in candidates(graph, {c: _batch1_ms(profile.components[c]) for c in names}):
        served = cand.served(names)
        comps = {s: merged_profile([profile.components[m] for m in ms], s) if len(ms) > 1 else profile.components[ms[0]]
                 for s, ms in served.items()}
        cands.append((cand, served, dataclasses.replace(profile, components=comps)))
    # per device count, every open candidate's plans are made, then simulated together ([Note: simulations in
    # parallel]); the rows keep the order of candidates, then counts
    found: dict[tuple[int, int], tuple[dict[str, Any], Plan | None]] = {}
    open_ = list(range(len(cands)))
    for n_cl, cl in enumerate(counts):
        trials: list[tuple[int, float, Plan]] = []
        errors: dict[int, list[str]] = {k: [] for k in open_}
        for k in open_:
            cand, _, prof = cands[k]
            seen: set[tuple[Any, ...]] = set()
            for f in PLAN_SLO_FACTORS:  # the allocator's plans under tighter per-component SLOs: faster options
                try:
                    alloc = allocate(prof, cl, dataclasses.replace(base, slo_ms=slo * f),
                                     frontend_s_per_request=frontend_s)
                except HpcsplitError as e:
                    errors[k].append(str(e).splitlines()[0])
                    continue
                plan = alloc.to_plan()
                shape = tuple((r.component, r.threads, r.slice_gb, r.batch_size, r.node, r.gpu) for r in plan.ranks)
                if shape not in seen:
                    seen.add(shape)
                    trials.append((k, f, plan))
        figs = _simulated([(plan, cands[k][0]) for k, _, plan in trials], profile, graph, calibration, policy, cl,
                          switchboard_sha256, arr, duration_s, slo, bind_cores, settings.sim_workers)
        still = []
        for k in open_:
            cand, served, _ = cands[k]
            row: dict[str, Any] = {"candidate": cand.name, "served": list(served), "devices": _devices(cl)}
            top: tuple[Any, ...] | None = None
            for (kk, f, plan), fig in zip(trials, figs, strict=True):
                key = (-round(fig["goodput_rps"], 6), fig["p50_ms"], plan.world_size)
                if kk == k and (top is None or key < top[0]):
                    top = (key, plan, {**fig, "component_slo_ms": slo * f})
            if top is None:
                found[(k, n_cl)] = ({**row, "error": errors[k][0] if errors[k] else "no plan"}, None)
                still.append(k)
                continue
            _, plan, fig = top
            row.update(ranks=plan.world_size, **fig, meets=fig["within_slo"] >= settings.slo_quantile)
            found[(k, n_cl)] = (row, plan)
            if log is not None:
                log(f"candidate {cand.name} on {row['devices']} device(s): {row['within_slo']:.1%} within "
                    f"{slo:g} ms, p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms ({plan.world_size} ranks)")
            if not (settings.objective == "devices" and row["meets"]):  # more devices cannot be fewer
                still.append(k)
        open_ = still
    rows: list[dict[str, Any]] = []
    plans: dict[int, Plan] = {}
    for pos in sorted(found):
        row, got = found[pos]
        if got is not None:
            plans[len(rows)] = got
        rows.append(row)
    ok = [i for i in plans]
    if not ok:
        raise AllocationError("no candidate split could be allocated on this cluster:\n  - "
                              + "\n  - ".join(f"{r['candidate']}: {r.get('error')}" for r in rows))
    if settings.objective == "devices":
        meet = [i for i in ok if rows[i]["meets"]]
        pool = meet or ok
        best = min(pool, key=lambda i: (rows[i]["devices"] if meet else 0, -round(rows[i]["goodput_rps"], 6),
                                        rows[i]["p50_ms"], rows[i]["ranks"], i))
        why = (f"chosen: {rows[best]['candidate']!r}, the fewest devices ({rows[best]['devices']}) on which at least "
               f"{settings.slo_quantile:.0%} of requests finish within {slo:g} ms at {rate:g} req/s"
               if meet else f"no candidate meets {settings.slo_quantile:.0%} within {slo:g} ms at {rate:g} req/s on "
               f"any device count; chosen: {rows[best]['candidate']!r}, the highest goodput")
    else:
        best = min(ok, key=lambda i: (-round(rows[i]["goodput_rps"], 6), rows[i]["p50_ms"], rows[i]["devices"], i))
        runner = [i for i in ok if i != best]
        alt = min(runner, key=lambda i: (-round(rows[i]["goodput_rps"], 6), rows[i]["p50_ms"])) if runner else None
        why = (f"chosen: {rows[best]['candidate']!r}, the highest simulated goodput at {rate:g} req/s within "
               f"{slo:g} ms ({rows[best]['goodput_rps']:.2f} req/s, {rows[best]['within_slo']:.1%} of requests)"
               + (f"; next: {rows[alt]['candidate']!r} ({rows[alt]['goodput_rps']:.2f} req/s, p50 "
                  f"{rows[alt]['p50_ms']:.2f} vs {rows[best]['p50_ms']:.2f} ms)" if alt is not None else ""))
    rows[best]["chosen"] = True
    why += f"; costs from {calibration.origin()}"
    plan = plans[best]
    meta = dict(plan.meta)
    meta["choice"] = {"rate_rps": rate, "slo_ms": slo, "objective": settings.objective, "chosen": rows[best]["candidate"],
                      "why": why, "candidates": rows}
    return Choice(dataclasses.replace(plan, meta=meta), tuple(rows), rows[best]["candidate"], why)


def _simulated(trials: Sequence[tuple[Plan, Candidate]], profile: Profile, graph: SimGraph, calibration: Calibration,
               policy: ServePolicy, cl: ClusterSpec, sha: str | None, arr: np.ndarray, duration_s: float,
               slo: float, bind_cores: bool = False, workers: int | None = None) -> list[dict[str, float]]:
    """Per ``(plan, candidate)``, medians over :data:`RUNS` simulations at the schedule ``arr`` (``duration_s``
    long): the share of requests done within ``slo`` and their rate over the schedule (the same requests: the same
    goodput).  Every trial's runs go to one pool of ``workers`` processes."""
    tasks = []
    for plan, cand in trials:
        variant = "whole" if cand.groups == ((WHOLE,),) else "grouped"
        system = build_system(plan, profile.components, graph, calibration, policy, variant=variant,
                              groups=[list(g) for g in cand.groups if g != (WHOLE,)],
                              cores_per_node=float(cl.cores_per_node), switchboard_sha256=sha, bind_cores=bind_cores)
        tasks += [(system, arr, k) for k in range(RUNS)]
    runs = simulate_many(tasks, workers, progress=None)
    out = []
    for t in range(len(trials)):
        within, good, p50, p99 = [], [], [], []
        for r, _ in runs[t * RUNS:(t + 1) * RUNS]:
            okl = ((r.done_s - r.arrival_s) * 1e3)[r.ok]
            n_in = int((okl <= slo).sum())
            within.append(n_in / len(arr))
            good.append(n_in / duration_s)
            p50.append(float(np.percentile(okl, 50)) if okl.size else math.inf)
            p99.append(float(np.percentile(okl, 99)) if okl.size else math.inf)
        out.append({"within_slo": float(np.median(within)), "goodput_rps": float(np.median(good)),
                    "p50_ms": float(np.median(p50)), "p99_ms": float(np.median(p99))})
    return out


def _batch1_ms(cp: ComponentProfile) -> float:
    """A component's batch-1 p50 at its first profiled slice (fewest threads, smallest slice): a chain's weights."""
    if 1 not in cp.batch_sizes:
        return 1.0
    v = cp.latency_p50_ms(cp.batch_sizes.index(1), 0)
    return float(v) if math.isfinite(v) else 1.0


def frontend_s_per_request(cal: Calibration) -> float | None:
    """The frontend's CPU seconds per request for the allocator's time-sharing pass (a request and one message):
    a calibration's, else None (the allocator's default, ``timeshare.FRONTEND_S_PER_REQUEST``).  A turn's own CPU
    (``frontend_us_per_turn``) is left out: at the rates the allocator plans for, a turn admits many requests."""
    return (cal.frontend_us_per_request + cal.frontend_us_per_message) / 1e6 if cal.measured else None
