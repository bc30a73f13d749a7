"""Plan + switchboard edges -> dataflow (pure), routing and critical path."""

from __future__ import annotations

import dataclasses

import pytest

from hpcsplit.errors import PlanError
from hpcsplit.runtime.routing import (
    GraphSpec,
    Router,
    _toy_plan,
    build_dataflow,
    critical_path_ms,
    whole_graph_of,
    whole_plan,
)

# x -> a -> (p) -> j ; x -> b -> (q) -> j ; j -> y ; b also -> output z
DIAMOND = GraphSpec(
    inputs=("x",),
    outputs=("y", "z"),
    components=(("a", ("x",), ("p",)), ("b", ("x",), ("q",)), ("j", ("p", "q"), ("y",))),
    edges=(("input", "x", "a", "x"), ("input", "x", "b", "x"), ("a", "p", "j", "p"), ("b", "q", "j", "q"),
           ("j", "y", "output", "y"), ("b", "q", "output", "z")),
    batch_dims={"q": (1,), "y": (0, 1)},
)


def test_diamond_dataflow() -> None:
    df = build_dataflow(_toy_plan(["a", "b", "j"], replicas=2, batch_size=4), DIAMOND)
    assert df.input_sinks == ((("a", 0), ("b", 0)),)
    assert df.component("b").sinks == ((("j", 1), ("output", 1)),)
    assert df.component("j").sources == (("a", "p"), ("b", "q"))
    assert df.output_sources == (("j", "y"), ("b", "q"))
    assert df.component("a").replicas == (1, 2)
    assert df.rank_component[5] == "j"
    assert df.send_groups("b") == {"j": ((0, 1),), "output": ((0, 1),)}
    assert df.entry_groups() == {"a": ((0, 0),), "b": ((0, 0),)}
    # batch dims travel with the ports; a join fed a value with 2 batch dims would run one at a time
    assert df.component("b").out_bdims == ((1,),)
    assert df.component("j").in_bdims == ((0,), (1,))
    assert df.component("j").batch_sizes == (4, 4)
    assert df.output_bdims == ((0, 1), (1,))
    # shutdown order: STOP from the frontend to a, b replicas; j waits for all of a's and b's replicas
    assert df.entry_ranks() == (1, 2, 3, 4)
    assert df.upstream_ranks("a") == (0,)
    assert df.upstream_ranks("j") == (1, 2, 3, 4)
    assert df.downstream_ranks("b") == (5, 6)
    assert df.downstream_ranks("j") == ()
    text = df.format()
    assert "j: (a.p, b.q) on [r5(b4), r6(b4)]" in text


def test_component_with_multi_batch_dim_input_runs_batch_1() -> None:
    g = GraphSpec(("x",), ("y",), (("a", ("x",), ("s",)), ("b", ("s",), ("y",))),
                  (("input", "x", "a", "x"), ("a", "s", "b", "s"), ("b", "y", "output", "y")),
                  batch_dims={"s": (0, 1)})
    df = build_dataflow(_toy_plan(["a", "b"], batch_size=8), g)
    assert df.component("a").batch_sizes == (8,)
    assert df.component("b").batch_sizes == (1,)
    assert df.batch_size_of(2) == 1


def test_mismatch_lists_every_problem() -> None:
    bad = GraphSpec(("x",), ("y",), (("a", ("x", "w"), ("p",)),),
                    (("input", "x", "a", "x"), ("a", "p", "output", "nope")))
    with pytest.raises(PlanError) as e:
        build_dataflow(_toy_plan(["a", "ghost"]), bad)
    msg = str(e.value)
    assert "input 'w' of component 'a' has 0 sources" in msg
    assert "unknown model output 'nope'" in msg
    assert "model output 'y' has 0 sources" in msg
    assert "serves component 'ghost'" in msg
    assert "Re-run the allocate stage" in msg


def test_component_without_rank_is_an_error() -> None:
    with pytest.raises(PlanError, match="component 'j' has no rank"):
        build_dataflow(_toy_plan(["a", "b"]), DIAMOND)


def test_whole_plan_keeps_ranks_and_resources() -> None:
    plan = _toy_plan(["a", "b", "j"], replicas=1, batch_size=3)
    wp = whole_plan(plan)
    assert wp.world_size == plan.world_size
    assert [r.component for r in wp.ranks] == [None, "whole", "whole", "whole"]
    assert [r.replica for r in wp.ranks[1:]] == [0, 1, 2]
    assert [(r.threads, r.batch_size, r.node) for r in wp.ranks] == [(r.threads, r.batch_size, r.node)
                                                                      for r in plan.ranks]
    df = build_dataflow(wp, whole_graph_of(DIAMOND))
    assert df.component("whole").replicas == (1, 2, 3)
    assert df.output_bdims == ((0, 1), (1,))


def test_router_picks_fewest_outstanding_and_rotates_ties() -> None:
    df = build_dataflow(_toy_plan(["a", "b", "j"], replicas=2), DIAMOND)
    r = Router(df)
    routes = [r.assign() for _ in range(4)]
    assert [x[0] for x in routes] == [1, 2, 1, 2]
    assert r.outstanding == {1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2}
    r.release(routes[1])
    r.release(routes[3])
    nxt = r.assign()
    assert nxt[0] == 2  # replica 2 now has fewer outstanding
    assert sum(r.outstanding.values()) == 9
    for route in (routes[0], routes[2], nxt):
        r.release(route)
    assert set(r.outstanding.values()) == {0}


def test_router_replica_of_a_timed_out_request_loses_ties_until_it_succeeds() -> None:
    r = Router(build_dataflow(_toy_plan(["a", "b", "j"], replicas=2), DIAMOND))
    bad = r.assign()
    assert bad[0] == 1
    r.release(bad, failed=True)
    seq = []
    for _ in range(3):
        route = r.assign()
        seq.append(route[0])
        r.release(route)
    assert seq == [2, 2, 2]  # replica 1 loses every idle tie
    busy, ok = r.assign(), r.assign()
    assert (busy[0], ok[0]) == (2, 1)  # fewest outstanding still wins
    r.release(busy)
    r.release(ok)  # replica 1 completed a request: it takes turns again
    seq = []
    for _ in range(2):
        route = r.assign()
        seq.append(route[0])
        r.release(route)
    assert seq == [2, 1]


def test_router_prefers_the_bigger_replica_on_ties() -> None:
    plan = _toy_plan(["a", "b", "j"], replicas=2)
    ranks = list(plan.ranks)
    ranks[2] = dataclasses.replace(ranks[2], threads=4)  # a's second replica has 4 threads
    df = build_dataflow(dataclasses.replace(plan, ranks=tuple(ranks)), DIAMOND)
    assert df.component("a").sizes == (1.0, 4.0)
    r = Router(df)
    first = r.assign()
    assert first[0] == 2  # idle tie: the 4-thread replica
    assert r.assign()[0] == 1  # it is busy: fewest outstanding still wins


def test_critical_path_takes_the_slowest_branch_plus_join() -> None:
    assert critical_path_ms(DIAMOND, {"a": 70.0, "b": 20.0, "j": 1.5}) == pytest.approx(71.5)
    assert critical_path_ms(DIAMOND, {"a": 5.0, "b": 20.0, "j": 1.0}) == pytest.approx(21.0)


@pytest.mark.parametrize("n", [3, 12])  # 12: at least BUCKET_MIN replicas, kept ordered instead of scanned
def test_router_routes_nothing_more_to_a_dropped_replica(n: int) -> None:
    from hpcsplit.core.policy import ReplicaRouter

    ranks = tuple(range(1, n + 1))
    r = ReplicaRouter([ranks, (99,)], {})
    for _ in range(2 * n):
        r.assign()
    assert r.drop(2) == n - 1 and 2 not in r.live(0)
    picked = [r.assign()[0] for _ in range(3 * n)]
    assert 2 not in picked and set(picked) == set(ranks) - {2}
    for route in [(p, 99) for p in picked]:
        r.release(route)
    assert r.drop(99) == 0 and r.live(1) == (99,)  # the last replica stays routed: the caller ends the job
