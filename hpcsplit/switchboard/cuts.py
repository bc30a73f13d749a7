"""Where sequential cuts go first, and whether they pay: input towers and the stage rule.

Pure graph algorithms on :class:`networkx.DiGraph`; nothing here imports torch. Used by
:func:`hpcsplit.switchboard.regions.decide` (step 7 of [Note: partition algorithm]).

[Note: input towers]
An encoder-decoder (T5, BART, Whisper) has two input streams: the encoder reads the source
(``input_ids``, ``input_features``), the decoder the target (``decoder_input_ids``), and the
encoder's output enters every decoder layer's cross-attention. No single-entry/single-exit region
holds the encoder (its output has many readers), so no branch split finds it; but it is a *tower*:
a node ``x`` such that every non-input ancestor of ``x`` is post-dominated by ``x`` (all that the
ancestors compute leaves through ``x``), reached from some model inputs but not from all of them
(the rest of the graph reads an input stream of its own). The tower's nodes are ancestor-closed, so
"tower, then the rest" is a sequential split where only ``x`` crosses (model inputs go to every
component that reads them). A DETR-style detector has one too: the backbone (from ``pixel_values``)
ends where the positional encoding (from ``pixel_mask``) joins it. A decoder-only model or a vision
backbone has a single stream: no tower. Towers nest (every encoder layer's output is one); the
maximal ones, carrying at least the branch threshold of work with as much left beside them, are
the *stage boundaries that come first*: with ``stages``/``max_stage_ms`` each such tower becomes a
stage of its own (or several, in proportion to its FLOPs) before the rest is balanced, so the
encoder's output crosses once, into the decoder's stage. Found in near-linear time: for every edge
``u -> v`` the nodes on the post-dominator tree path from ``v`` up to the first one that
post-dominates ``u`` are not exits (a union-find skips nodes already ruled out).

[Note: stages pay]
A sequential cut never shortens a request: it lets the pieces work on different requests at once,
so a pipeline of stages serves at the rate of its slowest stage, and each stage pays one hop per
request and the transfer of what it receives. Cutting a component into stages pays when its
slowest stage (its FLOPs at ``compute_gflops`` plus ``hop_ms`` plus its received bytes at
``transport_gb_s``) is faster than the whole component. Decided on FLOPs and bytes (the same on any
machine); a component whose cut does not pay stays whole (``partition.force=true`` cuts anyway).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx

__all__ = ["StageCut", "stage_counts", "stage_time", "subtree_sums", "tower_exits", "tower_segments", "tree_intervals"]


@dataclass(frozen=True, slots=True)
class StageCut:
    """Why a component was or was not cut into stages (a row of the export's stage table).

    ``towers`` names the tower exits cut at first; ``slowest_ms`` / ``whole_ms`` compare the slowest
    stage (compute, hop and received bytes) with the whole component (compute), both from FLOPs.
    """

    component: str
    requested: int
    made: int
    towers: tuple[str, ...]
    slowest_ms: float
    whole_ms: float
    reason: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (``layout.json``'s ``partition.stage_cuts``)."""
        return {"component": self.component, "requested": self.requested, "made": self.made,
                "towers": list(self.towers), "slowest_ms": self.slowest_ms, "whole_ms": self.whole_ms,
                "reason": self.reason}


def tree_intervals(parent: Mapping[Hashable, Hashable], root: Hashable) -> tuple[dict, dict]:
    """Entry and exit times of a DFS of the tree ``parent`` gives (iterative): ``x`` is above ``u`` iff
    ``tin[x] <= tin[u]`` and ``tout[u] <= tout[x]``."""
    children: dict[Hashable, list[Hashable]] = {}
    for v, q in parent.items():
        if v != root:
            children.setdefault(q, []).append(v)
    tin: dict[Hashable, int] = {}
    tout: dict[Hashable, int] = {}
    clock = 0
    stack: list[tuple[Hashable, bool]] = [(root, False)]
    while stack:
        v, done = stack.pop()
        if done:
            tout[v] = clock
        else:
            tin[v] = clock
            stack.append((v, True))
            stack.extend((c, False) for c in children.get(v, ()))
        clock += 1
    return tin, tout


def tower_exits(
    g: nx.DiGraph, ipdom: Mapping[Hashable, Hashable], sink: Hashable, inputs: set[Hashable],
    work: Mapping[Hashable, float], threshold: float,
) -> list[Hashable]:
    """The maximal input towers' exits of ``g`` (see [Note: input towers]).

    Parameters
    ----------
    g
        The dataflow DAG (model inputs are nodes in ``inputs``).
    ipdom, sink
        Immediate post-dominators of ``g`` with a virtual ``sink`` after its outputs (a tree on ``sink``).
    inputs
        The model input nodes.
    work, threshold
        Node work; a tower and what is left beside it each carry at least ``threshold``.

    Examples
    --------
    >>> g = nx.DiGraph([("src", "e1"), ("e1", "e2"), ("tgt", "d1"), ("e2", "d1"), ("d1", "d2"), ("e2", "d2")])
    >>> ipdom = {"src": "e1", "e1": "e2", "e2": "d2", "tgt": "d1", "d1": "d2", "d2": "sink", "sink": "sink"}
    >>> tower_exits(g, ipdom, "sink", {"src", "tgt"}, dict.fromkeys(g, 1.0), 1.0)
    ['e2']
    """
    tin, tout = tree_intervals(ipdom, sink)

    def pdom(x: Hashable, u: Hashable) -> bool:
        return tin[x] <= tin[u] and tout[u] <= tout[x]

    bad: dict[Hashable, Hashable] = {}  # ruled out -> where to look next (union-find, path-compressed)

    def find(x: Hashable) -> Hashable:
        path = []
        while x in bad:
            path.append(x)
            x = bad[x]
        for y in path:
            bad[y] = x
        return x

    for u, v in g.edges:
        if u in inputs:
            continue
        x = find(v)
        while x != sink and not pdom(x, u):
            bad[x] = ipdom[x]
            x = find(ipdom[x])
    # inputs reaching each node (few inputs: one pass each)
    reach: dict[Hashable, int] = {}
    for k, i in enumerate(sorted(inputs, key=str)):
        for v in nx.descendants(g, i):
            reach[v] = reach.get(v, 0) | (1 << k)
    everything = (1 << len(inputs)) - 1
    sums = subtree_sums(ipdom, sink, {v: w for v, w in work.items() if v not in inputs})
    total = sum(w for v, w in work.items() if v not in inputs)
    exits = {x for x in g if x not in inputs and x not in bad and reach.get(x, 0) not in (0, everything)
             and sums.get(x, 0.0) >= threshold and total - sums.get(x, 0.0) >= threshold}
    maximal = []
    for x in exits:
        y = ipdom[x]
        while y != sink and y not in exits:
            y = ipdom[y]
        if y == sink:
            maximal.append(x)
    return sorted(maximal, key=str)


def subtree_sums(parent: Mapping[Hashable, Hashable], root: Hashable, w: Mapping[Hashable, float]) -> dict:
    """Sum of ``w`` over each node's subtree in the tree ``parent`` gives (iterative)."""
    children: dict[Hashable, list[Hashable]] = {}
    for v, q in parent.items():
        if v != root:
            children.setdefault(q, []).append(v)
    order = [root]
    i = 0
    while i < len(order):
        order.extend(children.get(order[i], ()))
        i += 1
    sums = {v: w.get(v, 0.0) for v in order}
    for v in reversed(order):
        if v != root:
            sums[parent[v]] += sums[v]
    return sums


def tower_segments(
    nodes: Sequence[Hashable], exits: Sequence[Hashable], ipdom: Mapping[Hashable, Hashable], sink: Hashable,
    pos: Mapping[Hashable, int], work: Mapping[Hashable, float], limit: int,
) -> tuple[list[list[Hashable]], list[Hashable]]:
    """``nodes`` (topologically ordered) as the heaviest ``limit`` towers of ``exits`` inside them (in
    topological order), then the rest.

    A tower must be a proper part of ``nodes``; each is ancestor-closed and maximal towers do not
    overlap, so the segments in this order are a valid sequence. Returns the segments and the exits used
    (one segment and no exit when none fits).
    """
    inside = set(nodes)
    tin, tout = tree_intervals(ipdom, sink)
    towers = []
    for x in exits:
        if x in inside:
            tower = [v for v in nodes if tin[x] <= tin[v] and tout[v] <= tout[x]]
            if len(tower) < len(nodes):
                towers.append((-sum(work.get(v, 0.0) for v in tower), pos[x], x, tower))
    chosen = sorted(sorted(towers)[:max(limit, 0)], key=lambda t: t[1])
    if not chosen:
        return [list(nodes)], []
    taken = {v for *_, tower in chosen for v in tower}
    return [t[3] for t in chosen] + [[v for v in nodes if v not in taken]], [t[2] for t in chosen]


def stage_counts(n: int, works: Sequence[float]) -> list[int] | None:
    """``n`` stages over segments of ``works``: one each, the rest by largest remainder of their share.

    ``None`` when there are more segments than stages.

    >>> stage_counts(2, [5.0, 4.0]), stage_counts(4, [9.0, 1.0]), stage_counts(1, [1.0, 1.0])
    ([1, 1], [3, 1], None)
    """
    k = len(works)
    if n < k:
        return None
    total = sum(works) or 1.0
    ideal = [n * w / total for w in works]
    counts = [max(1, int(c)) for c in ideal]
    while sum(counts) > n:  # a floor of 1 took too many: take back from the largest surplus
        i = max(range(k), key=lambda i: (counts[i] - ideal[i], -i))
        counts[i] -= 1
    while sum(counts) < n:
        i = max(range(k), key=lambda i: (ideal[i] - counts[i], -i))
        counts[i] += 1
    return counts


def stage_time(piece: Sequence[Hashable], g: nx.DiGraph, work: Mapping[Hashable, float],
               inputs: set[Hashable], ms_per_work: float, ms_per_byte: float, hop_ms: float) -> float:
    """A stage's time per request in a pipeline: its work, one hop and the bytes it receives."""
    inside = set(piece)
    received = {u for v in piece for u in g.predecessors(v) if u not in inside and u not in inputs}
    nbytes = sum(int(g.nodes[u].get("bytes", 0)) for u in received)
    return sum(work.get(v, 0.0) for v in piece) * ms_per_work + hop_ms + nbytes * ms_per_byte
