"""Split a dataflow graph into components: SESE branch regions via dominators, then sequential cuts.

Pure graph algorithms on a :class:`networkx.DiGraph`; nothing here imports torch.

The graph is the *dataflow* graph of a captured model: one node per operation that carries data,
an edge ``u -> v`` when ``v`` reads a value ``u`` produces. Parameters, buffers, constants and
nodes with no data (guards, asserts, ``get_attr``) must be left out by the caller (see
:mod:`hpcsplit.switchboard.graph`). Node attributes (all optional):

``work``    cost of the node (measured milliseconds at the timing batch; default 1.0)
``bytes``   activation bytes per sample the node produces (default 0)
``module``  dotted module path (``"vision_model.encoder.layers.3.mlp"``; default ``""``)
``input``   True for model inputs (placeholders): analysed, but never put into a component

[Note: partition algorithm]
1. A virtual source feeds every node without predecessors, a virtual sink drains every node
   without successors. ``immediate_dominators`` on the graph and on its reverse give the dominator
   and post-dominator trees (:func:`_idom` normalises the networkx>=3.6 result, which leaves out
   the start node).
2. Canonical SESE regions are the pairs ``(a, b)`` with ``b = ipdom(a)`` and ``a = idom(b)``.
   Their interior (reachable from ``a`` without passing ``b``) is found by a bounded search,
   after a cheap upper bound on its work (dominator-subtree work) has ruled out the small ones.
3. A region *branches* when its interior falls apart into >= 2 weakly connected parts (CLIP:
   image tower and text tower), or, failing that, when its interior, cut into maximal chains,
   has chains that can run side by side (the toy's nested diamond). Every branch must carry at
   least ``min_branch_fraction`` of the total work.
4. Regions are chosen greedily by the work they take off the critical path
   (interior work minus the heaviest branch), disconnected-branch regions before chain regions;
   a chosen region may nest inside one branch of another, never overlap it.
5. Nodes outside the chosen branches become sequential components, grouped by how many
   chosen regions lie before them (stem, head, ...). This keeps the component graph acyclic.
6. ``stages`` / ``max_stage_ms`` cut components further, at topological positions near
   equal-work targets where the fewest activation bytes cross.
All steps are linear in the graph size, except nested-region searches (linear per nesting level).
"""

from __future__ import annotations

import bisect
import itertools
import math
import re
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import networkx as nx

from hpcsplit.errors import PartitionError

__all__ = ["Component", "Region", "component_graph", "find_regions", "partition"]

_SOURCE = ("__hpcsplit_source__",)
_SINK = ("__hpcsplit_sink__",)


@dataclass(frozen=True, slots=True)
class Region:
    """A single-entry/single-exit region whose interior splits into parallel branches.

    ``entry``/``exit`` are ``None`` when the region starts at the model inputs or ends at its
    outputs (the virtual source/sink). ``branches`` holds node tuples in topological order.
    """

    entry: Hashable | None
    exit: Hashable | None
    branches: tuple[tuple[Hashable, ...], ...]
    kind: str  # "disjoint" (weakly disconnected branches) or "chains" (parallel chains)
    work: float
    benefit: float  # interior work minus the heaviest branch's work


@dataclass(frozen=True, slots=True)
class Component:
    """A group of graph nodes that becomes one program.

    ``kind`` is ``"branch"`` (a branch of a region), ``"sequential"`` (between regions) or
    ``"stage"`` (a piece of a sequential cut). ``nodes`` are in topological order.
    """

    name: str
    nodes: tuple[Hashable, ...]
    kind: str
    work: float


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


def _tree_subtree_sums(idom: dict[Hashable, Hashable], root: Hashable, w: dict) -> dict:
    """Sum of ``w`` over each node's subtree in the tree given by ``idom`` (iterative)."""
    children: dict[Hashable, list[Hashable]] = {}
    for v, p in idom.items():
        if v != root:
            children.setdefault(p, []).append(v)
    order = [root]
    i = 0
    while i < len(order):
        order.extend(children.get(order[i], ()))
        i += 1
    sums = {v: w.get(v, 0.0) for v in order}
    for v in reversed(order):
        if v != root:
            sums[idom[v]] += sums[v]
    return sums


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


class _Prepared:
    """The graph with terminals, topological positions, dominator trees and work sums."""

    def __init__(self, g: nx.DiGraph) -> None:
        if g.number_of_nodes() == 0:
            raise PartitionError("found an empty dataflow graph; needed at least one node")
        self.g = g
        self.h = _with_terminals(g)
        try:
            self.order = list(nx.topological_sort(self.h))
        except nx.NetworkXUnfeasible as e:
            raise PartitionError(
                "found a cycle in the dataflow graph; needed a DAG (a captured model)"
            ) from e
        self.pos = {v: i for i, v in enumerate(self.order)}
        self.work = {v: float(g.nodes[v].get("work", 1.0)) for v in g.nodes}
        self.total = sum(self.work.values())
        self.idom = _idom(self.h, _SOURCE)
        self.ipdom = _idom(self.h.reverse(copy=False), _SINK)
        self.dom_sums = _tree_subtree_sums(self.idom, _SOURCE, self.work)

    def regions(self, min_branch_fraction: float, max_branches: int) -> list[Region]:
        threshold = min_branch_fraction * self.total
        found: list[Region] = []
        for a in self.order:
            if a == _SINK:
                continue
            b = self.ipdom[a]
            if b == a or self.idom.get(b) != a:
                continue
            succ = list(self.h.successors(a))
            if len(succ) == 1 and succ[0] == b:
                continue  # an edge, nothing inside
            upper = self.dom_sums[a] - self.dom_sums[b] - self.work.get(a, 0.0)
            if upper < 2 * threshold - 1e-12 and threshold > 0:
                continue
            inner = _interior(self.h, a, b)
            if len(inner) < 2:
                continue
            parts = _weak_parts(self.h, inner)
            kind = "disjoint"
            if len(parts) < 2:
                parts, parallel = _chain_parts(self.h, inner, self.pos)
                kind = "chains"
                if not parallel:
                    continue
            if not 2 <= len(parts) <= max_branches:
                continue
            works = [sum(self.work[v] for v in p) for p in parts]
            if min(works) < threshold or (threshold == 0 and kind == "chains" and min(works) <= 0):
                continue
            branches = tuple(
                tuple(sorted(p, key=self.pos.__getitem__))
                for p in sorted(parts, key=lambda p: min(self.pos[v] for v in p))
            )
            total = sum(works)
            found.append(
                Region(
                    entry=None if a == _SOURCE else a,
                    exit=None if b == _SINK else b,
                    branches=branches,
                    kind=kind,
                    work=total,
                    benefit=total - max(works),
                )
            )
        return found


def find_regions(g: nx.DiGraph, *, min_branch_fraction: float = 0.0, max_branches: int = 16) -> list[Region]:
    """Every canonical SESE region of ``g`` whose interior splits into parallel branches.

    Parameters
    ----------
    g
        Dataflow graph (a DAG); see the module docstring for node attributes.
    min_branch_fraction
        Each branch must carry at least this fraction of the graph's total work.
    max_branches
        Regions with more branches than this are skipped.

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
    return _Prepared(g).regions(min_branch_fraction, max_branches)


# --------------------------------------------------------------------------- selection


def _select(regions: list[Region]) -> list[Region]:
    """Greedy by benefit: keep regions that are disjoint from, or nested in one branch of, each other."""
    chosen: list[tuple[Region, set, list[set]]] = []
    # regions whose branches are disconnected come first: a "chains" region only fills in where
    # no such region lies (a skip edge over a diamond keeps the diamond)
    for r in sorted(regions, key=lambda r: (r.kind != "disjoint", -r.benefit)):
        if r.benefit <= 0:
            continue
        inner = {v for br in r.branches for v in br}
        blocks = [set(br) for br in r.branches]
        ok = True
        for _q, qinner, qblocks in chosen:
            common = inner & qinner
            if not common:
                continue
            if common == inner and any(inner <= qb for qb in qblocks):
                continue
            if common == qinner and any(qinner <= rb for rb in blocks):
                continue
            ok = False
            break
        if ok:
            chosen.append((r, inner, blocks))
    return [c[0] for c in chosen]


def _segment(
    scope: list[Hashable], regions: list[Region], p: _Prepared, out: list[tuple[list[Hashable], str]]
) -> None:
    """Append the components of ``scope`` (topologically ordered) to ``out``."""
    scope_set = set(scope)
    # regions directly inside this scope: not inside another region that is inside the scope
    mine = [r for r in regions if all(v in scope_set for br in r.branches for v in br)]
    inner_sets = [{v for br in r.branches for v in br} for r in mine]
    direct: list[int] = []
    for i in sorted(range(len(mine)), key=lambda i: -len(inner_sets[i])):
        if not any(inner_sets[i] <= inner_sets[j] for j in direct):
            direct.append(i)
    region_of: dict[Hashable, int] = {}
    for i in direct:
        for v in inner_sets[i]:
            region_of[v] = i
    level: dict[Hashable, int] = {}
    segments: dict[int, list[Hashable]] = {}
    for v in scope:
        if v in region_of:
            continue
        s = 0
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
            _segment(list(br), [r for r in rest if all(v in brs for b2 in r.branches for v in b2)], p, out)


# --------------------------------------------------------------------------- sequential cuts


def _cut(nodes: list[Hashable], n: int, p: _Prepared, slack: float) -> list[list[Hashable]]:
    """Cut a topologically ordered node list into ``n`` pieces of near-equal work, cheap to cross."""
    m = len(nodes)
    n = min(n, m)
    if n <= 1:
        return [nodes]
    idx = {v: i for i, v in enumerate(nodes)}
    prefix = [0.0]
    for v in nodes:
        prefix.append(prefix[-1] + p.work.get(v, 0.0))
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
    total = prefix[-1]
    step = total / n if total > 0 else 0.0
    key = prefix if step > 0 else list(range(m + 1))  # no measured work: balance node counts
    slack = min(max(slack, 0.0), 0.45)  # windows of neighbouring cuts never overlap: linear time
    cuts: list[int] = []
    lo_bound = 1
    for j in range(1, n):
        if lo_bound > m - (n - j):
            break
        target = j * step if step > 0 else j * m / n
        tol = slack * (step if step > 0 else m / n)
        lo = max(lo_bound, bisect.bisect_left(key, target - tol))
        hi = min(m - (n - j), bisect.bisect_right(key, target + tol) - 1)
        if lo > hi:
            lo = hi = min(max(lo_bound, bisect.bisect_left(key, target)), m - (n - j))
        best = min(range(lo, hi + 1), key=lambda i: (crossing[i], abs(key[i] - target)))
        cuts.append(best)
        lo_bound = best + 1
    bounds = [0, *cuts, m]
    return [nodes[x:y] for x, y in itertools.pairwise(bounds) if y > x]


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


def partition(
    g: nx.DiGraph,
    *,
    stages: int | None = None,
    max_stage_ms: float | None = None,
    min_branch_fraction: float = 0.05,
    max_branches: int = 8,
    cut_slack: float = 0.25,
) -> list[Component]:
    """Split a dataflow graph into components (see [Note: partition algorithm]).

    Parameters
    ----------
    g
        Dataflow DAG; node attributes ``work``, ``bytes``, ``module``, ``input``.
    stages
        Cut the heaviest component into this many stages, the others in proportion to their work.
    max_stage_ms
        Cut every component into stages of at most about this much ``work``.
    min_branch_fraction
        A branch must carry at least this fraction of the total work for its region to count.
    max_branches
        Regions with more branches are left whole.
    cut_slack
        How far (as a fraction of the ideal stage work) a cut may move to cross fewer bytes.

    Returns
    -------
    list[Component]
        In a topological order of the component graph; input nodes are left out.

    Raises
    ------
    PartitionError
        Both ``stages`` and ``max_stage_ms`` given, non-positive values, or a cyclic graph.

    Examples
    --------
    >>> g = nx.DiGraph([("x", "a"), ("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")])
    >>> [c.nodes for c in partition(g, min_branch_fraction=0.1)]
    [('x', 'a'), ('b',), ('c',), ('d',)]
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
    chosen = _select(p.regions(min_branch_fraction, max_branches))
    raw: list[tuple[list[Hashable], str]] = []
    branch_nodes = {v for r in chosen for br in r.branches for v in br}
    _segment([v for v in p.order if v in p.work], chosen, p, raw)
    groups: list[tuple[list[Hashable], str]] = []
    for nodes, kind in raw:
        kept = [v for v in nodes if not g.nodes[v].get("input", False)]
        if kept:
            kind = "branch" if kind == "sequential" and kept[0] in branch_nodes else kind
            groups.append((kept, kind))
    # sequential cuts
    works = [sum(p.work[v] for v in nodes) for nodes, _ in groups]
    if stages is not None or max_stage_ms is not None:
        wmax = max(works) if works else 0.0
        cut_groups: list[tuple[list[Hashable], str]] = []
        for (nodes, kind), w in zip(groups, works, strict=True):
            if stages is not None:
                n = max(1, round(stages * w / wmax)) if wmax > 0 else 1
            else:
                assert max_stage_ms is not None
                n = max(1, math.ceil(w / max_stage_ms))
            pieces = _cut(nodes, n, p, cut_slack)
            cut_groups.extend((pc, "stage" if len(pieces) > 1 else kind) for pc in pieces)
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
        base = _name(groups[i][0], p, root)
        if not base:
            kind = groups[i][1]
            if len(topo) == 1:
                base = "model"
            elif kind == "sequential" and k == 0:
                base = "stem"
            elif kind == "sequential" and k == len(topo) - 1:
                base = "head"
            else:
                base = "branch" if kind == "branch" else "stage"
        names.append(_sanitize(base))
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
    return [
        Component(
            name=nm, nodes=tuple(groups[i][0]), kind=groups[i][1], work=sum(p.work[v] for v in groups[i][0])
        )
        for nm, i in zip(final, topo, strict=True)
    ]


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
