"""Entry point of one MPI rank of an hpcsplit job.

Usage (started by the launch layer)::

    mpiexec -n N python -m mpi4py -m hpcsplit._rank MODULE:FUNCTION CFG.json RUN_DIR

``python -m mpi4py`` turns an uncaught exception into ``MPI_Abort`` so a failing
rank stops the whole job instead of leaving the others waiting.  We also catch
exceptions ourselves, print them with the rank prefix and abort, which covers
entry points that do not go through ``python -m mpi4py`` (submitit's srun line).

Rank 0's return value is written as JSON to ``RUN_DIR/<function>.result.json``.
"""

from __future__ import annotations

import importlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any


def resolve(entry: str) -> Any:
    """Import ``"package.module:function"``."""
    mod_name, _, func_name = entry.partition(":")
    if not func_name:
        raise ValueError(f"entry point {entry!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(mod_name), func_name)


def result_path(run_dir: str | Path, entry: str) -> Path:
    """Where rank 0's return value of ``entry`` is written."""
    func = entry.partition(":")[2]
    mod = entry.partition(":")[0].rsplit(".", 1)[-1]
    return Path(run_dir) / f"{mod}.{func}.result.json"


def run_rank(entry: str, cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> Any:
    """Run ``entry(cfg, run_dir, comm)`` on this rank; on any exception print it and abort the job."""
    from hpcsplit import _mpi

    comm = _mpi.get_comm(comm)
    rank = comm.Get_rank()
    try:
        _mpi.check_world_size(comm)
        out = resolve(entry)(cfg, run_dir, comm=comm)
        if rank == 0:
            path = result_path(run_dir, entry)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(out, indent=2, default=str))
        return out
    except BaseException as e:
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
        print("usage: python -m mpi4py -m hpcsplit._rank MODULE:FUNCTION CFG.json RUN_DIR", file=sys.stderr)
        return 2
    entry, cfg_path, run_dir = argv
    cfg = json.loads(Path(cfg_path).read_text())
    run_rank(entry, cfg, run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
