"""A plan, its profile, the switchboard's dataflow and a calibration as a :class:`~hpcsplit.core.simulator.SimSystem`.

[Note: simulated variants]
The simulator serves the same ranks three ways, as the runtime can:

- ``split``: the plan as it is (``runtime.routing.build_dataflow``);
- ``whole``: every component rank of the plan runs the unsplit model at its own batch size and threads (the
  bench's baseline, ``runtime.routing.whole_plan``; ``runtime.server_model=whole``);
- a *grouping* (:func:`grouped`): components merged into groups that one rank runs back to back (what a
  region left unsplit is).  A group's compute at batch ``b`` is the sum of its members' profiled latencies at
  ``b`` on that rank's threads or slice (the whole model is the group of every component), its cold extra the
  sum of its members', its inputs those of its members that come from outside it.

Latency tables come from the profile's p50 at each profiled batch size, linear in between; the column is the
rank's thread count (CPU) or slice (GPU), else the closest profiled one.  The spread of one batch's compute is
the profile's own (lognormal, from the cell's p90 / p50).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcsplit.core.calibration import Calibration, Curve
from hpcsplit.core.grouping import group_name, merge_groups
from hpcsplit.core.plan import Plan
from hpcsplit.core.profile_format import ComponentProfile
from hpcsplit.core.simulator import ServePolicy, SimComponent, SimRank, SimSystem
from hpcsplit.errors import ConfigError, PlanError

__all__ = ["WHOLE", "SimGraph", "binds_cores", "build_system", "grouped", "latency_table"]

WHOLE = "whole"  # as runtime.routing.WHOLE
INPUT = "input"
OUTPUT = "output"


@dataclass(frozen=True, slots=True)
class SimGraph:
    """The dataflow the simulator needs: components with their ports, the edges, bytes per sample of values."""

    inputs: tuple[str, ...]
    components: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]  # (name, inputs, outputs), topological
    edges: tuple[tuple[str, str, str, str], ...]  # (src | "input", src_name, dst | "output", dst_name)
    value_bytes: dict[str, int]  # bytes per sample of each value (component ports and model inputs)

    @classmethod
    def from_layout(cls, layout: Any) -> SimGraph:
        """From a switchboard ``Layout`` (``hpcsplit.switchboard.layout``): duck-typed, so core needs no import."""
        vb: dict[str, int] = {}
        for t in layout.inputs:
            vb[t.name] = int(t.bytes_per_sample)
        comps = []
        by_name = {c.name: c for c in layout.components}
        for name in layout.order:
            c = by_name[name]
            for t in (*c.inputs, *c.outputs):
                vb[t.name] = int(t.bytes_per_sample)
            comps.append((c.name, tuple(t.name for t in c.inputs), tuple(t.name for t in c.outputs)))
        return cls(tuple(t.name for t in layout.inputs), tuple(comps),
                   tuple((e.src, e.src_name, e.dst, e.dst_name) for e in layout.edges), vb)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c[0] for c in self.components)


def grouped(graph: SimGraph, groups: Sequence[Sequence[str]]) -> tuple[SimGraph, dict[str, tuple[str, ...]]]:
    """The graph with each group of components merged into one (``[Note: component groups]``), and group ->
    members (components in no group stand for themselves).

    Examples
    --------
    >>> g = SimGraph(("x",), (("a", ("x",), ("p",)), ("b", ("x",), ("q",)), ("h", ("p", "q"), ("y",))),
    ...              (("input", "x", "a", "x"), ("input", "x", "b", "x"), ("a", "p", "h", "p"),
    ...               ("b", "q", "h", "q"), ("h", "y", "output", "y")), {"x": 4, "p": 8, "q": 8, "y": 4})
    >>> m, members = grouped(g, [["b", "a"]])
    >>> m.names, members["a+b"], m.edges[-2:]
    (('a+b', 'h'), ('a', 'b'), (('a+b', 'q', 'h', 'q'), ('h', 'y', 'output', 'y')))
    """
    names = graph.names
    named = {group_name(g, names): tuple(c for c in names if c in set(g)) or tuple(g) for g in groups}
    comps, edges = merge_groups(graph.components, graph.edges, named)
    members = {c[0]: named.get(c[0], (c[0],)) for c in comps}
    return SimGraph(graph.inputs, comps, edges, dict(graph.value_bytes)), members


def _column(cp: ComponentProfile, want: float) -> int:
    """Profile column for a rank's threads / slice: that one, else the largest below, else the closest."""
    exact = [i for i, s in enumerate(cp.slices) if abs(s - want) < 1e-9]
    if exact:
        return exact[0]
    below = [i for i, s in enumerate(cp.slices) if s < want]
    if below:
        return max(below, key=lambda i: cp.slices[i])
    return min(range(len(cp.slices)), key=lambda i: abs(cp.slices[i] - want))


def latency_table(cp: ComponentProfile, want: float, max_batch: int) -> tuple[tuple[float, ...], float]:
    """``([ms of a batch of b] for b in 1..max_batch, lognormal sigma)`` from one profile column.

    Linear between profiled batch sizes, proportional beyond the largest (throughput held), the batch-1
    figure below the smallest.  Raises :class:`~hpcsplit.errors.PlanError` when the column has no measured
    batch size.
    """
    s = _column(cp, want)
    sizes, p50, sig = [], [], []
    for bi, b in enumerate(cp.batch_sizes):
        row = cp.latency_ms[bi, s]
        row = row[np.isfinite(row)]
        if row.size:
            sizes.append(b)
            p50.append(float(np.median(row)))
            q90 = float(np.quantile(row, 0.9))
            sig.append(math.log(max(q90, 1e-9) / max(p50[-1], 1e-9)) / 1.2816)
    if not sizes:
        raise PlanError(f"the profile of {cp.name!r} has no measured cell at slice {cp.slices[s]:g}: re-profile")
    table = [float(np.interp(b, sizes, p50)) if b <= sizes[-1] else p50[-1] * b / sizes[-1]
             for b in range(1, max(1, max_batch) + 1)]
    return tuple(table), float(max(0.0, np.median(sig)))


def _sum_curves(curves: Sequence[Curve]) -> Curve:
    gaps = sorted({g for c in curves for g in c.gaps_ms})
    return Curve(tuple(gaps), tuple(sum(c.at(g) for c in curves) for g in gaps))


def binds_cores(cfg: Mapping[str, Any]) -> bool:
    """Whether a CPU plan's ranks are simulated bound to cores (``[Note: wake-up placement]`` in
    :mod:`hpcsplit.core.simulator`): ``simulate.bind`` (``core`` or ``none``), else (null) whether
    ``launcher.mpiexec_args`` binds them with ``-bind-to core`` (MPICH) or ``--bind-to core`` (Open MPI). Other
    bindings (``srun --cpu-bind``, Open MPI's own default for two processes or fewer) are not read from anywhere:
    ``simulate.bind=core`` says them.

    >>> binds_cores({"launcher": {"mpiexec_args": ["-bind-to", "core"]}}), binds_cores({})
    (True, False)
    >>> binds_cores({"simulate": {"bind": "none"}, "launcher": {"mpiexec_args": ["--bind-to=core"]}})
    False
    """
    sim = cfg.get("simulate")
    bind = sim.get("bind") if isinstance(sim, Mapping) else None
    if bind is not None:
        if isinstance(bind, bool) or bind not in ("core", "none"):
            raise ConfigError(f"simulate.bind = {bind!r}: needs one of core, none, or null")
        return bool(bind == "core")
    launcher = cfg.get("launcher")
    args = launcher.get("mpiexec_args") if isinstance(launcher, Mapping) else None
    args = [str(a) for a in args] if isinstance(args, list | tuple) else []
    return any(a in ("-bind-to", "--bind-to") and b == "core" for a, b in itertools.pairwise(args)) or any(
        a in ("-bind-to=core", "--bind-to=core") for a in args)


def build_system(plan: Plan, profiles: Mapping[str, ComponentProfile], graph: SimGraph, calibration: Calibration,
                 policy: ServePolicy, *, variant: str = "split", groups: Sequence[Sequence[str]] = (),
                 cores_per_node: float | None = None, switchboard_sha256: str | None = None,
                 scale: Mapping[str, float] | None = None, bind_cores: bool = False) -> SimSystem:
    """The :class:`SimSystem` of ``plan`` served as ``variant`` (``[Note: simulated variants]``).

    Parameters
    ----------
    plan, profiles, graph, calibration, policy
        The plan, its components' profiles (name -> :class:`ComponentProfile`), the dataflow, the costs and the
        runtime's settings.
    variant : "split" | "whole" | "grouped"
        ``grouped`` merges ``groups``; the plan's ranks then name either a group (``a+b``) or a member of one.
    cores_per_node : float, optional
        CPU plans: the cores the node's ranks share (the cluster's ``cores_per_node``); ignored on GPU plans.
    switchboard_sha256 : str, optional
        Whose programs the calibration may hold (their cold extras).
    scale : mapping, optional
        Component -> factor on its profiled latencies (the machine's speed now against the profile's: the floor
        a bench re-measured, ``[Note: floor re-measured]``).
    bind_cores : bool
        CPU plans: each rank bound to one core of its node, in rank order (``SimSystem.bind_cores``).
    """
    if variant == "whole":
        g, members = grouped(graph, [list(graph.names)])
        whole_name = next(iter(members))
        members = {WHOLE: members[whole_name]}
        g = SimGraph(g.inputs, tuple((WHOLE, i, o) for _, i, o in g.components),
                     tuple((WHOLE if s == whole_name else s, sn, WHOLE if d == whole_name else d, dn)
                           for s, sn, d, dn in g.edges), g.value_bytes)
        serves = {r.rank: WHOLE for r in plan.ranks if r.role == "component"}
    elif variant == "grouped":
        g, members = grouped(graph, groups)
        owner = {m: gname for gname, ms in members.items() for m in ms}
        serves = {r.rank: owner.get(str(r.component), str(r.component)) for r in plan.ranks if r.role == "component"}
    elif variant == "split":
        g, members = graph, {c: (c,) for c in graph.names}
        serves = {r.rank: str(r.component) for r in plan.ranks if r.role == "component"}
    else:
        raise ValueError(f"variant {variant!r}: use split, whole or grouped")
    names = [c[0] for c in g.components]
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted({c for c in serves.values() if c not in index})
    missing = [n for n in names if n not in set(serves.values())]
    if unknown or missing:
        raise PlanError(f"the plan does not fit the dataflow: ranks serve {unknown or 'nothing unknown'}, "
                        f"components without a rank {missing or 'none'}; re-run the allocate stage")
    for n in names:
        for m in members[n]:
            if m not in profiles:
                raise PlanError(f"no profile for component {m!r}: profile the switchboard the plan was made for")
    comps = []
    for n, _, _ in g.components:
        # a request needs one message here from each distinct sender (the frontend's carries every model input;
        # a component's, all its values for this one: runtime.routing.Dataflow.send_groups)
        srcs = {src for src, _, dst, _ in g.edges if dst == n}
        sinks: dict[int, float] = {}
        for src, sname, dst, _ in g.edges:
            if src == n:
                d = -1 if dst == OUTPUT else index[dst]
                sinks[d] = sinks.get(d, 0.0) + g.value_bytes.get(sname, 0)
        reps = tuple(r for r in sorted(serves) if serves[r] == n)
        comps.append(SimComponent(n, max(1, len(srcs)), tuple(sinks.items()), reps))
    entry: dict[int, float] = {}
    for src, sname, dst, _ in g.edges:
        if src == INPUT and dst != OUTPUT:
            entry[index[dst]] = entry.get(index[dst], 0.0) + g.value_bytes.get(sname, 0)
    n_out = len({src for src, _, dst, _ in g.edges if dst == OUTPUT and src != INPUT})
    cpu = plan.device_kind == "cpu"
    ranks = []
    for r in plan.ranks:
        if r.role == "frontend":
            ranks.append(SimRank(r.rank, r.node, -1, 1, r.threads))
            continue
        n = serves[r.rank]
        want = float(r.threads) if cpu else float(r.slice_gb or 0.0)
        tables = [latency_table(profiles[m], want, r.batch_size) for m in members[n]]
        f = [float((scale or {}).get(m, 1.0)) for m in members[n]]
        lat = tuple(float(sum(k * t[0][b] for k, t in zip(f, tables, strict=True))) for b in range(r.batch_size))
        sigma = max(t[1] for t in tables)
        own = calibration.program(n, switchboard_sha256)
        progs = [calibration.program(m, switchboard_sha256) for m in members[n]]
        # a turn after an eviction: the program's measured turn, else a messaging turn's ([Note: evicted caches])
        evicted = calibration.evicted_us_per_turn / 1e3
        if own is not None:
            cold, evicted = own.cold, own.evicted_ms
        elif all(p is not None for p in progs):
            cold = _sum_curves([p.cold for p in progs if p is not None])
            # one turn runs the members back to back: its receive and send are cold once, not once per member
            ev = [p.evicted_ms for p in progs if p is not None]
            evicted = max(max(ev), sum(ev) - (len(ev) - 1) * evicted)
        else:
            cold = _sum_curves([calibration.compute_cold] * len(members[n]))
        ranks.append(SimRank(r.rank, r.node, index[n], r.batch_size, r.threads,
                             float(r.slice_gb or r.threads or 0), lat, sigma, cold, evicted))
    cores: tuple[float, ...] = ()
    if cpu:
        c = float(cores_per_node or calibration.cores_per_node or 1)
        cores = (c,) * plan.nodes
    return SimSystem(f"{plan.model}:{variant}", tuple(comps), tuple(entry.items()), n_out, tuple(ranks), cores,
                     calibration, policy, bind_cores and cpu)
