"""The allocator's results: :class:`Option`, :class:`Replica`, :class:`Allocation` (a leaf module).

Every other allocation module imports these; this one imports only ``core``, so that the solver
(:mod:`hpcsplit.allocation.solve`), the time-sharing pass (:mod:`hpcsplit.allocation.timeshare`) and
the plan checks (:mod:`hpcsplit.allocation.to_plan`) need no import cycle.  An :class:`Allocation`
unfolds into the rank table the runtime reads with :meth:`Allocation.to_plan`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.plan import Plan, RankEntry

__all__ = ["Allocation", "Option", "Replica"]


@dataclass(frozen=True, slots=True)
class Option:
    """One way to run one replica of a component (see ``[Note: allocation options]`` in
    :mod:`hpcsplit.allocation.options`)."""

    component: str
    batch_size: int
    slice_size: float  # GB (GPU) or threads (CPU), as the cluster names it
    profile_slice: float  # the profile column the figures come from
    throughput_rps: float
    latency_ms: float  # the SLO quantile of the latency
    mem_bytes: float
    utilization: float


@dataclass(frozen=True, slots=True)
class Replica:
    """One placed replica: where it runs and what it predicts."""

    node: int
    gpu: int | None
    slot: int
    option: Option


@dataclass(frozen=True, slots=True)
class Allocation:
    """The allocator's answer: replicas per device and predicted figures."""

    model: str
    switchboard_sha256: str | None
    cluster: ClusterSpec
    components: tuple[str, ...]
    weights: dict[str, float]
    replicas: tuple[Replica, ...]
    throughput_rps: dict[str, float]
    leximin: tuple[float, ...]  # sorted throughput / weight of weighted components
    device_utilization: dict[str, float]
    solve: dict[str, Any] = field(default_factory=dict)
    frontend_cores: int = 1

    @property
    def min_normalised_throughput(self) -> float:
        return self.leximin[0] if self.leximin else 0.0

    def to_plan(self) -> Plan:
        """The :class:`~hpcsplit.core.plan.Plan`: rank 0 the frontend on node 0, then one rank per
        replica ordered by (node, GPU, slot), so that srun's block distribution places them."""
        cl = self.cluster
        reps = sorted(self.replicas, key=lambda r: (r.node, -1 if r.gpu is None else r.gpu, r.slot))
        per_node = Counter(r.node for r in reps)
        ranks = [RankEntry(0, "frontend", 0, None, None, max(1, self.frontend_cores), None, 1, 0)]
        next_rep: dict[str, int] = defaultdict(int)
        for r in reps:
            c = r.option.component
            threads = (
                _gpu_threads(cl, r.node, per_node[r.node], self.frontend_cores)
                if cl.is_gpu
                else int(r.option.slice_size)
            )
            ranks.append(
                RankEntry(
                    rank=len(ranks),
                    role="component",
                    node=r.node,
                    gpu=r.gpu,
                    slice_gb=float(r.option.slice_size) if cl.is_gpu else None,
                    threads=threads,
                    component=c,
                    batch_size=r.option.batch_size,
                    replica=next_rep[c],
                )
            )
            next_rep[c] += 1
        meta = {
            "cluster": cl.name,
            "weights": dict(self.weights),
            "leximin": list(self.leximin),
            "frontend_cores": self.frontend_cores,
            "solve": self.solve,
            "latency_ms": {str(i + 1): r.option.latency_ms for i, r in enumerate(reps)},
            "nodes_used": sorted({r.node for r in reps} | {0}),
        }
        return Plan(
            model=self.model,
            switchboard_sha256=self.switchboard_sha256,
            device_kind=cl.device_kind,
            nodes=cl.nodes,
            ranks=tuple(ranks),
            predicted_throughput_rps=dict(self.throughput_rps),
            utilization=dict(self.device_utilization),
            meta=meta,
        )

    def summary(self) -> str:
        """A few readable lines: throughput per component, replicas, solve figures."""
        s = self.solve
        lines = [
            f"allocation on {self.cluster.name} ({self.cluster.device_kind}, {self.cluster.nodes} node(s)): "
            f"{len(self.replicas)} replicas, solver {s.get('solver')} ({s.get('mode')}), "
            f"{s.get('solve_s', 0):.2f} s, gap {s.get('gap', 0):.2%}"
            + (" [stopped at a limit]" if s.get("limit_hit") else "")
            + (" [wall clock: may differ on another machine]" if s.get("clock_hit") else ""),
        ]
        for c in self.components:
            n = sum(1 for r in self.replicas if r.option.component == c)
            w = self.weights.get(c, 1.0)
            lines.append(f"  {c:<24} {self.throughput_rps[c]:>12.1f} req/s  weight {w:g}  {n} replica(s)")
        return "\n".join(lines)


def _gpu_threads(cluster: ClusterSpec, node: int, ranks_on_node: int, frontend_cores: int) -> int:
    """CPU threads of one GPU rank: the node's cores (less the frontend's on node 0) shared evenly."""
    avail = cluster.cores_per_node - (frontend_cores if node == 0 else 0)
    return max(1, avail // max(1, ranks_on_node))
