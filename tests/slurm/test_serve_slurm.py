"""The serve stage through the dev SLURM cluster (``srun --mpi=pmi2`` via submitit): same outputs as mpiexec."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import compose_config

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch on PATH (no SLURM here)"),
]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def test_serve_under_srun_matches_whole_model(tmp_path: Path, in_repo: None,
                                             switchboards: Callable[..., Path]) -> None:
    pytest.importorskip("hpcsplit.switchboard.reader")
    from hpcsplit.launch import slurm as _slurm
    from tests.mpi.test_serve import _inputs, _last, _plan, _read, _whole_per_request

    sb_dir = switchboards("toy_mlp", stages=2, max_branches=2)
    n = _plan(sb_dir, tmp_path / "plan.json", replicas={_last(sb_dir): 2}, batch=2)
    inputs = _inputs(sb_dir, 9, tmp_path / "in.npz")
    cluster = compose_config("cluster=dev")["cluster"]
    cluster["cores_per_node"] = 2
    cluster["slurm"]["time_min"] = 10
    cfg = {
        "stage": "serve",
        "plan": str(tmp_path / "plan.json"),
        "switchboard": str(sb_dir),
        "runtime": {"input_path": str(tmp_path / "in.npz"), "output_path": str(tmp_path / "out.npz")},
        "cluster": cluster,
        "launcher": {"name": "slurm", "timeout_min": 10, "poll_s": 1, "poll_max_s": 3, "progress_s": 30},
        "paths": {"plan_filename": "plan.json", "switchboard_dirname": "switchboard"},
    }
    res = _slurm.run_mpi_slurm("hpcsplit.runtime.stage:mpi_main", cfg, tmp_path / "run", "serve", ranks=n)
    assert res["world_size"] == n
    assert "OMP_WAIT_POLICY=PASSIVE" in res["threads"] and "imported before" not in res["threads"]
    assert res["variants"]["split"]["done"] == 9
    out = _read(tmp_path / "out.npz")
    assert out["done"].all()
    np.testing.assert_allclose(out["output"], _whole_per_request(sb_dir, inputs)[0], rtol=1e-4, atol=1e-5)
