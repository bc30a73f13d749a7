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
later.  Ranks on other nodes are never rung (their wake-up is the timeout).
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
    """One rank's doorbell: :meth:`sleep` until rung or timed out, :meth:`ring` a node-local rank.

    Collective: every rank of ``comm`` constructs it (it splits a node communicator and allocates the
    shared flags).  Call :meth:`close` on every rank at the end (also collective).
    """

    def __init__(self, comm: Any) -> None:
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
        self.all_local = n_local == comm.Get_size()  # every sender can ring this rank
        self.win = MPI.Win.Allocate_shared(n_local if self._me == 0 else 0, 1, comm=self.node)
        buf, _ = self.win.Shared_query(0)
        self.flags = np.frombuffer(buf, dtype=np.uint8, count=n_local)  # type: ignore[call-overload]
        if self._me == 0:
            self.flags[:] = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self._prefix + str(self.rank))
        self.sock.setblocking(False)
        self.rings = 0  # bytes sent (for tests and the CPU benchmark)
        self.wakeups = 0  # sleeps ended by a ring
        self.node.Barrier()  # every socket is bound and every flag down before anyone rings

    def ring(self, dest: int) -> bool:
        """After a send to ``dest``: wake it if it sleeps on this node.  Returns whether a byte was sent."""
        i = self._local_index.get(dest)
        if i is None or not self.flags[i]:
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
            if probe is not None and probe():
                self._drain()  # a sender may have rung as well: no stale byte to end a later sleep
                return True
            ready, _, _ = select.select([self.sock], [], [], timeout_s)
        finally:
            flags[me] = 0
        if not ready:
            return False
        self.wakeups += 1
        self._drain()
        return True

    def _drain(self) -> None:
        try:
            while True:
                self.sock.recv(64)
        except BlockingIOError:
            pass

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
        self.sock.close()
        self.win.Free()
        self.node.Free()


def start_doorbell(comm: Any) -> Doorbell:
    """Collective: make this rank's doorbell and install it in the rank loops (:mod:`mailbox`).

    Close it with :meth:`Doorbell.close` on every rank once the loops are done, and only on success
    (a failing rank aborts the whole job instead of reaching the collective close).
    """
    from hpcsplit.runtime import mailbox

    db = Doorbell(comm)
    mailbox.install_doorbell(db)
    return db
