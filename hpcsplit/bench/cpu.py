"""CPU benchmark of the serve runtime: frontend ceiling, idle-rank CPU, OMP_WAIT_POLICY PASSIVE vs ACTIVE.

    python -m hpcsplit.bench cpu [--requests 20000] [--idle-s 3] [--omp-requests 400]

1. **Frontend ceiling**: requests/s through a chain of two trivial components (``x + 1`` on a 16-float
   row), all requests available at once, ``max_inflight`` 256; component batch size 1 and 32.
   Target: >= 5,000 requests/s (the runtime is never the bottleneck).
2. **Idle CPU**: % of one core used by a component rank waiting for work for ``--idle-s`` seconds,
   our polling loop (``Backoff``) vs a plain blocking MPICH ``Recv``.  Target: < 2% of a core.
3. **Wake-up**: latency of requests 100 ms apart (every rank asleep when one comes) with the doorbell
   (``runtime.doorbell``, ``[Note: doorbell]``) and with plain sleeps; and, in this process, how much
   slower a few us of per-message Python runs right after a sleep (cold caches and TLBs).
4. **OMP_WAIT_POLICY**: throughput of a 2-component MLP chain whose ranks each use 2 OpenMP threads
   while sharing the cores (oversubscribed), PASSIVE vs ACTIVE.

Each scenario runs as its own ``mpiexec -n 3`` job (OpenMP reads its settings at startup).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

from hpcsplit.core.mpi import MPI, get_comm
from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.launch.local import find_mpiexec
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime.component import serve_component
from hpcsplit.runtime.doorbell import start_doorbell
from hpcsplit.runtime.frontend import Frontend
from hpcsplit.runtime.routing import GraphSpec, build_dataflow
from hpcsplit.runtime.threads import cpu_seconds

_RESULT = "HPCSPLIT_BENCH_RESULT "


def _graph_chain(names: list[str]) -> GraphSpec:
    comps = tuple((n, ("x",), ("x",)) for n in names)
    edges = [("input", "x", names[0], "x")]
    edges += [(a, "x", b, "x") for a, b in itertools.pairwise(names)]
    edges.append((names[-1], "x", "output", "x"))
    return GraphSpec(("x",), ("x",), comps, tuple(edges))


def _plan(names: list[str], batch: int, threads: int) -> Plan:
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    for n in names:
        ranks.append(RankEntry(len(ranks), "component", 0, None, None, threads, n, batch, 0))
    return Plan("bench-cpu", None, "cpu", 1, tuple(ranks), dict.fromkeys(names, 0.0), {})


def _child(args: argparse.Namespace) -> int:
    """One scenario on MPI ranks (rank 0 prints the result line)."""
    comm = get_comm()
    rank = comm.Get_rank()
    names = ["a", "b"]
    if comm.Get_size() != len(names) + 1:
        print(f"cpu bench child needs {len(names) + 1} ranks", file=sys.stderr)
        return 2
    scn = args.child
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    df = build_dataflow(_plan(names, args.batch, threads), _graph_chain(names))
    if scn == "idle_recv":
        if rank == 0:
            time.sleep(args.idle_s)
            for r in (1, 2):
                comm.Send([np.zeros(1), MPI.DOUBLE], dest=r, tag=5)
            got = [comm.recv(source=r, tag=6) for r in (1, 2)]
            print(_RESULT + json.dumps({"idle_cpu_pct": [x["cpu_pct"] for x in got]}), flush=True)
        else:
            c0, t0 = cpu_seconds(), time.perf_counter()
            comm.Recv([np.zeros(1), MPI.DOUBLE], source=0, tag=5)
            comm.send({"cpu_pct": 100 * (cpu_seconds() - c0) / (time.perf_counter() - t0)}, dest=0, tag=6)
        return 0
    # as the runtime does (runtime.doorbell)
    db = start_doorbell(comm) if os.environ.get("HPCSPLIT_DOORBELL", "1") != "0" else None

    def _close() -> None:
        if db is not None:
            db.close()

    if rank != 0:
        if scn == "omp":
            torch.manual_seed(rank)
            mlp = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(6)]).eval()

            def fn(x: torch.Tensor) -> torch.Tensor:
                return mlp(x)
        else:
            def fn(x: torch.Tensor) -> torch.Tensor:
                return x + 1

        counters = serve_component(comm, df, df.rank_component[rank], fn, args.batch, 0.0)
        req = comm.isend(counters, dest=0, tag=9)
        tp.wait_polling(req.Test)
        _close()
        return 0
    fe = Frontend(comm, df)
    width = 512 if scn == "omp" else 16
    x = torch.randn(64, width)

    def get(idx: np.ndarray) -> list[torch.Tensor]:
        return [x.index_select(0, torch.as_tensor(idx % 64))]

    out: dict[str, Any] = {"scenario": scn, "batch": args.batch, "threads": threads,
                           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    if scn == "idle":
        time.sleep(args.idle_s)  # components wait in their loops
    elif scn == "wake":  # one request every 100 ms: each finds the ranks asleep (deep sleep after 50 ms)
        res = fe.run(np.arange(args.requests) * 0.1, get, None, 60.0, args.inflight)
        lat = res.latency_ms[res.ok]
        out.update(requests=args.requests, ok=int(res.ok.sum()), p50_ms=float(np.percentile(lat, 50)),
                   p90_ms=float(np.percentile(lat, 90)))
    else:
        n = args.requests
        fe.run(np.zeros(min(200, n)), get, None, 60.0, args.inflight)  # warm up
        c0 = cpu_seconds()
        res = fe.run(np.zeros(n), get, None, 120.0, args.inflight)
        out.update(requests=n, ok=int(res.ok.sum()), wall_s=res.wall_s, rps=float(res.ok.sum() / res.wall_s),
                   p50_ms=float(np.percentile(res.latency_ms[res.ok], 50)),
                   frontend_cpu_pct=100 * (cpu_seconds() - c0) / res.wall_s)
    fe.stop_all()
    stats = []
    for _ in (1, 2):
        st = MPI.Status()
        tp.wait_polling(lambda st=st: comm.Iprobe(source=MPI.ANY_SOURCE, tag=9, status=st))
        stats.append(comm.recv(source=st.Get_source(), tag=9))
    out["component_cpu_pct"] = [100 * s["cpu_s"] / s["wall_s"] for s in stats]
    out["component_batches"] = [s["batches"] for s in stats]
    out["doorbell_wakeups"] = sum(s.get("doorbell_wakeups", 0) for s in stats)
    print(_RESULT + json.dumps(out), flush=True)
    _close()
    return 0


def _launch(args: argparse.Namespace, scn: str, env_extra: dict[str, str], batch: int = 1,
            requests: int | None = None) -> dict[str, Any]:
    env = dict(os.environ, **env_extra)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [args.mpiexec, "-n", "3", sys.executable, "-m", "mpi4py", "-m", "hpcsplit.bench", "cpu",
           "--child", scn, "--batch", str(batch), "--requests", str(requests or args.requests),
           "--idle-s", str(args.idle_s), "--inflight", str(args.inflight)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s,
                       check=False)
    for line in p.stdout.splitlines():
        if line.startswith(_RESULT):
            return json.loads(line[len(_RESULT):])
    raise RuntimeError(f"scenario {scn} failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")


def _cold_after_sleep(sleeps_s: tuple[float, ...] = (0.0, 1e-3, 1e-2, 5e-2), n: int = 30) -> dict[float, float]:
    """Median us of a rank's per-message Python (encode and decode a header, make a tensor) after sleeping.

    Sleeping ranks wake with cold caches and TLBs (on a VM the host runs others on the core meanwhile),
    so every hop to a sleeping rank pays this on top of the wake-up itself; a spinning rank would not.
    """
    meta = (tp.TensorMeta(0, torch.float32, (1, 16)),)
    out = {}
    for s in sleeps_s:
        ts = []
        for i in range(n + 3):
            if s:
                time.sleep(s)
            t0 = time.perf_counter()
            h = tp.decode_header(tp.encode_header(tp.Header(tp.KIND_DATA, (i,), ((1, 2),), meta)))
            torch.from_numpy(np.empty(h.tensors[0].shape, dtype=np.float32)).add_(1.0)
            ts.append(time.perf_counter() - t0)
        ts = sorted(ts[3:])
        out[s] = ts[len(ts) // 2] * 1e6
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcsplit.bench cpu", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--omp-requests", type=int, default=400)
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--inflight", type=int, default=256)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--mpiexec", default=None, help="default: the one beside this Python, else PATH")
    p.add_argument("--only", default="ceiling,idle,wake,omp", help="comma list of: ceiling, idle, wake, omp")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mpiexec = find_mpiexec(args.mpiexec)
    if args.child:
        return _child(args)
    only = set(args.only.split(","))
    print(f"# serve runtime CPU benchmark: 3 MPI ranks (frontend + 2 components) on {os.cpu_count()} cores "
          "(shared machine: figures are indicative)")
    if "ceiling" in only:
        print("\n## frontend ceiling: requests/s through 2 trivial components (target >= 5000/s)")
        print(f"{'component batch':>15} {'requests':>9} {'req/s':>10} {'p50 ms':>8} {'target':>8} "
              f"{'frontend CPU':>12}  component CPU  batches a/b")
        for b in (1, 32):
            r = _launch(args, "ceiling", {"OMP_NUM_THREADS": "1"}, batch=b)
            ok = "met" if r["rps"] >= 5000 else "MISSED"
            print(f"{b:>15} {r['requests']:>9} {r['rps']:>10.0f} {r['p50_ms']:>8.2f} {ok:>8} "
                  f"{r['frontend_cpu_pct']:>11.0f}%  "
                  + "/".join(f"{x:.0f}%" for x in r["component_cpu_pct"]) + f"  {r['component_batches']}")
    if "idle" in only:
        print(f"\n## idle component rank CPU, % of one core over {args.idle_s:g} s (target < 2%)")
        ours = _launch(args, "idle", {"OMP_NUM_THREADS": "1"})
        udp = _launch(args, "idle", {"OMP_NUM_THREADS": "1", "HPCSPLIT_DOORBELL_ALL_REMOTE": "1"})
        mpich = _launch(args, "idle_recv", {"OMP_NUM_THREADS": "1"})
        worst = max(ours["component_cpu_pct"])
        print(f"{'hpcsplit loop, one node (100 ms quiet sleeps)':<48} "
              + "  ".join(f"{x:6.2f}%" for x in ours["component_cpu_pct"])
              + f"   target: {'met' if worst < 2 else 'MISSED'}")
        print(f"{'hpcsplit loop, UDP doorbell (20 ms quiet sleeps)':<48} "
              + "  ".join(f"{x:6.2f}%" for x in udp["component_cpu_pct"])
              + f"   target: {'met' if max(udp['component_cpu_pct']) < 2 else 'MISSED'}")
        print(f"{'blocking MPI Recv (MPICH busy-polls)':<48} "
              + "  ".join(f"{x:6.2f}%" for x in mpich["idle_cpu_pct"]))
    if "wake" in only:
        print("\n## wake-up: one request every 100 ms through 2 trivial components (3 hops to ranks asleep), "
              "latency with the doorbell (runtime.doorbell=true) and without")
        res = {}
        for name, val, remote in (("doorbell", "1", "0"), ("UDP doorbell", "1", "1"), ("sleep only", "0", "0")):
            env = {"OMP_NUM_THREADS": "1", "HPCSPLIT_DOORBELL": val, "HPCSPLIT_DOORBELL_ALL_REMOTE": remote}
            res[name] = r = _launch(args, "wake", env, requests=30)
            print(f"{name:<12} p50 {r['p50_ms']:7.3f} ms  p90 {r['p90_ms']:7.3f} ms  ({r['ok']} requests)"
                  + (f"  components woken by a ring {r['doorbell_wakeups']}x" if val == "1" else "")
                  + ("  [every rank rung over UDP, as if on its own node]" if remote == "1" else ""))
        print(f"sleep only / doorbell p50: {res['sleep only']['p50_ms'] / res['doorbell']['p50_ms']:.1f}x, "
              f"sleep only / UDP doorbell p50: {res['sleep only']['p50_ms'] / res['UDP doorbell']['p50_ms']:.1f}x")
        cold = _cold_after_sleep()
        print("cold wake on this machine (no MPI): a rank's few us of Python/torch per message take "
              + ", ".join(f"{us:.0f} us" + (f" after {s * 1e3:g} ms asleep" if s else " back to back")
                          for s, us in cold.items())
              + " (paid per hop to a sleeping rank, on top of the wake-up)")
    if "omp" in only:
        print(f"\n## OMP_WAIT_POLICY with ranks sharing cores: 2 MLP components x 2 threads on {os.cpu_count()} "
              f"cores, {args.omp_requests} requests, batch 8")
        res = {}
        for pol in ("PASSIVE", "ACTIVE"):
            res[pol] = _launch(args, "omp", {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": pol}, batch=8,
                               requests=args.omp_requests)
            r = res[pol]
            print(f"{pol:<8} {r['rps']:>9.1f} req/s  p50 {r['p50_ms']:8.1f} ms  component CPU "
                  + "/".join(f"{x:.0f}%" for x in r["component_cpu_pct"]))
        print(f"PASSIVE / ACTIVE throughput: {res['PASSIVE']['rps'] / res['ACTIVE']['rps']:.2f}x")
    return 0
