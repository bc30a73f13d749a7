"""The sbatch script submitit writes for the Perlmutter-like preset, against a recorded copy.

Re-record after an intended change:  HPCSPLIT_RECORD_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_sbatch_golden.py
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.launch import slurm as _slurm
from hpcsplit.launch.config import validate

RECORD = Path(__file__).parent / "data" / "sbatch_perlmutter_profile.txt"


@pytest.fixture
def perlmutter(compose: Callable[..., dict[str, Any]]) -> ClusterSpec:
    cfg = compose("stage=profile", "launcher=slurm", "cluster=perlmutter", "cluster.slurm.account=m1234")
    validate(cfg)
    return ClusterSpec.from_config(cfg["cluster"])


def test_perlmutter_sbatch_text_matches_record(perlmutter: ClusterSpec) -> None:
    text = _slurm.sbatch_text(perlmutter, "profile", None, "/pscratch/run/slurm", python="python")
    if os.environ.get("HPCSPLIT_RECORD_GOLDEN"):
        RECORD.write_text(text)
    assert text == RECORD.read_text()


def test_perlmutter_sbatch_has_the_options_that_matter(perlmutter: ClusterSpec) -> None:
    text = _slurm.sbatch_text(perlmutter, "profile", None, "/pscratch/run/slurm", python="python")
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --account=m1234",
        "#SBATCH --qos=regular",
        "#SBATCH --constraint=gpu",
        "#SBATCH --time=30",
        "export SLURM_MPI_TYPE=pmi2",
    ):
        assert line in text.splitlines(), line
    srun = next(x for x in text.splitlines() if x.startswith("srun "))
    assert "--mpi=pmi2" in srun and "--kill-on-bad-exit=1" in srun
    assert "#SBATCH --partition" not in text  # null keys are left out


def test_uneven_rank_count_sets_ntasks(perlmutter: ClusterSpec) -> None:
    text = _slurm.sbatch_text(perlmutter, "serve", 7, "/x", python="python")
    assert "#SBATCH --ntasks=7" in text and "#SBATCH --ntasks-per-node=4" in text
