"""The whole pipeline on the dev SLURM cluster (slurm/dev-cluster.sh up), and what SLURM can do to it.

* ``python -m hpcsplit +experiment=toy launcher=slurm cluster=dev`` completes every stage (profile and
  bench as SLURM jobs), and the served outputs match the whole model;
* re-running it in the same folder (``resume=``) skips every stage;
* a bench job killed by SLURM (``scancel``) ends with a clear error and keeps the profile; resuming
  re-runs only the bench;
* a profile job preempted with USR2 (what SLURM sends before the time limit) is requeued by the launch
  layer and keeps the cells measured before.

Skipped only where there is no ``sbatch``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# a fast whole pipeline of the toy model on the dev cluster (the sbatch pipeline tests)
_TOY_PIPELINE = ["+experiment=toy", "cluster=dev", "profile.max_batch=2", "profile.iters=3", "bench.qps=[20]",
                 "bench.duration_s=1", "bench.warmup_s=0.2"]

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch (start one: slurm/dev-cluster.sh up)"),
]

# Small enough for a 2-core CI machine; the shape of the real run.
FAST = [
    "+experiment=toy",
    "launcher=slurm",
    "cluster=dev",
    "profile.max_batch=2",
    "profile.iters=3",
    "bench.qps=[20]",
    "bench.duration_s=1",
    "bench.warmup_s=0.2",
    "launcher.poll_s=1",
    "launcher.poll_max_s=3",
]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _hpcsplit(run_dir: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpcsplit", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout, check=False,
    )


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    run = tmp_path_factory.mktemp("pipeline") / "run"
    return run, _hpcsplit(run, *FAST)


@pytest.mark.timeout(1200)
def test_toy_pipeline_on_dev_cluster(toy_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    run, res = toy_run
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert re.search(r"submitted profile as SLURM job \d+", out) and re.search(r"submitted bench as SLURM job \d+", out)
    from hpcsplit.core.plan import Plan
    from hpcsplit.core.profile_format import read_profile

    assert read_profile(run / "profile.h5").complete
    plan = Plan.load(run / "plan.json")
    assert plan.world_size >= 2
    bench = json.loads((run / "runtime.mpi_main.result.json").read_text())
    assert bench["mode"] == "bench"
    for variant in ("whole", "split"):  # served outputs vs the golden outputs of the whole model
        e2e = bench["variants"][variant]["end_to_end"]
        assert e2e["samples"] >= 1 and e2e["max_abs_diff"] < 1e-4
    assert (run / "bench" / "summary.csv").is_file()
    manifest = json.loads((run / "manifest.json").read_text())
    assert {s: v["status"] for s, v in manifest["stages"].items()} == dict.fromkeys(
        ("export", "profile", "analyze", "allocate", "bench"), "done"
    )
    summary = (run / "summary.md").read_text()
    assert "## Plan" in summary and "## Benchmark" in summary and "plan.png" in summary
    assert f"Results: {run}" in out


@pytest.mark.timeout(600)
def test_resume_skips_every_stage(toy_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    run, first = toy_run
    assert first.returncode == 0
    res = _hpcsplit(run, *FAST, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "submitted" not in out
    for stage in ("export", "profile", "analyze", "allocate", "bench"):
        assert f"stage {stage}: up to date" in out


def _wait_for(pattern: str, proc: subprocess.Popen[str], lines: list[str], limit_s: float) -> re.Match[str]:
    assert proc.stdout is not None
    deadline = time.monotonic() + limit_s
    for line in proc.stdout:
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            return m
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"never saw {pattern!r}:\n{''.join(lines)[-3000:]}")


@pytest.mark.timeout(1200)
def test_bench_job_killed_by_slurm_keeps_profile_and_resumes(
    toy_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    src, first = toy_run
    assert first.returncode == 0
    run = tmp_path / "run"
    shutil.copytree(src, run)
    before = json.loads((run / "manifest.json").read_text())["stages"]["profile"]["outputs_sha256"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcsplit", *FAST, "+force=[bench]", f"hydra.run.dir={run}"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    try:
        job = _wait_for(r"submitted bench as SLURM job (\d+)", proc, lines, 600).group(1)
        subprocess.run(["scancel", job], check=True)
        assert proc.stdout is not None
        lines += proc.stdout.readlines()
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert rc != 0
    assert f"SLURM job {job} (stage=bench) ended CANCELLED" in out, out[-3000:]
    assert f"resume={run}" in out
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    assert stages["bench"]["status"] == "failed" and stages["profile"]["status"] == "done"
    assert stages["profile"]["outputs_sha256"] == before  # the profile was not touched
    assert "FAILED" in (run / "summary.md").read_text()
    res = _hpcsplit(run, *FAST)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "stage profile: up to date" in out and "submitted bench as SLURM job" in out
    assert "submitted profile" not in out


@pytest.mark.slow  # SLURM holds a requeued job for about 2 minutes (BeginTime) before it runs again
@pytest.mark.timeout(1200)
def test_preempted_profile_job_is_requeued_and_keeps_cells(
    toy_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    src, first = toy_run
    assert first.returncode == 0
    run = tmp_path / "run"
    args = [
        "stage=profile", "launcher=slurm", "cluster=dev", f"switchboard={src / 'switchboard'}",
        "profile.max_batch=16", "profile.iters=3000", "profile.threads=[1]", "launcher.poll_s=1", "launcher.poll_max_s=2",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcsplit", *args, f"hydra.run.dir={run}"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: list[str] = []
    try:
        job = _wait_for(r"submitted profile as SLURM job (\d+)", proc, lines, 300).group(1)
        logs = run / "slurm"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # wait until a few cells are on disk
            text = "".join(p.read_text(errors="replace") for p in logs.glob(f"{job}_*_log.*"))
            if re.search(r"profile [3-9]\d*/\d+ cells", text) or re.search(r"profile \d\d+/\d+ cells", text):
                break
            time.sleep(1)
        # what SLURM sends to every task before the time limit or on preemption (submitit's signal)
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
        assert proc.stdout is not None
        lines += proc.stdout.readlines()
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    logs_text = "".join(p.read_text(errors="replace") for p in sorted((run / "slurm").glob(f"{job}_*_log.*")))
    assert rc == 0, out[-3000:] + logs_text[-3000:]
    assert "got SIGUSR2" in logs_text, logs_text[-3000:]
    kept = [int(m.group(1)) for m in re.finditer(r"profile \S+: (\d+)/\d+ cells already measured", logs_text)]
    assert len(kept) >= 2 and kept[-1] > 0, logs_text[-3000:]  # the requeued run started from the kept cells
    from hpcsplit.core.profile_format import read_profile

    assert read_profile(run / "profile.h5").complete


# -------------------------------------------------------------------------------- plain sbatch scripts


def _sbatch_wait(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sbatch", "--wait", *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout,
        check=False,
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bench_sbatch_script(toy_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path) -> None:
    src, first = toy_run
    assert first.returncode == 0
    run = tmp_path / "run"
    shutil.copytree(src, run, ignore=shutil.ignore_patterns("bench", "worker.*", "slurm"))
    world = len(json.loads((run / "plan.json").read_text())["ranks"])
    over = ["+experiment=toy", "cluster=dev", "bench.qps=[20]", "bench.duration_s=1", "bench.warmup_s=0.2"]
    # the wrong task count is refused with the right one in the message
    bad = _sbatch_wait("--ntasks=2", f"--output={run}/bad.out", "slurm/bench.sbatch", str(run), *over)
    assert bad.returncode != 0
    assert f"the plan needs {world} MPI ranks but this job has SLURM_NTASKS=2" in (run / "bad.out").read_text()
    res = _sbatch_wait(f"--ntasks={world}", f"--output={run}/ok.out", "slurm/bench.sbatch", str(run), *over)
    log = (run / "ok.out").read_text()
    assert res.returncode == 0, log[-3000:]
    out = json.loads((run / "runtime.mpi_main.result.json").read_text())
    assert out["mode"] == "bench" and out["variants"]["split"]["end_to_end"]["max_abs_diff"] < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_pipeline_sbatch_chains_jobs_with_dependencies(tmp_path: Path) -> None:
    run = tmp_path / "run"
    over = _TOY_PIPELINE
    res = subprocess.run(["bash", "slurm/pipeline.sbatch", str(run), *over], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    ids = re.search(r"export (\d+) -> profile (\d+) -> allocate (\d+)", res.stdout)
    assert ids, res.stdout
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline and not (run / "runtime.mpi_main.result.json").exists():
        time.sleep(3)
    out = json.loads((run / "runtime.mpi_main.result.json").read_text())
    assert out["mode"] == "bench" and out["variants"]["split"]["end_to_end"]["samples"] >= 1
    from hpcsplit.core.profile_format import read_profile

    assert read_profile(run / "profile.h5").complete and (run / "plan.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_pipeline_sbatch_in_one_allocation(tmp_path: Path) -> None:
    run = tmp_path / "run"
    over = _TOY_PIPELINE
    res = _sbatch_wait(f"--output={tmp_path}/job.out", "slurm/pipeline.sbatch", str(run), *over, timeout=1400)
    log = (tmp_path / "job.out").read_text()
    assert res.returncode == 0, log[-3000:]
    assert "ranks forked here" in log  # mpiexec inside a one-node batch job
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    assert all(s["status"] == "done" for s in stages.values()) and (run / "summary.md").is_file()
