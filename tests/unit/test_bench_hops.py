"""``python -m hpcsplit.bench hops``: every hop of a traced run, read from the runtime's own trace files."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from hpcsplit.bench import hops as bh
from hpcsplit.core.calibration import Calibration, Curve
from hpcsplit.errors import HpcsplitError
from hpcsplit.runtime.trace import Tracer


def _chain_traces(d: Path, host1: str = "n0") -> None:
    """Frontend 0 -> stem 1 -> head 2 -> frontend 0 for requests 10..13, one every 10 ms, written by the runtime's
    own :class:`Tracer` (times in seconds, as the runtime passes them)."""
    tr = {r: Tracer(r, 0, 100, label) for r, label in ((0, "frontend"), (1, "stem"), (2, "head"))}
    for k, q in enumerate(range(10, 14)):
        t = k * 0.010
        tr[0].span("admit_send", t, t + 50e-6, [q])
        tr[1].span("recv", t + 300e-6, t + 310e-6, [q], src=0)  # hop 0 -> 1: 0.3 ms from the send's start
        tr[1].span("compute", t + 320e-6, t + 420e-6, [q])
        tr[1].span("send", t + 420e-6, t + 450e-6, [q])
        if q == 13:  # head still works on another request when stem's send starts (t + 0.42 ms), to t + 0.55
            tr[2].span("compute", t + 400e-6, t + 550e-6, [50])
        tr[2].span("recv", t + 620e-6, t + 630e-6, [q], src=1)  # hop 1 -> 2: 0.2 ms (13: 0.07 after it is free)
        tr[2].span("compute", t + 640e-6, t + 700e-6, [q])
        tr[2].span("send", t + 700e-6, t + 720e-6, [q])
        tr[0].span("recv_output", t + 800e-6, t + 810e-6, [q], src=2)  # hop 2 -> 0: 0.1 ms
    for r, t in tr.items():
        p = t.write(d)
        assert p is not None
        doc = json.loads(p.read_text())
        doc["otherData"]["host"] = host1 if r == 1 else "n0"  # the file names its host; here, chosen
        p.write_text(json.dumps(doc))


def test_every_hop_and_the_receivers_idle_gap_are_read_from_the_traces(tmp_path: Path) -> None:
    _chain_traces(tmp_path)
    hops, labels, notes = bh.trace_hops(tmp_path)
    assert labels == {0: "rank 0 frontend", 1: "rank 1 stem", 2: "rank 2 head"} and notes == []
    by = {(h.src, h.dst, h.request): h for h in hops}
    # a rank's first traced receive has no span before it: no gap, left out; the three after it are read
    assert sorted({(a, b) for a, b, _ in by}) == [(0, 1), (1, 2), (2, 0)]
    assert sorted(q for a, b, q in by if (a, b) == (0, 1)) == [11, 12, 13]
    h = by[(0, 1, 12)]
    # the gap is the receiver's idle time when the send started: stem's last work (its send of 11) ended 0.45 ms
    # into the 10 ms before
    assert h.hop_ms == pytest.approx(0.3) and h.gap_ms == pytest.approx(10.0 - 0.45) and h.busy_ms == 0.0
    assert by[(1, 2, 12)].hop_ms == pytest.approx(0.2)
    busy = by[(1, 2, 13)]  # head was working when the send started: the message waited for it, then hopped
    assert busy.gap_ms == 0.0 and busy.busy_ms == pytest.approx(0.13) and busy.hop_ms == pytest.approx(0.07)
    back = by[(2, 0, 12)]  # the frontend's span before is its admit_send of the same request
    assert back.hop_ms == pytest.approx(0.1) and back.gap_ms == pytest.approx(0.65)


def test_edge_rows_put_the_calibrated_hop_at_each_gap_beside_the_measured_one(tmp_path: Path) -> None:
    _chain_traces(tmp_path)
    hops, labels, _ = bh.trace_hops(tmp_path)
    cal = dataclasses.replace(Calibration.defaults(), hop=Curve((0.0, 1.0, 100.0), (0.05, 0.1, 1.0)))
    rows = {r["edge"]: r for r in bh.edge_rows(hops, labels, cal)}
    r = rows["rank 0 frontend -> rank 1 stem"]
    assert r["requests"] == 3 and r["hop_p50_ms"] == pytest.approx(0.3) and r["busy_p50_ms"] == 0.0
    assert r["calibrated_p50_ms"] == pytest.approx(cal.hop.at(r["gap_p50_ms"]))
    assert r["measured_over_calibrated"] == pytest.approx(0.3 / cal.hop.at(r["gap_p50_ms"]))


def test_the_command_prints_the_table_and_writes_csv_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _chain_traces(run / "trace")
    cal = Calibration.defaults().save(tmp_path / "calibration.json")
    assert bh.main([str(run), "--calibration", str(cal), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "rank 1 stem -> rank 2 head" in out and "sum over the edges" in out and "meas/cal" in out
    assert (tmp_path / "out" / "hops.csv").read_text().splitlines()[0].startswith("src,dst,edge,requests")
    assert (tmp_path / "out" / "hops.png").stat().st_size > 1000


def test_an_edge_between_hosts_is_left_out_and_named(tmp_path: Path) -> None:
    _chain_traces(tmp_path, host1="n1")
    hops, _, notes = bh.trace_hops(tmp_path)
    assert {(h.src, h.dst) for h in hops} == {(2, 0)}
    assert any("0 -> 1" in n and "different hosts" in n for n in notes)
    assert any("1 -> 2" in n for n in notes)


@pytest.mark.parametrize("text,what", [
    ("not json", "not JSON"),
    ('{"events": []}', "no traceEvents"),
    ('{"traceEvents": [{"ph": "X", "name": "recv", "ts": "soon", "dur": 1, "args": {"requests": []}}]}', "finite ts"),
    ('{"traceEvents": [{"ph": "X", "name": "recv", "ts": 1, "dur": 1, "args": {"requests": ["a"]}}]}', "integers"),
    ('{"traceEvents": [{"ph": "X", "name": "recv", "ts": 1, "dur": 1, "args": {"requests": [1], "src": -1}}]}',
     "not a rank"),
    ('{"traceEvents": [{"ph": "X", "name": "recv", "ts": 1' + "0" * 400 + ', "dur": 1, "args": {"requests": []}}]}',
     "finite ts"),
    ('{"traceEvents": [{"ph": "X", "name": "recv", "ts": 1, "dur": 1, "args": {"requests": [1, 2], "n": 1}}]}',
     "count of its requests"),
    ('{"traceEvents": [{"ph": "X", "name": "send", "ts": 1, "dur": 1, "args": {"requests": [1], "cpu_us": -3}}]}',
     "cpu_us is not a CPU time"),
])
def test_a_file_that_is_not_a_trace_is_refused_by_name(tmp_path: Path, text: str, what: str) -> None:
    (tmp_path / "rank0.json").write_text(text)
    with pytest.raises(HpcsplitError, match=what) as e:
        bh.trace_hops(tmp_path)
    assert "rank0.json" in str(e.value)


def test_a_folder_without_traces_says_how_to_make_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bh.main([str(tmp_path)]) == 2
    assert "runtime.trace.start_step" in capsys.readouterr().out


def test_variant_keeps_the_requests_of_one_variant_and_level_of_a_bench_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    h5py = pytest.importorskip("h5py")
    run = tmp_path / "run"
    _chain_traces(run / "trace")
    (run / "bench").mkdir()
    with h5py.File(run / "bench" / "requests.h5", "w") as f:
        f["whole/qps_4/request_ids"] = [10, 11]
        f["split/qps_4/request_ids"] = [12]
        f["split/qps_32/request_ids"] = [13]
    assert bh.bench_requests(run, "split") == {12, 13}
    assert bh.bench_requests(run, "split", 32.0) == {13}
    assert bh.main([str(run), "--variant", "split", "--qps", "4", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "split at 4 req/s (1 requests)" in out
    assert bh.main([str(run), "--variant", "split", "--qps", "8"]) == 2
    assert "no level at 8 req/s (it has 32, 4)" in capsys.readouterr().out
    assert bh.main([str(run), "--variant", "whole", "--qps", "4"]) == 0  # the calibration: none named, none there
    assert bh.main([str(run), "--qps", "4"]) == 2
    assert "give --variant too" in capsys.readouterr().out


def test_simulated_ways_go_beside_the_measured_ones_per_edge(tmp_path: Path) -> None:
    _chain_traces(tmp_path)
    hops, labels, _ = bh.trace_hops(tmp_path)
    # the simulator's log: (source, destination, sent, taken, requests, delivered, busy, hop); a message of 3
    # requests counts 3 times; what is left of the way past its transfer, busy and hop is its wait for a core
    sim = bh.simulated_ways([(0, 1, 0.0, 0.0002, 1, 0.0, 0.0, 0.0002), (0, 1, 1.0, 1.0004, 3, 1.0, 0.0001, 0.0001),
                             (1, 2, 0.0, 0.0001, 1, 0.00001, 0.0, 0.0)])
    assert sim == {(0, 1): pytest.approx({"way": 0.4, "busy": 0.1, "hop": 0.1, "core": 0.2, "way_p90": 0.4}),
                   (1, 2): pytest.approx({"way": 0.1, "busy": 0.0, "hop": 0.0, "core": 0.09, "way_p90": 0.1})}
    tail = bh.simulated_ways([(0, 1, 0.0, 0.0001 * (k + 1), 1, 0.0, 0.0, 0.0) for k in range(10)])
    assert tail[(0, 1)]["way"] == pytest.approx(0.55) and tail[(0, 1)]["way_p90"] == pytest.approx(0.91)
    rows = {(r["src"], r["dst"]): r for r in bh.edge_rows(hops, labels, None, sim)}
    assert rows[(0, 1)]["way_p50_ms"] == pytest.approx(0.3)
    assert rows[(0, 1)]["simulated_way_p50_ms"] == pytest.approx(0.4)
    assert rows[(0, 1)]["simulated_core_p50_ms"] == pytest.approx(0.2)
    assert rows[(0, 1)]["simulated_way_p90_ms"] == pytest.approx(0.4)
    assert rows[(0, 1)]["way_p90_ms"] >= rows[(0, 1)]["way_p50_ms"]
    assert math.isnan(rows[(2, 0)]["simulated_way_p50_ms"])  # an edge the simulation never used
    assert math.isnan(rows[(2, 0)]["simulated_way_p90_ms"])
    table = bh._table(list(rows.values()), False)
    assert "sim way" in table and "1.33x" in table and "s.core" in table and "sim p90" in table


def test_simulate_needs_a_level_a_calibration_and_the_benchs_plan(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _chain_traces(run / "trace")
    assert bh.main([str(run), "--simulate"]) == 2
    assert "--simulate needs --variant, --qps and a calibration" in capsys.readouterr().out
    h5py = pytest.importorskip("h5py")
    (run / "bench").mkdir()
    with h5py.File(run / "bench" / "requests.h5", "w") as f:
        f["split/qps_4/request_ids"] = [11, 12, 13]
    cal = Calibration.defaults().save(tmp_path / "calibration.json")
    args = [str(run), "--variant", "split", "--qps", "4", "--simulate", "--calibration", str(cal)]
    assert bh.main(args) == 2
    assert "needs the bench's configuration" in capsys.readouterr().out
    (run / "bench.cfg.json").write_text(json.dumps({"stage": "bench", "plan": str(tmp_path / "gone.json")}))
    assert bh.main(args) == 2
    assert "gone.json is not there" in capsys.readouterr().out


def test_spans_with_their_cpu_say_how_long_the_rank_waited_inside_them(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A span of 100 us wall in which the thread computed 40 us waited 60 us (for a core, where ranks share them);
    spans without a CPU figure (receives, traces of older versions) are left out; ``keep`` picks requests."""
    from hpcsplit.runtime import trace as trace_mod

    monkeypatch.setattr(trace_mod.time, "thread_time", lambda: 1.0)
    tr = Tracer(1, 0, 100, "stem")
    for q, (wall, cpu) in enumerate([(100e-6, 40e-6), (200e-6, 40e-6), (50e-6, 50e-6)]):
        tr.span("compute", q * 0.01, q * 0.01 + wall, [q], cpu0=tr.cpu() - cpu)
    tr.span("recv", 0.5, 0.6, [9], src=0)
    tr.span("send", 0.7, 0.8, [9])  # no cpu0: no CPU figure
    tr.write(tmp_path)
    rows = bh.span_rows(tmp_path)
    assert [(r["span"], r["n"]) for r in rows] == [("compute", 3)]
    assert rows[0]["wall_p50_us"] == pytest.approx(100.0) and rows[0]["cpu_p50_us"] == pytest.approx(40.0)
    assert rows[0]["waited_p50_us"] == pytest.approx(60.0)
    assert bh.span_rows(tmp_path, keep={1})[0]["waited_p50_us"] == pytest.approx(160.0)
    assert "waited p50" in bh._span_table(rows) and "rank 1 stem" in bh._span_table(rows)
