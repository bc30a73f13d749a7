"""Bench mode on the frontend: open-loop levels per variant, then results files, table and plots.

Files under the run folder's ``bench/`` (``RunPaths.bench_dir``): ``levels.csv`` (``RunPaths.bench_levels``:
one row appended and synced as each level ends, so a job stopped or killed keeps its finished levels),
``requests.h5`` (per variant and QPS:
arrival, done, latency, status per request; and the summary table), ``summary.csv`` (one row per variant
and QPS: achieved QPS, success rate, p50/p90/p99), ``improvement.csv`` (the prototype's table),
``latency_vs_qps.png`` and ``throughput_vs_qps.png``.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcsplit.core.load import level_arrivals
from hpcsplit.core.profile_format import read_profile
from hpcsplit.runtime.context import RankContext, say
from hpcsplit.runtime.faults import job_process
from hpcsplit.runtime.frontend import Frontend, request_getter
from hpcsplit.runtime.heap import settle_heap
from hpcsplit.runtime.loadgen import LevelSummary, arrival_times, format_table, improvement_rows, summarize
from hpcsplit.runtime.routing import critical_path_ms, graph_from_switchboard
from hpcsplit.runtime.threads import cpu_seconds_each

__all__ = ["critical_path_floor_ms", "finish", "floor_now_ms", "in_run_batch1_ms", "node_pids", "run_levels",
           "start_levels"]


def _say(msg: str) -> None:
    say(0, msg)


def _append_rows(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    """Append ``rows`` to the CSV file ``path`` (``header`` first when it is new or empty), on disk at once (flushed
    and synced): a job stopped or killed keeps what it finished."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as fh:
        w = csv.writer(fh)
        if new:
            w.writerow(header)
        w.writerows(rows)
        fh.flush()
        os.fsync(fh.fileno())


def _append_level(path: Path, s: LevelSummary) -> None:
    """One finished level as a CSV row of ``RunPaths.bench_levels``."""
    row = s.to_dict()
    _append_rows(path, list(row), [list(row.values())])


def start_levels(ctx: RankContext) -> None:
    """Empty ``RunPaths.bench_levels`` before the first level of a bench run, and write ``RunPaths.bench_record``
    (what ``stage=simulate`` needs to simulate the same levels: the plan's hash, the schedule, the policy)."""
    ctx.paths.bench_levels.parent.mkdir(parents=True, exist_ok=True)
    ctx.paths.bench_levels.write_text("")
    ctx.paths.bench_rank_cpu.write_text("")
    b, rt = ctx.bench, ctx.runtime
    record = {"plan_sha256": hashlib.sha256(ctx.paths.plan.read_bytes()).hexdigest(), "qps": list(b.qps),
              "duration_s": b.duration_s, "min_requests": b.min_requests, "arrival": b.arrival, "seed": b.seed,
              "request_timeout_s": b.request_timeout_s or rt.request_timeout_s, "max_inflight": rt.max_inflight,
              "max_wait_ms": rt.max_wait_ms, "spin_us": ctx.spin_s * 1e6}
    ctx.paths.bench_record.write_text(json.dumps(record, indent=1) + "\n")


def run_levels(ctx: RankContext, fe: Frontend, variant: str) -> dict[str, Any]:
    """Warm up, then one open-loop level per ``bench.qps``; returns summaries and per-request arrays."""
    b = ctx.bench
    rt = ctx.runtime
    timeout = b.request_timeout_s or rt.request_timeout_s
    k = b.input_pool
    pool = [torch.as_tensor(x) for x in ctx.switchboard.example_inputs(k)]
    get = request_getter(fe.df, pool, modulo=k)

    if b.warmup_s > 0:
        fe.run(arrival_times(b.qps[0], b.warmup_s, "constant"), get, None, timeout, rt.max_inflight)
    levels, raw, windows = [], [], []
    ranks, pids = node_ranks(ctx)
    for i, q in enumerate(b.qps):
        arr = level_arrivals(q, i, b.duration_s, b.min_requests, b.arrival, b.seed)
        settle_heap()  # the last level's leftovers: no full collection in this one ([Note: frozen heap])
        w0, c0 = time.time(), cpu_seconds_each(pids)
        res = fe.run(arr, get, None, timeout, rt.max_inflight)
        w1, c1 = time.time(), cpu_seconds_each(pids)
        windows.append((w0, w1))
        s = summarize(variant, q, res.arrival_s, res.done_s, res.ok, res.path_ms)
        each = [(r, (b1 - a) / (w1 - w0)) for r, a, b1 in zip(ranks, c0, c1, strict=True)
                if a is not None and b1 is not None and w1 > w0]
        if each:
            s = replace(s, cpu_cores=sum(c for _, c in each))
            _append_rank_cpu(ctx.paths.bench_rank_cpu, variant, q, [(r, _label(fe, r), c) for r, c in each])
        levels.append(s)
        _append_level(ctx.paths.bench_levels, s)
        raw.append({"qps": q, "request_ids": res.request_ids, "arrival_s": res.arrival_s,
                    "admit_s": res.admit_s, "done_s": res.done_s, "status": res.status,
                    "critical_path_ms": res.path_ms})
        _say(f"bench {variant:>5} qps {q:>7g}: achieved {s.achieved_qps:8.2f} req/s, ok {s.success_rate:6.1%}, "
             f"p50 {s.p50_ms:8.2f} ms, p90 {s.p90_ms:8.2f} ms, p99 {s.p99_ms:8.2f} ms ({s.n_requests} requests; "
             f"critical-path compute p50 {s.path_p50_ms:.2f} ms"
             + (f"; the {len(pids)} ranks on this node used {s.cpu_cores:.2f} cores)" if s.cpu_cores >= 0 else ")"))
        if each:
            _say(f"bench {variant:>5} qps {q:>7g}: cores used per rank: "
                 + ", ".join(f"{r} {_label(fe, r)} {c:.2f}" for r, c in each))
    return {"levels": levels, "raw": raw, "windows": windows}


def _label(fe: Frontend, rank: int) -> str:
    return fe.df.rank_component.get(rank) or ("frontend" if rank == 0 else "-")


def node_pids(ctx: RankContext) -> list[int]:
    """The processes of this rank's node's ranks (as published at start), whose CPU a level reports."""
    return node_ranks(ctx)[1]


def node_ranks(ctx: RankContext) -> tuple[list[int], list[int]]:
    """The ranks of this rank's node whose process is known (as published at start), and those processes."""
    me = ctx.hosts[ctx.rank] if ctx.rank < len(ctx.hosts) else None
    got = [(r, job_process(r)[1]) for r, h in enumerate(ctx.hosts) if h == me]
    got = [(r, p) for r, p in got if p > 0]
    return [r for r, _ in got], [p for _, p in got]


def _append_rank_cpu(path: Path, variant: str, qps: float, each: list[tuple[int, str, float]]) -> None:
    """One finished level's CPU per rank of the frontend's node (``RunPaths.bench_rank_cpu``): which rank a CPU node's
    load falls on (the frontend, a component), and what ``stage=simulate``'s per-rank CPU is checked against."""
    _append_rows(path, ["variant", "offered_qps", "rank", "component", "cpu_cores"],
                 [[variant, float(qps), r, c, f"{cores:.4f}"] for r, c, cores in each])


def in_run_batch1_ms(batch1: dict[tuple[str, str], list[tuple[float, float]]], variant: str,
                     window: tuple[float, float]) -> dict[str, tuple[float, int]]:
    """Per component of ``variant``: p50 compute (ms) of its batches of one request that ended within
    ``window`` (wall clock), and how many there were; components with none are left out.

    ``batch1`` maps (variant, component) to the (wall-clock end, ms) of those batches, replicas pooled.
    """
    out = {}
    for (v, comp), samples in batch1.items():
        ms = [m for a, m in samples if v == variant and window[0] <= a <= window[1]]
        if ms:
            out[comp] = (float(np.median(ms)), len(ms))
    return out


def critical_path_floor_ms(ctx: RankContext) -> tuple[float, dict[str, float], str] | None:
    """Critical path (batch 1, each component at its rank's threads/slice) from the profile, if any
    (``profile.path``, else the run folder's: ``RunPaths.profile``)."""
    path = ctx.paths.profile
    if not path.exists():
        return None
    try:
        p = read_profile(path, allow_incomplete=True)
    except Exception as e:  # noqa: BLE001 - the floor is informative only
        _say(f"no critical-path floor: cannot read profile {path}: {e}")
        return None
    graph = graph_from_switchboard(ctx.switchboard)
    lat: dict[str, float] = {}
    for name, _, _ in graph.components:
        cp = p.components.get(name)
        if cp is None or 1 not in cp.batch_sizes:
            _say(f"no critical-path floor: profile {path} has no batch-1 figures for {name!r}")
            return None
        reps = ctx.plan.replicas(name)
        want = reps[0].threads if ctx.plan.device_kind == "cpu" else (reps[0].slice_gb or 0.0)
        bi = cp.batch_sizes.index(1)
        order = sorted(range(len(cp.slices)), key=lambda s: abs(cp.slices[s] - want))
        vals = [cp.latency_p50_ms(bi, s) for s in order]
        v = next((x for x in vals if not math.isnan(x)), math.nan)
        if math.isnan(v):
            return None
        lat[name] = v
    return critical_path_ms(graph, lat), lat, str(path)


def _write_h5(path: Path, results: dict[str, Any], rows: list[dict[str, float]]) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        f.attrs["schema"] = "hpcsplit.bench/1"
        for variant, r in results.items():
            g = f.create_group(variant)
            for lvl, raw in zip(r["levels"], r["raw"], strict=True):
                h = g.create_group(f"qps_{lvl.offered_qps:g}")
                for k, v in lvl.to_dict().items():
                    h.attrs[k] = v
                for k in ("request_ids", "arrival_s", "admit_s", "done_s", "status", "critical_path_ms"):
                    h.create_dataset(k, data=np.asarray(raw[k]))
                h.create_dataset("latency_ms", data=(raw["done_s"] - raw["arrival_s"]) * 1e3)
        if rows:
            s = f.create_group("improvement")
            for k in rows[0]:
                s.create_dataset(k, data=np.asarray([r[k] for r in rows], dtype=np.float64))


def _plot(out: Path, results: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for variant, r in results.items():
        q = [s.offered_qps for s in r["levels"]]
        ax.plot(q, [s.p50_ms for s in r["levels"]], "o-", label=f"{variant} p50")
        ax.plot(q, [s.p99_ms for s in r["levels"]], "x--", label=f"{variant} p99")
    files.append(_save_qps_axes(fig, ax, "latency (ms)", out / "latency_vs_qps.png"))
    fig, ax = plt.subplots(figsize=(6, 4))
    allq: list[float] = []
    for variant, r in results.items():
        q = [s.offered_qps for s in r["levels"]]
        allq += q
        ax.plot(q, [s.achieved_qps for s in r["levels"]], "o-", label=variant)
    if allq:
        ax.plot(sorted(set(allq)), sorted(set(allq)), ":", color="gray", label="offered")
    files.append(_save_qps_axes(fig, ax, "achieved throughput (requests/s)", out / "throughput_vs_qps.png"))
    return files


def floor_now_ms(ctx: RankContext, samples: dict[str, list[float]]) -> tuple[float, dict[str, float]] | None:
    """Critical path from the batch-1 times the ranks measured before the split levels (p50 per component);
    None unless every component has some (see ``[Note: floor re-measured]`` in :mod:`~hpcsplit.runtime.context`)."""
    graph = graph_from_switchboard(ctx.switchboard)
    lat = {name: float(np.median(samples[name])) for name, _, _ in graph.components if samples.get(name)}
    if len(lat) != len(graph.components):
        return None
    return critical_path_ms(graph, lat), lat


def finish(ctx: RankContext, results: dict[str, Any],
           batch1: dict[tuple[str, str], list[tuple[float, float]]] | None = None,
           floor_samples: dict[str, list[float]] | None = None) -> dict[str, Any]:
    """Write the results files, print the table and the critical-path floor; return a JSON-able summary.

    ``batch1`` (see :func:`in_run_batch1_ms`) adds each component's compute at the lowest level beside
    the profile's figure; ``floor_samples`` (component -> ms of batches of one timed back to back on its
    rank just before the split levels) adds the floor re-measured in this run beside the profile's.
    """
    out = ctx.paths.bench_dir
    out.mkdir(parents=True, exist_ok=True)
    whole: list[LevelSummary] = results.get("whole", {}).get("levels", [])
    split: list[LevelSummary] = results.get("split", {}).get("levels", [])
    rows = improvement_rows(whole, split)
    with open(ctx.paths.bench_summary, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(LevelSummary.__dataclass_fields__))
        w.writeheader()
        for r in results.values():
            for s in r["levels"]:
                w.writerow(s.to_dict())
    if rows:
        with open(out / "improvement.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    _write_h5(out / "requests.h5", results, rows)
    table = format_table(rows)
    print(table, flush=True)
    summary: dict[str, Any] = {"bench_dir": str(out), "table": table,
                               "levels": [s.to_dict() for r in results.values() for s in r["levels"]],
                               "improvement": rows}
    # the lowest load (bench.qps need not be in order)
    lo = min(range(len(split)), key=lambda i: split[i].offered_qps) if split else 0
    if split:
        low = split[lo]
        line = (f"low load ({low.offered_qps:g} req/s): split p50 {low.p50_ms:.2f} ms; compute on the critical "
                f"path in this run p50 {low.path_p50_ms:.2f} ms; per request, latency / its critical-path "
                f"compute: median {low.over_path_p50:.3f}x (target <= 1.10x; the rest is transport, wake-ups "
                "and queueing behind earlier requests)")
        if whole:
            wlow = min(whole, key=lambda x: x.offered_qps)
            line += (f"; whole p50 {wlow.p50_ms:.2f} ms, latency / its compute: median "
                     f"{wlow.over_path_p50:.3f}x")
        print(line, flush=True)
        summary.update(low_load_latency_over_run_critical_path=low.over_path_p50)
    now = floor_now_ms(ctx, floor_samples) if floor_samples and split else None
    if now is not None:
        cp_now, lat_now = now
        low = split[lo]
        ratio = low.p50_ms / cp_now
        parts = ", ".join(f"{k} {v:.2f}" for k, v in lat_now.items())
        print(f"low load ({low.offered_qps:g} req/s): split p50 {low.p50_ms:.2f} ms vs critical-path floor "
              f"{cp_now:.2f} ms re-measured on the ranks just before the split levels (batch 1, back to back, "
              f"one rank at a time: {parts}) = {ratio:.2f}x the floor (target <= 1.10x: "
              f"{'met' if ratio <= 1.10 else 'MISSED'})", flush=True)
        summary.update(critical_path_now_ms=cp_now, critical_path_now_components_ms=lat_now,
                       low_load_vs_floor_now=ratio)
    floor = critical_path_floor_ms(ctx)
    if floor is not None and split:
        cp, lat, path = floor
        low = split[lo]
        parts = ", ".join(f"{k} {v:.2f}" for k, v in lat.items())
        line = (f"low load ({low.offered_qps:g} req/s): split p50 {low.p50_ms:.2f} ms vs critical-path floor "
                f"{cp:.2f} ms from the profile {path} (batch 1: {parts}) = {low.p50_ms / cp:.2f}x the floor "
                f"(target <= 1.10x; the profile was measured alone, the run shares the cores)")
        if now is not None:
            line += (f"; the same components re-measured now take {now[0] / cp:.2f}x what the profile "
                     "measured (the machine's speed, not the runtime)")
        print(line, flush=True)
        summary.update(critical_path_ms=cp, critical_path_components_ms=lat, low_load_vs_floor=low.p50_ms / cp,
                       profile=path)
        windows = results["split"].get("windows") or []
        if batch1 and len(windows) > lo:
            run = in_run_batch1_ms(batch1, "split", windows[lo])
            parts = ", ".join(f"{c} {run[c][0]:.2f} vs {lat[c]:.2f} ({run[c][0] / lat[c]:.2f}x, {run[c][1]} batches)"
                              for c in lat if c in run and lat[c] > 0)
            if parts:
                print(f"low load ({low.offered_qps:g} req/s): compute of a batch of one in this run vs the profile, "
                      f"ms: {parts} (the profile times each component alone and back to back; here a request "
                      "finds it idle, its weights out of cache, and the branches computing side by side)",
                      flush=True)
                summary["low_load_batch1_compute_ms"] = {c: {"run_p50": v, "batches": n, "profile_p50": lat.get(c)}
                                                         for c, (v, n) in run.items()}
    try:
        summary["plots"] = _plot(out, results)
    except Exception as e:  # noqa: BLE001 - a plotting failure must not lose the measurements
        _say(f"could not plot: {e}")
    return summary


def _save_qps_axes(fig: Any, ax: Any, ylabel: str, path: Path) -> str:
    """Log-log axes against offered load, legend, saved as PNG and closed; returns the path."""
    import matplotlib.pyplot as plt

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
