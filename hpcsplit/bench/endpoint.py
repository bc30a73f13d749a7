"""Split vs whole through the endpoint: perf_analyzer concurrency sweeps against the Open Inference Protocol server.

    python -m hpcsplit.bench endpoint RUN [--concurrency 1,2,4,8] [--interval-ms 5000] [--protocol http]
    python -m hpcsplit.bench endpoint --switchboard DIR --plan PLAN [...]

``RUN`` is a pipeline run folder (its ``switchboard/`` and ``plan.json``; ``python -m hpcsplit +experiment=clip``
writes one).  For each of

* ``whole``: ``runtime.server_model=whole`` (the unsplit model on every component rank of the plan, requests to
  the least-loaded one: the bench's baseline), and
* ``split``: the plan as allocated,

it starts ``stage=serve runtime.mode=server`` under mpiexec on this node (token on, as deployed), drives it with
perf_analyzer at each concurrency (binary tensors; the switchboard's own golden inputs, first row, as
perf_analyzer's ``--input-data`` folder: real pixels and valid token ids), and stops it with SIGTERM.  One
run, figures side by side: infer/s, p50 and p99 (perf_analyzer's, client side) and the split/whole ratios; ``endpoint_sweep.csv`` and ``endpoint_sweep.png`` go to ``--out`` (default ``RUN/bench``).
"""

from __future__ import annotations

import argparse
import csv
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hpcsplit.bench.server import _perf, _start_hpcsplit, perf_analyzer
from hpcsplit.core.plan import Plan
from hpcsplit.errors import HpcsplitError
from hpcsplit.switchboard.reader import Switchboard

VARIANTS = ("whole", "split")


def input_data(sb: Path, out: Path) -> Path:
    """perf_analyzer's ``--input-data`` folder for ``sb``: one file per model input, named as the input, holding
    the raw bytes (row-major) of the first row of the switchboard's golden inputs (a batch-1 request)."""
    board = Switchboard.load(sb)
    out.mkdir(parents=True, exist_ok=True)
    for t, x in zip(board.layout.inputs, board.example_inputs(), strict=True):
        if t.name in ("", ".", "..") or Path(t.name).name != t.name or "\0" in t.name:
            raise HpcsplitError(f"{sb}: model input {t.name!r} cannot name a file of perf_analyzer's input data; "
                                "rename the input in the model and re-run the export")
        (out / t.name).write_bytes(x[:1].contiguous().numpy().tobytes())
    return out


def _sweep(pa: Path, tmp: Path, sb: Path, plan: Path, n: int, variant: str, levels: list[int], protocol: str,
           interval_ms: int) -> dict[int, tuple[float, float, float] | None]:
    t0 = time.monotonic()
    print(f"[{variant}] starting the server ({n} ranks) ...", flush=True)
    srv, info, token = _start_hpcsplit(tmp, sb, plan, n, {"server_model": variant}, name=variant)
    print(f"[{variant}] ready after {time.monotonic() - t0:.0f} s at {info['http_url']}", flush=True)
    out: dict[int, tuple[float, float, float] | None] = {}
    data = input_data(sb, tmp / "input-data")
    try:
        for c in levels:
            r = _perf(pa, info["model"], info[f"{protocol}_port"], protocol, "binary", c, interval_ms, token,
                      tmp / f"{variant}-{c}.csv", extra=("--input-data", str(data)), timeout_s=60 + 8 * interval_ms / 1e3)
            out[c] = r
            shown = f"{r[0]:.2f} infer/s, p50 {r[1]:.1f} ms, p99 {r[2]:.1f} ms" if r else "no stable measurement"
            print(f"[{variant}] concurrency {c}: {shown}", flush=True)
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            rc = srv.wait(60)
        except subprocess.TimeoutExpired:
            srv.kill()
            rc = srv.wait(10)
        print(f"[{variant}] stopped (exit {rc})", flush=True)
    return out


def _plot(path: Path, levels: list[int], res: dict[str, dict[int, Any]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for v, color in zip(VARIANTS, ("tab:blue", "tab:orange"), strict=True):
        xs = [c for c in levels if res[v].get(c)]
        a.plot(xs, [res[v][c][0] for c in xs], "o-", color=color, label=v)
        b.plot(xs, [res[v][c][1] for c in xs], "o-", color=color, label=f"{v} p50")
        b.plot(xs, [res[v][c][2] for c in xs], "x--", color=color, label=f"{v} p99")
    a.set(xlabel="concurrency (requests in flight)", ylabel="infer/s", title="throughput", xscale="log", xticks=levels)
    b.set(xlabel="concurrency (requests in flight)", ylabel="ms", title="latency (perf_analyzer)", xscale="log",
          xticks=levels)
    for ax in (a, b):
        ax.minorticks_off()
        ax.set_xticklabels([str(c) for c in levels])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcsplit.bench endpoint", description=__doc__.splitlines()[0])
    p.add_argument("run", nargs="?", help="a pipeline run folder (switchboard/ and plan.json)")
    p.add_argument("--switchboard", type=Path)
    p.add_argument("--plan", type=Path)
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--interval-ms", type=int, default=5000, help="perf_analyzer's measurement interval")
    p.add_argument("--protocol", choices=("http", "grpc"), default="http")
    p.add_argument("--out", type=Path, help="where the CSV and PNG go (default RUN/bench, else the current folder)")
    args = p.parse_args(argv)
    run = Path(args.run) if args.run else None
    sb = args.switchboard or (run / "switchboard" if run else None)
    plan_path = args.plan or (run / "plan.json" if run else None)
    if sb is None or plan_path is None:
        p.error("give a run folder, or --switchboard and --plan")
    try:
        levels = sorted({int(c) for c in args.concurrency.split(",")})
        if not levels or levels[0] < 1:
            raise ValueError
    except ValueError:
        p.error(f"--concurrency {args.concurrency!r}: give positive integers, comma-separated (1,2,4,8)")
    try:
        plan = Plan.load(plan_path)
    except (HpcsplitError, OSError) as e:
        print(f"cannot read the plan {plan_path}: {e}", file=sys.stderr)
        return 2
    if not (sb / "layout.json").is_file():
        print(f"{sb} is not a switchboard (no layout.json); run stage=export first or pass --switchboard",
              file=sys.stderr)
        return 2
    pa = perf_analyzer()
    if pa is None:
        return 2
    n = len(plan.ranks)
    out_dir = args.out or (run / "bench" if run else Path.cwd())
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict[str, dict[int, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="hpcsplit-bench-endpoint-") as d:
        for v in VARIANTS:
            res[v] = _sweep(pa, Path(d), sb.resolve(), plan_path.resolve(), n, v, levels, args.protocol,
                            args.interval_ms)
    title = (f"{plan.model}: split vs whole through the endpoint ({args.protocol}, {n} ranks, "
             f"{os.cpu_count()} cores)")
    print(f"python -m hpcsplit.bench endpoint: {title}; perf_analyzer {args.interval_ms} ms windows")
    print(f"{'conc':>4} | {'whole inf/s':>11} {'p50 ms':>8} {'p99 ms':>8} | {'split inf/s':>11} {'p50 ms':>8} "
          f"{'p99 ms':>8} | {'throughput':>10} {'p50':>7}")
    rows = []
    for c in levels:
        w, s = res["whole"].get(c), res["split"].get(c)

        def f(x: Any) -> str:
            return f"{x[0]:>11.2f} {x[1]:>8.1f} {x[2]:>8.1f}" if x else f"{'n/a':>11} {'':>8} {'':>8}"

        tput = f"{(s[0] / w[0] - 1) * 100:>+9.1f}%" if w and s else f"{'n/a':>10}"
        lat = f"{(s[1] / w[1] - 1) * 100:>+6.1f}%" if w and s else f"{'n/a':>7}"
        print(f"{c:>4} | {f(w)} | {f(s)} | {tput} {lat}")
        rows.append({"concurrency": c, **{f"{v}_{k}": (res[v][c][i] if res[v].get(c) else "")
                                          for v in VARIANTS for i, k in enumerate(("infer_per_s", "p50_ms", "p99_ms"))}})
    csv_path = out_dir / "endpoint_sweep.csv"
    with csv_path.open("w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    png = out_dir / "endpoint_sweep.png"
    _plot(png, levels, res, title)
    print(f"written: {csv_path}, {png}")
    return 0 if all(res[v].get(c) for v in VARIANTS for c in levels) else 1
