"""Discrete-event simulation of a served plan: the runtime's own policies, the target's calibrated costs.

[Note: simulator]
:func:`simulate` runs one open-loop session of a :class:`SimSystem` (built from a plan, a profile, the
switchboard's dataflow and a calibration by :mod:`hpcsplit.core.sim_model`) and returns per-request arrival,
admission and completion times, which :func:`hpcsplit.core.load.summarize` turns into the bench's figures.
What it models is what the runtime does (``hpcsplit/runtime/``), rule for rule:

- **frontend** (``frontend.py``): requests wait at the frontend until fewer than ``max_inflight`` are in the
  pipeline; one loop turn admits every arrived request (at most ``max_admit``), routes each, and sends one
  message per entry component replica; a request is done when the messages of every component that
  produces a model output have come back; one not done ``request_timeout_s`` after its arrival fails, and a
  sleeping frontend wakes for that deadline (its window frees then, not when the late output comes);
- **routing**: the runtime's own router (:class:`~hpcsplit.core.policy.ReplicaRouter`, which
  ``runtime.routing.Router`` is): per component the replica with the fewest outstanding requests, ties to
  the bigger replica, then to the one used least recently;
- **batching** (``batching.Batcher``): a replica runs what waits, up to its plan batch size, once the batch is
  full or the oldest request waited ``max_wait_ms`` (0: at once); a join runs a request once a message from
  every source of it has come (``JoinBuffer``);
- **the dataflow** (``routing.build_dataflow``): after a batch a replica sends one message per destination
  component and replica on the requests' routes, carrying their bytes;
- **costs** (:mod:`hpcsplit.core.calibration`): a message to a rank that has been idle for a gap waits the
  calibrated hop delay of that gap (wake-up, doorbell, message), plus its bytes at the link's bandwidth (one
  node or across); the frontend admits a request the calibrated timer delay after its arrival when it was
  asleep; every rank's turn costs CPU (per message, per request) and a batch its profiled latency at that
  batch and thread count (or slice), plus the calibrated cold extra after an idle gap (the program's; for the
  frontend's turn after a sleep, the small program's ``compute_cold``), with the profile's spread as jitter;
- **critical path** (``[Note: critical path in the run]``): a batch's messages carry the longest compute chain
  behind its requests plus the batch's own compute (its share of the job's wall time, slowed as the node slows
  it), so ``SimRun.path_ms`` is what the bench's ``critical_path_ms`` measures;
- **idle policy** (``mailbox.Backoff``): after its work a rank polls back to back for ``spin_us``, taking a
  core, and sees a message in that time at once; then it sleeps, and a message waits the hop delay of its
  idle gap; a sleep is never longer than the rank's next timer (the frontend's next arrival or deadline, a
  waiting batch's ``max_wait_ms``): whichever of the ring and the timer comes first ends it;
- **time-shared CPU** (CPU plans): a rank's turn needs one of its node's cores, and waits in the node's run queue
  when every core is held (``[Note: run queues]``), or for its own core when it is bound or its wake-up was placed
  on its ringer's core (``[Note: wake-up placement]``); the ranks holding cores run at ``cores / threads`` of their
  speed when the ranks backing off after their spin take a share too (``[Note: idle CPU]``), and ``k`` ranks
  computing at once each run ``corun_slowdown[k-1]`` slower (memory bandwidth).

[Note: run queues]
On a node whose cores the ranks share (a CPU plan), a rank runs only while it holds a core, as under Linux's
scheduler: a rank whose turn comes (a ring, a timer, a message seen while it spins) takes a free core, or waits
in the node's run queue, first come first; it keeps its core through its turn, its job and its spin, and gives it
to the first rank waiting when it sleeps (after its spin, or to wait for a batch).  A rank that has held a core
for a slice (:func:`sched_slice_s`: EEVDF's 0.75 ms base slice scaled by the number of CPUs, as the kernel does
by default) while others wait goes to the back of the queue, its job's work left for when it is back; a spinner
that lost its core polls once when it has it again (and sleeps if its spin's time has passed).  So short turns
run whole, one after the other (a rank waits for the turns ahead of it), and long jobs share the cores by slices.
The simulator shared saturated cores finely before (processor sharing), which charged a 30 us turn on a node
twice over-subscribed some 60 us; a run queue charges it the turns ahead of it.  On the development VM's two cores
a toy bench's ranks waited 300-800 us per scheduling at 2,048 req/s (``schedstat``).  Against the same benches
the toy's predicted p50 at 2,048 and 6,000 req/s went from 35-55 % low to 10-18 % low (one level 8 % high), and
in a later run with a faster hour's calibration from 43-61 % low to 19-42 % low; a wait per hop on a busy node is
still missing (``docs/simulate.md``, "Run queues").

[Note: wake-up placement]
The run queue knows which core each rank holds.  A rank taking a free core takes the one it last ran on if free,
else the first free.  Two things tie a rank to one core, and it then waits for that core though another is free:
- **stacked wake-ups** (``[Note: stacked wake-ups]`` in :mod:`hpcsplit.launch.calibrate_run`): on the development
  VM a rank rung by a rank of its node wakes on the ringer's core 95-100 % of the time.  The calibration measures
  that share (``wake_on_ringer_core``).  A sleeping rank rung from its node is placed, with that probability, on the
  core the ringer holds (or last held); when its hop delay has passed it waits for that core.  A spinning holder is
  preempted at once (a task that ran long yields to a woken one; it then waits for that core again); a working one
  keeps the core until it sleeps or its slice ends, and then waits for any core (tied to its core, CLIP's split was
  predicted 14-30 % lower near saturation than with placement off, the toy no better).  As the kernel balances
  its run queues, a core falling idle with no rank waiting for it takes the first rank waiting for another core
  (newly idle balancing), and a core already idle does so at the next scheduler tick (``BALANCE_TICK_S``, 4 ms at
  ``CONFIG_HZ=250``).  Not measured, or 0: no placement, the run queue as before.  So a split's branches rung by one
  rank share its core until a tick or a core falling idle parts them, and a chain's ranks gather on one core
  until their work overlaps;
- **bound ranks** (``SimSystem.bind_cores``, ``simulate.bind`` or ``-bind-to core`` in ``launcher.mpiexec_args``):
  each rank runs only on core ``i % cores`` of its node, ``i`` its place among the node's ranks in rank order (as
  MPICH's ``-bind-to core`` deals them out); a bound rank never stacks and is never moved, and its turn preempts a
  rank spinning on its core as a placed wake-up does.
Against a toy bench of stop 49 with its own calibration (95 % stacked; docs/simulate.md, "Wake-up placement"), the
p50s from 256 to 6,000 req/s went from -13..+15 % to -10..+8 % (whole at 6,000 req/s +15 to +8 %, split at 256 -12
to -9 %, at 6,000 -13 to -10 %) and the p99s from 28-40 % low to 20-35 % low; without the newly idle core's
balancing the p50s at 2,048-6,000 req/s were 15-21 % high.  The split's saturated throughput is predicted 18 % high
(20 % without placement).  On a CLIP bench the model moves the figures by 3 points or less but one (8).  A ringer
preempted between the sends of one batch (7-14 % of the multi-destination sends in a traced run, some 400 us each)
is not modelled.

[Note: idle CPU]
A rank idle between messages is not free: after its spin the runtime's backoff (``mailbox.Backoff``) sleeps
20 us, 40, 80, ... and each wake-up is a context switch, a poll of MPI and a turn of the Python loop, some
10-20 us of CPU on the development VM, until the doorbell's long sleep.  ``calibration.idle_cpu`` is the CPU a
rank spends over an idle gap (measured in the ping-pong: the replica's CPU per request at each gap, less back
to back).  On a node whose cores are shared, a rank in its backoff counts as a fraction of a thread: over
each span between the curve's points after the spin, the CPU the curve adds there divided by the span's
length (at most one core).  Measured on the development VM: a rank idle 0.5 ms used 0.14 ms of CPU, against
its spin's 0.05.  At 2,048 req/s through the toy's seven ranks on two cores the machine ran 95 % busy
(0.9 ms of CPU per request for 0.11 ms of compute); charging the wake-ups raised the simulated p50 there by
2-20 %, a part of what it missed (docs/simulate.md, "Measured").  On a crowded node (more ranks than cores) each
wake-up also runs cold, other ranks having run on the core since the last: the curve (measured with a core for
each rank) has each of a backoff's wake-ups before its doorbell sleep (six after a 50 us spin,
:func:`~hpcsplit.core.policy.backoff_wakes_ms`) cost ``cpu.evicted_us_per_wake`` more there, spread over the sleep it
ends.  Charged as a share of a core like the rest, it is an average: a backoff that work ends half-way through a
sleep has paid half of that wake-up, and it is paid whether or not another rank ran in that sleep.

Evicted caches (``[Note: evicted caches]`` in :mod:`hpcsplit.launch.calibrate_run`): on a node with more ranks than
cores, every rank's job (a frontend turn, a batch) marks the node's other ranks evicted; an evicted rank's next
batch pays at least the program's calibrated turn after an eviction (``ProgramCal.evicted_ms``) in place of its
cold extra after the idle gap (the larger of the two), and an evicted frontend's next working turn at least
``cpu.evicted_us_per_turn``.  A rank with a core of its own (a GPU plan, or no more ranks than cores) never pays
it.  The marking is per node, not per core: a job on another core marks the rank too, so a node with only a few
ranks more than cores is charged more than it pays (a node of 65 single-thread ranks on 64 cores, every batch);
the rank count, not the threads, is set against the cores.  On the development VM at 2,048 req/s the toy's
programs took 91-142 us of CPU in the run against 13-56 us back to back; the calibrated turns after a peer's on
the same core took 76-211 us more than warm.  Against one bench, with the calibration made just before it, the
split's predicted p50 went from 18-46 % low to 7-25 % low at 256 to 6,000 req/s (``docs/simulate.md``,
"Evicted caches").

The batching rule is checked against the runtime's code on the same trace (``tests/unit/test_simulator.py``
replays every turn through ``runtime.batching.Batcher``).  Deterministic: the same system, schedule and seed give the same result.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hpcsplit.core.calibration import HOP_SPREAD_MAX, Calibration, Curve
from hpcsplit.core.policy import ReplicaRouter, ServePolicy, backoff_wakes_ms

__all__ = ["STATUS_OK", "STATUS_TIMEOUT", "ServePolicy", "SimComponent", "SimRank", "SimRun",
           "SimSystem", "simulate"]

STATUS_PENDING = 0
STATUS_OK = 1  # as runtime.frontend.STATUS_OK
STATUS_TIMEOUT = 2

_ARR, _DLV, _TURN, _DONE, _SPIN, _DUE, _IDLEW, _SLICE, _BAL = 0, 1, 2, 3, 4, 5, 6, 7, 8
_IDLE, _SCHEDULED, _BUSY, _SPINNING, _QUEUED = 0, 1, 2, 3, 4  # a rank's states (_QUEUED: its turn waits for a core)
_OWN, _RING, _TIMER = 0, 1, 2  # what a scheduled turn is: the rank's own (no sleep), a ring or a timer ending a sleep
_Q_TURN, _Q_JOB, _Q_SPIN = 0, 1, 2  # what a rank waiting for a core does once it has one
BASE_SLICE_S = 0.75e-3  # EEVDF's base slice (Linux 6.6 on: sysctl_sched_base_slice)
BALANCE_TICK_S = 4e-3  # the scheduler tick at which an idle core is sent to pull waiting ranks (CONFIG_HZ=250)
HOP_SIGMA_MAX = math.log(HOP_SPREAD_MAX) / 1.2816  # a hop's lognormal spread at most: its p90 4x its p50


def sched_slice_s(cores: float) -> float:
    """The time slice of Linux's scheduler on a node of ``cores`` CPUs: the base slice scaled as the kernel scales it
    by default (``1 + log2(cpus)``, counting at most 8 CPUs).

    Examples
    --------
    >>> [round(sched_slice_s(c) * 1e3, 3) for c in (1, 2, 4, 128)]
    [0.75, 1.5, 2.25, 3.0]
    """
    n = min(8, max(1, int(cores)))
    return BASE_SLICE_S * (1 + int(math.log2(n)))


@dataclass(frozen=True, slots=True)
class SimComponent:
    """One component of the dataflow (``Dataflow.components`` order, topological)."""

    name: str
    need: int  # messages a request needs here: its distinct sources (the frontend counts once)
    sinks: tuple[tuple[int, float], ...]  # (destination component index, -1: the frontend; bytes per request)
    replicas: tuple[int, ...]  # ranks, by replica index


@dataclass(frozen=True, slots=True)
class SimRank:
    """One MPI rank: the frontend (``component == -1``) or a replica."""

    rank: int
    node: int
    component: int
    batch_size: int = 1
    threads: int = 1
    size: float = 0.0  # GPU slice or CPU threads (routing prefers bigger replicas on ties)
    latency_ms: tuple[float, ...] = ()  # [b - 1]: compute of a batch of b
    sigma: float = 0.0  # lognormal spread of one batch's compute
    cold: Curve = field(default_factory=lambda: Curve.constant(0.0))  # extra ms of a batch after an idle gap
    evicted_ms: float = 0.0  # extra ms of a turn with a batch after the core's caches were evicted ([Note: evicted caches])


@dataclass(frozen=True, slots=True)
class SimSystem:
    """Everything :func:`simulate` needs (``[Note: simulator]``)."""

    name: str
    components: tuple[SimComponent, ...]
    entry: tuple[tuple[int, float], ...]  # (component fed with model inputs, bytes per request)
    n_outputs: int  # components whose messages a request needs back at the frontend
    ranks: tuple[SimRank, ...]  # ranks[0] is the frontend
    node_cores: tuple[float, ...]  # per node: cores that compute shares (CPU plans); () = compute on devices
    calibration: Calibration
    policy: ServePolicy = field(default_factory=ServePolicy)
    bind_cores: bool = False  # each rank bound to one core of its node, in rank order (``[Note: wake-up placement]``)


@dataclass(frozen=True, slots=True)
class SimRun:
    """Per-request times of one simulated session (seconds from its start), as ``runtime.frontend.SessionResult``."""

    arrival_s: np.ndarray
    admit_s: np.ndarray
    done_s: np.ndarray  # NaN where not done
    status: np.ndarray
    busy_s: np.ndarray  # per rank: time spent in turns
    events: int
    node_cpu_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per node: CPU used (shared CPU plans)
    path_ms: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per request: compute on its critical path
    rank_cpu_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per rank: its part of its node's (shared CPU plans)

    @property
    def ok(self) -> np.ndarray:
        return self.status == STATUS_OK


class _Noise:
    """Standard normal draws (uniform in [0, 1) with ``uniform``) in blocks (one ``numpy`` call per 4096 draws)."""

    __slots__ = ("_buf", "_i", "_rng", "_uniform")

    def __init__(self, seed: int | list[int], uniform: bool = False) -> None:
        self._rng = np.random.default_rng(seed)
        self._uniform = uniform
        self._buf: list[float] = []
        self._i = 0

    def __call__(self) -> float:
        if self._i >= len(self._buf):
            draw = self._rng.random if self._uniform else self._rng.standard_normal
            self._buf = draw(4096).tolist()
            self._i = 0
        self._i += 1
        return self._buf[self._i - 1]


def simulate(system: SimSystem, arrivals_s: np.ndarray, seed: int = 0,
             trace: list[tuple[int, float, list[int], list[int]]] | None = None,
             hops: list[tuple[int, int, float, float, int, float, float, float]] | None = None) -> SimRun:
    """Simulate one open-loop session (``[Note: simulator]``).

    Parameters
    ----------
    system : SimSystem
    arrivals_s : array of float
        Arrival offsets in seconds, non-decreasing (``hpcsplit.core.load.arrival_times``).
    seed : int
        Seed of the jitter draws.
    trace : list, optional
        Filled with ``(rank, time, requests that became ready, requests batched)`` per component turn (the tests
        replay it through ``runtime.batching.Batcher``).
    hops : list, optional
        Filled with ``(source rank, destination rank, sent, taken, its requests, delivered, busy, hop)`` per
        message (ranks as the plan numbers them, times in seconds): from the sender's send to the turn of the
        receiver that took it, and that way's parts: the transfer (to ``delivered``), the wait for the receiver's
        work (``busy``: it was computing when the message came; a job that lost its core at a slice's end is
        counted here whole), the hop delay of a sleeping receiver (``hop``; the wait for a batch's timer and the
        frontend's timer lag too) and the rest, ``taken - delivered - busy - hop``, the wait for a core
        (``python -m hpcsplit.bench hops`` puts these beside a traced run's).

    Returns
    -------
    SimRun
    """
    return _Sim(system, seed, trace, hops).run(np.asarray(arrivals_s, dtype=np.float64))


class _Sim:
    """One session's state; :meth:`run` is the event loop (times in seconds)."""

    def __init__(self, s: SimSystem, seed: int, trace: list[Any] | None = None,
                 hops: list[Any] | None = None) -> None:
        self.s = s
        self.trace = trace
        self.hops = hops
        self.sent: list[list[tuple[int, float, int, float, bool]]] = [[] for _ in s.ranks]  # (source, sent,
        # requests, delivered, the receiver computing then) unread
        self.due = [0.0] * len(s.ranks)  # when the rank's latest turn came due (its hop or timer over, its job done)
        cal = s.calibration
        self.cal = cal
        self.noise = _Noise(seed)
        n = len(s.ranks)
        self.comp = [r.component for r in s.ranks]
        self.node = [r.node for r in s.ranks]
        self.bs = [max(1, r.batch_size) for r in s.ranks]
        self.threads = [max(1, r.threads) for r in s.ranks]
        self.lat = [tuple(x / 1e3 for x in r.latency_ms) for r in s.ranks]
        self.sigma = [r.sigma for r in s.ranks]
        self.cold = [r.cold for r in s.ranks]
        self.need = [c.need for c in s.components]
        self.sinks = [c.sinks for c in s.components]
        self.state = [_IDLE] * n
        self.sv = [0] * n  # spin versions (a message during the spin ends it)
        self.wk = [_OWN] * n  # what the scheduled turn is (_OWN, _RING, _TIMER)
        self.turn_at = [0.0] * n  # when the scheduled turn comes
        self.tv = [0] * n  # turn versions (a newer scheduled turn makes older ones stale)
        self.jv = [0] * n  # job versions (a change of its node's rate, or a slice's end, moves a job's end)
        self.last = [0.0] * n  # when the rank last finished work
        self.ran = [0.0] * n  # when the rank's program last finished a batch (its cold extra counts from there)
        self.owed = [0] * n  # messages a rank took in turns that ran no batch: their CPU is paid with the next batch
        self.inbox: list[list[tuple[list[int], float]]] = [[] for _ in range(n)]  # (requests, their path) a message
        self.pin: list[dict[int, float]] = [{} for _ in range(n)]  # request -> longest path of its messages here
        self.ready: list[deque[tuple[float, int]]] = [deque() for _ in range(n)]
        self.count: list[dict[int, int]] = [{} for _ in range(n)]
        self.job: list[Any] = [None] * n  # what the running job does when it ends
        self.busy = [0.0] * n
        self.shared = bool(s.node_cores)
        nodes = max(self.node) + 1
        self.cores = list(s.node_cores) if self.shared else [math.inf] * nodes
        self.jobs: list[dict[int, list[float]]] = [{} for _ in range(nodes)]  # rank -> [work left, threads]
        # [Note: run queues]: per node, the ranks holding a core and those waiting for one
        self.slots = [max(1, round(c)) for c in self.cores] if self.shared else []
        self.used = [0] * nodes  # cores held (by a turn, a job or a spin)
        self.runq: list[deque[int]] = [deque() for _ in range(nodes)]
        self.node_ranks = [[r for r in range(n) if self.node[r] == k] for k in range(nodes)]
        self.oncore = [False] * n
        self.qwhat = [_Q_TURN] * n  # what a queued rank does once it has a core
        self.qwork = [0.0] * n  # a preempted job's work left
        self.runv = [0] * n  # versions of a rank's hold of a core (a stale slice's end is ignored)
        self.armed = [-1] * n  # the hold whose slice end is in the heap
        self.held_since = [0.0] * n
        self.spin_until = [0.0] * n
        # [Note: wake-up placement]: which core each rank holds (or last held), which rank holds each core, and the
        # core a rank's wake-up was placed on (-1: any free core)
        self.core = [-1] * n
        self.holder = [[-1] * k for k in self.slots]
        self.bound = [-1] * n
        self.qcore = [-1] * n  # ... the core a queued rank waits for (-1: any)
        self.bal_armed = [False] * nodes  # a balancing tick is in the heap
        self.pinned = [-1] * n  # a bound rank's core
        if self.shared and s.bind_cores:  # as MPICH's -bind-to core: the node's ranks in order, wrapping around
            for k, rs in enumerate(self.node_ranks):
                for i, r in enumerate(rs):
                    self.pinned[r] = i % self.slots[k]
        self.p_stack = float(cal.wake_on_ringer_core or 0.0) if self.shared and not s.bind_cores else 0.0
        self.stack = self.p_stack > 0.0
        self.place = _Noise([seed, 1], uniform=True)
        self.slice_s = sched_slice_s(max(self.cores)) if self.shared else math.inf
        self.idle_w = [0.0] * nodes  # the cores' share the backing-off ranks take (``[Note: idle CPU]``)
        self.rank_cpu = [0.0] * n  # CPU seconds per rank (shared nodes): its part of its node's
        self.rank_cpu_at: list[float] | None = None
        self.iw = [0.0] * n  # this rank's share of it now
        self.iv = [0] * n  # idle versions (work ends a rank's backoff)
        self.spin_s = s.policy.spin_us / 1e6
        self.rate = [1.0] * nodes
        self.t_node = [0.0] * nodes
        self.demand = [0.0] * nodes  # threads that want a core now: computing, spinning, backing off
        self.cpu = [0.0] * nodes  # CPU seconds used so far: min(cores, demand) over time
        self.cpu_at: list[float] | None = None  # ... when the last request was answered (the bench's window)
        self.heap: list[tuple[float, int, int, int, Any]] = []
        self.seq = 0
        self.wait_s = s.policy.max_wait_ms / 1e3
        self.fe_req = cal.frontend_us_per_request / 1e6
        self.fe_msg = cal.frontend_us_per_message / 1e6
        self.fe_pass = cal.frontend_us_per_turn / 1e6  # a turn that admits or takes something, beyond those
        self.c_msg = cal.component_us_per_message / 1e6
        self.c_req = cal.component_us_per_request / 1e6
        same, cross = cal.same_node, cal.link(True)
        self.m_same = same.latency_ms / 1e3
        self.bw_same = same.gb_s * 1e9
        self.m_cross = cross.latency_ms / 1e3
        self.bw_cross = cross.gb_s * 1e9
        p50 = cal.hop
        p90 = cal.hop_p90
        # the hop's spread as a lognormal: sigma from the p90 / p50 ratio at each gap, at most HOP_SIGMA_MAX (a file
        # fitted before [Note: hop spread] may hold one gap's outlier as its p90)
        self._hop = p50
        self._hop_sig = [(g, min(HOP_SIGMA_MAX, max(0.0, math.log(max(b, 1e-9) / max(a, 1e-9)) / 1.2816)))
                         for g, a, b in zip(p50.gaps_ms, p50.values_ms,
                                            [p90.at(g) for g in p50.gaps_ms], strict=True)]
        self._timer = cal.frontend_timer
        self._cross = cal.cross_extra
        self._fe_cold = cal.compute_cold
        self.due_armed = False  # a _DUE event (the oldest request's deadline) is in the heap
        # [Note: evicted caches]: on a node with more ranks than cores, a rank's turn after another rank's work runs
        # cold (its turn's extra: the program's, or a messaging turn's for the frontend), and so does each wake-up of
        # its backoff ([Note: idle CPU])
        self.crowded = [self.shared and len(self.node_ranks[k]) > self.slots[k] for k in range(nodes)]
        plain = self._idle_segments(cal, self.spin_s) if self.shared else ()
        crowd = self._idle_segments(cal, self.spin_s, cal.evicted_us_per_wake / 1e6) if any(self.crowded) else ()
        self.idle_segs = [crowd if self.crowded[k] else plain for k in range(nodes)]
        self.idle_on = any(self.idle_segs)
        self.evicted = [False] * n
        self.ev_s = [r.evicted_ms / 1e3 for r in s.ranks]
        self.ev_s[0] = cal.evicted_us_per_turn / 1e6

    @staticmethod
    def _idle_segments(cal: Calibration, spin_s: float, per_wake_s: float = 0.0) -> tuple[tuple[float, float], ...]:
        """(seconds, share of a core) spans of a rank's backoff after its spin (``[Note: idle CPU]``), each wake-up of
        it costing ``per_wake_s`` more (a crowded node's: ``cpu.evicted_us_per_wake``)."""
        c = cal.idle_cpu
        spin_ms = spin_s * 1e3
        base = [spin_ms, *(g for g in c.gaps_ms if g > spin_ms)]
        rate = [max(0.0, c.at(b) - c.at(a)) / (b - a) for a, b in itertools.pairwise(base)]  # per curve span
        wakes = backoff_wakes_ms(spin_s * 1e6) if per_wake_s > 0 else ()
        starts = (spin_ms, *wakes[:-1])  # the sleep each wake-up ends
        # the curve's CPU spread evenly over each of its spans (as without wake-ups), each wake-up's extra over the
        # sleep it ends; at most a core, what a span cannot take goes into the next
        points = sorted({*base, *wakes})
        out = []
        carry = 0.0
        for a, b in itertools.pairwise(points):
            k = bisect.bisect_right(base, a) - 1  # the curve span (a, b] lies in (none past its last point)
            j = bisect.bisect_left(wakes, b)  # ... and the sleep
            cpu = (rate[k] if k < len(rate) else 0.0) * (b - a) + carry
            if j < len(wakes):
                cpu += per_wake_s * 1e3 * (b - a) / (wakes[j] - starts[j])
            w = min(1.0, cpu / (b - a))
            carry = cpu - w * (b - a)
            out.append(((b - a) / 1e3, w))
        while out and out[-1][1] <= 0.0:
            out.pop()
        return tuple(out)

    # ------------------------------------------------------------------ events and costs
    def push(self, t: float, kind: int, r: int, payload: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, r, payload))

    def hop_extra(self, gap_s: float, cross: bool) -> float:
        """Delay beyond a busy rank's message latency for a rank idle ``gap_s`` (seconds, jittered)."""
        g = gap_s * 1e3
        d = self._hop.at(g) + (self._cross.at(g) if cross else 0.0)
        sig = self._hop_sig[0][1]
        for gg, sg in self._hop_sig:
            if gg <= g:
                sig = sg
        if sig > 0:
            d *= math.exp(sig * self.noise())
        return max(0.0, d / 1e3 - (self.m_cross if cross else self.m_same))

    def send(self, t: float, src: int, dst: int, ids: list[int], nbytes: float, path: float = 0.0) -> None:
        t0 = t
        cross = self.node[src] != self.node[dst]
        if cross:
            t += self.m_cross + nbytes / self.bw_cross
        else:
            t += self.m_same + nbytes / self.bw_same
        self.push(t, _DLV, dst, (ids, cross, path, src, t0))

    def _reschedule(self, node: int, now: float) -> None:
        jobs = self.jobs[node]
        # the ranks on the cores: a computing one with all its threads, a spinning one or one in its turn with one;
        # and the backoffs' share
        threads = sum(j[1] for j in jobs.values()) + (self.used[node] - len(jobs)) + self.idle_w[node]
        self.demand[node] = threads
        if not jobs:
            return
        rate = min(1.0, self.cores[node] / threads) / self.cal.corun(len(jobs))
        self.rate[node] = rate
        for r, j in jobs.items():
            self.jv[r] += 1
            self.push(now + j[0] / rate, _DONE, r, self.jv[r])

    def _advance(self, node: int, now: float) -> None:
        """Bring the node's jobs (and its CPU count) up to ``now``; every change of what runs calls it first, then
        :meth:`_reschedule`."""
        dt = now - self.t_node[node]
        if dt > 0:
            demand = self.demand[node]
            self.cpu[node] += dt * min(self.cores[node], demand)
            if demand > 0:  # each rank's part: its threads computing, a core held, its backoff's share
                f = dt * min(1.0, self.cores[node] / demand)
                jobs, rc, iw, oncore = self.jobs[node], self.rank_cpu, self.iw, self.oncore
                for r in self.node_ranks[node]:
                    j = jobs.get(r)
                    w = (j[1] if j is not None else 1.0 if oncore[r] else 0.0) + iw[r]
                    if w:
                        rc[r] += f * w
        if dt > 0 and self.jobs[node]:
            done = dt * self.rate[node]
            for j in self.jobs[node].values():
                j[0] = max(0.0, j[0] - done)
        self.t_node[node] = now

    def start_job(self, r: int, now: float, work: float, what: Any) -> None:
        self.state[r] = _BUSY
        self.job[r] = (now, what)
        node = self.node[r]
        if self.crowded[node] and work > 0:  # its work pushes the others' out of the caches ([Note: evicted caches])
            ev = self.evicted
            for o in self.node_ranks[node]:
                ev[o] = o != r
        if not self.shared:
            self.jv[r] += 1
            self.push(now + work, _DONE, r, self.jv[r])
            return
        node = self.node[r]
        self._advance(node, now)
        self.jobs[node][r] = [work, float(self.threads[r])]
        self._reschedule(node, now)

    def end_job(self, r: int, now: float) -> Any:
        t0, what = self.job[r]
        self.busy[r] += now - t0
        self.job[r] = None
        if self.shared:
            node = self.node[r]
            self._advance(node, now)
            del self.jobs[node][r]
            self._reschedule(node, now)
        return what

    def spin(self, r: int, now: float) -> None:
        """Nothing left to do: the rank polls back to back for ``spin_us`` (on the core it holds), then sleeps."""
        self.last[r] = now
        if self.spin_s <= 0:
            self._to_idle(r, now)
            return
        self.state[r] = _SPINNING
        self.sv[r] += 1
        self.spin_until[r] = now + self.spin_s
        self.push(now + self.spin_s, _SPIN, r, self.sv[r])

    def backoff(self, r: int, now: float, k: int = 0) -> None:
        """Span ``k`` of rank ``r``'s backoff begins: it takes that span's share of a core (``[Note: idle CPU]``)."""
        seg = self.idle_segs[self.node[r]]
        w = seg[k][1] if k < len(seg) else 0.0
        if w != self.iw[r]:
            node = self.node[r]
            self._advance(node, now)
            self.idle_w[node] += w - self.iw[r]
            self.iw[r] = w
            self._reschedule(node, now)
        if k < len(seg):
            self.push(now + seg[k][0], _IDLEW, r, (self.iv[r], k + 1))

    def wake(self, r: int, now: float) -> None:
        """The rank's turn runs: its backoff (if any) ends."""
        self.iv[r] += 1
        if self.iw[r]:
            node = self.node[r]
            self._advance(node, now)
            self.idle_w[node] -= self.iw[r]
            self.iw[r] = 0.0
            self._reschedule(node, now)

    def schedule(self, r: int, at: float, kind: int) -> None:
        """The rank's next turn is at ``at`` (any turn scheduled before is stale)."""
        self.due[r] = at
        self.state[r] = _SCHEDULED
        self.wk[r] = kind
        self.bound[r] = -1
        self.turn_at[r] = at
        self.tv[r] += 1
        self.push(at, _TURN, r, self.tv[r])

    def turn_now(self, r: int, t: float) -> None:
        """A spinning rank sees the message (or arrival) at once: no wake-up (one that lost its core at a slice's end
        sees it once it has one again)."""
        self.due[r] = t
        self.sv[r] += 1
        if self.shared and not self.oncore[r]:
            self.state[r] = _QUEUED
            self.qwhat[r] = _Q_TURN
        else:
            self.schedule(r, t, _OWN)

    def turn(self, r: int, t: float) -> None:
        """A scheduled turn comes: on a shared node the rank needs a core first (``[Note: run queues]``): any free
        one, or its own (bound, or its wake-up placed on its ringer's core: ``[Note: wake-up placement]``), whose
        holder it preempts if that one only spins."""
        if self.shared and not self.oncore[r]:
            node = self.node[r]
            b = self.pinned[r] if self.pinned[r] >= 0 else self.bound[r]
            h = self.holder[node][b] if b >= 0 else -1
            if h >= 0 and self.state[h] == _SPINNING:  # the spinner waits for its core again, behind this rank
                self._unhold(h, t)
                self._hold(r, t, b)
                self._enqueue(h, _Q_SPIN, t, b)
            elif h >= 0 or (b < 0 and self.used[node] >= self.slots[node]):
                self.state[r] = _QUEUED
                if self.idle_on:  # woken: its backoff ends (a rank waiting for a core does not poll)
                    self.wake(r, t)
                self._enqueue(r, _Q_TURN, t, b)
                return
            else:
                self._hold(r, t, b)
        self._run_turn(r, t)

    def _run_turn(self, r: int, t: float) -> None:
        if self.idle_on:
            self.wake(r, t)
        if r == 0:
            self.fe_turn(t)
        else:
            self.comp_turn(r, t)

    def spin_end(self, r: int, t: float) -> None:
        """The spin ran out (wall-clock, as ``Backoff``'s) without a message: the rank backs off, then sleeps."""
        if self.shared and not self.oncore[r]:  # it ran out while the rank waited for a core: it leaves the queue
            self.runq[self.node[r]].remove(r)
        self._to_idle(r, t)

    def _to_idle(self, r: int, t: float) -> None:
        """The rank sleeps: it gives up its core (if it holds one) and backs off."""
        self.state[r] = _IDLE
        self.sv[r] += 1
        if self.shared:
            self._release(r, t)
        if self.idle_on:
            self.backoff(r, t)

    # ------------------------------------------------------------------ run queues ([Note: run queues])
    def _hold(self, r: int, t: float, core: int = -1) -> None:
        """Rank ``r`` takes a free core of its node: ``core``, or (-1) the one it last held if free, else the first
        free."""
        node = self.node[r]
        self._advance(node, t)
        held = self.holder[node]
        if core < 0:
            core = self.core[r] if 0 <= self.core[r] < len(held) and held[self.core[r]] < 0 else held.index(-1)
        held[core] = r
        self.core[r] = core
        self.oncore[r] = True
        self.used[node] += 1
        self.runv[r] += 1
        self.held_since[r] = t
        if self.runq[node]:
            self.armed[r] = self.runv[r]
            self.push(t + self.slice_s, _SLICE, r, self.runv[r])
        self._reschedule(node, t)

    def _unhold(self, r: int, t: float) -> None:
        """Rank ``r`` gives up the core it holds (the node brought up to ``t`` first)."""
        node = self.node[r]
        self._advance(node, t)
        self.oncore[r] = False
        self.used[node] -= 1
        self.runv[r] += 1
        self.holder[node][self.core[r]] = -1
        self._reschedule(node, t)

    def _release(self, r: int, t: float) -> None:
        """Rank ``r`` sleeps: its core goes to the first rank waiting for one."""
        if not self.oncore[r]:
            return
        self._unhold(r, t)
        self._dispatch(self.node[r], t, self.core[r])

    def _enqueue(self, r: int, what: int, t: float, core: int = -1) -> None:
        node = self.node[r]
        self.qwhat[r] = what
        self.qcore[r] = core
        self.runq[node].append(r)
        if core >= 0 and self.stack and not self.bal_armed[node] and self.used[node] < self.slots[node]:
            self.bal_armed[node] = True  # it waits for a held core while one is idle: the next tick moves it
            self.push((math.floor(t / BALANCE_TICK_S) + 1) * BALANCE_TICK_S, _BAL, node)
        for o in self.node_ranks[node]:  # whoever holds a core here now has a slice's end
            if self.oncore[o] and self.armed[o] != self.runv[o]:
                self.armed[o] = self.runv[o]
                self.push(max(t, self.held_since[o] + self.slice_s), _SLICE, o, self.runv[o])

    def _next_waiting(self, node: int) -> int:
        """The first rank in the node's run queue that a free core can take (one waiting for a core held by another
        rank stays), or -1."""
        if self.used[node] >= self.slots[node]:
            return -1
        held = self.holder[node]
        for i, r in enumerate(self.runq[node]):
            if self.qcore[r] < 0 or held[self.qcore[r]] < 0:
                del self.runq[node][i]
                return r
        return -1

    def _pull(self, node: int, core: int) -> int:
        """A core that fell idle with no rank waiting for it takes the first rank waiting for another core that
        may move (not a bound one), as the kernel's balancing of a newly idle core does (``[Note: wake-up
        placement]``); -1 when none waits."""
        q = self.runq[node]
        for i, r in enumerate(q):
            if self.pinned[r] < 0:
                del q[i]
                self.qcore[r] = core
                return r
        return -1

    def _dispatch(self, node: int, t: float, freed: int = -1) -> None:
        """Free cores go to the waiting ranks, first come first (``[Note: run queues]``); ``freed``, the core that
        fell idle, pulls a rank waiting for another core when none waits for it."""
        while (r := self._next_waiting(node)) >= 0 or (
                freed >= 0 and self.holder[node][freed] < 0 and (r := self._pull(node, freed)) >= 0):
            self._resume(node, r, t)

    def _balance(self, node: int, t: float) -> None:
        """The scheduler's tick: each idle core pulls a rank waiting for a held core (``[Note: wake-up
        placement]``)."""
        self.bal_armed[node] = False
        held = self.holder[node]
        for k in range(len(held)):
            if held[k] < 0 and (r := self._pull(node, k)) >= 0:
                self._resume(node, r, t)

    def _resume(self, node: int, r: int, t: float) -> None:
        """Rank ``r``, taken off the run queue, has its core (``qcore``, or any free one) and goes on."""
        what = self.qwhat[r]
        self._hold(r, t, self.qcore[r])
        if what == _Q_TURN:
            self.state[r] = _SCHEDULED
            self._run_turn(r, t)
        elif what == _Q_JOB:  # (_hold brought the node up to t)
            self.jobs[node][r] = [self.qwork[r], float(self.threads[r])]
            self._reschedule(node, t)
        elif self.inbox[r] or (r == 0 and self._fe_has_work(t)):  # a spinner back on a core polls
            self.sv[r] += 1
            self.state[r] = _SCHEDULED
            self.wk[r] = _OWN
            self._run_turn(r, t)
        elif t >= self.spin_until[r]:
            self._to_idle(r, t)

    def _fe_has_work(self, t: float) -> bool:
        return (self.nxt < len(self.arr) and self.arr[self.nxt] <= t
                and self.inflight < self.s.policy.max_inflight)

    def slice_end(self, r: int, t: float, version: int) -> None:
        """Rank ``r`` has held its core a slice: if a rank waits for that core (or for any) it goes to the back of
        the queue, and waits for any core (its own when bound: ``[Note: wake-up placement]``)."""
        node = self.node[r]
        if version != self.runv[r]:
            return
        self.armed[r] = -1
        mine = self.core[r]
        if not any(self.qcore[o] < 0 or self.qcore[o] == mine for o in self.runq[node]):  # none waits for its core
            return
        if self.state[r] == _BUSY and r in self.jobs[node]:
            self._advance(node, t)
            self.qwork[r] = self.jobs[node].pop(r)[0]
            self.jv[r] += 1  # its end moves
            what = _Q_JOB
        elif self.state[r] == _SPINNING:
            what = _Q_SPIN  # (its spin so far counts as CPU before it leaves the core)
        else:
            if self.state[r] == _SCHEDULED:  # its turn runs at this instant: the slice ends once it has
                self.armed[r] = self.runv[r]
                self.push(max(t, self.turn_at[r]), _SLICE, r, self.runv[r])
            return
        self._unhold(r, t)
        self._enqueue(r, what, t, self.core[r] if self.pinned[r] >= 0 else -1)
        self._dispatch(node, t, self.core[r])

    def ring(self, r: int, t: float, cross: bool, src: int = -1) -> None:
        """A message reached rank ``r`` at ``t`` from rank ``src``: a polling rank takes it now, a sleeping one when
        the hop delay of its idle gap has passed, unless its timer ends the sleep sooner; the wake-up runs on the
        ringer's core with the calibrated share (``[Note: wake-up placement]``)."""
        st = self.state[r]
        if st == _SPINNING:
            self.turn_now(r, t)
        elif st == _IDLE or (st == _SCHEDULED and self.wk[r] == _TIMER):
            at = t + self.hop_extra(t - self.last[r], cross)
            if st == _IDLE or at < self.turn_at[r]:
                self.schedule(r, at, _RING)
                if self.stack and not cross and src >= 0 and self.place() < self.p_stack:
                    self.bound[r] = self.core[src]

    def fe_timer(self, t: float) -> None:
        """The frontend's sleep is timed to end at ``t`` (an arrival, a deadline): it runs the timer's lag later,
        unless a ring ends the sleep sooner."""
        st = self.state[0]
        if st == _SPINNING:
            self.turn_now(0, t)
        elif st == _IDLE or (st == _SCHEDULED and self.wk[0] == _RING):
            at = t + self._timer.at((t - self.last[0]) * 1e3) / 1e3
            if st == _IDLE or at < self.turn_at[0]:
                self.schedule(0, at, _TIMER)

    def arm_deadline(self, t: float) -> None:
        """The frontend goes idle: it wakes when its oldest request in flight passes ``request_timeout_s``
        (``Frontend.run``'s sleep is bounded by that deadline)."""
        order, status = self.order, self.status
        while order and status[order[0]] != STATUS_PENDING:
            order.popleft()
        if self.due_armed or not order:
            return
        a = self.arr[order[0]]
        due = a + self.timeout
        while due - a <= self.timeout:  # the first time the scan counts it expired (``now - arrival > timeout``)
            due = math.nextafter(due, math.inf)
        self.due_armed = True
        self.push(max(due, t), _DUE, 0)  # (it may have passed during the turn that ends now)

    # ------------------------------------------------------------------ the loop
    def run(self, arr: np.ndarray) -> SimRun:
        s = self.s
        n_req = len(arr)
        self.arr = arr.tolist()
        self.admit = [math.nan] * n_req
        self.done = [math.nan] * n_req
        self.path = [0.0] * n_req
        self.status = [STATUS_PENDING] * n_req
        self.routes: list[tuple[int, ...]] = [()] * n_req
        self.missing = [0] * n_req
        self.nxt = 0  # arrivals so far
        self.adm = 0  # next request to admit
        self.inflight = 0
        self.order: deque[int] = deque()  # admitted requests in admission order (timeout scan)
        self.router = ReplicaRouter([c.replicas for c in s.components], {r.rank: r.size for r in s.ranks})
        self.timeout = s.policy.request_timeout_s
        if n_req:
            self.push(self.arr[0], _ARR, 0, 0)
        events = 0
        heap = self.heap
        pop = heapq.heappop
        while heap:
            t, _, kind, r, payload = pop(heap)
            events += 1
            if kind == _DLV:
                ids, cross, path, src, sent = payload
                self.inbox[r].append((ids, path))
                if self.hops is not None:
                    self.sent[r].append((src, sent, len(ids), t, self.state[r] == _BUSY))
                self.ring(r, t, cross, src)
            elif kind == _DONE:
                if payload == self.jv[r] and self.job[r] is not None:
                    if r == 0:
                        self.fe_done(t)
                    else:
                        self.comp_done(r, t)
            elif kind == _SPIN:
                if payload == self.sv[r] and self.state[r] == _SPINNING:
                    self.spin_end(r, t)
            elif kind == _TURN:
                if payload == self.tv[r] and self.state[r] == _SCHEDULED:
                    self.turn(r, t)
            elif kind == _SLICE:
                self.slice_end(r, t, payload)
            elif kind == _BAL:  # (r: the node)
                self._balance(r, t)
            elif kind == _ARR:  # arrival ``payload`` (a frontend's turn at that instant may have seen it already)
                self.nxt = max(self.nxt, payload + 1)
                if self.nxt < n_req:
                    self.push(self.arr[self.nxt], _ARR, 0, self.nxt)
                if self.inflight < s.policy.max_inflight:
                    self.fe_timer(t)
            elif kind == _IDLEW:  # the next span of a rank's backoff (unless work ended it)
                if payload[0] == self.iv[r]:
                    self.backoff(r, t, payload[1])
            else:  # _DUE: the oldest request's deadline (a busy frontend scans when its turn ends)
                self.due_armed = False
                if self.state[0] != _BUSY:
                    order = self.order
                    while order and self.status[order[0]] != STATUS_PENDING:
                        order.popleft()
                    if order and t - self.arr[order[0]] > self.timeout:
                        self.fe_timer(t)  # its turn's scan fails it; the frontend's next sleep arms the next
                    else:
                        self.arm_deadline(t)  # the one armed for finished: the oldest still in flight
        done = np.asarray(self.done)
        path = np.where(np.isfinite(done), np.asarray(self.path) * 1e3, np.nan)
        return SimRun(arr, np.asarray(self.admit), done, np.asarray(self.status, dtype=np.int8),
                      np.asarray(self.busy), events, np.asarray(self.cpu_at or self.cpu), path,
                      np.asarray(self.rank_cpu_at or self.rank_cpu))

    # ------------------------------------------------------------------ the frontend
    def fe_turn(self, t: float) -> None:
        s = self.s
        pol = s.policy
        out: dict[tuple[int, int], list[int]] = {}
        n_adm = 0
        arr, status, timeout = self.arr, self.status, self.timeout
        while self.nxt < len(arr) and arr[self.nxt] <= t:  # every request arrived by now (``arrivals <= now``)
            self.nxt += 1
        while self.adm < self.nxt and self.inflight < pol.max_inflight and n_adm < pol.max_admit:
            i = self.adm
            self.adm += 1
            if t - arr[i] > timeout:
                status[i] = STATUS_TIMEOUT
                continue
            route = self.router.assign()
            self.routes[i] = route
            self.admit[i] = t
            self.missing[i] = s.n_outputs
            self.inflight += 1
            self.order.append(i)
            n_adm += 1
            for ci, _ in s.entry:
                out.setdefault((ci, route[ci]), []).append(i)
        finished: list[int] = []
        n_in = len(self.inbox[0])
        path = self.path
        for ids, p in self.inbox[0]:
            for i in ids:
                if status[i] == STATUS_PENDING and self.missing[i] > 0:
                    self.missing[i] -= 1
                    path[i] = max(path[i], p)
                    if self.missing[i] == 0:
                        finished.append(i)
        self.inbox[0] = []
        if self.hops is not None:
            self._taken(0, t)
        order = self.order
        n_late = 0
        while order and (status[order[0]] != STATUS_PENDING or t - arr[order[0]] > timeout):
            i = order.popleft()
            if status[i] == STATUS_PENDING and self.missing[i] > 0:
                status[i] = STATUS_TIMEOUT
                self.router.release(self.routes[i], failed=True)
                self.inflight -= 1
                n_late += 1
        # the frontend's Python and torch calls after a sleep run cold, as a small program does (compute_cold)
        cold = self._fe_cold.at((t - self.last[0]) * 1e3) / 1e3 if self.wk[0] != _OWN else 0.0
        if self.evicted[0] and (n_adm or n_in or n_late):
            cold = max(cold, self.ev_s[0])
        self.wk[0] = _OWN
        # (a turn that admits, takes or fails something is a working pass of the runtime's loop: it pays its own CPU)
        work = (self.fe_req * n_adm + self.fe_msg * (n_in + len(out)) + cold
                + (self.fe_pass if n_adm or n_in or n_late else 0.0))
        self.start_job(0, t, work, (out, finished))

    def fe_done(self, t: float) -> None:
        out, finished = self.end_job(0, t)
        s = self.s
        bytes_of = dict(s.entry)
        for (ci, rank), ids in out.items():
            self.send(t, 0, rank, ids, bytes_of[ci] * len(ids))
        arr, status = self.arr, self.status
        for i in finished:
            if status[i] != STATUS_PENDING:
                continue
            self.inflight -= 1
            if t - arr[i] > self.timeout:
                status[i] = STATUS_TIMEOUT
                self.router.release(self.routes[i], failed=True)
            else:
                status[i] = STATUS_OK
                self.done[i] = t
                self.router.release(self.routes[i])
        self.last[0] = t
        if self.cpu_at is None and self.adm == len(arr) and not self.inflight:  # every request answered
            for node in range(len(self.cpu) if self.shared else 0):
                self._advance(node, t)
            self.cpu_at = list(self.cpu)
            self.rank_cpu_at = list(self.rank_cpu)
        if self.inbox[0] or (self.adm < self.nxt and self.inflight < s.policy.max_inflight):
            self.state[0] = _SCHEDULED
            self.due[0] = t
            self.fe_turn(t)
        else:
            self.spin(0, t)
            self.arm_deadline(t)

    # ------------------------------------------------------------------ a component replica
    def _taken(self, r: int, t: float) -> None:
        """Log the messages rank ``r``'s turn at ``t`` took (``simulate``'s ``hops``)."""
        ranks = self.s.ranks
        assert self.hops is not None
        due = min(self.due[r], t)
        for src, sent, n, dlv, busy in self.sent[r]:
            before = max(0.0, due - dlv)  # the receiver's work, or its sleep, after the message came
            self.hops.append((ranks[src].rank, ranks[r].rank, sent, t, n, dlv, before if busy else 0.0,
                              0.0 if busy else before))
        self.sent[r] = []

    def comp_turn(self, r: int, t: float) -> None:
        self.wk[r] = _OWN
        c = self.comp[r]
        need = self.need[c]
        ready = self.ready[r]
        n_in = len(self.inbox[r])
        n_before = len(ready)
        pin = self.pin[r]
        if need == 1:
            for ids, p in self.inbox[r]:
                for i in ids:
                    ready.append((t, i))
                    pin[i] = p
        else:
            cnt = self.count[r]
            for ids, p in self.inbox[r]:
                for i in ids:
                    if p > pin.get(i, -1.0):
                        pin[i] = p
                    k = cnt.get(i, 0) + 1
                    if k >= need:
                        cnt.pop(i, None)
                        ready.append((t, i))
                    else:
                        cnt[i] = k
        self.inbox[r] = []
        if self.hops is not None:
            self._taken(r, t)
        bs = self.bs[r]
        if ready and (len(ready) >= bs or t - ready[0][0] >= self.wait_s):
            b = min(bs, len(ready))
            if self.trace is not None:
                self.trace.append((r, t, [x[1] for x in list(ready)[n_before:]], [x[1] for x in list(ready)[:b]]))
            ids = [ready.popleft()[1] for _ in range(b)]
            lat = self.lat[r]
            comp = lat[b - 1] if b <= len(lat) else lat[-1] * b / len(lat)
            sig = self.sigma[r]
            if sig > 0:
                comp *= math.exp(sig * self.noise())
            cold = self.cold[r].at((t - self.ran[r]) * 1e3) / 1e3  # since the program last ran
            comp += max(cold, self.ev_s[r]) if self.evicted[r] else cold
            sends = self.outputs(c, ids)
            work = comp + self.c_msg * (n_in + self.owed[r] + len(sends)) + self.c_req * b
            self.owed[r] = 0
            # [Note: critical path in the run]: the batch's messages carry its longest input path + its compute
            self.start_job(r, t, work, (sends, max([pin.pop(i) for i in ids]), comp / work if work > 0 else 0.0))
            return
        self.last[r] = t
        self.owed[r] += n_in
        if self.trace is not None:
            self.trace.append((r, t, [x[1] for x in list(ready)[n_before:]], []))
        if ready:  # a batch waits for max_wait_ms: the rank sleeps until then (or a message rings it)
            self.wait_for_batch(r, t)
        else:
            self.spin(r, t)

    def wait_for_batch(self, r: int, t: float) -> None:
        """The rank sleeps until the oldest waiting request's ``max_wait_ms`` (or a message rings it)."""
        if self.shared:
            self._release(r, t)
        t0 = self.ready[r][0][0]
        due = t0 + self.wait_s
        while due - t0 < self.wait_s:  # the first time the batch is due in floating point (Batcher.due's test)
            due = math.nextafter(due, math.inf)
        self.schedule(r, due, _TIMER)

    def outputs(self, c: int, ids: list[int]) -> list[tuple[int, list[int], float]]:
        """A batch's messages: ``(rank, requests, bytes)``, one per destination replica on the requests' routes
        (``component._send_outputs``)."""
        routes = self.routes
        out: list[tuple[int, list[int], float]] = []
        for dc, nbytes in self.sinks[c]:
            if dc < 0:
                out.append((0, ids, nbytes * len(ids)))
                continue
            groups: dict[int, list[int]] = {}
            for i in ids:
                groups.setdefault(routes[i][dc], []).append(i)
            out.extend((dst, g, nbytes * len(g)) for dst, g in groups.items())
        return out

    def comp_done(self, r: int, t: float) -> None:
        t0 = self.job[r][0]
        sends, path, share = self.end_job(r, t)
        path += (t - t0) * share  # the compute's part of the job's wall time (as the runtime times the program call)
        for dst, ids, nbytes in sends:
            self.send(t, r, dst, ids, nbytes, path)
        self.last[r] = self.ran[r] = t
        ready = self.ready[r]
        if self.inbox[r] or (ready and (len(ready) >= self.bs[r] or t - ready[0][0] >= self.wait_s)):
            self.state[r] = _SCHEDULED
            self.due[r] = t
            self.comp_turn(r, t)
        elif ready:
            self.wait_for_batch(r, t)
        else:
            self.spin(r, t)
