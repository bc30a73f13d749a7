"""A server keeps serving through faults (``[Note: serving through faults]``), under the real login side
(``python -m hpcsplit stage=serve runtime.mode=server``: mpiexec, the rank keepers) and real clients.

- kill -9 of one of two replicas of a component while tritonclient sends 2,000 requests at concurrency 8:
  every request is answered (the ones in flight on the lost replica are sent again), the server keeps
  answering, ready and the metrics say degraded and name the rank, component and node; SIGSTOP of a replica:
  the same, after ``runtime.silence_s``;
- kill -9 of the only replica of a component: the login side starts the job again by itself, on the same
  ports and token, and the endpoint answers again (the time is printed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.mpi.test_serve import _whole_per_request

pytestmark = pytest.mark.mpi

pytest.importorskip("torch")
th = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException

REPO = Path(__file__).resolve().parents[2]
SILENCE_S = 2.0
N_REQUESTS, CONCURRENCY, HURT_AT = 2000, 8, 500


@pytest.fixture(scope="module")
def toy_sb(switchboards: Callable[..., Path]) -> Path:
    return switchboards("toy_mlp", stages=2, max_branches=2)


def _plan(sb_dir: Path, path: Path, replicas: dict[str, int]) -> list[str]:
    """A CPU plan: the frontend, then ``replicas[c]`` ranks of each component (batch 4); returns rank -> component."""
    from hpcsplit.core.plan import Plan, RankEntry
    from hpcsplit.switchboard.reader import Switchboard

    sb = Switchboard.load(sb_dir)
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    for c in sb.order:
        for k in range(replicas.get(c, 1)):
            ranks.append(RankEntry(len(ranks), "component", 0, None, None, 1, c, 4, k))
    Plan(sb.model_name, sb.sha256, "cpu", 1, tuple(ranks), dict.fromkeys(sb.order, 0.0), {}).save(path)
    return ["frontend", *(str(r.component) for r in ranks[1:])]


@dataclass
class LoginServer:
    """``python -m hpcsplit stage=serve runtime.mode=server`` in its own session, its output in a file."""

    proc: subprocess.Popen[str]
    run: Path
    out_path: Path
    ep: dict[str, Any] = field(default_factory=dict)
    token: str = ""

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_endpoint(self, after: float = 0.0, timeout_s: float = 200.0) -> dict[str, Any]:
        """The job's endpoint.json once it is there (one started after ``after``)."""
        t_end = time.monotonic() + timeout_s
        path = self.run / "endpoint.json"
        while True:
            try:
                ep = json.loads(path.read_text())
                if ep["started"] > after:
                    break
            except (OSError, ValueError, KeyError):
                pass
            if self.proc.poll() is not None or time.monotonic() > t_end:
                pytest.fail(f"no endpoint.json (rc {self.proc.poll()}):\n{self.output[-3000:]}")
            time.sleep(0.1)
        self.ep, self.token = ep, Path(ep["token_file"]).read_text().strip()
        return ep

    def ranks(self) -> dict[int, int]:
        """rank -> PID of the job's rank processes (``HPCSPLIT_KEEPER`` in the environment: not their keepers)."""
        out = {}
        for d in Path("/proc").iterdir():
            try:
                if not d.name.isdigit() or str(self.run).encode() not in (d / "cmdline").read_bytes():
                    continue
                env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if b"HPCSPLIT_KEEPER" in env and b"PMI_RANK" in env:
                out[int(env[b"PMI_RANK"])] = int(d.name)
        return out

    def get(self, path: str) -> tuple[int, str]:
        req = urllib.request.Request(f"http://127.0.0.1:{self.ep['http_port']}{path}",
                                     headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def stop(self, timeout_s: float = 90.0) -> tuple[int, str]:
        """Ctrl-C to the login side: the server drains; its exit code and output."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait(10)
        return rc, self.output


def _procs_of(run: Path) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if (d.name.isdigit() and str(run).encode() in (d / "cmdline").read_bytes()
                    and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")):
                out.append(int(d.name))
        except OSError:
            continue
    return out


@pytest.fixture
def servers() -> Iterator[list[LoginServer]]:
    made: list[LoginServer] = []
    yield made
    for s in made:
        s.stop(60)
        for pid in _procs_of(s.run):  # whatever the test saw, nothing of the job stays behind
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _start(tmp: Path, sb: Path, replicas: dict[str, int], servers: list[LoginServer], *extra: str) -> LoginServer:
    _plan(sb, tmp / "plan.json", replicas)
    run = tmp / "run"
    out = tmp / "login.txt"
    cmd = [sys.executable, "-m", "hpcsplit", "stage=serve", f"plan={tmp / 'plan.json'}", f"switchboard={sb}",
           "runtime.mode=server", "runtime.server_host=127.0.0.1", f"runtime.silence_s={SILENCE_S}",
           "runtime.request_timeout_s=20", "runtime.server_drain_s=5", "launcher.grace_s=30",
           "launcher.timeout_min=15", f"hydra.run.dir={run}", *extra]
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    srv = LoginServer(proc, run, out)
    servers.append(srv)
    srv.wait_endpoint()
    return srv


def _load(srv: LoginServer, sb: Path, hurt: Callable[[], None]) -> dict[int, tuple[str, float]]:
    """tritonclient (HTTP) sends N_REQUESTS at concurrency CONCURRENCY, each output checked against the whole
    model; ``hurt()`` runs after HURT_AT answers.  Returns request -> ("ok" | "error: ..." | "exception: ...",
    seconds)."""
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, 64)).astype(np.float32) for _ in range(CONCURRENCY)]
    refs = [_whole_per_request(sb, [x])[0] for x in xs]
    res: dict[int, tuple[str, float]] = {}

    def client(k: int) -> None:
        c = th.InferenceServerClient(f"127.0.0.1:{srv.ep['http_port']}", network_timeout=120)
        x = th.InferInput("x", [1, 64], "FP32")
        x.set_data_from_numpy(xs[k])
        for i in range(k, N_REQUESTS, CONCURRENCY):
            t0 = time.monotonic()
            try:
                y = c.infer(srv.ep["model"], [x], headers={"Authorization": f"Bearer {srv.token}"}).as_numpy("output")
                np.testing.assert_allclose(y.reshape(refs[k].shape), refs[k], atol=1e-5, rtol=1e-4)
                res[i] = ("ok", time.monotonic() - t0)
            except InferenceServerException as e:
                res[i] = (f"error: {e}", time.monotonic() - t0)
            except Exception as e:  # noqa: BLE001 - a timeout or a lost connection: silence, the test fails
                res[i] = (f"exception: {type(e).__name__}: {e}", time.monotonic() - t0)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(CONCURRENCY)]
    for t in threads:
        t.start()
    t_end = time.monotonic() + 120
    while len(res) < HURT_AT and time.monotonic() < t_end:
        time.sleep(0.005)
    hurt()
    for t in threads:
        t.join(180)
    return res


def _check_served_through(srv: LoginServer, res: dict[int, tuple[str, float]], victim: int, comp: str) -> str:
    assert len(res) == N_REQUESTS, f"{N_REQUESTS - len(res)} requests got no answer"
    silent = [v for v in res.values() if v[0].startswith("exception")]
    assert not silent, f"{len(silent)} requests got no answer: {silent[:3]}"
    errors = [v[0] for v in res.values() if v[0] != "ok"]
    assert all("503" in e for e in errors), errors[:5]  # a sample lost twice: a clear error
    assert len(errors) <= 8, errors[:5]  # the others were sent again on the live replica
    code, body = srv.get("/v2/health/ready")
    ready = json.loads(body)
    assert code == 200 and ready["state"] == "degraded", (code, body)
    assert f"rank {victim} (component '{comp}' replica" in ready["lost"][0] and "node 0" in ready["lost"][0], ready
    code, body = srv.get(f"/v2/models/{srv.ep['model']}/ready")
    assert code == 200 and json.loads(body)["state"] == "degraded", (code, body)
    metrics = srv.get("/metrics")[1]
    assert "hpcsplit_degraded 1.0" in metrics, metrics[-2000:]
    assert f'hpcsplit_component_replicas{{component="{comp}"}} 1.0' in metrics
    lost = [m for m in metrics.splitlines() if m.startswith("hpcsplit_replica_lost{")]
    assert len(lost) == 1 and f'component="{comp}"' in lost[0] and f'rank="{victim}"' in lost[0], lost
    assert 'node="0"' in lost[0], lost
    out = srv.output
    assert f"server: lost rank {victim} (component '{comp}' replica" in out, out[-3000:]
    rc, out = srv.stop()
    assert rc == 0 and "the server drained and stopped cleanly" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    t_end = time.monotonic() + 10
    while _procs_of(srv.run) and time.monotonic() < t_end:
        time.sleep(0.2)
    assert not _procs_of(srv.run), "a process of the job outlived it"
    return out


@pytest.mark.timeout(600)
def test_kill9_of_one_of_two_replicas_keeps_serving(tmp_path: Path, toy_sb: Path,
                                                    servers: list[LoginServer]) -> None:
    comps = _plan(toy_sb, tmp_path / "plan.json", {})[1:]
    last = comps[-1]
    srv = _start(tmp_path, toy_sb, {last: 2}, servers)  # frontend, the first component, two of the last
    victim = max(srv.ranks())  # the last component's second replica: its upstream replica sends to it
    res = _load(srv, toy_sb, lambda: os.kill(srv.ranks()[victim], signal.SIGKILL))
    after = [v for i, v in res.items() if i >= HURT_AT + CONCURRENCY]
    print(f"kill -9 of rank {victim} after {HURT_AT} answers: {sum(v[0] == 'ok' for v in res.values())} of "
          f"{N_REQUESTS} answered with outputs, {len(after)} sent after it, slowest {max(v[1] for v in res.values()):.2f} s")
    out = _check_served_through(srv, res, victim, last)
    assert "its process ended" in out


@pytest.mark.timeout(600)
def test_sigstop_of_a_replica_is_routed_around_after_the_silence_deadline(
        tmp_path: Path, toy_sb: Path, servers: list[LoginServer]) -> None:
    first = _plan(toy_sb, tmp_path / "plan.json", {})[1]
    # frontend, two of the first component, the last; the protocol in a worker process: it says degraded too
    srv = _start(tmp_path, toy_sb, {first: 2}, servers, "runtime.server_workers=1")
    victim = 1
    res = _load(srv, toy_sb, lambda: os.kill(srv.ranks()[victim], signal.SIGSTOP))
    slowest = max(v[1] for v in res.values())
    print(f"SIGSTOP of rank {victim}: {sum(v[0] == 'ok' for v in res.values())} of {N_REQUESTS} answered with "
          f"outputs; the requests that were on it waited up to {slowest:.2f} s (runtime.silence_s={SILENCE_S:g})")
    assert slowest < SILENCE_S + 10  # answered soon after the deadline, not at request_timeout_s (20 s)
    out = _check_served_through(srv, res, victim, first)
    assert "it sent nothing for" in out and "killed it (SIGKILL)" in out, out[-3000:]


@pytest.mark.timeout(600)
def test_kill9_of_the_only_replica_restarts_the_job_on_the_same_port_and_token(
        tmp_path: Path, toy_sb: Path, servers: list[LoginServer]) -> None:
    srv = _start(tmp_path, toy_sb, {}, servers)
    ep0, token0 = srv.ep, srv.token
    x = th.InferInput("x", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))

    def infer() -> None:
        c = th.InferenceServerClient(f"127.0.0.1:{ep0['http_port']}", network_timeout=10)
        c.infer(ep0["model"], [x], headers={"Authorization": f"Bearer {token0}"})

    infer()
    os.kill(srv.ranks()[1], signal.SIGKILL)
    t_kill = time.monotonic()
    refused = 0
    while True:  # the same URL and token as before: a client that retries needs no new address
        try:
            infer()
            break
        except Exception:  # noqa: BLE001 - 503 while it stops, then no listener until the next job is up
            refused += 1
            assert time.monotonic() - t_kill < 60, srv.output[-3000:]
            time.sleep(0.1)
    again_s = time.monotonic() - t_kill
    print(f"kill -9 of the only replica: the endpoint answered again after {again_s:.1f} s "
          f"({refused} attempts refused meanwhile)")
    ep1 = srv.wait_endpoint(after=ep0["started"])
    assert (ep1["http_port"], ep1["grpc_port"]) == (ep0["http_port"], ep0["grpc_port"])
    assert srv.token == token0
    out = srv.output
    assert "lost its last replica" in out and "starting the server job again in 1 s (restart 1 of 3" in out, out[-3000:]
    rc, out = srv.stop()
    assert rc == 0 and "the server drained and stopped cleanly" in out, out[-3000:]
