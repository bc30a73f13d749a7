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

The flag and the message can cross (the receiver raises its flag and probes while the sender posts and
reads the flag; x86 may reorder either side's store and load), and then no byte is sent: the sleep
ends at its timeout as it did without a doorbell.  A doorbell can only make a wake-up earlier, never
later.

Ranks on other nodes (``runtime.doorbell: true``; ``local`` rings node-local ranks only): their flags
cannot be read, so every send to one is followed by a one-byte UDP datagram to its doorbell port
(a ``sendto`` of a few microseconds, beside a network message).  Each rank binds a UDP socket on all
interfaces and publishes the address its node's hostname resolves to (or ``runtime.doorbell_address``)
with an ``Allgather`` at start; a peer on another node that published a loopback address cannot be
rung (reported once, its wake-up is the timeout).  A busy rank's datagrams pile up unread, so a rank
drains its UDP socket after raising its flag and before its probe: a stale byte would end the next
sleep for nothing, and the probe sees every message whose ring the drain dropped -- unless the
datagram overtook the MPI message, and then that sleep ends at its timeout, as without a doorbell.
``HPCSPLIT_DOORBELL_ALL_REMOTE=1`` treats every other rank as remote (tests, ``bench cpu`` on one node).
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Doorbell", "start_doorbell"]


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
    address : str, optional
        IPv4 address other nodes reach this rank at; default: what the hostname resolves to.
    """

    def __init__(self, comm: Any, remote: bool = True, address: str | None = None) -> None:
        from hpcsplit._mpi import MPI

        self._mpi = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        token = np.array([(os.getpid() << 20) ^ time.time_ns()], dtype=np.int64)
        comm.Bcast([token, MPI.INT64_T], root=0)  # one name space per job
        self._prefix = f"\0hpcsplit-{int(token[0]) & 0xFFFFFFFFFFFF:x}-"
        self.node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        n_local = self.node.Get_size()
        # global rank of each node-local rank, and back
        local_globals = MPI.Group.Translate_ranks(self.node.Get_group(), list(range(n_local)), comm.Get_group())
        self._local_index = {int(g): i for i, g in enumerate(local_globals)}
        self._me = self.node.Get_rank()
        self.win = MPI.Win.Allocate_shared(n_local if self._me == 0 else 0, 1, comm=self.node)
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
        if os.environ.get("HPCSPLIT_DOORBELL_ALL_REMOTE") == "1":  # as if every rank had a node of its own
            self._local_index = {self.rank: self._me}
        self.udp: socket.socket | None = None
        self._remote: dict[int, tuple[str, int]] = {}  # global rank -> UDP address
        self.unreachable: list[int] = []  # remote ranks that published a loopback address
        self.note = ""  # why remote rings are off, if they are
        self._setup_remote(remote, address)
        self._socks = [self.sock] if self.udp is None else [self.sock, self.udp]
        self.all_can_ring = len(self._local_index) + len(self._remote) == comm.Get_size()
        self.all_local = n_local == comm.Get_size()  # every rank on this node
        self.node.Barrier()  # every socket is bound and every flag down before anyone rings

    def _setup_remote(self, remote: bool, address: str | None) -> None:
        """Collective (when any rank is remote): bind the UDP socket and exchange addresses."""
        MPI, comm = self._mpi, self.comm
        size = comm.Get_size()
        if len(self._local_index) == size:
            return  # one node: nothing to exchange (every rank sees the same, so all skip)
        mine = np.zeros(2, dtype=np.int64)  # IPv4 as an integer, port; 0, 0: not reachable
        if remote:
            try:
                ip = address or socket.gethostbyname(socket.gethostname())
                udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                udp.bind(("", 0))
                udp.setblocking(False)
                mine[:] = int.from_bytes(socket.inet_aton(ip), "big"), udp.getsockname()[1]
                self.udp = udp
            except OSError as e:
                self.note = f"no UDP doorbell on this rank ({e}); ranks on other nodes wake at their timeout"
        table = np.zeros((size, 2), dtype=np.int64)
        comm.Allgather([mine, MPI.INT64_T], [table, MPI.INT64_T])
        if self.udp is None:
            return
        on_node = set(MPI.Group.Translate_ranks(self.node.Get_group(), list(range(self.node.Get_size())),
                                                comm.Get_group()))
        for r in range(size):
            if r in self._local_index or not table[r, 1]:
                continue
            ip = socket.inet_ntoa(int(table[r, 0]).to_bytes(4, "big"))
            if ip.startswith("127.") and r not in on_node:
                self.unreachable.append(r)
                continue
            self._remote[r] = (ip, int(table[r, 1]))
        if self.unreachable:
            self.note = (f"ranks {self.unreachable} are on other nodes but their hostname resolves to a loopback "
                         "address: they cannot be rung and wake at their timeout (set runtime.doorbell_address "
                         "to the node's address on the job network)")

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
        if not self.flags[i]:
            return False
        try:
            self.sock.sendto(b"\x01", self._prefix + str(dest))
        except OSError:  # its buffer is full (it is being woken anyway) or it has just closed
            return False
        self.rings += 1
        return True

    def sleep(self, timeout_s: float, probe: Callable[[], bool] | None = None) -> bool:
        """Sleep up to ``timeout_s``; return True when rung (or ``probe()`` saw work) before the timeout."""
        flags, me = self.flags, self._me
        flags[me] = 1
        try:
            if self.udp is not None:
                _drain(self.udp)  # rings of messages taken while busy (the probe sees any still waiting)
            if probe is not None and probe():
                self._drain()  # a sender may have rung as well: no stale byte to end a later sleep
                return True
            ready, _, _ = select.select(self._socks, [], [], timeout_s)
        finally:
            flags[me] = 0
        if not ready:
            return False
        self.wakeups += 1
        self._drain()
        return True

    def _drain(self) -> None:
        for sk in self._socks:
            _drain(sk)

    def probe_header(self) -> bool:
        """Whether a message header is waiting (the probe :meth:`sleep` makes after raising the flag).

        Probes twice: MPICH's first probe may only move the waiting message into its queues
        (``[Note: probing past misses]`` in :mod:`~hpcsplit.runtime.mailbox`).
        """
        from hpcsplit.runtime.transport import TAG_HEADER

        src = self._mpi.ANY_SOURCE
        return bool(self.comm.Iprobe(source=src, tag=TAG_HEADER) or self.comm.Iprobe(source=src, tag=TAG_HEADER))

    def close(self) -> None:
        """Collective: uninstall it from the rank loops, free the shared flags and the node communicator,
        close the socket."""
        from hpcsplit.runtime import mailbox

        if mailbox._DOORBELL is self:
            mailbox.install_doorbell(None)
        for sk in self._socks:
            sk.close()
        self.win.Free()
        self.node.Free()


def _drain(sk: socket.socket) -> None:
    try:
        while True:
            sk.recv(64)
    except BlockingIOError:
        pass


def start_doorbell(comm: Any, remote: bool = True, address: str | None = None) -> Doorbell:
    """Collective: make this rank's doorbell and install it in the rank loops (:mod:`mailbox`).

    Close it with :meth:`Doorbell.close` on every rank once the loops are done, and only on success
    (a failing rank aborts the whole job instead of reaching the collective close).
    """
    from hpcsplit.runtime import mailbox

    db = Doorbell(comm, remote, address)
    mailbox.install_doorbell(db)
    return db
