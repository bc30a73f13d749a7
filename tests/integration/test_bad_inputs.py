"""The bad-input catalogue: each bad input ends with exit code != 0, a message that names the problem
and the fix, and no lost results.  Everything runs as users run it: ``python -m hpcsplit ...``.

One toy pipeline run (module fixture, local mpiexec) provides a switchboard, profile and plan; the
SLURM cases (a job killed by SLURM, preemption) are in tests/slurm/test_pipeline_slurm.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAST = ["+experiment=toy", "profile.max_batch=2", "profile.iters=3", "bench.qps=[20]", "bench.duration_s=1",
        "bench.warmup_s=0.2"]

needs_mpiexec = pytest.mark.skipif(
    shutil.which("mpiexec") is None and not (Path(sys.executable).parent / "mpiexec").exists(),
    reason="no mpiexec",
)


def _run(run_dir: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> tuple[int, str]:
    res = subprocess.run(
        [sys.executable, "-m", "hpcsplit", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True, text=True, timeout=timeout, check=False,
    )
    return res.returncode, res.stdout + res.stderr


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete local toy pipeline run (also the local end-to-end check of stage=all)."""
    if shutil.which("mpiexec") is None and not (Path(sys.executable).parent / "mpiexec").exists():
        pytest.skip("no mpiexec")
    run = tmp_path_factory.mktemp("toy") / "run"
    rc, out = _run(run, *FAST)
    assert rc == 0, out[-4000:]
    assert f"Results: {run}" in out and (run / "summary.md").is_file()
    return run


# ----------------------------------------------------------------------------------- the happy path


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_pipeline_completes_and_resume_skips(toy_run: Path) -> None:
    stages = json.loads((toy_run / "manifest.json").read_text())["stages"]
    assert all(s["status"] == "done" for s in stages.values()) and len(stages) == 5
    summary = (toy_run / "summary.md").read_text()
    for section in ("## Components", "## Profile highlights", "## Plan", "## Benchmark", "## Plots", "plan.png"):
        assert section in summary
    rc, out = _run(toy_run, *FAST)
    assert rc == 0, out[-3000:]
    assert out.count("up to date") == 5 and "MPI rank(s)" not in out
    # a changed bench setting re-runs only the bench
    rc, out = _run(toy_run, *FAST[:-2], "bench.duration_s=0.5", "bench.warmup_s=0.1")
    assert rc == 0, out[-3000:]
    assert "stage profile: up to date" in out and "stage allocate: up to date" in out
    assert "stage bench: starting" in out


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_the_pipelines_run_serves_real_clients(toy_run: Path, tmp_path: Path) -> None:
    """``+experiment=toy stage=serve runtime.mode=server`` in a finished pipeline's run folder serves that
    run's switchboard and plan: a tritonclient request gets the whole model's outputs; Ctrl-C ends it (0)."""
    import signal

    import numpy as np
    import torch
    import tritonclient.http as th

    from hpcsplit.switchboard.reader import Switchboard

    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcsplit", "+experiment=toy", "stage=serve", "runtime.mode=server",
         "runtime.server_status_s=1", f"hydra.run.dir={run}"],
        cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the login side says when it is ready (the test's timeout bounds the wait)
            lines.append(line)
            if "server ready" in line:
                break
        assert (run / "endpoint.json").exists(), "".join(lines)[-3000:]
        ep = json.loads((run / "endpoint.json").read_text())
        token = (run / "server.token").read_text().strip()
        sb = Switchboard.load(run / "switchboard")  # the pipeline's own export
        assert ep["model"] == sb.model_name
        xs = [x.numpy() for x in sb.example_inputs(2)]
        ins = []
        for t, x in zip(sb.layout.inputs, xs, strict=True):
            i = th.InferInput(t.name, list(x.shape), {"float32": "FP32", "int64": "INT64"}[str(x.dtype)])
            i.set_data_from_numpy(x, binary_data=True)
            ins.append(i)
        client = th.InferenceServerClient(f"{ep['host']}:{ep['http_port']}")
        r = client.infer(ep["model"], ins, headers={"Authorization": f"Bearer {token}"})
        with torch.inference_mode():
            ref = sb.load_whole()(*(torch.from_numpy(x) for x in xs))
        for t, want in zip(sb.layout.outputs, ref, strict=True):
            np.testing.assert_allclose(r.as_numpy(t.name), want.numpy(), atol=1e-5, rtol=1e-4)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        out = "".join(lines) + rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "server ready" in out and "the server drained and stopped cleanly" in out, out[-3000:]
    from hpcsplit.core.paths import RunPaths

    cfg = json.loads((run / "serve.cfg.json").read_text())  # what the ranks read: the run's own plan and switchboard
    paths = RunPaths.from_config(cfg, run)
    assert paths.plan == run / "plan.json" and paths.switchboard == run / "switchboard"


# ---------------------------------------------------------------------------------- bad switchboards


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_malformed_switchboard(toy_run: Path, tmp_path: Path) -> None:
    sb = tmp_path / "sb"
    shutil.copytree(toy_run / "switchboard", sb)
    (sb / "layout.json").write_text("{not json")
    rc, out = _run(tmp_path / "run", *FAST, f"switchboard={sb}")
    assert rc != 0
    assert "SwitchboardError" in out and "layout.json" in out, out[-2000:]


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_tampered_switchboard_in_a_resumed_run(toy_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    prog = min((run / "switchboard" / "programs").glob("*.pt2"))
    data = bytearray(prog.read_bytes())
    data[len(data) // 2] ^= 0xFF
    prog.write_bytes(bytes(data))
    rc, out = _run(run, *FAST)
    assert rc != 0
    assert "SwitchboardError" in out and prog.name in out and "sha256" in out, out[-2000:]
    assert (run / "profile.h5").is_file() and (run / "plan.json").is_file()  # nothing else was touched


# ------------------------------------------------------------------------------ bad profile / plan


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_malformed_profile(toy_run: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"this is not an HDF5 file" * 10)
    rc, out = _run(tmp_path / "run", "stage=allocate", f"profile={bad}")
    assert rc != 0
    assert "ProfileFormatError" in out and str(bad) in out, out[-2000:]
    rc, out = _run(tmp_path / "run2", "stage=analyze", f"profile={tmp_path / 'missing.h5'}")
    assert rc != 0 and "missing.h5" in out, out[-2000:]


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_infeasible_allocation(toy_run: Path, tmp_path: Path) -> None:
    rc, out = _run(
        tmp_path / "run", "stage=allocate", f"profile={toy_run / 'profile.h5'}",
        "cluster.cores_per_node=2", "allocate.cpu_oversubscribe=false",
    )
    assert rc != 0
    assert "AllocationInfeasibleError" in out, out[-2000:]
    assert "cores_per_node" in out or "oversubscribe" in out, out[-2000:]
    assert not (tmp_path / "run" / "plan.json").exists()


# ---------------------------------------------------------------------------------- bad config values


@pytest.mark.timeout(300)
def test_invalid_config_values_are_listed_together(tmp_path: Path) -> None:
    rc, out = _run(tmp_path / "run", "bench.qps=[-1,2]", "model.batch_size=0", "profile.max_batch=0")
    assert rc != 0
    assert "3 config problem(s)" in out, out[-2000:]
    assert "bench.qps" in out and "model.batch_size = 0" in out and "profile.max_batch = 0" in out
    assert not (tmp_path / "run" / "switchboard").exists()  # nothing ran


@pytest.mark.timeout(300)
def test_unknown_cluster(tmp_path: Path) -> None:
    rc, out = _run(tmp_path / "run", "cluster=nosuchsite")
    assert rc != 0
    assert "cluster/nosuchsite" in out and "perlmutter" in out  # Hydra lists the presets


@pytest.mark.timeout(300)
def test_missing_mpiexec(tmp_path: Path) -> None:
    rc, out = _run(tmp_path / "run", "stage=probe", "launcher.mpiexec=/nonexistent/mpiexec")
    assert rc != 0
    assert "LaunchError" in out and "/nonexistent/mpiexec" in out and "fix the path" in out, out[-2000:]


@pytest.mark.timeout(300)
def test_missing_sbatch(tmp_path: Path) -> None:
    path = str(Path(sys.executable).parent) + os.pathsep + "/usr/bin/nonexistent"
    rc, out = _run(tmp_path / "run", "+experiment=toy", "launcher=slurm", "cluster=dev", env={"PATH": path})
    assert rc != 0
    assert "no `sbatch` on PATH" in out and "launcher=local" in out, out[-2000:]
    assert not (tmp_path / "run" / "switchboard").exists()  # failed before the export


def _bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpcsplit.bench", *args], cwd=REPO,
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=120, check=False)


def test_transport_bench_on_slurm_names_a_missing_preset_or_srun(tmp_path: Path) -> None:
    res = _bench("transport", "--slurm", "--cluster", "nosuchsite", "--out", str(tmp_path))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "'nosuchsite': no such preset" in res.stderr and "dev2" in res.stderr, res.stderr
    res = _bench("transport", "--slurm", "--cluster", "local", "--out", str(tmp_path))
    assert res.returncode == 2 and "has no slurm: block" in res.stderr, res.stderr
    res = _bench("transport", "--slurm", "--out", str(tmp_path), env={"PATH": str(Path(sys.executable).parent)})
    assert res.returncode == 2 and "needs srun on PATH" in res.stderr and "Traceback" not in res.stderr, res.stderr
    res = _bench("transport", "--sizes", "1M,big")
    assert res.returncode == 2 and "--sizes '1M,big'" in res.stderr, res.stderr


# -------------------------------------------------------------------------------------- rank crash


@pytest.mark.mpi
@pytest.mark.timeout(900)
def test_rank_crash_keeps_earlier_stages(toy_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    profile_sha = json.loads((run / "manifest.json").read_text())["stages"]["profile"]["outputs_sha256"]
    rc, out = _run(run, *FAST, "+force=[bench]", "runtime.fault={component:head,kind:raise,after_batches:0}")
    assert rc != 0
    assert "[rank " in out and "head" in out, out[-3000:]
    assert f"resume={run}" in out
    stages = json.loads((run / "manifest.json").read_text())["stages"]
    assert stages["bench"]["status"] == "failed" and stages["profile"]["outputs_sha256"] == profile_sha
    assert "FAILED" in (run / "summary.md").read_text()


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_changed_profile_settings_set_the_old_profile_aside(toy_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(toy_run, run)
    rc, out = _run(run, *[a for a in FAST if not a.startswith("profile.iters")], "profile.iters=4")
    assert rc == 0, out[-3000:]
    assert "stage export: up to date" in out and "kept the old one as" in out
    assert list(run.glob("profile.*.h5")) and (run / "profile.h5").is_file()
