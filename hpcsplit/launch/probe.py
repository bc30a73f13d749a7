"""``stage=probe``: who runs where.  The first job to run on a new cluster.

Every rank describes itself (host, rank / world size, the GPU it would own, CPUs, thread settings,
MPI library); rank 0 gathers the rows and prints one table.  It proves that the launch path works:
under SLURM a world size of 1 on every rank means srun was started without ``--mpi=pmi2``, and
``hpcsplit.launch.rank.run_rank`` already refuses that (``check_world_size``).

Run it with ``python -m hpcsplit stage=probe`` (``launcher.ranks=3`` for 3 local ranks,
``launcher=slurm cluster=dev`` on a cluster), or ``sbatch slurm/probe.sbatch`` without Hydra.

[Note: GPU a rank owns]
A rank owns ``CUDA_VISIBLE_DEVICES[local_rank % n]`` when several devices are visible, the only
visible device when one is (srun ``--gpus-per-task=1`` / ``--gpu-bind``), and ``local_rank % count``
when CUDA works but nothing restricts visibility.  ``local_rank`` is ``SLURM_LOCALID`` under srun,
else the rank within the node's shared-memory communicator.  The runtime uses the same rule
(:func:`~hpcsplit.launch.probe_table.owned_gpu`).  ``CUDA_VISIBLE_DEVICES`` set by SLURM's gres
does not mean CUDA exists: the dev cluster's GPUs are symlinks to /dev/null.

This module imports mpi4py (through :mod:`hpcsplit.core.mpi`), so only rank processes import it;
its pure parts (:func:`owned_gpu`, :func:`format_table`) live in :mod:`hpcsplit.launch.probe_table`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from typing import Any

from hpcsplit.core import mpi as _mpi
from hpcsplit.core.mpi import MPI
from hpcsplit.core.paths import RunPaths
from hpcsplit.launch.probe_table import format_table, owned_gpu
from hpcsplit.runtime.netaddr import job_network, node_address

__all__ = ["format_table", "mpi_main", "owned_gpu", "probe_row"]

def _local_rank(comm: Any) -> int:
    if os.environ.get("SLURM_LOCALID") is not None and os.environ.get("SLURM_STEP_ID") is not None:
        return int(os.environ["SLURM_LOCALID"])
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return int(node.Get_rank())
    finally:
        node.Free()


def _nvml_info(device: str | None) -> dict[str, Any]:
    """Name, memory and MIG mode of ``device`` from NVML; ``nvml_error`` when NVML does not work."""
    info: dict[str, Any] = {"gpu_name": None, "gpu_mem_gb": None, "mig_mode": None, "nvml_error": None}
    if device is None:
        return info
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no driver, no library: report, do not fail
        info["nvml_error"] = f"{type(e).__name__}: {e}"
        return info
    try:
        if device.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(device))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(device)
        name = pynvml.nvmlDeviceGetName(handle)
        info["gpu_name"] = name.decode() if isinstance(name, bytes) else str(name)
        info["gpu_mem_gb"] = round(pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30, 1)
        try:
            current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
            info["mig_mode"] = "on" if current == pynvml.NVML_DEVICE_MIG_ENABLE else "off"
        except pynvml.NVMLError:
            info["mig_mode"] = "n/a"
    except Exception as e:  # noqa: BLE001
        info["nvml_error"] = f"{type(e).__name__}: {e}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return info


def _torch_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency
        return {"torch_threads": None, "cuda_available": False, "cuda_count": 0, "torch_error": str(e)}
    cuda = bool(torch.cuda.is_available())
    return {
        "torch_threads": torch.get_num_threads(),
        "cuda_available": cuda,
        "cuda_count": torch.cuda.device_count() if cuda else 0,
    }


def _address(network: str | None) -> str:
    """Where other nodes reach this rank's node (the doorbell's rule, ``runtime.doorbell_network``), or why not."""
    try:
        return node_address(job_network(network))
    except (OSError, ValueError, UnicodeError) as e:
        return f"? ({e})"


def probe_row(comm: Any, network: str | None = None) -> dict[str, Any]:
    """This rank's row of the probe table (plain JSON-able values).

    ``network``: ``runtime.doorbell_network`` (the ``address`` column: where other nodes reach this node).
    """
    env = os.environ
    local_rank = _local_rank(comm)
    torch_info = _torch_info()
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpu = owned_gpu(local_rank, visible, torch_info["cuda_count"])
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        usable = os.cpu_count() or 1
    row: dict[str, Any] = {
        "host": socket.gethostname(),
        "address": _address(network),
        "rank": comm.Get_rank(),
        "world_size": comm.Get_size(),
        "local_rank": local_rank,
        "gpu": gpu,
        "cuda_visible_devices": visible,
        "slurm_job_gpus": env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS"),
        **torch_info,
        **_nvml_info(gpu if torch_info["cuda_available"] or visible else None),
        "cpus_per_task": int(env["SLURM_CPUS_PER_TASK"]) if env.get("SLURM_CPUS_PER_TASK") else None,
        "cpus_usable": usable,
        "omp_num_threads": env.get("OMP_NUM_THREADS"),
        "omp_wait_policy": env.get("OMP_WAIT_POLICY"),
        "mpi_library": " ".join(_mpi.mpi_library_version().split()),
        "slurm_job_id": env.get("SLURM_JOB_ID"),
        "slurm_ntasks": int(env["SLURM_NTASKS"]) if env.get("SLURM_NTASKS") else None,
        "pid": os.getpid(),
    }
    return row


def mpi_main(cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> list[dict[str, Any]] | None:
    """Gather every rank's :func:`probe_row` on rank 0, print the table and return the rows.

    Parameters
    ----------
    cfg : dict
        The resolved config (only ``paths``: the probe reports the environment it finds).
    run_dir : str
        Where ``probe.txt`` is written (rank 0).
    comm : mpi4py communicator, optional
        Default ``COMM_WORLD``.

    Returns
    -------
    list of dict or None
        The rows ordered by rank on rank 0, None on the other ranks.
    """
    comm = _mpi.get_comm(comm)
    network = (cfg.get("runtime") or {}).get("doorbell_network")
    rows = comm.gather(probe_row(comm, network), root=0)
    if comm.Get_rank() != 0:
        return None
    rows = sorted(rows, key=lambda r: r["rank"])
    table = format_table(rows)
    print(table, flush=True)
    out = RunPaths.from_config(cfg, run_dir).probe_table
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table + "\n")
    except OSError as e:  # the table is printed anyway
        print(f"[rank 0] could not write {out}: {e}", file=sys.stderr)
    return rows


def _raise_for_tests(cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> None:
    """Test-only entry point: the last rank raises while the others wait in a barrier."""
    comm = _mpi.get_comm(comm)
    if comm.Get_rank() == comm.Get_size() - 1:
        raise RuntimeError(f"deliberate failure on rank {comm.Get_rank()} (hpcsplit.launch.probe:_raise_for_tests)")
    comm.Barrier()


def _crash_for_tests(cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> None:
    """Test-only entry point: the last rank is killed (SIGKILL, no result) while the others wait."""
    comm = _mpi.get_comm(comm)
    if comm.Get_rank() == comm.Get_size() - 1:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    comm.Barrier()


def _hang_for_tests(cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> None:
    """Test-only entry point: rank 0 sleeps forever while the others wait (timeout handling)."""
    comm = _mpi.get_comm(comm)
    if comm.Get_rank() == 0:
        while True:
            time.sleep(1)
    comm.Barrier()
