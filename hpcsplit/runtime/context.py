"""What a rank of the serve/bench job set up, as one typed value, and the helpers every rank uses.

:func:`hpcsplit.runtime.rank.run_rank` builds a :class:`RankContext` once the rank has its threads,
device and switchboard (``[Note: serve rank lifecycle]`` in :mod:`hpcsplit.runtime.stage`); the frontend
(:mod:`~hpcsplit.runtime.frontend_rank`), the component ranks (:mod:`~hpcsplit.runtime.component`) and the
benchmark (:mod:`~hpcsplit.runtime.benchmark`) take it instead of the config dict.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hpcsplit.core.mpi import MPI
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.runtime.faults import describe_rank, named_barrier
from hpcsplit.runtime.mailbox import spin_after_work_s
from hpcsplit.runtime.routing import Dataflow
from hpcsplit.runtime.settings import BenchSettings, RuntimeSettings
from hpcsplit.runtime.threads import ThreadChoice
from hpcsplit.runtime.trace import Tracer
from hpcsplit.switchboard.reader import Switchboard

__all__ = ["FLOOR_WAIT_SLEEP_S", "TAG_STATS", "RankContext", "barrier", "floor_turns", "say"]

TAG_STATS = 7201  # component ranks' counters to rank 0 at the end
FLOOR_WAIT_SLEEP_S = 0.02  # ranks waiting for another's floor timing wake at most 50 times a second


@dataclass(frozen=True, slots=True)
class RankContext:
    """Everything one rank set up in :func:`hpcsplit.runtime.stage.mpi_main`."""

    comm: MPI.Comm
    rank: int
    runtime: RuntimeSettings
    bench: BenchSettings
    plan: Plan
    entry: RankEntry
    switchboard: Switchboard
    paths: RunPaths
    device: torch.device
    threads: ThreadChoice
    hosts: tuple[str, ...] = ()  # hostname of every rank (for messages naming a rank)

    def name(self, rank: int) -> str:
        """A rank as messages name it: number, component, node, host."""
        return describe_rank(self.plan, rank, self.hosts)

    def barrier(self, what: str, timeout_s: float | None, while_waiting: Callable[[], object] | None = None,
                max_sleep_s: float = 1e-3) -> None:
        """A named, non-spinning barrier of the job with a deadline (:func:`barrier`)."""
        barrier(self.comm, while_waiting, max_sleep_s, timeout_s, what, self.name)

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def spin_s(self) -> float:
        """How long this rank's loops poll back to back after work (``[Note: spin after work]``)."""
        return spin_after_work_s(self.runtime.spin_us, self.runtime.mode, self.threads.local_ranks)

    def tracer(self, label: str) -> Tracer:
        """This rank's tracer (``runtime.trace``)."""
        tr = self.runtime.trace
        return Tracer(self.rank, tr.start_step, tr.end_step, label)


def say(rank: int, msg: str) -> None:
    """One line of the rank's log, prefixed with the rank."""
    print(f"[rank {rank}] {msg}", file=sys.stderr, flush=True)


def barrier(comm: MPI.Comm, while_waiting: Callable[[], object] | None = None, max_sleep_s: float = 1e-3,
            timeout_s: float | None = None, what: str = "a barrier",
            name: Callable[[int], str] | None = None) -> None:
    """A barrier that waits without spinning (backoff polling to ``max_sleep_s``), calling ``while_waiting``;
    with ``timeout_s`` rank 0 names the ranks that did not come and raises
    (:func:`hpcsplit.runtime.faults.named_barrier`)."""
    named_barrier(comm, timeout_s, what, name or (lambda r: f"rank {r}"), while_waiting, max_sleep_s)


def floor_turns(ctx: RankContext, df: Dataflow, vname: str) -> list[int]:
    """Ranks that time their component before the split levels, in turn: the first replica of each.

    [Note: floor re-measured]
    The critical-path floor comes from the profile, measured in another process, minutes or hours earlier.
    On a shared or virtual machine the same batch-1 run can take 20% more or less from one minute to the
    next, which is as large as the target (within 10% of the floor).  So in bench mode, before the split
    levels, the first replica of every component runs ``bench.floor_runs`` batches of one back to back,
    one rank at a time (the others wait at a non-spinning barrier), as the profile times them; the bench
    prints the floor from these beside the profile's.  The waiting ranks poll their barrier at most every
    20 ms rather than every 1 ms, so as not to take the core from the rank being timed.  Empty unless
    bench mode, the split variant and ``bench.floor_runs`` > 0; every rank computes the same list.
    """
    if ctx.runtime.mode != "bench" or vname != "split" or ctx.bench.floor_runs <= 0:
        return []
    first: dict[str, int] = {}
    for r, c in sorted(df.rank_component.items()):
        first.setdefault(c, r)
    return sorted(first.values())
