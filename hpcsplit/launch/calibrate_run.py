"""The calibration job's measurements (``stage=calibrate``; imported by :mod:`hpcsplit.launch.calibrate` once the
rank's threads are set).

[Note: calibration measurements]
Every rank takes part in one fixed sequence of steps (the same on every rank, so the job cannot deadlock); in
each chain the components run the runtime's own loop (``serve_component``) on ``x + 1``:

1. **ping-pong** with a replica on rank 0's node, and with one on another node when the job has one: rank 0
   sends each request once the replica has been idle a gap (``gaps_ms``; back to back at each of
   ``sizes_bytes`` first) and waits for the answer as the runtime's loops wait; the replica's program stamps the
   time it ran into its answer, so on one node the hop to a rank idle that long (its backoff, doorbell, wake-up
   and cold caches) is measured one way; across nodes the round trip;
2. **chains through the runtime's frontend**, ``one`` (frontend -> a -> frontend) and ``two`` (-> a -> b ->),
   with requests ``chain_gaps_ms`` apart: the frontend's admission lag after a sleep (admit - arrival), and
   pipeline times the simulator is checked against;
3. **saturation**: ``saturation_requests`` all at once through ``one`` with the component at batch 1, then
   at batch 32: the frontend's and the component's CPU seconds per request and per message; then ``turns``:
   :data:`TURN_REQUESTS` through ``one`` with one in flight (each working pass of the frontend admits one request
   or takes one answer). In all three the frontend counts its loop's working passes and their thread CPU, from
   which the fit takes its CPU per request, per message and per pass (the saturation runs spread a pass over
   many requests, the ``turns`` run has one a pass);
4. **compute**: a fixed matmul set on rank 0 at each thread count (GFLOP/s), then on ``k`` ranks of rank 0's
   node at once for one second each (``corun_slowdown``); a small program (Linear 64 -> 256, ReLU, batch 1)
   back to back and after each idle gap (``compute_cold``);
5. **programs** (``calibrate.programs`` and a switchboard in the run folder or ``switchboard=PATH``): each
   component and the whole model at batch 1, back to back and after ``program_gaps_ms`` idle;
6. **wake-up placement** (``[Note: stacked wake-ups]``): rank 0 rings a peer asleep on its doorbell and keeps its
   core; on which core the peer woke;
7. **shared core** (``[Note: evicted caches]``): rank 0 and the first other rank of its node pinned to one core;
   a rank's turn (take a message, a program, send its outputs; no program: the frontend's turn) straight after
   the other rank's turn there, against the same turn warm; and an idle rank's wake-up that finds nothing, in
   CPU time, after a sleep the other rank's turn ran in, against the same wake-up warm.

After an idle gap (4 and 5) a program's inputs are received first, through the runtime's receive code, and only the
program is timed (``[Note: cold extra after a receive]``).

Ranks not in a step wait at a non-spinning barrier.  Rank 0 turns the raw figures into a
:class:`~hpcsplit.core.calibration.Calibration` (:func:`hpcsplit.launch.calibrate_fit.fit`) and writes it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import json
import math
import os
import socket
import time
from typing import Any

import numpy as np
import torch

from hpcsplit.core.calibration import load_calibration
from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.device import time_latency_ms
from hpcsplit.core.mpi import MPI
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.errors import CalibrationError
from hpcsplit.launch.calibrate import CalibrateSettings
from hpcsplit.launch.calibrate_fit import fit
from hpcsplit.runtime import transport as tp
from hpcsplit.runtime.component import serve_component
from hpcsplit.runtime.context import barrier, say
from hpcsplit.runtime.doorbell import start_doorbell
from hpcsplit.runtime.frontend import Frontend
from hpcsplit.runtime.mailbox import Backoff, Inbox, Outbox, spin_after_work_s
from hpcsplit.runtime.routing import Dataflow, GraphSpec, build_dataflow
from hpcsplit.runtime.settings import RuntimeSettings
from hpcsplit.runtime.threads import cpu_seconds
from hpcsplit.switchboard.reader import Switchboard

__all__ = ["calibrate", "chain_dataflow", "settle_requests"]

WAIT_SLEEP_S = 0.02  # ranks outside a step poll their barrier at most 50 times a second
MATMUL_SIZES = (256, 512, 1024)
CORUN_S = 1.0
SMALL_RUNS = 50
TURN_REQUESTS = 300  # the frontend's turns one request at a time (``turns``)
SETTLE_MAX = 100  # requests at most that settle a gap before its samples (``calibrate.settle_s``)

# [Note: settled gaps]
# How long a sleeping rank takes to wake depends on how long its core slept before, not only on this gap.  On the
# 2-core development VM (a KVM guest whose idle cores halt at once; the host polls a halted core for a while, and
# adapts how long from its recent halts), 100 ping-pongs at a 1 ms gap took 77-109 us one way for the first 16, then
# 190-372 us (with a few near 100); at 2 ms 200-230 us from the start.  With 20 samples straight after the shorter
# gaps the calibration measured the first regime (0.08 ms at 1 ms, 0.10-0.12 at 2 ms), while a bench serving at that
# pace for seconds runs in the second (hops of 0.18-0.29 ms to ranks idle 1-2.5 ms, in a traced toy split at 256
# req/s).  So each gap first runs ``calibrate.settle_s`` worth of requests at that gap (1 to SETTLE_MAX) that are not
# counted, in the ping-pong and in the frontend chains.


def settle_requests(settle_s: float, gap_ms: float) -> int:
    """Requests ``gap_ms`` apart that run before that gap's samples and are not counted: ``settle_s`` worth, 1 to
    :data:`SETTLE_MAX` (``[Note: settled gaps]``).

    Examples
    --------
    >>> [settle_requests(1.0, g) for g in (0.05, 2, 30, 300, 1000)], settle_requests(0.0, 2)
    ([100, 100, 34, 4, 1], 1)
    """
    return max(1, min(SETTLE_MAX, math.ceil(settle_s * 1e3 / gap_ms)))


def chain_dataflow(ranks: list[int], batch: int) -> Dataflow:
    """The dataflow frontend -> ranks[0] -> ranks[1] -> ... -> frontend of ``x + 1`` components.

    Built for a contiguous plan (ranks 1..k) and renumbered, so any ranks of the job can serve it.
    """
    names = [f"c{i}" for i in range(len(ranks))]
    edges = [("input", "x", names[0], "x")]
    edges += [(a, "x", b, "x") for a, b in itertools.pairwise(names)]
    edges.append((names[-1], "x", "output", "x"))
    graph = GraphSpec(("x",), ("x",), tuple((n, ("x",), ("x",)) for n in names), tuple(edges))
    entries = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    entries += [RankEntry(i + 1, "component", 0, None, None, 1, n, batch, 0) for i, n in enumerate(names)]
    plan = Plan("calibrate", None, "cpu", 1, tuple(entries), dict.fromkeys(names, 0.0), {})
    df = build_dataflow(plan, graph)
    real = {i + 1: r for i, r in enumerate(ranks)}
    comps = tuple(dataclasses.replace(c, replicas=tuple(real[r] for r in c.replicas)) for c in df.components)
    return dataclasses.replace(df, components=comps, world_size=max(ranks) + 1,
                               rank_component={real[r]: n for r, n in df.rank_component.items()})


class _Job:
    """One rank's view of the calibration job (see ``[Note: calibration measurements]``)."""

    def __init__(self, comm: Any, s: CalibrateSettings, rt: RuntimeSettings) -> None:
        self.comm, self.s, self.rt = comm, s, rt
        self.rank = comm.Get_rank()
        self.wait("start")  # every rank there (or named) before a blocking collective, which would wait for ever
        self.hosts = [str(h) for h in comm.allgather(socket.gethostname())]
        self.same = [r for r in range(1, len(self.hosts)) if self.hosts[r] == self.hosts[0]]
        self.cross = [r for r in range(len(self.hosts)) if self.hosts[r] != self.hosts[0]]
        self.raw: dict[str, Any] = {"hosts": self.hosts, "chains": {}, "saturation": {}}
        self.spin_s = spin_after_work_s(rt.spin_us, "bench", len(self.same) + 1)

    def wait(self, what: str) -> None:
        barrier(self.comm, None, WAIT_SLEEP_S, self.rt.load_timeout_s, f"calibration: {what}")

    # ------------------------------------------------------------------ chains
    def chain(self, name: str, ranks: list[int], batch: int, drive: Any, fn: Any = None) -> None:
        """Serve ``ranks`` as a chain of components (``x + 1``, or ``fn``) while rank 0 runs ``drive(df)``, then STOP."""
        df = chain_dataflow(ranks, batch)
        self.wait(f"{name}: start")
        if self.rank in ranks:
            st = serve_component(self.comm, df, df.rank_component[self.rank], fn or (lambda x: x + 1), batch, 0.0,
                                 self.rt.request_timeout_s, idle_sleep_s=self.rt.idle_sleep_ms / 1e3,
                                 spin_s=self.spin_s)
            self.raw["chains"].setdefault(name, {})["component"] = {k: st[k] for k in ("batches", "requests", "cpu_s")}
        elif self.rank == 0:
            self.raw["chains"].setdefault(name, {}).update(drive(df))
        self.wait(f"{name}: stop")

    def frontend_sessions(self, sessions: list[tuple[str, Any]]) -> Any:
        """A chain driver: the runtime's own frontend runs ``sessions`` (label, (kind, arguments))."""
        def drive(df: Dataflow) -> dict[str, Any]:
            fe = Frontend(self.comm, df, None, self.rt.idle_sleep_ms / 1e3, self.spin_s)
            x = torch.zeros(4, 16)
            fe.run(np.zeros(5), lambda idx: [x.index_select(0, torch.as_tensor(idx % 4))], None,
                   self.rt.request_timeout_s, 1)  # first messages of a chain (connections, caches) are not timed
            out = {}
            for label, spec in sessions:
                out[label] = r = self.session(fe, spec)
                if label == "turns":
                    say(0, f"calibration: frontend {label}: {r['requests']} requests one at a time, {r['turns']} "
                           f"working passes of {r['turn_cpu_s'] / max(1, r['turns']) * 1e6:.1f} us CPU each")
                    continue
                say(0, f"calibration: frontend {label}: pipeline p50 {np.median(r['pipe_ms']):.3f} ms, admission lag "
                       f"p50 {np.median(r['lag_ms']):.3f} ms ({len(r['pipe_ms'])} requests)")
            fe.stop_all(self.rt.wait_bound_s)  # every request finished (a timeout raises): nothing left to drop
            return out
        return drive

    def pingpong(self, sizes: tuple[int, ...], gaps_ms: tuple[float, ...], same_clock: bool) -> Any:
        """A chain driver: rank 0 sends each request once the replica has been idle the gap and waits for the
        answer as the runtime's loops wait (its backoff and doorbell).  The replica's program writes the time it
        runs into its answer (:func:`_stamped`): on one node (one clock) that less the send time is the one-way
        hop to a rank idle that long; across nodes only the round trip is used (``[Note: calibration fit]``)."""
        def drive(df: Dataflow) -> dict[str, Any]:
            comm, dest = self.comm, df.components[0].replicas[0]
            inbox, outbox = Inbox(comm), Outbox()
            backoff = Backoff(spin_s=self.spin_s, deep_sleep_s=self.rt.idle_sleep_ms / 1e3)
            ids = iter(range(1 << 40))
            out: dict[str, Any] = {}
            last = [time.perf_counter()]

            def one(x: torch.Tensor, gap_s: float) -> tuple[float, float, float, float]:
                due = last[0] + gap_s
                while (now := time.perf_counter()) < due:  # as the frontend waits for an arrival
                    backoff.idle(now, due, False, quiet=True)
                backoff.reset()
                t0 = time.perf_counter()
                outbox.add(tp.isend_message(comm, dest, tp.KIND_DATA, [next(ids)], [(dest,)], [(0, x)]), dest)
                deadline = t0 + self.rt.request_timeout_s
                while not (got := inbox.poll()):
                    now = time.perf_counter()
                    if now > deadline:
                        raise CalibrationError(f"calibration: rank {dest} did not answer within "
                                               f"{self.rt.request_timeout_s:g} s (runtime.request_timeout_s)")
                    outbox.reap()
                    backoff.idle(now, deadline, bool(inbox.pending) or outbox.in_flight(now),
                                 quiet=not inbox.pending and not outbox.pending)
                backoff.reset()
                last[0] = time.perf_counter()
                ans = got[0][0].tensors[0]
                ran = float(ans[0, 0])
                cpu = float(ans[0, 1]) * 1e3 if ans.shape[1] > 1 else float("nan")
                return ((last[0] - t0) * 1e3, (ran - t0) * 1e3 if same_clock else float("nan"),
                        (t0 - due + gap_s) * 1e3, cpu)

            for b in sizes:
                x = torch.zeros(1, max(1, b // 8), dtype=torch.float64)
                for _ in range(5):
                    one(x, 0.0)
                got = [one(x, 0.0) for _ in range(self.s.samples)]
                out[f"stream {b}"] = {"bytes": b, "rtt_ms": [g[0] for g in got], "one_way_ms": [g[1] for g in got],
                                      "cpu_ms": [g[3] for g in got]}
            x = torch.zeros(1, 16, dtype=torch.float64)
            for g in gaps_ms:
                for _ in range(settle_requests(self.s.settle_s, g)):  # [Note: settled gaps]
                    one(x, g / 1e3)
                got = [one(x, g / 1e3) for _ in range(self._runs(g, self.s.samples))]
                out[f"gap {g:g}"] = {"gap_ms": g, "rtt_ms": [p[0] for p in got], "one_way_ms": [p[1] for p in got],
                                     "idle_ms": [p[2] for p in got], "cpu_ms": [p[3] for p in got]}
                say(0, f"calibration: ping-pong to rank {dest} idle {g:g} ms: round trip p50 "
                       f"{np.median(out[f'gap {g:g}']['rtt_ms']):.3f} ms, one way p50 "
                       f"{np.median(out[f'gap {g:g}']['one_way_ms']):.3f} ms")
            outbox.add(tp.isend_message(comm, dest, tp.KIND_STOP), dest)
            outbox.drain(timeout_s=self.rt.wait_bound_s)
            return out
        return drive

    def session(self, fe: Frontend, spec: tuple[str, Any]) -> dict[str, Any]:
        kind, arg = spec
        x = torch.zeros(4, 16)

        def get(idx: np.ndarray) -> list[torch.Tensor]:
            return [x.index_select(0, torch.as_tensor(idx % 4))]

        timeout = self.rt.request_timeout_s
        if kind == "gap":
            skip = max(2, settle_requests(self.s.settle_s, arg["gap_ms"]))  # [Note: settled gaps]
            res = fe.run(np.arange(arg["n"] + skip) * arg["gap_ms"] / 1e3, get, None, timeout, self.rt.max_inflight)
        else:  # saturation (everything at once) and turns (one in flight: a working pass admits one or takes one)
            window = 256 if kind == "saturation" else 1
            if kind == "saturation":
                fe.run(np.zeros(min(200, arg["n"])), get, None, timeout, 256)
            c0 = cpu_seconds()
            fe.count_turns, fe.turns, fe.turn_cpu_s = True, 0, 0.0  # the working passes and their thread CPU
            try:
                res = fe.run(np.zeros(arg["n"]), get, None, timeout, window)
            finally:
                fe.count_turns = False
            if not res.ok.all():
                raise CalibrationError(f"calibration: {int((~res.ok).sum())} of {len(res.ok)} requests of a {kind} "
                                       "session timed out; the machine is too loaded to calibrate (or a rank is stuck)")
            return {"requests": int(res.ok.sum()), "wall_s": res.wall_s, "frontend_cpu_s": cpu_seconds() - c0,
                    "turns": fe.turns, "turn_cpu_s": fe.turn_cpu_s,
                    "pipe_ms": [float(np.median((res.done_s - res.admit_s)[res.ok]) * 1e3)], "lag_ms": [0.0]}
        if not res.ok.all():
            raise CalibrationError(f"calibration: {int((~res.ok).sum())} of {len(res.ok)} requests of a {kind} session "
                                   "timed out; the machine is too loaded to calibrate (or a rank is stuck)")
        return {"pipe_ms": ((res.done_s - res.admit_s)[skip:] * 1e3).tolist(),
                "lag_ms": ((res.admit_s - res.arrival_s)[skip:] * 1e3).tolist(), **arg}

    def gap_sessions(self, gaps: tuple[float, ...]) -> list[tuple[str, Any]]:
        s = self.s
        return [(f"gap {g:g}", ("gap", {"gap_ms": g, "n": max(3, min(s.samples, int(s.max_gap_time_s * 1e3 / g)))}))
                for g in gaps]

    # ------------------------------------------------------------------ compute
    def matmul_rate(self, threads: int, seconds: float | None = None) -> float:
        """GFLOP/s of the matmul set at ``threads`` (for ``seconds`` of repeats when given)."""
        torch.set_num_threads(threads)
        mats = [(torch.randn(n, n), torch.randn(n, n)) for n in MATMUL_SIZES]
        with torch.inference_mode():
            for a, b in mats:
                a @ b
            flops, t0, reps = 0.0, time.perf_counter(), 0
            while True:
                for a, b in mats:
                    a @ b
                    flops += 2.0 * a.shape[0] ** 3
                reps += 1
                el = time.perf_counter() - t0
                if (seconds is None and reps >= 3) or (seconds is not None and el >= seconds):
                    break
        torch.set_num_threads(1)
        return flops / el / 1e9

    def small_cold(self) -> dict[str, Any]:
        lin = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU()).eval()
        x = torch.randn(1, 64)
        with torch.inference_mode():
            b2b = time_latency_ms(lin, (x,), warmup=2, iters=SMALL_RUNS)  # the profile's timer
            after = {str(g): _times(lin, (x,), self._runs(g, self.s.samples), g / 1e3) for g in self.s.gaps_ms}
        return {"b2b_ms": b2b, **_pairs(after)}

    def _runs(self, gap_ms: float, want: int) -> int:
        return max(3, min(want, int(self.s.max_gap_time_s * 1e3 / gap_ms)))

    def work(self, paths: RunPaths) -> tuple[str | None, list[tuple[str, Any, tuple[torch.Tensor, ...]]]]:
        """(the switchboard's sha256, [(name, program, batch-1 inputs)] of each component and the whole model); (None,
        []) without ``calibrate.programs`` or a switchboard."""
        if not self.s.programs or not (paths.switchboard / "layout.json").is_file():
            return None, []
        sb = Switchboard.load(paths.switchboard)
        acts = sb.component_example_inputs(1)
        return sb.sha256, [(name, sb.load_whole() if name == "whole" else sb.load_component(name),
                            tuple(sb.example_inputs(1)) if name == "whole" else tuple(acts[name]))
                           for name in (*sb.order, "whole")]

    def programs(self, sha: str | None, work: list[tuple[str, Any, tuple[torch.Tensor, ...]]]) -> dict[str, Any] | None:
        if sha is None:
            return None
        progs: dict[str, Any] = {}
        with torch.inference_mode():
            for name, fn, args in work:
                b2b = time_latency_ms(fn, args, warmup=2, iters=self.s.program_runs + 2)  # as the profile times it
                after = {str(g): _times(fn, args, self.s.program_runs, g / 1e3) for g in self.s.program_gaps_ms}
                progs[name] = {"b2b_ms": b2b, **_pairs(after)}
                say(0, f"calibration: program {name!r}: batch 1 back to back p50 {np.median(b2b):.3f} ms, after "
                       + ", ".join(f"{g} ms idle {np.median(c):.3f} ({np.median(np.subtract(c, w)):+.3f} over the "
                                   "warm run after it)" for g, (c, w) in after.items()))
        return {"switchboard_sha256": sha, "programs": progs}


WAKE: Any = object()  # the shared-core step's work item for an idle rank's wake-up (no program, no message)
SHORT_RUNS = 100  # pairs of the turn with no program and of the wake-up (calibrate.program_runs, if more)
WAKE_COLD_SLEEP_S = 3e-3  # a wake-up's sleep (both): the peer's turn runs in the cold one (its own wait for the
# request may be in a 1 ms sleep), with 1.5 times the program's last turn on it
WAKE_MARGIN_S = 1e-3  # the peer sleeps rank 0's two sleeps and this after its turn
WAKE_BUDGET_S = 10.0  # no more wake-up pairs begun after this (once calibrate.program_runs are in)
# the shared-core step's set-up (the core, rank 0 -> its peer; whether it could pin, back) and the peer's answers
# to the wake-up item (a tag of their own: the doorbell's probe of TAG_HEADER must not see them)
SHARED_CORE_TAG = 7401


def _take_one(inbox: Inbox) -> Any:
    """The one message this rank sent itself (``_times``, ``_SharedCore``), within 30 s."""
    deadline = time.perf_counter() + 30.0
    got = inbox.poll()
    while not got:
        if time.perf_counter() > deadline:
            raise CalibrationError("calibration: a message this rank sent itself did not arrive in 30 s")
        got = inbox.poll()
    if len(got) != 1:
        raise CalibrationError(f"calibration: {len(got)} messages where this rank sent itself one")
    return got[0][0]


def _recv_setup(comm: Any, source: int, what: str, timeout_s: float = 300.0) -> Any:
    """The shared-core step's message from ``source`` (its set-up, a wake-up item's answer), waited for without
    spinning (a blocking receive spins in MPICH, on the core the other rank is moving to), within ``timeout_s``."""
    deadline = time.perf_counter() + timeout_s
    while True:
        m = comm.improbe(source=source, tag=SHARED_CORE_TAG)
        if m is not None:
            return m.recv()
        if time.perf_counter() > deadline:
            raise CalibrationError(f"calibration: rank {source} did not send {what} within {timeout_s:g} s; is it "
                                   "stopped or dead?")
        time.sleep(1e-3)


# [Note: stacked wake-ups]
# Where does a rank woken by a ring run?  On the 2-vCPU development VM (a KVM guest) on the core of the rank that rang
# it, 95-100 % of the time -- though the other core was idle -- either preempting the ringer (3-11 us after the ring,
# two bare processes) or waiting until the ringer gives the core up (this step: 39 of the 39 rings that woke it, of
# 40, woken 322 us after the ring, the ringer's 0.3 ms of work done).  An idle vCPU is halted, and most likely reads
# as preempted to the guest's scheduler, whose search for an idle core then passes it over.  A split's chain then runs
# on one core while the other idles, until the load fills both: bound to cores
# (``launcher.mpiexec_args=[-bind-to,core]``), the toy's split answered 6-15 % sooner (docs/simulate.md, stop 48). So
# the calibration measures it, and the simulator places wake-ups by it (``[Note: wake-up placement]`` in
# ``core/simulator.py``): rank 0 tells a peer on its node to sleep on its doorbell, rings it after a message, and
# keeps its core a while (as a rank with more to send); the peer answers on which core it woke (``sched_getcpu``).
# The file keeps the share of rings that woke the peer on rank 0's core (``wake_on_ringer_core``); on a bare node it
# should be near 0.
PLACEMENT_RINGS = 40  # rings of the wake-up placement step
PLACEMENT_SLEEP_S = 3e-3  # rank 0 waits this long after telling the peer to sleep (it is asleep by then)
PLACEMENT_WORK_S = 300e-6  # ... and keeps its core this long after the ring, as a rank with more to send


def _cpu_reader() -> Any:
    """``sched_getcpu`` (the core this thread runs on), or None where the C library has none."""
    try:
        fn = ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError, TypeError):
        return None
    fn.restype = ctypes.c_int
    return fn


def placement_ringer(comm: Any, peer: int, db: Any, cpu: Any) -> dict[str, list[Any]]:
    """Rank 0's side of the wake-up placement step (``[Note: stacked wake-ups]``): per ring that woke the peer from
    its sleep, whether it ran on this rank's core (which this rank kept throughout), and how long after the send (us)."""
    same: list[bool] = []
    woke_us: list[float] = []
    for i in range(PLACEMENT_RINGS):
        comm.send(i, dest=peer, tag=SHARED_CORE_TAG)  # sleep on your doorbell
        time.sleep(PLACEMENT_SLEEP_S)
        t_arm = time.perf_counter() + 0.1
        while not db.armed(peer) and time.perf_counter() < t_arm:  # (asleep by now, unless its machine is slow)
            time.sleep(1e-4)
        core = cpu()
        t0 = time.perf_counter()
        h = tp.isend_message(comm, peer, tp.KIND_DATA, (i,))
        rang = db.ring(peer)
        while time.perf_counter() - t0 < PLACEMENT_WORK_S:  # this rank still has work: it keeps its core
            pass
        kept = cpu() == core
        if not tp.wait_polling(h.test, 30.0):
            raise CalibrationError(f"calibration: rank {peer} did not take a message of the placement step in 30 s")
        t_woke, peer_core, by_ring = _recv_setup(comm, peer, "its wake-up (the placement step)", 300.0)
        if rang and by_ring and kept and peer_core >= 0 and core >= 0:
            same.append(bool(peer_core == core))
            woke_us.append((t_woke - t0) * 1e6)
    comm.send(None, dest=peer, tag=SHARED_CORE_TAG)
    return {"same_core": same, "woke_us": woke_us}


def placement_sleeper(comm: Any, db: Any, cpu: Any) -> None:
    """The peer's side: told to, it sleeps on its doorbell (at most 1 s a time, 300 s in all) until rank 0's message
    comes, and answers when it woke, on which core, and whether a ring woke it (not its own probe)."""
    while (i := _recv_setup(comm, 0, "a ring of the placement step", 300.0)) is not None:
        deadline = time.perf_counter() + 300.0
        rings = db.wakeups
        while not db.sleep(1.0, db.probe_header):
            if time.perf_counter() > deadline:
                raise CalibrationError("calibration: rank 0's ring of the placement step did not come within 300 s")
        t, core, by_ring = time.perf_counter(), cpu(), db.wakeups > rings
        m = tp.recv_message(comm, source=0, timeout_s=300.0)
        if m.header.kind != tp.KIND_DATA or m.header.request_ids != (i,):
            raise CalibrationError(f"calibration: the placement step's message {i} from rank 0 was {m.header}")
        comm.send((t, core, by_ring), dest=0, tag=SHARED_CORE_TAG)


def _outputs(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]


class _SharedCore:
    """The shared-core step (``[Note: evicted caches]``): rank 0 and a peer on its node pinned to one core.

    [Note: evicted caches]
    On a node with more ranks than cores, the ranks take turns on each core, and each one's turn (its Python,
    torch and MPI work on its own data) pushes the others' out of the core's caches.  A rank's next turn then
    runs cold, whatever its idle gap: in a traced bench of the toy at 2,048 req/s on the 2-core development VM
    (seven ranks), the programs' spans took 91-142 us of CPU against 13-56 us back to back, and each send 37-56
    us against about 20.  So the calibration measures it where it happens: rank 0 and a peer of its node are
    pinned to one core (``os.sched_setaffinity``), and for each program (and for a turn with none, the
    frontend's) rank 0 times a rank's turn (take a message, the program on its tensors, send the outputs; to
    itself, on a communicator of its own) straight after the peer's turn on that core (it takes a message, runs
    the same program on its own inputs, answers with a small message and sleeps through rank 0's two turns),
    then the same turn again at once (warm).  ``os.sched_setaffinity`` pins the calling thread, the one that runs
    the turns (torch's other threads, if any, stay where they were).  The fit takes the median of the pairs'
    differences (``[Note: cold extra in pairs]``); the simulator charges it to a rank's batch when another rank
    of its crowded node has worked since (``[Note: run queues]`` in :mod:`hpcsplit.core.simulator`).  A first version evicted the caches
    by writing twice the L2 in this process; that took the toy's turns 170-420 us, about twice what the bench
    showed: another rank shares this rank's code (the same libraries' pages), and only its data pushes ours out.

    An idle rank pays it too: its backoff wakes it some six times in the first 1.3 ms after its work (20 us
    doubling, ``mailbox.Backoff``), and on a crowded node other ranks ran on its core between two wake-ups.  So
    the step also times a wake-up that finds nothing (a backoff's sleep, on the doorbell where there is one, and a
    poll), cold (the peer's turn, with each program in turn, ran while this rank slept) and warm, in the thread's CPU
    time (``time.thread_time``: the kernel's part of the sleep counts, the sleep itself does not;
    :meth:`_wake_pairs`); the simulator adds the difference to each wake-up of an idle rank on a crowded node
    (``[Note: idle CPU]``).  A first version waited for the peer's answer with an MPI probe before the timed
    wake-up, which warmed the very calls the wake-up makes, and let the peer wake during the warm one; with a peer
    turn that runs no program the toy's wake-ups came out 2.2 us over warm (100 pairs, twice); as here, 14-16 us.
    """

    def __init__(self, comm: Any, peer: int, runs: int, db: Any = None) -> None:
        self.comm, self.peer, self.runs, self.db = comm, peer, runs, db
        self.x = torch.zeros(1, 8)

    @staticmethod
    def pin(core: int | None = None) -> tuple[set[int], int] | None:
        """Pin this rank's main thread to ``core`` (None: the lowest it may use); (the cores it had, that core), or
        None where it cannot."""
        try:
            had = set(os.sched_getaffinity(0))
            core = min(had) if core is None else core
            os.sched_setaffinity(0, {core})
        except (AttributeError, OSError, ValueError):
            return None
        return had, core

    @staticmethod
    def unpin(had: set[int]) -> None:
        try:
            os.sched_setaffinity(0, had)
        except OSError:  # pragma: no cover - the cores it had are gone
            pass

    def lead(self, work: list[tuple[str, Any, tuple[torch.Tensor, ...]]],
             b2b_ms: dict[str, float] | None = None) -> dict[str, Any] | None:
        """Rank 0: per program, ``runs`` pairs of (turn after the peer's turn on this core, warm turn) in ms."""
        comm, peer = self.comm, self.peer
        pinned = self.pin()
        comm.send(None if pinned is None else pinned[1], dest=peer, tag=SHARED_CORE_TAG)
        if pinned is None:
            say(0, "calibration: could not pin this rank to one core (os.sched_setaffinity): no shared-core figures")
            return None
        if not _recv_setup(comm, peer, "whether it runs on that core"):  # it may not (a CPU binding)
            self.unpin(pinned[0])
            say(0, f"calibration: rank {peer} cannot run on core {pinned[1]} (its CPU binding): no shared-core figures")
            return None
        selfc = MPI.COMM_SELF.Dup()
        inbox = Inbox(selfc)
        out: dict[str, Any] = {"core": pinned[1], "programs": {}}
        try:
            for i, (name, fn, args) in enumerate(work):
                if fn is WAKE:  # an idle rank's wake-up, the peer's turns running the programs in turn
                    progs = [k for k, w in enumerate(work) if w[1] is not None and w[1] is not WAKE]
                    took = {k: (b2b_ms or {}).get(work[k][0], 0.0) / 1e3 for k in progs}
                    out["wake"] = self._wake_pairs(i, max(self.runs, SHORT_RUNS), Inbox(comm), progs, took)
                    continue
                cold: list[float] = []
                warm: list[float] = []
                # the turn without a program takes a few ms a pair: more pairs for a steadier median
                for _ in range(self.runs if fn is not None else max(self.runs, SHORT_RUNS)):
                    for into in (cold, warm):
                        h_in = tp.isend_message(selfc, 0, tp.KIND_DATA, (0,), (), list(enumerate(args)))
                        if into is cold:  # the peer's turn on this core, then this rank's
                            tp.send_message(comm, peer, tp.KIND_DATA, (0,), (), [(0, self.x)], aux=i)
                            # asleep while the peer's turn (about this rank's warm one) runs: polls would warm this
                            # rank's receive path on the core
                            time.sleep(min(1.0, 0.3e-3 + 2 * (warm[-1] if warm else 0.0) / 1e3))
                            deadline = time.perf_counter() + 30.0
                            while not comm.Iprobe(source=peer, tag=tp.TAG_HEADER):
                                if time.perf_counter() > deadline:
                                    raise CalibrationError(f"calibration: rank {peer} did not answer within 30 s on "
                                                           f"the core it shares with rank 0; is it stopped or dead?")
                                time.sleep(20e-6)  # (asleep: the core is the peer's)
                        t0 = time.perf_counter()
                        msg = _take_one(inbox)
                        h = tp.isend_message(selfc, 0, tp.KIND_DATA, (0,), (), list(enumerate(
                            _outputs(msg.tensors if fn is None else fn(*msg.tensors)))))
                        into.append((time.perf_counter() - t0) * 1e3)
                        _take_one(inbox)  # the outputs, untimed
                        h.wait()
                        h_in.wait()
                        if into is cold:
                            tp.recv_message(comm, source=peer, timeout_s=30.0)  # the peer's answer
                pairs = {"evicted_ms": cold, "warm_ms": warm}
                if fn is None:  # the turn with no program: the frontend's
                    out["turn"] = pairs
                else:
                    out["programs"][name] = pairs
        finally:
            tp.send_message(comm, peer, tp.KIND_STOP)
            selfc.Free()
            self.unpin(pinned[0])
        return out

    def _wake_pairs(self, item: int, n: int, world: Inbox, progs: list[int],
                    took: dict[int, float]) -> dict[str, list[float]]:
        """Up to ``n`` pairs of (an idle rank's wake-up after the peer's turn, the same warm), thread CPU ms.

        The wake-up is a backoff's (a sleep, on the doorbell where there is one, then a poll that finds nothing).
        The cold one's sleep is where the peer's turn runs (asked for just before), as other ranks run on a crowded
        node's core while a rank sleeps; the warm one, as long, follows at once while the peer sleeps: the peer's
        turn is all that differs.  The peer's turns run the programs of ``progs`` (indices into the work list) in
        turn, as a crowded node's other ranks run theirs (none: a turn with no program); the sleeps cover the
        program's last turn there (``took``, seconds, seeded with its back-to-back time).  The peer answers once it
        woke, saying when its turn ended and when it woke: a pair whose turn ended after the cold sleep, or whose
        peer woke before the warm one ended, is left out and measured again; at most ``3 n`` tries, and none begun
        after :data:`WAKE_BUDGET_S` once ``runs`` pairs are in.
        """
        comm, peer, db = self.comm, self.peer, self.db
        cold: list[float] = []
        warm: list[float] = []
        t_stop = time.perf_counter() + WAKE_BUDGET_S

        def wake(sleep_s: float) -> float:
            if db is not None:  # as mailbox.Backoff sleeps from 100 us on
                db.sleep(sleep_s, db.probe_header)
            else:
                time.sleep(sleep_s)
            woke = time.perf_counter()
            if world.poll():
                raise CalibrationError("calibration: a message came to a poll that expects none")
            return woke

        tries = 0
        for tries in range(1, 3 * n + 1):
            if len(cold) >= self.runs and time.perf_counter() > t_stop:
                break
            prog = progs[tries % len(progs)] if progs else -1
            sleep_s = WAKE_COLD_SLEEP_S + 1.5 * took.get(prog, 0.0)
            tp.send_message(comm, peer, tp.KIND_DATA, (prog, int(sleep_s * 1e6)), (), (), aux=item)
            c0 = time.thread_time()
            t_cold = wake(sleep_s)
            c1 = time.thread_time()
            wake(sleep_s)
            c2 = time.thread_time()
            t_end = time.perf_counter()
            turn_s, turn_end, peer_woke = _recv_setup(comm, peer, "its answer (the shared-core step)", 300.0)
            took[prog] = turn_s
            if turn_end < t_cold and peer_woke > t_end:
                cold.append((c1 - c0) * 1e3)
                warm.append((c2 - c1) * 1e3)
                if len(cold) == n:
                    break
        say(0, f"calibration: shared core: {len(cold)} wake-up pairs kept of {tries} tries")
        return {"evicted_ms": cold, "warm_ms": warm}

    def follow(self, work: list[tuple[str, Any, tuple[torch.Tensor, ...]]]) -> None:
        """The peer: pinned to rank 0's core, it runs a turn of program ``aux`` each time rank 0 asks (takes the
        message, runs the program on its own inputs, answers), until STOP; for the wake-up item, the program rank 0
        names, then it sleeps through rank 0's two timed wake-ups before it answers (:meth:`_wake_pairs`)."""
        comm = self.comm
        core = _recv_setup(comm, 0, "the core to share")
        if core is None:
            return
        pinned = self.pin(core)
        comm.send(pinned is not None, dest=0, tag=SHARED_CORE_TAG)
        if pinned is None:
            return
        try:
            while True:
                m = tp.recv_message(comm, source=0, timeout_s=300.0, spin_s=0.0)
                if m.header.kind == tp.KIND_STOP:
                    return
                _name, fn, args = work[m.header.aux]
                t0 = time.perf_counter()
                if fn is WAKE:  # the program rank 0 names (if any), then asleep through rank 0's two sleeps of the
                    prog, sleep_us = m.header.request_ids[:2]  # length it names; the answer says how long the turn
                    if 0 <= prog < len(work):  # took, when it ended and when this rank woke (rank 0 keeps the pairs
                        work[prog][1](*work[prog][2])  # whose turn ended in its cold sleep and slept through its warm)
                    turn_end = time.perf_counter()
                    time.sleep(2 * sleep_us / 1e6 + WAKE_MARGIN_S)
                    comm.send((turn_end - t0, turn_end, time.perf_counter()), dest=0, tag=SHARED_CORE_TAG)
                    continue
                if fn is not None:
                    fn(*args)
                # a small answer: a large one would keep this rank polling its send, on rank 0's core, until rank 0
                # takes it (after its timed turn)
                tp.send_message(comm, 0, tp.KIND_DATA, (0,), (), [(0, self.x)])
                # asleep through rank 0's two timed turns (a backoff's wake-ups would run on its core meanwhile)
                time.sleep(min(1.0, 0.5e-3 + 4 * (time.perf_counter() - t0)))
        finally:
            self.unpin(pinned[0])


def _stamped(x: torch.Tensor) -> torch.Tensor:
    """The ping-pong replica's program: its input with the time it ran (``time.perf_counter``) in the first entry
    and, where there is a second, the CPU seconds its process has used (``time.process_time``: successive answers
    differ by the CPU of one request and the idle gap before it, ``[Note: idle CPU]``)."""
    y = x.clone()
    y[:, 0] = time.perf_counter()
    if y.shape[1] > 1:
        y[:, 1] = time.process_time()
    return y


def _pairs(after: dict[str, tuple[list[float], list[float]]]) -> dict[str, dict[str, list[float]]]:
    """:func:`_times`'s (cold, warm) runs per gap as the raw figures ``after_ms`` and ``warm_ms``."""
    return {"after_ms": {g: c for g, (c, _) in after.items()}, "warm_ms": {g: w for g, (_, w) in after.items()}}


def _times(fn: Any, args: tuple[torch.Tensor, ...], n: int, sleep_s: float) -> tuple[list[float], list[float]]:
    """ms of ``n`` runs of ``fn`` on ``args``, each after ``sleep_s`` idle (its cold extra), as a rank runs a batch,
    and of the warm run straight after each (the pair's difference is the extra; ``[Note: cold extra in pairs]``).

    [Note: cold extra after a receive]
    A rank woken after an idle gap receives its inputs before it computes: it polls MPI, decodes the header and
    makes the tensors, and those first calls after the sleep run cold.  The calibrated hop (``pingpong``: to the
    replica's stamp, after its receive) already holds that; the simulator adds the program's cold extra to it.  So
    the program is timed here as the runtime times a batch: its inputs arrive as a message through the runtime's
    transport (sent to this rank itself before the sleep, taken by an ``Inbox`` after it: the runtime's receive
    code, though a copy within this process after a plain sleep, not a doorbell's wake-up), and only ``fn`` is
    timed.  Timed straight after a sleep instead, the toy's programs (15 us back to back) paid 0.47 ms after
    100 ms idle, and 0.29 ms once a receive-like step ran first: the 0.18 ms of the wake-up's cold calls counted
    in the hop and again in every program of a path (the toy's split at 8 req/s: 1.96 ms of simulated compute on
    the critical path against 1.06 measured in the run; docs/simulate.md, "Cold extras").

    [Note: cold extra in pairs]
    The extra is a difference of two times of one program, and on a shared node the program's speed drifts
    between the back-to-back runs and the runs after gaps, timed seconds apart: the whole CLIP model's extra
    after 1 s came out 0.25, 6.5 and 48 ms in three calibrations.  So each cold run is followed at once by a
    warm one, and the extra is the median of the pairs' differences (``calibrate_fit``): a drift slower than
    one pair cancels.
    """
    comm = MPI.COMM_SELF.Dup()  # its own: nothing a failed call left behind reaches another call
    inbox = Inbox(comm)
    cold: list[float] = []
    warm: list[float] = []
    h = None
    try:
        for _ in range(n):
            h = tp.isend_message(comm, 0, tp.KIND_DATA, (0,), (), list(enumerate(args)))
            time.sleep(sleep_s)
            ts = _take_one(inbox).tensors
            h.wait()
            h = None
            for into in (cold, warm):
                t0 = time.perf_counter()
                fn(*ts)
                into.append((time.perf_counter() - t0) * 1e3)
    finally:
        if h is not None:  # failed half-way: no payload may land later in a buffer the pool hands out again
            inbox.forget({0})
        comm.Free()
    return cold, warm


def calibrate(comm: Any, cfg: dict[str, Any], s: CalibrateSettings, rt: RuntimeSettings,
              paths: RunPaths) -> dict[str, Any] | None:
    """Run every step of ``[Note: calibration measurements]``; rank 0 writes the file and returns a summary."""
    job = _Job(comm, s, rt)
    rank = job.rank
    if not job.same:
        raise CalibrationError(f"stage=calibrate needs at least 2 ranks on rank 0's node ({job.hosts[0]}); the job has "
                               f"{len(job.hosts)} rank(s) on {sorted(set(job.hosts))}: set calibrate.ranks (>= 3)")
    db = start_doorbell(comm, rt.doorbell is True, rt.doorbell_network) if rt.doorbell else None
    if db is not None and db.note and rank == 0:
        say(0, db.note)
    t0 = time.perf_counter()
    a = job.same[0]
    job.chain("pingpong", [a], 1, job.pingpong(s.sizes_bytes, s.gaps_ms, True), _stamped)
    if job.cross:
        job.chain("pingpong cross", [job.cross[0]], 1, job.pingpong(s.sizes_bytes, s.gaps_ms, False), _stamped)
    check = job.gap_sessions(s.chain_gaps_ms)
    job.chain("one", [a], 1, job.frontend_sessions(check))
    if len(job.same) >= 2:
        job.chain("two", job.same[:2], 1, job.frontend_sessions(check))
    for b in (1, 32):
        job.chain(f"saturation b{b}", [a], b,
                  job.frontend_sessions([("saturation", ("saturation", {"n": s.saturation_requests}))]))
    job.chain("turns", [a], 1, job.frontend_sessions([("turns", ("turns", {"n": TURN_REQUESTS}))]))
    job.wait("compute: start")
    cluster = ClusterSpec.from_config(cfg.get("cluster") or {})
    threads = s.threads or tuple(cluster.cpu_threads) or (1,)
    if rank == 0:
        job.raw["gflops"] = {str(int(t)): job.matmul_rate(int(t)) for t in threads}
        say(0, "calibration: matmul set " + ", ".join(f"{t} thread(s) {v:.1f} GFLOP/s"
                                                       for t, v in job.raw["gflops"].items()))
    node0 = [0, *job.same]
    k_max = min(len(node0), max(1, cluster.cores_per_node))
    rates: dict[str, list[float]] = {}
    for k in range(1, k_max + 1):
        job.wait(f"corun {k}")
        mine = job.matmul_rate(1, CORUN_S) if rank in node0[:k] else None
        job.wait(f"corun {k}: done")  # the gather below blocks (and spins) only once every rank is there
        got = comm.gather(mine, root=0)
        if rank == 0:
            rates[str(k)] = [float(v) for v in got if v is not None]
    job.wait("small program")
    peer = job.same[0]
    sha: str | None = None
    work: list[tuple[str, Any, tuple[torch.Tensor, ...]]] = []
    if rank == 0:
        job.raw["corun_gflops"] = rates
        job.raw["small"] = job.small_cold()
        sha, work = job.work(paths)
        job.raw["programs"] = job.programs(sha, work)
    job.wait("placement: start")  # [Note: stacked wake-ups]
    cpu = _cpu_reader()
    if db is not None and cpu is not None and rank in (0, peer):
        if rank == 0:
            job.raw["placement"] = placed = placement_ringer(comm, peer, db, cpu)
            n = len(placed["same_core"])
            if n:
                share = float(np.mean(placed["same_core"]))
                say(0, f"calibration: {100 * share:.0f} % of {n} doorbell wake-ups (of {PLACEMENT_RINGS} rings) ran on "
                       f"the core of the rank that rang (woken after p50 {float(np.median(placed['woke_us'])):.0f} us)"
                       + ("; where a node has fewer cores than ranks, bind a split plan's ranks to cores "
                          "(launcher.mpiexec_args, docs/simulate.md)" if share > 0.5 else ""))
            else:
                say(0, f"calibration: none of {PLACEMENT_RINGS} doorbell rings found rank {peer} asleep: no figure "
                       "of where a woken rank runs")
        else:
            placement_sleeper(comm, db, cpu)
    job.wait("placement: done")
    job.wait("shared core")  # [Note: evicted caches]
    if rank == peer:  # (loaded only now: nothing else runs on the node while rank 0 times its programs)
        sha, work = job.work(paths)
    if rank in (0, peer):
        sc = _SharedCore(comm, peer, s.program_runs, db)
        turns = [("turn", None, (torch.zeros(1, 8),)), ("wake", WAKE, ()), *work]
        with torch.inference_mode():
            if rank == 0:
                timed = (job.raw.get("programs") or {}).get("programs") or {}
                job.raw["shared_core"] = sc.lead(turns, {k: float(np.median(v["b2b_ms"])) for k, v in timed.items()
                                                         if v.get("b2b_ms")})
            else:
                sc.follow(turns)
    job.wait("programs")
    comp = comm.gather(job.raw["chains"], root=0)
    if db is not None:
        db.close()
    if rank != 0:
        return None
    for part in comp[1:]:
        for name, d in part.items():
            job.raw["chains"].setdefault(name, {}).update(d)
    job.raw["cores_per_node"] = cluster.cores_per_node
    job.raw["cluster"] = cluster.name
    job.raw["wall_s"] = time.perf_counter() - t0
    cal = fit(job.raw)
    out = cal.save(paths.own_calibration)
    raw_path = out.with_name(out.stem + ".raw.json")  # the measurements the file was fitted from (for a person)
    raw_path.write_text(json.dumps(job.raw, indent=1, default=float) + "\n")
    load_calibration(out)  # what every reader will check
    say(0, f"calibration written to {out} in {job.raw['wall_s']:.0f} s: {cal.describe()}")
    return {"calibration": str(out), "summary": cal.describe(), "wall_s": job.raw["wall_s"],
            "hop_ms": dict(zip(cal.hop.gaps_ms, cal.hop.values_ms, strict=True))}
