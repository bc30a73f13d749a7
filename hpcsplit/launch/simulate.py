"""``stage=simulate``: predict a plan's throughput and latency per offered load before running it.

    python -m hpcsplit stage=simulate plan=PATH switchboard=PATH profile=PATH [calibration=PATH]

The split plan and the whole model on its component ranks (the bench's two variants) are simulated
(:mod:`hpcsplit.core.simulator`, ``[Note: simulator]``) at each offered load, with Poisson and bursty arrivals,
from the profile and the calibration (``calibration=PATH``, else the run folder's ``calibration.json``, else the
documented defaults, which the table says).  When the run folder holds a bench of the same plan
(``bench/bench.json`` names its sha256) the bench's own levels, schedules and serving settings are simulated,
and predicted and measured figures are written side by side (``simulate/compare.csv``, ``summary.md``).

Files under ``RUN_DIR/simulate/``: ``predicted.csv`` (variant, arrival, offered load, achieved, p50/p90/p99),
``compare.csv`` (with a bench), ``latency_vs_qps.png``, ``throughput_vs_qps.png``.

[Note: the level's speed]
A prediction is made from the profile, measured minutes or days before; a shared machine computes 5-20 % slower or
faster from one minute to the next (the development VM: CLIP's vision tower alone took 143 ms in one level of a
bench and 167 ms in the next), more than the 10 % a p50 is judged by.  So each compared level also says how fast
the machine computed in it: the bench measures every request's critical-path compute (``[Note: critical path in
the run]``; the simulator carries the same figure through its batches), and ``compute_ratio`` is the measured p50
of it over the simulated one, of the requests that were alone in the system (each component a batch of one on an
idle pipeline: no batching or queueing in it).  It is 1 when the machine ran at the profile's speed.  The level is then simulated again with every component's compute times that ratio
(``at_speed_*``, ``target_at_speed``): what the model predicts had it known the machine's speed in that level.  A
miss that disappears at the level's speed is the machine's drift; one that stays is the model's.  The verdict
that counts is the plain prediction's.
"""

from __future__ import annotations

import calendar
import csv
import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from hpcsplit.core.calibration import Calibration, Curve, calibration_for
from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.load import ARRIVALS, alone, level_arrivals, summarize
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan
from hpcsplit.core.profile_format import ComponentProfile, read_profile
from hpcsplit.core.settings import Checker, group_defaults
from hpcsplit.core.sim_model import SimGraph, binds_cores, build_system
from hpcsplit.core.sim_pool import SimTask, simulate_many
from hpcsplit.core.simulator import ServePolicy, SimRun, SimSystem, simulate
from hpcsplit.errors import ConfigError
from hpcsplit.launch.pipeline import load_manifest
from hpcsplit.launch.summary import write_summary
from hpcsplit.runtime.settings import stage_settings
from hpcsplit.switchboard.layout import load_layout

__all__ = ["SETTINGS", "TARGET_PCT", "Predicted", "Schedule", "SimulateSettings", "compare_rows", "err_pct", "predict",
           "run_simulate", "verdict"]

VARIANTS = ("whole", "split")
SATURATED = 0.9  # a measured level whose achieved rate is below this share of what its schedule offers is saturated
RUN_REQUESTS = 2000  # a level is simulated ``runs`` times, or fewer once that many requests were simulated
MAX_RECORD_BYTES = 1 << 20  # bench/bench.json is a few hundred bytes
MAX_REQUESTS_BYTES = 1 << 30  # bench/requests.h5: some 40 bytes a request
MIN_ALONE = 5  # requests alone in the system a level needs, measured and simulated, to give its speed
TARGET_PCT = {"p50_ms": 10.0, "p99_ms": 20.0, "qps": 10.0}  # the issue's: p50, p99 below saturation; throughput past it


@dataclass(frozen=True, slots=True)
class SimulateSettings:
    """``conf/simulate/default.yaml`` (meanings there)."""

    qps: tuple[float, ...] | None
    arrivals: tuple[str, ...]
    variants: tuple[str, ...]
    runs: int
    seed: int
    bind: str | None  # "core", "none", or None: as launcher.mpiexec_args binds
    workers: int | None = None  # processes the simulations are spread over (None: one per core, at most 8)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> SimulateSettings:
        """Read ``cfg["simulate"]`` over the defaults; one ConfigError lists every problem.

        >>> SimulateSettings.from_config({"simulate": {"qps": [2, 4]}}).qps
        (2.0, 4.0)
        """
        node = cfg.get("simulate")
        c = Checker("simulate", {**group_defaults("simulate"), **(node if isinstance(node, Mapping) else {})},
                    [f.name for f in fields(cls)])
        q = c.get("qps")
        qps = None
        if q is not None:
            items = q if isinstance(q, list | tuple) else [q]
            if not items or any(isinstance(x, bool) or not isinstance(x, int | float) or not 0 < x <= 1e9 for x in items):
                c.problem(f"simulate.qps = {q!r}: needs a non-empty list of numbers in (0, 1e9], or null")
            else:
                qps = tuple(float(x) for x in items)
        out = cls(qps=qps, arrivals=_names(c, "arrivals", ARRIVALS), variants=_names(c, "variants", VARIANTS),
                  runs=c.integer("runs", lo=1, hi=1000), seed=c.integer("seed"),
                  bind=c.choice("bind", (None, "core", "none")), workers=c.integer("workers", lo=1, hi=1024, none=True))
        c.done()
        return out

    def binds_cores(self, cfg: Mapping[str, Any]) -> bool:
        """Whether the ranks run bound to cores: :func:`hpcsplit.core.sim_model.binds_cores` with this
        ``simulate.bind``."""
        return binds_cores({**cfg, "simulate": {"bind": self.bind}})


SETTINGS: dict[str, type | dict[str, type]] = {"simulate": SimulateSettings}


def _names(c: Checker, key: str, valid: Sequence[str]) -> tuple[str, ...]:
    v = c.get(key)
    if not isinstance(v, list | tuple) or not v or any(x not in valid for x in v) or len(set(v)) != len(v):
        c.problem(f"simulate.{key} = {v!r}: needs a non-empty list of distinct names from {list(valid)}")
        return tuple(valid[:1])
    return tuple(str(x) for x in v)


@dataclass(frozen=True, slots=True)
class Schedule:
    """The levels to simulate: the bench's (``bench/bench.json``) or the config's ``bench`` and ``runtime``."""

    qps: tuple[float, ...]
    duration_s: float
    min_requests: int
    arrival: str  # the process the bench used (others are simulated on the same durations and seeds)
    seed: int
    policy: ServePolicy
    source: str  # "bench" (a recorded bench of this plan) or "config"


@dataclass(frozen=True, slots=True)
class Predicted:
    """One simulated level: the medians over ``runs`` simulations of the same schedule."""

    variant: str
    arrival: str
    offered_qps: float
    n_requests: int
    schedule_qps: float  # the rate the schedule itself offers: (requests - 1) / its span (Poisson varies)
    success_rate: float
    achieved_qps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    sim_s: float  # seconds the simulations of this level took (summed, in whichever processes ran them)
    cpu_cores: float = float("nan")  # CPU of the frontend's node over the level, in cores (CPU plans; NaN: GPUs)
    path_p50_ms: float = float("nan")  # compute on a request's critical path, p50 (the bench's path_p50_ms)
    alone_path_p50_ms: float = float("nan")  # ... of the requests alone in the system (every run's, pooled)
    alone_n: int = 0  # how many those were
    rank_cpu_cores: tuple[float, ...] = ()  # per rank of the system (its ranks' order): cores over the level (CPU
    #                                          plans; NaN: not on the frontend's node); not a column of predicted.csv


def predict(systems: Mapping[str, SimSystem], schedule: Schedule, arrivals: Sequence[str], runs: int,
            seed: int = 0, workers: int | None = None) -> list[Predicted]:
    """Simulate every variant x arrival process x level of ``schedule`` ``runs`` times (fewer for a level of many
    requests: at least :data:`RUN_REQUESTS` requests in all); medians per level.  The simulations are spread over
    ``workers`` processes (``[Note: simulations in parallel]``): the same figures on any number."""
    return predict_levels([(variant, system, kind, i) for variant, system in systems.items() for kind in arrivals
                           for i in range(len(schedule.qps))], schedule, runs, seed, workers)


def _level_arrivals(schedule: Schedule, kind: str, i: int) -> np.ndarray:
    """Level ``i``'s arrivals of process ``kind``, as every simulation of that level draws them."""
    return level_arrivals(schedule.qps[i], i, schedule.duration_s, schedule.min_requests, kind, schedule.seed)


def _run_seed(seed: int, k: int, i: int) -> int:
    """The jitter seed of run ``k`` of level ``i``."""
    return seed + 1000 * k + i


def predict_level(variant: str, system: SimSystem, schedule: Schedule, kind: str, i: int, runs: int,
                  seed: int = 0, workers: int | None = None) -> Predicted:
    """Level ``i`` of ``schedule`` (its own arrivals and seeds, as :func:`predict` draws them)."""
    return predict_levels([(variant, system, kind, i)], schedule, runs, seed, workers)[0]


def predict_levels(items: Sequence[tuple[str, SimSystem, str, int]], schedule: Schedule, runs: int, seed: int = 0,
                   workers: int | None = None) -> list[Predicted]:
    """:func:`predict_level` of each ``(variant, system, arrival process, level)``, their simulations in one pool of
    ``workers`` processes."""
    tasks: list[SimTask] = []
    spans = []
    for _, system, kind, i in items:
        arr = _level_arrivals(schedule, kind, i)
        n = max(1, min(runs, math.ceil(RUN_REQUESTS / max(1, len(arr)))))
        spans.append((len(tasks), n, arr))
        tasks += [(system, arr, _run_seed(seed, k, i)) for k in range(n)]
    done = simulate_many(tasks, workers)
    return [_level_figures(variant, system, schedule.qps[i], kind, arr, done[a:a + n])
            for (variant, system, kind, i), (a, n, arr) in zip(items, spans, strict=True)]


def _level_figures(variant: str, system: SimSystem, q: float, kind: str, arr: np.ndarray,
                   runs: Sequence[tuple[SimRun, float]]) -> Predicted:
    """One level's figures: the medians over its simulated ``runs`` (each with the seconds it took)."""
    ss, cpu, lone, each = [], [], [], []
    span = float(arr[-1] - arr[0]) if len(arr) > 1 else 0.0
    for r, _ in runs:
        ss.append(summarize(variant, q, r.arrival_s, r.done_s, r.ok, r.path_ms))
        cpu.append(node_cpu_cores(system, r))
        each.append(rank_cpu_cores(system, r))
        v = r.path_ms[alone(r.arrival_s, r.done_s) & r.ok]
        lone.append(v[np.isfinite(v) & (v > 0)])  # (as the measured side: measured_alone_paths)
    med = {f: float(np.nanmedian([getattr(s, f) for s in ss]))
           for f in ("success_rate", "achieved_qps", "p50_ms", "p90_ms", "p99_ms", "path_p50_ms")}
    pooled = np.concatenate(lone)
    return Predicted(variant, kind, q, len(arr), (len(arr) - 1) / span if span > 0 else q,
                     sim_s=sum(dt for _, dt in runs), cpu_cores=float(np.median(cpu)),
                     rank_cpu_cores=tuple(float(v) for v in np.median(each, axis=0)) if each and each[0] else (),
                     alone_path_p50_ms=float(np.median(pooled)) if len(pooled) else math.nan, alone_n=len(pooled), **med)


def node_cpu_cores(system: SimSystem, run: SimRun) -> float:
    """The CPU the simulated ranks on the frontend's node used, in cores, from the start of the level to its last
    answer (the window over which the bench reads its ranks' CPU); NaN where compute is on devices."""
    node = system.ranks[0].node
    if not system.node_cores or node >= len(run.node_cpu_s):
        return float("nan")
    t = _level_end(run)
    return float(run.node_cpu_s[node]) / t if t > 0 else float("nan")


def _level_end(run: SimRun) -> float:
    """The level's last arrival or answer (seconds; 0 when it has none): the end of the window its CPU is read over."""
    end = np.concatenate([run.arrival_s, run.done_s[np.isfinite(run.done_s)]])
    return float(end.max()) if len(end) else 0.0


def rank_cpu_cores(system: SimSystem, run: SimRun) -> list[float]:
    """Each rank's part of :func:`node_cpu_cores` (the system's ranks' order), NaN for a rank on another node; ``[]``
    where compute is on devices."""
    node = system.ranks[0].node
    total = node_cpu_cores(system, run)
    if not math.isfinite(total) or len(run.rank_cpu_s) != len(system.ranks):
        return []
    t = _level_end(run)
    return [float(c) / t if k.node == node else math.nan for k, c in zip(system.ranks, run.rank_cpu_s, strict=True)]


def rank_label(system: SimSystem, i: int) -> str:
    """The frontend, or the component rank ``i`` of ``system`` runs."""
    c = system.ranks[i].component
    return "frontend" if c < 0 else system.components[c].name


def measured_rank_cpu(path: Path) -> dict[tuple[str, float, int], float]:
    """A bench's ``rank_cpu.csv`` (``RunPaths.bench_rank_cpu``): cores per (variant, level, rank); ``{}`` (said) when
    it is missing (a bench before it) or not as the bench writes it."""
    if not path.is_file():
        return {}
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes")
        out: dict[tuple[str, float, int], float] = {}
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                variant, q, rank, cores = row["variant"], float(row["offered_qps"]), int(row["rank"]), float(row["cpu_cores"])
                if variant not in VARIANTS:
                    raise ValueError(f"variant {variant!r}")
                _within(q, "offered_qps", 1e-9, 1e9)
                _within(rank, "rank", 0, 1 << 24, whole=True)
                _within(cores, "cpu_cores", 0.0, 1e6)
                out[(variant, q, rank)] = cores
        return out
    except (OSError, ValueError, TypeError, KeyError, UnicodeDecodeError, csv.Error) as e:
        print(f"{path}: not as the bench writes it ({type(e).__name__}: {e}); no CPU per rank compared", flush=True)
        return {}


def rank_cpu_rows(systems: Mapping[str, SimSystem], pred: Sequence[Predicted], arrival: str,
                  measured: Mapping[tuple[str, float, int], float]) -> list[dict[str, Any]]:
    """Per level of the bench's arrival process and rank of the frontend's node: the CPU the rank used, measured
    (``measured``: :func:`measured_rank_cpu`) and predicted, in cores."""
    rows = []
    for p in pred:
        system = systems.get(p.variant)
        if p.arrival != arrival or system is None or not p.rank_cpu_cores:
            continue
        for i, k in enumerate(system.ranks):
            v = p.rank_cpu_cores[i]
            if not math.isfinite(v):
                continue
            m = next((c for (mv, mq, mr), c in measured.items()
                      if mv == p.variant and mr == k.rank and math.isclose(mq, p.offered_qps, rel_tol=1e-6)), math.nan)
            rows.append({"variant": p.variant, "offered_qps": p.offered_qps, "rank": k.rank,
                         "component": rank_label(system, i), "measured_cpu_cores": m, "predicted_cpu_cores": v})
    return rows


def format_rank_cpu(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line per level: each rank's cores, measured / predicted (where the bench measured them)."""
    lines = []
    for key in dict.fromkeys((r["variant"], r["offered_qps"]) for r in rows):
        mine = [r for r in rows if (r["variant"], r["offered_qps"]) == key]
        if not any(math.isfinite(r["measured_cpu_cores"]) for r in mine):
            continue
        lines.append(f"{key[0]:<6} {key[1]:>8g} | " + ", ".join(
            f"{r['rank']} {r['component']} {r['measured_cpu_cores']:.2f}/{r['predicted_cpu_cores']:.2f}" for r in mine))
    return "\n".join(lines)


def compare_rows(pred: Sequence[Predicted], measured: Sequence[Mapping[str, Any]], arrival: str,
                 alone_measured: Mapping[tuple[str, float], tuple[float, int]] | None = None) -> list[dict[str, Any]]:
    """Predicted beside measured per (variant, level) of the bench's arrival process, with the errors.

    A level whose measured achieved rate is below :data:`SATURATED` of what its schedule offers (its requests over
    its span: a Poisson schedule of 30 requests offers 20 % more or less than the nominal rate) is *saturated*: its
    throughput is compared; the others' p50 and p99.  ``alone_measured``: per (variant, level), the critical-path
    compute p50 of the requests that were alone in the system, and their number (:func:`measured_alone_paths`),
    which gives ``compute_ratio`` (``[Note: the level's speed]``).
    """
    by = {(p.variant, p.offered_qps): p for p in pred if p.arrival == arrival}
    rows = []
    for m in measured:
        key = (str(m["variant"]), float(m["offered_qps"]))
        p = by.get(key)
        if p is None:
            continue
        mq, m50, m99 = float(m["achieved_qps"]), float(m["p50_ms"]), float(m["p99_ms"])
        mc = float(m.get("cpu_cores") or "nan")  # (a bench before the column: not measured)
        mp = float(m.get("path_p50_ms") or "nan")  # (a bench before the column: not measured)
        ma, na = next((v for (av, aq), v in (alone_measured or {}).items()
                       if av == key[0] and math.isclose(aq, key[1], rel_tol=1e-5)), (math.nan, 0))  # (names keep 6 digits)
        saturated = mq < SATURATED * p.schedule_qps
        rows.append({
            "variant": key[0], "offered_qps": key[1], "saturated": saturated,
            "measured_qps": mq, "predicted_qps": p.achieved_qps, "qps_err_pct": err_pct(p.achieved_qps, mq),
            "measured_p50_ms": m50, "predicted_p50_ms": p.p50_ms, "p50_err_pct": err_pct(p.p50_ms, m50),
            "measured_p99_ms": m99, "predicted_p99_ms": p.p99_ms, "p99_err_pct": err_pct(p.p99_ms, m99),
            "measured_ok": float(m["success_rate"]), "predicted_ok": p.success_rate,
            "measured_cpu_cores": mc, "predicted_cpu_cores": p.cpu_cores, "cpu_err_pct": err_pct(p.cpu_cores, mc),
            "measured_path_p50_ms": mp, "predicted_path_p50_ms": p.path_p50_ms,
            "measured_alone_path_p50_ms": ma, "measured_alone_n": na,
            "predicted_alone_path_p50_ms": p.alone_path_p50_ms, "predicted_alone_n": p.alone_n,
            "compute_ratio": speed_ratio(ma, p.alone_path_p50_ms) if min(na, p.alone_n) >= MIN_ALONE else math.nan,
        })
    return rows


def speed_ratio(measured_path_ms: float, predicted_path_ms: float) -> float:
    """How much slower the level computed than the model said: the measured critical-path compute p50 of the requests
    alone in the system over the simulated one (``[Note: the level's speed]``); NaN when either is missing or not
    positive.

    >>> speed_ratio(159.4, 139.7) > 1.1, math.isnan(speed_ratio(float("nan"), 10.0))
    (True, True)
    """
    ok = all(np.isfinite(x) and x > 0 for x in (measured_path_ms, predicted_path_ms))
    return measured_path_ms / predicted_path_ms if ok else float("nan")


def err_pct(pred: float, meas: float) -> float:
    """The prediction's error against the measurement, % (NaN when either is missing)."""
    return (pred - meas) / meas * 100 if meas and np.isfinite(meas) and np.isfinite(pred) else float("nan")


def verdict(row: Mapping[str, Any]) -> str:
    """``met`` / ``MISSED`` against :data:`TARGET_PCT`: p50 within 10 %, p99 within 20 % below saturation, throughput
    within 10 % past it."""
    if row["saturated"]:
        return "met" if abs(row["qps_err_pct"]) <= TARGET_PCT["qps"] else "MISSED"
    ok = abs(row["p50_err_pct"]) <= TARGET_PCT["p50_ms"] and abs(row["p99_err_pct"]) <= TARGET_PCT["p99_ms"]
    return "met" if ok else "MISSED"


def format_compare(rows: Sequence[Mapping[str, Any]]) -> str:
    head = (f"{'variant':<7} {'QPS':>7} | {'p50 meas':>9} {'pred':>9} {'err':>7} | {'p99 meas':>9} {'pred':>9} "
            f"{'err':>7} | {'req/s meas':>10} {'pred':>9} {'err':>7} | {'CPU meas':>8} {'pred':>5} | target")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['variant']:<7} {r['offered_qps']:>7g} | {r['measured_p50_ms']:>9.2f} {r['predicted_p50_ms']:>9.2f} "
            f"{r['p50_err_pct']:>+6.1f}% | {r['measured_p99_ms']:>9.2f} {r['predicted_p99_ms']:>9.2f} "
            f"{r['p99_err_pct']:>+6.1f}% | {r['measured_qps']:>10.2f} {r['predicted_qps']:>9.2f} "
            f"{r['qps_err_pct']:>+6.1f}% | {r.get('measured_cpu_cores', math.nan):>8.2f} "
            f"{r.get('predicted_cpu_cores', math.nan):>5.2f} | {verdict(r)}"
            f"{' (saturated: throughput)' if r['saturated'] else ''}{_at_speed_text(r)}")
    lines.append("CPU: cores the ranks on the frontend's node used over the level (measured from /proc; predicted: the "
                 "simulated node's computing, polling and backing-off ranks); not a target, a reading of the model")
    if any(math.isfinite(float(r.get("compute_ratio", math.nan))) for r in rows):
        lines.append("compute xF: the critical-path compute p50 of the level's requests alone in the system, measured / "
                     "simulated (how much slower the "
                     "machine computed than the profile); 'at that speed': the same level simulated with every "
                     "component's compute times F, the errors and verdict of that prediction (a reading of the "
                     "model without the machine's drift; the verdict above is the one that counts)")
    return "\n".join(lines)


def _at_speed_text(r: Mapping[str, Any]) -> str:
    f = float(r.get("compute_ratio", math.nan))
    if not math.isfinite(float(r.get("at_speed_p50_ms", math.nan))):
        return ""
    figs = (f"req/s {r['at_speed_qps_err_pct']:+.1f}%" if r["saturated"] else
            f"p50 {r['at_speed_p50_err_pct']:+.1f}%, p99 {r['at_speed_p99_err_pct']:+.1f}%")
    return f" | compute x{f:.2f}, at that speed {figs}: {verdict_at_speed(r)}"


def format_predicted(pred: Sequence[Predicted]) -> str:
    head = (f"{'variant':<7} {'arrival':<8} {'QPS':>8} {'achieved':>9} {'ok':>6} {'p50 ms':>9} {'p90 ms':>9} "
            f"{'p99 ms':>9} {'requests':>8}")
    lines = [head, "-" * len(head)]
    for p in pred:
        lines.append(f"{p.variant:<7} {p.arrival:<8} {p.offered_qps:>8g} {p.achieved_qps:>9.2f} {p.success_rate:>6.1%} "
                     f"{p.p50_ms:>9.2f} {p.p90_ms:>9.2f} {p.p99_ms:>9.2f} {p.n_requests:>8}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ inputs
def bench_record(paths: RunPaths, plan_path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The run folder's bench of ``plan_path`` (its record and measured levels), or None (none, of another plan,
    or files that do not read as the bench writes them: said, and the config's levels simulated instead)."""
    try:
        if paths.bench_record.stat().st_size > MAX_RECORD_BYTES:
            raise ValueError(f"{paths.bench_record.stat().st_size} bytes")
        rec = json.loads(paths.bench_record.read_text())
        sha = hashlib.sha256(plan_path.read_bytes()).hexdigest()
        with open(paths.bench_summary, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(rec, dict) or rec.get("plan_sha256") != sha or not rows:
        return None
    try:
        for k, lo, hi in (("max_inflight", 1, 1 << 30), ("min_requests", 1, 10**7), ("seed", -(1 << 62), 1 << 62)):
            _within(rec[k], k, lo, hi, whole=True)
        for key, low, high in (("max_wait_ms", 0.0, 3.6e6), ("request_timeout_s", 1e-9, 3.6e6),
                               ("duration_s", 1e-9, 3.6e6), ("spin_us", 0.0, 1e6)):
            if key in rec or key != "spin_us":  # (a record before spin_us: the config's)
                _within(rec[key], key, low, high)
        if rec["arrival"] not in ARRIVALS or not isinstance(rec["qps"], list) or not rec["qps"]:
            raise ValueError(f"arrival {rec['arrival']!r}, qps {rec['qps']!r}")
        for q in rec["qps"]:
            _within(q, "qps", 1e-9, 1e9)
        for r in rows:
            for k in ("offered_qps", "achieved_qps", "p50_ms", "p99_ms", "success_rate"):
                float(r[k])
            str(r["variant"])
            if r.get("cpu_cores") not in (None, "", "nan"):  # optional (benches before it have none)
                _within(float(r["cpu_cores"]), "cpu_cores", 0.0, 1e6)
    except (KeyError, TypeError, ValueError) as e:
        print(f"{paths.bench_record} / {paths.bench_summary}: not as the bench writes them ({type(e).__name__}: {e}); "
              "simulating the configured levels without a comparison", flush=True)
        return None
    return rec, rows


def measured_alone_paths(path: Path, sched: Schedule) -> dict[tuple[str, float], tuple[float, int]]:
    """Per (variant, level of ``sched``) of a bench's ``requests.h5``: the critical-path compute p50 (ms) of the
    requests that were alone in the system (:func:`hpcsplit.core.load.alone`) and how many there were; ``{}`` (said)
    when the file is missing or not as the bench writes it.

    Reads datasets only, each only after its length was checked against the level's schedule: a level's group must
    hold exactly the arrivals ``sched`` gives it (the bench's own requests, not an older bench's or another plan's),
    and every answered request an end after its arrival.  A level whose arrivals differ is left out (said).
    """
    if not path.is_file():
        return {}
    try:
        import h5py

        if path.stat().st_size > MAX_REQUESTS_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes, more than {MAX_REQUESTS_BYTES}")
        out: dict[tuple[str, float], tuple[float, int]] = {}
        other: list[str] = []
        with h5py.File(path, "r") as f:
            for variant in VARIANTS:
                g = f.get(variant)
                if not isinstance(g, h5py.Group):
                    continue
                for i, q in enumerate(sched.qps):
                    name = f"qps_{q:g}"  # as the bench names it
                    lvl = g.get(name)
                    if not isinstance(lvl, h5py.Group):
                        continue
                    arr = _level_arrivals(sched, sched.arrival, i)
                    cols = {}
                    for k in ("arrival_s", "done_s", "critical_path_ms", "status"):
                        d = lvl.get(k)
                        if not isinstance(d, h5py.Dataset) or d.ndim != 1 or d.dtype.kind not in "fiu":
                            raise ValueError(f"{variant}/{name}/{k}: not a 1-D numeric dataset")
                        if d.shape[0] != len(arr):
                            break
                        cols[k] = np.asarray(d[()], dtype=np.float64)
                    if len(cols) < 4 or not np.allclose(cols["arrival_s"], arr, rtol=0.0, atol=1e-9):
                        other.append(f"{variant}/{name}")
                        continue
                    ok = cols["status"] == 1  # runtime.frontend.STATUS_OK
                    done = np.where(ok, cols["done_s"], np.nan)
                    if not (done[ok] >= cols["arrival_s"][ok]).all():
                        raise ValueError(f"{variant}/{name}: an answered request ends before it arrives")
                    v = cols["critical_path_ms"][alone(cols["arrival_s"], done) & ok]
                    v = v[np.isfinite(v) & (v > 0)]
                    out[(variant, q)] = (float(np.median(v)) if len(v) else math.nan, len(v))
        if other:
            print(f"{path}: {', '.join(other)} hold other requests than this schedule's; no speed for those levels",
                  flush=True)
        return out
    except (OSError, ValueError, TypeError, KeyError, RecursionError, RuntimeError, MemoryError) as e:
        print(f"{path}: not as the bench writes it ({type(e).__name__}: {e}); no level's speed", flush=True)
        return {}


def _within(v: Any, what: str, lo: float, hi: float, whole: bool = False) -> None:
    """``v`` is a number in ``[lo, hi]`` (an integer when ``whole``), else ValueError."""
    ok = isinstance(v, int) if whole else isinstance(v, int | float)
    if isinstance(v, bool) or not ok or not lo <= v <= hi:  # (NaN is not in any range)
        raise ValueError(f"{what} = {v!r}, needs {'an integer' if whole else 'a number'} in [{lo:g}, {hi:g}]")


def schedule_of(cfg: Mapping[str, Any], s: SimulateSettings, rec: Mapping[str, Any] | None) -> Schedule:
    """The bench's recorded schedule and policy when there is one, else the config's."""
    rt, b = stage_settings(cfg)
    # the bench polls after work as the runtime does in bench mode: runtime.spin_us, else mailbox.SPIN_S
    spin_us = ServePolicy().spin_us if rt.spin_us is None else rt.spin_us
    if rec is not None:
        pol = ServePolicy(int(rec["max_inflight"]), float(rec["max_wait_ms"]), float(rec["request_timeout_s"]),
                          spin_us=float(rec.get("spin_us", spin_us)))
        return Schedule(s.qps or tuple(float(q) for q in rec["qps"]), float(rec["duration_s"]),
                        int(rec["min_requests"]), str(rec["arrival"]), int(rec["seed"]), pol, "bench")
    pol = ServePolicy(rt.max_inflight, rt.max_wait_ms, b.request_timeout_s or rt.request_timeout_s, spin_us=spin_us)
    return Schedule(s.qps or b.qps, b.duration_s, b.min_requests, b.arrival, b.seed, pol, "config")


def systems_for(plan: Plan, profiles: Mapping[str, ComponentProfile], graph: SimGraph, cal: Calibration,
                policy: ServePolicy, variants: Sequence[str], cores: float, sha: str | None,
                scale: Mapping[str, float] | None = None, bind: bool = False) -> dict[str, SimSystem]:
    return {v: build_system(plan, profiles, graph, cal, policy, variant=v, cores_per_node=cores,
                            switchboard_sha256=sha, scale=scale, bind_cores=bind) for v in variants}


def floor_scale(paths: RunPaths) -> dict[str, float] | None:
    """Per component: the batch-1 time the bench re-measured just before its split levels over the profile's
    (``[Note: floor re-measured]``): how much faster or slower the machine was during the bench."""
    try:
        r = json.loads(paths.rank_result("hpcsplit.runtime.stage:mpi_main").read_text())
        now, prof = r["critical_path_now_components_ms"], r["critical_path_components_ms"]
        out = {str(c): float(now[c]) / float(prof[c]) for c in now if c in prof and float(prof[c]) > 0}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError, ZeroDivisionError):
        return None
    return out if all(0 < f < 1e6 for f in out.values()) else None  # (NaN, inf or 0: not a speed)


def _profiles(paths: RunPaths) -> dict[str, ComponentProfile]:
    out: dict[str, ComponentProfile] = {}
    for p in paths.profiles:
        out.update(read_profile(p).components)
    return out


def simulated_hops(cfg: dict[str, Any], run_dir: Path, cal: Calibration, variant: str,
                   qps: float) -> list[tuple[int, int, float, float, int, float, float, float]]:
    """Every message of one level of the bench in ``run_dir`` as the simulator runs it (:func:`simulate`'s
    ``hops``: source, destination, sent, taken, requests, delivered, busy, hop): one run, with the plan, profile, switchboard, schedule
    and seed of ``stage=simulate``'s first run of that level, under ``cal`` (no floor scale, no at-speed run)."""
    s = SimulateSettings.from_config(cfg)
    paths = RunPaths.from_config(cfg, run_dir)
    if not paths.plan.is_file():
        raise ConfigError(f"the bench's plan {paths.plan} is not there; pass the run folder of a stage=bench run "
                          "whose plan, switchboard and profile still exist")
    inp = _inputs(cfg, s, paths)
    sched = inp.sched
    level = [i for i, q in enumerate(sched.qps) if math.isclose(q, qps, rel_tol=1e-6)]
    if not level:
        raise ConfigError(f"the bench in {run_dir} has no level at {qps:g} req/s (it has "
                          f"{', '.join(f'{q:g}' for q in sched.qps)})")
    i = level[0]
    system = build_system(inp.plan, _profiles(paths), SimGraph.from_layout(inp.layout), cal, sched.policy,
                          variant=variant, cores_per_node=float(inp.cluster.cores_per_node), switchboard_sha256=inp.sha,
                          bind_cores=s.binds_cores(cfg))
    hops: list[tuple[int, int, float, float, int, float, float, float]] = []
    simulate(system, _level_arrivals(sched, sched.arrival, i), seed=_run_seed(s.seed, 0, i), hops=hops)
    return hops


class _Inputs(NamedTuple):
    """What a simulation of a run folder's plan reads besides its calibration and profiles."""

    plan: Plan
    layout: Any
    sha: str | None
    cluster: ClusterSpec
    bench: tuple[dict[str, Any], list[dict[str, Any]]] | None
    sched: Schedule


def _inputs(cfg: dict[str, Any], s: SimulateSettings, paths: RunPaths) -> _Inputs:
    """The plan (which must exist), the switchboard's layout, the cluster, the folder's bench of the plan and the
    schedule to simulate (the bench's when there is one)."""
    plan = Plan.load(paths.plan)
    layout, sha = load_layout(paths.switchboard)
    cluster = ClusterSpec.from_config(cfg.get("cluster") or {})
    bench = bench_record(paths, paths.plan)
    return _Inputs(plan, layout, sha, cluster, bench, schedule_of(cfg, s, bench[0] if bench else None))


# ------------------------------------------------------------------------------------------ the stage
def run_simulate(cfg: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """``stage=simulate``: write the predictions (and the comparison with a bench of the plan); see the module."""
    s = SimulateSettings.from_config(cfg)
    paths = RunPaths.from_config(cfg, run_dir)
    if not paths.plan.is_file():
        raise ConfigError(f"stage=simulate needs a plan: {paths.plan} does not exist; run stage=allocate or pass plan=PATH")
    plan, layout, sha, cluster, bench, sched = _inputs(cfg, s, paths)
    cal = calibration_for(paths.calibration, paths.calibration_given)
    print(cal.describe(), flush=True)
    bind = s.binds_cores(cfg)
    if plan.device_kind == "cpu" and bind:
        print("ranks bound to cores (simulate.bind, or -bind-to core in launcher.mpiexec_args): each runs on one core "
              "of its node, in rank order", flush=True)
    elif plan.device_kind == "cpu" and cal.wake_on_ringer_core:
        print(f"ranks placed by the kernel: {cal.wake_on_ringer_core:.0%} of the wake-ups a rank on the same node rings "
              "run on the ringer's core (the calibration's wake_on_ringer_core, [Note: wake-up placement]); "
              "simulate.bind=core to simulate them bound", flush=True)
    t0 = time.perf_counter()
    profiles, graph = _profiles(paths), SimGraph.from_layout(layout)  # read once: every simulation below uses them
    systems = systems_for(plan, profiles, graph, cal, sched.policy, s.variants,
                          float(cluster.cores_per_node), sha, bind=bind)
    arrivals = tuple(dict.fromkeys((sched.arrival, *s.arrivals)))
    pred = predict(systems, sched, arrivals, s.runs, s.seed, s.workers)
    out = paths.simulate_dir
    out.mkdir(parents=True, exist_ok=True)
    _write_csv(out / "predicted.csv", [{k: v for k, v in asdict(p).items() if k != "rank_cpu_cores"} for p in pred])
    print(format_predicted(pred), flush=True)
    result: dict[str, Any] = {"calibration": cal.describe(), "calibration_source": cal.source,
                              "schedule": sched.source, "predicted": [asdict(p) for p in pred],
                              "simulate_s": time.perf_counter() - t0, "dir": str(out)}
    if bench is not None:
        rows = compare_rows(pred, bench[1], sched.arrival, measured_alone_paths(paths.bench_dir / "requests.h5", sched))
        scale = floor_scale(paths)
        if scale:  # the same simulation with the profile moved to the machine's speed during the bench
            now = predict(systems_for(plan, profiles, graph, cal, sched.policy,
                                      s.variants, float(cluster.cores_per_node), sha, scale, bind),
                          sched, (sched.arrival,), s.runs, s.seed, s.workers)
            by = {(p.variant, p.offered_qps): p for p in now}
            for r in rows:
                p = by[(r["variant"], r["offered_qps"])]
                r.update(predicted_now_p50_ms=p.p50_ms, predicted_now_p99_ms=p.p99_ms, predicted_now_qps=p.achieved_qps,
                         now_p50_err_pct=err_pct(p.p50_ms, r["measured_p50_ms"]),
                         now_p99_err_pct=err_pct(p.p99_ms, r["measured_p99_ms"]),
                         now_qps_err_pct=err_pct(p.achieved_qps, r["measured_qps"]))
            result["floor_scale"] = scale
            print("the bench re-measured each component's batch of one just before its split levels: "
                  + ", ".join(f"{c} {f:.2f}x the profile" for c, f in scale.items())
                  + "; predictions with the profile moved to that speed are the predicted_now_* columns of compare.csv",
                  flush=True)
        at_speed(rows, plan, profiles, graph, cal, sched, float(cluster.cores_per_node),
                 sha, s.runs, s.seed, bind, s.workers)
        _write_csv(out / "compare.csv", [{**r, "target": verdict(r), "target_at_speed": verdict_at_speed(r)} for r in rows])
        table = format_compare(rows)
        print(f"predicted vs measured (the bench of this plan, {sched.arrival} arrivals):\n{table}", flush=True)
        result.update(compare=rows, compare_table=table)
        ranks = rank_cpu_rows(systems, pred, sched.arrival, measured_rank_cpu(paths.bench_rank_cpu))
        if ranks:
            _write_csv(out / "rank_cpu.csv", ranks)
            if text := format_rank_cpu(ranks):
                print("CPU per rank of the frontend's node, cores measured / predicted (where a node's load falls; "
                      f"simulate/rank_cpu.csv):\n{text}", flush=True)
                result["rank_cpu_table"] = text
        age = calibration_age_min(cal, paths.bench_summary)
        if age is not None:
            result["calibration_age_min"] = age
            print(calibration_age_note(age), flush=True)
    try:
        result["plots"] = _plot(out, pred, bench[1] if bench else [], sched.arrival, result.get("compare") or [])
    except Exception as e:  # noqa: BLE001 - a plotting failure must not lose the figures
        print(f"could not plot: {e}", flush=True)
    _refresh_summary(paths)
    return result


def calibration_age_min(cal: Calibration, bench_summary: Path) -> float | None:
    """Minutes from the calibration's making (``created_utc``, when its fit was written) to the bench's end (its
    ``summary.csv``, written when it ended), negative when the calibration came after; None when either is not
    known (the defaults, an unreadable file)."""
    if not cal.measured:
        return None
    try:
        made = calendar.timegm(time.strptime(cal.created_utc, "%Y-%m-%dT%H:%M:%SZ"))
        ended = bench_summary.stat().st_mtime
    except (ValueError, OSError, OverflowError):
        return None
    return (ended - made) / 60.0


def calibration_age_note(age_min: float) -> str:
    """One line on how far apart the calibration and the bench were: a shared machine's costs move with the hour
    (docs/simulate.md, "Hops, traced": 2-4x on the development VM)."""
    when = f"{age_min:.0f} min before the bench ended" if age_min >= 0 else f"{-age_min:.0f} min after the bench"
    line = f"calibration: made {when}"
    if abs(age_min) > 30:
        line += ("; on a shared machine the costs move with the hour, so a calibration made beside the bench "
                 "(python -m hpcsplit stage=calibrate, then the bench) predicts it better")
    return line


def at_speed(rows: list[dict[str, Any]], plan: Plan, profiles: Mapping[str, ComponentProfile], graph: SimGraph,
             cal: Calibration, sched: Schedule, cores: float, sha: str | None, runs: int, seed: int,
             bind: bool = False, workers: int | None = None) -> None:
    """Add to each compared level the prediction with every component's compute (its profile and its cold extras)
    moved by the level's ``compute_ratio`` (``[Note: the level's speed]``): the ``at_speed_*`` columns, NaN where the
    ratio is unknown."""
    items, which = [], []
    for n, r in enumerate(rows):
        f = float(r.get("compute_ratio", math.nan))
        if math.isfinite(f) and 0 < f < 1e6 and r["offered_qps"] in sched.qps:
            system = at_speed_system(plan, profiles, graph, cal, sched.policy, r["variant"], cores, sha, f, bind)
            items.append((r["variant"], system, sched.arrival, sched.qps.index(r["offered_qps"])))
            which.append(n)
    got = dict(zip(which, predict_levels(items, sched, runs, seed, workers), strict=True))
    for n, r in enumerate(rows):
        p = got.get(n)
        for k, field_, meas in (("p50_ms", "p50_ms", "measured_p50_ms"), ("p99_ms", "p99_ms", "measured_p99_ms"),
                                ("qps", "achieved_qps", "measured_qps")):
            v = getattr(p, field_) if p is not None else math.nan
            r[f"at_speed_{k}"] = v
            r[f"at_speed_{k.removesuffix('_ms')}_err_pct"] = err_pct(v, r[meas])


def at_speed_system(plan: Plan, profiles: Mapping[str, ComponentProfile], graph: SimGraph, cal: Calibration,
                    policy: ServePolicy, variant: str, cores: float, sha: str | None, f: float,
                    bind: bool = False) -> SimSystem:
    """``variant``'s simulated system on a machine that computes ``f`` times slower than the profile says: every
    component's latencies and its program's cold extras times ``f``; the frontend and the hops as calibrated."""
    system = build_system(plan, profiles, graph, cal, policy, variant=variant, cores_per_node=cores,
                          switchboard_sha256=sha, scale=dict.fromkeys(graph.names, f), bind_cores=bind)
    return dataclasses.replace(system, ranks=tuple(
        k if k.component < 0 else dataclasses.replace(k, cold=Curve(k.cold.gaps_ms, tuple(v * f for v in k.cold.values_ms)))
        for k in system.ranks))


def verdict_at_speed(row: Mapping[str, Any]) -> str:
    """:func:`verdict` of the prediction at the level's own speed (``""`` where it is unknown)."""
    if not math.isfinite(float(row.get("at_speed_p50_ms", math.nan))):
        return ""
    return verdict({"saturated": row["saturated"], "qps_err_pct": row["at_speed_qps_err_pct"],
                    "p50_err_pct": row["at_speed_p50_err_pct"], "p99_err_pct": row["at_speed_p99_err_pct"]})


def _refresh_summary(paths: RunPaths) -> None:
    """A pipeline's run folder (it has ``manifest.json``): write its ``summary.md`` again, with the simulation."""
    if not paths.manifest.is_file():
        return
    m = load_manifest(paths.manifest)
    bench = (m.get("stages") or {}).get("bench") or {}
    write_summary(paths, m, switchboard=paths.switchboard if paths.switchboard.is_dir() else None,
                  profile=paths.profile, plan=paths.plan, bench_result=bench.get("result"))


def _write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    with open(path, "w", newline="") as fh:
        if rows:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def _plot(out: Path, pred: Sequence[Predicted], measured: Sequence[Mapping[str, Any]], arrival: str,
          compared: Sequence[Mapping[str, Any]] = ()) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for name, ylabel, fields_ in (("latency_vs_qps.png", "latency (ms)", ("p50_ms", "p99_ms")),
                                  ("throughput_vs_qps.png", "achieved throughput (requests/s)", ("achieved_qps",))):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        variants = list(dict.fromkeys(p.variant for p in pred))
        for vi, variant in enumerate(variants):
            mrows = [m for m in measured if m["variant"] == variant]
            for fi, f in enumerate(fields_):
                # one colour per variant and figure: measured solid, predicted dashed (the bench's arrivals) or
                # dotted (the others), at the level's speed open squares
                color, what = f"C{(2 * vi + fi) % 10}", f"{variant} {f.removesuffix('_ms')}"
                for kind in dict.fromkeys(p.arrival for p in pred):
                    pts = [p for p in pred if p.variant == variant and p.arrival == kind]
                    ax.plot([p.offered_qps for p in pts], [getattr(p, f) for p in pts],
                            "--" if kind == arrival else ":", marker="x", color=color,
                            label=f"{what} predicted ({kind})")
                if mrows:
                    ax.plot([float(m["offered_qps"]) for m in mrows], [float(m[f]) for m in mrows], "-o", color=color,
                            label=f"{what} measured")
                # [Note: the level's speed]: the levels simulated again at the speed the bench computed at
                key = f"at_speed_{f.replace('achieved_', '')}"
                sp = [(r["offered_qps"], r[key]) for r in compared
                      if r["variant"] == variant and math.isfinite(r.get(key, math.nan))]
                if sp:
                    ax.plot(*zip(*sp, strict=True), linestyle="none", marker="s", fillstyle="none", markersize=8,
                            color=color, label=f"{what} predicted at the level's speed")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        files.append(str(out / name))
    return files
