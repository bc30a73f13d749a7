"""Streaming, resumable batch mode under real ``mpiexec`` (``[Note: streaming batch mode]``).

200,000 toy rows from a chunked HDF5 file and from a directory of ``.npy`` shards equal the whole
model row by row; the frontend's peak RSS (VmHWM) at 20,000 and 200,000 rows is within 10%; a job
SIGKILLed half-way and run again finishes with every row committed exactly once (``done_count``);
a re-run with another input is refused; a bad input is refused before any work.
"""

from __future__ import annotations

import itertools
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

from tests.mpi.jobs import MPIEXEC

pytestmark = pytest.mark.mpi

torch = pytest.importorskip("torch")
h5py = pytest.importorskip("h5py")
if MPIEXEC is None:  # pragma: no cover
    pytest.skip("no mpiexec on PATH", allow_module_level=True)

N_BIG = 200_000
RUNTIME = {"max_inflight": 256, "chunk_rows": 8192, "progress_s": 1.0, "request_timeout_s": 60.0}


@pytest.fixture(scope="module")
def toy(switchboards: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The toy cut into components (whatever the partitioner makes of it), a plan, 200k inputs and the
    whole model's outputs for them."""
    from hpcsplit.core.plan import Plan, RankEntry
    from hpcsplit.switchboard.reader import Switchboard

    sb_dir = switchboards("toy_mlp", stages=2, max_branches=2)
    sb = Switchboard.load(sb_dir)
    d = tmp_path_factory.mktemp("batch_stream")
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    for c in sb.order:
        ranks.append(RankEntry(len(ranks), "component", 0, None, None, 1, c, 32, 0))
    Plan(sb.model_name, sb.sha256, "cpu", 1, tuple(ranks), dict.fromkeys(sb.order, 0.0), {}).save(d / "plan.json")
    (spec,) = sb.layout.inputs
    x = np.random.default_rng(0).standard_normal((N_BIG, *spec.shape[1:])).astype(np.float32)
    whole = sb.load_whole()
    with torch.no_grad():
        ref = np.concatenate([whole(torch.from_numpy(x[i:i + 20_000]))[0].numpy() for i in range(0, N_BIG, 20_000)])
    with h5py.File(d / "in.h5", "w") as f:
        f.create_dataset(spec.name, data=x, chunks=(4096, x.shape[1]))
    return {"sb": sb_dir, "dir": d, "ranks": len(ranks), "x": x, "ref": ref, "name": spec.name}


def _cmd(toy: dict, run: Path, runtime: dict) -> list[str]:
    run.mkdir(parents=True, exist_ok=True)
    cfg = {"stage": "serve", "plan": str(toy["dir"] / "plan.json"), "switchboard": str(toy["sb"]),
           "runtime": {**RUNTIME, **runtime}}
    (run / "cfg.json").write_text(json.dumps(cfg))
    return [MPIEXEC, "-n", str(toy["ranks"]), sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank",
            "hpcsplit.runtime.stage:mpi_main", str(run / "cfg.json"), str(run)]


ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _serve(toy: dict, run: Path, runtime: dict, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(toy, run, runtime), capture_output=True, text=True, timeout=timeout_s, env=ENV,
                          check=False)


def _summary(run: Path) -> dict:
    return json.loads((run / "runtime.mpi_main.result.json").read_text())["variants"]["split"]


def _check_outputs(path: Path, ref: np.ndarray) -> None:
    with h5py.File(path, "r") as f:
        assert f["done"][()].all()
        assert (f["done_count"][()] == 1).all(), "a row was committed twice (or never)"
        np.testing.assert_allclose(f["output"][()], ref, rtol=1e-4, atol=1e-5)


def test_200k_rows_chunked_hdf5_equal_the_whole_model_in_bounded_memory(toy: dict, tmp_path: Path) -> None:
    p = _serve(toy, tmp_path / "h5", {"input_path": str(toy["dir"] / "in.h5"),
                                      "output_path": str(tmp_path / "out.h5")})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "batch progress:" in p.stderr
    big = _summary(tmp_path / "h5")
    assert big["done"] == N_BIG and big["served"] == N_BIG and big["failed"] == 0
    _check_outputs(tmp_path / "out.h5", toy["ref"])

    with h5py.File(tmp_path / "in20k.h5", "w") as f:
        f.create_dataset(toy["name"], data=toy["x"][:20_000], chunks=(4096, toy["x"].shape[1]))
    p = _serve(toy, tmp_path / "small", {"input_path": str(tmp_path / "in20k.h5"),
                                         "output_path": str(tmp_path / "out3.h5")})
    assert p.returncode == 0, p.stderr[-3000:]
    small = _summary(tmp_path / "small")
    r20, r200 = small["frontend_peak_rss_mb"], big["frontend_peak_rss_mb"]
    print(f"\nfrontend peak RSS (VmHWM): 20,000 rows {r20:.1f} MiB, 200,000 rows {r200:.1f} MiB "
          f"({100 * (r200 / r20 - 1):+.1f}%); batch {big['throughput_rps']:.0f} rows/s")
    assert abs(r200 - r20) <= 0.10 * r20


def _frontend_pid(root: int) -> int | None:
    """The rank-0 process under ``root`` (PMI_RANK=0 in its environment)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"hpcsplit.launch.rank" in cmd and b"PMI_RANK=0" in env and f"HPCSPLIT_TEST_JOB={root}".encode() in env:
            return int(pid)
    return None


def test_200k_shards_kill_9_then_rerun_finishes_exactly_once_and_mismatch_is_refused(toy: dict, tmp_path: Path) -> None:
    n = N_BIG
    shards = tmp_path / "shards"  # uneven .npy shards, in name order
    shards.mkdir()
    cuts = [0, 1, 70_001, 130_000, n]
    for k, (a, b) in enumerate(itertools.pairwise(cuts)):
        np.save(shards / f"part-{k:03d}.npy", toy["x"][a:b])
    runtime = {"input_path": str(shards), "output_path": str(tmp_path / "out.h5")}
    run = tmp_path / "run"
    env = dict(ENV, HPCSPLIT_TEST_JOB=str(os.getpid()))
    proc = subprocess.Popen(_cmd(toy, run, runtime), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        done = 0
        while time.monotonic() < deadline and proc.poll() is None:
            prog = run / "batch-progress.txt"
            if prog.exists():
                done = int(prog.read_text().split("batch progress: ")[1].split("/")[0])
                if done >= n // 3:
                    break
            time.sleep(0.2)
        assert proc.poll() is None, "the job ended before it could be killed"
        pid = _frontend_pid(os.getpid())
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the frontend: hydra then kills every rank
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with h5py.File(tmp_path / "out.h5", "r") as f:  # what the kill left: readable, done rows whole
        kept = int(f["done"][()].sum())
        assert 0 < kept < n
        assert (f["done_count"][()] <= 1).all()
        ok = f["done"][()]
        np.testing.assert_allclose(f["output"][()][ok], toy["ref"][:n][ok], rtol=1e-4, atol=1e-5)
    p = _serve(toy, run, runtime)
    assert p.returncode == 0, p.stderr[-3000:]
    s = _summary(run)
    print(f"\nkill -9 after {done} rows reported: {kept} rows kept on disk, {s['served']} served on re-run")
    assert s["kept"] == kept and s["served"] == n - kept
    _check_outputs(tmp_path / "out.h5", toy["ref"][:n])

    x2 = np.load(shards / "part-002.npy")  # another input: same file names, shapes and sizes, other rows
    np.save(shards / "part-002.npy", np.random.default_rng(1).standard_normal(x2.shape).astype(x2.dtype))
    p = _serve(toy, tmp_path / "run2", runtime)
    assert p.returncode != 0
    assert "refusing to continue it" in p.stderr and "another input" in p.stderr, p.stderr[-2000:]
    assert "batch progress" not in p.stderr


def test_bad_input_is_refused_before_work(toy: dict, tmp_path: Path) -> None:
    bad = tmp_path / "bad.h5"
    with h5py.File(bad, "w") as f:
        f.create_dataset(toy["name"], data=np.zeros((10, toy["x"].shape[1] + 1), np.float32))
    p = _serve(toy, tmp_path / "run", {"input_path": str(bad), "output_path": str(tmp_path / "out.h5")}, 120)
    assert p.returncode != 0
    assert f"{bad}" in p.stderr and f"array '{toy['name']}' has shape (10, 65)" in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "out.h5").exists()  # refused before the outputs file was made


def test_max_failures_stops_the_job_and_keeps_the_rows_done(toy: dict, tmp_path: Path) -> None:
    from hpcsplit.switchboard.reader import Switchboard

    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset(toy["name"], data=toy["x"][:200])
    last = Switchboard.load(toy["sb"]).order[-1]
    p = _serve(toy, tmp_path / "run", {
        "input_path": str(tmp_path / "in.h5"), "output_path": str(tmp_path / "out.h5"), "verify": False,
        "max_inflight": 4, "request_timeout_s": 1.0, "max_failures": 0,
        "fault": {"component": last, "kind": "sleep", "after_batches": 3, "sleep_s": 3.0, "times": 1}}, 120)
    assert p.returncode != 0
    assert "more than runtime.max_failures=0: stopping" in p.stderr, p.stderr[-2000:]
    with h5py.File(tmp_path / "out.h5", "r") as f:
        done = f["done"][()]
        assert 0 < done.sum() < 200 and done[:3].all()


BAD_ROWS = [5, 123, 777, 1999]


def _serve_bad_rows(toy: dict, tmp_path: Path, **runtime: object) -> tuple[subprocess.CompletedProcess, str]:
    """2000 rows of which BAD_ROWS hold a NaN, which the last component refuses (runtime.fault kind=nan)."""
    from hpcsplit.switchboard.reader import Switchboard

    x = toy["x"][:2000].copy()
    x[BAD_ROWS, 0] = np.nan
    with h5py.File(tmp_path / "in.h5", "w") as f:
        f.create_dataset(toy["name"], data=x, chunks=(512, x.shape[1]))
    last = Switchboard.load(toy["sb"]).order[-1]
    p = _serve(toy, tmp_path / "run", {
        "input_path": str(tmp_path / "in.h5"), "output_path": str(tmp_path / "out.h5"), "verify": False,
        "fault": {"component": last, "kind": "nan"}, **runtime}, 180)
    return p, last


def test_a_component_error_fails_only_its_rows_retried_once_and_listed(toy: dict, tmp_path: Path) -> None:
    from hpcsplit.runtime.batch_stream import FAIL_COMPONENT

    p, last = _serve_bad_rows(toy, tmp_path, max_inflight=64)
    # the job ends non-zero (not every row is done) after serving every other row, and says why
    assert p.returncode != 0
    err = p.stderr
    assert f"{len(BAD_ROWS)} rows failed ({len(BAD_ROWS)} component error); retrying them once" in err, err[-3000:]
    assert f"component error (the component raised on this row alone): rows {BAD_ROWS}" in err, err[-3000:]
    assert (f"{len(BAD_ROWS)} row(s) failed after their retry ({len(BAD_ROWS)} component error; ids {BAD_ROWS}"
            in err), err[-3000:]
    assert f"component {last!r}: ValueError: a NaN in the inputs" in err
    good = np.setdiff1d(np.arange(2000), BAD_ROWS)
    with h5py.File(tmp_path / "out.h5", "r") as f:
        done, failed = f["done"][()], f["failed"][()]
        assert done[good].all() and not done[BAD_ROWS].any()
        assert (failed[BAD_ROWS] == FAIL_COMPONENT).all() and (failed[good] == 0).all()
        assert (f["done_count"][()][good] == 1).all()
        # rows that shared a batch with a bad one were served alone, with the same outputs
        np.testing.assert_allclose(f["output"][()][good], toy["ref"][good], rtol=1e-4, atol=1e-5)


def test_component_errors_past_max_failures_stop_the_job(toy: dict, tmp_path: Path) -> None:
    p, _ = _serve_bad_rows(toy, tmp_path, max_failures=2)
    assert p.returncode != 0
    assert "more than runtime.max_failures=2: stopping" in p.stderr, p.stderr[-2000:]
    with h5py.File(tmp_path / "out.h5", "r") as f:
        assert f["done"][()].sum() >= 2000 - len(BAD_ROWS) - 64 * 4  # the rows done are kept
