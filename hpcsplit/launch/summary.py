"""``summary.md``: the page of a run folder a person reads first.

Written by :mod:`hpcsplit.launch.pipeline` after every ``stage=all`` run, also after a failed stage (then
it says which stage failed and how to resume).  Every section reads files of the run folder and is
skipped when they are missing, so a partial run still gets a useful summary.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan
from hpcsplit.core.profile_format import read_profile
from hpcsplit.switchboard.layout import LAYOUT_FILE
from hpcsplit.switchboard.picture import PICTURE_PNG, PICTURE_SVG

__all__ = ["plots_of", "write_summary"]


def plots_of(paths: RunPaths) -> list[Path]:
    """Every PNG under the run folder (sorted, submitit's folder left out)."""
    return sorted(p for p in paths.run_dir.rglob("*.png") if paths.slurm_dir not in p.parents)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _components(sb_dir: Path, run_dir: Path) -> list[str]:
    try:
        layout = json.loads((sb_dir / LAYOUT_FILE).read_text())  # read as JSON: no torch here
    except (OSError, ValueError):
        return []
    out = [
        "## Components",
        "",
        f"Switchboard `{sb_dir}` (model `{layout.get('model')}`); sha256 of {LAYOUT_FILE} in the manifest.",
        "",
        "| component | parameters | inputs | outputs |",
        "|---|---:|---|---|",
    ]
    for c in layout.get("components", []):
        ins = ", ".join(t.get("name", "?") for t in c.get("inputs", []))
        outs = ", ".join(t.get("name", "?") for t in c.get("outputs", []))
        out.append(f"| {c.get('name')} | {_human(float(c.get('param_bytes', 0)))} | {ins} | {outs} |")
    if (sb_dir / PICTURE_PNG).is_file():  # the export's picture of the split (a side file of the switchboard)
        png, svg = (os.path.relpath(sb_dir / n, run_dir) for n in (PICTURE_PNG, PICTURE_SVG))
        out += ["", f"![the split: components, the bytes each edge carries, the region decisions]({png})",
                "", f"(also [{svg}]({svg}))"]
    ver = layout.get("verification") or {}
    if ver:
        out += [
            "",
            (f"Export check: max abs diff {ver.get('max_abs_diff', math.nan):.3g} at batch "
            f"{ver.get('batch_size')} (atol {ver.get('atol')}, rtol {ver.get('rtol')}), "
            f"passed: {ver.get('passed')}."),
        ]
    return out


def _profile(path: Path) -> list[str]:
    if not path.is_file():
        return []
    try:
        prof = read_profile(path, allow_incomplete=True)
    except Exception as e:  # noqa: BLE001 - a summary never fails the run
        return ["## Profile", "", f"`{path}` could not be read: {e}"]
    done, total = prof.n_cells()
    unit = "GB" if prof.meta.slice_unit == "gb" else "threads"
    out = [
        "## Profile highlights",
        "",
        (f"`{path.name}`: {done}/{total} cells, {'complete' if prof.complete else 'INCOMPLETE'}, device "
        f"{prof.meta.device_kind} ({prof.meta.device_name}), {prof.meta.iters} timed runs per cell "
        "(file format: docs/profile-format.md in the hpcsplit source; tables in `analysis/`)."),
        "",
        f"| component | p50 ms at batch 1 (largest slice) | best throughput req/s | at batch, {unit} |",
        "|---|---:|---:|---|",
    ]
    for name, cp in prof.components.items():
        s_last = len(cp.slices) - 1
        lat1 = cp.latency_p50_ms(0, s_last) if cp.batch_sizes else math.nan
        best, where = math.nan, "-"
        for bi, b in enumerate(cp.batch_sizes):
            for si, sl in enumerate(cp.slices):
                t = cp.throughput_rps(bi, si)
                if not math.isnan(t) and (math.isnan(best) or t > best):
                    best, where = t, f"{b}, {sl:g}"
        out.append(f"| {name} | {lat1:.3f} | {best:.1f} | {where} |")
    return out


def _plan(path: Path) -> list[str]:
    if not path.is_file():
        return []
    try:
        plan = Plan.load(path)
        text = plan.format()
    except Exception as e:  # noqa: BLE001
        return ["## Plan", "", f"`{path}` could not be read: {e}"]
    out = ["## Plan", "", f"`{path.name}`:", "", "```", text, "```"]
    choice = plan.meta.get("choice")
    if isinstance(choice, Mapping) and isinstance(choice.get("candidates"), list):  # allocate.rate_rps
        out += ["", (f"Chosen by prediction at {choice.get('rate_rps')} req/s within {choice.get('slo_ms')} ms "
                f"({choice.get('objective')}): {choice.get('why')}"), "",
                "| candidate | devices | ranks | within SLO | goodput req/s | p50 ms | p99 ms |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for r in choice["candidates"]:
            if isinstance(r, Mapping) and "within_slo" in r:
                out.append(f"| {r.get('candidate')}{' (chosen)' if r.get('chosen') else ''} | {r.get('devices')} | "
                           f"{r.get('ranks')} | {_fig(r.get('within_slo'), '.1%')} | "
                           f"{_fig(r.get('goodput_rps'), '.2f')} | {_fig(r.get('p50_ms'), '.2f')} | "
                           f"{_fig(r.get('p99_ms'), '.2f')} |")
    return out


def _fig(v: Any, fmt: str) -> str:
    """A figure of the plan file (written by someone else): a number in ``fmt``; "-" where the simulation had none
    (a p50 of a candidate that answered nothing is null in the plan, :func:`hpcsplit.core.plan.strict_json`)."""
    return format(float(v), fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def _cores(v: Any) -> str:
    """A CPU figure of compare.csv (cores, or empty / NaN where not measured or not simulated) for the table."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return ""
    return f"{x:.2f}" if math.isfinite(x) else ""


def _bench(result: Mapping[str, Any] | None, paths: RunPaths) -> list[str]:
    if not result:
        return []
    out = ["## Benchmark (split vs whole)", ""]
    if result.get("mode") == "batch":
        out.append("The serve stage ran in batch mode (no benchmark table).")
    for vname, v in (result.get("variants") or {}).items():
        e2e = v.get("end_to_end") if isinstance(v, Mapping) else None
        if e2e:
            out.append(
                f"- {vname}: served outputs of {e2e.get('samples')} requests match the reference "
                f"({e2e.get('reference')}), max |diff| {float(e2e.get('max_abs_diff', math.nan)):.2e}"
            )
    bench = result.get("bench") if isinstance(result.get("bench"), Mapping) else result
    table = bench.get("table") if isinstance(bench, Mapping) else None
    if table:
        out += ["", "```", str(table).rstrip(), "```"]
    if isinstance(bench, Mapping) and bench.get("low_load_vs_floor"):
        out.append(
            f"\nLow load: split p50 = {float(bench['low_load_vs_floor']):.2f} x the critical-path floor "
            f"({float(bench.get('critical_path_ms', math.nan)):.2f} ms) predicted by the profile."
        )
        b1 = bench.get("low_load_batch1_compute_ms")
        if isinstance(b1, Mapping) and b1:
            out.append("Compute of a batch of one at that load vs the profile (ms): " + ", ".join(
                f"{c} {float(v['run_p50']):.1f} vs {float(v.get('profile_p50') or math.nan):.1f}"
                for c, v in b1.items()) + ".")
    if isinstance(bench, Mapping) and bench.get("low_load_vs_floor_now"):
        out.append(
            f"Re-measured on the ranks just before the split levels, the critical-path floor is "
            f"{float(bench.get('critical_path_now_ms', math.nan)):.2f} ms: split p50 = "
            f"{float(bench['low_load_vs_floor_now']):.2f} x that floor (target <= 1.10 x)."
        )
    names = ("summary.csv", "improvement.csv", "requests.h5")  # what the bench mode writes (runtime)
    files = [os.path.relpath(paths.bench_dir / n, paths.run_dir) for n in names if (paths.bench_dir / n).exists()]
    if files:
        out.append("\nFiles: " + ", ".join(f"[{p}]({p})" for p in files))
    return out


def _simulate(paths: RunPaths) -> list[str]:
    """Predicted beside measured (``simulate/compare.csv``), else the predictions alone (``stage=simulate``)."""
    folder = paths.simulate_dir
    compare, predicted = folder / "compare.csv", folder / "predicted.csv"
    try:
        if compare.is_file():
            with open(compare, newline="") as fh:
                rows = list(csv.DictReader(fh))
            out = ["## Simulated vs measured", "",
                   ("`stage=simulate` of this plan beside the bench (the bench's own levels and schedule; p50 within "
                   "10 % and p99 within 20 % below saturation, throughput within 10 % past it)."), "",
                   ("| variant | QPS | p50 ms measured | predicted | error | p99 ms measured | predicted | error "
                   "| req/s measured | predicted | error | CPU cores measured | predicted | target | at the level's speed |"),
                   "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
            for r in rows:
                out.append(
                    f"| {r['variant']} | {float(r['offered_qps']):g} | {float(r['measured_p50_ms']):.2f} | "
                    f"{float(r['predicted_p50_ms']):.2f} | {float(r['p50_err_pct']):+.1f}% | "
                    f"{float(r['measured_p99_ms']):.2f} | {float(r['predicted_p99_ms']):.2f} | "
                    f"{float(r['p99_err_pct']):+.1f}% | {float(r['measured_qps']):.2f} | {float(r['predicted_qps']):.2f} | "
                    f"{float(r['qps_err_pct']):+.1f}% | {_cores(r.get('measured_cpu_cores'))} | "
                    f"{_cores(r.get('predicted_cpu_cores'))} | {r['target']}"
                    f"{' (saturated)' if r['saturated'] == 'True' else ''} | {_at_speed(r)} |")
            out += ["", ("CPU cores: what the ranks on the frontend's node used over the level (the bench reads /proc; the "
                         "simulation counts its computing, polling and backing-off ranks); empty where not known."),
                    "", ("At the level's speed: the critical-path compute of the level's requests that were alone in the "
                         "system, measured over simulated (xF: how much slower the machine computed than the profile), and "
                         "the level simulated again with every component's compute times F: its p50 / p99 (or req/s) "
                         "errors and verdict. A miss that disappears there is the machine's drift, one that stays the "
                         "model's; empty where too few requests ran alone. The target column is the one that counts.")]
            return out
        if predicted.is_file():
            with open(predicted, newline="") as fh:
                rows = list(csv.DictReader(fh))
            out = ["## Simulated", "", "`stage=simulate` of this plan (no bench of it in this run folder).", "",
                   "| variant | arrival | QPS | achieved req/s | p50 ms | p90 ms | p99 ms |", "|---|---|---:|---:|---:|---:|---:|"]
            for r in rows:
                out.append(f"| {r['variant']} | {r['arrival']} | {float(r['offered_qps']):g} | "
                           f"{float(r['achieved_qps']):.2f} | {float(r['p50_ms']):.2f} | {float(r['p90_ms']):.2f} | "
                           f"{float(r['p99_ms']):.2f} |")
            return out
    except (OSError, KeyError, ValueError) as e:  # a summary never fails the run
        return ["## Simulated", "", f"`{folder}` could not be read: {e}"]
    return []


def _at_speed(r: Mapping[str, Any]) -> str:
    """``x1.19: -4% / +1% met`` from a compare.csv row (``[Note: the level's speed]``); empty when not known."""
    try:
        f = float(r.get("compute_ratio") or "nan")
        if not (math.isfinite(f) and math.isfinite(float(r.get("at_speed_p50_ms") or "nan"))):
            return ""
        if r["saturated"] == "True":
            return f"x{f:.2f}: {float(r['at_speed_qps_err_pct']):+.1f}% {r.get('target_at_speed', '')}"
        return (f"x{f:.2f}: {float(r['at_speed_p50_err_pct']):+.1f}% / {float(r['at_speed_p99_err_pct']):+.1f}% "
                f"{r.get('target_at_speed', '')}")
    except (KeyError, ValueError):
        return ""


def _stages(manifest: Mapping[str, Any]) -> list[str]:
    out = ["## Stages", "", "| stage | status | wall s | inputs sha256 |", "|---|---|---:|---|"]
    for name, st in (manifest.get("stages") or {}).items():
        wall = st.get("wall_s")
        out.append(
            f"| {name} | {st.get('status')} | {'' if wall is None else f'{wall:.1f}'} | "
            f"`{str(st.get('inputs_sha256', ''))[:12]}` |"
        )
    return out


def write_summary(
    paths: RunPaths,
    manifest: Mapping[str, Any],
    *,
    switchboard: Path | None,
    profile: Path | None,
    plan: Path | None,
    bench_result: Mapping[str, Any] | None,
    failure: str | None = None,
) -> Path:
    """Write ``RunPaths.summary`` from what the run folder holds; return its path."""
    run_dir = paths.run_dir
    lines = [f"# hpcsplit run: {manifest.get('model') or '?'}", ""]
    lines.append(
        f"Run folder `{run_dir}`; launcher `{manifest.get('launcher')}`, cluster `{manifest.get('cluster')}`. "
        f"Re-run or continue with `python -m hpcsplit ... resume={run_dir}` (stages whose inputs did not "
        "change are skipped; `{paths.manifest.name}` records the hashes)."
    )
    if failure:
        lines += ["", "**FAILED**: " + failure.splitlines()[0], "", "```", failure.strip()[:3000], "```"]
    lines.append("")
    for section in (
        _stages(manifest),
        _components(switchboard, run_dir) if switchboard else [],
        _profile(profile) if profile else [],
        _plan(plan) if plan else [],
        _bench(bench_result, paths),
        _simulate(paths),
    ):
        if section:
            lines += [*section, ""]
    pngs = plots_of(paths)
    lines += ["## Plots", ""]
    if pngs:
        for p in pngs:
            rel = os.path.relpath(p, run_dir)
            lines.append(f"- [{rel}]({rel})")
    else:
        lines.append("(none yet)")
    lines.append("")
    out = paths.summary
    out.write_text("\n".join(lines))
    return out
