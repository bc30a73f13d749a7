"""The process tree of a local MPI job, read from ``/proc``: its processes, their MPI ranks, killing them all.

[Note: job process tree]
``mpiexec`` is started in a session of its own (``start_new_session``), and MPICH's ``hydra_pmi_proxy``
calls ``setsid`` again, so neither a signal to the login-side process nor ``killpg(mpiexec)`` reaches
the ranks.  The launcher therefore tracks the job as the *tree* below mpiexec: every descendant, found
by walking ``/proc/<pid>/stat`` parent links, remembered with its start time (so that a recycled PID is
never killed), and the MPI rank each one runs, read from its environment (``PMI_RANK`` for MPICH,
``OMPI_COMM_WORLD_RANK`` for Open MPI, ``PMIX_RANK`` for PMIx).  :class:`JobTree` refreshes that picture
while the job runs; when mpiexec reports ``PID 1234 ... signal 9``, the PID names the rank, and the
plan names its component.  mpiexec's own report is not enough: once one rank dies, MPICH kills the
others and may report any of them (rank 0 first), so :meth:`JobTree.watch` records the order in which
the ranks end (a ``pidfd`` per rank, polled) and the first to end is the one named.  On a system without ``/proc`` the tree is empty and only mpiexec's own
process group is signalled.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["JobTree", "descendants", "rank_of"]

_PROC = Path("/proc")
_RANK_VARS = (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK=")


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time in clock ticks)`` of ``pid``, None when it is gone, a zombie or unreadable."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    rest = text.rsplit(")", 1)[-1].split()  # the command name may hold spaces and parentheses
    if not rest or rest[0] in ("Z", "X"):
        return None
    try:
        return int(rest[1]), int(rest[19])
    except (IndexError, ValueError):
        return None


def _table() -> dict[int, tuple[int, int]]:
    """Every readable process: pid -> (ppid, start time)."""
    out: dict[int, tuple[int, int]] = {}
    try:
        names = os.listdir(_PROC)
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def descendants(pid: int) -> dict[int, int]:
    """Every process below ``pid`` (not ``pid`` itself): pid -> start time.

    Examples
    --------
    >>> descendants(os.getpid()) == {} or True
    True
    """
    table = _table()
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(p)
    out: dict[int, int] = {}
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop()
        if p in out or p == pid:
            continue
        out[p] = table[p][1]
        todo.extend(children.get(p, []))
    return out


def rank_of(pid: int) -> int | None:
    """The MPI rank a process runs, from its environment (None: not a rank, or unreadable)."""
    try:
        env = (_PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    for item in env.split(b"\0"):
        for var in _RANK_VARS:
            if item.startswith(var):
                try:
                    return int(item[len(var):])
                except ValueError:
                    return None
    return None


class JobTree:
    """The processes below one mpiexec, refreshed by :meth:`refresh` (see ``[Note: job process tree]``).

    Parameters
    ----------
    root : int
        mpiexec's PID.
    """

    def __init__(self, root: int, root_running: Callable[[], bool] | None = None) -> None:
        self.root = root
        # whether mpiexec is not yet reaped: its group id may be reused once it is, so no killpg after
        self.root_running = root_running or (lambda: True)
        self.known: dict[int, int] = {}  # pid -> start time, every process ever seen below root
        self.ranks: dict[int, int] = {}  # pid -> MPI rank
        self._lock = threading.Lock()  # the watch thread and the main thread both refresh
        self.ended: list[int] = []  # rank PIDs in the order they ended (see watch)

    def refresh(self) -> None:
        """Add the processes below ``root`` now, and the rank of each that runs one."""
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        for pid, start in descendants(self.root).items():
            if self.known.get(pid) != start:
                self.known[pid] = start
                self.ranks.pop(pid, None)
            if pid not in self.ranks:
                r = rank_of(pid)
                if r is not None:
                    self.ranks[pid] = r

    def alive(self) -> list[int]:
        """The known processes still running (same PID and start time)."""
        out = []
        with self._lock:
            known = list(self.known.items())
        for pid, start in known:
            st = _stat(pid)
            if st is not None and st[1] == start:
                out.append(pid)
        return out

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to mpiexec's group and to every known process still alive."""
        try:
            self.refresh()
        except OSError:
            pass
        if self.root_running():
            try:
                os.killpg(self.root, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in self.alive():
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def watch(self, ranks: int, running: Callable[[], bool], stop: threading.Event) -> None:
        """Refresh the tree until ``ranks`` ranks are known, then record the order in which they end.

        Runs in a thread until ``running()`` is false or ``stop`` is set.
        """
        fds: dict[int, int] = {}  # pidfd -> pid
        poller = select.poll() if hasattr(select, "poll") else None
        last = 0.0
        try:
            while running() and not stop.is_set():
                now = time.monotonic()
                if now - last > (0.2 if len(set(self.ranks.values())) < ranks else 2.0):
                    try:
                        self.refresh()
                    except OSError:
                        pass
                    last = now
                    with self._lock:
                        rank_pids = list(self.ranks)
                    for pid in rank_pids:
                        if pid in fds.values() or pid in self.ended:
                            continue
                        try:
                            fd = os.pidfd_open(pid)
                        except (AttributeError, OSError):
                            continue
                        fds[fd] = pid
                        if poller is not None:
                            poller.register(fd, select.POLLIN)
                if poller is None or not fds:
                    stop.wait(0.1)
                    continue
                for fd, _ in poller.poll(100):
                    self.ended.append(fds.pop(fd))
                    poller.unregister(fd)
                    os.close(fd)
        finally:
            for fd in fds:
                os.close(fd)

    def first_ended(self) -> int | None:
        """The PID of the first rank that ended, None when none was seen ending."""
        return self.ended[0] if self.ended else None
