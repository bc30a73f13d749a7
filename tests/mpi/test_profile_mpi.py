"""The profile stage on real MPI ranks (``mpiexec`` subprocesses with a timeout)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from hpcsplit.core.profile_format import read_profile
from hpcsplit.core.settings import group_defaults
from hpcsplit.errors import ProfileFormatError

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec on PATH"),
]

REPO = Path(__file__).resolve().parents[2]
CFG = {
    "profile": {**group_defaults("profile"), "batch_sizes": [1, 2, 4], "threads": [1, 2], "warmup": 1, "iters": 3,
                "progress": True},
    "cluster": {"cores_per_node": 2},
}


def _cmd(n: int, entry: str, cfg_path: Path, run_dir: Path) -> list[str]:
    return ["mpiexec", "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank", entry,
            str(cfg_path), str(run_dir)]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def _run(
    n: int, run_dir: Path, cfg: dict, entry: str = "tests.unit.profile_toys:mpi_main", timeout: float = 180
):
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    return subprocess.run(
        _cmd(n, entry, cfg_path, run_dir),
        check=False,
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _start_toys(run_dir: Path, cfg: dict) -> subprocess.Popen[str]:
    """The toy profile on 2 ranks in the background, its output on one pipe."""
    (run_dir / "cfg.json").write_text(json.dumps(cfg))
    return subprocess.Popen(
        _cmd(2, "tests.unit.profile_toys:mpi_main", run_dir / "cfg.json", run_dir),
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def toy_switchboard(switchboards: Callable[..., Path]) -> Path:
    return switchboards("toy_mlp", dims=(16, 32, 4))


def test_two_ranks_merge_into_one_file_equal_in_cells_to_one_rank(
    tmp_path: Path, toy_switchboard: Path
) -> None:
    cfg = {**CFG, "switchboard": str(toy_switchboard)}
    entry = "hpcsplit.profiling.stage:mpi_main"
    one = _run(1, tmp_path / "n1", cfg, entry)
    assert one.returncode == 0, one.stdout + one.stderr
    two = _run(2, tmp_path / "n2", cfg, entry)
    assert two.returncode == 0, two.stdout + two.stderr
    p1, p2 = read_profile(tmp_path / "n1/profile.h5"), read_profile(tmp_path / "n2/profile.h5")
    assert p1.complete and p2.complete
    assert p1.meta.component_order == p2.meta.component_order and len(p1.components) > 2
    assert p1.meta.switchboard_sha256 == p2.meta.switchboard_sha256
    for name, c1 in p1.components.items():
        c2 = p2.components[name]
        assert c1.batch_sizes == c2.batch_sizes and c1.slices == c2.slices
        assert c1.latency_ms.shape == c2.latency_ms.shape
        assert (c1.measured == c2.measured).all() and (c1.oom == c2.oom).all()
        assert np.isfinite(c2.latency_ms).all()
        assert (c1.input_bytes == c2.input_bytes).all() and (c1.output_bytes == c2.output_bytes).all()
        assert c1.param_bytes == c2.param_bytes
    ranks = np.concatenate([c.measured_by_rank.ravel() for c in p2.components.values()])
    assert set(ranks.tolist()) == {0, 1}  # both ranks measured cells
    assert not list((tmp_path / "n2").glob("profile.h5.part*"))  # parts merged and removed
    summary = json.loads((tmp_path / "n2/profiling.mpi_main.result.json").read_text())
    assert summary["complete"] and summary["ranks"] == 2
    assert summary["cells_total"] == len(p1.components) * 3 * 2


def test_two_ranks_sigterm_then_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = {**CFG, "toy": {"sleep_s": 0.05}, "profile": {**CFG["profile"], "batch_sizes": [1, 2, 4, 8]}}
    proc = _start_toys(run_dir, cfg)
    lines, deadline = [], time.monotonic() + 120
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if not line or "profile 2/" in line:
            break
    os.killpg(proc.pid, signal.SIGTERM)  # like SLURM signalling every task of the step
    out, _ = proc.communicate(timeout=120)
    text = "".join(lines) + out
    with pytest.raises(ProfileFormatError, match="did not finish"):
        read_profile(run_dir / "profile.h5")
    part = read_profile(run_dir / "profile.h5", allow_incomplete=True)
    done, total = part.n_cells()
    assert 2 <= done < total, text
    before = {n: (c.measured.copy(), c.latency_ms.copy()) for n, c in part.components.items()}
    again = _run(2, run_dir, cfg)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{done}/{total} cells already measured" in again.stdout
    full = read_profile(run_dir / "profile.h5")
    for name, (m, lat) in before.items():
        assert lat[m].tobytes() == full.components[name].latency_ms[m].tobytes()


def test_failing_rank_aborts_the_job(tmp_path: Path) -> None:
    cfg = {**CFG, "toy": {"fail_on": "head"}}
    res = _run(2, tmp_path / "bad", cfg, timeout=120)
    assert res.returncode != 0
    assert "component head is broken (toy)" in res.stdout + res.stderr


def _rank_pid(run_dir: Path, rank: int) -> int | None:
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or str(run_dir).encode() not in (d / "cmdline").read_bytes():
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in env:
            return int(d.name)
    return None


def test_a_stopped_rank_is_named_after_profile_rank_silence_s(tmp_path: Path) -> None:
    """``profile.rank_silence_s``: rank 0 waits at the final gather while a rank's part file grows, and names a
    rank silent that long (SIGSTOP) instead of the 900 s default."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = {**CFG, "toy": {"sleep_s": 0.05},
           "profile": {**CFG["profile"], "batch_sizes": [1, 2, 4, 8], "rank_silence_s": 3.0}}
    proc = _start_toys(run_dir, cfg)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "[rank 1] profile 1/" not in (line := proc.stdout.readline()):
            assert line, "the job ended before rank 1 measured a cell"
        victim = _rank_pid(run_dir, 1)
        assert victim is not None
        os.kill(victim, signal.SIGSTOP)
        t_stop = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        took = time.monotonic() - t_stop
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    print(f"rank 1 stopped: the job ended {took:.1f} s later (profile.rank_silence_s=3)")
    assert proc.returncode != 0
    assert "rank 1 wrote no cell" in out and "for 3 s (profile.rank_silence_s" in out, out[-3000:]
    assert took < 60
