"""Faults of the serve/bench job under real ``mpiexec``: a silent rank, a killed rank, a stop signal.

Each test starts the job as the launch layer does (``mpiexec -n N python -m mpi4py -m
hpcsplit.launch.rank hpcsplit.runtime.stage:mpi_main CFG RUN``), finds a rank's PID from the process
table (``PMI_RANK`` in its environment), hurts it, and checks what the job leaves: the message naming
the rank, the finished outputs or bench levels on disk, and no process of the job left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

MPIEXEC = shutil.which("mpiexec") or (shutil.which("mpiexec", path=str(Path(sys.executable).parent)))
if MPIEXEC is None:  # pragma: no cover
    pytest.skip("no mpiexec on PATH", allow_module_level=True)
if not Path("/proc/self/environ").exists():  # pragma: no cover
    pytest.skip("needs /proc to find a rank's PID", allow_module_level=True)

torch = pytest.importorskip("torch")
h5py = pytest.importorskip("h5py")

JOB_LIMIT_S = 150.0  # no test's job may run longer (a hang fails the test, it does not hang the suite)


@pytest.fixture(scope="module")
def toy_sb(switchboards: Callable[..., Path]) -> Path:
    return switchboards("toy_mlp", stages=2, max_branches=2)


def _plan(sb_dir: Path, path: Path) -> int:
    from hpcsplit.core.plan import Plan, RankEntry
    from hpcsplit.switchboard.reader import Switchboard

    sb = Switchboard.load(sb_dir)
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    for c in sb.order:
        ranks.append(RankEntry(len(ranks), "component", 0, None, None, 1, c, 1, 0))
    Plan(sb.model_name, sb.sha256, "cpu", 1, tuple(ranks), dict.fromkeys(sb.order, 0.0), {}).save(path)
    return len(ranks)


def _inputs(sb_dir: Path, n: int, path: Path) -> list[np.ndarray]:
    from hpcsplit.switchboard.reader import Switchboard

    sb = Switchboard.load(sb_dir)
    gen = torch.Generator().manual_seed(3)
    arrays = {s.name: torch.randn(ex.shape, generator=gen).numpy()
              for s, ex in zip(sb.layout.inputs, sb.example_inputs(n), strict=True)}
    np.savez(path, **arrays)
    return list(arrays.values())


def _whole(sb_dir: Path, inputs: list[np.ndarray]) -> np.ndarray:
    from hpcsplit.switchboard.reader import Switchboard

    sb = Switchboard.load(sb_dir)
    whole = sb.load_whole()
    with torch.no_grad():
        return np.stack([whole(*(torch.from_numpy(x[i:i + 1]) for x in inputs))[0][0].numpy()
                         for i in range(inputs[0].shape[0])])


class Job:
    """One ``mpiexec`` job in its own session, stdout/stderr to files under ``tmp``."""

    def __init__(self, tmp: Path, cfg: dict, n: int) -> None:
        self.run = tmp / "run"
        (tmp / "cfg.json").write_text(json.dumps(cfg))
        cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank",
               "hpcsplit.runtime.stage:mpi_main", str(tmp / "cfg.json"), str(self.run)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.err_path = tmp / "stderr.txt"
        self._err = open(self.err_path, "w")  # noqa: SIM115 - closed in finish()
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self._err, env=env,
                                  start_new_session=True)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, pred: Callable[[], bool], timeout_s: float, what: str) -> None:
        t_end = time.monotonic() + timeout_s
        while not pred():
            if self.p.poll() is not None:
                pytest.fail(f"the job ended (rc {self.p.returncode}) before {what}:\n{self.stderr[-3000:]}")
            if time.monotonic() > t_end:
                pytest.fail(f"no {what} within {timeout_s} s:\n{self.stderr[-3000:]}")
            time.sleep(0.05)

    def rank_pids(self) -> dict[int, int]:
        """``rank -> PID`` of this job's ranks still alive (``PMI_RANK`` in each one's environment)."""
        return _job_ranks(self.run)

    def finish(self) -> tuple[int, float]:
        """Wait for the job (at most JOB_LIMIT_S from its start); return (exit code, seconds it ran)."""
        try:
            rc = self.p.wait(timeout=max(1.0, JOB_LIMIT_S - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            rc = None
        elapsed = time.monotonic() - self.t0
        self.close()
        if rc is None:
            pytest.fail(f"the job did not end within {JOB_LIMIT_S} s:\n{self.stderr[-3000:]}")
        return rc, elapsed

    def close(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait(timeout=10)
        for pid in _job_ranks(self.run).values():  # never leave a rank behind, whatever the test saw
            os.kill(pid, signal.SIGKILL)
        self._err.close()


def _job_ranks(run_dir: Path) -> dict[int, int]:
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            if b"hpcsplit.launch.rank" not in cmd or str(run_dir).encode() not in cmd:
                continue
            env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "Z":  # a zombie is gone already
            continue
        rank = env.get(b"PMI_RANK", env.get(b"PMIX_RANK"))
        if rank is not None:
            out[int(rank)] = int(d.name)
    return out


@pytest.fixture
def jobs() -> Iterator[list[Job]]:
    made: list[Job] = []
    yield made
    for j in made:
        j.close()


def _last(sb_dir: Path) -> str:
    from hpcsplit.switchboard.reader import Switchboard

    return Switchboard.load(sb_dir).order[-1]


def _batch_cfg(tmp: Path, sb: Path, n_req: int, out: str, **runtime: object) -> dict:
    _inputs(sb, n_req, tmp / "in.npz")
    rt = {"input_path": str(tmp / "in.npz"), "output_path": str(tmp / out), "verify": False, "max_inflight": 4,
          # every batch of the last component sleeps: the job serves long enough to be hurt mid-way
          "fault": {"component": _last(sb), "kind": "sleep", "after_batches": 0, "sleep_s": 0.05,
                    "times": 100000}}
    rt.update(runtime)
    return {"stage": "serve", "plan": str(tmp / "plan.json"), "switchboard": str(sb), "runtime": rt}


def _read(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    with h5py.File(path, "r", locking=False) as f:
        return {k: f[k][()] for k in f}


def _rows_done(path: Path) -> int:
    try:
        with h5py.File(path, "r", locking=False) as f:
            return int(f["done"][()].sum())
    except (OSError, KeyError):
        return 0


def _no_ranks_left(run_dir: Path) -> None:
    t_end = time.monotonic() + 10  # hydra reaps its ranks just after it exits
    while _job_ranks(run_dir) and time.monotonic() < t_end:
        time.sleep(0.1)
    assert not _job_ranks(run_dir), f"ranks of the job still running: {_job_ranks(run_dir)}"


def _check_done_rows(sb: Path, tmp: Path, out: dict[str, np.ndarray]) -> int:
    with np.load(tmp / "in.npz") as z:
        inputs = [z[k] for k in z.files]
    done = out["done"]
    ref = _whole(sb, inputs)
    np.testing.assert_allclose(out["output"][done], ref[done], rtol=1e-4, atol=1e-5)
    assert not out["output"][~done].any()  # rows not done are zeros
    return int(done.sum())


def test_sigstop_component_names_rank_within_bound(tmp_path: Path, toy_sb: Path, jobs: list[Job]) -> None:
    n = _plan(toy_sb, tmp_path / "plan.json")
    timeout_s, grace_s = 2.0, 3.0
    bound = timeout_s + grace_s
    cfg = _batch_cfg(tmp_path, toy_sb, 300, "out.h5", request_timeout_s=timeout_s, stop_grace_s=grace_s)
    job = Job(tmp_path, cfg, n)
    jobs.append(job)
    job.wait_for(lambda: _rows_done(tmp_path / "out.h5") >= 3, 90, "finished rows")
    victim = job.rank_pids()[2]
    os.kill(victim, signal.SIGSTOP)
    t_stop = time.monotonic()
    rc, _ = job.finish()
    after = time.monotonic() - t_stop
    # the frontend: requests time out (timeout_s), then it waits `bound` for the silent rank's counters
    print(f"bound {bound:g} s (request_timeout_s {timeout_s:g} + stop_grace_s {grace_s:g}); the job ended "
          f"{after:.1f} s after SIGSTOP")
    assert rc != 0
    err = job.stderr
    named = f"rank 2 (component '{_last(toy_sb)}' replica 0, node 0, host"
    assert "RankSilentError" in err and named in err, err[-3000:]
    assert after < timeout_s + bound + 30  # generous: 2 shared cores
    assert 0 < _check_done_rows(toy_sb, tmp_path, _read(tmp_path / "out.h5")) < 300
    _no_ranks_left(job.run)


def test_sigkill_component_keeps_finished_outputs(tmp_path: Path, toy_sb: Path, jobs: list[Job]) -> None:
    n = _plan(toy_sb, tmp_path / "plan.json")
    job = Job(tmp_path, _batch_cfg(tmp_path, toy_sb, 300, "out.h5"), n)
    jobs.append(job)
    job.wait_for(lambda: _rows_done(tmp_path / "out.h5") >= 5, 90, "finished rows")
    os.kill(job.rank_pids()[2], signal.SIGKILL)
    rc, _ = job.finish()
    assert rc != 0
    done = _check_done_rows(toy_sb, tmp_path, _read(tmp_path / "out.h5"))
    assert 5 <= done < 300
    _no_ranks_left(job.run)


def test_sigterm_to_mpiexec_writes_partial_outputs(tmp_path: Path, toy_sb: Path, jobs: list[Job]) -> None:
    n = _plan(toy_sb, tmp_path / "plan.json")
    job = Job(tmp_path, _batch_cfg(tmp_path, toy_sb, 300, "out.npz"), n)
    jobs.append(job)
    job.wait_for(lambda: _rows_done(tmp_path / "out.npz.partial.h5") >= 3, 90, "finished rows")
    job.p.send_signal(signal.SIGTERM)  # as the login side does: hydra forwards it to every rank
    rc, _ = job.finish()
    assert rc != 0
    err = job.stderr
    assert "JobInterrupted: SIGTERM received: stopped admitting" in err and "of 300 rows are done in" in err, \
        err[-3000:]
    out = _read(tmp_path / "out.npz")
    assert "hpcsplit_outputs" in out
    assert 3 <= _check_done_rows(toy_sb, tmp_path, out) < 300
    assert (tmp_path / "out.npz.partial.h5").exists()  # kept: the same command continues from it
    _no_ranks_left(job.run)


def test_sigterm_during_bench_keeps_finished_levels(tmp_path: Path, toy_sb: Path, jobs: list[Job]) -> None:
    n = _plan(toy_sb, tmp_path / "plan.json")
    cfg = {"stage": "bench", "plan": str(tmp_path / "plan.json"), "switchboard": str(toy_sb),
           "runtime": {"verify": False},
           "bench": {"qps": [20, 20, 20, 20, 20, 20], "duration_s": 1.0, "min_requests": 0, "warmup_s": 0,
                     "arrival": "constant", "floor_runs": 0}}
    job = Job(tmp_path, cfg, n)
    jobs.append(job)
    levels = tmp_path / "run" / "bench" / "levels.csv"

    def _rows() -> int:
        return max(0, len(levels.read_text().splitlines()) - 1) if levels.exists() else 0

    job.wait_for(lambda: _rows() >= 2, 120, "finished bench levels")
    job.p.send_signal(signal.SIGTERM)
    rc, _ = job.finish()
    assert rc != 0
    assert "finished bench levels are in" in job.stderr, job.stderr[-3000:]
    rows = levels.read_text().splitlines()
    assert rows[0].startswith("variant,offered_qps") and len(rows) >= 3
    assert all(r.startswith("whole,") for r in rows[1:3])
    _no_ranks_left(job.run)


def test_sigstop_during_the_whole_model_variant_is_named_within_the_serving_bound(
        tmp_path: Path, toy_sb: Path, jobs: list[Job]) -> None:
    """A component stopped while the bench serves the whole model is named at the end of that variant, within
    runtime.request_timeout_s + runtime.stop_grace_s, not at the next variant's load_timeout_s (600 s)."""
    n = _plan(toy_sb, tmp_path / "plan.json")
    timeout_s, grace_s = 2.0, 3.0
    cfg = {"stage": "bench", "plan": str(tmp_path / "plan.json"), "switchboard": str(toy_sb),
           "runtime": {"verify": False, "request_timeout_s": timeout_s, "stop_grace_s": grace_s},
           "bench": {"qps": [20, 20], "duration_s": 2.0, "min_requests": 0, "warmup_s": 0, "arrival": "constant",
                     "floor_runs": 0, "request_timeout_s": 1.0}}
    job = Job(tmp_path, cfg, n)
    jobs.append(job)
    levels = tmp_path / "run" / "bench" / "levels.csv"
    job.wait_for(lambda: levels.exists() and len(levels.read_text().splitlines()) >= 2, 120, "a whole-model level")
    os.kill(job.rank_pids()[2], signal.SIGSTOP)  # during the second whole-model level
    t_stop = time.monotonic()
    rc, _ = job.finish()
    after = time.monotonic() - t_stop
    print(f"SIGSTOP in the whole variant: named {after:.1f} s later (bound {timeout_s + grace_s:g} s after the "
          "variant's last level of 2 s)")
    assert rc != 0
    err = job.stderr
    assert f"rank 2 (component '{_last(toy_sb)}' replica 0, node 0, host" in err and "(whole: serving ended)" in err, \
        err[-3000:]
    assert after < 2.0 + timeout_s + grace_s + 30  # generous: 2 shared cores; before, 600 s (load_timeout_s)
    _no_ranks_left(job.run)


def test_the_stream_file_holds_request_latencies_after_a_kill(tmp_path: Path, toy_sb: Path,
                                                              jobs: list[Job]) -> None:
    """After kill -9 of the frontend, the outputs stream on disk holds each row's latency (admission to
    output: about max_inflight batches of the slow component), not the time since the job started."""
    n = _plan(toy_sb, tmp_path / "plan.json")
    job = Job(tmp_path, _batch_cfg(tmp_path, toy_sb, 300, "out.h5", max_inflight=2), n)
    jobs.append(job)
    job.wait_for(lambda: _rows_done(tmp_path / "out.h5") >= 40, 90, "finished rows")
    served_s = time.monotonic() - job.t0
    os.kill(job.rank_pids()[0], signal.SIGKILL)
    job.finish()
    out = _read(tmp_path / "out.h5")
    lat = out["latency_ms"][out["done"]]
    print(f"{len(lat)} rows on disk after {served_s:.1f} s: latency p50 {np.median(lat):.0f} ms, max {lat.max():.0f} ms")
    assert len(lat) >= 40 and np.isfinite(lat).all()
    assert lat.min() >= 40  # each row waited at least one 50 ms batch of the slow component (timer slack aside)
    assert lat.max() < 1000  # two in flight: about 100 ms each; time since the start would reach the seconds served


def test_foreign_output_file_is_refused_before_any_work(tmp_path: Path, toy_sb: Path, jobs: list[Job]) -> None:
    n = _plan(toy_sb, tmp_path / "plan.json")
    foreign = tmp_path / "profile.h5"
    with h5py.File(foreign, "w") as f:
        f["keep"] = np.arange(3)
    job = Job(tmp_path, _batch_cfg(tmp_path, toy_sb, 5, "profile.h5", fault=None), n)
    jobs.append(job)
    rc, _ = job.finish()
    assert rc != 0
    assert "exists and is not an hpcsplit outputs file" in job.stderr and "runtime.overwrite=true" in job.stderr
    with h5py.File(foreign, "r") as f:
        assert list(f) == ["keep"]
    _no_ranks_left(job.run)


def test_profile_ghost_component_names_the_valid_ones(tmp_path: Path, toy_sb: Path) -> None:
    from hpcsplit.core.settings import group_defaults

    prof = group_defaults("profile") | {"components": ["ghost"], "device": "cpu", "max_batch": 1, "threads": [1]}
    cfg = {"stage": "profile", "switchboard": str(toy_sb), "profile": prof}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    cmd = [MPIEXEC, "-n", "1", sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank",
           "hpcsplit.profiling.stage:mpi_main", str(tmp_path / "cfg.json"), str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode != 0
    from hpcsplit.switchboard.reader import Switchboard

    valid = list(Switchboard.load(toy_sb).components)
    assert "ProfileError: profile.components names ['ghost'], not components of" in p.stderr, p.stderr[-3000:]
    assert f"valid: {valid}" in p.stderr and "KeyError" not in p.stderr
