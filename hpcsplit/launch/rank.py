"""Entry point of one MPI rank of an hpcsplit job.

Usage (started by the launch layer)::

    mpiexec -n N python -m mpi4py -m hpcsplit.launch.rank MODULE:FUNCTION CFG.json RUN_DIR

``python -m mpi4py`` turns an uncaught exception into ``MPI_Abort`` so a failing
rank stops the whole job instead of leaving the others waiting.  We also catch
exceptions ourselves, print them with the rank prefix and abort, which covers
entry points that do not go through ``python -m mpi4py`` (submitit's srun line).

Rank 0's return value is written as JSON to ``RUN_DIR/<result_name(entry)>``
(:func:`hpcsplit.core.paths.result_name`: ``runtime.mpi_main.result.json`` for
``hpcsplit.runtime.stage:mpi_main``).  This module imports mpi4py (through
:mod:`hpcsplit.core.mpi`): the login side never imports it, SLURM tasks reach
:func:`run_rank` by name (``hpcsplit.launch.slurm.RANK_ENTRY``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from hpcsplit.core import mpi as _mpi
from hpcsplit.core.detect import bind_rank_devices
from hpcsplit.core.paths import result_name
from hpcsplit.errors import RankLeftJob
from hpcsplit.launch.stages import resolve

__all__ = ["LEFT_JOB_EXIT", "main", "run_rank"]

LEFT_JOB_EXIT = 1  # a rank that left a job going on without it (RankLeftJob); hydra ORs the ranks' codes,
# so anything else would make a SIGKILLed rank's 137 look like another signal


def run_rank(entry: str, cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> Any:
    """Run ``entry(cfg, run_dir, comm)`` on this rank; on any exception print it and abort the job.

    :class:`~hpcsplit.errors.RankLeftJob` is the exception: this rank leaves a server that goes on without it
    (``[Note: serving through faults]`` in :mod:`hpcsplit.runtime.server.failover`), so it exits
    (:data:`LEFT_JOB_EXIT`, no ``MPI_Finalize``, which would wait for the others) without aborting them."""
    comm = _mpi.get_comm(comm)
    rank = comm.Get_rank()
    try:
        _mpi.check_world_size(comm)
        bind_rank_devices(rank)  # launcher=local with MIG: this rank's instance, before torch loads
        out = resolve(entry)(cfg, run_dir, comm=comm)
        if rank == 0:
            path = Path(run_dir) / result_name(entry)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=2, default=str))
        return out
    except BaseException as e:
        if isinstance(e, RankLeftJob):  # the job goes on without this rank (server mode): no abort
            sys.stderr.write(f"[rank {rank}] {e}\n")
            sys.stderr.flush()
            os._exit(LEFT_JOB_EXIT)
        if isinstance(e, SystemExit):
            if not e.code:
                raise
            # e.g. submitit exiting after a checkpoint/requeue signal: expected, no traceback
            sys.stderr.write(f"[rank {rank}] exiting with code {e.code}\n")
        else:
            sys.stderr.write(f"[rank {rank}] {type(e).__name__}: {e}\n{traceback.format_exc()}")
        sys.stderr.write(f"[rank {rank}] aborting the MPI job\n")
        _mpi.abort(comm, 1)
        raise


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 3:
        print("usage: python -m mpi4py -m hpcsplit.launch.rank MODULE:FUNCTION CFG.json RUN_DIR", file=sys.stderr)
        return 2
    entry, cfg_path, run_dir = argv
    cfg = json.loads(Path(cfg_path).read_text())
    run_rank(entry, cfg, run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
