"""Known answers for the dominator partition on small graphs (pure networkx, no torch)."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest

from hpcsplit.errors import PartitionError
from hpcsplit.switchboard.regions import RuntimeCost, _idom, component_graph, decide, find_regions, partition


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
    # the threshold off, the minimum component work (2% of the total) still keeps the fork whole
    assert len(partition(g, min_branch_fraction=0.0)) == 1
    assert len(partition(g, min_branch_fraction=0.0, min_component_fraction=0.0)) == 4


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


# ----------------------------------------------------------------------------- issue 17: structure first


def _tower(prefix: str, n: int, src: str, dst: str) -> list[tuple[str, str]]:
    nodes = [f"{prefix}{i}" for i in range(n)]
    return [(src, nodes[0]), *itertools.pairwise(nodes), (nodes[-1], dst)]


def test_a_dead_end_no_longer_hides_the_towers() -> None:
    # x -> (vision: v0..v3 with a dead end v1 -> w) | (text: t0..t3) -> join -> out; w reaches no output
    edges = [*_tower("v", 4, "img", "join"), *_tower("t", 4, "txt", "join"), ("v1", "w"), ("join", "out")]
    marks = {"input": {"img": True, "txt": True}, "module": {}}
    g = _graph(edges, **marks)
    # the cause: w is a second sink, so the virtual sink post-dominates the source, not the join
    assert (None, "join") not in {(r.entry, r.exit) for r in find_regions(g)}
    g.nodes["out"]["output"] = True
    result = decide(g, min_branch_fraction=0.0)
    assert result.dead == ("w",)
    assert [c.nodes for c in result.components] == [
        ("v0", "v1", "v2", "v3"), ("t0", "t1", "t2", "t3"), ("join", "out")
    ]


def test_a_small_branch_is_absorbed_not_a_veto() -> None:
    # two towers and an interaction term (a * b).sum() of their inputs beside them (issue 17, cause 2)
    edges = [*_tower("a", 4, "ea", "head"), *_tower("b", 4, "eb", "head"), ("x", "mul"), ("y", "mul"),
             ("mul", "sum"), ("sum", "head"), ("x", "ea"), ("y", "eb")]
    g = _graph(edges, work={"mul": 0.1, "sum": 0.1, "x": 0.0, "y": 0.0}, input={"x": True, "y": True})
    (r,) = find_regions(g, min_branch_fraction=0.05)
    assert r.branches == (("x", "ea", "a0", "a1", "a2", "a3"), ("y", "eb", "b0", "b1", "b2", "b3"))
    assert r.absorbed_exit == (("mul", "sum"),)  # no entry side at the model inputs: the exit takes it
    comps = partition(g)
    assert [c.nodes for c in comps] == [
        ("ea", "a0", "a1", "a2", "a3"), ("eb", "b0", "b1", "b2", "b3"), ("mul", "sum", "head")
    ]
    assert nx.is_directed_acyclic_graph(component_graph(g, comps))


def test_an_absorbed_branch_takes_the_side_that_sends_fewer_bytes() -> None:
    # s -> towers -> j, and a tiny branch s -> r (a reduction: few bytes out) -> j
    edges = [("x", "s"), *_tower("a", 3, "s", "j"), *_tower("b", 3, "s", "j"), ("s", "r"), ("r", "j")]
    g = _graph(edges, work={"r": 0.01}, bytes={"s": 4096, "r": 4}, input={"x": True})
    (r,) = find_regions(g, min_branch_fraction=0.05)
    assert r.absorbed_entry == (("r",),) and not r.absorbed_exit
    assert next(c.nodes for c in partition(g)) == ("s", "r")  # the reduction runs with the stem
    g.nodes["s"]["bytes"], g.nodes["r"]["bytes"] = 4, 4096  # now the branch's output is the big one
    (r,) = find_regions(g, min_branch_fraction=0.05)
    assert r.absorbed_exit == (("r",),)
    assert [c.nodes for c in partition(g)][-1] == ("r", "j")


def test_towers_whose_input_skips_to_the_head() -> None:
    # x -> e -> (tower a | tower b) -> cat, and x -> mean -> cat: cat's idom is x, not e
    edges = [("x", "e"), *_tower("a", 3, "e", "cat"), *_tower("b", 3, "e", "cat"), ("x", "mean"),
             ("mean", "cat")]
    g = _graph(edges, work={"mean": 0.01}, input={"x": True})
    assert ("e", "cat") in {(r.entry, r.exit) for r in find_regions(g, min_branch_fraction=0.05)}
    assert [c.nodes for c in partition(g)] == [("e", "mean"), ("a0", "a1", "a2"), ("b0", "b1", "b2"), ("cat",)]


def test_members_sharing_a_model_input_are_branches() -> None:
    # an ensemble: three members read the same input; inputs connect nothing (the frontend sends each)
    edges = [*_tower("m", 3, "x", "stack"), *_tower("n", 3, "x", "stack"), *_tower("o", 3, "x", "stack")]
    g = _graph(edges, input={"x": True})
    (r,) = find_regions(g)
    assert r.entry == "x" and len(r.branches) == 3


def test_attention_qkv_never_becomes_three_node_components() -> None:
    # twelve layers: ln -> q, k, v (3 nodes each) -> attn -> o -> add (residual from the layer input)
    edges: list[tuple[str, str]] = []
    work: dict[str, float] = {}
    prev = "x"
    for i in range(12):
        ln, attn, o, add = f"ln{i}", f"attn{i}", f"o{i}", f"add{i}"
        edges += [(prev, ln), (attn, o), (o, add), (prev, add)]
        for p in "qkv":
            chain = [f"{p}{i}_{j}" for j in range(3)]
            edges += [(ln, chain[0]), *itertools.pairwise(chain), (chain[-1], attn)]
            work[chain[0]] = 4.0
        work[attn], work[o] = 2.0, 8.0  # o: the output projection and the MLP
        prev = add
    g = _graph(edges, work=work, input={"x": True})
    comps = partition(g, min_branch_fraction=0.0)  # the threshold off: the 2% floor still holds
    assert len(comps) == 1
    forced = partition(g, min_branch_fraction=0.0, min_component_fraction=0.0, force=True)
    assert any(len(c.nodes) == 3 for c in forced)  # what the floor prevents


def test_a_split_that_does_not_pay_is_not_made() -> None:
    edges = [("x", "a"), *_tower("l", 2, "a", "d"), *_tower("r", 2, "a", "d")]
    g = _graph(edges, work={"a": 1e5, "d": 1e5, "l0": 1e5, "l1": 1e5, "r0": 1e5, "r1": 1e5},
               bytes={v: 1000 for v in ("a", "l1", "r1")}, input={"x": True})
    cheap = RuntimeCost(ms_per_work=1e-5, ms_per_byte=1e-4, hop_ms=0.3)  # benefit 2 ms
    dear = RuntimeCost(ms_per_work=1e-5, ms_per_byte=1e-4, hop_ms=1.0)
    for rt, split in ((cheap, True), (dear, False)):
        result = decide(g, runtime=rt)
        (d,) = result.decisions
        assert d.added_edges == 4 and d.crossing_bytes == 4000
        assert d.benefit_ms == pytest.approx(2.0) and d.split is split
        assert d.cost_ms == pytest.approx(4 * rt.hop_ms + 0.4)
        assert len(result.components) == (4 if split else 1)
    d = decide(g, runtime=dear).decisions[0]
    assert "benefit 2 ms <= cost 4.4 ms" in d.reason
    assert len(decide(g, runtime=dear, force=True).components) == 4


def test_timing_noise_moves_no_component_and_no_cut() -> None:
    # two towers of twelve equal layers; measured ms with +-20% noise: structure and cuts stay put
    import random

    edges = [("x", "e"), *_tower("a", 12, "e", "j"), *_tower("b", 12, "e", "j")]
    g = _graph(edges, bytes={v: 100 for v in ("e", "j")}, input={"x": True})
    rng = random.Random(0)
    seen = set()
    for _ in range(20):
        for v in g.nodes:
            g.nodes[v]["ms"] = rng.uniform(0.8, 1.2)
        seen.add(tuple(c.nodes for c in partition(g)))
    assert len(seen) == 1
    cuts = set()
    for _ in range(20):
        for v in g.nodes:
            g.nodes[v]["ms"] = 1.0 + rng.uniform(-0.01, 0.01)  # equal layers: every boundary ties
        cuts.add(tuple(c.nodes for c in partition(g, stages=2, cut_slack=0.25)))
    assert len(cuts) == 1


def test_the_tiny_join_of_a_nested_region_runs_in_the_next_component() -> None:
    # x -> pre -> (deep | wide) -> add, beside a right tower; cat -> out. The add alone would be a
    # component without work of its own.
    edges = [("x", "pre"), *_tower("d", 2, "pre", "add"), *_tower("w", 2, "pre", "add"), ("add", "cat"),
             *_tower("r", 4, "x", "cat"), ("cat", "out")]
    g = _graph(edges, work={"add": 0.01, "cat": 0.01, "x": 0.0}, input={"x": True})
    comps = partition(g, min_branch_fraction=0.05)
    assert [c.nodes for c in comps] == [
        ("pre",), ("r0", "r1", "r2", "r3"), ("d0", "d1"), ("w0", "w1"), ("add", "cat", "out")
    ]
    assert nx.is_directed_acyclic_graph(component_graph(g, comps))


def test_experts_whose_small_gate_joins_after_them() -> None:
    # x -> four experts -> stack -> mul <- softmax <- gate <- x: stack is not ipdom(x) (the gate meets later)
    edges = [e for i in range(4) for e in _tower(f"e{i}_", 2, "x", "stack")]
    edges += [("x", "gate"), ("gate", "softmax"), ("stack", "mul"), ("softmax", "mul"), ("mul", "sum")]
    g = _graph(edges, work={"gate": 0.1, "softmax": 0.01, "stack": 0.01, "mul": 0.01, "sum": 0.01},
               input={"x": True})
    assert ("x", "stack") in {(r.entry, r.exit) for r in find_regions(g, min_branch_fraction=0.1)}
    comps = partition(g)
    assert [c.nodes for c in comps][:4] == [(f"e{i}_0", f"e{i}_1") for i in range(4)]
    assert nx.is_directed_acyclic_graph(component_graph(g, comps))
