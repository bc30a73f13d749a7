"""The calibration file: round trip, the documented defaults, and every way a file is refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from hpcsplit.core.calibration import (
    CALIBRATION_FORMAT,
    Calibration,
    Curve,
    Link,
    ProgramCal,
    calibration_for,
    load_calibration,
)
from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.errors import CalibrationError, HpcsplitError
from hpcsplit.launch.calibrate_fit import fit


def measured() -> Calibration:
    hop = Curve((0.0, 1.0, 10.0, 100.0), (0.02, 0.15, 0.45, 0.9))
    return Calibration(
        source="measured", created_utc="2026-01-01T00:00:00Z", hpcsplit_version="0", cluster="local",
        hosts=("vm",), nodes=1, cores_per_node=2, device_kind="cpu", hop=hop,
        hop_p90=Curve(hop.gaps_ms, tuple(v * 2 for v in hop.values_ms)),
        frontend_timer=Curve((0.0, 100.0), (0.0, 0.15)), compute_cold=Curve((0.0, 100.0), (0.0, 0.2)),
        same_node=Link(0.01, 3.0, (64, 1 << 20), (0.01, 0.4)), cross_node=None, cross_extra=Curve.constant(0.0),
        frontend_us_per_request=3.0, frontend_us_per_message=17.0, component_us_per_message=15.0,
        component_us_per_request=2.5, compute_gflops={1: 38.0, 2: 60.0}, corun_slowdown=(1.0, 1.07),
        switchboard_sha256="ab" * 32, programs={"whole": ProgramCal(1.5, Curve((0.0, 100.0), (0.0, 0.4)))},
        idle_cpu=Curve((0.0, 0.5, 2.0), (0.0, 0.1, 0.15)),
    )


def test_round_trip_keeps_every_figure(tmp_path: Path) -> None:
    cal = measured()
    back = load_calibration(cal.save(tmp_path / "calibration.json"))
    assert back.to_json() == cal.to_json()
    assert back.hop.at(10.0) == pytest.approx(0.45) and back.program("whole", "ab" * 32).batch1_ms == 1.5
    assert back.program("whole", "cd" * 32) is None  # another switchboard's programs are not used
    assert back.idle_cpu.at(2.0) == pytest.approx(0.15)


def test_a_file_written_before_the_frontends_cpu_per_turn_reads_it_as_zero(tmp_path: Path) -> None:
    d = dataclasses.replace(measured(), frontend_us_per_turn=42.0).to_json()
    assert load_calibration(_write(tmp_path, d)).frontend_us_per_turn == 42.0
    del d["cpu"]["frontend_us_per_turn"]
    assert load_calibration(_write(tmp_path, d)).frontend_us_per_turn == 0.0
    d["cpu"]["frontend_us_per_turn"] = -1.0
    with pytest.raises(CalibrationError, match=r"cpu.frontend_us_per_turn = -1.0"):
        load_calibration(_write(tmp_path, d))


def test_a_file_written_before_the_evicted_turns_reads_them_as_zero(tmp_path: Path) -> None:
    """[Note: evicted caches]: both figures are optional (older files have neither) and checked like the rest."""
    cal = dataclasses.replace(measured(), evicted_us_per_turn=31.0, evicted_us_per_wake=14.0,
                              programs={"whole": ProgramCal(1.5, Curve.constant(0.0), 0.12)})
    back = load_calibration(cal.save(tmp_path / "c.json"))
    assert back.evicted_us_per_turn == 31.0 and back.programs["whole"].evicted_ms == 0.12
    assert back.evicted_us_per_wake == 14.0
    d = cal.to_json()
    del d["cpu"]["evicted_us_per_turn"]
    del d["cpu"]["evicted_us_per_wake"]
    del d["programs"]["programs"]["whole"]["evicted_ms"]
    old = load_calibration(_write(tmp_path, d))
    assert old.evicted_us_per_turn == 0.0 and old.programs["whole"].evicted_ms == 0.0
    assert old.evicted_us_per_wake == 0.0
    d["cpu"]["evicted_us_per_turn"] = float("nan")
    d["cpu"]["evicted_us_per_wake"] = -3.0
    d["programs"]["programs"]["whole"]["evicted_ms"] = -0.5
    with pytest.raises(CalibrationError, match=r"cpu.evicted_us_per_turn = nan") as e:
        load_calibration(_write(tmp_path, d))
    assert "programs['whole'].evicted_ms = -0.5" in str(e.value)
    assert "cpu.evicted_us_per_wake = -3.0" in str(e.value)


def test_the_wake_up_placement_share_is_optional_and_kept(tmp_path: Path) -> None:
    """[Note: stacked wake-ups]: absent or null reads as not measured; a share round-trips; the fit takes the share of
    the placement step's rings that woke the peer on the ringer's core."""
    d = measured().to_json()
    assert d["wake_on_ringer_core"] is None
    del d["wake_on_ringer_core"]
    assert load_calibration(_write(tmp_path, d)).wake_on_ringer_core is None
    cal = dataclasses.replace(measured(), wake_on_ringer_core=0.975)
    assert load_calibration(cal.save(tmp_path / "c.json")).wake_on_ringer_core == pytest.approx(0.975)
    raw = _raw(0.5)
    assert fit(raw).wake_on_ringer_core is None  # (no placement step: an older job, or no doorbell)
    raw["placement"] = {"same_core": [True, True, False, True], "woke_us": [5.0, 6.0, 80.0, 4.0]}
    assert fit(raw).wake_on_ringer_core == pytest.approx(0.75)


def test_a_file_written_before_idle_cpu_reads_as_no_idle_cpu(tmp_path: Path) -> None:
    d = measured().to_json()
    del d["idle_cpu"]
    back = load_calibration(_write(tmp_path, d))
    assert back.idle_cpu == Curve.constant(0.0) and back.hop.at(10.0) == pytest.approx(0.45)


def test_split_rule_takes_the_calibrated_figures_and_defaults_say_so() -> None:
    rule = measured().split_rule()
    assert rule == {"compute_gflops": 38.0, "transport_gb_s": 3.0, "hop_ms": pytest.approx(0.45)}
    d = Calibration.defaults()
    assert d.split_rule() == {"compute_gflops": 30.0, "transport_gb_s": 0.5, "hop_ms": 0.3}
    assert "documented defaults" in d.describe() and "stage=calibrate" in d.describe()
    assert "calibration of local" in measured().describe()


def test_calibration_for_uses_the_given_file_the_run_folders_or_the_defaults(tmp_path: Path) -> None:
    assert calibration_for(tmp_path / "calibration.json", given=False).source == "defaults"
    with pytest.raises(CalibrationError, match="cannot read calibration file"):
        calibration_for(tmp_path / "missing.json", given=True)
    measured().save(tmp_path / "calibration.json")
    assert calibration_for(tmp_path / "calibration.json", given=False).source == "measured"


def _write(tmp_path: Path, data: object) -> Path:
    p = tmp_path / "calibration.json"
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.update(schema_version=2), "found schema_version=2; this hpcsplit reads version 1"),
    (lambda d: d.pop("hop"), r"missing keys \['hop'\]"),
    (lambda d: d.update(extra=1), r"unknown keys \['extra'\]"),
    (lambda d: d["hop"].update(gaps_ms=[0.0, 5.0, 1.0, 2.0]), "hop.gaps_ms = .*strictly increasing"),
    (lambda d: d["hop"].update(values_ms=[0.1, -1.0, 0.2, 0.3]), r"hop.values_ms\[1\] = -1.0: needs a number"),
    (lambda d: d["hop"].update(values_ms=[0.1, 0.2]), "lists of equal length"),
    (lambda d: d["same_node"].update(gb_s=0), r"same_node.gb_s = 0: needs a number in \(0"),
    (lambda d: d["cpu"].update(frontend_us_per_request="fast"), "cpu.frontend_us_per_request = 'fast'"),
    (lambda d: d["compute"].update(gflops={"one": 3}), "compute.gflops key = 'one'"),
    (lambda d: d["compute"].update(corun_slowdown=[0.5]), r"corun_slowdown\[0\] = 0.5"),
    (lambda d: d.update(nodes=True), "nodes = True: needs an integer"),
    (lambda d: d.update(source="guessed"), "source = 'guessed'"),
    (lambda d: d["hop"].update(values_ms=[float("nan")] * 4), "hop.values_ms"),
    (lambda d: d["cpu"].update(frontend_us_per_request=10**400), r"cpu.frontend_us_per_request = 1000.*needs a number"),
    (lambda d: d["compute"].update(gflops={"\u00b2": 3.0}), "compute.gflops key = '\u00b2'"),  # a digit to isdigit()
    (lambda d: d.update(hop=None), "hop = None: needs an object"),  # null is not the curve, nor a default
    (lambda d: d.update(same_node=None), "same_node = None: needs an object"),
    (lambda d: d.update(idle_cpu=None), "idle_cpu = None: needs an object"),  # optional, but not null
    (lambda d: d["idle_cpu"].update(values_ms=[0.0, float("inf"), 1.0]), r"idle_cpu.values_ms\[1\] = inf"),
    (lambda d: d.update(wake_on_ringer_core=1.5), r"wake_on_ringer_core = 1.5: needs a number in \[0, 1\]"),
    (lambda d: d.update(wake_on_ringer_core="most"), "wake_on_ringer_core = 'most'"),
])
def test_a_malformed_file_is_refused_naming_the_problem(tmp_path: Path, mutate, message: str) -> None:
    d = measured().to_json()
    mutate(d)
    with pytest.raises(CalibrationError, match=message) as e:
        load_calibration(_write(tmp_path, json.dumps(d, allow_nan=True)))
    assert "stage=calibrate" in str(e.value) and "calibration.json" in str(e.value)


def test_a_foreign_file_is_refused_by_its_format(tmp_path: Path) -> None:
    plan = Plan("m", None, "cpu", 1, (RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0),
                                      RankEntry(1, "component", 0, None, None, 1, "a", 1, 0)), {"a": 1.0}, {})
    plan.save(tmp_path / "plan.json")
    with pytest.raises(CalibrationError, match=f"format=None .a plan.; needed format='{CALIBRATION_FORMAT}'"):
        load_calibration(tmp_path / "plan.json")
    for text, msg in (("not json {", "not a JSON calibration file"), ("[1, 2]", "found a JSON list"),
                      (json.dumps({"format": "hpcsplit-profile"}), "a profile"), ("\xff".encode("latin-1"), "not a JSON")):
        p = tmp_path / "x.json"
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(CalibrationError, match=msg):
            load_calibration(p)


def test_a_huge_file_is_refused_before_parsing(tmp_path: Path) -> None:
    p = tmp_path / "calibration.json"
    p.write_text(" " * (2 << 20))
    with pytest.raises(CalibrationError, match="larger than"):
        load_calibration(p)


def test_a_deeply_nested_or_endless_number_file_is_refused(tmp_path: Path) -> None:
    head = '{"format": "hpcsplit-calibration", "schema_version": 1, "notes": '
    for body, msg in (("[" * 200_000 + "]" * 200_000, "nests JSON too deeply"), ("1" * 5000, "not a JSON")):
        p = tmp_path / "calibration.json"
        p.write_text(head + body + "}")
        with pytest.raises(CalibrationError, match=msg):
            load_calibration(p)


def test_errors_are_hpcsplit_errors() -> None:
    assert issubclass(CalibrationError, HpcsplitError)


def test_curve_is_flat_outside_and_log_linear_inside() -> None:
    c = Curve((0.0, 1.0, 100.0), (0.1, 0.2, 1.0))
    assert c.at(-1) == 0.1 and c.at(0.5) > 0.1 and c.at(1e9) == 1.0
    assert c.at(10.0) == pytest.approx(0.2 + 0.8 * (__import__("math").log1p(10) - __import__("math").log1p(1))
                                       / (__import__("math").log1p(100) - __import__("math").log1p(1)))


def _raw(hop_ms: float, turn_s: float = 30e-6) -> dict:
    """Raw figures of a calibration job on a machine whose hop is ``hop_ms`` at every gap (ms)."""
    m = 0.01
    rtt0 = 2 * m + turn_s * 1e3
    recv = (turn_s - 5e-6) / 2 * 1e3 + 5e-3  # a / 2 + b of the saturation runs below (a = 25 us + ..., b = 5 us)
    pp = {f"stream {b}": {"bytes": b, "rtt_ms": [rtt0 + 2 * b / 2e6] * 5, "one_way_ms": [m + recv + b / 2e6] * 5}
          for b in (64, 1 << 20)}
    for g in (1.0, 10.0, 100.0):
        pp[f"gap {g:g}"] = {"gap_ms": g, "rtt_ms": [hop_ms + turn_s * 1e3 + m] * 9,
                            "one_way_ms": [hop_ms + recv] * 9, "idle_ms": [g] * 9,
                            # the replica's CPU stamps: a request costs turn_s, an idle gap g ms 0.02 * g + 0.05 ms
                            "cpu_ms": list(np.cumsum([turn_s * 1e3 + 0.02 * g + 0.05] * 9))}
    for v in (pp["stream 64"], pp[f"stream {1 << 20}"]):
        v["cpu_ms"] = list(np.cumsum([turn_s * 1e3] * 5))
    sat = {"saturation b1": {"component": {"batches": 1000, "requests": 1000, "cpu_s": 1000 * turn_s},
                             "saturation": {"requests": 1000, "wall_s": 0.1, "frontend_cpu_s": 1000 * 40e-6}},
           "saturation b32": {"component": {"batches": 40, "requests": 1000, "cpu_s": 40 * 25e-6 + 1000 * 5e-6},
                              "saturation": {"requests": 1000, "wall_s": 0.05, "frontend_cpu_s": 1000 * 10e-6}}}
    one = {f"gap {g:g}": {"gap_ms": g, "pipe_ms": [1.0] * 5, "lag_ms": [0.1] * 5} for g in (10.0, 100.0)}
    return {"chains": {"pingpong": pp, "one": one, **sat}, "hosts": ["vm", "vm", "vm"], "cores_per_node": 2,
            "cluster": "local", "gflops": {"1": 40.0}, "corun_gflops": {"1": [40.0], "2": [36.0, 38.0]},
            "small": {"b2b_ms": [0.01] * 9, "after_ms": {"100": [0.21] * 5}}, "programs": None}


def test_fit_recovers_the_figures_it_was_given(tmp_path: Path) -> None:
    cal = fit(_raw(0.5))
    assert cal.measured and cal.nodes == 1 and cal.cores_per_node == 2
    assert cal.same_node.gb_s == pytest.approx(2.0, rel=1e-6)  # 2 bytes per ns round trip = 2 GB/s each way
    assert cal.hop.at(10.0) == pytest.approx(0.5 - 0.01 + 0.01 - 0.0, abs=0.02)
    assert cal.compute_cold.at(100.0) == pytest.approx(0.2)
    assert cal.corun(2) == pytest.approx(40 / 37)
    assert cal.frontend_timer.at(99.0) == pytest.approx(0.1)
    load_calibration(cal.save(tmp_path / "c.json"))  # what it writes, every reader takes
    assert fit(_raw(2.0)).hop.at(10.0) > fit(_raw(0.5)).hop.at(10.0) + 1.4
    for g in (1.0, 10.0, 100.0):  # the CPU of an idle gap: per request at that gap, less back to back
        assert cal.idle_cpu.at(g) == pytest.approx(0.02 * g + 0.05)
    raw = _raw(0.5)
    for v in raw["chains"]["pingpong"].values():
        v.pop("cpu_ms")
    assert fit(raw).idle_cpu == Curve.constant(0.0)  # no stamps (an older job's raw figures): none
    assert cal.frontend_us_per_turn == 0.0  # no turns run (an older job's raw figures): none


def test_the_frontends_cpu_per_turn_is_what_a_pass_costs_beyond_its_request_and_messages() -> None:
    """The frontend's working passes, counted in the two saturation runs and in the ``turns`` run (one request a
    pass): their thread CPU gives 6 us a request and 12 us a message in the saturation runs (not the process
    CPU, 8.75 and 15.625 us, which also counts the passes that found nothing), and the ``turns`` run's passes cost
    20 us more each than that."""
    raw = _raw(0.5)
    c, d, turn = 6e-6, 12e-6, 20e-6
    ch = raw["chains"]
    for key, m, passes in (("saturation b1", 2000, 900), ("saturation b32", 80, 30)):
        ch[key]["saturation"].update(turns=passes, turn_cpu_s=1000 * c + m * d)
    ch["turns"] = {"turns": {"requests": 300, "turns": 600, "turn_cpu_s": 300 * c + 600 * d + 600 * turn}}
    cal = fit(raw)
    assert cal.frontend_us_per_request == pytest.approx(6.0) and cal.frontend_us_per_message == pytest.approx(12.0)
    assert cal.frontend_us_per_turn == pytest.approx(20.0)
    ch["turns"]["turns"]["turn_cpu_s"] = 300 * c + 600 * d  # no more than its requests and messages: no turn cost
    assert fit(raw).frontend_us_per_turn == pytest.approx(0.0, abs=1e-9)
    del ch["turns"]  # an older job's figures: the saturation runs' process CPU, no turn cost
    old = fit(raw)
    assert old.frontend_us_per_turn == 0.0 and old.frontend_us_per_message == pytest.approx(15.625)


def test_cold_extra_is_taken_in_pairs_so_a_drift_between_the_runs_cancels() -> None:
    """[Note: cold extra in pairs]: the back-to-back runs were timed on a fast machine (10 ms), the runs after the
    gaps on one 30 % slower (13 ms warm); the true extra is 2 ms at 100 ms idle, 5 at 1 s.  The pairs give it;
    without them (an older job's figures) the drift is taken for an extra."""
    rng = np.random.default_rng(0)
    warm = {g: list(13.0 + rng.normal(0, 0.2, 7)) for g in ("100", "1000")}
    after = {g: [w + e + rng.normal(0, 0.05) for w in warm[g]] for g, e in (("100", 2.0), ("1000", 5.0))}
    b2b = list(10.0 + rng.normal(0, 0.2, 9))
    raw = _raw(0.5)
    raw["small"] = {"b2b_ms": b2b, "after_ms": after, "warm_ms": warm}
    raw["programs"] = {"switchboard_sha256": "0" * 64, "programs": {"whole": dict(raw["small"])}}
    cal = fit(raw)
    for c in (cal.compute_cold, cal.programs["whole"].cold):
        assert c.at(100.0) == pytest.approx(2.0, abs=0.15) and c.at(1000.0) == pytest.approx(5.0, abs=0.15)
    assert cal.programs["whole"].batch1_ms == pytest.approx(10.0, abs=0.2)  # the warm time: back to back
    del raw["small"]["warm_ms"]
    assert fit(raw).compute_cold.at(100.0) == pytest.approx(5.0, abs=0.3)  # 3 ms of drift taken for an extra


def test_the_evicted_turns_are_the_pairs_median_extra_and_zero_where_the_job_could_not_pin() -> None:
    """[Note: evicted caches]: each turn straight after the peer's turn on the same core is paired with the warm
    turn after it; a drift between pairs cancels, a pair warmer than its cold turn counts as no extra, and a job
    that could not pin two ranks to one core (``shared_core`` None), or an older job's figures, give 0."""
    rng = np.random.default_rng(1)
    warm = list(0.05 + np.linspace(0.0, 0.2, 21))  # the machine slows down over the runs
    cold = [w + 0.09 + rng.normal(0, 0.003) for w in warm]
    raw = _raw(0.5)
    raw["programs"] = {"switchboard_sha256": "0" * 64,
                       "programs": {"stem": {"b2b_ms": [0.05] * 5, "after_ms": {}, "warm_ms": {}}}}
    raw["shared_core"] = {"core": 0, "turn": {"evicted_ms": [0.045] * 5, "warm_ms": [0.015] * 5},
                          "wake": {"evicted_ms": [0.03, 0.031, 0.07, 0.029, 0.032], "warm_ms": [0.017] * 5},
                          "programs": {"stem": {"evicted_ms": cold, "warm_ms": warm}}}
    cal = fit(raw)
    assert cal.programs["stem"].evicted_ms == pytest.approx(0.09, abs=0.005)
    assert cal.evicted_us_per_turn == pytest.approx(30.0)
    assert cal.evicted_us_per_wake == pytest.approx(14.0)  # (the pairs' median: one slow wake-up does not count)
    raw["shared_core"]["turn"] = {"evicted_ms": [0.01] * 5, "warm_ms": [0.02] * 5}
    assert fit(raw).evicted_us_per_turn == 0.0  # never below 0
    raw["shared_core"] = None
    old = fit(raw)
    assert old.evicted_us_per_turn == 0.0 and old.programs["stem"].evicted_ms == 0.0
    assert old.evicted_us_per_wake == 0.0


@pytest.mark.parametrize("over", [{"sizes_bytes": [float("inf")]}, {"sizes_bytes": [2**2000]},
                                  {"gaps_ms": [float("inf")]}, {"max_gap_time_s": float("inf")},
                                  {"threads": [0]}, {"samples": 10**9}, {"settle_s": float("inf")},
                                  {"settle_s": -1.0}, {"settle_s": 61.0}])
def test_calibrate_settings_refuse_infinite_and_huge_values(over: dict) -> None:
    """Each would have raised OverflowError or made a step wait (or loop) for ever."""
    from hpcsplit.errors import ConfigError
    from hpcsplit.launch.calibrate import CalibrateSettings

    with pytest.raises(ConfigError, match=f"calibrate.{next(iter(over))} = "):
        CalibrateSettings.from_config({"calibrate": over})


def test_a_program_after_an_idle_gap_is_timed_on_inputs_received_as_a_rank_receives_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: cold extra after a receive]: the wake-up's first calls (the receive) are the hop's, so the program's
    cold extra is timed after its inputs came through the runtime's transport, on what arrived: the sleep first,
    then the receive, then the program alone."""
    import time

    import torch

    from hpcsplit.launch import calibrate_run
    from hpcsplit.runtime.mailbox import Inbox

    events: list[str] = []
    real_sleep, real_poll = time.sleep, Inbox.poll

    def sleep(s: float) -> None:
        events.append("sleep")
        real_sleep(s)

    def poll(self: Inbox) -> list:
        got = real_poll(self)
        events.append("received" if got else "poll")
        return got

    monkeypatch.setattr(calibrate_run.time, "sleep", sleep)
    monkeypatch.setattr(Inbox, "poll", poll)
    big = (torch.randn(1, 3, 224, 224), torch.arange(7).reshape(1, 7), torch.zeros(1, 0), torch.ones(1, 4, 2).mT)
    small = (torch.randn(1, 64),)  # inline: its bytes behind the header (compute_cold's program)
    seen: list[tuple[torch.Tensor, ...]] = []

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        events.append("program")
        seen.append(xs)
        return xs[0]

    for args in (big, small):
        events.clear()
        seen.clear()
        cold, warm = calibrate_run._times(fn, args, 3, 0.002)
        assert len(cold) == len(warm) == 3 and all(m >= 0 for m in cold + warm)
        runs = "".join("S" if e == "sleep" else "R" if e == "received" else "P" if e == "program" else "." for e in events)
        # each run: the sleep, then the receive, then the program cold and at once warm ([Note: cold extra in pairs])
        assert runs.replace(".", "") == "SRPP" * 3, runs
        assert len(seen) == 6
        for xs in seen:
            assert len(xs) == len(args)
            for got, want in zip(xs, args, strict=True):
                assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
                assert got.numel() == 0 or got.data_ptr() != want.data_ptr()  # received, not the caller's tensor


def test_a_hop_is_a_trimmed_mean_and_its_spread_is_pooled_so_outliers_and_mode_flips_move_it_little() -> None:
    """[Note: hop spread]: a bimodal gap (half fast, half slow) gives the mix's mean whichever mode has one more sample;
    two outliers of twenty in one gap neither move its hop much nor make its p90."""
    def with_gap10(samples: list[float]) -> dict:
        raw = _raw(0.5)
        recv = raw["chains"]["pingpong"]["gap 10"]["one_way_ms"][0] - 0.5
        v = raw["chains"]["pingpong"]["gap 10"]
        v["one_way_ms"] = [s + recv for s in samples]
        v["rtt_ms"], v["idle_ms"] = [1.0] * len(samples), [10.0] * len(samples)
        v["cpu_ms"] = list(np.cumsum([0.1] * len(samples)))
        return raw

    fast_more = fit(with_gap10([0.1] * 11 + [0.3] * 9)).hop.at(10.0)
    slow_more = fit(with_gap10([0.1] * 9 + [0.3] * 11)).hop.at(10.0)
    assert 0.17 < fast_more < slow_more < 0.23  # (the median jumped from 0.1 to 0.3)
    odd = fit(with_gap10([0.5] * 18 + [16.0] * 2))
    assert odd.hop.at(10.0) == pytest.approx(0.5, abs=0.01)
    assert odd.hop_p90.at(10.0) < 1.0  # (the 90th percentile of these twenty samples is 16 ms)
    few = fit(with_gap10([0.8] * 7 + [16.0]))  # eight samples (a 1 s gap's): one outlier is still cut
    assert few.hop.at(10.0) == pytest.approx(0.8, abs=0.01)


def test_a_hops_spread_is_one_ratio_pooled_over_the_gaps_above_a_spinning_ranks() -> None:
    """[Note: hop spread]: every gap 8 fast samples and 2 twice as slow -> the same p90 / hop at every gap, the pooled
    quantile; a gap whose hop is near m (a spinning rank) stays out of the pool; and at most HOP_SPREAD_MAX."""
    from hpcsplit.core.calibration import HOP_SPREAD_MAX

    def raw_of(per_gap: dict[float, list[float]]) -> dict:
        raw = _raw(0.5)
        pp = raw["chains"]["pingpong"]
        recv = pp["gap 10"]["one_way_ms"][0] - 0.5
        for g, hs in per_gap.items():
            pp[f"gap {g:g}"] = {"gap_ms": g, "rtt_ms": [1.0] * len(hs), "one_way_ms": [h + recv for h in hs],
                                "idle_ms": [g] * len(hs), "cpu_ms": list(np.cumsum([0.1] * len(hs)))}
        return raw

    hops = {1.0: 0.3, 10.0: 0.5, 100.0: 0.9}
    cal = fit(raw_of({g: [h] * 8 + [2 * h] * 2 for g, h in hops.items()}))
    pool = np.concatenate([np.array([h] * 8 + [2 * h] * 2) / (h * 9 / 8) for h in hops.values()])  # over the trimmed mean
    for g, h in hops.items():
        assert cal.hop.at(g) == pytest.approx(h * 9 / 8, rel=1e-3)  # (7 fast, 1 slow: the ends cut)
        assert cal.hop_p90.at(g) / cal.hop.at(g) == pytest.approx(float(np.quantile(pool, 0.9)), rel=1e-3)
    assert cal.hop_p90.at(10.0) / cal.hop.at(10.0) > 1.5
    # a gap whose hop is a spinning rank's (about m, 0.01 ms): its jitter (a fifth of its samples 3x) stays out of the
    # pool, which would otherwise read a p90 over twice the hop for every gap
    spin = fit(raw_of({0.05: [0.011] * 32 + [0.03] * 8, **{g: [h] * 10 for g, h in hops.items()}}))
    assert spin.hop.at(0.05) < 2 * spin.same_node.latency_ms
    assert spin.hop_p90.at(10.0) == pytest.approx(spin.hop.at(10.0))
    wild = fit(raw_of({g: [h] * 8 + [50 * h] * 2 for g, h in hops.items()}))
    assert wild.hop_p90.at(10.0) / wild.hop.at(10.0) == pytest.approx(HOP_SPREAD_MAX)
