"""The serve stage under real ``mpiexec`` (3-4 ranks, subprocesses with timeouts).

Batch-mode outputs equal the whole model's (each request = the model at batch 1); a raising rank
stops the job within seconds with rank, component and request in the message; a slow component
triggers the timeout path.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

MPIEXEC = shutil.which("mpiexec") or (shutil.which("mpiexec", path=str(Path(sys.executable).parent)))
if MPIEXEC is None:  # pragma: no cover
    pytest.skip("no mpiexec on PATH", allow_module_level=True)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="session")
def toy_sb(switchboards: Callable[..., Path]) -> Path:
    """The toy cut into a chain of two components (the second replicated and faulted below)."""
    return switchboards("toy_mlp", stages=2, max_branches=2)


@pytest.fixture(scope="session")
def clip_sb(switchboards: Callable[..., Path]) -> Path:
    pytest.importorskip("transformers")
    return switchboards("clip_tiny")


def _last(sb_dir: Path) -> str:
    """The last component of a switchboard (the one a chain's replicas and faults go to)."""
    from hpcsplit.switchboard.reader import Switchboard

    return Switchboard.load(sb_dir).order[-1]


def _plan(sb_dir: Path, path: Path, replicas: dict[str, int] | None = None, batch: int = 4) -> int:
    from hpcsplit.core.plan import Plan, RankEntry
    from hpcsplit.switchboard.reader import Switchboard

    sb = Switchboard.load(sb_dir)
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    for c in sb.order:
        for k in range((replicas or {}).get(c, 1)):
            ranks.append(RankEntry(len(ranks), "component", 0, None, None, 1, c, batch, k))
    Plan(sb.model_name, sb.sha256, "cpu", 1, tuple(ranks), dict.fromkeys(sb.order, 0.0), {}).save(path)
    return len(ranks)


def _inputs(sb_dir: Path, n: int, path: Path) -> list[np.ndarray]:
    """``n`` distinct random requests shaped like the switchboard's inputs, saved to ``path``."""
    from hpcsplit.switchboard.reader import Switchboard

    sb = Switchboard.load(sb_dir)
    gen = torch.Generator().manual_seed(1)
    arrays = {}
    for spec, ex in zip(sb.layout.inputs, sb.example_inputs(n), strict=True):
        if ex.is_floating_point():
            arrays[spec.name] = torch.randn(ex.shape, generator=gen).numpy()
        else:
            hi = int(ex.max()) + 1
            arrays[spec.name] = torch.randint(max(hi - 1, 1), hi, ex.shape, generator=gen).numpy()
    if path.suffix == ".npz":
        np.savez(path, **arrays)
    else:
        import h5py

        with h5py.File(path, "w") as f:
            for k, v in arrays.items():
                f.create_dataset(k, data=v)
    return list(arrays.values())


def _whole_per_request(sb_dir: Path, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """The whole program run on each request alone (batch 1), first batch dim dropped, stacked."""
    from hpcsplit.switchboard.reader import Switchboard

    sb = Switchboard.load(sb_dir)
    whole = sb.load_whole()
    rows: list[list[np.ndarray]] = []
    with torch.no_grad():
        for i in range(inputs[0].shape[0]):
            outs = whole(*(torch.from_numpy(x[i:i + 1]) for x in inputs))
            rows.append([o.movedim(spec.batch_dims[0], 0)[0].numpy()
                         for o, spec in zip(outs, sb.layout.outputs, strict=True)])
    return [np.stack([r[j] for r in rows]) for j in range(len(rows[0]))]


def _serve(tmp: Path, sb_dir: Path, n_ranks: int, runtime: dict, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    cfg = {"stage": "serve", "plan": str(tmp / "plan.json"), "switchboard": str(sb_dir), "runtime": runtime}
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    cmd = [MPIEXEC, "-n", str(n_ranks), sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank",
           "hpcsplit.runtime.stage:mpi_main", str(tmp / "cfg.json"), str(tmp / "run")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)


def _read(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".npz":
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    import h5py

    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}


def test_toy_batch_mode_equals_whole_model(tmp_path: Path, toy_sb: Path) -> None:
    last = _last(toy_sb)
    n = _plan(toy_sb, tmp_path / "plan.json", replicas={last: 2}, batch=3)
    assert n == 4
    inputs = _inputs(toy_sb, 23, tmp_path / "in.npz")
    p = _serve(tmp_path, toy_sb, n, {"input_path": str(tmp_path / "in.npz"),
                                     "output_path": str(tmp_path / "out.npz"), "max_inflight": 5,
                                     "trace": {"start_step": 0, "end_step": 8}})
    assert p.returncode == 0, p.stderr[-3000:]
    out = _read(tmp_path / "out.npz")
    ref = _whole_per_request(toy_sb, inputs)
    assert out["done"].all()
    np.testing.assert_allclose(out["output"], ref[0], rtol=1e-4, atol=1e-5)
    result = json.loads((tmp_path / "run" / "runtime.mpi_main.result.json").read_text())
    # OMP settings were applied before torch loaded OpenMP
    assert "OMP_WAIT_POLICY=PASSIVE" in result["threads"] and "imported before" not in result["threads"]
    comp = [r for r in result["ranks"] if r["component"] == last]
    assert sorted(r["rank"] for r in comp) == [2, 3]
    assert sum(r["requests"] for r in comp) >= 23  # both replicas share the work (+ the check requests)
    assert all(r["requests"] > 0 for r in comp)
    trace = json.loads((tmp_path / "run" / "trace" / "rank1.json").read_text())
    assert {e["name"] for e in trace["traceEvents"]} >= {"recv", "compute", "send"}


def test_clip_tiny_batch_mode_equals_whole_model(tmp_path: Path, clip_sb: Path) -> None:
    n = _plan(clip_sb, tmp_path / "plan.json", batch=4)
    assert n == 4
    inputs = _inputs(clip_sb, 11, tmp_path / "in.h5")
    p = _serve(tmp_path, clip_sb, n, {"input_path": str(tmp_path / "in.h5"),
                                      "output_path": str(tmp_path / "out.h5")})
    assert p.returncode == 0, p.stderr[-3000:]
    out = _read(tmp_path / "out.h5")
    ref = _whole_per_request(clip_sb, inputs)
    assert out["done"].all()
    np.testing.assert_allclose(out["output"], ref[0], rtol=1e-4, atol=1e-5)
    assert "match the reference" in p.stderr


def _served_plan(sb_dir: Path, path: Path, served: list[str], batch: int = 4) -> int:
    """A plan whose ranks serve ``served`` (components, groups ``a+b``, or ``whole``), one rank each."""
    from hpcsplit.core.plan import Plan, RankEntry
    from hpcsplit.switchboard.reader import Switchboard

    sb = Switchboard.load(sb_dir)
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    ranks += [RankEntry(i + 1, "component", 0, None, None, 1, c, batch, 0) for i, c in enumerate(served)]
    Plan(sb.model_name, sb.sha256, "cpu", 1, tuple(ranks), dict.fromkeys(served, 0.0), {}).save(path)
    return len(ranks)


@pytest.mark.parametrize("kind", ["towers as one group", "whole"])
def test_a_region_left_unsplit_or_the_whole_model_serve_the_same_outputs(tmp_path: Path, clip_sb: Path,
                                                                         kind: str) -> None:
    """What ``allocate.rate_rps`` may choose ([Note: component groups]): CLIP's towers back to back on one rank,
    or the unsplit program; batch-mode outputs equal the whole model's per request."""
    from hpcsplit.core.grouping import group_name
    from hpcsplit.switchboard.reader import Switchboard

    order = list(Switchboard.load(clip_sb).order)
    towers = [c for c in order if c != order[-1]]  # the parallel towers; the last component joins them
    served = [group_name(towers, order), order[-1]] if kind != "whole" else ["whole"]
    n = _served_plan(clip_sb, tmp_path / "plan.json", served)
    inputs = _inputs(clip_sb, 9, tmp_path / "in.npz")
    p = _serve(tmp_path, clip_sb, n, {"input_path": str(tmp_path / "in.npz"), "output_path": str(tmp_path / "out.npz")})
    assert p.returncode == 0, p.stderr[-3000:]
    out = _read(tmp_path / "out.npz")
    np.testing.assert_allclose(out["output"], _whole_per_request(clip_sb, inputs)[0], rtol=1e-4, atol=1e-5)
    assert out["done"].all() and f"'{served[0]}' runs on its example inputs" in p.stderr


def test_raising_rank_fails_its_rows_and_ends_the_job_quickly_with_message(tmp_path: Path, toy_sb: Path) -> None:
    """Batch mode ([Note: failed rows]): a component that raises on every batch fails every row it gets (each
    tried alone, then retried once) and the job ends non-zero within seconds, the rows done before kept."""
    n = _plan(toy_sb, tmp_path / "plan.json", batch=2)
    last = _last(toy_sb)
    _inputs(toy_sb, 40, tmp_path / "in.npz")
    t0 = time.monotonic()
    p = _serve(tmp_path, toy_sb, n, {"input_path": str(tmp_path / "in.npz"), "verify": False,
                                     "output_path": str(tmp_path / "out.npz"), "max_inflight": 4,
                                     "fault": {"component": last, "kind": "raise", "after_batches": 3}},
               timeout_s=90)
    elapsed = time.monotonic() - t0
    assert p.returncode != 0
    assert f"[rank 2] {last}: " in p.stderr and "request(s) failed alone" in p.stderr, p.stderr[-3000:]
    assert "injected fault" in p.stderr
    assert "row(s) failed after their retry" in p.stderr and "component error" in p.stderr
    out = _read(tmp_path / "out.npz")  # what finished before the error was written
    assert 0 < out["done"].sum() < 40
    assert elapsed < 60


def test_slow_component_times_out(tmp_path: Path, toy_sb: Path) -> None:
    n = _plan(toy_sb, tmp_path / "plan.json", batch=1)
    _inputs(toy_sb, 6, tmp_path / "in.npz")
    p = _serve(tmp_path, toy_sb, n, {"input_path": str(tmp_path / "in.npz"), "verify": False,
                                     "output_path": str(tmp_path / "out.npz"), "request_timeout_s": 1.0,
                                     "fault": {"component": _last(toy_sb), "kind": "sleep", "after_batches": 2,
                                               "sleep_s": 3.0, "times": 1}},
               timeout_s=90)
    assert p.returncode != 0
    assert "exceeded runtime.request_timeout_s" in p.stderr
    out = _read(tmp_path / "out.npz")
    assert out["done"][:2].all() and not out["done"].all()


def test_bench_mode_writes_results_and_table(tmp_path: Path, clip_sb: Path) -> None:
    from hpcsplit.switchboard.reader import Switchboard

    order = Switchboard.load(clip_sb).order
    n = _plan(clip_sb, tmp_path / "plan.json", replicas={order[0]: 2}, batch=2)
    cfg = {"stage": "bench", "plan": str(tmp_path / "plan.json"), "switchboard": str(clip_sb),
           "runtime": {"verify": False},
           "bench": {"qps": [10, 40], "duration_s": 1.0, "min_requests": 0, "warmup_s": 0,
                     "arrival": "constant"}}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank",
           "hpcsplit.runtime.stage:mpi_main", str(tmp_path / "cfg.json"), str(tmp_path / "run")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Latency Improvement (%)" in p.stdout
    bench = tmp_path / "run" / "bench"
    rows = (bench / "summary.csv").read_text().splitlines()
    assert rows[0].startswith("variant,offered_qps") and len(rows) == 5  # header + 2 variants x 2 levels
    assert (bench / "latency_vs_qps.png").stat().st_size > 0 and (bench / "throughput_vs_qps.png").exists()
    record = json.loads((bench / "bench.json").read_text())  # what stage=simulate replays: schedule and policy
    assert record["qps"] == [10, 40] and record["spin_us"] == 50.0  # bench mode: mailbox.SPIN_S
    # each level's CPU of the ranks on the frontend's node (all of them here), read from /proc around the level
    with open(bench / "levels.csv", newline="") as fh:
        cores = [float(r["cpu_cores"]) for r in csv.DictReader(fh)]
    assert len(cores) == 4 and all(0 < c <= (os.cpu_count() or 1) + 0.5 for c in cores), cores
    assert f"the {n} ranks on this node used" in p.stderr
    # ... and each rank's share of it, named by its component (which rank a CPU node's load falls on)
    with open(bench / "rank_cpu.csv", newline="") as fh:
        each = list(csv.DictReader(fh))
    assert len(each) == 4 * n and {r["rank"] for r in each} == {str(i) for i in range(n)}
    assert {r["component"] for r in each if r["rank"] == "0"} == {"frontend"}
    assert {r["component"] for r in each if r["variant"] == "whole" and r["rank"] != "0"} == {"whole"}
    assert {r["component"] for r in each if r["variant"] == "split" and r["rank"] != "0"} == set(order)
    for (variant, qps), total in zip([(v, q) for v in ("whole", "split") for q in ("10.0", "40.0")], cores, strict=True):
        mine = [float(r["cpu_cores"]) for r in each if r["variant"] == variant and r["offered_qps"] == qps]
        assert len(mine) == n and all(c >= 0 for c in mine) and abs(sum(mine) - total) < 1e-3 * n, (variant, qps, mine)
    assert p.stderr.count("cores used per rank: 0 frontend") == 4
    import h5py

    with h5py.File(bench / "requests.h5") as f:
        lvl = f["split/qps_10"]
        assert lvl["latency_ms"].shape == (10,) and lvl.attrs["n_ok"] == 10
        assert set(f) == {"whole", "split", "improvement"}
    # the floor re-measured before the split levels: the first replica of each component, once
    timed = [ln for ln in p.stderr.splitlines() if "batch of one, back to back" in ln]
    assert len(timed) == len(order), timed
    assert sum(f"'{order[0]}'" in ln for ln in timed) == 1
    line = next(ln for ln in p.stdout.splitlines() if "re-measured on the ranks" in ln)
    assert all(c in line for c in order) and "x the floor" in line


@pytest.mark.slow
def test_toy_with_joins_on_seven_ranks(tmp_path: Path, switchboards: Callable[..., Path]) -> None:
    sb_dir = switchboards("toy_mlp")  # 6 components, 2 joins
    n = _plan(sb_dir, tmp_path / "plan.json", batch=4)
    assert n == 7
    inputs = _inputs(sb_dir, 17, tmp_path / "in.npz")
    p = _serve(tmp_path, sb_dir, n, {"input_path": str(tmp_path / "in.npz"),
                                     "output_path": str(tmp_path / "out.npz"), "max_inflight": 6})
    assert p.returncode == 0, p.stderr[-3000:]
    out = _read(tmp_path / "out.npz")
    np.testing.assert_allclose(out["output"], _whole_per_request(sb_dir, inputs)[0], rtol=1e-4, atol=1e-5)
