"""Batch inference as a plain sbatch job (``slurm/infer.sbatch``) on the dev SLURM: a job sent USR2 (what
``--signal=USR2@60`` sends before the time limit, or a preemption) flushes, requeues itself and finishes
from the rows already done, each row committed once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.slurm.test_profile_slurm import _job_state

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch on PATH (no SLURM here)"),
]

REPO = Path(__file__).resolve().parents[2]
N = 30_000
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def test_usr2_requeues_and_continues_from_the_rows_done(tmp_path: Path, switchboards: Callable[..., Path]) -> None:
    h5py = pytest.importorskip("h5py")
    torch = pytest.importorskip("torch")
    from hpcsplit.core.plan import Plan, RankEntry
    from hpcsplit.switchboard.reader import Switchboard

    sb_dir = switchboards("toy_mlp", stages=2, max_branches=2)
    sb = Switchboard.load(sb_dir)
    run = tmp_path / "run"
    run.mkdir()
    (run / "switchboard").symlink_to(sb_dir)
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    ranks += [RankEntry(k + 1, "component", 0, None, None, 1, c, 32, 0) for k, c in enumerate(sb.order)]
    Plan(sb.model_name, sb.sha256, "cpu", 1, tuple(ranks), dict.fromkeys(sb.order, 0.0), {}).save(run / "plan.json")
    (spec,) = sb.layout.inputs
    x = np.random.default_rng(3).standard_normal((N, *spec.shape[1:])).astype(np.float32)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset(spec.name, data=x, chunks=(4096, x.shape[1]))
    log = run / "job.out"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HPCSPLIT_PYTHON=sys.executable,
               HPCSPLIT_ROOT=str(REPO))
    sub = subprocess.run(
        ["sbatch", "--parsable", f"--ntasks={len(ranks)}", "--time=10", f"--output={log}", str(REPO / "slurm/infer.sbatch"),
         str(run), f"runtime.input_path={tmp_path / 'in.h5'}", f"runtime.output_path={tmp_path / 'out.h5'}",
         "runtime.progress_s=1", "runtime.max_inflight=256", "runtime.chunk_rows=8192"],
        cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        queued = time.monotonic() + 900  # a shared dev cluster may run other jobs first
        while time.monotonic() < queued and _job_state(int(job)) == "PENDING":
            time.sleep(1)
        deadline = time.monotonic() + 400
        prog = run / "batch-progress.txt"
        while time.monotonic() < deadline:
            text = prog.read_text() if prog.exists() else ""
            if text and int(text.split("batch progress: ")[1].split("/")[0]) >= N // 5:
                break
            assert _job_state(int(job)) not in FINISHED, log.read_text() if log.exists() else "no log"
            time.sleep(0.5)
        subprocess.run(["scancel", "--signal=USR2", job], check=True)  # as --signal=USR2@60 would
        deadline = time.monotonic() + 300  # the requeue, SLURM's hold, and the second run
        released = False
        while time.monotonic() < deadline:
            state = _job_state(int(job))
            text = log.read_text() if log.exists() else ""
            if state == "PENDING" and "requeueing job" in text and not released:
                # SLURM holds a requeued job ~2 minutes (BeginTime); let it start now
                subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=False)
                released = True
            if state in FINISHED and "restart 1" in text:
                break
            time.sleep(1)
    finally:
        if _job_state(int(job)) not in FINISHED:
            subprocess.run(["scancel", job], check=False)
    text = log.read_text()
    state = _job_state(int(job))
    text += f"\n[test] job state at the end: {state}\n" + subprocess.run(
        ["scontrol", "show", "job", job], check=False, capture_output=True, text=True).stdout
    assert "SIGUSR2 received" in text and "requeueing job" in text, text[-3000:]
    assert "restart 1" in text and "[infer.sbatch] every row done" in text, text[-3000:]
    s = json.loads((run / "runtime.mpi_main.result.json").read_text())["variants"]["split"]
    print(f"\nUSR2 then requeue: {s['kept']} of {N} rows kept from the first run, {s['served']} served after it")
    assert s["kept"] > 0 and s["kept"] + s["served"] == N
    whole = sb.load_whole()
    with torch.no_grad():
        ref = whole(torch.from_numpy(x))[0].numpy()
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert f["done"][()].all() and (f["done_count"][()] == 1).all()
        np.testing.assert_allclose(f["output"][()], ref, rtol=1e-4, atol=1e-5)
