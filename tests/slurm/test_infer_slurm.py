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
from typing import Any

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
# Both requeue tests send USR2 once a twentieth of the rows is done, and run slowly enough (batch 4, at
# most 32 requests in flight: a few thousand rows a second) for it to land while most rows are still to
# serve: at batch 32 with 256 in flight a fast machine served all N rows in 2.5 s, before the signal came.
SIGNAL_AT = N // 20
SLOW_RUN = ("runtime.progress_s=0.2", "runtime.max_inflight=32", "runtime.chunk_rows=2048")


def _rows_done(run: Path) -> int:
    """Rows done so far, from the job's progress file (0 before its first line)."""
    prog = run / "batch-progress.txt"
    text = prog.read_text() if prog.exists() else ""
    return int(text.split("batch progress: ")[1].split("/")[0]) if text else 0


def _check_resumed(run: Path, sb: Any, x: np.ndarray, out: Path, what: str) -> None:
    """Rows kept from the first run plus rows served after it make the whole input, each committed once,
    and the outputs equal the whole model's."""
    h5py = pytest.importorskip("h5py")
    torch = pytest.importorskip("torch")
    s = json.loads((run / "runtime.mpi_main.result.json").read_text())["variants"]["split"]
    print(f"\n{what}: {s['kept']} of {N} rows kept from the first run, {s['served']} served after it")
    assert s["kept"] > 0 and s["kept"] + s["served"] == N
    with torch.no_grad():
        ref = sb.load_whole()(torch.from_numpy(x))[0].numpy()
    with h5py.File(out, "r") as f:
        assert f["done"][()].all() and (f["done_count"][()] == 1).all()
        np.testing.assert_allclose(f["output"][()], ref, rtol=1e-4, atol=1e-5)


def _release(job: str) -> None:
    """Start a requeued job now instead of after SLURM's hold (~2 minutes, BeginTime).

    Not in the same second as the first run ended: slurmd revokes the job's credential when it ends, and
    refuses a launch whose credential is not newer than that, by whole seconds ("Killing non-startable
    batch JobId=N: Job credential revoked", the job then FAILED at once).  The hold exists for this.
    """
    time.sleep(2.0)
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=False)


def _requeue_case(tmp_path: Path, switchboards: Callable[..., Path], seed: int,
                  batch: int) -> tuple[Path, Any, Path, int, np.ndarray]:
    """The toy switchboard (linked into a run folder), its plan (``batch`` per rank) and ``N`` random rows in
    ``tmp_path/in.h5``: ``(switchboard dir, switchboard, run folder, world size, rows)``."""
    h5py = pytest.importorskip("h5py")
    pytest.importorskip("torch")
    from hpcsplit.switchboard.reader import Switchboard
    from tests.mpi.test_serve import _plan

    sb_dir = switchboards("toy_mlp", stages=2, max_branches=2)
    sb = Switchboard.load(sb_dir)
    run = tmp_path / "run"
    run.mkdir()
    (run / "switchboard").symlink_to(sb_dir)
    world = _plan(sb_dir, run / "plan.json", batch=batch)
    (spec,) = sb.layout.inputs
    x = np.random.default_rng(seed).standard_normal((N, *spec.shape[1:])).astype(np.float32)
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset(spec.name, data=x, chunks=(4096, x.shape[1]))
    return sb_dir, sb, run, world, x


def test_usr2_requeues_and_continues_from_the_rows_done(tmp_path: Path, switchboards: Callable[..., Path]) -> None:
    _, sb, run, world, x = _requeue_case(tmp_path, switchboards, seed=3, batch=4)
    log = run / "job.out"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HPCSPLIT_PYTHON=sys.executable,
               HPCSPLIT_ROOT=str(REPO))
    sub = subprocess.run(
        ["sbatch", "--parsable", f"--ntasks={world}", "--time=10", f"--output={log}", str(REPO / "slurm/infer.sbatch"),
         str(run), f"runtime.input_path={tmp_path / 'in.h5'}", f"runtime.output_path={tmp_path / 'out.h5'}",
         *SLOW_RUN],
        cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    signalled_at = 0
    try:
        queued = time.monotonic() + 900  # a shared dev cluster may run other jobs first
        while time.monotonic() < queued and _job_state(int(job)) == "PENDING":
            time.sleep(1)
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            if (signalled_at := _rows_done(run)) >= SIGNAL_AT:
                break
            assert _job_state(int(job)) not in FINISHED, log.read_text() if log.exists() else "no log"
            time.sleep(0.1)
        subprocess.run(["scancel", "--signal=USR2", job], check=True)  # as --signal=USR2@60 would
        print(f"\nUSR2 sent with {signalled_at} of {N} rows done")
        deadline = time.monotonic() + 300  # the requeue, SLURM's hold, and the second run
        released = False
        while time.monotonic() < deadline:
            state = _job_state(int(job))
            text = log.read_text() if log.exists() else ""
            if state == "PENDING" and "requeueing job" in text and not released:
                _release(job)
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
    _check_resumed(run, sb, x, tmp_path / "out.h5", "USR2 then requeue")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_submitit_batch_job_usr2_requeues_and_continues(tmp_path: Path, switchboards: Callable[..., Path]) -> None:
    """``stage=serve runtime.mode=batch launcher=slurm``: USR2 (submitit's timeout warning, a preemption) makes
    rank 0 flush and hand over to submitit, which requeues the same call; the login side keeps waiting and
    the requeued job serves only the rows not done."""
    import re

    sb_dir, sb, run, _, x = _requeue_case(tmp_path, switchboards, seed=4, batch=4)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcsplit", "stage=serve", "runtime.mode=batch", "launcher=slurm", "cluster=dev",
         "launcher.poll_s=1", "launcher.poll_max_s=2", f"plan={run / 'plan.json'}", f"switchboard={sb_dir}",
         f"runtime.input_path={tmp_path / 'in.h5'}", f"runtime.output_path={tmp_path / 'out.h5'}",
         *SLOW_RUN, f"hydra.run.dir={run}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job = None
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            logs = sorted((run / "slurm").glob("*_0_log.out")) if (run / "slurm").exists() else []
            if logs and job is None:
                job = re.match(r"(\d+)_", logs[0].name).group(1)  # type: ignore[union-attr]
            if job and _rows_done(run) >= SIGNAL_AT:
                break
            time.sleep(0.1)
        assert job is not None and proc.poll() is None, proc.communicate(timeout=60)[0][-3000:]
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        released = False
        while time.monotonic() < deadline and proc.poll() is None:
            if not released and _job_state(int(job)) == "PENDING":
                _release(job)
                released = True
            time.sleep(1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if job is not None and _job_state(int(job)) not in FINISHED:
            subprocess.run(["scancel", job], check=False)
    logs = "".join(p.read_text(errors="replace") for p in sorted((run / "slurm").glob(f"{job}_*_log.*")))
    assert proc.returncode == 0, (out + logs)[-4000:]
    assert "submitit requeues the job" in logs and "rows done already (kept)" in logs, logs[-3000:]
    _check_resumed(run, sb, x, tmp_path / "out.h5", "submitit USR2 then requeue")
