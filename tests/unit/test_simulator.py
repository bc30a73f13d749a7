"""The simulator: the runtime's own routing and batching decisions, queueing theory, run queues on shared cores,
the window and timeouts, grouping, and the systems built from a plan and a profile."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import numpy as np
import pytest

from hpcsplit.allocation.synthetic import make_profile
from hpcsplit.core.calibration import Calibration, Curve, Link
from hpcsplit.core.load import arrival_times, summarize
from hpcsplit.core.policy import ReplicaRouter, backoff_wakes_ms
from hpcsplit.core.profile_format import Profile
from hpcsplit.core.sim_model import SimGraph, build_system, grouped, latency_table
from hpcsplit.core.simulator import (
    BALANCE_TICK_S,
    STATUS_OK,
    STATUS_TIMEOUT,
    ServePolicy,
    SimComponent,
    SimRank,
    SimRun,
    SimSystem,
    sched_slice_s,
    simulate,
)
from hpcsplit.errors import PlanError
from hpcsplit.runtime.batching import Batcher
from hpcsplit.runtime.routing import GraphSpec, Router, _toy_plan, build_dataflow


def free(**over: object) -> Calibration:
    """A calibration in which nothing but compute costs time (figures of a test set per case)."""
    zero = Curve.constant(0.0)
    base = dataclasses.replace(Calibration.defaults(), hop=zero, hop_p90=zero, frontend_timer=zero,
                               compute_cold=zero, same_node=Link(0.0, 1e4), frontend_us_per_request=0.0,
                               frontend_us_per_message=0.0, component_us_per_message=0.0,
                               component_us_per_request=0.0, corun_slowdown=(1.0,))
    return dataclasses.replace(base, **over)


def chain(lat_ms: list[float], cal: Calibration, batch: int = 1, replicas: int = 1, cores: tuple[float, ...] = (),
          policy: ServePolicy | None = None) -> SimSystem:
    """frontend -> c0 -> c1 -> ... -> frontend, each component ``replicas`` ranks of fixed latency per batch."""
    comps, ranks = [], [SimRank(0, 0, -1)]
    for i, lat in enumerate(lat_ms):
        reps = tuple(range(len(ranks), len(ranks) + replicas))
        for _ in reps:
            ranks.append(SimRank(len(ranks), 0, i, batch, 1, 1.0, tuple(lat for _ in range(batch))))
        comps.append(SimComponent(f"c{i}", 1, ((i + 1 if i + 1 < len(lat_ms) else -1, 64.0),), reps))
    return SimSystem("chain", tuple(comps), ((0, 64.0),), 1, tuple(ranks), cores, cal, policy or ServePolicy())


def test_the_simulator_routes_with_the_runtimes_own_router() -> None:
    assert issubclass(Router, ReplicaRouter)  # one code: runtime.routing.Router adapts the core policy
    plan = _toy_plan(["a", "b"], replicas=3)
    g = GraphSpec(("x",), ("y",), (("a", ("x",), ("h",)), ("b", ("h",), ("y",))),
                  (("input", "x", "a", "x"), ("a", "h", "b", "h"), ("b", "y", "output", "y")))
    df = build_dataflow(plan, g)
    sim = SimGraph(("x",), g.components, g.edges, {"x": 4, "h": 4, "y": 4})
    prof = make_profile({c: {"latency_ms": [[1.0]], "peak_mem_bytes": [[1.0]], "utilization": [[0.5]]}
                         for c in ("a", "b")}, batch_sizes=(1,), slices=(1.0,), device_kind="cpu")
    system = build_system(plan, prof.components, sim, free(), ServePolicy(), cores_per_node=8)
    assert [c.replicas for c in system.components] == [c.replicas for c in df.components]
    _same_choices(Router(df), ReplicaRouter([c.replicas for c in system.components],
                                            {r.rank: r.size for r in system.ranks}), 500, 0.45, 0.1, seed=4)


def _same_choices(a: ReplicaRouter, b: ReplicaRouter, steps: int, p_release: float, p_fail: float, seed: int) -> None:
    """Random assigns and releases (some failed) given to both routers: every route must be the same."""
    rnd = random.Random(seed)
    live: list[tuple[int, ...]] = []
    for _ in range(steps):
        if live and rnd.random() < p_release:
            route = live.pop(rnd.randrange(len(live)))
            failed = rnd.random() < p_fail
            a.release(route, failed)
            b.release(route, failed)
        else:
            got = a.assign()
            assert b.assign() == got
            live.append(got)


@pytest.mark.parametrize("n", [9, 40])
def test_many_replicas_kept_in_order_pick_what_a_scan_picks(n: int) -> None:
    reps = [tuple(range(1, n + 1)), (n + 1, n + 2)]
    sizes = {r: float(r % 3) for r in range(1, n + 3)}
    _same_choices(ReplicaRouter(reps, sizes, bucket_min=10**9), ReplicaRouter(reps, sizes, bucket_min=3), 5000,
                  0.48, 0.05, seed=n)


def test_batches_are_the_runtimes_batcher_on_the_same_trace() -> None:
    policy = ServePolicy(max_inflight=64, max_wait_ms=3.0)
    system = chain([4.0, 1.0], free(), batch=4, policy=policy)
    trace: list = []
    simulate(system, arrival_times(400, 2.0, "poisson", 3), trace=trace)
    assert len(trace) > 200 and any(len(t[3]) == 4 for t in trace) and any(0 < len(t[3]) < 4 for t in trace)
    batchers = {r: Batcher(4, 3e-3) for r in {t[0] for t in trace}}
    for r, t, ready, taken in trace:
        b = batchers[r]
        for i in ready:
            b.push(i, t)
        assert b.due(t) == bool(taken)
        if taken:
            assert b.take() == taken


def test_md1_queue_waits_as_pollaczek_khinchine_says() -> None:
    s_ms, rho = 10.0, 0.6
    system = chain([s_ms], free())
    r = simulate(system, arrival_times(rho / (s_ms / 1e3), 400.0, "poisson", 1))
    lat = (r.done_s - r.arrival_s)[r.ok] * 1e3
    expected = s_ms + rho * s_ms / (2 * (1 - rho))  # service + M/D/1 mean wait
    assert lat.mean() == pytest.approx(expected, rel=0.05)


def test_hops_and_the_frontend_timer_add_up_on_an_idle_chain() -> None:
    cal = free(hop=Curve.constant(0.5), hop_p90=Curve.constant(0.5), frontend_timer=Curve.constant(0.2))
    r = simulate(chain([0.0, 0.0], cal), np.arange(5) * 1.0)
    lat = (r.done_s - r.arrival_s) * 1e3
    assert lat == pytest.approx([0.2 + 3 * 0.5] * 5)  # timer, then frontend -> c0 -> c1 -> frontend


def test_the_hop_log_gives_each_messages_way_from_send_to_the_turn_that_took_it() -> None:
    """On an idle chain every message takes the hop delay; a message sent while its receiver still computes the
    one before waits for that too (the log is what ``bench hops --simulate`` sets beside a traced run)."""
    cal = free(hop=Curve.constant(0.5), hop_p90=Curve.constant(0.5))
    hops: list[tuple[int, int, float, float, int, float, float, float]] = []
    r = simulate(chain([0.0, 0.0], cal), np.arange(5) * 1.0, hops=hops)
    assert r.ok.all()
    assert sorted({(a, b) for a, b, *_ in hops}) == [(0, 1), (1, 2), (2, 0)]
    assert len(hops) == 15 and all(h[4] == 1 for h in hops)
    assert [h[3] - h[2] for h in hops] == pytest.approx([0.5e-3] * 15)
    # its parts: no transfer time (free links), the hop delay, no wait for work or a core
    assert np.array([(h[5] - h[2], h[6], h[7]) for h in hops]) == pytest.approx(np.array([(0.0, 0.0, 0.5e-3)] * 15),
                                                                                 abs=1e-9)
    busy: list[tuple[int, int, float, float, int, float, float, float]] = []
    simulate(chain([5.0], free()), np.array([0.0, 0.001]), hops=busy)  # the second arrives while c0 computes the first
    waits = np.array(sorted((h[3] - h[2], h[6], h[7]) for h in busy if h[:2] == (0, 1)))
    assert waits == pytest.approx(np.array([(0.0, 0.0, 0.0), (4e-3, 4e-3, 0.0)]), abs=1e-9)  # c0's batch: 5 ms
    sys_, arr = chain([1.0, 2.0], free(hop=Curve((0.0, 10.0), (0.05, 0.4))), replicas=2), np.arange(200) * 7e-4
    plain, logged = simulate(sys_, arr, seed=3), simulate(sys_, arr, seed=3, hops=[])
    assert np.array_equal(plain.done_s, logged.done_s)  # keeping the log changes nothing of the run


def _branches(a_ms: float, b_ms: float, h_ms: float) -> tuple[SimGraph, Profile]:
    """Two branches ``a`` and ``b`` side by side, joined by ``h``; a CPU profile of those batch-1 latencies."""
    g = SimGraph(("x",), (("a", ("x",), ("p",)), ("b", ("x",), ("q",)), ("h", ("p", "q"), ("y",))),
                 (("input", "x", "a", "x"), ("input", "x", "b", "x"), ("a", "p", "h", "p"), ("b", "q", "h", "q"),
                  ("h", "y", "output", "y")), {"x": 4, "p": 4, "q": 4, "y": 4})
    prof = make_profile({c: {"latency_ms": [[ms]], "peak_mem_bytes": [[1.0]], "utilization": [[0.5]]}
                         for c, ms in (("a", a_ms), ("b", b_ms), ("h", h_ms))},
                        batch_sizes=(1,), slices=(1.0,), device_kind="cpu")
    return g, prof


def test_ranks_sharing_one_core_take_turns() -> None:
    g, prof = _branches(10.0, 10.0, 0.0)
    plan = _toy_plan(["a", "b", "h"])
    lat = {}
    quiet = ServePolicy(spin_us=0.0)  # no polling after work: only the two branches want the core
    for cores in (1, 2):
        s = build_system(plan, prof.components, g, free(), quiet, cores_per_node=cores)
        r = simulate(s, np.array([0.0]))
        lat[cores] = float((r.done_s - r.arrival_s)[0] * 1e3)
    assert lat[2] == pytest.approx(10.0) and lat[1] == pytest.approx(20.0)
    s = build_system(plan, prof.components, g, free(corun_slowdown=(1.0, 1.2)), quiet, cores_per_node=2)
    r = simulate(s, np.array([0.0]))
    assert float((r.done_s - r.arrival_s)[0] * 1e3) == pytest.approx(12.0)  # side by side, 20 % slower each


def test_a_rank_polling_after_work_takes_the_next_message_without_a_wake_up() -> None:
    cal = free(hop=Curve.constant(0.5), hop_p90=Curve.constant(0.5))
    arr = np.array([0.0, 0.0005])  # the second arrives while the frontend still polls after the first
    fast = simulate(chain([0.0], cal, policy=ServePolicy(spin_us=2000.0)), arr)
    slow = simulate(chain([0.0], cal, policy=ServePolicy(spin_us=0.0)), arr)
    assert ((fast.done_s - fast.arrival_s) * 1e3)[1] < ((slow.done_s - slow.arrival_s) * 1e3)[1] - 0.4


def test_window_and_timeouts() -> None:
    r = simulate(chain([5.0], free(), policy=ServePolicy(max_inflight=1)), np.zeros(4))
    assert ((r.done_s - r.arrival_s) * 1e3) == pytest.approx([5.0, 10.0, 15.0, 20.0])
    over = simulate(chain([10.0], free(), policy=ServePolicy(request_timeout_s=0.2)), arrival_times(200, 2.0))
    s = summarize("x", 200, over.arrival_s, over.done_s, over.ok)
    assert (over.status == STATUS_TIMEOUT).sum() > 0 and (over.status == STATUS_OK).sum() > 0
    assert s.achieved_qps == pytest.approx(100.0, rel=0.1)  # saturated at one request per 10 ms


def test_jitter_is_seeded() -> None:
    cal = free(hop=Curve.constant(0.3), hop_p90=Curve.constant(0.6))
    a = simulate(chain([1.0, 1.0], cal), arrival_times(50, 2.0, "poisson", 0), seed=1)
    b = simulate(chain([1.0, 1.0], cal), arrival_times(50, 2.0, "poisson", 0), seed=1)
    c = simulate(chain([1.0, 1.0], cal), arrival_times(50, 2.0, "poisson", 0), seed=2)
    assert np.array_equal(a.done_s, b.done_s) and not np.array_equal(a.done_s, c.done_s)


def _clip_like() -> tuple[SimGraph, object]:
    g = SimGraph(("img", "txt"), (("vision", ("img",), ("v",)), ("text", ("txt",), ("t",)),
                                  ("head", ("v", "t"), ("y",))),
                 (("input", "img", "vision", "img"), ("input", "txt", "text", "txt"), ("vision", "v", "head", "v"),
                  ("text", "t", "head", "t"), ("head", "y", "output", "y")),
                 {"img": 600_000, "txt": 600, "v": 2048, "t": 2048, "y": 4})
    prof = make_profile({c: {"latency_ms": [[ms, ms * 0.6], [ms * 1.8, ms * 1.1]], "peak_mem_bytes": [[1e8] * 2] * 2,
                             "utilization": [[0.5, 1.0]] * 2, "param_bytes": 5e7}
                         for c, ms in (("vision", 120.0), ("text", 40.0), ("head", 0.2))},
                        batch_sizes=(1, 2), slices=(1.0, 2.0), device_kind="cpu", cores_per_node=2)
    return g, prof


def test_whole_and_groups_run_their_members_back_to_back() -> None:
    g, prof = _clip_like()
    plan = _toy_plan(["vision", "text", "head"], batch_size=2)
    split = build_system(plan, prof.components, g, free(), ServePolicy(), cores_per_node=4)
    whole = build_system(plan, prof.components, g, free(), ServePolicy(), variant="whole", cores_per_node=4)
    assert [c.name for c in whole.components] == ["whole"] and len(whole.components[0].replicas) == 3
    assert whole.ranks[1].latency_ms == pytest.approx((160.2, 160.2 * 1.8))
    one = np.array([0.0])
    lat = {n: float(simulate(s, one).done_s[0] * 1e3) for n, s in (("split", split), ("whole", whole))}
    assert lat["split"] == pytest.approx(120.2) and lat["whole"] == pytest.approx(160.2)
    gg, members = grouped(g, [["text", "vision"]])
    assert gg.names == ("vision+text", "head") and members["vision+text"] == ("vision", "text")
    with pytest.raises(PlanError, match="cycle"):
        grouped(SimGraph(("x",), (("a", ("x",), ("p",)), ("b", ("p",), ("q",)), ("c", ("q",), ("y",))),
                         (("input", "x", "a", "x"), ("a", "p", "b", "p"), ("b", "q", "c", "q"),
                          ("c", "y", "output", "y")), {}), [["a", "c"]])


def test_latency_table_interpolates_between_profiled_batches() -> None:
    _, prof = _clip_like()
    table, sigma = latency_table(prof.components["vision"], 2.0, 4)
    assert table[0] == pytest.approx(72.0) and table[1] == pytest.approx(132.0)
    assert table[3] == pytest.approx(264.0) and sigma == 0.0  # beyond the largest: its throughput held
    assert math.isfinite(latency_table(prof.components["vision"], 3.0, 1)[0][0])  # the closest column below


SLOW_WAKE = Curve((0.0, 0.9, 1.0), (0.0, 0.0, 5.0))  # a rank asleep 1 ms or more wakes 5 ms after a ring


def test_a_ring_does_not_delay_a_batch_past_its_max_wait() -> None:
    """``Backoff.idle`` never sleeps past the batch's deadline: a message that rings the rank meanwhile is taken
    then, not when the ring's (slower) wake-up would come."""
    cal = free(hop=SLOW_WAKE, hop_p90=SLOW_WAKE)
    trace: list = []
    simulate(chain([0.0], cal, batch=4, policy=ServePolicy(max_wait_ms=2.0, spin_us=0.0)), np.array([0.0, 1.5e-3]),
             trace=trace)
    batches = [(t, taken) for r, t, _, taken in trace if taken]
    assert batches[0][1] == [0, 1] and batches[0][0] == pytest.approx(2e-3)  # (the ring would have run it at 6.5 ms)


def test_an_arrival_ends_a_sleep_sooner_than_a_slow_ring() -> None:
    """The frontend sleeps at most until the next arrival: one that comes before a ring's wake-up starts its turn,
    which takes the output that rang it as well."""
    cal = free(hop=SLOW_WAKE, hop_p90=SLOW_WAKE)
    r = simulate(chain([1.0], cal, policy=ServePolicy(spin_us=0.0)), np.array([0.0, 3e-3]))
    assert r.admit_s[1] == pytest.approx(3e-3) and r.done_s[0] == pytest.approx(3e-3)  # (not 6 ms, the ring's)


def test_a_sleeping_frontend_wakes_for_the_oldest_deadline_and_frees_its_window() -> None:
    r = simulate(chain([1000.0], free(), policy=ServePolicy(max_inflight=1, request_timeout_s=0.2)),
                 np.array([0.0, 0.1]))
    assert list(r.status) == [STATUS_TIMEOUT, STATUS_TIMEOUT]
    assert r.admit_s[1] == pytest.approx(0.2)  # at request 0's deadline, not when its late output came (1 s)


def test_a_programs_cold_extra_counts_from_its_last_batch_not_from_a_join_turn() -> None:
    """A join's first input gets a turn; the batch runs when the second comes.  The program has not run since the
    previous request, so the cold extra is of that gap (2 s), not of the 10 ms since the join's turn."""
    cold = Curve((0.0, 100.0, 1000.0), (0.0, 0.0, 50.0))
    comps = (SimComponent("a", 1, ((2, 64.0),), (1,)), SimComponent("b", 1, ((2, 64.0),), (2,)),
             SimComponent("h", 2, ((-1, 4.0),), (3,)))
    ranks = (SimRank(0, 0, -1), SimRank(1, 0, 0, latency_ms=(0.0,)), SimRank(2, 0, 1, latency_ms=(10.0,)),
             SimRank(3, 0, 2, latency_ms=(0.0,), cold=cold))
    system = SimSystem("join", comps, ((0, 64.0), (1, 64.0)), 1, ranks, (), free(), ServePolicy())
    r = simulate(system, np.array([0.0, 2.0]))
    assert ((r.done_s - r.arrival_s) * 1e3) == pytest.approx([10.0, 60.0])


def test_a_batch_pays_for_every_message_in_and_one_per_destination_replica_out() -> None:
    """Four requests come one by one (turns that run no batch: max_wait_ms), run as one batch and go to 4
    replicas downstream: 4 messages out (``component._send_outputs``) and 4 in, each the calibrated CPU."""
    cal = free(component_us_per_message=1000.0)
    comps = (SimComponent("c0", 1, ((1, 64.0),), (1,)), SimComponent("c1", 1, ((-1, 64.0),), (2, 3, 4, 5)))
    ranks = (SimRank(0, 0, -1), SimRank(1, 0, 0, 4, latency_ms=(0.0,) * 4),
             *(SimRank(k, 0, 1, latency_ms=(0.0,)) for k in (2, 3, 4, 5)))
    system = SimSystem("fan", comps, ((0, 64.0),), 1, ranks, (), cal, ServePolicy(max_wait_ms=1.0))
    r = simulate(system, np.arange(4) * 1e-4)
    assert r.busy_s[1] == pytest.approx(8e-3)  # four messages in, four out
    assert list(r.busy_s[2:]) == pytest.approx([2e-3] * 4)


def test_requests_arriving_at_one_instant_are_admitted_in_one_turn() -> None:
    """``Frontend.run`` admits every request with ``arrival <= now``: four at once travel in one message."""
    trace: list = []
    simulate(chain([1.0], free(), batch=4), np.zeros(4), trace=trace)
    assert [taken for _, _, _, taken in trace if taken] == [[0, 1, 2, 3]]


def test_a_join_needs_one_message_per_sender_whatever_the_ports_are_named() -> None:
    g = SimGraph(("x",), (("a", ("x",), ("p",)), ("h", ("q", "x2"), ("y",))),
                 (("input", "x", "a", "x"), ("a", "p", "h", "q"), ("input", "x", "h", "x2"), ("h", "y", "output", "y")),
                 {"x": 4, "p": 4, "y": 4})
    prof = make_profile({c: {"latency_ms": [[1.0]], "peak_mem_bytes": [[1.0]], "utilization": [[0.5]]}
                         for c in ("a", "h")}, batch_sizes=(1,), slices=(1.0,), device_kind="cpu")
    system = build_system(_toy_plan(["a", "h"]), prof.components, g, free(), ServePolicy(), cores_per_node=4)
    assert [c.need for c in system.components] == [1, 2]  # h: the frontend's message and a's


def test_time_never_runs_backwards_when_deadlines_pass_during_slow_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Frontend turns of 5 ms a request and a 20 ms timeout: deadlines pass while the frontend works (its wake-up
    for them is never put in the past); every event comes at or after the one before."""
    import heapq

    from hpcsplit.core import simulator as sim

    times: list[float] = []
    real = heapq.heappop

    def pop(h: list) -> tuple:
        item = real(h)
        times.append(item[0])
        return item

    monkeypatch.setattr(sim.heapq, "heappop", pop)
    cal = free(frontend_us_per_request=5000.0, hop=Curve.constant(0.2), hop_p90=Curve.constant(0.4))
    r = simulate(chain([20.0, 5.0], cal, policy=ServePolicy(request_timeout_s=0.02)), arrival_times(80, 2.0, "poisson", 2))
    assert (r.status == STATUS_TIMEOUT).all()  # (20 ms of compute: every request misses the 20 ms)
    assert len(times) == r.events and all(b >= a for a, b in itertools.pairwise(times))


def test_ranks_backing_off_take_the_cpu_their_wake_ups_cost_from_a_shared_core() -> None:
    """[Note: idle CPU]: after its spin a rank's backoff costs the share of a core the calibration's idle_cpu
    says; on one core the frontend and the first component backing off (half a core each) halve the speed
    of the second one's 10 ms batch; with a core each, or with no idle CPU, it takes its 10 ms."""
    idle = free(idle_cpu=Curve((0.0, 100.0), (0.0, 50.0)))  # 50 ms of CPU over 100 ms idle: half a core
    quiet = ServePolicy(spin_us=0.0)

    def ms(cal: Calibration, cores: float) -> float:
        r = simulate(chain([0.0, 10.0], cal, cores=(cores,), policy=quiet), np.array([0.0]))
        return float((r.done_s - r.arrival_s)[0] * 1e3)

    assert ms(free(), 1.0) == pytest.approx(10.0)
    assert ms(idle, 1.0) == pytest.approx(20.0)
    assert ms(idle, 3.0) == pytest.approx(10.0)
    # past the curve's last point a rank sleeps on the doorbell: no share; work ends the backoff at once
    late = free(idle_cpu=Curve((0.0, 1.0), (0.0, 0.5)))
    assert ms(late, 1.0) == pytest.approx(10.5)  # its first 1 ms at half speed (0.5 ms done), then alone
    r = simulate(chain([0.0, 10.0], idle, cores=(1.0,), policy=quiet), np.array([0.0, 0.05]))
    assert np.all(r.ok)


def test_a_nodes_cpu_counts_computing_polling_and_backing_off_ranks_up_to_its_cores() -> None:
    """SimRun.node_cpu_s (what the bench's measured CPU is set against): one request through a 10 ms and a 5 ms
    component is 15 ms of a core; a spin after each turn adds its 2 ms per rank that polled (the frontend twice,
    each component once) while the request was in the pipeline; half a core of backoff adds half of the time it
    overlaps; on a node with fewer cores than demand the count stops at its cores."""
    quiet = ServePolicy(spin_us=0.0)
    r = simulate(chain([10.0, 5.0], free(), cores=(4.0,), policy=quiet), np.array([0.0]))
    assert r.node_cpu_s[0] == pytest.approx(0.015)
    spin = simulate(chain([10.0, 5.0], free(), cores=(4.0,), policy=ServePolicy(spin_us=2000.0)), np.array([0.0]))
    # the frontend polls 2 ms after admitting (then sleeps), c0 2 ms after its batch; c1's batch ends the request:
    # its spin and the frontend's last one come after the answer, outside the window
    assert spin.node_cpu_s[0] == pytest.approx(0.015 + 0.002 + 0.002)
    idle = free(idle_cpu=Curve((0.0, 100.0), (0.0, 50.0)))  # half a core while idle, after the spin
    back = simulate(chain([10.0, 5.0], idle, cores=(4.0,), policy=quiet), np.array([0.0]))
    # the frontend backs off for the whole 15 ms, c0 for the 5 ms of c1's batch: 7.5 + 2.5 ms more
    assert back.node_cpu_s[0] == pytest.approx(0.015 + 0.0075 + 0.0025)
    one = simulate(chain([10.0, 5.0], idle, cores=(1.0,), policy=quiet), np.array([0.0]))
    done = float(one.done_s[0])
    assert one.node_cpu_s[0] == pytest.approx(done)  # demand was above one core the whole time: all of it
    gpu = simulate(chain([10.0, 5.0], free(), policy=quiet), np.array([0.0]))  # devices: not counted
    assert gpu.node_cpu_s[0] == 0.0
    # SimRun.rank_cpu_s: each rank's part (what the bench's CPU per rank is set against), summing to the node's
    assert r.rank_cpu_s == pytest.approx([0.0, 0.010, 0.005])
    assert spin.rank_cpu_s == pytest.approx([0.002, 0.010 + 0.002, 0.005])
    assert back.rank_cpu_s == pytest.approx([0.0075, 0.010 + 0.0025, 0.005])
    for run in (r, spin, back, one):
        assert run.rank_cpu_s.sum() == pytest.approx(run.node_cpu_s[0])
    # on one core a batch still costs its compute, the backoffs share the rest: c0's batch runs at 2/3 speed beside the
    # frontend's half core (15 ms, the frontend 5 ms of it), c1's at 1/2 beside two (10 ms, 2.5 ms each)
    assert done == pytest.approx(0.025)
    assert one.rank_cpu_s == pytest.approx([0.005 + 0.0025, 0.010 + 0.0025, 0.005])
    assert gpu.rank_cpu_s.sum() == 0.0


def test_each_wake_up_of_a_backoff_on_a_crowded_node_costs_its_evicted_extra() -> None:
    """[Note: idle CPU], [Note: evicted caches]: one request through a 10 ms and a 5 ms component, no idle CPU in
    the curve, a wake-up after an eviction 10 us more.  On two cores (three ranks: crowded) the frontend backs off
    through both batches and c0 through c1's: six wake-ups each before they sleep on the doorbell, 0.12 ms of CPU
    in all, and the request as fast (the cores are not full).  With a core for each rank nothing is added; a curve
    of its own is added to, not replaced."""
    quiet = ServePolicy(spin_us=0.0)

    def run(cal: Calibration, cores: float) -> SimRun:
        return simulate(chain([10.0, 5.0], cal, cores=(cores,), policy=quiet), np.array([0.0]))

    base, woke = run(free(), 2.0), run(free(evicted_us_per_wake=10.0), 2.0)
    assert len(backoff_wakes_ms(0.0)) == 6
    assert woke.node_cpu_s[0] - base.node_cpu_s[0] == pytest.approx(2 * 6 * 10e-6)
    assert woke.done_s[0] == pytest.approx(base.done_s[0])
    assert run(free(evicted_us_per_wake=10.0), 3.0).node_cpu_s[0] == pytest.approx(run(free(), 3.0).node_cpu_s[0])
    curve = free(idle_cpu=Curve((0.0, 100.0), (0.0, 1.0)))  # 1 ms of CPU over 100 ms idle (the cores still not full)
    both = dataclasses.replace(curve, evicted_us_per_wake=10.0)
    assert run(both, 2.0).node_cpu_s[0] - run(curve, 2.0).node_cpu_s[0] == pytest.approx(2 * 6 * 10e-6)


def test_a_wake_ups_extra_is_spread_over_the_sleep_it_ends_at_most_a_core_a_span() -> None:
    """[Note: idle CPU]: with a 10 us extra per wake-up and no curve, each sleep of the backoff (20 us, 40, ...,
    640 after a 50 us spin) takes 10 us spread evenly over it; with a 30 us extra the first sleep (20 us) cannot take
    it at one core, and the rest goes into the next sleep; in all cases the total is the wake-ups' count times the
    extra, on top of the curve's own CPU, which keeps its spans' shares."""
    from hpcsplit.core.simulator import _Sim

    wakes = backoff_wakes_ms(50.0)
    segs = _Sim._idle_segments(free(), 50e-6, 10e-6)
    assert [round(d * 1e6, 6) for d, _ in segs] == pytest.approx([20.0, 40.0, 80.0, 160.0, 320.0, 640.0])
    assert [w for _, w in segs] == pytest.approx([10 / 20, 10 / 40, 10 / 80, 10 / 160, 10 / 320, 10 / 640])
    big = _Sim._idle_segments(free(), 50e-6, 30e-6)
    assert big[0][1] == 1.0 and big[1][1] == pytest.approx((30 + 10) / 40)  # 10 us carried into the second
    assert sum(d * w for d, w in big) == pytest.approx(len(wakes) * 30e-6)
    curve = free(idle_cpu=Curve((0.0, 0.3, 100.0), (0.0, 0.05, 1.0)))
    plain = _Sim._idle_segments(curve, 50e-6)
    both = _Sim._idle_segments(curve, 50e-6, 10e-6)
    assert all(0.0 <= w <= 1.0 for _, w in both)
    assert sum(d * w for d, w in both) - sum(d * w for d, w in plain) == pytest.approx(len(wakes) * 10e-6)
    assert sum(d for d, _ in both) == pytest.approx(sum(d for d, _ in plain))  # the same backoff, cut finer


def _two_replicas_on_one_core(ms: float) -> SimSystem:
    """The frontend on a node of its own; one component of two replicas (``ms`` a batch) sharing one core."""
    ranks = (SimRank(0, 1, -1), SimRank(1, 0, 0, 1, 1, 1.0, (ms,)), SimRank(2, 0, 0, 1, 1, 1.0, (ms,)))
    comps = (SimComponent("c", 1, ((-1, 64.0),), (1, 2)),)
    return SimSystem("pair", comps, ((0, 64.0),), 1, ranks, (1.0, 1.0), free(cross_extra=Curve.constant(0.0)),
                     ServePolicy(spin_us=0.0))


def test_short_turns_on_a_full_node_run_whole_in_the_order_they_came() -> None:
    """[Note: run queues]: two 0.5 ms batches that want the node's one core at once run one after the other (the
    first answer at 0.5 ms, the second at 1 ms), not side by side at half speed (both at 1 ms)."""
    r = simulate(_two_replicas_on_one_core(0.5), np.array([0.0, 0.0]))
    assert sorted(((r.done_s - r.arrival_s) * 1e3).tolist()) == pytest.approx([0.5, 1.0])


def test_the_frontends_cpu_per_turn_is_paid_once_by_each_turn_that_admits_or_takes_something() -> None:
    """One request alone: the frontend's admission turn and its answer's turn each cost the 0.3 ms a turn takes
    beyond its request (0.1 ms) and messages (0.05 ms each): 0.45 + 0.35 ms about a 1 ms batch; two requests
    admitted in one turn pay the turn once."""
    cal = free(frontend_us_per_turn=300.0, frontend_us_per_request=100.0, frontend_us_per_message=50.0)
    r = simulate(chain([1.0], cal), np.array([0.0]))
    assert float((r.done_s - r.arrival_s)[0] * 1e3) == pytest.approx(0.45 + 1.0 + 0.35)
    two = simulate(chain([1.0], cal, batch=2), np.array([0.0, 0.0]))
    # one turn admits both (0.3 + 2 x 0.1 + one message 0.05), one batch, one turn takes the answer (0.3 + 0.05)
    assert ((two.done_s - two.arrival_s) * 1e3).tolist() == pytest.approx([0.55 + 1.0 + 0.35] * 2)


def _evicting(system: SimSystem, evicted_ms: float, cold_ms: float = 0.0) -> SimSystem:
    return dataclasses.replace(system, ranks=tuple(
        r if r.component < 0 else dataclasses.replace(r, evicted_ms=evicted_ms, cold=Curve.constant(cold_ms))
        for r in system.ranks))


def test_a_turn_after_another_ranks_work_on_a_crowded_node_pays_its_evicted_caches() -> None:
    """[Note: evicted caches]: frontend (10 us a request admitted, answers free), two 1 ms components, one request.
    On one core (three ranks) each batch follows another rank's work and pays its 0.2 ms evicted turn, and the
    frontend's answer turn its 0.1 ms (its admission is the first work there is: nothing evicted it); the larger
    of the cold extra and the evicted turn counts, not both.  With a core for each rank, or on GPUs, nothing is
    evicted."""
    cal = free(evicted_us_per_turn=100.0, frontend_us_per_request=10.0)
    quiet = ServePolicy(spin_us=0.0)

    def latency(cores: tuple[float, ...], evicted_ms: float, cold_ms: float = 0.0) -> float:
        r = simulate(_evicting(chain([1.0, 1.0], cal, cores=cores, policy=quiet), evicted_ms, cold_ms),
                     np.array([0.0]))
        return float((r.done_s - r.arrival_s)[0] * 1e3)

    assert latency((1.0,), 0.2) == pytest.approx(0.01 + 2.0 + 0.2 + 0.2 + 0.1)
    assert latency((1.0,), 0.2, cold_ms=0.5) == pytest.approx(0.01 + 2.0 + 0.5 + 0.5 + 0.1)  # the cold extra is larger
    assert latency((1.0,), 0.2, cold_ms=0.1) == pytest.approx(0.01 + 2.0 + 0.2 + 0.2 + 0.1)
    assert latency((3.0,), 0.2) == pytest.approx(2.01)  # a core for each rank
    assert latency((), 0.2) == pytest.approx(2.01)  # GPU ranks: no shared cores


def test_a_rank_that_worked_last_on_its_node_runs_its_next_batch_warm() -> None:
    """One 1 ms component on one core, the frontend's admission 10 us a request, its answers free (a turn that
    costs nothing evicts nothing).  Two requests 5 ms apart: each batch follows an admission (evicted, 0.3 ms).
    Two requests admitted together, batch 1: the second batch runs straight after the first, with no other rank's
    work between them, and pays nothing."""
    quiet = ServePolicy(spin_us=0.0)
    s = _evicting(chain([1.0], free(frontend_us_per_request=10.0), cores=(1.0,), policy=quiet), 0.3)
    r = simulate(s, np.array([0.0, 5.0e-3]))
    assert ((r.done_s - r.arrival_s) * 1e3).tolist() == pytest.approx([1.31, 1.31])
    r = simulate(s, np.array([0.0, 0.0]))
    assert sorted(((r.done_s - r.arrival_s) * 1e3).tolist()) == pytest.approx([1.32, 2.32])


def test_a_frontend_turn_that_only_fails_requests_pays_its_turn_too() -> None:
    """The runtime counts a loop pass whose timeout scan fails a request as a working pass: at request 0's 10 ms
    deadline the frontend's turn fails it and takes its 1 ms, so request 1, arriving 0.5 ms later, is admitted at
    11 ms, not at once."""
    cal = free(frontend_us_per_turn=1000.0)
    r = simulate(chain([50.0], cal, policy=ServePolicy(spin_us=0.0, request_timeout_s=0.01)), np.array([0.0, 0.0105]))
    assert r.status[0] == STATUS_TIMEOUT
    assert r.admit_s[1] * 1e3 == pytest.approx(11.0, abs=1e-6)


def test_the_hop_log_counts_a_turn_that_waited_for_a_core_as_that_wait() -> None:
    """Of two messages that reach replicas sharing one core at once, one is taken at once and the other when the
    first replica's 0.5 ms batch ends: its way is that wait for a core, not a hop or the receiver's own work."""
    hops: list[tuple[int, int, float, float, int, float, float, float]] = []
    simulate(_two_replicas_on_one_core(0.5), np.array([0.0, 0.0]), hops=hops)
    core = sorted(h[3] - h[5] - h[6] - h[7] for h in hops if h[0] == 0)
    assert core == pytest.approx([0.0, 0.5e-3]) and all(h[6] == h[7] == 0.0 for h in hops if h[0] == 0)


def test_jobs_longer_than_a_slice_share_the_core_by_slices() -> None:
    """Two 15 ms batches (twenty slices each of a 1-core node's 0.75 ms) take turns a slice at a time: both end
    near 30 ms, the first at most a slice or two before the second, as a time-sharing kernel runs them (not one
    at 15 ms and the other at 30, nor both at 30 side by side)."""
    r = simulate(_two_replicas_on_one_core(15.0), np.array([0.0, 0.0]))
    lat = sorted(((r.done_s - r.arrival_s) * 1e3).tolist())
    assert lat[1] == pytest.approx(30.0)
    assert 30.0 - 2 * sched_slice_s(1.0) * 1e3 <= lat[0] < 30.0


def test_a_rank_waiting_for_a_core_sees_every_message_that_came_meanwhile() -> None:
    """Requests that reach a queued replica while it waits for the core are taken in its one turn (one batch of
    two, as the runtime's loop takes what its inbox holds), and no request is lost or answered twice."""
    ranks = (SimRank(0, 1, -1), SimRank(1, 0, 0, 4, 1, 1.0, (1.0, 1.0, 1.0, 1.0)),
             SimRank(2, 0, 0, 4, 1, 1.0, (1.0, 1.0, 1.0, 1.0)))
    comps = (SimComponent("c", 1, ((-1, 64.0),), (1, 2)),)
    s = SimSystem("pair", comps, ((0, 64.0),), 1, ranks, (1.0, 1.0), free(cross_extra=Curve.constant(0.0)),
                  ServePolicy(spin_us=0.0))
    trace: list[tuple[int, float, list[int], list[int]]] = []
    r = simulate(s, np.array([0.0, 0.0, 0.0001, 0.0002]), trace=trace)
    assert np.all(r.ok)
    batched = [i for _, _, _, b in trace for i in b]
    assert sorted(batched) == [0, 1, 2, 3]
    # replica 2 waited for the core while replica 1 ran request 0, and took both of its requests in one batch
    assert [len(b) for r_, _, _, b in trace if r_ == 2] == [2]


def test_a_rank_of_several_threads_takes_that_many_cores_of_its_node() -> None:
    """Two replicas of two threads each computing 10 ms batches at once on a 2-core node run at half speed (20 ms),
    as four threads on two cores do; with one thread each they have a core each (10 ms)."""
    def lat(threads: int) -> list[float]:
        ranks = (SimRank(0, 1, -1), SimRank(1, 0, 0, 1, threads, 1.0, (10.0,)),
                 SimRank(2, 0, 0, 1, threads, 1.0, (10.0,)))
        comps = (SimComponent("c", 1, ((-1, 64.0),), (1, 2)),)
        s = SimSystem("pair", comps, ((0, 64.0),), 1, ranks, (2.0, 1.0), free(cross_extra=Curve.constant(0.0)),
                      ServePolicy(spin_us=0.0))
        r = simulate(s, np.array([0.0, 0.0]))
        return ((r.done_s - r.arrival_s) * 1e3).tolist()

    assert lat(1) == pytest.approx([10.0, 10.0])
    assert lat(2) == pytest.approx([20.0, 20.0])


def test_a_spinning_rank_gives_up_its_core_at_a_slices_end_when_another_waits() -> None:
    """[Note: run queues]: replica 1 computes its 0.5 ms batch, then spins (5 ms, longer than the 1-core node's
    0.75 ms slice) while replica 2 waits for the core: at the slice's end the spinner goes to the back of the queue
    and replica 2 runs (its answer at 1.25 ms, not after the spin at 6 ms). The node's CPU counts the spin that
    held the core (0.5 + 0.25 + 0.5 ms up to the last answer); their spins run out in the queue and nothing is
    lost."""
    ranks = (SimRank(0, 1, -1), SimRank(1, 0, 0, 1, 1, 1.0, (0.5,)), SimRank(2, 0, 0, 1, 1, 1.0, (0.5,)))
    comps = (SimComponent("c", 1, ((-1, 64.0),), (1, 2)),)
    s = SimSystem("pair", comps, ((0, 64.0),), 1, ranks, (1.0, 1.0), free(cross_extra=Curve.constant(0.0)),
                  ServePolicy(spin_us=5000.0))
    r = simulate(s, np.array([0.0, 0.0]))
    assert np.all(r.ok)
    assert sorted(((r.done_s - r.arrival_s) * 1e3).tolist()) == pytest.approx([0.5, 1.25])
    assert r.node_cpu_s[0] == pytest.approx(0.00125)
    later = simulate(s, np.array([0.0, 0.0, 0.003, 0.0031]))  # after the spins were cut by slices
    assert np.all(later.ok)


def test_a_requests_critical_path_compute_is_its_longest_chain_of_batches_without_its_waits() -> None:
    """``SimRun.path_ms`` is what the bench's ``critical_path_ms`` measures (``[Note: critical path in the run]``):
    the longest chain of batch compute behind a request's answer, not the hops or the queueing in between."""
    cal = free(hop=Curve.constant(0.5), hop_p90=Curve.constant(0.5))
    r = simulate(chain([3.0, 5.0], cal), np.array([0.0, 1.0]))
    assert r.path_ms == pytest.approx([8.0, 8.0])
    assert ((r.done_s - r.arrival_s) * 1e3) == pytest.approx([9.5, 9.5])  # three hops besides
    q = simulate(chain([5.0], free()), np.zeros(2))  # the second waits for the first's batch: not compute
    assert ((q.done_s - q.arrival_s) * 1e3) == pytest.approx([5.0, 10.0]) and q.path_ms == pytest.approx([5.0, 5.0])
    g, prof = _branches(10.0, 20.0, 1.0)
    s = build_system(_toy_plan(["a", "b", "h"]), prof.components, g, free(), ServePolicy(spin_us=0.0),
                     cores_per_node=2)
    assert simulate(s, np.array([0.0])).path_ms == pytest.approx([21.0])  # the longer branch, then the join
    one = build_system(_toy_plan(["a", "b", "h"]), prof.components, g, free(), ServePolicy(spin_us=0.0),
                       cores_per_node=1)
    assert simulate(one, np.array([0.0])).path_ms[0] > 21.0  # branches sharing one core compute slower: it counts


def test_a_hops_spread_is_capped_so_one_outlier_p90_cannot_blow_up_every_hop() -> None:
    """[Note: hop spread]: a file fitted before it could hold one gap's outlier as its p90 (1.62 ms against a median of
    0.13 was seen); the lognormal spread is capped at a p90 of 4x the p50 (HOP_SIGMA_MAX)."""
    from hpcsplit.core.simulator import HOP_SIGMA_MAX

    arr = arrival_times(400, 20.0, "poisson", 0)
    wild = simulate(chain([0.1], free(hop=Curve.constant(0.5), hop_p90=Curve.constant(50.0))), arr, seed=3)
    capped = simulate(chain([0.1], free(hop=Curve.constant(0.5), hop_p90=Curve.constant(2.0))), arr, seed=3)
    lat = lambda r: (r.done_s - r.arrival_s)[r.ok] * 1e3
    assert HOP_SIGMA_MAX == pytest.approx(math.log(4.0) / 1.2816)
    # the same draws: a p90 of 100x the p50 is read as 4x, so the two runs are the same run
    assert np.allclose(lat(wild), lat(capped))
    assert np.quantile(lat(capped), 0.99) < 2 * 0.5 * math.exp(2.33 * HOP_SIGMA_MAX) + 1.0


def test_wake_ups_stacked_on_the_ringers_core_share_it_until_a_slice_or_a_tick_parts_them() -> None:
    """[Note: wake-up placement]: the frontend rings both branches of a split on a 2-core node. Where every wake-up
    runs on the ringer's core (``wake_on_ringer_core`` 1), the two 10 ms branches share that core, though the other
    is idle, until the first branch's slice ends (1.5 ms on two cores: it then takes the idle core) or, sooner, the
    scheduler's tick (every 4 ms) moves the waiting one: 11.5 ms for a request at 0, 10.1 ms for one at 3.9 ms. Not
    measured (None), or 0, each branch takes a core: 10 ms. On one core the share changes nothing."""
    g, prof = _branches(10.0, 10.0, 0.0)
    plan = _toy_plan(["a", "b", "h"])
    quiet = ServePolicy(spin_us=0.0)

    def ms(share: float | None, cores: float, arr: np.ndarray | None = None, seed: int = 0) -> np.ndarray:
        s = build_system(plan, prof.components, g, free(wake_on_ringer_core=share), quiet, cores_per_node=cores)
        r = simulate(s, np.zeros(1) if arr is None else arr, seed=seed)
        assert np.all(r.ok)
        return (r.done_s - r.arrival_s) * 1e3

    assert ms(None, 2) == pytest.approx([10.0]) and ms(0.0, 2) == pytest.approx([10.0])
    assert ms(1.0, 2) == pytest.approx([10.0 + sched_slice_s(2.0) * 1e3])
    tick = BALANCE_TICK_S * 1e3
    assert ms(1.0, 2, np.array([tick - 0.1]) / 1e3) == pytest.approx([10.1])
    assert ms(1.0, 1) == pytest.approx(ms(None, 1))
    # half the wake-ups stacked: over many requests (far apart) the branches share a core in about half of them (the
    # second branch's wake-up stacked behind the first, which ran on the ringer's core, placed there or by choice)
    lat = ms(0.5, 2, np.arange(200) * 0.1, seed=1)
    stacked = float(np.mean(lat > 10.0 + 0.01))
    assert np.all((np.abs(lat - 10.0) < 0.01) | (np.abs(lat - 10.0 - sched_slice_s(2.0) * 1e3) < 0.01))
    assert 0.3 < stacked < 0.6


def test_a_core_falling_idle_takes_a_rank_stacked_on_another() -> None:
    """[Note: wake-up placement]: the frontend rings both 1 ms branches at 0 ms on a 2-core node, every wake-up on the
    frontend's core: branch a runs there, branch b waits for it. A second request at 0.5 ms wakes the frontend on the
    idle core; when its turn ends that core, falling idle, takes b at once (not when a's batch ends at 1 ms, nor at
    the tick)."""
    g, prof = _branches(1.0, 1.0, 1.0)
    s = build_system(_toy_plan(["a", "b", "h"]), prof.components, g, free(wake_on_ringer_core=1.0),
                     ServePolicy(spin_us=0.0), cores_per_node=2)
    hops: list[tuple[int, int, float, float, int, float, float, float]] = []
    r = simulate(s, np.array([0.0, 0.0005]), hops=hops)
    assert np.all(r.ok)
    to_b = sorted(h[3] for h in hops if h[0] == 0 and h[1] == 2)  # the turns of b that took the frontend's messages
    assert to_b[0] == pytest.approx(0.0005)


def test_a_wake_up_placed_on_a_spinning_ringers_core_preempts_it() -> None:
    """[Note: wake-up placement]: on a 1-core node the frontend rings the replica and spins 5 ms, and so does the
    replica after its 0.2 ms batch. A wake-up with a core of its choice waits for the spinner's slice to end (0.75 ms
    on one core, [Note: run queues]), and the answer for the replica's: 1.5 ms. One placed on the ringer's core
    preempts the spinner at once, as a woken task preempts one that ran long: the batch runs at once, and the answer
    (the frontend waits on the core as a preempted task, not woken) comes at the replica's slice end, 0.75 ms. A
    rank bound to the core (``bind_cores``) does the same."""
    pol = ServePolicy(spin_us=5000.0)
    base = chain([0.2], free(), cores=(1.0,), policy=pol)

    def ms(share: float | None) -> float:
        s = dataclasses.replace(base, calibration=free(wake_on_ringer_core=share))
        r = simulate(s, np.array([0.0]))
        return float((r.done_s - r.arrival_s)[0] * 1e3)

    assert ms(None) == pytest.approx(2 * sched_slice_s(1.0) * 1e3)
    assert ms(1.0) == pytest.approx(sched_slice_s(1.0) * 1e3)
    # bound to the one core, the replica's turn preempts the spinning frontend as a placed wake-up does
    r = simulate(dataclasses.replace(base, bind_cores=True), np.array([0.0]))
    assert float((r.done_s - r.arrival_s)[0] * 1e3) == pytest.approx(sched_slice_s(1.0) * 1e3)


def test_ranks_bound_to_cores_wait_for_their_own_core_though_another_is_idle() -> None:
    """``SimSystem.bind_cores`` (``mpiexec -bind-to core``): the frontend and three 10 ms replicas on a 2-core node
    are bound in rank order to cores 0, 1, 0, 1. Three requests at once: replicas 1 and 3 share core 1 by slices
    (done near 20 ms) while replica 2 has core 0 (10 ms; the frontend sleeps). Placed by the kernel, the three batches
    share both cores and end at 14.5-15.5 ms. A bound rank never stacks on its ringer's core."""
    quiet = ServePolicy(spin_us=0.0)
    s = chain([10.0], free(), replicas=3, cores=(2.0,), policy=quiet)

    def ms(system: SimSystem) -> list[float]:
        r = simulate(system, np.array([0.0, 0.0, 0.0]))
        assert np.all(r.ok)
        return sorted(((r.done_s - r.arrival_s) * 1e3).tolist())

    bound = ms(dataclasses.replace(s, bind_cores=True))
    assert bound[0] == pytest.approx(10.0) and bound[2] == pytest.approx(20.0)
    assert 20.0 - 2 * sched_slice_s(2.0) * 1e3 <= bound[1] < 20.0
    assert ms(s) == pytest.approx([14.5, 14.5, 15.5])
    stacked = dataclasses.replace(s, bind_cores=True, calibration=free(wake_on_ringer_core=1.0))
    assert ms(stacked) == bound
    g, prof = _branches(1.0, 1.0, 1.0)
    cpu = _toy_plan(["a", "b", "h"])
    assert build_system(cpu, prof.components, g, free(), quiet, cores_per_node=2, bind_cores=True).bind_cores
    gpu = dataclasses.replace(cpu, device_kind="cuda", ranks=tuple(  # ranks with devices of their own: nothing to bind
        r if r.role == "frontend" else dataclasses.replace(r, gpu=0, slice_gb=1.0) for r in cpu.ranks))
    assert not build_system(gpu, prof.components, g, free(), quiet, bind_cores=True).bind_cores


def test_the_cpu_of_each_rank_is_set_beside_the_benchs_and_its_file_read_as_untrusted(tmp_path) -> None:
    """``stage=simulate`` puts each rank's predicted CPU beside what the bench measured (``bench/rank_cpu.csv``):
    which rank a CPU node's load falls on.  The bench's file is read as untrusted: anything not as the bench writes
    it compares nothing, and says so."""
    from hpcsplit.launch.simulate import (
        Schedule,
        format_rank_cpu,
        measured_rank_cpu,
        predict_level,
        rank_cpu_rows,
    )

    quiet = ServePolicy(spin_us=0.0)
    system = chain([10.0, 5.0], free(), cores=(4.0,), policy=quiet)
    sched = Schedule((10.0,), 1.0, 10, "constant", 0, quiet, "config")
    p = predict_level("split", system, sched, "constant", 0, 1)
    # ten requests, each 10 + 5 ms of compute, over the 0.9 s of arrivals and the last one's 15 ms
    assert p.rank_cpu_cores == pytest.approx([0.0, 0.1 / 0.915, 0.05 / 0.915], rel=1e-6)
    assert sum(p.rank_cpu_cores) == pytest.approx(p.cpu_cores)
    f = tmp_path / "rank_cpu.csv"
    f.write_text("variant,offered_qps,rank,component,cpu_cores\n"
                 "split,10.0,0,frontend,0.0200\nsplit,10.0,1,c0,0.1500\nsplit,10.0,2,c1,0.0500\nwhole,10.0,1,whole,0.3\n")
    got = measured_rank_cpu(f)
    assert got == {("split", 10.0, 0): 0.02, ("split", 10.0, 1): 0.15, ("split", 10.0, 2): 0.05, ("whole", 10.0, 1): 0.3}
    rows = rank_cpu_rows({"split": system}, [p], "constant", got)
    assert [(r["rank"], r["component"], r["measured_cpu_cores"]) for r in rows] == [
        (0, "frontend", 0.02), (1, "c0", 0.15), (2, "c1", 0.05)]
    assert format_rank_cpu(rows) == "split        10 | 0 frontend 0.02/0.00, 1 c0 0.15/0.11, 2 c1 0.05/0.05"
    assert rank_cpu_rows({"split": system}, [p], "poisson", got) == []  # not the bench's arrivals
    assert format_rank_cpu(rank_cpu_rows({"split": system}, [p], "constant", {})) == ""  # nothing measured
    assert measured_rank_cpu(tmp_path / "none.csv") == {}  # a bench before the file
    head = "variant,offered_qps,rank,component,cpu_cores\n"
    for bad in ("zipf,10,0,frontend,0.1", "split,10,0,frontend,-1", "split,10,0,frontend,nan", "split,10,1.5,c0,0.1",
                "split,inf,0,frontend,0.1", "split,10,x,c0,0.1", "split,10,0,frontend"):
        f.write_text(head + bad + "\n")
        assert measured_rank_cpu(f) == {}, bad
    f.write_text("variant\n" + "x" * 100 + "\n")
    assert measured_rank_cpu(f) == {}


def test_simulations_spread_over_processes_give_the_same_figures_in_order(monkeypatch) -> None:
    """``[Note: simulations in parallel]``: sessions forked to worker processes come back in the tasks' order with
    the figures of the same sessions run one after the other (shared cores, hop jitter, the default idle policy),
    and a worker that dies ends the call with an error that names the task and the way out."""
    from hpcsplit.core import sim_pool
    from hpcsplit.core.sim_pool import auto_workers, simulate_many
    from hpcsplit.errors import HpcsplitError
    from hpcsplit.launch.simulate import Schedule, predict

    cal = dataclasses.replace(Calibration.defaults(), corun_slowdown=(1.0, 1.2))
    shared = chain([0.4, 0.2, 0.3], cal, batch=4, replicas=2, cores=(2.0,))
    gpu = chain([0.4, 0.2], cal, batch=8, replicas=3)
    tasks = [(s, arrival_times(q, 0.5, kind, seed), seed) for s in (shared, gpu) for q, kind in
             ((200.0, "poisson"), (2000.0, "bursty")) for seed in (0, 1)]
    one = simulate_many(tasks, workers=1)
    many = simulate_many(tasks, workers=3)
    assert len(many) == len(tasks)
    for (a, _), (b, dt) in zip(one, many, strict=True):
        assert dt > 0
        for f in ("arrival_s", "admit_s", "done_s", "status", "busy_s", "node_cpu_s", "path_ms", "rank_cpu_s"):
            assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f
        assert a.events == b.events
    assert len({float(np.nansum(r.done_s)) for r, _ in one}) == len(tasks)  # each session its own (the order shows)
    assert auto_workers(len(tasks), None) >= 1 and auto_workers(2, 64) == 2 and auto_workers(5, 1) == 1

    sched = Schedule((100.0, 400.0), 0.3, 20, "poisson", 0, ServePolicy(), "config")
    serial = predict({"split": shared}, sched, ("poisson", "bursty"), 2, workers=1)
    spread = predict({"split": shared}, sched, ("poisson", "bursty"), 2, workers=2)
    strip = [{**dataclasses.asdict(p), "sim_s": 0.0} for p in serial]
    assert strip == [{**dataclasses.asdict(p), "sim_s": 0.0} for p in spread]

    def dies(*_a: object, **_k: object) -> None:
        import os
        os._exit(3)

    monkeypatch.setattr(sim_pool, "simulate", dies)  # (the forked workers inherit it)
    with pytest.raises(HpcsplitError, match=r"worker process died .*simulate.workers"):
        simulate_many(tasks[:2], workers=2)


def test_an_interrupted_pool_of_simulations_ends_its_workers_at_once(monkeypatch) -> None:
    """An interruption (here the progress line raising, as Ctrl-C would in the wait) terminates the workers still
    in their sessions instead of waiting for them; and each worker asked the kernel to kill it with its parent."""
    import multiprocessing
    import signal
    import time

    from hpcsplit.core import sim_pool

    def slow(*_a: object, **_k: object) -> None:
        time.sleep(600)

    class Stop(Exception):
        pass

    def interrupt(_line: str) -> None:
        raise Stop

    before = set(multiprocessing.active_children())
    monkeypatch.setattr(sim_pool, "simulate", slow)
    monkeypatch.setattr(sim_pool, "PROGRESS_EVERY_S", 0.2)
    seen: list[multiprocessing.process.BaseProcess] = []
    real_collect = sim_pool._collect

    def collect(*a: object, **k: object) -> object:
        seen.extend(p for p in multiprocessing.active_children() if p not in before)
        return real_collect(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_pool, "_collect", collect)
    system = chain([1.0], free())
    with pytest.raises(Stop):
        sim_pool.simulate_many([(system, np.zeros(1), k) for k in range(4)], workers=2, progress=interrupt)
    assert len(seen) == 2
    assert all(not p.is_alive() and p.exitcode == -signal.SIGTERM for p in seen)  # terminated, not finished
    assert not [p for p in multiprocessing.active_children() if p not in before]


def test_a_hung_simulation_worker_ends_the_call_at_its_deadline(monkeypatch) -> None:
    """Every wait has a deadline: a worker whose session never ends (a lock held at the fork, say) ends the call
    with an error once no session has finished for longer than any pending one may take, and no worker is left."""
    import multiprocessing
    import time

    from hpcsplit.core import sim_pool
    from hpcsplit.errors import HpcsplitError

    def hangs(*_a: object, **_k: object) -> None:
        time.sleep(600)

    system = chain([1.0], free())
    tasks = [(system, np.zeros(1000), k) for k in range(3)]
    assert sim_pool.session_bound_s(tasks[0]) == pytest.approx(sim_pool.BOUND_FLOOR_S + 1000 * 2e-3)
    before = set(multiprocessing.active_children())
    monkeypatch.setattr(sim_pool, "simulate", hangs)
    monkeypatch.setattr(sim_pool, "session_bound_s", lambda _t: 0.5)
    t0 = time.perf_counter()
    with pytest.raises(HpcsplitError, match=r"no simulation finished in 0.5 s.*3 left \(of 3\).*simulate.workers"):
        sim_pool.simulate_many(tasks, workers=2, progress=None)
    assert time.perf_counter() - t0 < 30
    assert not [p for p in multiprocessing.active_children() if p not in before]

    # the deadline counts from the last session that finished: sessions of 0.8 s each, 2.4 s in all on two workers,
    # pass a bound of 2 s (the first one finishes 0.8 s after the workers start)
    def steady(*_a: object, **_k: object) -> None:
        time.sleep(0.8)

    monkeypatch.setattr(sim_pool, "simulate", steady)
    monkeypatch.setattr(sim_pool, "session_bound_s", lambda _t: 2.0)
    t0 = time.perf_counter()
    out = sim_pool.simulate_many([(system, np.zeros(1), k) for k in range(6)], workers=2, progress=None)
    assert len(out) == 6 and time.perf_counter() - t0 > 2.0


def test_a_worker_that_outlives_sigterm_is_killed(monkeypatch) -> None:
    """A worker that got SIGTERM before its start reset the handler it inherited (here: a caller whose SIGTERM
    handler does nothing, and no reset) is killed once it outlives SIGTERM: no worker outlives the call."""
    import multiprocessing
    import signal
    import time

    from hpcsplit.core import sim_pool
    from hpcsplit.errors import HpcsplitError

    def hangs(*_a: object, **_k: object) -> None:
        time.sleep(600)

    seen: list[multiprocessing.process.BaseProcess] = []
    real_collect = sim_pool._collect
    before = set(multiprocessing.active_children())

    def collect(*a: object, **k: object) -> object:
        seen.extend(p for p in multiprocessing.active_children() if p not in before)
        return real_collect(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(sim_pool, "_collect", collect)
    monkeypatch.setattr(sim_pool, "_worker", lambda _parent: None)  # keeps the caller's handlers
    monkeypatch.setattr(sim_pool, "simulate", hangs)
    monkeypatch.setattr(sim_pool, "session_bound_s", lambda _t: 0.5)
    old = signal.signal(signal.SIGTERM, lambda _s, _f: None)
    try:
        with pytest.raises(HpcsplitError, match="no simulation finished"):
            sim_pool.simulate_many([(chain([1.0], free()), np.zeros(1), k) for k in range(2)], workers=2,
                                   progress=None)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert len(seen) == 2 and all(p.exitcode == -signal.SIGKILL for p in seen), [p.exitcode for p in seen]
    assert not [p for p in multiprocessing.active_children() if p not in before]


def test_the_workers_setting_is_checked() -> None:
    from hpcsplit.errors import ConfigError
    from hpcsplit.launch.simulate import SimulateSettings

    assert SimulateSettings.from_config({}).workers is None
    assert SimulateSettings.from_config({"simulate": {"workers": 3}}).workers == 3
    for bad in (0, -1, 2.5, "many", True):
        with pytest.raises(ConfigError, match="simulate.workers"):
            SimulateSettings.from_config({"simulate": {"workers": bad}})
