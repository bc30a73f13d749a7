"""Faults of the serve/bench job on the ranks' side: deadlines that name the silent rank, stop signals.

[Note: every wait has a deadline]
A rank that is alive but silent (stopped with SIGSTOP, stuck in a driver call, swapped out) never
makes MPI fail: the others would wait for it forever.  So every wait of the job has a deadline:

- requests: ``runtime.request_timeout_s`` per request (:class:`~hpcsplit.runtime.frontend.Frontend`);
- the frontend's STOP sends, the component counters it collects and every barrier after serving:
  :attr:`~hpcsplit.runtime.settings.RuntimeSettings.wait_bound_s` = ``runtime.request_timeout_s`` +
  ``runtime.stop_grace_s`` (a component that is busy with a batch when STOP comes finishes that batch
  first, and no batch may take longer than a request's timeout);
- the barriers while ranks load and check their programs or time the floor (bench):
  ``runtime.load_timeout_s`` (loading a large program can take minutes).

A barrier here is *named* (:func:`named_barrier`): every other rank first sends rank 0 a small arrival
message, so when the deadline passes rank 0 knows who did not come and raises :class:`RankSilentError`
naming rank, component, node and host; ``hpcsplit.launch.rank`` then aborts the job.  The other ranks
wait for the barrier with twice the deadline (rank 0 names the culprit first) before giving up on their own.

[Note: stop signals]
``mpiexec`` (MPICH's hydra) forwards SIGTERM and SIGINT to every rank and waits for them; so does SLURM
before its kill.  :func:`install_stop_signals` makes these (and SIGUSR2, SLURM's usual warning signal)
set a flag instead of killing the rank.  The frontend checks the flag in its loop: it stops admitting,
writes what finished (batch outputs; bench levels are on disk already, one line per level) and raises
:class:`JobInterrupted`, which aborts the job.  A component keeps serving for ``runtime.abort_grace_s``
plus :data:`COMPONENT_SIGNAL_GRACE_S` (so the frontend can finish), then raises itself: no rank outlives
its job.  In batch and bench mode a rank killed outright (SIGKILL) takes the job with it at once (hydra
kills every other rank with SIGKILL), which is why batch outputs are written to disk as they finish
(:class:`~hpcsplit.runtime.batch_stream.StreamWriter`).

[Note: lost ranks]
In server mode a component replica may be lost while the job goes on (``[Note: serving through faults]``
in :mod:`hpcsplit.runtime.server.failover`).  hydra, run with ``-disable-auto-cleanup`` (the launcher
does), sends SIGUSR1 to the surviving ranks of a node when one of its ranks ended; its default action
would end them too, so :func:`install_stop_signals` ignores it (a Python handler would not do: Python
puts the default action back while it exits, and a rank ending a moment after another died of it).  The
frontend looks every 0.1 s whether a rank of its node has ended instead (:func:`ended_ranks`, from the
PIDs every rank published at start, :func:`set_job_processes`).  Every rank keeps the ranks the frontend declared lost
(:func:`mark_lost`, :func:`lost_ranks`): nothing is sent to them, STOP is not waited for from them, and
the barriers after serving meet among the survivors only (:func:`named_barrier`): MPI's own barrier
would wait for the lost rank for ever.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from hpcsplit.core.mpi import MPI
from hpcsplit.core.plan import Plan
from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime import transport as tp

__all__ = ["COMPONENT_SIGNAL_GRACE_S", "CONTROL_ALIVE", "CONTROL_LOST", "CONTROL_QUIET", "TAG_ARRIVE",
           "JobInterrupted", "RankSilentError", "chain_requeue", "describe_rank", "ended_ranks", "install_stop_signals",
           "job_process", "leave_degraded_job", "lost_ranks", "mark_lost", "named_barrier", "process_gone", "set_job_processes",
           "stop_signal"]

TAG_ARRIVE = 7203  # a rank's arrival at a named barrier, to rank 0
TAG_RELEASE = 7204  # rank 0 lets a survivor leave a named barrier (a job with lost ranks: [Note: lost ranks])
COMPONENT_SIGNAL_GRACE_S = 10.0  # a signalled component serves this long past abort_grace_s, then raises
# KIND_CONTROL messages from the frontend to the component ranks in server mode (their ``aux``; a component's own
# counters to the frontend carry its component index, >= 0): [Note: serving through faults]
CONTROL_LOST = -1  # int64 payload: every rank lost so far
CONTROL_ALIVE = -2  # the frontend's heartbeat
CONTROL_QUIET = -3  # the frontend stops its heartbeats (serving ended; STOP follows)
ENDED_LOOK_S = 0.5  # rank 0 looks this often at a named barrier whether a missing rank of its node ended

_SIGNALLED: list[tuple[int, float]] = []  # (signal number, time.monotonic()) of the first stop signal
_LOST: dict[int, str] = {}  # rank -> why the frontend declared it lost
_PROCS: list[tuple[str, int]] = []  # (host, pid) of every rank of the job, by rank


class RankSilentError(RuntimeStageError):
    """A rank did not answer within its deadline (``[Note: every wait has a deadline]``)."""


class JobInterrupted(RuntimeStageError):
    """The job was asked to stop (SIGTERM, SIGINT or SIGUSR2; ``[Note: stop signals]``)."""


def _on_signal(signum: int, _frame: Any) -> None:
    if not _SIGNALLED:
        _SIGNALLED.append((signum, time.monotonic()))


_PREVIOUS: dict[int, Any] = {}  # the handlers ours replaced (submitit's checkpoint-and-requeue on USR2)


def install_stop_signals() -> None:
    """SIGTERM, SIGINT and SIGUSR2 set this rank's stop flag (:func:`stop_signal`) instead of killing it;
    SIGUSR1 (hydra: a rank of this node ended, ``[Note: lost ranks]``) is ignored."""
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        prev = signal.signal(s, _on_signal)
        if prev is not _on_signal:
            _PREVIOUS[s] = prev
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def set_job_processes(procs: Sequence[tuple[str, int]]) -> None:
    """Record every rank's ``(host, pid)`` (gathered at start) for :func:`ended_ranks`."""
    _PROCS[:] = [(str(h), int(p)) for h, p in procs]


def job_process(rank: int) -> tuple[str, int]:
    """``(host, pid)`` of ``rank`` as it published them at start (``("", 0)`` when not known)."""
    return _PROCS[rank] if 0 <= rank < len(_PROCS) else ("", 0)


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` (of this node) has ended: no such process, or a zombie not yet reaped.

    Examples
    --------
    >>> process_gone(os.getpid())
    False
    """
    try:
        text = Path(f"/proc/{int(pid)}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return False  # unreadable: not known to be gone
    rest = text.rsplit(")", 1)[-1].split()
    return bool(rest) and rest[0] in ("Z", "X")


def ended_ranks(ranks: Iterable[int]) -> list[int]:
    """Those of ``ranks`` on this node whose process has ended (ranks on other nodes are never listed)."""
    here = socket.gethostname()
    return [r for r in ranks if 0 <= r < len(_PROCS) and _PROCS[r][0] == here and process_gone(_PROCS[r][1])]


def mark_lost(rank: int, why: str) -> None:
    """Record that the frontend declared ``rank`` lost (``[Note: lost ranks]``)."""
    _LOST.setdefault(int(rank), why)


def lost_ranks() -> dict[int, str]:
    """The ranks lost so far (rank -> why), on whichever rank asks."""
    return dict(_LOST)


def chain_requeue(before: Callable[[], object] | None = None) -> bool:
    """After a stop signal, once what was finished is saved: call the handler it would have reached without
    ours when that is submitit's (SIGUSR2 under ``launcher=slurm``: it checkpoints, requeues the job and
    exits), after ``before()``.  False when there is none (local runs; plain sbatch, where
    ``slurm/infer.sbatch`` requeues the job itself)."""
    if not _SIGNALLED:
        return False
    signum = _SIGNALLED[0][0]
    prev = _PREVIOUS.get(signum)
    # submitit requeues on USR2 only (its SIGTERM handler just logs: SLURM itself requeues on a preemption)
    if (signum != signal.SIGUSR2 or not callable(prev)
            or not str(getattr(prev, "__module__", "")).startswith("submitit")):
        return False
    if before is not None:
        before()
    prev(signum, None)
    return True


def stop_signal() -> tuple[str, float] | None:
    """``(signal name, seconds since it came)`` once a stop signal came; None before."""
    if not _SIGNALLED:
        return None
    s, t = _SIGNALLED[0]
    return signal.Signals(s).name, time.monotonic() - t


def describe_rank(plan: Plan, rank: int, hosts: Sequence[str] = ()) -> str:
    """``rank 2 (component 'stage_1' replica 0, node 0, host vm)``: a rank as messages name it."""
    try:
        e = plan.rank_entry(rank)
    except Exception:  # noqa: BLE001 - a rank outside the plan is still named by its number
        return f"rank {rank}"
    role = "frontend" if e.role == "frontend" else f"component {e.component!r} replica {e.replica}"
    host = f", host {hosts[rank]}" if rank < len(hosts) else ""
    return f"rank {rank} ({role}, node {e.node}{host})"


def leave_degraded_job(comm: MPI.Comm, result: Path | None, out: object) -> None:
    """The end of a job that lost ranks while serving (``[Note: lost ranks]``), after its last barrier.

    Rank 0 writes its result (``result``) first.  It then kills the lost ranks of its node that still run
    (stopped, stuck) and, when a lost rank ran on another node (it may still run: stopped, cut off), aborts the
    job, so that no rank outlives it.  Every survivor ends without ``MPI_Finalize`` unless the launcher made it
    local (``MPIR_CVAR_NO_COLLECTIVE_FINALIZE=1``): MPICH's finalize waits for every rank, the lost ones too.
    """
    if comm.Get_rank() == 0:
        if result is not None:
            result.write_text(json.dumps(out, indent=2, default=str))
        here = socket.gethostname()
        elsewhere = False
        for r in _LOST:
            host, pid = job_process(r)
            if host != here:
                elsewhere = True
            elif pid and not process_gone(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        sys.stderr.write(f"[rank 0] the job ends without the rank(s) it lost: {sorted(_LOST)}\n")
        if elsewhere:
            sys.stderr.flush()
            comm.Abort(1)  # the launcher ends every rank left, the lost ones on other nodes too
    if os.environ.get("MPIR_CVAR_NO_COLLECTIVE_FINALIZE") != "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def named_barrier(comm: MPI.Comm, timeout_s: float | None, what: str, name: Callable[[int], str],
                  while_waiting: Callable[[], object] | None = None, max_sleep_s: float = 1e-3) -> None:
    """A barrier that waits without spinning and, on rank 0, names the ranks that did not come in time.

    Every other rank sends rank 0 an arrival message; once all have come, rank 0 sends each a release
    message.  Ranks declared lost (:func:`lost_ranks`, ``[Note: lost ranks]``) are neither waited for nor
    released, so the survivors of a server that lost a replica still meet (an ``MPI_Barrier`` would wait for
    the lost rank for ever); a rank of rank 0's node that ends while rank 0 waits for it is named within a
    second (:func:`ended_ranks`).

    Parameters
    ----------
    comm
        The job's communicator (every rank calls this, in the same order as every other barrier).
    timeout_s
        Rank 0's deadline; the other ranks wait twice as long.  None: no deadline.
    what
        What the ranks were doing before the barrier (in the message).
    name
        ``rank -> description`` (:func:`describe_rank`).
    while_waiting
        Called while polling (the frontend drops late outputs).

    Raises
    ------
    RankSilentError
        On rank 0 when some rank did not arrive within ``timeout_s`` (every such rank named), or ended.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    t_end = None if timeout_s is None else time.monotonic() + timeout_s * (1 if rank == 0 else 2)
    if size == 1:
        return

    def _left() -> float | None:
        return None if t_end is None else max(0.0, t_end - time.monotonic())

    st = MPI.Status()
    if rank == 0:
        survivors = sorted(set(range(1, size)) - set(_LOST))
        missing = set(survivors)
        next_look = [time.monotonic() + ENDED_LOOK_S]

        def _arrived() -> bool:
            if while_waiting is not None:
                while_waiting()
            while missing and comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_ARRIVE, status=st):
                src = st.Get_source()
                comm.recv(source=src, tag=TAG_ARRIVE)
                missing.discard(src)
            if missing and time.monotonic() > next_look[0]:  # a rank of this node that ended is not coming
                next_look[0] = time.monotonic() + ENDED_LOOK_S
                gone = ended_ranks(missing)
                if gone:
                    raise RankSilentError(f"{', '.join(name(r) for r in gone)} ended (its process is gone) "
                                          f"before {what} was over; look at its log lines above")
            return not missing

        if not tp.wait_polling(_arrived, _left(), max_sleep_s=max_sleep_s):
            raise RankSilentError(
                f"{', '.join(name(r) for r in sorted(missing))} did not answer within {timeout_s:g} s "
                f"({what}); the rank is stopped, stuck or overloaded. Look at its log lines above; if it is "
                "only slow, raise runtime.request_timeout_s / runtime.stop_grace_s (serving) or "
                "runtime.load_timeout_s (loading)."
            )
        reqs = [comm.isend(None, dest=r, tag=TAG_RELEASE) for r in survivors]
        left = _left()
        if not tp.wait_polling(lambda: bool(MPI.Request.Testall(reqs)), max(1.0, left if left is not None else 60.0),
                               max_sleep_s=max_sleep_s):
            raise RankSilentError(f"rank 0: the ranks did not take their release from the barrier after {what}")
        return
    req = comm.isend(None, dest=0, tag=TAG_ARRIVE)
    if not tp.wait_polling(lambda: bool(req.Test()), _left(), max_sleep_s=max_sleep_s):
        raise RankSilentError(f"rank {rank}: rank 0 did not take this rank's arrival ({what}) within "
                              f"{2 * (timeout_s or 0):g} s")

    def _released() -> bool:
        if while_waiting is not None:
            while_waiting()
        if not comm.Iprobe(source=0, tag=TAG_RELEASE, status=st):
            return False
        comm.recv(source=0, tag=TAG_RELEASE)
        return True

    left = _left()
    if not tp.wait_polling(_released, None if left is None else max(1.0, left), max_sleep_s=max_sleep_s):
        raise RankSilentError(f"rank {rank}: the barrier after {what} did not complete within "
                              f"{2 * (timeout_s or 0):g} s")
