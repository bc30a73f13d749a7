"""Dataflow of a served plan, derived from the plan and the switchboard edges: pure data, no MPI.

[Note: serve dataflow]
``build_dataflow(plan, graph)`` answers, for every rank, everything the rank loop needs and nothing it
has to compute at run time:

- the frontend sends model input ``i`` to every ``(component, slot)`` in ``input_sinks[i]``;
- a component replica fills input slot ``k`` from ``sources[k]`` and, after running, sends output
  ``j`` to every ``(component, slot)`` in ``sinks[j]`` (``"output"`` = the frontend, slot = model output
  index);
- a request's *route* is one rank per component (``Dataflow.components`` order), chosen once by the
  frontend (:class:`Router`, fewest outstanding requests); it travels in every message header so a join
  component receives all inputs of one request on the same replica.

Shutdown travels the same way: the frontend sends STOP to the replicas it feeds; a replica that has
a STOP from every rank upstream of it (``Dataflow.upstream_ranks``) has received all its data (MPI keeps
the order of one sender's messages); it finishes its queue, waits for its sends, then sends STOP to
every replica downstream.  So no message is ever left unreceived, even late outputs of timed-out
requests.

``whole_graph`` / ``whole_plan`` describe the baseline: the unsplit model served by the same ranks.
``Dataflow.format()`` prints the whole thing (test it, print it in logs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hpcsplit.core.grouping import GROUP_SEP, group_members, merge_groups
from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.core.policy import ReplicaRouter
from hpcsplit.errors import PlanError

__all__ = [
    "INPUT",
    "OUTPUT",
    "ComponentFlow",
    "Dataflow",
    "GraphSpec",
    "Router",
    "build_dataflow",
    "critical_path_ms",
    "graph_from_switchboard",
    "group_graph",
    "served_graph",
    "whole_graph",
    "whole_graph_of",
    "whole_plan",
]

INPUT = "input"
OUTPUT = "output"
WHOLE = "whole"


@dataclass(frozen=True, slots=True)
class GraphSpec:
    """The component graph: model inputs/outputs, component port names, and edges.

    ``edges`` are ``(src, src_name, dst, dst_name)`` with ``src`` a component or ``"input"`` and
    ``dst`` a component or ``"output"`` (the switchboard's ``edges``).  ``components`` is topological.
    ``batch_dims`` maps value names (component ports, model inputs and outputs) to their batch dims;
    a name not in it has batch dim 0.
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    components: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...]  # (name, inputs, outputs)
    edges: tuple[tuple[str, str, str, str], ...]
    batch_dims: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def bdims(self, name: str) -> tuple[int, ...]:
        return tuple(self.batch_dims.get(name, (0,)))


@dataclass(frozen=True, slots=True)
class ComponentFlow:
    """Where one component's inputs come from and its outputs go, and who serves it."""

    name: str
    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    sources: tuple[tuple[str, str], ...]  # per input slot: (component | "input", output name)
    sinks: tuple[tuple[tuple[str, int], ...], ...]  # per output: ((component | "output", slot), ...)
    replicas: tuple[int, ...]  # ranks, by replica index
    batch_sizes: tuple[int, ...]  # per replica (1 where an input has several batch dims)
    sizes: tuple[float, ...] = ()  # per replica: its GPU slice (GB) or CPU threads; routing prefers big ones
    in_bdims: tuple[tuple[int, ...], ...] = ()  # batch dims per input slot
    out_bdims: tuple[tuple[int, ...], ...] = ()  # batch dims per output


@dataclass(frozen=True, slots=True)
class Dataflow:
    """Everything the ranks need to move one request through the plan (``[Note: serve dataflow]``)."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    components: tuple[ComponentFlow, ...]
    input_sinks: tuple[tuple[tuple[str, int], ...], ...]  # per model input
    output_sources: tuple[tuple[str, str], ...]  # per model output: (component | "input", name)
    world_size: int
    rank_component: dict[int, str] = field(default_factory=dict)
    input_bdims: tuple[tuple[int, ...], ...] = ()
    output_bdims: tuple[tuple[int, ...], ...] = ()

    def batch_size_of(self, rank: int) -> int:
        c = self.component_of_rank(rank)
        if c is None:
            return 1
        return c.batch_sizes[c.replicas.index(rank)]

    def component(self, name: str) -> ComponentFlow:
        for c in self.components:
            if c.name == name:
                return c
        raise PlanError(f"no component {name!r} in the dataflow; it has {[c.name for c in self.components]}")

    def component_of_rank(self, rank: int) -> ComponentFlow | None:
        name = self.rank_component.get(rank)
        return None if name is None else self.component(name)

    def entry_groups(self) -> dict[str, tuple[tuple[int, int], ...]]:
        """Per component fed by model inputs: ``(model input index, slot)`` pairs."""
        out: dict[str, list[tuple[int, int]]] = {}
        for i, sinks in enumerate(self.input_sinks):
            for comp, slot in sinks:
                if comp != OUTPUT:
                    out.setdefault(comp, []).append((i, slot))
        return {k: tuple(v) for k, v in out.items()}

    def send_groups(self, name: str) -> dict[str, tuple[tuple[int, int], ...]]:
        """Per destination of component ``name``: ``(output index, destination slot)`` pairs."""
        c = self.component(name)
        out: dict[str, list[tuple[int, int]]] = {}
        for j, sinks in enumerate(c.sinks):
            for dst, slot in sinks:
                out.setdefault(dst, []).append((j, slot))
        return {k: tuple(v) for k, v in out.items()}

    def upstream_ranks(self, name: str) -> tuple[int, ...]:
        """Ranks that may send inputs to replicas of ``name`` (the frontend is 0).

        Each sends a STOP after its last data message, so a replica has seen everything once it has
        a STOP from each of them (``[Note: serve dataflow]``).
        """
        out: set[int] = set()
        for src, _ in self.component(name).sources:
            out.update((0,) if src == INPUT else self.component(src).replicas)
        return tuple(sorted(out))

    def downstream_ranks(self, name: str) -> tuple[int, ...]:
        """Component ranks replicas of ``name`` send to (not the frontend)."""
        out: set[int] = set()
        for sinks in self.component(name).sinks:
            for dst, _ in sinks:
                if dst != OUTPUT:
                    out.update(self.component(dst).replicas)
        return tuple(sorted(out))

    def entry_ranks(self) -> tuple[int, ...]:
        """Ranks the frontend sends model inputs to (and so STOP to)."""
        return tuple(sorted({r for c in self.entry_groups() for r in self.component(c).replicas}))

    def format(self) -> str:
        """A readable description: one line per component and per model input/output."""
        lines = [f"dataflow: {len(self.components)} component(s), {self.world_size} ranks"]
        for i, (name, sinks) in enumerate(zip(self.inputs, self.input_sinks, strict=True)):
            lines.append(f"  input[{i}] {name} -> " + ", ".join(f"{c}[{s}]" for c, s in sinks))
        for c in self.components:
            srcs = ", ".join(f"{s}.{n}" for s, n in c.sources)
            reps = ", ".join(f"r{r}(b{b})" for r, b in zip(c.replicas, c.batch_sizes, strict=True))
            lines.append(f"  {c.name}: ({srcs}) on [{reps}]")
            for j, sinks in enumerate(c.sinks):
                lines.append(f"    out[{j}] {c.outputs[j]} -> " + ", ".join(f"{d}[{s}]" for d, s in sinks))
        for i, (name, (src, sname)) in enumerate(zip(self.outputs, self.output_sources, strict=True)):
            lines.append(f"  output[{i}] {name} <- {src}.{sname}")
        return "\n".join(lines)


def build_dataflow(plan: Plan, graph: GraphSpec) -> Dataflow:
    """Derive the :class:`Dataflow` of ``plan`` serving ``graph``.

    Raises
    ------
    PlanError
        Listing every problem: a component without ranks, a plan rank serving an unknown component,
        an input slot with zero or several sources, a model output without a source.

    Examples
    --------
    >>> g = GraphSpec(("x",), ("y",), (("a", ("x",), ("h",)), ("b", ("h",), ("y",))),
    ...               (("input", "x", "a", "x"), ("a", "h", "b", "h"), ("b", "y", "output", "y")))
    >>> df = build_dataflow(_toy_plan(["a", "b"]), g)
    >>> df.input_sinks, df.component("a").sinks, df.output_sources
    (((('a', 0),),), ((('b', 0),),), (('b', 'y'),))
    """
    problems: list[str] = []
    names = [c[0] for c in graph.components]
    comp_io = {c[0]: (c[1], c[2]) for c in graph.components}
    sources: dict[tuple[str, int], list[tuple[str, str]]] = {}
    sinks: dict[tuple[str, int], list[tuple[str, int]]] = {}
    in_sinks: dict[int, list[tuple[str, int]]] = {i: [] for i in range(len(graph.inputs))}
    out_src: dict[int, list[tuple[str, str]]] = {i: [] for i in range(len(graph.outputs))}

    def _in_slot(dst: str, dst_name: str) -> int | None:
        if dst == OUTPUT:
            if dst_name not in graph.outputs:
                problems.append(f"edge to unknown model output {dst_name!r} (outputs {list(graph.outputs)})")
                return None
            return graph.outputs.index(dst_name)
        if dst not in comp_io:
            problems.append(f"edge to unknown component {dst!r}")
            return None
        if dst_name not in comp_io[dst][0]:
            problems.append(f"edge to unknown input {dst_name!r} of {dst!r} (inputs {list(comp_io[dst][0])})")
            return None
        return comp_io[dst][0].index(dst_name)

    for src, src_name, dst, dst_name in graph.edges:
        slot = _in_slot(dst, dst_name)
        if slot is None:
            continue
        if src == INPUT:
            if src_name not in graph.inputs:
                problems.append(f"edge from unknown model input {src_name!r} (inputs {list(graph.inputs)})")
                continue
            in_sinks[graph.inputs.index(src_name)].append((dst, slot))
        else:
            if src not in comp_io or src_name not in comp_io[src][1]:
                problems.append(f"edge from unknown output {src}.{src_name}")
                continue
            sinks.setdefault((src, comp_io[src][1].index(src_name)), []).append((dst, slot))
        if dst == OUTPUT:
            out_src[slot].append((src, src_name))
        else:
            sources.setdefault((dst, slot), []).append((src, src_name))

    for name in names:
        for k, inp in enumerate(comp_io[name][0]):
            n = len(sources.get((name, k), []))
            if n != 1:
                problems.append(f"input {inp!r} of component {name!r} has {n} sources, needs exactly 1")
    for i, name in enumerate(graph.outputs):
        if len(out_src[i]) != 1:
            problems.append(f"model output {name!r} has {len(out_src[i])} sources, needs exactly 1")
    planned = {r.component for r in plan.ranks if r.component is not None}
    for extra in sorted(planned - set(names)):
        problems.append(f"the plan serves component {extra!r}, which the switchboard does not have")
    for name in names:
        if name not in planned:
            problems.append(f"component {name!r} has no rank in the plan")
    for value in (*graph.inputs, *graph.outputs, *(p for c in graph.components for p in (*c[1], *c[2]))):
        if not graph.bdims(value):
            problems.append(f"value {value!r} has no batch dim; the runtime sends each request's slice of "
                            "every value, so every value needs one (re-export with a symbolic batch)")
    for value in graph.inputs:
        if len(graph.bdims(value)) > 1:
            problems.append(f"model input {value!r} has several batch dims {graph.bdims(value)}; inputs need one")
    if problems:
        raise PlanError(
            "the plan and the switchboard do not fit together:\n  - " + "\n  - ".join(problems)
            + "\nRe-run the allocate stage with this switchboard (or pass the matching plan=...)."
        )
    flows = []
    for idx, name in enumerate(names):
        ins, outs = comp_io[name]
        reps: Sequence[RankEntry] = plan.replicas(name)
        # an input with several batch dims (e.g. a [batch, batch] similarity) cannot hold several
        # requests side by side: such a component runs one request at a time
        single = any(len(graph.bdims(n)) > 1 for n in ins)
        flows.append(ComponentFlow(
            name=name,
            index=idx,
            inputs=tuple(ins),
            outputs=tuple(outs),
            sources=tuple(sources[(name, k)][0] for k in range(len(ins))),
            sinks=tuple(tuple(sinks.get((name, j), ())) for j in range(len(outs))),
            replicas=tuple(r.rank for r in reps),
            batch_sizes=tuple(1 if single else r.batch_size for r in reps),
            sizes=tuple(float(r.slice_gb or r.threads or 0) for r in reps),
            in_bdims=tuple(graph.bdims(n) for n in ins),
            out_bdims=tuple(graph.bdims(n) for n in outs),
        ))
    return Dataflow(
        inputs=tuple(graph.inputs),
        outputs=tuple(graph.outputs),
        components=tuple(flows),
        input_sinks=tuple(tuple(in_sinks[i]) for i in range(len(graph.inputs))),
        output_sources=tuple(out_src[i][0] for i in range(len(graph.outputs))),
        world_size=plan.world_size,
        rank_component={r.rank: r.component for r in plan.ranks if r.component is not None},
        input_bdims=tuple(graph.bdims(n) for n in graph.inputs),
        output_bdims=tuple(graph.bdims(n) if n in graph.batch_dims else graph.bdims(out_src[i][0][1])
                           for i, n in enumerate(graph.outputs)),
    )


def graph_from_switchboard(sb: Any) -> GraphSpec:
    """The :class:`GraphSpec` of a loaded ``Switchboard`` (``[Note: switchboard layout]``)."""
    layout = sb.layout
    bd: dict[str, tuple[int, ...]] = {}
    for t in (*layout.inputs, *layout.outputs, *(p for c in layout.components for p in (*c.inputs, *c.outputs))):
        bd[t.name] = tuple(t.batch_dims)
    comps = tuple((c.name, tuple(t.name for t in c.inputs), tuple(t.name for t in c.outputs))
                  for c in (sb.components[n] for n in sb.order))
    return GraphSpec(
        inputs=tuple(t.name for t in layout.inputs),
        outputs=tuple(t.name for t in layout.outputs),
        components=comps,
        edges=tuple((e.src, e.src_name, e.dst, e.dst_name) for e in sb.edges),
        batch_dims=bd,
    )


def group_graph(graph: GraphSpec, served: Sequence[str]) -> GraphSpec:
    """``graph`` with the groups among the ``served`` names merged (``[Note: component groups]`` in
    :mod:`hpcsplit.core.grouping`): a rank serving ``a+b`` runs components ``a`` and ``b`` back to back.

    Examples
    --------
    >>> g = GraphSpec(("x",), ("y",), (("a", ("x",), ("p",)), ("b", ("x",), ("q",)), ("h", ("p", "q"), ("y",))),
    ...               (("input", "x", "a", "x"), ("input", "x", "b", "x"), ("a", "p", "h", "p"),
    ...                ("b", "q", "h", "q"), ("h", "y", "output", "y")))
    >>> [c[0] for c in group_graph(g, ["a+b", "h"]).components]
    ['a+b', 'h']
    """
    order = [c[0] for c in graph.components]
    groups = {n: group_members(n, order) for n in dict.fromkeys(served) if GROUP_SEP in n}
    comps, edges = merge_groups(graph.components, graph.edges, groups)
    return GraphSpec(graph.inputs, graph.outputs, comps, edges, dict(graph.batch_dims))


def served_graph(graph: GraphSpec, plan: Plan) -> GraphSpec:
    """The graph the plan's ranks serve: as it is, with the plan's groups merged, or the unsplit model when the
    plan serves only ``whole`` (an allocation that chose not to split, ``allocate.rate_rps``)."""
    served = [r.component for r in plan.ranks if r.component is not None]
    if served and set(served) == {WHOLE}:
        return whole_graph_of(graph)
    if any(GROUP_SEP in c for c in served):
        return group_graph(graph, served)
    return graph


def whole_graph_of(graph: GraphSpec) -> GraphSpec:
    """:func:`whole_graph` with the model's batch dims kept."""
    g = whole_graph(graph.inputs, graph.outputs)
    bd = dict(graph.batch_dims)
    for src, src_name, dst, dst_name in graph.edges:
        if dst == OUTPUT and dst_name not in bd:
            bd[dst_name] = graph.bdims(src_name)
    return GraphSpec(g.inputs, g.outputs, g.components, g.edges, bd)


def whole_graph(inputs: Sequence[str], outputs: Sequence[str]) -> GraphSpec:
    """The graph of the unsplit model as one component named ``"whole"``."""
    return GraphSpec(
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        components=((WHOLE, tuple(inputs), tuple(outputs)),),
        edges=tuple((INPUT, n, WHOLE, n) for n in inputs) + tuple((WHOLE, n, OUTPUT, n) for n in outputs),
    )


def whole_plan(plan: Plan) -> Plan:
    """The baseline plan: every component rank of ``plan`` serves a replica of the whole model.

    Same ranks, nodes, GPUs, slices, threads and batch sizes: only what each rank runs changes.
    """
    ranks = []
    k = 0
    for r in plan.ranks:
        if r.role == "frontend":
            ranks.append(r)
            continue
        ranks.append(replace(r, component=WHOLE, replica=k))
        k += 1
    return replace(
        plan,
        ranks=tuple(ranks),
        predicted_throughput_rps={WHOLE: 0.0},
        utilization=dict(plan.utilization),
        meta={"baseline_of": plan.model},
    )


class Router(ReplicaRouter):
    """Join-shortest-queue routing: each request goes to the replica with fewest outstanding requests.

    The frontend's router over a :class:`Dataflow`: :class:`~hpcsplit.core.policy.ReplicaRouter` (the code the
    simulator routes with too).  Ties go to a replica that has not timed out since its last success, then to
    the bigger replica (GPU slice or CPU threads, when replicas differ), then to the one used least recently,
    so idle replicas share the load in turn.  (Keeping one replica warm instead was tried: CLIP on the 2-core
    VM at 2 req/s, five alternating runs each, split p50 143 ms taking turns vs 152 ms always the last one
    used, within the noise but not better.)

    Examples
    --------
    >>> from types import SimpleNamespace as NS
    >>> df = NS(components=(NS(replicas=(1, 2), sizes=()), NS(replicas=(3,), sizes=())))
    >>> r = Router(df)
    >>> r.assign(), r.assign(), r.assign()
    ((1, 3), (2, 3), (1, 3))
    >>> r.release((1, 3)); r.assign()  # 1 and 2 tie at one each: 2 was used less recently
    (2, 3)
    """

    def __init__(self, dataflow: Dataflow) -> None:
        super().__init__([tuple(c.replicas) for c in dataflow.components],
                         {r: s for c in dataflow.components
                          for r, s in zip(c.replicas, c.sizes or [0.0] * len(c.replicas), strict=True)})


def critical_path_ms(graph: GraphSpec, latency_ms: dict[str, float]) -> float:
    """Longest path through the component DAG, weighting each component by ``latency_ms``.

    The latency floor of one request when every branch runs side by side (transfers excluded).

    Examples
    --------
    >>> g = GraphSpec(("x",), ("y",), (("a", ("x",), ("p",)), ("b", ("x",), ("q",)),
    ...               ("j", ("p", "q"), ("y",))),
    ...               (("input", "x", "a", "x"), ("input", "x", "b", "x"), ("a", "p", "j", "p"),
    ...                ("b", "q", "j", "q"), ("j", "y", "output", "y")))
    >>> critical_path_ms(g, {"a": 70.0, "b": 20.0, "j": 1.0})
    71.0
    """
    finish: dict[str, float] = {}
    preds: dict[str, set[str]] = {c[0]: set() for c in graph.components}
    for src, _, dst, _ in graph.edges:
        if src != INPUT and dst != OUTPUT:
            preds[dst].add(src)
    for name, _, _ in graph.components:
        start = max((finish[p] for p in preds[name]), default=0.0)
        finish[name] = start + float(latency_ms[name])
    return max(finish.values(), default=0.0)


def _toy_plan(components: Sequence[str], replicas: int = 1, batch_size: int = 1) -> Plan:
    """A CPU plan with a frontend and ``replicas`` ranks per component (tests, docs)."""
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    for c in components:
        for k in range(replicas):
            ranks.append(RankEntry(len(ranks), "component", 0, None, None, 1, c, batch_size, k))
    return Plan("toy", None, "cpu", 1, tuple(ranks), dict.fromkeys(components, 0.0), {})
