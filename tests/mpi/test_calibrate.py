"""``stage=calibrate`` under real ``mpiexec``: the runtime's own loops measured, a valid ``calibration.json``
written, and the simulator reproducing the calibration's own chains through the runtime's frontend."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

MPIEXEC = shutil.which("mpiexec") or (shutil.which("mpiexec", path=str(Path(sys.executable).parent)))
if MPIEXEC is None:  # pragma: no cover
    pytest.skip("no mpiexec on PATH", allow_module_level=True)

QUICK = {"gaps_ms": [0.2, 2, 20], "chain_gaps_ms": [2, 20], "samples": 5, "max_gap_time_s": 1.0, "settle_s": 0.2,
         "sizes_bytes": [64, 262144], "saturation_requests": 300, "threads": [1], "programs": False}


def test_a_short_calibration_writes_a_file_every_reader_takes(tmp_path: Path) -> None:
    from hpcsplit.core.calibration import load_calibration
    from hpcsplit.core.settings import group_defaults

    cfg = {"stage": "calibrate", "calibrate": QUICK, "cluster": group_defaults("cluster", "local"), "runtime": {}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    cmd = [MPIEXEC, "-n", "3", sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank",
           "hpcsplit.launch.calibrate:mpi_main", str(tmp_path / "cfg.json"), str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False,
                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    cal = load_calibration(tmp_path / "run" / "calibration.json")
    assert cal.measured and cal.hosts and cal.cross_node is None  # one node
    assert cal.hop.gaps_ms[0] == 0.0 and len(cal.hop.gaps_ms) >= 3 and all(v > 0 for v in cal.hop.values_ms)
    assert 0 < cal.same_node.gb_s < 1e4 and cal.component_us_per_message > 0 and cal.frontend_us_per_request >= 0
    assert cal.compute_gflops[1] > 0 and cal.corun_slowdown[0] == 1.0
    raw = json.loads((tmp_path / "run" / "calibration.raw.json").read_text())
    assert {"pingpong", "one", "two", "saturation b1", "saturation b32", "turns"} <= set(raw["chains"])
    # one request in flight: an admitting pass and an answering pass each (now and then, on a busy machine, a pass
    # takes an answer and admits the next request at once: 594 passes for 300 requests was seen)
    turns = raw["chains"]["turns"]["turns"]
    n = turns["requests"]
    assert n > 0 and 2 * n - max(2, n // 25) <= turns["turns"] <= 2 * n + 2
    assert turns["turn_cpu_s"] > 0 and raw["chains"]["saturation b1"]["saturation"]["turns"] > 0
    one_way = raw["chains"]["pingpong"]["gap 20"]["one_way_ms"]
    assert len(one_way) >= 3 and np.isfinite(one_way).all()  # the replica's stamp: one clock on one node
    # [Note: settled gaps]: each gap's settling requests run (the replica served them) and are not counted
    from hpcsplit.launch.calibrate_run import settle_requests

    pp = raw["chains"]["pingpong"]
    counted = {g: len(pp[f"gap {g:g}"]["one_way_ms"]) for g in QUICK["gaps_ms"]}
    assert counted == {0.2: 5, 2: 5, 20: 5}  # samples, at most max_gap_time_s worth
    served = 5 * len(QUICK["sizes_bytes"]) + sum(counted.values())  # 5 unrecorded before each size's samples
    served += len(QUICK["sizes_bytes"]) * QUICK["samples"] + sum(settle_requests(0.2, g) for g in QUICK["gaps_ms"])
    assert pp["component"]["requests"] == served
    for g in QUICK["chain_gaps_ms"]:
        assert len(raw["chains"]["one"][f"gap {g:g}"]["pipe_ms"]) == QUICK["samples"]
    # ... and the frontend chain's: 5 first requests, then per gap its samples after at least 2 that settle it
    chain = 5 + sum(QUICK["samples"] + max(2, settle_requests(0.2, g)) for g in QUICK["chain_gaps_ms"])
    assert raw["chains"]["one"]["component"]["requests"] == chain
    cpu = raw["chains"]["pingpong"]["gap 20"]["cpu_ms"]  # ... and its process's CPU: never runs backwards
    assert len(cpu) >= 3 and np.all(np.diff(cpu) >= 0)
    # an idle gap costs CPU (at least the spin after work), more the longer it is
    idle = cal.idle_cpu
    assert idle.at(20.0) > 0 and all(b >= a for a, b in zip(idle.values_ms, idle.values_ms[1:], strict=False))
    # [Note: evicted caches]: rank 0 and a peer pinned to one of rank 0's cores; a turn after the peer's, and warm
    shared = raw["shared_core"]
    if shared is None:  # a machine whose ranks cannot share one core: said, and no figures
        assert "no shared-core figures" in p.stderr and cal.evicted_us_per_turn == 0.0
    else:
        assert shared["core"] in os.sched_getaffinity(0) and shared["programs"] == {}  # (no switchboard here)
        for what in ("turn", "wake"):  # (a turn with no program, an idle rank's wake-up: SHORT_RUNS pairs each)
            pairs = shared[what]
            assert len(pairs["evicted_ms"]) == len(pairs["warm_ms"]) >= 25 and min(pairs["warm_ms"]) > 0
        wake = np.subtract(shared["wake"]["evicted_ms"], shared["wake"]["warm_ms"])  # the file holds their median
        assert cal.evicted_us_per_wake == pytest.approx(max(0.0, float(np.median(wake))) * 1e3)
    # [Note: stacked wake-ups]: rank 0 rang a peer asleep on its doorbell; on which core it woke, per ring
    from hpcsplit.launch.calibrate_run import PLACEMENT_RINGS, _cpu_reader

    placed = raw.get("placement")
    if _cpu_reader() is None:  # (no sched_getcpu here: the step does not run)
        assert placed is None and cal.wake_on_ringer_core is None
    else:
        assert 0 < len(placed["same_core"]) == len(placed["woke_us"]) <= PLACEMENT_RINGS
        assert min(placed["woke_us"]) > 0
        assert cal.wake_on_ringer_core == pytest.approx(float(np.mean(placed["same_core"])))
        assert "doorbell wake-ups (of 40 rings) ran on the core of the rank that rang" in p.stderr
    assert "calibration written to" in p.stderr
