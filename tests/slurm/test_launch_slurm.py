"""The SLURM launch path for real: submitit on the dev cluster (slurm/dev-cluster.sh up), and sbatch.

Skipped only where there is no ``sbatch``.  Each test is bounded by a pytest timeout: a failed job
must be reported, never waited on forever.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcsplit.errors import LaunchError
from hpcsplit.launch import app as launch
from tests.conftest import compose_config

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        shutil.which("sbatch") is None, reason="no sbatch (start one: slurm/dev-cluster.sh up)"
    ),
]


def _dev_cfg(**slurm: object) -> dict:
    cfg = compose_config("stage=probe", "launcher=slurm", "cluster=dev")
    cfg["cluster"]["slurm"].update(slurm)
    return {k: cfg[k] for k in ("stage", "launcher", "cluster")}


def _rows(run: Path) -> list[dict]:
    return json.loads((run / "probe.mpi_main.result.json").read_text())


@pytest.mark.timeout(300)
def test_probe_through_submitit_four_ranks_each_own_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcsplit",
            "stage=probe",
            "launcher=slurm",
            "cluster=dev",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = _rows(tmp_path / "run")
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    assert {r["world_size"] for r in rows} == {4}  # one MPI world, not 4 singletons
    assert {r["slurm_ntasks"] for r in rows} == {4}
    assert len({r["slurm_job_id"] for r in rows}) == 1
    assert sorted(r["gpu"] for r in rows) == ["0", "1", "2", "3"]  # each rank its own (fake) GPU
    assert all(r["cuda_visible_devices"] for r in rows)
    assert {r["omp_wait_policy"] for r in rows} == {"PASSIVE"}  # setup lines reached the ranks
    # the login side showed progress, the job id, the table and where the logs are
    assert "submitted probe as SLURM job" in res.stdout
    assert "COMPLETED" in res.stdout and "elapsed" in res.stdout
    assert "4 rank(s) on 1 host(s)" in res.stdout
    assert "_log.{out,err}" in res.stdout


@pytest.mark.timeout(300)
def test_probe_sbatch_script(tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--parsable",
            f"--output={tmp_path}/slurm-%j.out",
            str(REPO / "slurm/probe.sbatch"),
            str(run),
        ],
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=280,
    )
    out = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert res.returncode == 0, res.stdout + res.stderr + out
    rows = _rows(run)
    assert {r["world_size"] for r in rows} == {4}
    assert sorted(r["gpu"] for r in rows) == ["0", "1", "2", "3"]
    assert "4 rank(s) on 1 host(s)" in out


def _failing(entry: str, tmp_path: Path, ranks: int = 4, **slurm: object) -> tuple[str, float, list[str]]:
    lines: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as err:
        launch.run_mpi(entry, _dev_cfg(**slurm), tmp_path, "probe", ranks, echo=lines.append)
    return str(err.value), time.monotonic() - t0, lines


@pytest.mark.timeout(150)
def test_rank_exception_on_the_cluster_is_reported(tmp_path: Path) -> None:
    msg, elapsed, lines = _failing("hpcsplit.launch.probe:_raise_for_tests", tmp_path)
    print(f"exception reported after {elapsed:.1f} s")
    assert "ended FAILED" in msg
    assert "[rank 3] RuntimeError: deliberate failure on rank 3" in msg
    assert str(tmp_path / "slurm") in msg  # where the logs are
    assert any("submitted probe as SLURM job" in x for x in lines)


@pytest.mark.timeout(150)
def test_killed_rank_on_the_cluster_is_reported(tmp_path: Path) -> None:
    msg, elapsed, _ = _failing("hpcsplit.launch.probe:_crash_for_tests", tmp_path)
    print(f"kill reported after {elapsed:.1f} s")
    assert "ended FAILED" in msg and "without a result" in msg
    assert "task 3: Killed" in msg  # srun's word for the SIGKILLed rank


@pytest.mark.timeout(150)
def test_srun_without_pmi_fails_the_world_size_check(tmp_path: Path) -> None:
    msg, _, _ = _failing("hpcsplit.launch.probe:mpi_main", tmp_path, ranks=2, srun_mpi="none", setup=[])
    assert "WorldSizeError: MPI world size is 1 but SLURM started 2 tasks" in msg


@pytest.mark.timeout(150)
def test_sbatch_refusal_is_a_launch_error(tmp_path: Path) -> None:
    msg, _, _ = _failing("hpcsplit.launch.probe:mpi_main", tmp_path, ranks=1, partition="no_such_partition")
    assert "sbatch refused" in msg and "no_such_partition" in msg


@pytest.mark.timeout(300)
def test_hydra_submitit_slurm_launcher_runs_main_in_a_job(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcsplit",
            "-m",
            "hydra/launcher=slurm_dev",
            "cluster=dev",  # the preset reads its SLURM block from cluster.slurm
            "stage=probe",
            "launcher.ranks=2",
            f"hydra.sweep.dir={sweep}",
        ],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads((sweep / "0" / "probe.mpi_main.result.json").read_text())
    assert {r["world_size"] for r in rows} == {2}  # mpiexec inside the job, not srun's 1-task step
    assert {r["cpus_per_task"] for r in rows} == {4}  # slurm_dev.yaml: cluster=dev's 4 tasks x 1 cpu
    assert {r["slurm_job_id"] for r in rows} != {None}
