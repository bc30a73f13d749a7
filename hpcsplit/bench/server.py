"""Server benchmark: hpcsplit's Open Inference Protocol endpoint vs a bare echo server of the same libraries.

    python -m hpcsplit.bench server [--concurrency 1,8,64] [--protocols ...] [--rounds 1] [--workers 0]
        [--base CHECKOUT] [--server-cpus LIST --client-cpus LIST] [--interval-ms 2000] [--samples 2000]

One run, figures side by side: requests/s, p50 and p99 (perf_analyzer's, client side) at each concurrency
over HTTP with JSON tensors, HTTP with the binary extension, gRPC, and gRPC streaming (ModelStreamInfer), for

* ``hpcsplit``: ``stage=serve runtime.mode=server`` of a trivial model (one 8 -> 8 linear layer, one component:
  frontend + 1 rank under mpiexec), token on, as deployed;
* ``echo``: an aiohttp app and a grpc.aio server in one process answering every infer with a canned response
  (no parsing, no pipeline): the ceiling of the protocol stack in Python on this machine;
* ``hop``: the same echo, but every infer first goes to a peer process and back (a 12-byte header and the
  32 bytes of an answer over a socketpair; the peer does nothing but send them back, batched, as fast as it
  reads them), once with a peer that waits in ``recv`` and once with one that polls for 2 ms after each
  message as the component ranks do (``[Note: spin after work]``).  A split model's components run in other
  processes, so the better of the two is the ceiling of any server of a split model here: what one hop
  costs this machine, before any work of hpcsplit's;
* ``frontend``: the MPI frontend's own ceiling without a protocol: batch mode over ``--samples`` requests.

``server_bench.csv`` and ``server_bench.png`` (requests/s and p50 of every server, a panel per protocol) go to
``--out`` (default ``outputs/bench-server``).

Issue 31 (docs/serving.md, Benchmark): ``--workers 0,1,2`` runs one hpcsplit server per
``runtime.server_workers`` value; ``--base CHECKOUT`` serves the same model with an earlier checkout's code
beside this one (``git worktree add --detach /tmp/base 45d97c6``); around every perf_analyzer run the bench
reads each server's CPU time from ``/proc`` (the echo's process, hpcsplit's frontend rank and its workers)
and the requests it answered, and prints CPU per request; ``--rounds R`` measures every level R times, the
servers in turn, and shows medians; ``--server-cpus`` / ``--client-cpus`` pin the servers and perf_analyzer
(``taskset -c``).  Targets: the frontend's CPU per request at most 1.5x the echo's (HTTP binary, gRPC);
unary gRPC at 8 clients at least 2x the base's rate; with workers on spare cores, at least 0.7 of the
better hop's rate.

Target (issue 18): hpcsplit >= 70% of echo's rate on each protocol, and under 1 ms added to p50 at
concurrency 1.  The table also gives hpcsplit's rate against the better hop's, and the verdict names the
rows where even the hop is under 70% of the echo (a target no split server can reach on this machine).
perf_analyzer comes from ``scripts/setup-perf.sh`` (its own venv, .venv-perf).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcsplit.bench.server_echo import echo_main
from hpcsplit.bench.server_report import report
from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.launch.local import find_mpiexec
from hpcsplit.runtime.threads import cpu_seconds_of
from hpcsplit.switchboard.reader import Switchboard
from hpcsplit.switchboard.writer import export

ROOT = Path(__file__).resolve().parents[2]
MODES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("http-json", "http", "json", ()), ("http-binary", "http", "binary", ()), ("grpc", "grpc", "binary", ()),
    ("grpc-stream", "grpc", "binary", ("--streaming",)))  # ModelStreamInfer: one stream per client


# ------------------------------------------------------------------------------------------ setup
def _toy(tmp: Path) -> tuple[Path, Path, int]:
    """A trivial model (one 8 -> 8 linear layer, one component) exported, and its plan (frontend + 1 rank)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    sb_dir = tmp / "switchboard"
    export(m, (torch.randn(2, 8),), out=sb_dir, name="linear8", cost="flops", stages=1)
    sb = Switchboard.load(sb_dir)
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    for c in sb.order:
        ranks.append(RankEntry(len(ranks), "component", 0, None, None, 1, c, 16, 0))
    plan = tmp / "plan.json"
    Plan(sb.model_name, sb.sha256, "cpu", 1, tuple(ranks), dict.fromkeys(sb.order, 0.0), {}).save(plan)
    return sb_dir, plan, len(ranks)


def _mpi_cmd(n: int, cfg: Path, run: Path) -> list[str]:
    return [find_mpiexec(None), "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank",
            "hpcsplit.runtime.stage:mpi_main", str(cfg), str(run)]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _code_env(code: Path | None) -> tuple[dict[str, str], str | None]:
    """The environment and working folder of a server that runs the hpcsplit of checkout ``code`` (None: this
    one).  The checkout is the working folder as well as ``PYTHONPATH``: ``python -m`` puts the working
    folder first on ``sys.path``, so a 'base' started from this repository's root would import this code."""
    if code is None:
        return _env(), None
    return dict(_env(), PYTHONPATH=str(code)), str(code)


def _start_hpcsplit(tmp: Path, sb: Path, plan: Path, n: int, runtime: dict[str, Any] | None = None,
                    name: str = "server", code: Path | None = None,
                    prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], dict[str, Any], str]:
    """``stage=serve runtime.mode=server`` under mpiexec on this node; returns it once its endpoint is up.

    ``code``: serve with the hpcsplit of that checkout (``PYTHONPATH``) instead of this one; ``prefix``: a
    command the server runs under (``taskset -c 0-7``)."""
    cfg = tmp / f"{name}.cfg.json"
    cfg.write_text(json.dumps({"stage": "serve", "plan": str(plan), "switchboard": str(sb),
                               "runtime": {"mode": "server", "server_host": "127.0.0.1", "max_inflight": 256,
                                           "server_queue": 1024, **(runtime or {})}}))
    run = tmp / f"{name}-run"
    with open(tmp / f"{name}.log", "wb") as log:
        env, cwd = _code_env(code)
        proc = subprocess.Popen([*prefix, *_mpi_cmd(n, cfg, run)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                cwd=cwd)
    ep = run / "endpoint.json"
    t_end = time.monotonic() + 180
    while not ep.exists():
        if proc.poll() is not None or time.monotonic() > t_end:
            raise SystemExit(f"the hpcsplit server did not start; log: {tmp / f'{name}.log'}")
        time.sleep(0.2)
    time.sleep(0.2)
    info = json.loads(ep.read_text())
    return proc, info, Path(info["token_file"]).read_text().strip()


def _frontend_ceiling(tmp: Path, sb: Path, plan: Path, n: int, samples: int) -> float | None:
    cfg = tmp / "batch.cfg.json"
    cfg.write_text(json.dumps({"stage": "serve", "plan": str(plan), "switchboard": str(sb),
                               "runtime": {"mode": "batch", "num_samples": samples, "max_inflight": 256,
                                           "verify": False}}))
    run = tmp / "batch-run"
    subprocess.run(_mpi_cmd(n, cfg, run), env=_env(), capture_output=True, timeout=300, check=False)
    try:
        res = json.loads((run / "runtime.mpi_main.result.json").read_text())
        return float(res["variants"]["split"]["throughput_rps"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _perf(pa: Path, model: str, port: int, protocol: str, fmt: str, conc: int, interval_ms: int, token: str | None,
          out: Path, extra: tuple[str, ...] = (), timeout_s: float = 120.0,
          prefix: tuple[str, ...] = ()) -> tuple[float, float, float] | None:
    """One perf_analyzer level: (infer/s, p50 ms, p99 ms), or None (said on stderr) when it measured nothing."""
    cmd = [*prefix, str(pa), "-m", model, "-u", f"127.0.0.1:{port}", "-i", protocol, "--concurrency-range", str(conc),
           "--measurement-interval", str(interval_ms), "--stability-percentage", "50", "--max-trials", "6",
           "-f", str(out), *extra]
    if protocol == "http":
        cmd += ["--input-tensor-format", fmt, "--output-tensor-format", fmt]
    if token:
        cmd += ["-H", f"{'Authorization' if protocol == 'http' else 'authorization'}:Bearer {token}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        print(f"  perf_analyzer did not finish within {timeout_s:g} s (concurrency {conc})", file=sys.stderr)
        return None
    if p.returncode not in (0, 2) or not out.exists():
        print(f"  perf_analyzer failed (rc {p.returncode}): {(p.stderr or p.stdout)[-300:]}", file=sys.stderr)
        return None
    rows = list(csv.DictReader(out.open()))
    if not rows:
        return None
    r = rows[-1]
    return float(r["Inferences/Second"]), float(r["p50 latency"]) / 1e3, float(r["p99 latency"]) / 1e3


def perf_analyzer() -> Path | None:
    """perf_analyzer from ``scripts/setup-perf.sh`` (installed on first use), or None (said on stderr)."""
    setup = subprocess.run([str(ROOT / "scripts" / "setup-perf.sh")], capture_output=True, text=True, check=False)
    if setup.returncode != 0 or not setup.stdout.strip():
        print(f"perf_analyzer is not available (scripts/setup-perf.sh): {setup.stderr[-500:]}", file=sys.stderr)
        return None
    return ROOT / setup.stdout.strip().splitlines()[-1]


# ----------------------------------------------------------------------------------------- targets
ECHOES = (("echo", None), ("hop-wait", "wait"), ("hop-spin", "spin"))


@dataclass
class Target:
    """One server the bench measures: where it listens and which processes' CPU counts as its own."""

    name: str
    kind: str  # "echo", "hop", "hpcsplit", "base"
    model: str
    ports: dict[str, int]
    token: str | None
    frontend_pid: int  # the echo's process, or hpcsplit's frontend rank
    worker_pids: tuple[int, ...] = ()
    workers: int = 0

    def served(self) -> int:
        """Infers answered so far (the echo's ``/count``, hpcsplit's ``/stats``; batch 1: samples = requests)."""
        if self.kind in ("echo", "hop"):
            url, hdr = f"http://127.0.0.1:{self.ports['http_port']}/count", {}
        else:
            url = f"http://127.0.0.1:{self.ports['http_port']}/v2/models/{self.model}/stats"
            hdr = {"Authorization": f"Bearer {self.token}"}
        with urllib.request.urlopen(urllib.request.Request(url, headers=hdr), timeout=10) as r:
            doc = json.loads(r.read())
        return int(doc["served"] if "served" in doc else doc["model_stats"][0]["inference_count"])


def cpu_seconds(pids: tuple[int, ...] | list[int]) -> float:
    """utime + stime of the processes (every thread) from ``/proc``; a process gone counts 0."""
    return cpu_seconds_of(pids) or 0.0


@dataclass
class Result:
    rate: float
    p50: float
    p99: float
    fe_us: float | None  # the frontend's (the echo's) CPU per request
    w_us: float | None  # the protocol workers' CPU per request, together


def measure(pa: Path, t: Target, proto: str, fmt: str, conc: int, interval_ms: int, out: Path,
            extra: tuple[str, ...], prefix: tuple[str, ...]) -> Result | None:
    """One perf_analyzer level against ``t``, with the server's CPU per request over the whole run."""
    try:
        n0, f0, w0 = t.served(), cpu_seconds([t.frontend_pid]), cpu_seconds(t.worker_pids)
        r = _perf(pa, t.model, t.ports[f"{proto}_port"], proto, fmt, conc, interval_ms, t.token, out, extra,
                  prefix=prefix)
        n = t.served() - n0
        f1, w1 = cpu_seconds([t.frontend_pid]), cpu_seconds(t.worker_pids)
    except (OSError, ValueError, KeyError) as e:
        print(f"  {t.name}: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    if r is None or r[0] <= 0:
        return None
    per = (lambda d: d / n * 1e6) if n > 0 else (lambda d: None)
    return Result(r[0], r[1], r[2], per(f1 - f0), per(w1 - w0) if t.worker_pids else None)


def _median(rs: list[Result | None]) -> Result | None:
    got = [r for r in rs if r is not None]
    if not got:
        return None

    def med(xs: list[float | None]) -> float | None:
        v = [x for x in xs if x is not None]
        return float(np.median(v)) if v else None

    return Result(*(med([getattr(r, k) for r in got]) for k in ("rate", "p50", "p99", "fe_us", "w_us")))  # type: ignore[arg-type]


def _start_echoes(tmp: Path, procs: list[subprocess.Popen[bytes]], prefix: tuple[str, ...]) -> list[Target]:
    """Start the echo server and the two hop servers, each a process of its own (appended to ``procs``,
    which the caller stops whatever happens)."""
    files = {}
    for name, hop in ECHOES:
        files[name] = tmp / f"{name}.json"
        procs.append(subprocess.Popen([*prefix, sys.executable, "-m", "hpcsplit.bench", "server", "--echo-server",
                                       str(files[name]), *(("--hop", hop) if hop else ())], env=_env()))
    out = []
    t_end = time.monotonic() + 60
    for (name, f), proc in zip(files.items(), procs, strict=True):
        while not f.exists():
            if proc.poll() is not None:
                raise SystemExit(f"the {name} server exited (rc {proc.returncode}) before it listened")
            if time.monotonic() > t_end:
                raise SystemExit(f"the {name} server did not start within 60 s")
            time.sleep(0.1)
        # taskset execs the server, so its pid is the server's
        out.append(Target(name, "echo" if name == "echo" else "hop", "echo", json.loads(f.read_text()), None,
                          proc.pid))
    return out


def _hpcsplit_target(name: str, kind: str, info: dict[str, Any], token: str) -> Target:
    return Target(name, kind, info["model"], {"http_port": info["http_port"], "grpc_port": info["grpc_port"]}, token,
                  int(info["pid"]), tuple(info.get("worker_pids") or ()), int(info.get("workers") or 0))


def _workers_arg(text: str) -> list[int | None]:
    out: list[int | None] = []
    for w in text.split(","):
        out.append(None if w.strip() == "auto" else int(w))
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcsplit.bench server", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--protocols", default=",".join(m[0] for m in MODES), help="of " + ",".join(m[0] for m in MODES))
    p.add_argument("--interval-ms", type=int, default=2000, help="perf_analyzer's measurement interval")
    p.add_argument("--rounds", type=int, default=1, help="measure every level this often, the servers in turn; "
                                                         "the tables show the medians")
    p.add_argument("--workers", default="0", help="hpcsplit servers to run, by runtime.server_workers "
                                                  "(0: the protocol on the frontend's thread; auto: null)")
    p.add_argument("--base", type=Path, default=None, help="a checkout of earlier code (git worktree add /tmp/base "
                                                           "45d97c6) to serve beside this one, as 'base'")
    p.add_argument("--server-cpus", default=None, help="taskset -c list for every server (e.g. 0-7)")
    p.add_argument("--client-cpus", default=None, help="taskset -c list for perf_analyzer (e.g. 8-15)")
    p.add_argument("--samples", type=int, default=2000, help="requests of the frontend-ceiling batch run")
    p.add_argument("--out", type=Path, default=Path("outputs/bench-server"), help="where the CSV and PNG go")
    p.add_argument("--echo-server", default=None, help=argparse.SUPPRESS)  # internal: run an echo server
    p.add_argument("--hop", choices=("wait", "spin"), default=None, help=argparse.SUPPRESS)  # internal
    args = p.parse_args(argv)
    if args.echo_server:
        echo_main(args.echo_server, args.hop)
        return 0
    if args.base is not None and not (args.base / "hpcsplit" / "runtime" / "server" / "serve.py").is_file():
        p.error(f"--base {args.base}: no hpcsplit checkout there (make one: git worktree add {args.base} 45d97c6)")
    modes = [m for m in MODES if m[0] in args.protocols.split(",")]
    if not modes:
        p.error(f"--protocols {args.protocols!r}: none of {[m[0] for m in MODES]}")
    pa = perf_analyzer()
    if pa is None:
        return 2
    levels = [int(c) for c in args.concurrency.split(",")]
    srv_pre = ("taskset", "-c", args.server_cpus) if args.server_cpus else ()
    cli_pre = ("taskset", "-c", args.client_cpus) if args.client_cpus else ()
    table: list[tuple[str, int, dict[str, Result | None]]] = []
    with tempfile.TemporaryDirectory(prefix="hpcsplit-bench-server-") as d:
        tmp = Path(d)
        sb, plan, n = _toy(tmp)
        ceiling = _frontend_ceiling(tmp, sb, plan, n, args.samples)
        procs: list[subprocess.Popen[bytes]] = []
        servers: list[subprocess.Popen[bytes]] = []
        try:
            targets = _start_echoes(tmp, procs, srv_pre)
            for w in _workers_arg(args.workers):
                name = "hpcsplit" if w == 0 else f"hpcsplit-w{'auto' if w is None else w}"
                proc, info, token = _start_hpcsplit(tmp, sb, plan, n, {"server_workers": w}, name=name, prefix=srv_pre)
                servers.append(proc)
                targets.append(_hpcsplit_target(name, "hpcsplit", info, token))
            if args.base is not None:
                proc, info, token = _start_hpcsplit(tmp, sb, plan, n, name="base", code=args.base.resolve(),
                                                    prefix=srv_pre)
                servers.append(proc)
                targets.append(_hpcsplit_target("base", "base", info, token))
            steps = len(modes) * len(levels)
            for label, proto, fmt, extra in modes:
                for c in levels:
                    runs: dict[str, list[Result | None]] = {t.name: [] for t in targets}
                    for rnd in range(args.rounds):
                        for t in targets:
                            runs[t.name].append(measure(pa, t, proto, fmt, c, args.interval_ms,
                                                        tmp / f"{t.name}-{label}-{c}-{rnd}.csv", extra, cli_pre))
                    got = {name: _median(rs) for name, rs in runs.items()}
                    table.append((label, c, got))
                    print(f"  [{len(table)}/{steps}] {label} at concurrency {c}: " + ", ".join(
                        f"{name} {r.rate:.0f} req/s" if r else f"{name} n/a" for name, r in got.items()),
                        file=sys.stderr, flush=True)
        finally:
            for s_ in servers:
                s_.send_signal(signal.SIGTERM)
            for e_ in procs:
                e_.terminate()
            for p_, grace in [(s_, 60.0) for s_ in servers] + [(e_, 10.0) for e_ in procs]:
                try:
                    p_.wait(grace)
                except subprocess.TimeoutExpired:
                    p_.kill()
                    p_.wait()
    report(args, table, [t.name for t in targets], levels, ceiling, targets)
    return 0
