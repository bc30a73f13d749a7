"""``python -m hpcsplit stage=probe`` on real local MPI ranks, and failing ranks through the launch layer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpcsplit.errors import LaunchError
from hpcsplit.launch import app as launch

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(
        shutil.which("mpiexec") is None and not (Path(sys.executable).parent / "mpiexec").exists(),
        reason="no mpiexec",
    ),
]


def _cli(
    tmp_path: Path, *overrides: str, multirun: bool = False, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
    flags = ["-m"] if multirun else []  # Hydra's flags go before the overrides
    return subprocess.run(
        [sys.executable, "-m", "hpcsplit", *flags, f"hydra.run.dir={tmp_path / 'run'}", *overrides],
        check=False,
        cwd=tmp_path,  # not the repo: conf/ must be found from anywhere
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("ranks", [1, 3])
def test_probe_cli_gathers_one_row_per_rank(tmp_path: Path, ranks: int) -> None:
    res = _cli(tmp_path, "stage=probe", f"launcher.ranks={ranks}")
    assert res.returncode == 0, res.stdout + res.stderr
    run = tmp_path / "run"
    rows = json.loads((run / "probe.mpi_main.result.json").read_text())
    assert [r["rank"] for r in rows] == list(range(ranks))
    assert {r["world_size"] for r in rows} == {ranks}
    assert len({r["pid"] for r in rows}) == ranks  # separate processes, not one rank repeated
    assert all(r["mpi_library"] for r in rows)
    assert all(r["torch_threads"] >= 1 for r in rows)
    # one table, printed once by rank 0, also saved
    assert res.stdout.count("MPI library") == 1
    assert f"{ranks} rank(s) on 1 host(s)" in res.stdout
    assert (run / "probe.txt").read_text().startswith("host")
    summary = json.loads((run / "launch.json").read_text())
    assert summary["stage"] == "probe" and summary["launcher"] == "local"
    assert str(run.resolve()) in res.stdout  # says where the outputs are


def _local_cfg() -> dict:
    return {
        "stage": "probe",
        "launcher": yaml.safe_load((REPO / "conf/launcher/local.yaml").read_text()),
        "cluster": yaml.safe_load((REPO / "conf/cluster/local.yaml").read_text()),
    }


def test_rank_exception_is_reported_with_its_message(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as err:
        launch.run_mpi(
            "hpcsplit.launch.probe:_raise_for_tests", _local_cfg(), tmp_path, "probe", 2, echo=lambda s: None
        )
    msg = str(err.value)
    assert "[rank 1] RuntimeError: deliberate failure on rank 1" in msg
    assert "exited with code" in msg and str(tmp_path / "probe.log") in msg


def test_killed_rank_ends_the_job_instead_of_hanging(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as err:
        launch.run_mpi(
            "hpcsplit.launch.probe:_crash_for_tests", _local_cfg(), tmp_path, "probe", 3, echo=lambda s: None
        )
    assert "exited with code" in str(err.value)
    assert not (tmp_path / "probe._crash_for_tests.result.json").exists()


def test_local_timeout_kills_the_ranks(tmp_path: Path) -> None:
    cfg = _local_cfg()
    cfg["launcher"]["timeout_min"] = 0.05  # 3 s: the hanging barrier below never returns
    with pytest.raises(LaunchError, match="ran past launcher.timeout_min"):
        launch.run_mpi("hpcsplit.launch.probe:_hang_for_tests", cfg, tmp_path, "probe", 2, echo=lambda s: None)


def test_hydra_submitit_local_sweep_runs_main_per_point(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    res = _cli(
        tmp_path,
        "hydra/launcher=local",
        "stage=probe",
        "launcher.ranks=1,2",
        f"hydra.sweep.dir={sweep}",
        multirun=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    worlds = [
        {r["world_size"] for r in json.loads((sweep / str(i) / "probe.mpi_main.result.json").read_text())}
        for i in (0, 1)
    ]
    assert worlds == [{1}, {2}]
