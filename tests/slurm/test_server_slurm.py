"""Server mode on the dev SLURM: ``slurm/serve.sbatch`` and the submitit path (``launcher=slurm``) start a
server, a client on the login side finds it through ``endpoint.json`` and gets the whole model's outputs,
and ``scancel`` (sbatch) or Ctrl-C on the login side (submitit) drains it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(shutil.which("sbatch") is None, reason="no sbatch (start one: slurm/dev-cluster.sh up)"),
]

REPO = Path(__file__).resolve().parents[2]
th = pytest.importorskip("tritonclient.http")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
            "HPCSPLIT_PYTHON": sys.executable, "HPCSPLIT_ROOT": str(REPO)}


def _run_folder(tmp: Path, switchboards: Callable[..., Path]) -> tuple[Path, Path, int]:
    from tests.mpi.test_serve import _plan

    sb = switchboards("toy_mlp", stages=2, max_branches=2)
    run = tmp / "run"
    run.mkdir()
    shutil.copytree(sb, run / "switchboard")
    n = _plan(sb, run / "plan.json")
    return run, sb, n


def _wait_endpoint(run: Path, alive: Callable[[], bool], limit_s: float = 400) -> dict:
    ep = run / "endpoint.json"
    deadline = time.monotonic() + limit_s
    while not ep.exists():
        assert alive(), "the job ended before the server was ready"
        assert time.monotonic() < deadline, "no endpoint.json in time"
        time.sleep(1)
    time.sleep(0.3)
    return json.loads(ep.read_text())


def _check_outputs(ep: dict, sb: Path) -> None:
    from tests.mpi.test_serve import _whole_per_request

    tok = Path(ep["token_file"]).read_text().strip()
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    c = th.InferenceServerClient(f"{ep['host']}:{ep['http_port']}")
    i = th.InferInput("x", [4, 64], "FP32")
    i.set_data_from_numpy(x)
    got = c.infer(ep["model"], [i], headers={"Authorization": f"Bearer {tok}"}).as_numpy("output")
    np.testing.assert_allclose(got, _whole_per_request(sb, [x])[0], atol=1e-5, rtol=1e-4)


def _job_gone(job: str, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, check=False)
        if not q.stdout.strip():
            return
        time.sleep(1)
    raise AssertionError(f"job {job} still in the queue {limit_s:g} s after scancel")


@pytest.mark.timeout(600)
def test_serve_sbatch_endpoint_and_scancel(tmp_path: Path, switchboards: Callable[..., Path]) -> None:
    run, sb, n = _run_folder(tmp_path, switchboards)
    res = subprocess.run(["sbatch", "--parsable", f"--ntasks={n}", f"--output={tmp_path}/slurm-%j.out",
                          str(REPO / "slurm/serve.sbatch"), str(run)],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    log = tmp_path / f"slurm-{job}.out"
    try:
        def alive() -> bool:
            return bool(subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True,
                                       check=False).stdout.strip())

        ep = _wait_endpoint(run, alive)
        _check_outputs(ep, sb)
    finally:
        subprocess.run(["scancel", job], check=False)
    _job_gone(job)
    text = log.read_text()
    assert "not ready, refusing new requests" in text and "server: stopped after 1 request(s)" in text, text[-3000:]
    assert "Traceback" not in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_submitit_server_prints_endpoint_and_ctrl_c_drains(tmp_path: Path,
                                                           switchboards: Callable[..., Path]) -> None:
    """launcher=slurm: the login side prints the endpoint; Ctrl-C there drains the job (SIGTERM to its steps),
    which ends COMPLETED, and the login process exits 0 as a local server's does."""
    run, sb, _ = _run_folder(tmp_path, switchboards)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcsplit", "stage=serve", "runtime.mode=server", "launcher=slurm", "cluster=dev",
         "launcher.poll_s=1", "launcher.poll_max_s=3", "runtime.server_status_s=2",
         f"plan={run / 'plan.json'}", f"switchboard={run / 'switchboard'}", f"hydra.run.dir={run}"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    job = None
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 400
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"SLURM job (\d+)", line)
            job = job or (m.group(1) if m else None)
            if "server status:" in line or time.monotonic() > deadline:
                break
        out = "".join(lines)
        assert "server ready" in out and "ssh -N -L" in out, out[-3000:]
        ep = json.loads((run / "endpoint.json").read_text())
        _check_outputs(ep, sb)
        assert job is not None, out[-3000:]
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=180)
        lines.append(rest or "")
    finally:
        if proc.poll() is None:
            proc.kill()
        if job is not None and proc.returncode != 0:
            subprocess.run(["scancel", job], check=False)
    assert job is not None
    out = "".join(lines)
    assert proc.returncode == 0, out[-3000:]
    assert "the server drained and stopped cleanly" in out and "interrupted" not in out, out[-3000:]
    _job_gone(job)
    state = subprocess.run(["sacct", "-n", "-X", "-j", job, "-o", "State"], capture_output=True, text=True,
                           check=False).stdout
    assert "COMPLETED" in state, state
    logs = "".join(p.read_text(errors="replace") for p in (run / "slurm").glob(f"{job}_*"))
    assert "server: stopped after 1 request(s)" in logs, ("".join(lines) + logs)[-4000:]
