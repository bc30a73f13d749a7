"""Choosing the split by prediction (``allocate.rate_rps``): whole when the split does not pay, split when it
does, and the choice flips when the calibration's hop cost is raised."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from hpcsplit.allocation.choose import Candidate, candidates, choose, merged_profile
from hpcsplit.allocation.settings import AllocateSettings
from hpcsplit.allocation.synthetic import make_profile
from hpcsplit.core.calibration import Calibration, Curve
from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.sim_model import SimGraph
from hpcsplit.core.simulator import ServePolicy
from hpcsplit.errors import ConfigError

CPU4 = ClusterSpec.from_config({"name": "t", "nodes": 1, "gpus_per_node": 0, "cores_per_node": 8,
                                "mem_gb_per_node": 16, "cpu_threads": [1, 2]})


def _cal(hop_ms: float) -> Calibration:
    hop = Curve.constant(hop_ms)
    return dataclasses.replace(Calibration.defaults(), source="measured", hop=hop, hop_p90=hop,
                               frontend_us_per_request=5.0, frontend_us_per_message=10.0,
                               component_us_per_message=10.0)


def _profile(ms: dict[str, float]):
    return make_profile({c: {"latency_ms": [[v, v * 0.6], [v * 1.8, v * 1.1]], "peak_mem_bytes": [[1e7] * 2] * 2,
                             "utilization": [[0.25, 0.5]] * 2, "param_bytes": 1e6} for c, v in ms.items()},
                        batch_sizes=(1, 2), slices=(1.0, 2.0), device_kind="cpu", cores_per_node=4)


def _two_towers() -> SimGraph:
    """CLIP's shape: two towers side by side, then a head."""
    return SimGraph(("img", "txt"), (("vision", ("img",), ("v",)), ("text", ("txt",), ("t",)),
                                     ("head", ("v", "t"), ("y",))),
                    (("input", "img", "vision", "img"), ("input", "txt", "text", "txt"), ("vision", "v", "head", "v"),
                     ("text", "t", "head", "t"), ("head", "y", "output", "y")),
                    {"img": 60_000, "txt": 300, "v": 2048, "t": 2048, "y": 4})


def _settings(rate: float, slo: float, **kw: object) -> AllocateSettings:
    return AllocateSettings.defaults(rate_rps=rate, slo_ms=slo, time_limit_s=10, **kw)


def test_candidates_are_whole_each_region_unsplit_stages_and_split() -> None:
    names = [c.name for c in candidates(_two_towers())]
    assert names == ["whole", "vision+text unsplit", "split"]
    assert Candidate("whole", (("whole",),)).served(["vision", "text", "head"]) == {"whole": ("vision", "text", "head")}
    chain = SimGraph(("x",), (("a", ("x",), ("p",)), ("b", ("p",), ("y",))),
                     (("input", "x", "a", "x"), ("a", "p", "b", "p"), ("b", "y", "output", "y")), {})
    assert [c.name for c in candidates(chain)] == ["whole", "split"]  # two stages: as one is the whole


def test_a_chain_of_stages_is_tried_at_every_stage_count() -> None:
    names = "abcde"
    comps = tuple((n, (f"v{i}",), (f"v{i + 1}",)) for i, n in enumerate(names))
    edges = (("input", "v0", "a", "v0"), *((names[i], f"v{i + 1}", names[i + 1], f"v{i + 1}") for i in range(4)),
             ("e", "v5", "output", "y"))
    cands = {c.name: c.groups for c in candidates(SimGraph(("v0",), comps, edges, {}), dict(zip(names, [1, 1, 1, 1, 4])))}
    assert list(cands) == ["whole", "a+b as one stage", "b+c as one stage", "c+d as one stage", "d+e as one stage",
                           "a..e in 2 stages", "a..e in 3 stages", "split"]  # 5, 4 (the pairs), 3, 2 and 1 stage(s)
    assert cands["a..e in 2 stages"] == (("a", "b", "c", "d"),)  # e alone weighs as much as the four others
    assert all(len(g) > 1 for name, gs in cands.items() if name != "whole" for g in gs)  # groups, not singletons


def test_a_group_is_profiled_as_its_members_back_to_back() -> None:
    p = _profile({"vision": 120.0, "text": 40.0})
    g = merged_profile([p.components["vision"], p.components["text"]], "vision+text")
    assert g.latency_p50_ms(0, 0) == pytest.approx(160.0) and g.param_bytes == 2_000_000
    assert g.utilization[0, 0] == pytest.approx(0.25)


def test_the_whole_model_when_the_split_does_not_pay() -> None:
    """A toy: components of a few microseconds; every hop the split adds costs more than it saves."""
    prof = _profile({"vision": 0.02, "text": 0.02, "head": 0.01})
    c = choose(prof, CPU4, _settings(4, 2.0), _two_towers(), _cal(0.3), ServePolicy())
    assert c.chosen == "whole", c.table()
    assert c.plan.meta["choice"]["chosen"] == "whole" and {r.component for r in c.plan.ranks} == {None, "whole"}
    assert "highest simulated goodput" in c.why
    # every candidate serves every request within the SLO: the same goodput (not each one's last completion), so
    # the lowest p50 decides
    assert all(r["within_slo"] == 1.0 for r in c.rows) and len({r["goodput_rps"] for r in c.rows}) == 1
    assert min(c.rows, key=lambda r: r["p50_ms"])["candidate"] == "whole"


def test_the_split_when_it_pays_and_the_whole_when_hops_get_dear() -> None:
    """CLIP's shape: the towers side by side save the text tower's 40 ms; a hop of 60 ms eats that and more."""
    prof = _profile({"vision": 120.0, "text": 40.0, "head": 0.2})
    cheap = choose(prof, CPU4, _settings(2, 150.0), _two_towers(), _cal(0.3), ServePolicy())
    assert cheap.chosen == "split", cheap.table()
    dear = choose(prof, CPU4, _settings(2, 150.0), _two_towers(), _cal(0.3).with_hop_scaled(200.0), ServePolicy())
    assert dear.chosen == "whole", dear.table()
    rows = {r["candidate"]: r for r in dear.rows}
    assert rows["split"]["p50_ms"] > rows["whole"]["p50_ms"] > 120


def test_fewest_devices_that_meet_the_slo() -> None:
    prof = _profile({"vision": 120.0, "text": 40.0, "head": 0.2})
    two = dataclasses.replace(CPU4, nodes=2)
    c = choose(prof, two, _settings(6, 400.0, objective="devices"), _two_towers(), _cal(0.3), ServePolicy())
    best = next(r for r in c.rows if r.get("chosen"))
    assert best["meets"] and best["devices"] == min(r["devices"] for r in c.rows if r.get("meets"))
    assert "fewest devices" in c.why
    # every candidate's plans at a device count are simulated together: the same rows, in the same order (candidates,
    # then counts; none past the count it met the SLO on), with one worker process or two
    serial = choose(prof, two, _settings(6, 400.0, objective="devices", sim_workers=1), _two_towers(), _cal(0.3),
                    ServePolicy())
    assert serial.rows == c.rows and serial.why == c.why
    order = [(r["candidate"], r["devices"]) for r in c.rows]
    assert order == sorted(order, key=lambda x: ([r["candidate"] for r in c.rows].index(x[0]), x[1]))
    met = {r["candidate"]: r["devices"] for r in c.rows if r.get("meets")}
    assert all(r["devices"] <= met.get(r["candidate"], r["devices"]) for r in c.rows)


def test_rate_needs_one_end_to_end_slo() -> None:
    with pytest.raises(ConfigError, match="needs one end-to-end SLO"):
        AllocateSettings.defaults(rate_rps=3, slo_ms={"vision": 10})


def test_the_plan_records_why(tmp_path: Path) -> None:
    prof = _profile({"vision": 120.0, "text": 40.0, "head": 0.2})
    c = choose(prof, CPU4, _settings(2, 150.0), _two_towers(), _cal(0.3), ServePolicy())
    saved = json.loads(Path(c.plan.save(tmp_path / "plan.json")).read_text())
    assert saved["meta"]["choice"]["why"] == c.why and len(saved["meta"]["choice"]["candidates"]) == 3


def test_summary_shows_the_choice_and_the_simulation_beside_the_bench(tmp_path: Path) -> None:
    from hpcsplit.core.paths import RunPaths
    from hpcsplit.launch.simulate import Predicted, _write_csv, compare_rows, verdict
    from hpcsplit.launch.summary import write_summary

    prof = _profile({"vision": 120.0, "text": 40.0, "head": 0.2})
    c = choose(prof, CPU4, _settings(2, 150.0), _two_towers(), _cal(0.3), ServePolicy())
    paths = RunPaths.from_config({}, tmp_path)
    c.plan.save(paths.own_plan)
    pred = [Predicted("split", "poisson", 2.0, 30, 2.1, 1.0, 2.0, 75.0, 80.0, 90.0, 0.1, cpu_cores=1.2),
            Predicted("split", "poisson", 16.0, 160, 16.3, 1.0, 7.0, 900.0, 1200.0, 1500.0, 0.1)]
    measured = [{"variant": "split", "offered_qps": 2.0, "achieved_qps": 1.9, "p50_ms": 80.0, "p99_ms": 100.0,
                 "success_rate": 1.0, "cpu_cores": "1.5"},
                {"variant": "split", "offered_qps": 16.0, "achieved_qps": 9.5, "p50_ms": 1000.0, "p99_ms": 2000.0,
                 "success_rate": 1.0}]
    rows = compare_rows(pred, measured, "poisson")
    assert [r["saturated"] for r in rows] == [False, True]  # 9.5 of the 16.3 the schedule offered
    assert verdict(rows[0]) == "met" and verdict(rows[1]) == "MISSED"  # p50 -6 %, p99 -10 %; 7 vs 9.5 req/s -26 %
    assert rows[0]["cpu_err_pct"] == pytest.approx(-20.0)  # the node's CPU: 1.2 predicted, 1.5 measured cores
    assert math.isnan(rows[1]["measured_cpu_cores"]) and math.isnan(rows[1]["cpu_err_pct"])  # a level without it
    paths.simulate_dir.mkdir()
    rows[0].update(compute_ratio=1.19, at_speed_p50_ms=80.6, at_speed_p50_err_pct=0.75, at_speed_p99_err_pct=-0.9,
                   target_at_speed="met")  # the level simulated at its speed ([Note: the level's speed])
    _write_csv(paths.simulate_dir / "compare.csv", [{**r, "target": verdict(r)} for r in rows])
    text = write_summary(paths, {"stages": {}}, switchboard=None, profile=None, plan=paths.own_plan,
                         bench_result=None).read_text()
    assert "## Simulated vs measured" in text and "| split | 2 | 80.00 | 75.00 | -6.2% |" in text
    assert "| +5.3% | 1.50 | 1.20 | met | x1.19: +0.8% / -0.9% met |" in text
    assert "| -26.3% |  |  | MISSED (saturated) |  |" in text
    assert "Chosen by prediction at 2.0 req/s within 150.0 ms" in text and "| split (chosen) |" in text


def test_a_bench_of_another_plan_or_a_damaged_one_is_not_compared(tmp_path: Path) -> None:
    import hashlib

    from hpcsplit.core.paths import RunPaths
    from hpcsplit.launch.simulate import bench_record

    prof = _profile({"vision": 120.0, "text": 40.0, "head": 0.2})
    paths = RunPaths.from_config({}, tmp_path)
    choose(prof, CPU4, _settings(2, 150.0), _two_towers(), _cal(0.3), ServePolicy()).plan.save(paths.own_plan)
    paths.bench_dir.mkdir()
    rec = {"plan_sha256": hashlib.sha256(paths.own_plan.read_bytes()).hexdigest(), "qps": [2], "duration_s": 10.0,
           "min_requests": 30, "arrival": "poisson", "seed": 0, "request_timeout_s": 10.0, "max_inflight": 64,
           "max_wait_ms": 0.0}
    row = "variant,offered_qps,achieved_qps,p50_ms,p99_ms,success_rate\nsplit,2,1.9,80,100,1\n"
    paths.bench_summary.write_text(row)
    for good, r in ((True, rec), (False, {**rec, "plan_sha256": "0" * 64}), (False, {**rec, "max_inflight": "x"}),
                    (False, {**rec, "arrival": "zipf"}), (False, {**rec, "spin_us": "x"}), (True, {**rec, "spin_us": 50.0})):
        paths.bench_record.write_text(json.dumps(r))
        assert (bench_record(paths, paths.own_plan) is not None) == good, r
    for bad in ({**rec, "duration_s": float("nan")}, {**rec, "qps": [-2]}, {**rec, "min_requests": 10**12},
                {**rec, "seed": 1.5}, {**rec, "max_inflight": True}):  # each would have stopped the stage raw
        paths.bench_record.write_text(json.dumps(bad))
        assert bench_record(paths, paths.own_plan) is None, bad
    paths.bench_record.write_text('{"qps": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert bench_record(paths, paths.own_plan) is None
    paths.bench_record.write_text(json.dumps(rec))
    paths.bench_summary.write_text(row.replace("80", "fast"))
    assert bench_record(paths, paths.own_plan) is None
    for cpu, good in (("1.5", True), ("", True), ("nan", True), ("-1", False), ("many", False), ("inf", False)):
        paths.bench_summary.write_text(row.replace("success_rate\n", "success_rate,cpu_cores\n").replace(",1\n", f",1,{cpu}\n"))
        assert (bench_record(paths, paths.own_plan) is not None) == good, cpu


def test_the_simulated_schedule_polls_after_work_as_the_bench_did() -> None:
    """``runtime.spin_us`` (and the spin a bench recorded) reach the simulation: a rank that polls longer sees
    the next message without a wake-up."""
    from hpcsplit.launch.simulate import SimulateSettings, schedule_of

    s = SimulateSettings.from_config({})
    assert schedule_of({}, s, None).policy.spin_us == 50.0  # mailbox.SPIN_S, the bench mode's
    assert schedule_of({"runtime": {"spin_us": 2000}}, s, None).policy.spin_us == 2000.0
    rec = {"qps": [2], "duration_s": 10.0, "min_requests": 30, "arrival": "poisson", "seed": 0,
           "request_timeout_s": 10.0, "max_inflight": 64, "max_wait_ms": 0.0}
    assert schedule_of({"runtime": {"spin_us": 0}}, s, rec).policy.spin_us == 0.0  # a record without it
    assert schedule_of({}, s, {**rec, "spin_us": 700.0}).policy.spin_us == 700.0


def test_the_speed_a_bench_remeasured_is_read_as_untrusted(tmp_path: Path) -> None:
    from hpcsplit.core.paths import RunPaths
    from hpcsplit.launch.simulate import floor_scale

    paths = RunPaths.from_config({}, tmp_path)
    f = paths.rank_result("hpcsplit.runtime.stage:mpi_main")
    f.parent.mkdir(parents=True, exist_ok=True)
    for now, want in (({"a": 2.0}, {"a": 2.0}), ({"a": float("nan")}, None), ({"a": -1.0}, None)):
        f.write_text(json.dumps({"critical_path_now_components_ms": now, "critical_path_components_ms": {"a": 1.0}}))
        assert floor_scale(paths) == want
    f.write_text("[" * 100_000)
    assert floor_scale(paths) is None


def test_settings_refuse_infinite_rates_and_integers_past_a_float() -> None:
    """An infinite offered load, or an integer too large for a float, is a ConfigError (it raised OverflowError)."""
    from hpcsplit.launch.simulate import SimulateSettings

    with pytest.raises(ConfigError, match=r"simulate.qps = \[inf\]"):
        SimulateSettings.from_config({"simulate": {"qps": [float("inf")]}})
    with pytest.raises(ConfigError, match="simulate.runs = 1000"):
        SimulateSettings.from_config({"simulate": {"runs": 10**400}})
    with pytest.raises(ConfigError, match="allocate.rate_rps = 1000"):
        AllocateSettings.defaults(rate_rps=10**400, slo_ms=10.0)


def test_a_candidate_that_answered_nothing_is_strict_json_in_the_plan_and_summary(tmp_path: Path) -> None:
    from hpcsplit.launch.summary import _plan

    prof = _profile({"vision": 120.0, "text": 40.0, "head": 0.2})
    c = choose(prof, CPU4, _settings(2, 150.0), _two_towers(), _cal(0.3), ServePolicy())
    rows = c.plan.meta["choice"]["candidates"]
    rows[-1].update(p50_ms=math.inf, p99_ms=math.inf, note=[math.nan, 1.0])  # what _simulated gives when none did
    path = c.plan.save(tmp_path / "plan.json")

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in the plan file")

    saved = json.loads(path.read_text(), parse_constant=refuse)
    last = saved["meta"]["choice"]["candidates"][-1]
    assert last["p50_ms"] is None and last["p99_ms"] is None and last["note"] == [None, 1.0]
    table = "\n".join(_plan(path))
    assert f"| {last['candidate']}" in table and "| - | - |" in table


def test_a_machine_at_another_speed_moves_every_components_compute_and_cold_extra_not_the_frontends() -> None:
    from hpcsplit.launch.simulate import at_speed_system

    prof = _profile({"vision": 120.0, "text": 40.0, "head": 0.2})
    graph = _two_towers()
    cal = dataclasses.replace(_cal(0.3), compute_cold=Curve((0.0, 1000.0), (0.0, 5.0)))
    plan = choose(prof, CPU4, _settings(2, 150.0), graph, cal, ServePolicy()).plan
    for variant in ("split", "whole"):
        base = at_speed_system(plan, prof.components, graph, cal, ServePolicy(), variant, 8.0, None, 1.0)
        slow = at_speed_system(plan, prof.components, graph, cal, ServePolicy(), variant, 8.0, None, 1.5)
        assert any(k.cold.values_ms[-1] > 0 for k in base.ranks if k.component >= 0)
        for a, b in zip(base.ranks, slow.ranks, strict=True):
            if a.component < 0:  # the frontend: no compute, as calibrated
                assert b == a
                continue
            assert b.latency_ms == pytest.approx(tuple(1.5 * x for x in a.latency_ms))
            assert b.cold.values_ms == pytest.approx(tuple(1.5 * x for x in a.cold.values_ms))
            assert b.cold.gaps_ms == a.cold.gaps_ms
        assert slow.calibration == base.calibration and slow.components == base.components  # hops, bytes as they were


def test_a_level_simulated_at_its_speed_moves_with_it_and_is_judged_on_its_own(tmp_path: Path) -> None:
    """``[Note: the level's speed]``: a level whose requests alone computed twice as slow as simulated is simulated
    again with twice the compute; a level whose speed is not known gets no such prediction."""
    from hpcsplit.launch.simulate import (
        MIN_ALONE,
        Schedule,
        at_speed,
        compare_rows,
        predict,
        systems_for,
        verdict_at_speed,
    )

    prof = _profile({"vision": 120.0, "text": 40.0, "head": 0.2})
    graph, cal = _two_towers(), _cal(0.3)
    plan = choose(prof, CPU4, _settings(2, 150.0), graph, cal, ServePolicy()).plan
    sched = Schedule((1.0, 2.0), 10.0, 20, "poisson", 0, ServePolicy(), "bench")
    systems = systems_for(plan, prof.components, graph, cal, sched.policy, ("split",), 8.0, None)
    pred = predict(systems, sched, ("poisson",), 1)
    assert all(p.alone_n >= MIN_ALONE and p.alone_path_p50_ms > 0 for p in pred)
    measured = [{"variant": "split", "offered_qps": p.offered_qps, "achieved_qps": p.achieved_qps,
                 "p50_ms": 2 * p.p50_ms, "p99_ms": 2 * p.p99_ms, "success_rate": 1.0} for p in pred]
    alone_meas = {("split", 1.0): (2 * pred[0].alone_path_p50_ms, 10)}  # level 1 computed at half speed; 2: unknown
    rows = compare_rows(pred, measured, "poisson", alone_meas)
    at_speed(rows, plan, prof.components, graph, cal, sched, 8.0, None, 1, 0)
    slow, unknown = rows
    assert slow["compute_ratio"] == pytest.approx(2.0)
    assert 1.8 < slow["at_speed_p50_ms"] / slow["predicted_p50_ms"] < 2.05  # compute doubled, the hops did not
    assert abs(slow["at_speed_p50_err_pct"]) < 10 and verdict_at_speed(slow) == "met"
    assert math.isnan(unknown["at_speed_p50_ms"]) and verdict_at_speed(unknown) == ""
    from hpcsplit.launch.simulate import _plot

    files = _plot(tmp_path, pred, measured, "poisson", rows)  # the level at its speed drawn beside the rest
    assert [Path(f).name for f in files] == ["latency_vs_qps.png", "throughput_vs_qps.png"]
    assert all(Path(f).stat().st_size > 0 for f in files)


def test_simulate_says_how_far_apart_the_calibration_and_the_bench_were(tmp_path: Path) -> None:
    """A shared machine's costs move with the hour: the comparison says when the calibration was made against the
    bench's end (its summary.csv written), and what to do when they are far apart; none for the defaults."""
    import calendar
    import dataclasses
    import os
    import time

    from hpcsplit.core.calibration import Calibration
    from hpcsplit.launch.simulate import calibration_age_min, calibration_age_note

    rec = tmp_path / "summary.csv"
    rec.write_text("variant\n")
    made = calendar.timegm(time.strptime("2026-12-07T02:00:00Z", "%Y-%m-%dT%H:%M:%SZ"))
    cal = dataclasses.replace(_cal(0.3), source="measured", created_utc="2026-12-07T02:00:00Z")
    os.utime(rec, (made + 12 * 60, made + 12 * 60))
    assert calibration_age_min(cal, rec) == pytest.approx(12.0)
    assert calibration_age_note(12.0) == "calibration: made 12 min before the bench ended"
    os.utime(rec, (made + 90 * 60, made + 90 * 60))
    note = calibration_age_note(calibration_age_min(cal, rec) or 0.0)
    assert note.startswith("calibration: made 90 min before the bench ended;") and "stage=calibrate" in note
    assert calibration_age_note(-5.0) == "calibration: made 5 min after the bench"
    assert calibration_age_min(Calibration.defaults(), rec) is None
    assert calibration_age_min(dataclasses.replace(cal, created_utc="yesterday"), rec) is None
    assert calibration_age_min(cal, tmp_path / "none.json") is None


def test_the_simulation_binds_ranks_as_the_launcher_does_or_as_simulate_bind_says() -> None:
    """``simulate.bind``: null reads ``-bind-to core`` (MPICH) or ``--bind-to core`` (Open MPI) in the launcher's
    mpiexec arguments; ``core`` and ``none`` override it; anything else is refused. Only CPU plans are bound."""
    from hpcsplit.launch.simulate import SimulateSettings

    auto = SimulateSettings.from_config({})
    for args, want in (([], False), (["-bind-to", "core"], True), (["--bind-to", "core"], True),
                       (["--bind-to=core"], True), (["-bind-to", "socket"], False), (["core", "-bind-to"], False),
                       ("-bind-to core", False)):
        assert auto.binds_cores({"launcher": {"mpiexec_args": args}}) is want, args
    bound = {"launcher": {"mpiexec_args": ["-bind-to", "core"]}}
    assert SimulateSettings.from_config({"simulate": {"bind": "none"}}).binds_cores(bound) is False
    assert SimulateSettings.from_config({"simulate": {"bind": "core"}}).binds_cores({}) is True
    with pytest.raises(ConfigError, match="simulate.bind = 'cores'"):
        SimulateSettings.from_config({"simulate": {"bind": "cores"}})
    with pytest.raises(ConfigError, match="simulate.bind = True"):
        SimulateSettings.from_config({"simulate": {"bind": True}})


def test_choosing_by_prediction_simulates_the_ranks_bound_as_the_launcher_binds_them() -> None:
    """``allocate.rate_rps`` simulates its candidates as ``stage=simulate`` does (``core.sim_model.binds_cores``, one
    code for both): with every wake-up stacked on its ringer's core, the split's towers share the frontend's core
    until a slice parts them; bound to cores they cannot stack, and the split answers sooner."""
    from hpcsplit.core.sim_model import binds_cores

    assert binds_cores({"launcher": {"mpiexec_args": ["-bind-to", "core"]}})
    assert not binds_cores({"launcher": {"mpiexec_args": ["-bind-to", "core"]}, "simulate": {"bind": "none"}})
    with pytest.raises(ConfigError, match="simulate.bind = 'socket'"):
        binds_cores({"simulate": {"bind": "socket"}})
    prof = _profile({"vision": 120.0, "text": 40.0, "head": 0.2})
    cal = dataclasses.replace(_cal(0.3), wake_on_ringer_core=1.0)
    p50 = {}
    for bind in (False, True):
        c = choose(prof, CPU4, _settings(2, 150.0), _two_towers(), cal, ServePolicy(), bind_cores=bind)
        p50[bind] = {r["candidate"]: r["p50_ms"] for r in c.rows}
    assert p50[True]["split"] < p50[False]["split"], p50
