"""The one module that imports mpi4py.

The profiler, the probe and the runtime share it.  MPI functions elsewhere take
``comm=None`` and resolve it here (default ``COMM_WORLD``), like dask-mpi.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from hpcsplit.errors import WorldSizeError

__all__ = ["MPI", "abort", "check_world_size", "get_comm", "mpi_library_version"]

# Initialise threads only as needed; the runtime polls from one thread.
import mpi4py

mpi4py.rc.thread_level = "serialized"
from mpi4py import MPI


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
