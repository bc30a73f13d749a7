"""Stages ``serve`` and ``bench``: the rank entry point every rank of the job runs, and their settings.

    python -m hpcsplit stage=serve  ...      # runtime.mode=batch: inputs file -> outputs file
    python -m hpcsplit stage=bench +experiment=clip   # whole model vs split plan at each bench.qps

This module is the only reader of the config dict in :mod:`hpcsplit.runtime`: it turns ``cfg["runtime"]``
and ``cfg["bench"]`` into the settings of :mod:`hpcsplit.runtime.settings` (``[Note: settings]`` in
:mod:`hpcsplit.core.settings`), the run folder's files into :class:`~hpcsplit.core.paths.RunPaths`, reads the
plan, and hands typed values to :mod:`hpcsplit.runtime.rank`.

[Note: serve rank lifecycle]
Every rank: read the plan, set its thread share and OMP wait policy (``threads.configure_rank``, before
the first ``import torch``), bind its GPU and memory slice (or CPU threads), load the switchboard and
derive the dataflow (``routing.build_dataflow``, the same pure function on every rank).  A component
rank (:mod:`~hpcsplit.runtime.component`) loads only its component, checks it on the switchboard's
example activations, then runs :func:`~hpcsplit.runtime.component.serve_component` until the frontend
says STOP.  The frontend (:mod:`~hpcsplit.runtime.frontend_rank`) pushes requests through, checks the
end-to-end outputs against the golden outputs, then serves the batch file or the benchmark levels
(:mod:`~hpcsplit.runtime.benchmark`).  Bench mode repeats this per variant (``whole`` = the unsplit
model on the same ranks, then ``split``), each ended by STOP.  At the end components send their counters
to rank 0 and everyone meets at a non-spinning barrier.

Faults: an exception in a component is sent to the frontend as an ERROR message naming rank,
component and requests; the frontend writes the outputs finished so far (batch mode) and raises, and
``hpcsplit.launch.rank`` aborts the job.  The component raises too, after ``runtime.abort_grace_s``, in case
the frontend cannot.

[Note: torch after the thread settings]
OpenMP reads ``OMP_NUM_THREADS`` and ``OMP_WAIT_POLICY`` once, when ``import torch`` loads it
(``[Note: rank threads]`` in :mod:`~hpcsplit.runtime.threads`).  So this module imports nothing that
imports torch: :func:`mpi_main` sets the variables first and only then imports the rank's modules
(:data:`RANK_MODULE`, which imports torch, the switchboard reader and the rank loops) by name.  It is the
one import by name in the runtime, and only for this order; the layer test sees that module's own imports.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from hpcsplit.core import mpi as _mpi
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan
from hpcsplit.runtime.settings import SETTINGS, stage_settings
from hpcsplit.runtime.threads import configure_rank

__all__ = ["SETTINGS", "mpi_main"]

RANK_MODULE = "hpcsplit.runtime.rank"  # imported once the thread settings are in place (see the note)




# ------------------------------------------------------------------------------------------ mpi_main
def mpi_main(cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> dict[str, Any] | None:
    """Entry of ``stage=serve`` and ``stage=bench`` on every rank (``[Note: serve rank lifecycle]``).

    Returns
    -------
    dict or None
        On rank 0 the summary (batch: counts, output file, latency; bench: per-level summaries and
        result files); None on other ranks.
    """
    rt, bench = stage_settings(cfg)
    paths = RunPaths.from_config(cfg, Path(run_dir))
    comm = _mpi.get_comm(comm)
    rank = comm.Get_rank()
    plan = Plan.load(paths.plan)
    _mpi.check_world_size(comm, plan.world_size)
    entry = plan.rank_entry(rank)
    node_comm = comm.Split_type(_mpi.MPI.COMM_TYPE_SHARED)
    local_ranks = node_comm.Get_size()
    node_comm.Free()
    choice = configure_rank(rt.threads, rt.omp_wait_policy, entry.threads if plan.device_kind == "cpu" else None,
                            local_ranks)
    ranks = importlib.import_module(RANK_MODULE)  # only now: [Note: torch after the thread settings]
    out: dict[str, Any] | None = ranks.run_rank(comm, rt, bench, paths, plan, entry, choice)
    return out
