"""The profile stage on a real SLURM (the dev cluster: slurm/dev-cluster.sh up).

Through submitit (the launch layer, ``hpcsplit.launch.slurm``) and through ``slurm/profile.sbatch``; a job
that fails on the cluster surfaces its error on the login side; a job warned with USR2 (SLURM's
signal before the time limit) flushes, requeues itself and finishes the profile.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpcsplit.core.profile_format import read_profile
from hpcsplit.core.settings import group_defaults
from hpcsplit.errors import LaunchError
from tests.conftest import compose_config

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch on PATH (no SLURM here)"),
]

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "slurm" / "profile.sbatch"
TOY_ENTRY = "tests.unit.profile_toys:mpi_main"
PROFILE = {**group_defaults("profile"), "batch_sizes": [1, 2, 4], "threads": [1, 2], "warmup": 1, "iters": 3}


def _cfg(**extra: Any) -> dict[str, Any]:
    cluster = compose_config("cluster=dev")["cluster"]
    cluster["cores_per_node"] = 2
    cluster["slurm"]["time_min"] = 10
    return {
        "profile": dict(PROFILE),
        "cluster": cluster,
        "launcher": {"name": "slurm", "timeout_min": 15, "poll_s": 1, "poll_max_s": 3, "progress_s": 30},
        "paths": {"profile_filename": "profile.h5", "switchboard_dirname": "switchboard"},
        **extra,
    }


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jobs import the package (and the toy entry point in tests/) from the submission folder."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def toy_switchboard(switchboards: Callable[..., Path]) -> Path:
    return switchboards("toy_mlp", dims=(16, 32, 4))


# ------------------------------------------------------------------------------------------- submitit


def test_submitit_profile_job(tmp_path: Path, in_repo: None, toy_switchboard: Path) -> None:
    from hpcsplit.launch import slurm as _slurm

    cfg = _cfg(switchboard=str(toy_switchboard))
    res = _slurm.run_mpi_slurm("hpcsplit.profiling.stage:mpi_main", cfg, tmp_path, "profile", ranks=2)
    assert res["complete"] and res["ranks"] == 2
    prof = read_profile(tmp_path / "profile.h5")
    assert prof.complete and len(prof.components) > 2


def test_submitit_failing_job_surfaces_its_error(tmp_path: Path, in_repo: None) -> None:
    from hpcsplit.launch import slurm as _slurm

    cfg = _cfg(toy={"fail_on": "head"})
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as ei:
        _slurm.run_mpi_slurm(TOY_ENTRY, cfg, tmp_path, "profile", ranks=2)
    assert "component head is broken (toy)" in str(ei.value)
    assert time.monotonic() - t0 < 600  # reported, not hung until the time limit


# -------------------------------------------------------------------------------------- plain sbatch


def _sbatch(
    run_dir: Path, *args: str, wait: bool = True, env: dict[str, str] | None = None
) -> tuple[int, str]:
    out = run_dir / "job.out"
    cmd = ["sbatch", "--parsable", "--ntasks=2", "--time=10", f"--output={out}"]
    cmd += ["--wait"] if wait else []
    res = subprocess.run(
        [*cmd, str(SBATCH), str(run_dir), *args],
        check=False,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )
    job_id = res.stdout.strip().split(";")[0]
    if not wait:
        assert res.returncode == 0, res.stderr
        return int(job_id), ""
    return res.returncode, out.read_text() if out.exists() else res.stderr


def test_sbatch_script_profiles(tmp_path: Path, in_repo: None, toy_switchboard: Path) -> None:
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(_cfg(switchboard=str(toy_switchboard))))
    rc, log = _sbatch(tmp_path, str(cfg_path))
    assert rc == 0, log
    assert "[profile.sbatch] profile complete" in log
    prof = read_profile(tmp_path / "profile.h5")
    assert prof.complete
    ranks = {int(r) for c in prof.components.values() for r in c.measured_by_rank.ravel()}
    assert ranks == {0, 1}


def test_sbatch_failing_job_surfaces_its_error(tmp_path: Path, in_repo: None) -> None:
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(_cfg(toy={"fail_on": "enc"})))
    rc, log = _sbatch(tmp_path, str(cfg_path), env={"HPCSPLIT_PROFILE_ENTRY": TOY_ENTRY})
    assert rc != 0
    assert "component enc is broken (toy)" in log and "[profile.sbatch] FAILED" in log


def _job_state(job_id: int) -> str:
    """squeue while queued or running, then scontrol (kept MinJobAge), then sacct (last run's state)."""
    q = subprocess.run(
        ["squeue", "-h", "-j", str(job_id), "-o", "%T"], check=False, capture_output=True, text=True
    )
    if q.stdout.strip():
        return q.stdout.strip()
    c = subprocess.run(["scontrol", "show", "job", str(job_id)], check=False, capture_output=True, text=True)
    for word in c.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    a = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "State"],
        check=False,
        capture_output=True,
        text=True,
    )
    lines = a.stdout.split()  # a requeued job has one line per run: REQUEUED, then the last state
    return lines[-1] if lines else "UNKNOWN"


@pytest.mark.slow
def test_sbatch_usr2_flushes_requeues_and_finishes(tmp_path: Path, in_repo: None) -> None:
    cfg = _cfg(toy={"sleep_s": 0.1})
    cfg["profile"]["batch_sizes"] = [1, 2, 4, 8]
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    job_id, _ = _sbatch(tmp_path, str(cfg_path), wait=False, env={"HPCSPLIT_PROFILE_ENTRY": TOY_ENTRY})
    log = tmp_path / "job.out"
    deadline = time.monotonic() + 600  # SLURM holds a requeued batch job about 2 minutes (BeginTime)
    while time.monotonic() < deadline and "profile 2/" not in (log.read_text() if log.exists() else ""):
        time.sleep(1)
    # what SLURM sends before the time limit (--signal=USR2@120), to every rank of the step
    subprocess.run(["scancel", "--signal=USR2", str(job_id)], check=True)
    while time.monotonic() < deadline:
        text = log.read_text()
        if _job_state(job_id) in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"} and "restart 1" in text:
            break
        time.sleep(2)
    text = log.read_text()
    assert "got SIGUSR2" in text and "requeueing job" in text, text
    assert "restart 1" in text and "[profile.sbatch] profile complete" in text, text
    prof = read_profile(tmp_path / "profile.h5")
    assert prof.complete
