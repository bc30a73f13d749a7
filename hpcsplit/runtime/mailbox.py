"""The rank loops' mailboxes: nonblocking receive of whole messages, outstanding sends, idle backoff.

Used by the frontend and the component loop; built on :mod:`transport`.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

import torch

from hpcsplit.core.mpi import MPI
from hpcsplit.core.policy import BACKOFF_FIRST_S, BACKOFF_MAX_S, QUIET_AFTER_S
from hpcsplit.runtime.transport import Message, RecvHandle, SendHandle, take_message, wait_polling

ANY_SOURCE = MPI.ANY_SOURCE

__all__ = ["IN_FLIGHT_SLEEP_S", "Backoff", "Inbox", "Outbox", "install_doorbell", "ring"]

IN_FLIGHT_SLEEP_S = 50e-6
SPIN_S = 50e-6  # a rank polls back to back this long after work before it backs off (runtime.spin_us)
SERVER_SPIN_S = 2e-3  # ... in server mode, when the node has a core for each of the job's ranks on it
DOORBELL_MIN_SLEEP_S = 100e-6  # shorter sleeps are plain time.sleep (no flag, no select)
DOORBELL_DEEP_SLEEP_S = 10e-3  # deep backoff sleep when every rank of the job is on this node (all can ring)
DOORBELL_QUIET_SLEEP_S = 100e-3  # quiet sleep when every rank of the job is on this node (all ring via flags)
DOORBELL_UDP_SLEEP_S = 20e-3  # quiet sleep when some senders ring over UDP (and this rank got its test ring)
# QUIET_AFTER_S: a quiet rank backs off as usual this long (a stream's next message is near), then sleeps on its
# doorbell; with the backoff's first and longest sleeps it is defined in core.policy, which the simulator reads

_DOORBELL: Any = None  # this rank's runtime.doorbell.Doorbell, when the runtime installed one


def install_doorbell(db: Any) -> None:
    """Make idle sleeps end when another rank rings (None: plain sleeps again)."""
    global _DOORBELL
    _DOORBELL = db


def ring(dest: int) -> None:
    """After a send to ``dest``: wake it if it sleeps (no-op without a doorbell)."""
    if _DOORBELL is not None:
        _DOORBELL.ring(dest)


def spin_after_work_s(spin_us: float | None, mode: str | None, local_ranks: int,
                      cores: int | None = None) -> float:
    """How long a rank polls back to back after work before it backs off (``runtime.spin_us``; null: this).

    [Note: spin after work]
    A rank that found no work spins ``SPIN_S`` (50 us), then sleeps 20 us doubling, and from 100 us on
    sleeps on the doorbell until a sender rings.  In batch and bench mode that is right: the next message
    is either near (a stream) or far, and a spinning rank takes a core from ranks that compute.  A server
    answering clients one request at a time is the other case: the client's next request comes a few
    hundred microseconds after its answer, when every rank has just gone to sleep, and each wake-up from
    a sleep costs this 2-core VM 100-300 us (the woken rank also runs its first calls cold: a Linear(8, 8)
    took 113 us after a sleep and 43 us hot).  So in server mode, when this node has a core for each of
    the job's ranks on it, a rank spins ``SERVER_SPIN_S`` (2 ms) after work, yielding the core between
    polls past the first ``SPIN_S`` (``os.sched_yield``: a process with work on that core, a component or
    a client, runs first, and the spin takes only idle time); with more ranks than cores
    (a split CLIP on 2 cores) spinning would take the cores the components compute on, and it stays 50 us.
    ``python -m hpcsplit.bench server`` measured the trivial model's p50 at concurrency 1 at 0.88-0.95 ms
    with it and 1.19-1.24 ms without; a quiet server still sleeps (it spins only after work), and the
    server's frontend, with nothing in flight, waits on its event loop at once (``ServeLoop.pause``: a
    client's request wakes it there).

    Examples
    --------
    >>> spin_after_work_s(None, "batch", 2, cores=2), spin_after_work_s(None, "server", 2, cores=2)
    (5e-05, 0.002)
    >>> spin_after_work_s(None, "server", 5, cores=2), spin_after_work_s(0, "server", 2, cores=2)
    (5e-05, 0.0)
    """
    if spin_us is not None:
        return spin_us / 1e6
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return SERVER_SPIN_S if mode == "server" and local_ranks <= cores else SPIN_S


class Backoff:
    """Idle policy of a rank loop: spin ``spin_s``, then sleep 20 us doubling to ``max_sleep_s``; after
    ``deep_after_s`` without work the ceiling becomes ``deep_sleep_s``.

    Call :meth:`reset` whenever the loop did work and :meth:`idle` when it found none.  A rank idle for
    long wakes ``1 / deep_sleep_s`` times a second for an ``Iprobe`` instead of spinning a whole core in
    MPICH's blocking ``Recv``; the price is at most ``deep_sleep_s`` of added latency when work arrives,
    unless a doorbell is installed (:func:`install_doorbell`): then a sender wakes it at once and, when
    the whole job is on this node, the deep sleep grows to ``DOORBELL_DEEP_SLEEP_S`` (UDP rings from
    other nodes are not counted on for that).
    """

    __slots__ = ("_since", "_sleep", "deep_after_s", "deep_sleep_s", "max_sleep_s", "spin_s", "yielding")

    def __init__(self, spin_s: float = SPIN_S, max_sleep_s: float = BACKOFF_MAX_S, deep_sleep_s: float = 2e-3,
                 deep_after_s: float = 0.05) -> None:
        self.spin_s, self.max_sleep_s = spin_s, max_sleep_s
        self.deep_sleep_s, self.deep_after_s = max(deep_sleep_s, max_sleep_s), deep_after_s
        self._since: float | None = None
        self._sleep = BACKOFF_FIRST_S
        self.yielding = False  # the last plan was a spin past SPIN_S: the caller yields the core between polls

    def reset(self) -> None:
        self._since = None
        self._sleep = BACKOFF_FIRST_S

    def idle(self, now: float, wake_at: float | None = None, in_flight: bool = False, quiet: bool = False) -> None:
        """Spin or sleep once; never past ``wake_at`` (a perf_counter time) if given.

        ``in_flight``: a message is half-way (payload posted, or a large send not yet taken).  MPICH
        moves large shared-memory messages only while *both* ranks call into MPI, so then sleep at most
        ``IN_FLIGHT_SLEEP_S``: a deep sleep on either side would stall the copy.

        ``quiet``: nothing of this rank's is on the way (no receive posted, no send pending), so only a
        new message can give it work.  When every sender can ring it, after ``QUIET_AFTER_S`` of the usual
        backoff (in a stream the next message is near, and a ring costs more than a short sleep) it sleeps
        the doorbell's ``quiet_sleep_s`` (``DOORBELL_QUIET_SLEEP_S``, 100 ms, when the whole job is on this
        node; ``DOORBELL_UDP_SLEEP_S``, 20 ms, when some senders ring over UDP) instead of backing off on:
        a backoff wakes a rank some 30 times in the 50 ms after every message, and on a node whose cores
        are all computing each wake-up takes a core from a component for a moment (the compute ranks
        of a 2-core VM were switched out 45 times per 150 ms batch; ``[Note: doorbell]``).
        """
        s, on_bell = self.plan(now, wake_at, in_flight, quiet)
        if s <= 0:
            if self.yielding:
                os.sched_yield()
            return
        db = _DOORBELL
        if on_bell:
            # the probe after raising the flag catches a message sent just before it went up
            # (its sender saw no flag and rang nobody)
            if db.sleep(s, db.probe_header):  # a message is waiting: poll back to back again
                self.reset()  # (the next poll takes it; a rung rank must not wait one more sleep)
        else:
            time.sleep(s)

    def plan(self, now: float, wake_at: float | None = None, in_flight: bool = False,
             quiet: bool = False) -> tuple[float, bool]:
        """The next idle pause as :meth:`idle` would take it: ``(seconds, on the doorbell)``; 0 seconds: spin.

        The backoff moves on as if the pause were taken (a caller that waits its own way, such as the
        server's event loop, calls :meth:`reset` when it is woken early by work).
        """
        if self._since is None:
            self._since = now
        idle_for = now - self._since
        if idle_for < self.spin_s:
            # a long spin (runtime.spin_us) yields the core between polls once past SPIN_S, so a rank that
            # has work on this core (a component, a client) runs first and the spin only takes idle time
            self.yielding = idle_for >= SPIN_S
            return 0.0, False
        self.yielding = False
        db = _DOORBELL
        quiet_s = (db.quiet_sleep_s if quiet and not in_flight and db is not None and idle_for >= QUIET_AFTER_S
                   else None)
        s = quiet_s or (min(self._sleep, IN_FLIGHT_SLEEP_S) if in_flight else self._sleep)
        if wake_at is not None:
            s = min(s, max(0.0, wake_at - now))
        if not quiet_s:  # a quiet sleep leaves the backoff where it was
            deep = idle_for > self.deep_after_s
            ceiling = self.deep_sleep_s if deep else self.max_sleep_s
            if deep and db is not None and db.all_local:
                # every sender can ring us: sleep longer (a missed ring, a rare race, costs this much once)
                ceiling = max(ceiling, DOORBELL_DEEP_SLEEP_S)
            self._sleep = min(self._sleep * 2, ceiling)
        return s, s > 0 and db is not None and not in_flight and s >= DOORBELL_MIN_SLEEP_S


class Inbox:
    """Receives every incoming message without blocking: first messages matched, payloads posted and tested.

    Messages come out in the order they arrived from each source (a message that arrived whole waits
    behind an earlier one of the same source that is still being received); ``pending`` holds the ones
    not yet handed out.
    """

    def __init__(self, comm: Any, device: torch.device | None = None, max_new: int = 256) -> None:
        self.comm, self.device, self.max_new = comm, device, max_new
        self.pending: list[RecvHandle] = []
        self._status = MPI.Status()
        self._first: set[int] = set()  # sources whose latest first message is still arriving (take_message)

    def poll(self) -> list[tuple[Message, float]]:
        """Messages completed since the last call, with the time their first message arrived.

        [Note: probing past misses]
        MPICH (ch4, shared memory) moves one waiting message into its queues per probe and matches
        before it moves, so a header that sits behind ``k`` payload messages (of headers matched
        earlier, from any sender) shows up at the ``k + 1``-th probe.  Stopping at the first miss took
        one message per two calls, and a component that polls once between batches ran batch after
        batch of one request however many were waiting.  So a poll keeps probing until ``2 + owed``
        probes in a row find nothing, ``owed`` being the receives still outstanding of every message
        taken but not complete (their payloads may still be ahead in the queue): two probes when idle.
        At most ``max_new`` messages are taken per call.
        """
        pending = self.pending
        owed = 0
        for h in pending:
            owed += len(h.requests)
        comm, device, st, first, now = self.comm, self.device, self._status, self._first, time.perf_counter
        done: list[tuple[Message, float]] = []
        misses = hits = 0
        while hits < self.max_new:
            got = take_message(comm, device, ANY_SOURCE, st, first)
            if got is None:
                misses += 1
                if misses >= 2 + owed:
                    break
                continue
            misses = 0
            hits += 1
            if isinstance(got, RecvHandle):
                owed += len(got.requests)
                pending.append(got)
                if got.header is None:
                    first.add(got.source)
            elif pending:  # behind what is still arriving (the sweep below keeps each source's order)
                pending.append(RecvHandle(got.source, got.header, [], [], None, now(), got))
            else:
                done.append((got, now()))
        if not pending:
            return done
        # test in the order taken; a source's messages come out in its order, and a message is not
        # decoded (its payloads not posted) while its source's previous first message is still arriving
        still: list[RecvHandle] = []
        waiting: set[int] = set()  # sources with an earlier message not complete
        first.clear()
        for h in pending:
            src = h.source
            m = None if src in first else h.test()
            if m is None or src in waiting:
                still.append(h)
                waiting.add(src)
                if h.header is None:
                    first.add(src)
            else:
                done.append((m, h.t_start))
        self.pending = still
        return done

    def forget(self, ranks: set[int]) -> None:
        """Drop the half-received messages from ``ranks`` (lost: their payloads never come).

        Their posted receives are cancelled first: a payload that came after all must not land in a
        buffer the pool has handed out again.
        """
        for h in self.pending:
            if h.source in ranks:
                h.cancel()
        self.pending = [h for h in self.pending if h.source not in ranks]
        self._first -= ranks


class Outbox:
    """Outstanding sends; :meth:`reap` drops the finished ones (their tensors may then be freed).

    Sends finish roughly in the order they started, so :meth:`reap` tests from the oldest and stops
    at the first unfinished one (a full sweep every 64 calls catches out-of-order completions).

    A send that was still pending when added rings its destination again when it completes: MPICH may
    hold a message back when the receiver's queue is full and deliver it later, from a progress call of
    ours, so the ring at :meth:`add` may have come before the message could be seen; a rank that found
    nothing after that ring may sleep until its timeout (``[Note: doorbell]``).
    """

    def __init__(self) -> None:
        self.pending: deque[tuple[SendHandle, int | None]] = deque()
        self._calls = 0
        self.t_last_add = 0.0

    def add(self, h: SendHandle, dest: int | None = None) -> None:
        """Keep ``h`` until it completes; ``dest`` (its destination) is rung if it sleeps on this node."""
        done = h.test()  # first: a message MPICH held back may go out in this call, before the ring
        if dest is not None:
            ring(dest)
        if not done:
            self.pending.append((h, dest))
            self.t_last_add = time.perf_counter()

    def in_flight(self, now: float, window_s: float = 0.02) -> bool:
        """Sends pending that started within ``window_s``: the receiver is probably taking them now.

        (A send still pending after that waits for a busy receiver; no need to keep polling fast.)
        """
        return bool(self.pending) and now - self.t_last_add < window_s

    @staticmethod
    def _open(item: tuple[SendHandle, int | None]) -> bool:
        """Whether the send is still pending; when it has just completed, ring its destination."""
        if not item[0].test():
            return True
        if item[1] is not None:
            ring(item[1])
        return False

    def reap(self) -> int:
        p = self.pending
        while p and not self._open(p[0]):
            p.popleft()
        self._calls += 1
        if len(p) > 1 and self._calls % 64 == 0:
            self.pending = p = deque(x for x in p if self._open(x))
        return len(p)

    def forget(self, ranks: set[int]) -> None:
        """Stop waiting for the sends to ``ranks`` (lost: they are never received)."""
        self.pending = deque(x for x in self.pending if x[1] not in ranks)

    def drain(self, timeout_s: float | None = None) -> bool:
        def _all() -> bool:
            self.pending = deque(x for x in self.pending if self._open(x))
            return not self.pending

        return wait_polling(_all, timeout_s)
