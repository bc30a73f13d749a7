"""Known answers for the dominator partition on small graphs (pure networkx, no torch)."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest

from hpcsplit.errors import PartitionError
from hpcsplit.switchboard.regions import _idom, component_graph, find_regions, partition


def _graph(edges: list[tuple[str, str]], work: dict[str, float] | None = None, **attrs: dict) -> nx.DiGraph:
    g = nx.DiGraph(edges)
    for v in g.nodes:
        g.nodes[v]["work"] = (work or {}).get(v, 1.0)
        for key, values in attrs.items():
            if v in values:
                g.nodes[v][key] = values[v]
    return g


def _regions(g: nx.DiGraph) -> list[tuple]:
    return [(r.entry, r.exit, r.kind, r.branches) for r in find_regions(g)]


def _parts(g: nx.DiGraph, **kw: object) -> list[tuple]:
    return [c.nodes for c in partition(g, min_branch_fraction=0.0, **kw)]


def test_idom_helper_maps_start_to_itself() -> None:
    g = nx.DiGraph([("a", "b"), ("b", "c")])
    assert _idom(g, "a") == {"a": "a", "b": "a", "c": "b"}


def test_diamond() -> None:
    g = _graph([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")], module={"b": "left.fc", "c": "right.fc"})
    assert _regions(g) == [("a", "d", "disjoint", (("b",), ("c",)))]
    comps = partition(g, min_branch_fraction=0.0)
    assert [c.nodes for c in comps] == [("a",), ("b",), ("c",), ("d",)]
    assert [c.name for c in comps] == ["stem", "left", "right", "head"]
    assert [c.kind for c in comps] == ["sequential", "branch", "branch", "sequential"]


def test_issue_nested_diamond_splits_into_parallel_chains() -> None:
    # A->B,C; B->D,E; C->E; D->F; E->G; F,G->H: the interior of (A, H) stays connected (B->E),
    # so its maximal chains B | C | D-F | E-G are the branches (B,C and D-F,E-G run side by side).
    edges = [
        ("A", "B"),
        ("A", "C"),
        ("B", "D"),
        ("B", "E"),
        ("C", "E"),
        ("D", "F"),
        ("E", "G"),
        ("F", "H"),
        ("G", "H"),
    ]
    g = _graph(edges)
    assert _regions(g) == [("A", "H", "chains", (("B",), ("C",), ("D", "F"), ("E", "G")))]
    assert _parts(g) == [("A",), ("B",), ("C",), ("D", "F"), ("E", "G"), ("H",)]
    cg = component_graph(g, partition(g, min_branch_fraction=0.0))
    assert nx.is_directed_acyclic_graph(cg)


def test_truly_nested_regions() -> None:
    # a -> [b -> (c | d) -> e] | f -> g : the (b, e) diamond nests in one branch of (a, g)
    edges = [("a", "b"), ("b", "c"), ("b", "d"), ("c", "e"), ("d", "e"), ("e", "g"), ("a", "f"), ("f", "g")]
    g = _graph(edges)
    found = {(r.entry, r.exit): r.branches for r in find_regions(g)}
    assert found[("a", "g")] == (("b", "c", "d", "e"), ("f",))
    assert found[("b", "e")] == (("c",), ("d",))
    assert sorted(_parts(g)) == sorted([("a",), ("b",), ("c",), ("d",), ("e",), ("f",), ("g",)])


def test_three_way_branch() -> None:
    g = _graph([("x", "a"), ("a", "b"), ("a", "c"), ("a", "d"), ("b", "e"), ("c", "e"), ("d", "e")])
    assert _regions(g) == [("a", "e", "disjoint", (("b",), ("c",), ("d",)))]
    assert _parts(g) == [("x", "a"), ("b",), ("c",), ("d",), ("e",)]


def test_regions_from_model_inputs() -> None:
    # two inputs, two towers, one join (CLIP's shape): the region starts at the virtual source
    g = _graph(
        [("img", "v1"), ("v1", "v2"), ("txt", "t1"), ("t1", "t2"), ("v2", "join"), ("t2", "join")],
        input={"img": True, "txt": True},
        module={"v1": "vision_model.a", "v2": "vision_model.b", "t1": "text_model.a", "t2": "text_model.b"},
    )
    assert _regions(g) == [(None, "join", "disjoint", (("img", "v1", "v2"), ("txt", "t1", "t2")))]
    comps = partition(g, min_branch_fraction=0.0)
    assert [(c.name, c.nodes) for c in comps] == [
        ("vision_model", ("v1", "v2")),
        ("text_model", ("t1", "t2")),
        ("head", ("join",)),
    ]


def test_chain_has_no_region_and_cuts_where_few_bytes_cross() -> None:
    nodes = [f"n{i}" for i in range(8)]
    g = _graph(list(itertools.pairwise(nodes)), bytes={v: 1000 for v in nodes} | {"n3": 10})
    assert _regions(g) == []
    assert _parts(g) == [tuple(nodes)]
    # the ideal cut is after n3 (4 + 4 work); it is also the cheapest place to cut
    assert _parts(g, stages=2) == [tuple(nodes[:4]), tuple(nodes[4:])]
    # with slack the cut moves one node to the cheap edge
    g.nodes["n3"]["bytes"] = 1000
    g.nodes["n4"]["bytes"] = 10
    assert _parts(g, stages=2, cut_slack=0.3) == [tuple(nodes[:5]), tuple(nodes[5:])]


def test_max_stage_ms_balances_measured_work() -> None:
    nodes = [f"n{i}" for i in range(6)]
    g = _graph(
        list(itertools.pairwise(nodes)),
        work={"n0": 3.0, "n1": 3.0, "n2": 1.0, "n3": 1.0, "n4": 1.0, "n5": 1.0},
    )
    parts = _parts(g, max_stage_ms=5.0, cut_slack=0.0)
    assert len(parts) == 2
    assert parts == [("n0", "n1"), ("n2", "n3", "n4", "n5")]


def test_skip_edge_over_a_region() -> None:
    # residual: s -> a -> (b | c) -> d -> t and s -> t
    edges = [("s", "a"), ("a", "b"), ("a", "c"), ("b", "d"), ("c", "d"), ("d", "t"), ("s", "t")]
    g = _graph(edges)
    found = {(r.entry, r.exit): (r.kind, r.branches) for r in find_regions(g)}
    assert found[("a", "d")] == ("disjoint", (("b",), ("c",)))
    assert _parts(g) == [("s", "a"), ("b",), ("c",), ("d", "t")]


def test_small_branches_are_left_whole() -> None:
    # a big chain with a tiny fork: the fork carries < 5% of the work, so no region is chosen
    edges = [("a", "b"), ("b", "c"), ("b", "d"), ("c", "e"), ("d", "e"), ("e", "f")]
    g = _graph(edges, work={"a": 50.0, "f": 50.0, "c": 0.5, "d": 0.5})
    assert len(partition(g)) == 1
    assert len(partition(g, min_branch_fraction=0.0)) == 4


def test_stages_cut_branches_in_proportion() -> None:
    left = [f"l{i}" for i in range(8)]
    right = [f"r{i}" for i in range(4)]
    edges = [
        ("x", left[0]),
        ("x", right[0]),
        *itertools.pairwise(left),
        *itertools.pairwise(right),
        (left[-1], "y"),
        (right[-1], "y"),
    ]
    g = _graph(edges, work={"x": 0.0, "y": 0.0})
    comps = partition(g, stages=2, min_branch_fraction=0.0)
    sizes = sorted(len(c.nodes) for c in comps if c.kind in ("stage", "branch"))
    assert sizes == [4, 4, 4]  # the 8-node branch in 2 stages, the 4-node one whole
    assert nx.is_directed_acyclic_graph(component_graph(g, comps))


def test_errors() -> None:
    g = _graph([("a", "b")])
    with pytest.raises(PartitionError, match="at most one"):
        partition(g, stages=2, max_stage_ms=1.0)
    with pytest.raises(PartitionError, match="stages=0"):
        partition(g, stages=0)
    with pytest.raises(PartitionError, match="cycle"):
        partition(_graph([("a", "b"), ("b", "a")]))
    with pytest.raises(PartitionError, match="empty"):
        partition(nx.DiGraph())


def test_names_are_unique_and_readable() -> None:
    g = _graph(
        [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")],
        module={"a": "m.stem", "b": "m.tower.0", "c": "m.tower.1", "d": "m.head"},
    )
    assert [c.name for c in partition(g, min_branch_fraction=0.0)] == ["stem", "tower_0", "tower_1", "head"]
