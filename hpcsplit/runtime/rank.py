"""One rank of the serve/bench job once its threads are set: bind, load, derive the dataflow, run its role.

Imported by name from :func:`hpcsplit.runtime.stage.mpi_main` only after the thread settings are in
place, since importing this module loads torch (``[Note: torch after the thread settings]`` there).
"""

from __future__ import annotations

import os
import socket

import torch

from hpcsplit.core import mpi as _mpi
from hpcsplit.core.cluster import slice_fraction
from hpcsplit.core.detect import RANK_DEVICES_VAR
from hpcsplit.core.device import full_fp32_on_gpu
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.errors import PlanError, RuntimeStageError
from hpcsplit.runtime.component import run_component_rank
from hpcsplit.runtime.context import RankContext, barrier, say
from hpcsplit.runtime.doorbell import start_doorbell
from hpcsplit.runtime.faults import (
    describe_rank,
    install_stop_signals,
    leave_degraded_job,
    lost_ranks,
    set_job_processes,
)
from hpcsplit.runtime.frontend_rank import run_frontend
from hpcsplit.runtime.routing import (
    Dataflow,
    build_dataflow,
    graph_from_switchboard,
    served_graph,
    whole_graph_of,
    whole_plan,
)
from hpcsplit.runtime.settings import BenchSettings, RuntimeSettings
from hpcsplit.runtime.threads import ThreadChoice
from hpcsplit.runtime.transport import cuda_aware_mpi, set_node_peers
from hpcsplit.switchboard.reader import Switchboard

__all__ = ["STAGE_ENTRY", "bind_device", "run_rank"]

STAGE_ENTRY = "hpcsplit.runtime.stage:mpi_main"  # the entry point of the ranks (its result file's name)


def bind_device(plan: Plan, entry: RankEntry, rank: int) -> torch.device:
    """This rank's torch device; on CUDA also its memory slice (``slice_gb``)."""
    if plan.device_kind != "cuda" or entry.role != "component":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeStageError(
            f"rank {rank}: the plan places component {entry.component!r} on GPU {entry.gpu}, but CUDA is "
            "not available here. Run on GPU nodes, or allocate for CPU (cluster with gpus_per_node: 0)."
        )
    gpu, slice_gb = entry.gpu, entry.slice_gb
    if gpu is None or slice_gb is None:
        raise RuntimeStageError(f"rank {rank}: the GPU plan gives component {entry.component!r} no gpu or no "
                                f"slice_gb (gpu={gpu}, slice_gb={slice_gb}); re-run the allocate stage")
    n = torch.cuda.device_count()
    if os.environ.get(RANK_DEVICES_VAR):
        # launcher=local gave this rank its own MIG instance (CUDA_VISIBLE_DEVICES is that one UUID):
        # the plan's GPU index names the physical GPU, and the instance is this process's cuda:0.
        gpu = 0
    if gpu >= n:
        raise RuntimeStageError(
            f"rank {rank}: plan says GPU {gpu} but this rank sees {n} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); request all GPUs of the node "
            "for every task (no per-task GPU binding), or re-plan for this node shape."
        )
    dev = torch.device("cuda", gpu)
    torch.cuda.set_device(dev)
    full_fp32_on_gpu()  # as the profile ran (and as the end-to-end check needs)
    # the profile measured this cell under the same cap (GB = GiB, as everywhere in hpcsplit)
    frac = slice_fraction(slice_gb, torch.cuda.get_device_properties(dev).total_memory)
    torch.cuda.set_per_process_memory_fraction(frac, dev)
    return dev


def run_rank(comm: _mpi.MPI.Comm, rt: RuntimeSettings, bench: BenchSettings, paths: RunPaths, plan: Plan,
             entry: RankEntry, threads: ThreadChoice) -> dict[str, object] | None:
    """The rest of :func:`hpcsplit.runtime.stage.mpi_main` (``[Note: serve rank lifecycle]`` there).

    Returns
    -------
    dict or None
        Rank 0's summary; None on other ranks.
    """
    rank = comm.Get_rank()
    install_stop_signals()  # [Note: stop signals]
    torch.set_num_threads(threads.threads)
    device = bind_device(plan, entry, rank)
    aware, why = cuda_aware_mpi()
    role = "frontend" if entry.role == "frontend" else f"component {entry.component!r} replica {entry.replica}"
    say(rank, f"{role}: {threads.describe()}, device {device}, {_mpi.mpi_library_version()}, "
              f"CUDA-aware MPI: {aware} ({why})")
    sb = Switchboard.load(paths.switchboard)
    if plan.switchboard_sha256 and getattr(sb, "sha256", None) and sb.sha256 != plan.switchboard_sha256:
        raise PlanError(
            f"the plan was made for switchboard {plan.switchboard_sha256[:12]} but "
            f"{paths.switchboard} is {sb.sha256[:12]}; pass the matching "
            "switchboard=... or re-run the allocate stage"
        )
    graph = graph_from_switchboard(sb)
    variants: list[tuple[str, Dataflow]] = []
    whole_only = rt.mode == "server" and rt.server_model == "whole"  # the unsplit baseline behind the endpoint
    if rt.mode == "bench" or whole_only:
        variants.append(("whole", build_dataflow(whole_plan(plan), whole_graph_of(graph))))
    if not whole_only:  # the plan's groups (or the whole model) as it serves them
        variants.append(("split", build_dataflow(plan, served_graph(graph, plan))))
    if rank == 0:
        say(rank, "plan:\n" + plan.format())
        for vname, df in variants:
            say(rank, f"{vname} " + df.format())
    # MPICH's blocking collectives spin: meet at a sleeping barrier first, so the doorbell's collectives
    # (and, at the end, its close and MPI_Finalize) do not spin while a slower rank loads or plots
    barrier(comm, timeout_s=rt.load_timeout_s, what="loading the switchboard",
            name=lambda r: describe_rank(plan, r))
    procs = [(str(h), int(p)) for h, p in comm.allgather((socket.gethostname(), os.getpid()))]
    set_job_processes(procs)  # [Note: lost ranks]
    hosts = tuple(h for h, _ in procs)
    set_node_peers(comm, [r for r, h in enumerate(hosts) if h == hosts[rank]])  # the transport's inline limits
    ctx = RankContext(comm=comm, rank=rank, runtime=rt, bench=bench, plan=plan, entry=entry, switchboard=sb,
                      paths=paths, device=device, threads=threads, hosts=hosts)
    db = None
    if rt.doorbell:  # [Note: doorbell]
        db = start_doorbell(comm, rt.doorbell is True, rt.doorbell_network)
        if db.note:
            say(rank, db.note)
    out: dict[str, object] | None = None
    if entry.role == "frontend":
        out = run_frontend(ctx, variants)
    else:
        run_component_rank(ctx, variants)
    ctx.barrier("the end of the job", rt.wait_bound_s)
    if lost_ranks():  # a server that lost replicas: [Note: lost ranks] in hpcsplit.runtime.faults
        leave_degraded_job(comm, paths.rank_result(STAGE_ENTRY) if rank == 0 else None, out)
    if db is not None and not lost_ranks():  # collective: only on success, with every rank there
        db.close()
    return out
