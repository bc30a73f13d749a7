"""A node lost under a serve on the two-node dev cluster: its ranks killed, or its slurmd killed.

Each test starts a batch serve (``launcher=slurm cluster=dev2``) with the frontend and the first component on
node 0 and the last component on node 1 (2 + 1 ranks: the uneven-plan hostfile path), hurts node 1 once rows
are done, and checks that the job ends within a bound (printed: measured), that the login side names the node
and its rank, that the rows done are kept and equal the whole model, and that no rank of the job is left.
Skipped unless two SLURM nodes are up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.mpi.test_faults import _rows_done
from tests.multinode import helpers as mn

pytestmark = mn.pytestmark
STATE = Path(os.environ.get("HPCSPLIT_DEV_CLUSTER_DIR", "/var/tmp/hpcsplit-dev-cluster"))


def _job_procs(run: Path, node: str | None = None) -> dict[int, int]:
    """PID -> SLURM_PROCID of this run's rank processes (on ``node``), from /proc (one PID namespace)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            if b"submitit" not in cmd or str(run).encode() not in cmd:
                continue
            env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except OSError:
            continue
        if b"SLURM_PROCID" in env and (node is None or env.get(b"SLURMD_NODENAME") == node.encode()):
            out[int(d.name)] = int(env[b"SLURM_PROCID"])
    return out


class Serve:
    """``python -m hpcsplit stage=serve`` in the background on both nodes; rows slowed by a sleep fault."""

    def __init__(self, tmp: Path, sb_dir: Path, rows: int, sleep_s: float) -> None:
        from hpcsplit.switchboard.reader import Switchboard
        from tests.mpi.test_serve import _inputs

        order = Switchboard.load(sb_dir).order
        self.sb_dir, self.tmp, self.run, self.out = sb_dir, tmp, tmp / "run", tmp / "out.h5"
        mn.two_node_plan(sb_dir, tmp / "plan.json", [order[:1], order[1:]], batch=2)
        self.inputs = _inputs(sb_dir, rows, tmp / "in.npz")
        fault = f"{{component:'{order[-1]}',kind:sleep,after_batches:0,sleep_s:{sleep_s},times:1000000}}"
        cmd = [sys.executable, "-m", "hpcsplit", "launcher=slurm", "cluster=dev2", "launcher.poll_s=1",
               "launcher.poll_max_s=1", "stage=serve", f"plan={tmp / 'plan.json'}", f"switchboard={sb_dir}",
               f"runtime.input_path={tmp / 'in.npz'}", f"runtime.output_path={self.out}", "runtime.verify=false",
               "runtime.max_inflight=2", f"runtime.fault={fault}", f"hydra.run.dir={self.run}"]
        self.log = open(tmp / "login.txt", "w")  # noqa: SIM115 - closed in close()
        self.p = subprocess.Popen(cmd, cwd=mn.REPO, env=mn.env(), stdout=self.log, stderr=subprocess.STDOUT,
                                  start_new_session=True)

    @property
    def output(self) -> str:
        return (self.tmp / "login.txt").read_text(errors="replace")

    def wait_rows(self, n: int, timeout_s: float) -> None:
        t_end = time.monotonic() + timeout_s
        while _rows_done(self.out) < n:
            if self.p.poll() is not None:
                pytest.fail(f"the serve ended (rc {self.p.returncode}) before {n} rows:\n{self.output[-3000:]}")
            if time.monotonic() > t_end:
                pytest.fail(f"fewer than {n} rows within {timeout_s} s:\n{self.output[-3000:]}")
            time.sleep(0.2)

    def check_rows_kept(self) -> int:
        from tests.mpi.test_serve import _read, _whole_per_request

        out = _read(self.out)
        done = out["done"].astype(bool)
        ref = _whole_per_request(self.sb_dir, self.inputs)[0]
        np.testing.assert_allclose(out["output"][done], ref[done], rtol=1e-4, atol=1e-5)
        return int(done.sum())

    def close(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)  # the login side cancels its job
            self.p.wait(timeout=60)
        self.log.close()


@pytest.fixture
def serves() -> Iterator[list[Serve]]:
    made: list[Serve] = []
    yield made
    for s in made:
        s.close()
        for pid in _job_procs(s.run):  # whatever the test saw, no rank of it stays behind
            os.kill(pid, signal.SIGKILL)


def _no_ranks_left(run: Path, within_s: float) -> None:
    t_end = time.monotonic() + within_s
    while _job_procs(run) and time.monotonic() < t_end:
        time.sleep(0.5)
    assert not _job_procs(run), f"ranks of the job still running: {_job_procs(run)}"


def test_ranks_of_one_node_killed_end_the_job_and_name_them(
        tmp_path: Path, switchboards: Callable[..., Path], serves: list[Serve]) -> None:
    sb_dir = switchboards("toy_mlp", stages=2, max_branches=1, force=True)
    serve = Serve(tmp_path, sb_dir, rows=400, sleep_s=0.05)
    serves.append(serve)
    serve.wait_rows(6, 300)
    victims = _job_procs(serve.run, mn.NODES[1])
    assert sorted(victims.values()) == [2], victims  # the plan's node 1 holds rank 2 only
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    rc = serve.p.wait(timeout=120)
    ended_s = time.monotonic() - t_kill
    print(f"ranks of {mn.NODES[1]} killed: the login side returned after {ended_s:.1f} s")
    out = serve.output
    assert rc != 0
    assert f"{mn.NODES[1]}: task 2: Killed" in out, out[-3000:]  # srun names the node and the rank
    assert 6 <= serve.check_rows_kept() < 400
    _no_ranks_left(serve.run, 30)


@pytest.mark.slow  # SlurmdTimeout (30 s) + NODE_FAIL + the node's restart: over a minute
def test_slurmd_of_one_node_killed_ends_the_job_as_node_fail(
        tmp_path: Path, switchboards: Callable[..., Path], serves: list[Serve]) -> None:
    node = mn.NODES[1]
    pidfile = STATE / "run" / f"slurmd-{node}.pid"
    if not pidfile.is_file():
        pytest.skip(f"no {pidfile}: not the dev cluster of slurm/dev-cluster.sh")
    sb_dir = switchboards("toy_mlp", stages=2, max_branches=1, force=True)
    serve = Serve(tmp_path, sb_dir, rows=4000, sleep_s=0.2)  # longer than SlurmdTimeout (30 s)
    serves.append(serve)
    try:
        serve.wait_rows(4, 300)
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        t_kill = time.monotonic()
        rc = serve.p.wait(timeout=180)
        ended_s = time.monotonic() - t_kill
        print(f"slurmd of {node} killed: the login side returned after {ended_s:.1f} s (SlurmdTimeout=30)")
        out = serve.output
        assert rc != 0
        assert "NODE_FAIL" in out, out[-3000:]
        assert f"node {node} (node 1 of the job, rank 2) is DOWN" in out, out[-3000:]
        assert 4 <= serve.check_rows_kept() < 4000
        assert not _job_procs(serve.run, mn.NODES[0])  # node 0's ranks ended with the job
    finally:  # the node back: its slurmd restarted, its orphaned ranks killed when it registers
        subprocess.run([str(mn.REPO / "slurm/dev-cluster.sh"), "up", "--nodes", str(len(mn.NODES))],
                       capture_output=True, timeout=120, check=False)
    _no_ranks_left(serve.run, 60)
