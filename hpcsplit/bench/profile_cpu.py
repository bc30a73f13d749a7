"""Wall time of the profile stage on CPU: ``python -m hpcsplit.bench profile_cpu [options]``.

Exports a model's switchboard (or uses ``--switchboard DIR``), profiles every component at batch
sizes 1, 2, 4, ... ``--max-batch`` and the thread slices ``--threads``, and writes the analysis
(tables and PNG plots) next to the profile. Prints the wall times of each step, the p50 latency
per component, batch size and slice, and each component's share of the summed latency.

Options: ``--model clip|clip_tiny|toy_mlp`` (default clip: ViT-B/32 shapes, random weights),
``--max-batch 16``, ``--threads 1,2``, ``--warmup 2``, ``--iters 10``, ``--out DIR``,
``--switchboard DIR``. The figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from hpcsplit.core.profile_format import read_profile
from hpcsplit.core.settings import group_defaults
from hpcsplit.profiling.analyze import analyze_file
from hpcsplit.profiling.runner import default_batch_sizes, profile_components
from hpcsplit.switchboard.stage import model_settings
from hpcsplit.switchboard.writer import export


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcsplit.bench profile_cpu")
    ap.add_argument("--model", default="clip", choices=["clip", "clip_tiny", "toy_mlp"])
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default="bench-profile-cpu")
    ap.add_argument("--switchboard", default=None)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared machines inflate figures)"
    )
    t0 = time.perf_counter()
    if a.switchboard:
        sb_dir = Path(a.switchboard)
        t_export = 0.0
    else:
        # conf/model/<name>.yaml at its example batch; seed 0 (the YAML's ${seed} default)
        ms = model_settings({"model": {**group_defaults("model", a.model), "seed": 0, "batch_size": 2}})
        model, args, kwargs = ms.build()
        sb_dir = out / f"switchboard-{a.model}"
        export(model, args, kwargs, out=sb_dir, name=a.model, force=a.model != "clip")  # tiny ones: forced
        t_export = time.perf_counter() - t0
    prof_path = out / f"profile-{a.model}.h5"
    prof_path.unlink(missing_ok=True)
    threads = [int(x) for x in a.threads.split(",")]
    batch_sizes = default_batch_sizes(a.max_batch)
    t1 = time.perf_counter()
    summary = profile_components(
        sb_dir, batch_sizes=batch_sizes, slices=threads, warmup=a.warmup, iters=a.iters, out=prof_path
    )
    t_profile = time.perf_counter() - t1
    t2 = time.perf_counter()
    res = analyze_file(prof_path, out / f"analysis-{a.model}", echo=False)
    t_analyze = time.perf_counter() - t2

    prof = read_profile(prof_path)
    print(f"\nmodel {a.model}: {len(prof.components)} components {list(prof.components)}")
    print(f"batch sizes {list(batch_sizes)}, threads {threads}, warmup {a.warmup}, iters {a.iters}")
    print(f"cells {summary['cells_measured']}; load average now {os.getloadavg()[0]:.2f}")
    print(f"{'step':<10} {'wall s':>8}")
    for step, sec in (("export", t_export), ("profile", t_profile), ("analyze", t_analyze)):
        print(f"{step:<10} {sec:>8.1f}")
    for si, th in enumerate(threads):
        print(f"\np50 latency (ms), {th} thread(s); share = component / sum of components")
        names = list(prof.components)
        print(f"{'batch':>5} " + " ".join(f"{n[:14]:>14}" for n in names) + f" {'sum':>9} " + " ".join(
            f"{'share ' + n[:8]:>14}" for n in names
        ))  # fmt: skip
        for bi, b in enumerate(batch_sizes):
            vals = [prof.components[n].latency_p50_ms(bi, si) for n in names]
            total = sum(vals)
            print(f"{b:>5} " + " ".join(f"{v:>14.2f}" for v in vals) + f" {total:>9.2f} " + " ".join(
                f"{v / total:>14.2f}" for v in vals
            ))  # fmt: skip
    print(f"\nprofile: {prof_path}\ntables: {res['table_csv']}, {res['table_md']}")
    print("plots: " + ", ".join(res["plots"]))
    return 0
