"""A server loses a node on the two-node dev cluster (``launcher=slurm cluster=dev2``): one node's slurmd is
killed while the server runs on both nodes.  SLURM ends the job (NODE_FAIL, about SlurmdTimeout + a few
seconds later); the login side starts it again by itself on the node left (the CPU plan folded onto it,
``[Note: server restarts]``), on the same ports and token, and the endpoint answers again.  The measured
times are printed.  The node is brought back afterwards (``slurm/dev-cluster.sh up``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.multinode import helpers as mn
from tests.multinode.test_node_faults import STATE, _job_procs

pytestmark = mn.pytestmark
th = pytest.importorskip("tritonclient.http")


def _infer(ep: dict, token: str, x: np.ndarray, timeout_s: float = 10.0) -> np.ndarray:
    c = th.InferenceServerClient(f"{ep['host']}:{ep['http_port']}", network_timeout=timeout_s)
    i = th.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return c.infer(ep["model"], [i], headers={"Authorization": f"Bearer {token}"}).as_numpy("output")


def _endpoint(run: Path, after: float, proc: subprocess.Popen[str], log: Path, timeout_s: float) -> dict:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        try:
            ep = json.loads((run / "endpoint.json").read_text())
            if ep["started"] > after:
                return ep
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    pytest.fail(f"no endpoint.json started after {after} (rc {proc.poll()}):\n{log.read_text()[-4000:]}")


@pytest.mark.slow  # SlurmdTimeout (30 s) + NODE_FAIL + a new job + the node's restore: a few minutes
@pytest.mark.timeout(900)
def test_slurmd_of_one_node_killed_restarts_the_server_on_the_node_left(
        tmp_path: Path, switchboards: Callable[..., Path]) -> None:
    node = mn.NODES[1]
    pidfile = STATE / "run" / f"slurmd-{node}.pid"
    if not pidfile.is_file():
        pytest.skip(f"no {pidfile}: not the dev cluster of slurm/dev-cluster.sh")
    sb_dir = switchboards("toy_mlp", stages=2, max_branches=1, force=True)
    from hpcsplit.switchboard.reader import Switchboard
    from tests.mpi.test_serve import _whole_per_request

    order = Switchboard.load(sb_dir).order
    mn.two_node_plan(sb_dir, tmp_path / "plan.json", [order[:1], order[1:]], batch=2)
    run, log = tmp_path / "run", tmp_path / "login.txt"
    cmd = [sys.executable, "-m", "hpcsplit", "launcher=slurm", "cluster=dev2", "launcher.poll_s=1",
           "launcher.poll_max_s=1", "stage=serve", "runtime.mode=server", f"plan={tmp_path / 'plan.json'}",
           f"switchboard={sb_dir}", "runtime.silence_s=10", "runtime.server_status_s=10", f"hydra.run.dir={run}"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=mn.REPO, env=mn.env(), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    ref = _whole_per_request(sb_dir, [x])[0]
    try:
        ep0 = _endpoint(run, 0.0, proc, log, 300)
        token = Path(ep0["token_file"]).read_text().strip()
        np.testing.assert_allclose(_infer(ep0, token, x).reshape(ref.shape), ref, atol=1e-5, rtol=1e-4)
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        t_kill = time.monotonic()
        served_on = 0
        while not (run / "endpoint.json").exists() or json.loads((run / "endpoint.json").read_text())["started"] <= \
                ep0["started"]:
            with contextlib.suppress(Exception):  # the old job serves until SLURM ends it (its tasks are alive)
                _infer(ep0, token, x, 5.0)
                served_on = max(served_on, int(time.monotonic() - t_kill))
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() - t_kill < 400, log.read_text()[-4000:]
            time.sleep(1.0)
        ep1 = _endpoint(run, ep0["started"], proc, log, 60)
        np.testing.assert_allclose(_infer(ep1, Path(ep1["token_file"]).read_text().strip(), x).reshape(ref.shape), ref,
                                   atol=1e-5, rtol=1e-4)
        again_s = time.monotonic() - t_kill
        out = log.read_text()
        print(f"slurmd of {node} killed: the old job answered for {served_on} s more, the server answered again "
              f"{again_s:.1f} s after the kill, on {ep1['host']}")
        assert "NODE_FAIL" in out, out[-4000:]
        assert "the next job runs the plan's ranks on 1 node(s)" in out and node in out, out[-4000:]
        assert "starting the server job again in" in out, out[-4000:]
        assert (ep1["http_port"], ep1["grpc_port"]) == (ep0["http_port"], ep0["grpc_port"])
        assert Path(ep1["token_file"]).read_text().strip() == token
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the server drains, the login side ends
        assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
        # the node back: its slurmd restarted; its orphaned ranks are killed when it registers
        subprocess.run([str(mn.REPO / "slurm/dev-cluster.sh"), "up", "--nodes", str(len(mn.NODES))],
                       capture_output=True, timeout=180, check=False)
        for pid in _job_procs(run):
            os.kill(pid, signal.SIGKILL)
