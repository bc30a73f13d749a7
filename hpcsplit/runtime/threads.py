"""CPU hygiene of a rank: thread share and OpenMP wait policy, set before torch is imported.

[Note: rank threads]
OpenMP (libgomp, which torch loads) reads ``OMP_NUM_THREADS`` and ``OMP_WAIT_POLICY`` once, when the
library initialises, i.e. when ``import torch`` runs.  The rank entry point (``hpcsplit.launch.rank``) imports
nothing heavy, and :func:`hpcsplit.runtime.stage.mpi_main` calls :func:`configure_rank` before its
first ``import torch``; torch already imported by then is reported in the log (the launch layer must
then export the variables itself).  Precedence of the thread count (first that applies):

1. ``runtime.threads`` in the config (an explicit user choice);
2. ``OMP_NUM_THREADS`` already in the environment (the user exported it);
3. the plan's ``threads`` for this rank, on CPU plans (the allocator's choice);
4. ``SLURM_CPUS_PER_TASK``;
5. cores of the node / MPI ranks on the node (at least 1).

``OMP_WAIT_POLICY``: the environment's value if set, else ``runtime.omp_wait_policy`` (default
``PASSIVE``: idle OpenMP workers sleep instead of spinning, which matters when ranks share cores).
``MKL_NUM_THREADS`` and ``OPENBLAS_NUM_THREADS`` follow the thread count unless set.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ThreadChoice", "choose_threads", "configure_rank", "cpu_seconds", "cpu_seconds_each", "cpu_seconds_of", "usable_cores"]


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    """How many threads a rank uses, and why."""

    threads: int
    source: str
    omp_wait_policy: str | None
    wait_policy_source: str
    torch_was_imported: bool = False
    local_ranks: int = 1  # ranks of the job on this node

    def describe(self) -> str:
        s = (f"threads={self.threads} ({self.source}), OMP_WAIT_POLICY={self.omp_wait_policy} "
             f"({self.wait_policy_source})")
        if self.torch_was_imported:
            s += " [torch was imported before: OMP settings may not apply; export them in the launcher]"
        return s


def usable_cores() -> int:
    """Cores this process may run on (affinity mask), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def choose_threads(
    cfg_threads: int | None,
    env: MutableMapping[str, str],
    plan_threads: int | None,
    local_ranks: int,
    cores: int,
) -> tuple[int, str]:
    """Thread count for one rank (``[Note: rank threads]``).

    Examples
    --------
    >>> choose_threads(None, {}, None, local_ranks=4, cores=16)
    (4, 'cores 16 / 4 ranks on the node')
    >>> choose_threads(None, {"SLURM_CPUS_PER_TASK": "8"}, None, 4, 64)
    (8, 'SLURM_CPUS_PER_TASK')
    >>> choose_threads(None, {"OMP_NUM_THREADS": "3"}, 2, 4, 64)
    (3, 'OMP_NUM_THREADS from the environment')
    >>> choose_threads(2, {"OMP_NUM_THREADS": "3"}, 1, 4, 64)
    (2, 'runtime.threads')
    """
    if cfg_threads:
        return max(1, int(cfg_threads)), "runtime.threads"
    if env.get("OMP_NUM_THREADS", "").strip().isdigit():
        return max(1, int(env["OMP_NUM_THREADS"])), "OMP_NUM_THREADS from the environment"
    if plan_threads:
        return max(1, int(plan_threads)), "plan"
    if env.get("SLURM_CPUS_PER_TASK", "").strip().isdigit():
        return max(1, int(env["SLURM_CPUS_PER_TASK"])), "SLURM_CPUS_PER_TASK"
    n = max(1, cores // max(1, local_ranks))
    return n, f"cores {cores} / {local_ranks} ranks on the node"


def configure_rank(
    threads: int | None,
    omp_wait_policy: str | None,
    plan_threads: int | None,
    local_ranks: int,
    env: MutableMapping[str, str] | None = None,
) -> ThreadChoice:
    """Set OMP/MKL/OpenBLAS variables for this rank; call before ``import torch``.

    Parameters
    ----------
    threads : int or None
        ``runtime.threads`` (None or 0: choose, ``[Note: rank threads]``).
    omp_wait_policy : str or None
        ``runtime.omp_wait_policy``, used unless ``OMP_WAIT_POLICY`` is exported; None leaves OpenMP's default.
    plan_threads : int or None
        The plan's threads for this rank (CPU plans).
    local_ranks : int
        MPI ranks on this node.
    env : mapping, optional
        The environment to read and set (default ``os.environ``).
    """
    env = os.environ if env is None else env
    n, source = choose_threads(threads, env, plan_threads, local_ranks, usable_cores())
    env["OMP_NUM_THREADS"] = str(n)
    for var in ("MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env.setdefault(var, str(n))
    policy: str | None
    if env.get("OMP_WAIT_POLICY"):
        policy, psrc = env["OMP_WAIT_POLICY"], "environment"
    else:
        policy, psrc = omp_wait_policy, "runtime.omp_wait_policy"
        if policy:
            env["OMP_WAIT_POLICY"] = policy = str(policy).upper()
    return ThreadChoice(n, source, policy, psrc, "torch" in sys.modules, max(1, int(local_ranks)))


def cpu_seconds() -> float:
    """CPU time of this process, all threads (user + system)."""
    return time.process_time()


def cpu_seconds_each(pids: Iterable[int]) -> list[float | None]:
    """CPU time (user + system, every thread) of each of these processes of this node from ``/proc/PID/stat``, in
    seconds (10 ms steps); None for one that cannot be read (gone, or not Linux).

    Examples
    --------
    >>> [c is None or c >= 0 for c in cpu_seconds_each([os.getpid()])]
    [True]
    """
    tick = os.sysconf("SC_CLK_TCK")
    out: list[float | None] = []
    for pid in pids:
        try:
            f = Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()
            out.append((int(f[11]) + int(f[12])) / tick)  # utime, stime (fields 14 and 15 of proc(5))
        except (OSError, IndexError, ValueError):
            out.append(None)
    return out


def cpu_seconds_of(pids: Iterable[int]) -> float | None:
    """CPU time (user + system, every thread) of processes of this node from ``/proc/PID/stat``, in seconds
    (10 ms steps); a process gone counts nothing; None where none can be read (not Linux).

    Examples
    --------
    >>> cpu_seconds_of([os.getpid()]) is None or cpu_seconds_of([os.getpid()]) >= 0
    True
    """
    each = [c for c in cpu_seconds_each(pids) if c is not None]
    return sum(each) if each else None
