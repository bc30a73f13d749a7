"""Split a dataflow graph into components: SESE branch regions via dominators, then sequential cuts.

Pure graph algorithms on a :class:`networkx.DiGraph`; nothing here imports torch.

The graph is the *dataflow* graph of a captured model: one node per operation that carries data,
an edge ``u -> v`` when ``v`` reads a value ``u`` produces. Parameters, buffers, constants and
nodes with no data (guards, asserts, ``get_attr``) must be left out by the caller (see
:mod:`hpcsplit.switchboard.graph`). Node attributes (all optional):

``work``    deterministic cost of the node (the export uses FLOPs from shapes; default 1.0): it alone
            decides regions, branches, absorption and each region's benefit
``ms``      measured milliseconds at the timing batch: balances sequential cuts and sums into
            ``Component.work``; default: ``work``
``bytes``   activation bytes per sample the node produces (default 0)
``module``  dotted module path (``"vision_model.encoder.layers.3.mlp"``; default ``""``)
``input``   True for model inputs (placeholders): analysed, but never put into a component
``output``  True for nodes whose value is a model output; when any node has it, nodes from which no
            output can be reached (dead code) are dropped before the analysis

[Note: partition algorithm]
1. Dead code goes first (nodes reaching no ``output`` node). A virtual source feeds every node
   without predecessors, a virtual sink drains every node without successors.
   ``immediate_dominators`` on the graph and on its reverse give the dominator and post-dominator
   trees (:func:`_idom` normalises the networkx>=3.6 result, which leaves out the start node).
2. Regions are the pairs ``(a, b)`` with ``b = ipdom(a)`` whose interior (reachable from ``a``
   without passing ``b``) has a single entry (always so when ``a = idom(b)``: canonical SESE), and
   the pairs ``(idom(b), b)`` of a join ``b`` whose interior (the nodes on paths ``a -> b``) has a
   single entry and exit. Each interior is found by a bounded search, after an exact bound on its
   work (dominator-subtree work) has ruled out the small ones.
3. A region's candidate branches are the weakly connected parts of its interior (CLIP: image tower
   and text tower) or, failing that, its maximal chains when two of them can run side by side (the
   toy's nested diamond). A branch carrying less than ``max(min_branch_fraction,
   min_component_fraction)`` of the total work is *absorbed*: it joins the region's entry side or
   exit side, whichever the part graph allows without a cycle and with fewer crossing bytes (a part
   with no entry side goes to the exit side and the other way round). The region splits into the
   branches that are left (at least two); a region whose branches are all small stays whole.
4. Benefit against cost: the benefit is the work a split takes off the critical path (kept
   branch work minus the heaviest chain of kept branches), in ms at ``RuntimeCost.ms_per_work``;
   the cost is one ``hop_ms`` per edge the split adds to the component graph plus the activation
   bytes that start crossing between components at ``ms_per_byte``. A region is split only when
   the benefit is larger (or ``force``). Every candidate gets a :class:`Decision` saying why.
5. Regions are chosen greedily by benefit, disconnected-branch regions before chain regions; a
   chosen region may nest inside one kept branch of another, never overlap it.
6. Nodes outside the chosen branches become sequential components, grouped by how many chosen
   regions lie before them (stem, head, ...); a branch absorbed into the exit side counts as after
   its region. This keeps the component graph acyclic.
7. ``stages`` / ``max_stage_ms`` cut components further (``stages``: counts in proportion to
   ``work``), at the input towers inside them first ([Note: input towers] in
   :mod:`hpcsplit.switchboard.cuts`: an encoder beside its decoder), then at topological positions near
   equal-``ms`` targets where the fewest activation bytes cross; positions whose distance to the target
   differs by less than ``tie_margin`` of a stage are tied and decided by module depth (between blocks
   before inside one), then ``work`` (so timing noise cannot move a cut between them). With a
   ``runtime`` a component is cut only when its slowest stage beats it whole ([Note: stages pay]).
Steps 1-6 see only ``work``, ``bytes`` and the graph: the same graph gives the same components on
any machine and load. All steps are linear in the graph size, except nested-region searches
(linear per nesting level).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import re
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from hpcsplit.errors import PartitionError
from hpcsplit.switchboard.cuts import StageCut, stage_counts, stage_time, tower_exits, tower_segments
from hpcsplit.switchboard.cuts import subtree_sums as _tree_subtree_sums
from hpcsplit.switchboard.cuts import tree_intervals as _intervals

__all__ = [
    "Component",
    "Decision",
    "Partition",
    "Region",
    "RuntimeCost",
    "component_graph",
    "decide",
    "find_regions",
    "partition",
]

_SOURCE = ("__hpcsplit_source__",)
_SINK = ("__hpcsplit_sink__",)


@dataclass(frozen=True, slots=True)
class RuntimeCost:
    """What a split costs the runtime, in ms (see [Note: partition algorithm], step 4).

    ``ms_per_work`` turns node ``work`` into ms (``1 / (GFLOP/s * 1e6)`` for FLOPs);
    ``ms_per_byte`` is the transfer time of one activation byte per sample at the decision batch
    (``batch / (GB/s * 1e6)``); ``hop_ms`` is paid once per edge the split adds.
    """

    ms_per_work: float = 0.0
    ms_per_byte: float = 0.0
    hop_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Region:
    """A single-entry/single-exit region whose interior splits into parallel branches.

    ``entry``/``exit`` are ``None`` when the region starts at the model inputs or ends at its
    outputs (the virtual source/sink). ``branches`` holds the kept branches' node tuples in
    topological order; ``absorbed_entry``/``absorbed_exit`` the small branches that join the entry
    or exit side (``absorbed_branch``: those that join the lightest kept branch, when the region has
    neither side). ``work`` and ``benefit`` are in ``work`` units; the cost figures are filled in
    when a :class:`RuntimeCost` is given.
    """

    entry: Hashable | None
    exit: Hashable | None
    branches: tuple[tuple[Hashable, ...], ...]
    kind: str  # "disjoint" (weakly disconnected branches) or "chains" (parallel chains)
    work: float
    benefit: float  # kept work minus the heaviest chain of kept branches
    absorbed_entry: tuple[tuple[Hashable, ...], ...] = ()
    absorbed_exit: tuple[tuple[Hashable, ...], ...] = ()
    absorbed_branch: tuple[tuple[Hashable, ...], ...] = ()
    branch_work: tuple[float, ...] = ()
    crossing_bytes: int = 0
    added_edges: int = 0
    benefit_ms: float = 0.0
    cost_ms: float = 0.0

    @property
    def interior(self) -> set[Hashable]:
        """Every node of the region's branches, kept or absorbed."""
        out = {v for br in self.branches for v in br}
        for group in (self.absorbed_entry, self.absorbed_exit, self.absorbed_branch):
            out.update(v for br in group for v in br)
        return out


@dataclass(frozen=True, slots=True)
class Decision:
    """Why one candidate region was or was not split (a row of the export's region table).

    ``work`` figures are in node ``work`` units (FLOPs in an export), ``*_ms`` in ms, bytes per sample.
    """

    entry: str | None
    exit: str | None
    kind: str
    branch_work: tuple[float, ...]
    absorbed: tuple[tuple[str, float], ...]  # (side, work) per absorbed small branch
    crossing_bytes: int
    added_edges: int
    benefit_ms: float
    cost_ms: float
    split: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``layout.json``'s ``partition.regions``)."""
        return {
            "entry": self.entry,
            "exit": self.exit,
            "kind": self.kind,
            "branch_work": list(self.branch_work),
            "absorbed": [list(a) for a in self.absorbed],
            "crossing_bytes": self.crossing_bytes,
            "added_edges": self.added_edges,
            "benefit_ms": self.benefit_ms,
            "cost_ms": self.cost_ms,
            "split": self.split,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True)
class Component:
    """A group of graph nodes that becomes one program.

    ``kind`` is ``"branch"`` (a branch of a region), ``"sequential"`` (between regions) or
    ``"stage"`` (a piece of a sequential cut). ``nodes`` are in topological order; ``work`` sums the
    nodes' ``ms`` (their ``work`` where no ``ms`` is given).
    """

    name: str
    nodes: tuple[Hashable, ...]
    kind: str
    work: float


@dataclass(frozen=True, slots=True)
class Partition:
    """The result of :func:`decide`: components, one decision per candidate region, dead nodes, and
    one :class:`StageCut` per component that ``stages``/``max_stage_ms`` asked to cut."""

    components: list[Component]
    decisions: list[Decision] = field(default_factory=list)
    dead: tuple[Hashable, ...] = ()
    stage_cuts: list[StageCut] = field(default_factory=list)


# --------------------------------------------------------------------------- helpers


def _idom(g: nx.DiGraph, start: Hashable) -> dict[Hashable, Hashable]:
    """Immediate dominators with ``start`` mapped to itself (networkx>=3.6 leaves it out)."""
    idom = dict(nx.immediate_dominators(g, start))
    idom[start] = start
    return idom


def _with_terminals(g: nx.DiGraph) -> nx.DiGraph:
    h = nx.DiGraph()
    h.add_nodes_from(g.nodes)
    h.add_edges_from(g.edges)
    h.add_edges_from((_SOURCE, v) for v, d in g.in_degree() if d == 0)
    h.add_edges_from((v, _SINK) for v, d in g.out_degree() if d == 0)
    return h


def _interior(h: nx.DiGraph, a: Hashable, b: Hashable) -> list[Hashable]:
    seen = {a, b}
    stack = [a]
    out: list[Hashable] = []
    while stack:
        u = stack.pop()
        for v in h.successors(u):
            if v not in seen:
                seen.add(v)
                out.append(v)
                stack.append(v)
    return out


def _weak_parts(h: nx.DiGraph, nodes: list[Hashable]) -> list[list[Hashable]]:
    inside = set(nodes)
    parent = {v: v for v in nodes}

    def find(x: Hashable) -> Hashable:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for u in nodes:
        for v in h.successors(u):
            if v in inside:
                ru, rv = find(u), find(v)
                if ru != rv:
                    parent[ru] = rv
    parts: dict[Hashable, list[Hashable]] = {}
    for v in nodes:
        parts.setdefault(find(v), []).append(v)
    return list(parts.values())


def _chain_parts(h: nx.DiGraph, nodes: list[Hashable], pos: dict) -> tuple[list[list[Hashable]], bool]:
    """Maximal chains of ``nodes`` and whether two of them can run side by side."""
    inside = set(nodes)
    head: dict[Hashable, Hashable] = {}
    for v in sorted(nodes, key=pos.__getitem__):
        preds = list(h.predecessors(v))
        if len(preds) == 1 and preds[0] in inside and h.out_degree(preds[0]) == 1:
            head[v] = head[preds[0]]
        else:
            head[v] = v
    chains: dict[Hashable, list[Hashable]] = {}
    for v in sorted(nodes, key=pos.__getitem__):
        chains.setdefault(head[v], []).append(v)
    parts = sorted(chains.values(), key=lambda c: pos[c[0]])
    # The chain DAG has a unique topological order (no parallelism) iff consecutive chains
    # in that order are joined by an edge.
    index = {v: i for i, c in enumerate(parts) for v in c}
    edges = {(index[u], index[v]) for u in nodes for v in h.successors(u) if v in inside}
    cdag = nx.DiGraph()
    cdag.add_nodes_from(range(len(parts)))
    cdag.add_edges_from((i, j) for i, j in edges if i != j)
    topo = list(nx.topological_sort(cdag))
    parallel = any(not cdag.has_edge(x, y) for x, y in itertools.pairwise(topo))
    return parts, parallel


# --------------------------------------------------------------------------- regions


def _live(g: nx.DiGraph) -> tuple[nx.DiGraph, tuple[Hashable, ...]]:
    """``g`` without the nodes that reach no ``output`` node (unchanged when no node is marked)."""
    outs = [v for v, o in g.nodes(data="output") if o]
    if not outs:
        return g, ()
    live = set(outs)
    stack = list(outs)
    while stack:
        for u in g.predecessors(stack.pop()):
            if u not in live:
                live.add(u)
                stack.append(u)
    dead = tuple(v for v in g.nodes if v not in live)
    if not dead:
        return g, ()
    return g.subgraph([v for v in g.nodes if v in live]).copy(), dead


@dataclass(slots=True)
class _Candidate:
    """A region under analysis: its region (kept branches) and why it cannot split, if it cannot."""

    region: Region
    problem: str  # "" when the structure splits


class _Prepared:
    """The graph with terminals, topological positions, dominator trees and work sums."""

    def __init__(self, g: nx.DiGraph) -> None:
        if g.number_of_nodes() == 0:
            raise PartitionError("found an empty dataflow graph; needed at least one node")
        self.g, self.dead = _live(g)
        if self.g.number_of_nodes() == 0:
            raise PartitionError("found no node that reaches a model output; needed at least one")
        g = self.g
        self.h = _with_terminals(g)
        try:
            self.order = list(nx.topological_sort(self.h))
        except nx.NetworkXUnfeasible as e:
            raise PartitionError(
                "found a cycle in the dataflow graph; needed a DAG (a captured model)"
            ) from e
        self.pos = {v: i for i, v in enumerate(self.order)}
        self.work = {v: float(g.nodes[v].get("work", 1.0)) for v in g.nodes}
        self.ms = {v: float(g.nodes[v].get("ms", self.work[v])) for v in g.nodes}
        self.total = sum(self.work.values())
        self.idom = _idom(self.h, _SOURCE)
        self.ipdom = _idom(self.h.reverse(copy=False), _SINK)
        self.dom_sums = _tree_subtree_sums(self.idom, _SOURCE, self.work)
        self.tin, self.tout = _intervals(self.idom, _SOURCE)

    def nbytes(self, v: Hashable) -> int:
        return int(self.g.nodes[v].get("bytes", 0)) if v in self.work else 0

    def is_input(self, v: Hashable) -> bool:
        return v in self.work and bool(self.g.nodes[v].get("input", False))

    # ---- candidates

    def candidates(self, fraction: float, max_branches: int, runtime: RuntimeCost | None) -> list[_Candidate]:
        """Every canonical SESE region with >= 2 candidate branches, after absorbing the small ones."""
        threshold = fraction * self.total
        found: list[_Candidate] = []
        seen: set[tuple[Hashable, Hashable]] = set()
        for a in self.order:
            if a == _SINK:
                continue
            b = self.ipdom[a]
            if b == a:
                continue
            succ = list(self.h.successors(a))
            if len(succ) == 1 and succ[0] == b:
                continue  # an edge, nothing inside
            canonical = self.idom.get(b) == a
            # the interior, when it has a single entry, is a's dominator subtree without a and
            # (when a dominates b) b's subtree: an exact bound on its work
            upper = self.dom_sums[a] - self.work.get(a, 0.0) - (self.dom_sums[b] if self._dominates(a, b) else 0.0)
            if upper < 2 * threshold - 1e-12 and threshold > 0:
                continue  # two kept branches cannot fit
            inner = _interior(self.h, a, b)
            if len(inner) < 2:
                continue
            if not canonical and not self._single_entry(a, inner):
                continue
            parts, kind = self._parts(inner)
            if not parts:
                continue
            seen.add((a, b))
            found.append(self._candidate(a, b, parts, kind, threshold, max_branches, runtime))
        # joins seen from the other side: (idom(b), b) for a join b whose region a small branch
        # bypasses to meet after b (experts stacked, the gate joining later): b is not ipdom(a)
        for b in self.order:
            if b in (_SOURCE, _SINK) or self.h.in_degree(b) < 2:
                continue
            a = self.idom[b]
            if (a, b) in seen or self.ipdom.get(a) == b:
                continue
            upper = self.dom_sums[a] - self.work.get(a, 0.0) - self.dom_sums[b]
            if upper < 2 * threshold - 1e-12 and threshold > 0:
                continue
            between = self._between(a, b)
            if between is None or len(between) < 2:
                continue
            parts, kind = self._parts(between)
            if not parts:
                continue
            seen.add((a, b))
            found.append(self._candidate(a, b, parts, kind, threshold, max_branches, runtime))
        found.sort(key=lambda c: self.pos[_SOURCE if c.region.entry is None else c.region.entry])
        return found

    def _between(self, a: Hashable, b: Hashable) -> list[Hashable] | None:
        """The nodes on paths from ``a`` to ``b`` when they form a single-entry/single-exit region."""
        inner: list[Hashable] = []
        seen = {a, b}
        stack = [b]
        while stack:
            for u in self.h.predecessors(stack.pop()):
                if u not in seen:
                    if u == _SOURCE:
                        return None
                    seen.add(u)
                    inner.append(u)
                    stack.append(u)
        inside = set(inner)
        for v in inner:
            if any(w != b and w not in inside for w in self.h.successors(v)):
                return None  # a value leaves the region elsewhere than at its exit
        if not self._single_entry(a, inner):
            return None
        return sorted(inner, key=self.pos.__getitem__)

    def _dominates(self, a: Hashable, b: Hashable) -> bool:
        """``a`` dominates ``b`` (O(1): the dominator tree's DFS intervals)."""
        return self.tin[a] <= self.tin[b] and self.tout[b] <= self.tout[a]

    def _single_entry(self, a: Hashable, inner: list[Hashable]) -> bool:
        """Whether every edge into ``inner`` comes from ``a`` or from inside (a region whose exit also
        reads a value from before it: the towers of a model whose input skips past them)."""
        inside = set(inner)
        return all(u == a or u in inside for v in inner for u in self.h.predecessors(v))

    def _parts(self, inner: list[Hashable]) -> tuple[list[list[Hashable]], str]:
        """Candidate branches of an interior: weakly connected parts or parallel chains.

        Model inputs do not connect parts (the frontend sends each to every component that reads
        it): each joins the first part that reads it, or stands alone when only the exit does.
        """
        core = [v for v in inner if not self.is_input(v)]
        inputs = [v for v in inner if self.is_input(v)]
        parts = _weak_parts(self.h, core) if core else []
        kind = "disjoint"
        core_set = set(core)
        if len(parts) + sum(1 for u in inputs if not any(s in core_set for s in self.h.successors(u))) < 2:
            if len(core) < 2:
                return [], kind
            parts, parallel = _chain_parts(self.h, core, self.pos)
            kind = "chains"
            if not parallel:
                return [], kind
        index = {v: i for i, p in enumerate(parts) for v in p}
        work = [sum(self.work[v] for v in p) for p in parts]
        first = [min(self.pos[v] for v in p) for p in parts]
        lone: list[list[Hashable]] = []
        for u in sorted(inputs, key=self.pos.__getitem__):
            readers = {index[s] for s in self.h.successors(u) if s in index}
            if readers:  # the heaviest reader (a tower, not a small term beside it)
                parts[min(readers, key=lambda i: (-work[i], first[i]))].append(u)
            else:
                lone.append([u])
        return parts + lone, kind

    def _candidate(
        self, a: Hashable, b: Hashable, parts: list[list[Hashable]], kind: str, threshold: float,
        max_branches: int, runtime: RuntimeCost | None,
    ) -> _Candidate:
        parts = [sorted(p, key=self.pos.__getitem__) for p in parts]
        parts.sort(key=lambda p: self.pos[p[0]])
        works = [sum(self.work[v] for v in p) for p in parts]
        index = {v: i for i, p in enumerate(parts) for v in p}
        preds: list[set[int]] = [set() for _ in parts]
        succs: list[set[int]] = [set() for _ in parts]
        for i, p in enumerate(parts):
            for u in p:
                if self.is_input(u):
                    continue  # not an edge between parts: the frontend sends inputs to every reader
                for v in self.h.successors(u):
                    j = index.get(v)
                    if j is not None and j != i:
                        succs[i].add(j)
                        preds[j].add(i)
        has_entry = a != _SOURCE and not self.is_input(a)
        has_exit = b != _SINK
        small = {i for i, w in enumerate(works) if w < threshold or w <= 0}
        side: dict[int, str] = {}
        if has_entry:  # forward closure: a small part whose every predecessor part is on the entry side
            for i in range(len(parts)):
                if i in small and preds[i] <= {k for k, s in side.items() if s == "entry"}:
                    side[i] = "entry"
        if has_exit:  # backward closure; an entry-side part moves over when it crosses fewer bytes
            for i in reversed(range(len(parts))):
                if i not in small or not succs[i] <= {k for k, s in side.items() if s == "exit"}:
                    continue
                if i not in side or self._exit_bytes(parts[i]) < self._entry_bytes(parts[i]):
                    side[i] = "exit"
        if not has_entry and not has_exit:
            for i in small:
                if not preds[i] and not succs[i]:
                    side[i] = "branch"
        kept = [i for i in range(len(parts)) if i not in small]
        stuck = [i for i in small if i not in side]
        if kept and any(s == "branch" for s in side.values()):
            lightest = min(kept, key=lambda i: (works[i], i))
        else:
            lightest = None
        branches = [list(parts[i]) for i in kept]
        if lightest is not None:
            extra = sorted((v for i, s in side.items() if s == "branch" for v in parts[i]), key=self.pos.__getitem__)
            k = kept.index(lightest)
            branches[k] = sorted(branches[k] + extra, key=self.pos.__getitem__)
        kept_work = [sum(self.work[v] for v in br) for br in branches]
        # benefit: kept work minus the heaviest chain of kept branches (the part graph is a DAG)
        longest: dict[int, float] = {}
        for i in kept:
            longest[i] = works[i] + max((longest[j] for j in preds[i] if j in longest), default=0.0)
        critical = max(longest.values(), default=0.0)
        if lightest is not None:
            critical = max(critical, max(kept_work))
        total = sum(kept_work)
        region = Region(
            entry=None if a == _SOURCE else a,
            exit=None if b == _SINK else b,
            branches=tuple(tuple(br) for br in branches),
            kind=kind,
            work=total,
            benefit=total - critical,
            absorbed_entry=tuple(tuple(parts[i]) for i in sorted(side) if side[i] == "entry"),
            absorbed_exit=tuple(tuple(parts[i]) for i in sorted(side) if side[i] == "exit"),
            absorbed_branch=tuple(tuple(parts[i]) for i in sorted(side) if side[i] == "branch"),
            branch_work=tuple(kept_work),
        )
        problem = ""
        if stuck:
            problem = (f"{len(stuck)} small branch(es) can join neither the entry nor the exit side "
                       "without a cycle")
        elif len(kept) < 2:
            problem = ("every branch is below the minimum work" if not kept
                       else "one branch carries the work; the others are absorbed")
        elif len(kept) > max_branches:
            problem = f"{len(kept)} branches, more than max_branches={max_branches}"
        elif kind == "chains" and not _parallel(kept, succs):
            problem = "the kept chains run one after another"
        if not problem and runtime is not None:
            crossing, edges = self._crossings(a, b, region)
            region = _with_cost(region, crossing, edges, runtime)
        return _Candidate(region, problem)

    def _entry_bytes(self, part: list[Hashable]) -> int:
        """Bytes a part sends out when it runs on the entry side."""
        inside = set(part)
        return sum(self.nbytes(v) for v in part if any(s not in inside for s in self.h.successors(v)))

    def _exit_bytes(self, part: list[Hashable]) -> int:
        """Bytes a part receives when it runs on the exit side (model inputs arrive anyway)."""
        inside = set(part)
        srcs = {u for v in part for u in self.h.predecessors(v) if u not in inside}
        return sum(self.nbytes(u) for u in srcs if not self.is_input(u))

    def _crossings(self, a: Hashable, b: Hashable, r: Region) -> tuple[int, int]:
        """Bytes per sample that start crossing components, and component edges added, by splitting ``r``."""
        group: dict[Hashable, Any] = {}
        if a != _SOURCE:
            group[a] = "E"
        if b != _SINK:
            group[b] = "X"
        for br in r.absorbed_entry:
            group.update((v, "E") for v in br)
        for br in r.absorbed_exit:
            group.update((v, "X") for v in br)
        for i, br in enumerate(r.branches):
            group.update((v, i) for v in br)
        for v in list(group):
            if self.is_input(v):
                group[v] = "I"
        after: set[tuple[Any, Any]] = set()
        sent: set[tuple[Hashable, Any]] = set()
        for u, gu in group.items():
            if u == b:
                continue  # what the exit sends on is the same split or not
            for v in self.h.successors(u):
                gv = "O" if v == _SINK else group.get(v)
                if gv is None or gv == gu:
                    continue
                after.add((gu, gv))
                if gu != "I" and gv != "O":
                    sent.add((u, gv))
        def whole(x: Any) -> Any:
            return x if x in ("I", "O") else "W"

        before = {(whole(x), whole(y)) for x, y in after if whole(x) != whole(y)}
        return sum(self.nbytes(u) for u, _ in sent), len(after) - len(before)


def _parallel(kept: list[int], succs: list[set[int]]) -> bool:
    """Whether two of the kept parts can run side by side (their DAG has no Hamiltonian path)."""
    cdag = nx.DiGraph()
    cdag.add_nodes_from(kept)
    cdag.add_edges_from((i, j) for i in kept for j in succs[i] if j in cdag)
    topo = list(nx.lexicographical_topological_sort(cdag))
    return any(not cdag.has_edge(x, y) for x, y in itertools.pairwise(topo))


def _with_cost(r: Region, crossing: int, edges: int, rt: RuntimeCost) -> Region:
    return dataclasses.replace(
        r, crossing_bytes=crossing, added_edges=edges,
        benefit_ms=r.benefit * rt.ms_per_work, cost_ms=edges * rt.hop_ms + crossing * rt.ms_per_byte,
    )


def find_regions(
    g: nx.DiGraph, *, min_branch_fraction: float = 0.0, max_branches: int = 16, min_component_fraction: float = 0.0
) -> list[Region]:
    """Every canonical SESE region of ``g`` whose interior splits into parallel branches.

    Parameters
    ----------
    g
        Dataflow graph (a DAG); see the module docstring for node attributes.
    min_branch_fraction, min_component_fraction
        A branch below the larger of the two fractions of the graph's total work is absorbed into
        the region's entry or exit side; a region needs two branches left.
    max_branches
        Regions with more (kept) branches than this are skipped.

    Returns
    -------
    list[Region]
        In topological order of their entries.

    Examples
    --------
    >>> g = nx.DiGraph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    >>> [(r.entry, r.exit, r.branches) for r in find_regions(g)]
    [('a', 'd', (('b',), ('c',)))]
    """
    fraction = max(min_branch_fraction, min_component_fraction)
    return [c.region for c in _Prepared(g).candidates(fraction, max_branches, None) if not c.problem]


# --------------------------------------------------------------------------- selection


def _label(v: Hashable | None) -> str | None:
    return None if v is None else str(v)


def _decision(c: _Candidate, p: _Prepared, split: bool, reason: str) -> Decision:
    r = c.region
    absorbed = [("entry", br) for br in r.absorbed_entry] + [("exit", br) for br in r.absorbed_exit]
    absorbed += [("branch", br) for br in r.absorbed_branch]
    return Decision(
        entry=_label(r.entry),
        exit=_label(r.exit),
        kind=r.kind,
        branch_work=r.branch_work,
        absorbed=tuple((s, sum(p.work[v] for v in br)) for s, br in absorbed),
        crossing_bytes=r.crossing_bytes,
        added_edges=r.added_edges,
        benefit_ms=r.benefit_ms,
        cost_ms=r.cost_ms,
        split=split,
        reason=reason,
    )


def _select(cands: list[_Candidate], p: _Prepared, runtime: RuntimeCost | None, force: bool
            ) -> tuple[list[Region], list[Decision]]:
    """Greedy by benefit over the regions that pay: disjoint from, or nested in one kept branch of, each other."""
    verdict: dict[int, tuple[bool, str]] = {}
    paying: list[int] = []
    for i, c in enumerate(cands):
        r = c.region
        if c.problem:
            verdict[i] = (False, c.problem)
        elif r.benefit <= 0:
            verdict[i] = (False, "no work comes off the critical path")
        elif runtime is not None and r.benefit_ms <= r.cost_ms and not force:
            verdict[i] = (False, (f"benefit {r.benefit_ms:.3g} ms <= cost {r.cost_ms:.3g} ms "
                                 "(partition.force=true splits anyway)"))
        else:
            paying.append(i)
    chosen: list[tuple[int, set, list[set]]] = []
    # regions whose branches are disconnected come first: a "chains" region only fills in where
    # no such region lies (a skip edge over a diamond keeps the diamond)
    for i in sorted(paying, key=lambda i: (cands[i].region.kind != "disjoint", -cands[i].region.benefit, i)):
        r = cands[i].region
        inner = r.interior
        blocks = [set(br) for br in r.branches]
        clash = None
        for j, qinner, qblocks in chosen:
            common = inner & qinner
            if not common:
                continue
            if common == inner and any(inner <= qb for qb in qblocks):
                continue
            if common == qinner and any(qinner <= rb for rb in blocks):
                continue
            clash = j
            break
        if clash is None:
            chosen.append((i, inner, blocks))
            why = "benefit > cost" if runtime is not None and r.benefit_ms > r.cost_ms else (
                "forced (partition.force=true)" if runtime is not None else "branches take work off the critical path")
            verdict[i] = (True, why)
        else:
            q = cands[clash].region
            verdict[i] = (False, f"overlaps the region {_label(q.entry)} -> {_label(q.exit)}, chosen first")
    decisions = [_decision(c, p, *verdict[i]) for i, c in enumerate(cands)]
    return [cands[i].region for i, _, _ in chosen], decisions


def _segment(
    scope: list[Hashable], regions: list[Region], p: _Prepared, out: list[tuple[list[Hashable], str]]
) -> None:
    """Append the components of ``scope`` (topologically ordered) to ``out``."""
    scope_set = set(scope)
    # regions directly inside this scope: not inside another region that is inside the scope
    mine = [r for r in regions if r.interior <= scope_set]
    inner_sets = [r.interior for r in mine]
    direct: list[int] = []
    for i in sorted(range(len(mine)), key=lambda i: -len(inner_sets[i])):
        if not any(inner_sets[i] <= inner_sets[j] for j in direct):
            direct.append(i)
    region_of: dict[Hashable, int] = {}
    after_of: dict[Hashable, int] = {}  # absorbed into the exit side: after the region
    for i in direct:
        for br in mine[i].branches:
            for v in br:
                region_of[v] = i
        for br in mine[i].absorbed_exit:
            for v in br:
                after_of[v] = i
    level: dict[Hashable, int] = {}
    segments: dict[int, list[Hashable]] = {}
    for v in scope:
        if v in region_of:
            continue
        s = 0
        if v in after_of:
            s = level.get(mine[after_of[v]].entry, 0) + 1
        for u in p.h.predecessors(v):
            if u in level:
                s = max(s, level[u])
            elif u in region_of:
                entry = mine[region_of[u]].entry
                s = max(s, level.get(entry, 0) + 1)
        level[v] = s
        segments.setdefault(s, []).append(v)
    for s in sorted(segments):
        out.append((segments[s], "sequential"))
    for i in direct:
        rest = [r for j, r in enumerate(mine) if j != i and inner_sets[j] < inner_sets[i]]
        for br in mine[i].branches:
            brs = set(br)
            _segment(list(br), [r for r in rest if r.interior <= brs], p, out)


# --------------------------------------------------------------------------- sequential cuts


def _cut(nodes: list[Hashable], n: int, p: _Prepared, slack: float, margin: float = 0.0) -> list[list[Hashable]]:
    """Cut a topologically ordered node list into ``n`` pieces of near-equal ``ms``, cheap to cross.

    Within ``slack`` of a stage around each target the position where the fewest bytes cross wins;
    positions as cheap whose distance to the target is within ``margin`` of a stage of the nearest
    one are tied, and the one nearest the target by ``work`` wins (deterministic under timing noise).
    """
    m = len(nodes)
    n = min(n, m)
    if n <= 1:
        return [nodes]
    idx = {v: i for i, v in enumerate(nodes)}
    prefix = [0.0]
    wprefix = [0.0]
    for v in nodes:
        prefix.append(prefix[-1] + p.ms.get(v, 0.0))
        wprefix.append(wprefix[-1] + p.work.get(v, 0.0))
    # crossing[i] = bytes live across a cut placed before index i (difference array)
    diff = [0] * (m + 2)
    for i, v in enumerate(nodes):
        last = max((idx[u] for u in p.h.successors(v) if u in idx), default=i)
        if last > i:
            nbytes = int(p.g.nodes[v].get("bytes", 0))
            diff[i + 1] += nbytes
            diff[last + 1] -= nbytes
    crossing = [0] * (m + 1)
    run = 0
    for i in range(m + 1):
        run += diff[i]
        crossing[i] = run
    # depth[i]: how deep in the module tree a cut before index i lies (the common prefix of the module
    # paths on its two sides): among tied positions, a cut between blocks beats one inside a block
    paths = [str(p.g.nodes[v].get("module", "") or "").split(".") for v in nodes]
    depth = [0] + [_common(paths[i - 1], paths[i]) for i in range(1, m)] + [0]
    total = prefix[-1]
    step = total / n if total > 0 else 0.0
    key = prefix if step > 0 else list(range(m + 1))  # no work: balance node counts
    wstep = wprefix[-1] / n
    wkey = wprefix if wstep > 0 else list(range(m + 1))
    slack = min(max(slack, 0.0), 0.45)  # windows of neighbouring cuts never overlap: linear time
    unit = step if step > 0 else m / n
    cuts: list[int] = []
    lo_bound = 1
    for j in range(1, n):
        if lo_bound > m - (n - j):
            break
        target = j * step if step > 0 else j * m / n
        wtarget = j * wstep if wstep > 0 else j * m / n
        tol = slack * unit
        lo = max(lo_bound, bisect.bisect_left(key, target - tol))
        hi = min(m - (n - j), bisect.bisect_right(key, target + tol) - 1)
        if lo > hi:
            lo = hi = min(max(lo_bound, bisect.bisect_left(key, target)), m - (n - j))
        window = range(lo, hi + 1)
        cheapest = min(crossing[i] for i in window)
        cheap = [i for i in window if crossing[i] == cheapest]
        nearest = min(abs(key[i] - target) for i in cheap)
        tied = [i for i in cheap if abs(key[i] - target) <= nearest + margin * unit]
        best = min(tied, key=lambda i: (depth[i], abs(wkey[i] - wtarget), i))
        cuts.append(best)
        lo_bound = best + 1
    bounds = [0, *cuts, m]
    return [nodes[x:y] for x, y in itertools.pairwise(bounds) if y > x]


def _common(a: list[str], b: list[str]) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k] and a[k]:
        k += 1
    return k


# --------------------------------------------------------------------------- naming


def _name(nodes: Iterable[Hashable], p: _Prepared, root: tuple[str, ...]) -> str:
    share: dict[str, float] = {}
    total = 0.0
    for v in nodes:
        w = p.work.get(v, 0.0) + 1e-9
        total += w
        parts = str(p.g.nodes[v].get("module", "") or "").split(".")
        if parts[: len(root)] == list(root) and len(parts) > len(root) and parts[len(root)]:
            key = parts[len(root)]
            share[key] = share.get(key, 0.0) + w
    if not share:
        return ""
    key, w = max(share.items(), key=lambda kv: kv[1])
    if key.isdigit() and root:
        key = f"{root[-1]}_{key}"  # members.0 -> members_0
    return key if w >= 0.5 * total else ""


def _common_root(g: nx.DiGraph) -> tuple[str, ...]:
    root: list[str] | None = None
    for _v, mod in g.nodes(data="module"):
        if not mod:
            continue  # model inputs and code in the top-level forward say nothing about structure
        parts = str(mod).split(".")
        if root is None:
            root = parts
        else:
            k = 0
            while k < min(len(root), len(parts)) and root[k] == parts[k]:
                k += 1
            root = root[:k]
        if not root:
            return ()
    return tuple(root or ())


def _sanitize(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_]+", "_", name).strip("_")
    return s or "part"


# --------------------------------------------------------------------------- entry point


def _fold_tiny(groups: list[tuple[list[Hashable], str]], p: _Prepared, threshold: float
               ) -> list[tuple[list[Hashable], str]]:
    """A sequential group below ``threshold`` that feeds one component only runs in that component.

    (The join of a nested region: ``deep(h) + wide(h)`` would be a component of its own with no
    parameters.) Every path from the group starts at that component, so no cycle can appear.
    """
    groups = [(list(nodes), kind) for nodes, kind in groups]
    while True:
        comp_of = {v: i for i, (nodes, _) in enumerate(groups) for v in nodes}
        succ: list[set[int]] = [set() for _ in groups]
        for u, v in p.g.edges:
            cu, cv = comp_of.get(u), comp_of.get(v)
            if cu is not None and cv is not None and cu != cv:
                succ[cu].add(cv)
        tiny = [i for i, (nodes, kind) in enumerate(groups)
                if kind in ("sequential", "branch") and len(succ[i]) == 1
                and sum(p.work[v] for v in nodes) < threshold]
        if not tiny:
            return groups
        i = tiny[0]
        (j,) = succ[i]
        groups[j] = (sorted(groups[i][0] + groups[j][0], key=p.pos.__getitem__), groups[j][1])
        del groups[i]



def decide(
    g: nx.DiGraph,
    *,
    stages: int | None = None,
    max_stage_ms: float | None = None,
    min_branch_fraction: float = 0.1,
    max_branches: int = 8,
    cut_slack: float = 0.25,
    min_component_fraction: float = 0.02,
    runtime: RuntimeCost | None = None,
    force: bool = False,
    tie_margin: float = 0.25,
) -> Partition:
    """Split a dataflow graph into components and say why (see [Note: partition algorithm]).

    Parameters
    ----------
    g
        Dataflow DAG; node attributes ``work``, ``ms``, ``bytes``, ``module``, ``input``, ``output``.
    stages
        Cut the heaviest component into this many stages, the others in proportion to their ``work``.
    max_stage_ms
        Cut every component into stages of at most about this much ``ms``.
    min_branch_fraction, min_component_fraction
        A branch carrying less than the larger of these fractions of the total ``work`` is absorbed
        into its region's entry or exit side (``min_component_fraction`` is the floor that keeps
        attention's q/k/v projections together even with ``min_branch_fraction=0``).
    max_branches
        Regions with more kept branches are left whole.
    cut_slack
        How far (as a fraction of the ideal stage) a cut may move to cross fewer bytes.
    runtime
        The runtime's costs; a region splits only when its benefit beats them. ``None``: every
        region with a benefit splits (pure graph use).
    force
        Split every structural region, paying or not.
    tie_margin
        Cut positions whose ``ms`` distance to the target differs by less than this fraction of a
        stage are tied and decided by ``work`` (the default, ``cut_slack``'s: measured ms say
        roughly where a cut goes, bytes and FLOPs exactly where).

    Returns
    -------
    Partition
        Components in a topological order of the component graph (input nodes left out), a
        decision per candidate region, the dead nodes dropped.

    Raises
    ------
    PartitionError
        Both ``stages`` and ``max_stage_ms`` given, non-positive values, or a cyclic graph.
    """
    if stages is not None and max_stage_ms is not None:
        raise PartitionError(
            f"found both stages={stages} and max_stage_ms={max_stage_ms}; needed at most one; "
            "set the other to null"
        )
    if stages is not None and stages < 1:
        raise PartitionError(f"found stages={stages}; needed an integer >= 1")
    if max_stage_ms is not None and max_stage_ms <= 0:
        raise PartitionError(f"found max_stage_ms={max_stage_ms}; needed a positive number")
    p = _Prepared(g)
    g = p.g
    fraction = max(min_branch_fraction, min_component_fraction)
    cands = p.candidates(fraction, max_branches, runtime)
    chosen, decisions = _select(cands, p, runtime, force)
    raw: list[tuple[list[Hashable], str]] = []
    branch_nodes = {v for r in chosen for br in r.branches for v in br}
    _segment([v for v in p.order if v in p.work], chosen, p, raw)
    groups: list[tuple[list[Hashable], str]] = []
    for nodes, kind in raw:
        kept = [v for v in nodes if not g.nodes[v].get("input", False)]
        if kept:
            kind = "branch" if kind == "sequential" and kept[0] in branch_nodes else kind
            groups.append((kept, kind))
    groups = _fold_tiny(groups, p, fraction * p.total)
    # sequential cuts
    works = [sum(p.ms[v] for v in nodes) for nodes, _ in groups]
    flops = [sum(p.work[v] for v in nodes) for nodes, _ in groups]  # stage counts: deterministic
    whole_of: dict[int, list[Hashable]] = {}  # a stage piece -> the nodes it is named after
    cut_rows: list[tuple[list[int], int, int, tuple[str, ...], float, float, str]] = []
    if stages is not None or max_stage_ms is not None:
        fmax = max(flops) if flops else 0.0
        inputs = {v for v in g if p.is_input(v)}
        exits = tower_exits(g, p.ipdom, _SINK, inputs, p.work, fraction * p.total)
        cut_groups: list[tuple[list[Hashable], str]] = []
        for (nodes, kind), w, f in zip(groups, works, flops, strict=True):
            if stages is not None:
                n = max(1, round(stages * f / fmax)) if fmax > 0 else 1
            else:
                assert max_stage_ms is not None
                n = max(1, math.ceil(w / max_stage_ms))
            pieces, named, towers = _stage_pieces(nodes, n, p, exits, cut_slack, tie_margin)
            slowest, whole_ms, reason = 0.0, 0.0, "one stage asked" if n == 1 else "cut"
            if runtime is not None and len(pieces) > 1:
                whole_ms = f * runtime.ms_per_work
                slowest = max(stage_time(pc, g, p.work, inputs, runtime.ms_per_work, runtime.ms_per_byte,
                                         runtime.hop_ms) for pc in pieces)
                if slowest < whole_ms:
                    reason = "slowest stage < whole"
                elif force:
                    reason = "forced (partition.force=true)"
                else:
                    reason = (f"slowest stage {slowest:.3g} ms >= whole {whole_ms:.3g} ms "
                              "(partition.force=true cuts anyway)")
                    pieces, named = [nodes], [nodes]
            if n > 1:
                start = len(cut_groups)
                cut_rows.append((list(range(start, start + len(pieces))), n, len(pieces),
                                 tuple(str(x) for x in towers), slowest, whole_ms, reason))
            cut_groups.extend((pc, "stage" if len(pieces) > 1 else kind) for pc in pieces)
            if len(pieces) > 1:
                whole_of.update((id(pc), nm) for pc, nm in zip(pieces, named, strict=True))
        groups = cut_groups
    # order the component graph topologically (ties: earliest node)
    comp_of = {v: i for i, (nodes, _) in enumerate(groups) for v in nodes}
    cdag = nx.DiGraph()
    cdag.add_nodes_from(range(len(groups)))
    for u, v in g.edges:
        cu, cv = comp_of.get(u), comp_of.get(v)
        if cu is not None and cv is not None and cu != cv:
            cdag.add_edge(cu, cv)
    if not nx.is_directed_acyclic_graph(cdag):  # pragma: no cover - guarded by construction
        raise PartitionError("the chosen components depend on each other in a cycle; report this graph")
    first = [p.pos[nodes[0]] for nodes, _ in groups]
    topo = list(nx.lexicographical_topological_sort(cdag, key=lambda i: first[i]))
    # names
    root = _common_root(g)
    names: list[str] = []
    for k, i in enumerate(topo):
        base = "model" if len(topo) == 1 else _name(whole_of.get(id(groups[i][0]), groups[i][0]), p, root)
        if not base:
            kind = groups[i][1]
            if kind == "sequential" and k == 0:
                base = "stem"
            elif kind == "sequential" and k == len(topo) - 1:
                base = "head"
            else:
                base = "branch" if kind == "branch" else "stage"
        names.append(base)
    # names shared by several components (the sub-towers of one tower): one path segment deeper
    # (stage pieces of one component keep its name and are numbered; pieces of different towers go deeper too)
    for nm in sorted({n for n in names if names.count(n) > 1 and n not in ("stem", "head", "branch", "stage")}):
        idx = [k for k, n in enumerate(names) if n == nm
               and (groups[topo[k]][1] != "stage" or whole_of.get(id(groups[topo[k]][0])) is not None
                    and len({id(whole_of.get(id(groups[topo[j]][0]))) for j, m in enumerate(names) if m == nm}) > 1)]
        basis = [whole_of.get(id(groups[topo[k]][0]), groups[topo[k]][0]) for k in idx]
        subs = [_name(b, p, (*root, nm)) for b in basis]
        for k, sub in zip(idx, subs, strict=True):
            if sub and len({id(b) for b, s2 in zip(basis, subs, strict=True) if s2 == sub}) == 1:
                names[k] = sub if sub.startswith(f"{nm}_") else f"{nm}_{sub}"
    names = [_sanitize(n) for n in names]
    counts: dict[str, int] = {}
    for nm in names:
        counts[nm] = counts.get(nm, 0) + 1
    seen: dict[str, int] = {}
    final: list[str] = []
    for nm in names:
        if counts[nm] > 1:
            seen[nm] = seen.get(nm, -1) + 1
            final.append(f"{nm}_{seen[nm]}")
        else:
            final.append(nm)
    comps = [
        Component(
            name=nm, nodes=tuple(groups[i][0]), kind=groups[i][1], work=sum(p.ms[v] for v in groups[i][0])
        )
        for nm, i in zip(final, topo, strict=True)
    ]
    name_of = {i: nm for nm, i in zip(final, topo, strict=True)}
    cuts = [StageCut(", ".join(name_of[i] for i in idx), n, made, towers, slowest, whole_ms, reason)
            for idx, n, made, towers, slowest, whole_ms, reason in cut_rows]
    return Partition(components=comps, decisions=decisions, dead=p.dead, stage_cuts=cuts)


def _stage_pieces(nodes: list[Hashable], n: int, p: _Prepared, exits: list[Hashable], slack: float, margin: float
                  ) -> tuple[list[list[Hashable]], list[list[Hashable]], tuple[Hashable, ...]]:
    """``nodes`` cut into ``n`` stages: at the input towers inside them first ([Note: input towers] in
    :mod:`hpcsplit.switchboard.cuts`), each tower and the rest balanced within; the pieces, the nodes each
    is named after (its tower, or ``nodes``) and the tower exits cut at."""
    if n <= 1:
        return [nodes], [nodes], ()
    segs, used = tower_segments(nodes, exits, p.ipdom, _SINK, p.pos, p.work, n - 1)
    counts = stage_counts(n, [sum(p.work[v] for v in s) for s in segs]) if used else None
    if counts is None:
        pieces = _cut(nodes, n, p, slack, margin)
        return pieces, [nodes] * len(pieces), ()
    pieces, named = [], []
    for s, c in zip(segs, counts, strict=True):
        cut = _cut(s, c, p, slack, margin)
        pieces += cut
        named += [s] * len(cut)
    return pieces, named, tuple(used)


def partition(g: nx.DiGraph, **options: Any) -> list[Component]:
    """The components of :func:`decide` (same options).

    Examples
    --------
    >>> g = nx.DiGraph([("x", "a"), ("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    >>> [c.nodes for c in partition(g, min_branch_fraction=0.1)]
    [('x', 'a'), ('b',), ('c',), ('d',)]
    """
    return decide(g, **options).components


def component_graph(g: nx.DiGraph, components: list[Component]) -> nx.DiGraph:
    """The graph of components: an edge where a component reads a value another one produces."""
    comp_of = {v: c.name for c in components for v in c.nodes}
    cg = nx.DiGraph()
    cg.add_nodes_from(c.name for c in components)
    for u, v in g.edges:
        cu, cv = comp_of.get(u), comp_of.get(v)
        if cu is not None and cv is not None and cu != cv:
            cg.add_edge(cu, cv)
    return cg
