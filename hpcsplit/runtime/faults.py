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
its job.  A rank killed outright (SIGKILL) takes the job with it at once (hydra kills every other rank
with SIGKILL), which is why batch outputs are written to disk as they finish
(:class:`~hpcsplit.runtime.batch_files.OutputWriter`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from hpcsplit.core.mpi import MPI
from hpcsplit.core.plan import Plan
from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime import transport as tp

__all__ = ["COMPONENT_SIGNAL_GRACE_S", "TAG_ARRIVE", "JobInterrupted", "RankSilentError", "chain_requeue",
           "describe_rank", "install_stop_signals", "named_barrier", "stop_signal"]

TAG_ARRIVE = 7203  # a rank's arrival at a named barrier, to rank 0
COMPONENT_SIGNAL_GRACE_S = 10.0  # a signalled component serves this long past abort_grace_s, then raises

_SIGNALLED: list[tuple[int, float]] = []  # (signal number, time.monotonic()) of the first stop signal


class RankSilentError(RuntimeStageError):
    """A rank did not answer within its deadline (``[Note: every wait has a deadline]``)."""


class JobInterrupted(RuntimeStageError):
    """The job was asked to stop (SIGTERM, SIGINT or SIGUSR2; ``[Note: stop signals]``)."""


def _on_signal(signum: int, _frame: Any) -> None:
    if not _SIGNALLED:
        _SIGNALLED.append((signum, time.monotonic()))


_PREVIOUS: dict[int, Any] = {}  # the handlers ours replaced (submitit's checkpoint-and-requeue on USR2)


def install_stop_signals() -> None:
    """SIGTERM, SIGINT and SIGUSR2 set this rank's stop flag (:func:`stop_signal`) instead of killing it."""
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        prev = signal.signal(s, _on_signal)
        if prev is not _on_signal:
            _PREVIOUS[s] = prev


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


def named_barrier(comm: MPI.Comm, timeout_s: float | None, what: str, name: Callable[[int], str],
                  while_waiting: Callable[[], object] | None = None, max_sleep_s: float = 1e-3) -> None:
    """A barrier that waits without spinning and, on rank 0, names the ranks that did not come in time.

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
        On rank 0 when some rank did not arrive within ``timeout_s`` (every such rank named).
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    t_end = None if timeout_s is None else time.monotonic() + timeout_s * (1 if rank == 0 else 2)
    if size == 1:
        return
    if rank == 0:
        missing = set(range(1, size))
        st = MPI.Status()

        def _arrived() -> bool:
            if while_waiting is not None:
                while_waiting()
            while missing and comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_ARRIVE, status=st):
                src = st.Get_source()
                comm.recv(source=src, tag=TAG_ARRIVE)
                missing.discard(src)
            return not missing

        left = None if t_end is None else max(0.0, t_end - time.monotonic())
        if not tp.wait_polling(_arrived, left, max_sleep_s=max_sleep_s):
            raise RankSilentError(
                f"{', '.join(name(r) for r in sorted(missing))} did not answer within {timeout_s:g} s "
                f"({what}); the rank is stopped, stuck or overloaded. Look at its log lines above; if it is "
                "only slow, raise runtime.request_timeout_s / runtime.stop_grace_s (serving) or "
                "runtime.load_timeout_s (loading)."
            )
    else:
        req = comm.isend(None, dest=0, tag=TAG_ARRIVE)
        left = None if t_end is None else max(0.0, t_end - time.monotonic())
        if not tp.wait_polling(lambda: bool(req.Test()), left, max_sleep_s=max_sleep_s):
            raise RankSilentError(f"rank {rank}: rank 0 did not take this rank's arrival ({what}) within "
                                  f"{2 * (timeout_s or 0):g} s")
    req_b = comm.Ibarrier()

    def _done() -> bool:
        if while_waiting is not None:
            while_waiting()
        return bool(req_b.Test())

    left = None if t_end is None else max(1.0, t_end - time.monotonic())
    if not tp.wait_polling(_done, left, max_sleep_s=max_sleep_s):
        raise RankSilentError(f"rank {rank}: the barrier after {what} did not complete within "
                              f"{(timeout_s or 0) * (1 if rank == 0 else 2):g} s")
