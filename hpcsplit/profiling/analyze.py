"""Tables and plots from a profile: ``python -m hpcsplit stage=analyze profile=PATH``.

Writes into ``<run_dir>/analysis/`` (or ``profile.analysis_dir``):

- ``profile_table.csv`` and ``profile_table.md``: one row per component x batch size x slice
  with p50/p99 latency, throughput (batch / p50 latency), peak memory and utilization;
- ``latency_vs_batch.png``, ``throughput_vs_batch.png``, ``peak_mem_vs_batch.png``: one panel
  per component, one line per slice, batch size on a log2 axis; out-of-memory cells are marked.

Also runs without Hydra: ``python -m hpcsplit.profiling.analyze PROFILE.h5 [OUT_DIR]``.
"""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcsplit.core.profile_format import Profile, read_profile

__all__ = ["TableRow", "analyze_file", "main", "plot_profile", "profile_table", "write_tables"]

_PLOTS = ("latency_vs_batch.png", "throughput_vs_batch.png", "peak_mem_vs_batch.png")


@dataclass(frozen=True, slots=True)
class TableRow:
    """One cell of the profile, summarised."""

    component: str
    batch_size: int
    slice: float
    status: str  # "ok" | "oom" | "oom (inferred)" | "missing"
    latency_p50_ms: float
    latency_p99_ms: float
    throughput_rps: float
    peak_mem_bytes: float
    utilization: float
    cpu_busy_fraction: float


def profile_table(prof: Profile) -> list[TableRow]:
    """Every cell of ``prof`` as a :class:`TableRow` (component, then slice, then batch size)."""
    rows = []
    for name, c in prof.components.items():
        for si, sl in enumerate(c.slices):
            for bi, b in enumerate(c.batch_sizes):
                if not c.measured[bi, si]:
                    status = "missing"
                elif c.oom[bi, si]:
                    status = "oom (inferred)" if c.oom_inferred.size and c.oom_inferred[bi, si] else "oom"
                else:
                    status = "ok"
                busy = float(c.cpu_busy_fraction[bi, si]) if c.cpu_busy_fraction.size else math.nan
                rows.append(
                    TableRow(
                        component=name,
                        batch_size=b,
                        slice=sl,
                        status=status,
                        latency_p50_ms=c.latency_p50_ms(bi, si),
                        latency_p99_ms=c.latency_p99_ms(bi, si),
                        throughput_rps=c.throughput_rps(bi, si),
                        peak_mem_bytes=float(c.peak_mem_bytes[bi, si]),
                        utilization=float(c.utilization[bi, si]),
                        cpu_busy_fraction=busy,
                    )
                )
    return rows


def _f(x: float, fmt: str) -> str:
    return "" if math.isnan(x) else format(x, fmt)


def write_tables(rows: list[TableRow], prof: Profile, out_dir: Path) -> tuple[Path, Path, str]:
    """Write ``profile_table.csv`` and ``profile_table.md``; return their paths and the markdown."""
    unit = prof.meta.slice_unit
    csv_path, md_path = out_dir / "profile_table.csv", out_dir / "profile_table.md"
    with csv_path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(
            ["component", "batch_size", f"slice_{unit}", "status", "latency_p50_ms", "latency_p99_ms",
             "throughput_rps", "peak_mem_bytes", "utilization", "cpu_busy_fraction"]
        )  # fmt: skip
        for r in rows:
            w.writerow(
                [r.component, r.batch_size, f"{r.slice:g}", r.status, _f(r.latency_p50_ms, ".6g"),
                 _f(r.latency_p99_ms, ".6g"), _f(r.throughput_rps, ".6g"), _f(r.peak_mem_bytes, ".0f"),
                 _f(r.utilization, ".4f"), _f(r.cpu_busy_fraction, ".4f")]
            )  # fmt: skip
    m = prof.meta
    done, total = prof.n_cells()
    lines = [
        f"# Profile of `{m.model}` on {m.device_name}",
        "",
        (
            f"{done}/{total} cells measured{'' if m.complete else ' (INCOMPLETE: resume the profile stage)'}; "
            f"{m.iters} timed runs per cell after {m.warmup} warm-up; slice = {unit}; timer {m.latency_timer}; "
            f"torch {m.torch_version}; host {m.host}; switchboard {m.switchboard_sha256[:12]}."
        ),
        "",
        f"| component | batch | slice ({unit}) | status | p50 ms | p99 ms | throughput /s | peak MiB | util |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.component} | {r.batch_size} | {r.slice:g} | {r.status} | {_f(r.latency_p50_ms, '.3f')} | "
            f"{_f(r.latency_p99_ms, '.3f')} | {_f(r.throughput_rps, '.1f')} | "
            f"{_f(r.peak_mem_bytes / 2**20, '.3g')} | {_f(r.utilization, '.2f')} |"
        )
    md = "\n".join(lines) + "\n"
    md_path.write_text(md)
    return csv_path, md_path, md


def plot_profile(prof: Profile, out_dir: Path) -> list[Path]:
    """Write the three PNG plots (one panel per component, one line per slice); return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit = "GB" if prof.meta.slice_unit == "gb" else "threads"
    metrics = {
        "latency_vs_batch.png": ("p50 latency (ms)", lambda c, b, s: c.latency_p50_ms(b, s)),
        "throughput_vs_batch.png": ("throughput (samples/s)", lambda c, b, s: c.throughput_rps(b, s)),
        "peak_mem_vs_batch.png": ("peak memory (MiB)", lambda c, b, s: float(c.peak_mem_bytes[b, s]) / 2**20),
    }
    paths = []
    comps = list(prof.components.values())
    n = len(comps)
    for fname, (ylabel, value) in metrics.items():
        fig, axes = plt.subplots(1, n, figsize=(4.2 * n + 0.6, 3.6), squeeze=False, constrained_layout=True)
        for ax, c in zip(axes[0], comps, strict=True):
            for si, sl in enumerate(c.slices):
                xs = list(c.batch_sizes)
                ys = [value(c, bi, si) for bi in range(len(xs))]
                (line,) = ax.plot(xs, ys, marker="o", label=f"{sl:g} {unit}")
                oom_x = [x for bi, x in enumerate(xs) if c.measured[bi, si] and c.oom[bi, si]]
                if oom_x:
                    ax.plot(oom_x, [0.0] * len(oom_x), "x", color=line.get_color(), ms=9, clip_on=False)
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(c.batch_sizes), [str(b) for b in c.batch_sizes])
            ax.set_title(c.name)
            ax.set_xlabel("batch size")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(title="slice (x = OOM)", fontsize=8)
        fig.suptitle(f"{prof.meta.model} on {prof.meta.device_name}", fontsize=10)
        path = out_dir / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def analyze_file(path: str | Path, out_dir: str | Path, *, echo: bool = True) -> dict[str, Any]:
    """Read ``path`` (incomplete files too), write tables and plots into ``out_dir``."""
    prof = read_profile(path, allow_incomplete=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = profile_table(prof)
    csv_path, md_path, md = write_tables(rows, prof, out)
    plots = plot_profile(prof, out)
    if echo:
        print(md, flush=True)
        print(f"tables: {csv_path}, {md_path}\nplots: {', '.join(str(p) for p in plots)}", flush=True)
    done, total = prof.n_cells()
    return {
        "stage": "analyze",
        "profile": str(path),
        "complete": prof.complete,
        "cells_measured": done,
        "cells_total": total,
        "table_csv": str(csv_path),
        "table_md": str(md_path),
        "plots": [str(p) for p in plots],
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"} or len(argv) > 2:
        print("usage: python -m hpcsplit.profiling.analyze PROFILE.h5 [OUT_DIR]", file=sys.stderr)
        return 0 if argv else 2
    path = Path(argv[0])
    out_dir = Path(argv[1]) if len(argv) > 1 else path.parent / "analysis"
    analyze_file(path, out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
