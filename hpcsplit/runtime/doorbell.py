"""Wake a sleeping rank on the same node when a message is sent to it (see ``[Note: doorbell]``).

[Note: doorbell]
An idle rank may not spin (seed ``000``: spinning waits cost the compute ranks beside them 25-49%), so it
sleeps between polls, up to ``runtime.idle_sleep_ms`` (2 ms).  MPI cannot wake a sleeping process: the
sleep ends on its own, after 2 ms plus timer slack plus however long the scheduler takes to give the
rank a core its neighbours are computing on -- about 3 ms a hop measured on the 2-core VM, three hops
(frontend -> vision -> head -> frontend) for CLIP.  So a rank that goes to sleep raises its flag in a
byte array shared by the node's ranks (``MPI.Win.Allocate_shared``) and sleeps in ``select`` on a
datagram socket of its own (Linux abstract namespace: no file, gone with the process); a sender on the
same node that sees the flag up after its ``Isend`` writes one byte to that socket, which ends the sleep
at once.  Busy ranks have their flag down, so the common case costs a sender one byte read.

The flag and the message must not cross: the receiver raises its flag, then probes; the sender posts the
message, then reads the flag.  Each side stores, then loads, and a CPU may let the load pass the store
(x86 and Arm do), so both could miss -- no ring, and the sleeper wakes only at its timeout.  So each
side fences between the two.  ``MPI_Win_sync`` on the flags' window is the MPI way (the window stays in
one ``Lock_all`` epoch for the run); MPICH makes it ``atomic_thread_fence(acq_rel)``, which is a full
``dmb ish`` on Arm but no instruction at all on x86.  On x86 the full fence is the locked instruction of
the GIL's mutex, which mpi4py releases and takes around every MPI call: the sleeper's probe and the
sender's ``Isend`` both sit between its store and its load.  A free-threaded Python has no GIL, so there
quiet sleeps stay at ``DOORBELL_DEEP_SLEEP_S`` (10 ms).  Then either the probe sees the message or the
sender sees the flag, and a quiet rank of a one-node job can sleep long (``DOORBELL_QUIET_SLEEP_S`` in
:mod:`~hpcsplit.runtime.mailbox`, 100 ms) without a message waiting that long.  A sleep still ends at
its timeout, so anything that slipped through costs at most one such sleep.  One thing that could:
MPICH holds a send back when the receiver's queue is full and delivers it from a later progress call
of the sender's, after the ring; so ``Outbox`` rings again when a send that was still pending completes.

Ranks on other nodes (``runtime.doorbell: true``; ``local`` rings node-local ranks only): their flags
cannot be read, so every send to one is followed by a one-byte UDP datagram to its doorbell port
(a ``sendto`` of a few microseconds, beside a network message).  Each rank binds a UDP socket to its
node's address (on ``runtime.doorbell_network``, an interface or IPv4 network, else on
``$HPCSPLIT_DOORBELL_NETWORK`` -- a cluster preset's ``slurm.setup`` exports it, as ``cluster=dev2`` does for
the dev cluster's bridge --, else what the hostname resolves to; a loopback address does not count) and publishes it with an ``Allgather`` at start; then
each rank sends one test ring to the next rank on another node and waits up to a second for the one it
is sent, and says so if it does not arrive (a firewall, an address off the job network).  A busy rank's
datagrams pile up unread, so a rank drains its UDP socket after raising its flag and before its probe: a
stale byte would end the next sleep for nothing, and the probe sees every message whose ring the drain
dropped -- unless the datagram overtook the MPI message, and then that sleep ends at its timeout, as
without a doorbell.  A rank that some sender must ring over UDP sleeps at most 20 ms when quiet
(``DOORBELL_UDP_SLEEP_S``; a one-node job's quiet ranks: 100 ms), and only if its own test ring arrived
and every rank on another node has a UDP socket to ring from; otherwise at most ``runtime.idle_sleep_ms``,
as without a doorbell.  A lost or overtaking datagram costs at most 20 ms once.
``HPCSPLIT_DOORBELL_ALL_REMOTE=1`` (rank 0's value
counts) treats every other rank as remote: tests and ``bench cpu`` run this path on one node.
"""

from __future__ import annotations

import bisect
import contextlib
import ipaddress
import itertools
import os
import select
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcsplit.core.mpi import MPI
from hpcsplit.runtime import mailbox
from hpcsplit.runtime.mailbox import DOORBELL_DEEP_SLEEP_S, DOORBELL_QUIET_SLEEP_S, DOORBELL_UDP_SLEEP_S
from hpcsplit.runtime.netaddr import NETWORK_ENV, _interface_addresses, job_network, node_address  # noqa: F401
from hpcsplit.runtime.transport import TAG_HEADER

__all__ = ["NETWORK_ENV", "Doorbell", "job_network", "node_address", "start_doorbell"]

class Doorbell:
    """One rank's doorbell: :meth:`sleep` until rung or timed out, :meth:`ring` another rank.

    Collective: every rank of ``comm`` constructs it (it splits a node communicator, allocates the
    shared flags and exchanges UDP addresses).  Call :meth:`close` on every rank at the end (also
    collective).

    Parameters
    ----------
    comm : mpi4py communicator
    remote : bool
        Ring ranks on other nodes too (UDP), not only node-local ones.
    network : str, optional
        Where other nodes reach this node: an interface name (``hsn0``, ``ib0``) or an IPv4 network
        (``10.100.0.0/16``); default: :func:`job_network` (``$HPCSPLIT_DOORBELL_NETWORK``, else the address
        the hostname resolves to).  See :func:`node_address`.
    check_s : float
        How long a rank waits at start for the test ring another node sends it (see ``note``).
    """

    def __init__(self, comm: Any, remote: bool = True, network: str | None = None, check_s: float = 1.0) -> None:
        self._mpi = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        # rank 0's name space and ALL_REMOTE switch for every rank (ranks that disagreed would not all
        # take part in the address exchange below)
        head = np.array([(os.getpid() << 20) ^ time.time_ns(),
                         os.environ.get("HPCSPLIT_DOORBELL_ALL_REMOTE") == "1"], dtype=np.int64)
        comm.Bcast([head, MPI.INT64_T], root=0)
        self._prefix = f"\0hpcsplit-{int(head[0]) & 0xFFFFFFFFFFFF:x}-"
        self.node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        n_local = self.node.Get_size()
        # global rank of each node-local rank, and back
        local_globals = MPI.Group.Translate_ranks(self.node.Get_group(), list(range(n_local)), comm.Get_group())
        self._local_index = {int(g): i for i, g in enumerate(local_globals)}
        self._me = self.node.Get_rank()
        self.win = MPI.Win.Allocate_shared(n_local if self._me == 0 else 0, 1, comm=self.node)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for the whole run, for Win_sync (see the note)
        buf, _ = self.win.Shared_query(0)
        self.flags = np.frombuffer(buf, dtype=np.uint8, count=n_local)  # type: ignore[call-overload]
        if self._me == 0:
            self.flags[:] = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self._prefix + str(self.rank))
        self.sock.setblocking(False)
        self.rings = 0  # bytes sent (for tests and the CPU benchmark)
        self.remote_rings = 0  # of which UDP datagrams to other nodes
        self.wakeups = 0  # sleeps ended by a ring
        self._node_id = min(int(g) for g in local_globals)  # the node's lowest global rank
        self._all_remote = bool(head[1])
        if self._all_remote:  # as if every rank had a node of its own (tests, bench cpu)
            self._local_index, self._node_id = {self.rank: self._me}, self.rank
        # every sender is on this node and rings through the flags (Backoff then sleeps longer when idle;
        # UDP rings are never counted on for that: a blocked datagram must not cost more than no doorbell)
        self.all_local = len(self._local_index) == comm.Get_size()
        self.udp: socket.socket | None = None
        self._remote: dict[int, tuple[str, int]] = {}  # global rank on another node -> its UDP address
        self.address = ""  # this rank's UDP address as published, "" if none
        self.note = ""  # what is wrong with remote rings on this rank, if anything
        self._remote_all_ring = False  # every rank on another node has a UDP socket to ring from
        if not self.all_local:
            self._setup_remote(remote, network, check_s)
        # how long a quiet rank may sleep (mailbox.Backoff): long when every sender rings through the fenced
        # flags; shorter when some ring over UDP (a datagram can be lost or overtake its message); None (the
        # plain backoff) when some sender cannot ring this rank at all
        if self.all_local:
            gil = getattr(sys, "_is_gil_enabled", lambda: True)()
            self.quiet_sleep_s: float | None = DOORBELL_QUIET_SLEEP_S if gil else DOORBELL_DEEP_SLEEP_S
        elif self.udp is not None and not self.note and self._remote_all_ring:
            self.quiet_sleep_s = DOORBELL_UDP_SLEEP_S
        else:
            self.quiet_sleep_s = None
        self._socks = [self.sock] if self.udp is None else [self.sock, self.udp]
        self.node.Barrier()  # every socket is bound and every flag down before anyone rings

    def _setup_remote(self, remote: bool, network: str | None, check_s: float) -> None:
        """Collective: bind the UDP socket, exchange addresses, send and await one test ring."""
        MPI, comm = self._mpi, self.comm
        size = comm.Get_size()
        network = job_network(network)
        mine = np.zeros(3, dtype=np.int64)  # IPv4 as an integer, port (0: cannot be rung), node id
        mine[2] = self._node_id
        if remote:
            udp = None
            try:
                ip = ipaddress.IPv4Address(node_address(network))
                if ip.is_unspecified or (ip.is_loopback and not self._all_remote):
                    raise ValueError(f"{socket.gethostname()} resolves to {ip}, which other nodes cannot reach")
                udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                udp.bind((str(ip), 0))  # an address that is not this node's fails here
                udp.setblocking(False)
                mine[:2] = int(ip), udp.getsockname()[1]
                self.udp, self.address = udp, f"{ip}:{mine[1]}"
            except (OSError, ValueError, UnicodeError) as e:
                if udp is not None:
                    udp.close()
                self.note = (f"rank {self.rank}: ranks on other nodes cannot ring this rank ({e}); it wakes at its "
                             "timeout (runtime.idle_sleep_ms). Set runtime.doorbell_network to the interface or "
                             "IPv4 network the nodes share (e.g. hsn0, ib0 or 10.100.0.0/16).")
        table = np.zeros((size, 3), dtype=np.int64)
        comm.Allgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
        ringable = [r for r in range(size) if table[r, 1]]
        self._remote_all_ring = all(table[r, 1] for r in range(size) if table[r, 2] != self._node_id)
        for r in ringable:
            if table[r, 2] != self._node_id:
                self._remote[r] = (str(ipaddress.IPv4Address(int(table[r, 0]))), int(table[r, 1]))

        def successor(q: int) -> int | None:  # the rank q test-rings: the next ringable one on another node
            after = itertools.islice(ringable, bisect.bisect_right(ringable, q), None)
            return next((r for r in itertools.chain(after, ringable) if table[r, 2] != table[q, 2]), None)

        if self.udp is not None:
            to = successor(self.rank)
            if to is not None:
                with contextlib.suppress(OSError):
                    self.udp.sendto(b"\x02", self._remote[to])
        comm.Barrier()  # once, at start
        expect = [q for q in ringable if successor(q) == self.rank]
        if self.udp is None or not expect:
            return
        got, t_end = 0, time.monotonic() + check_s
        while got < len(expect) and select.select([self.udp], [], [], max(0.0, t_end - time.monotonic()))[0]:
            with contextlib.suppress(BlockingIOError):
                while True:
                    self.udp.recv(64)
                    got += 1
        if got < len(expect):
            self.note = (f"rank {self.rank}: the test ring from rank {expect[0]} (another node) did not reach "
                         f"{self.address} within {check_s:g} s: rings from other nodes may not arrive (a firewall, "
                         "or an address off the job network: set runtime.doorbell_network); they are sent anyway, "
                         "and this rank still wakes at its timeout (runtime.idle_sleep_ms)")

    def ring(self, dest: int) -> bool:
        """After a send to ``dest``: wake it if it sleeps on this node, or ring it if it is on another node
        (its flag cannot be read from here).  Returns whether a byte was sent."""
        i = self._local_index.get(dest)
        if i is None:
            addr = self._remote.get(dest)
            if addr is None or self.udp is None:
                return False
            try:
                self.udp.sendto(b"\x01", addr)
            except OSError:  # no route, buffer full: the receiver's timeout wakes it
                return False
            self.rings += 1
            self.remote_rings += 1
            return True
        self.win.Sync()  # fence: the message posted before is visible before we read the flag
        if not self.flags[i]:
            return False
        try:
            self.sock.sendto(b"\x01", self._prefix + str(dest))
        except OSError:  # its buffer is full (it is being woken anyway) or it has just closed
            return False
        self.rings += 1
        return True

    def armed(self, dest: int) -> bool | None:
        """Whether rank ``dest`` of this node has its flag up (it sleeps, or is about to); None: not on this node."""
        i = self._local_index.get(dest)
        if i is None:
            return None
        self.win.Sync()
        return bool(self.flags[i])

    def sleep(self, timeout_s: float, probe: Callable[[], bool] | None = None) -> bool:
        """Sleep up to ``timeout_s``; return True when rung (or ``probe()`` saw work) before the timeout."""
        if self.arm(probe):
            return True
        try:
            ready, _, _ = select.select(self._socks, [], [], timeout_s)
        finally:
            self.disarm()
        if not ready:
            return False
        self.rung()
        return True

    def arm(self, probe: Callable[[], bool] | None = None) -> bool:
        """Raise this rank's flag before a wait on :attr:`sockets`; True (flag down again) when ``probe()``
        already sees work.  Otherwise wait, then :meth:`disarm` (and :meth:`rung` if a socket woke it)."""
        self.flags[self._me] = 1
        self.win.Sync()  # fence: the flag is visible before the probe reads the queues
        if self.udp is not None:
            _drain(self.udp)  # rings of messages taken while busy (the probe sees any still waiting)
        if probe is not None and probe():
            self.disarm()
            self._drain()  # a sender may have rung as well: no stale byte to end a later sleep
            return True
        return False

    def disarm(self) -> None:
        self.flags[self._me] = 0

    def rung(self, woke: bool = True) -> None:
        """A ring read from :attr:`sockets`: empty them, and count a wake-up if it ended a wait (``woke``)."""
        self.wakeups += int(woke)
        self._drain()

    @property
    def sockets(self) -> list[socket.socket]:
        """What a ring writes to (the node-local socket, and the UDP one when other nodes ring)."""
        return list(self._socks)

    def _drain(self) -> None:
        for sk in self._socks:
            _drain(sk)

    def probe_header(self) -> bool:
        """Whether a message header is waiting (the probe :meth:`sleep` makes after raising the flag).

        Probes twice: MPICH's first probe may only move the waiting message into its queues
        (``[Note: probing past misses]`` in :mod:`~hpcsplit.runtime.mailbox`).
        """
        src = self._mpi.ANY_SOURCE
        return bool(self.comm.Iprobe(source=src, tag=TAG_HEADER) or self.comm.Iprobe(source=src, tag=TAG_HEADER))

    def close(self) -> None:
        """Collective: uninstall it from the rank loops, free the shared flags and the node communicator,
        close the socket."""
        if mailbox._DOORBELL is self:
            mailbox.install_doorbell(None)
        for sk in self._socks:
            sk.close()
        self.win.Unlock_all()
        self.win.Free()
        self.node.Free()


def _drain(sk: socket.socket) -> None:
    try:
        while True:
            sk.recv(64)
    except BlockingIOError:
        pass


def start_doorbell(comm: Any, remote: bool = True, network: str | None = None) -> Doorbell:
    """Collective: make this rank's doorbell and install it in the rank loops (:mod:`mailbox`).

    Close it with :meth:`Doorbell.close` on every rank once the loops are done, and only on success
    (a failing rank aborts the whole job instead of reaching the collective close).
    """
    db = Doorbell(comm, remote, network)
    mailbox.install_doorbell(db)
    return db
