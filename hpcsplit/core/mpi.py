"""The one module that imports mpi4py.

The profiler, the probe and the runtime share it.  MPI functions elsewhere take
``comm=None`` and resolve it here (default ``COMM_WORLD``), like dask-mpi.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from hpcsplit.core.paths import MPI_INIT_DIR_VAR
from hpcsplit.errors import WorldSizeError

__all__ = [
    "INIT_TIMEOUT_VAR", "MPI", "abort", "check_world_size", "get_comm", "init_with_deadline", "mpi_library_version",
]

# Initialise threads only as needed; the runtime polls from one thread.
import mpi4py

mpi4py.rc.thread_level = "serialized"
if "mpi4py.MPI" not in sys.modules:  # MPI_Init below, under a deadline (see init_with_deadline)
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = True
from mpi4py import MPI

INIT_TIMEOUT_VAR = "HPCSPLIT_MPI_INIT_TIMEOUT_S"  # seconds MPI_Init may take (default below)
INIT_TIMEOUT_S = 180.0


def _task_id() -> str:
    for var in ("SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(var, "").isdigit():
            return os.environ[var]
    return str(os.getpid())


def _marker() -> str:
    """``$HPCSPLIT_MPI_INIT_DIR/rank-<task>.txt``, or "" when the launcher asked for no record."""
    folder = os.environ.get(MPI_INIT_DIR_VAR)
    return os.path.join(folder, f"rank-{_task_id()}.txt") if folder else ""


def _record(state: str) -> None:
    """This rank's marker: ``started`` before MPI_Init, ``ready`` after it (``timeout``: the watcher's)."""
    marker = _marker()
    if not marker:
        return
    try:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w", encoding="utf-8") as f:
            f.write(f"{state} {socket.gethostname()} {time.time():.3f}\n")
    except OSError:  # a record for the launcher's retry, never a reason to fail
        pass


# the watcher process of init_with_deadline: argv = fd, timeout, rank pid, marker file, host, message
_WATCHER = """
import os, select, sys, time
fd, limit, rank, marker, host, msg = sys.argv[1:7]
if not select.select([int(fd)], [], [], float(limit))[0]:
    if marker:
        try:
            with open(marker, "w") as f:
                f.write("timeout %s %.3f\\n" % (host, time.time()))
        except OSError:
            pass
    os.write(2, msg.encode())
    os.kill(int(rank), 9)
"""


def init_with_deadline(timeout_s: float | None = None) -> None:
    """``MPI_Init_thread`` with a deadline: a rank whose MPI_Init does not return names itself and exits.

    MPI_Init waits on the process manager's PMI exchange with every other rank; when a message of it
    is lost (Slurm 22.05's pmi2 server misreading a long value: "value not properly terminated") it
    waits for ever.  After ``HPCSPLIT_MPI_INIT_TIMEOUT_S`` (default 180 s; 0: no deadline) this rank is
    named on stderr and killed (SIGKILL; no work has started), so the launcher may start the ranks again (``launcher=slurm`` does, once; see :func:`hpcsplit.launch.slurm.startup_failed`).
    """
    if MPI.Is_initialized():
        return
    if timeout_s is None:
        try:
            timeout_s = float(os.environ.get(INIT_TIMEOUT_VAR, INIT_TIMEOUT_S))
        except ValueError:
            timeout_s = INIT_TIMEOUT_S
    _record("started")
    if timeout_s <= 0:  # no deadline
        MPI.Init_thread(MPI.THREAD_SERIALIZED)
        _record("ready")
        return
    msg = (f"[rank {_task_id()}] MPI_Init did not finish within {timeout_s:g} s on {socket.gethostname()}: the "
           "ranks' startup exchange with the process manager (srun's PMI, mpiexec) is stuck, or another rank never "
           f"started; this rank stops (nothing ran yet: starting the job again may work; {INIT_TIMEOUT_VAR} sets "
           "the limit)\n")
    # MPI_Init holds the GIL while it waits, so no Python thread or signal handler can run: the watcher
    # is a separate small process (forked, then exec'd: it must not look like a rank to anyone who
    # lists the job's processes), which ends when the pipe closes (MPI_Init returned, or this rank died)
    r, w = os.pipe()
    argv = [sys.executable, "-I", "-S", "-c", _WATCHER, str(r), repr(float(timeout_s)), str(os.getpid()), _marker(),
            socket.gethostname(), msg]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: exec the watcher, or give up watching
        try:
            # nothing of the rank's but the pipe and stderr: above all not the PMI socket (PMI_FD), which
            # a second holder broke (MPI_Init's exchange with slurmstepd aborted in a two-node profile job)
            os.closerange(3, r)
            os.closerange(r + 1, 1 << 16)
            os.set_inheritable(r, True)
            os.execve(sys.executable, argv, {})
        finally:
            os._exit(0)
    os.close(r)
    try:
        MPI.Init_thread(MPI.THREAD_SERIALIZED)
    finally:
        os.close(w)
        os.waitpid(pid, 0)
    _record("ready")


init_with_deadline()


def get_comm(comm: Any | None = None) -> Any:
    """Return ``comm`` or ``MPI.COMM_WORLD``."""
    return MPI.COMM_WORLD if comm is None else comm


def check_world_size(comm: Any | None = None, expected: int | None = None) -> None:
    """Fail loudly when the MPI world does not match SLURM's task count or ``expected``.

    Without ``srun --mpi=pmi2`` (or ``SLURM_MPI_TYPE``) srun starts N singleton
    worlds of size 1; each would think it is alone.
    """
    comm = get_comm(comm)
    size = comm.Get_size()
    ntasks = os.environ.get("SLURM_NTASKS") if _started_by_srun() else None
    if ntasks is not None and int(ntasks) != size:
        raise WorldSizeError(
            f"MPI world size is {size} but SLURM started {ntasks} tasks (SLURM_NTASKS). "
            "srun started separate singleton MPI worlds: run the step with `srun --mpi=pmi2` "
            "or `export SLURM_MPI_TYPE=pmi2` (cluster.slurm.srun_mpi in the config)."
        )
    if expected is not None and expected != size:
        raise WorldSizeError(
            f"this job needs {expected} MPI ranks but runs with {size}; "
            f"start it with `mpiexec -n {expected}` (or --ntasks={expected} under SLURM)."
        )


def _started_by_srun() -> bool:
    """True when srun (not a process manager such as MPICH's or Open MPI's mpiexec) started this rank.

    ``mpiexec`` inside an sbatch allocation inherits the allocation's ``SLURM_*`` variables, which then
    describe the allocation, not this MPI world; Hydra (MPICH) sets ``MPI_LOCALNRANKS`` and Open MPI
    sets ``OMPI_COMM_WORLD_SIZE`` in the ranks it starts.
    """
    if "MPI_LOCALNRANKS" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ:
        return False
    return os.environ.get("SLURM_STEP_ID") is not None and "SLURM_PROCID" in os.environ


ABORT_FORWARD_S = 0.5  # seconds between flushing stdio and MPI_Abort (see abort)


def abort(comm: Any | None = None, code: int = 1) -> None:
    """Flush stdio, give the launcher a moment to forward it, and abort every rank of the job (never returns).

    MPICH's ``mpiexec`` (hydra) tears the job down on ``MPI_Abort`` and can drop output still on its way
    from the ranks: a CI run once lost the very error line that explained the abort.  Half a second
    lets it through; an abort is the slow path anyway.
    """
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(ABORT_FORWARD_S)
    finally:
        get_comm(comm).Abort(code)


def mpi_library_version() -> str:
    """First line of the MPI library's version string (e.g. ``MPICH Version: 5.0.2``)."""
    return MPI.Get_library_version().strip().splitlines()[0]
