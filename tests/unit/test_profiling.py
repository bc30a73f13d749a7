"""The measuring loop, settings, OOM handling and the analysis, on toy and tiny CLIP switchboards."""

from __future__ import annotations

import csv
import importlib.util
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hpcsplit.core.profile_format import read_profile
from hpcsplit.core.settings import group_defaults
from hpcsplit.errors import ConfigError, ProfileError
from hpcsplit.profiling.measure import measure_callable
from hpcsplit.profiling.runner import default_batch_sizes, profile_components, profile_components_mpi
from hpcsplit.profiling.stage import SETTINGS, AnalyzeSettings, ProfileSettings, run_analyze
from tests.unit.profile_toys import ToySwitchboard

GRID = {"batch_sizes": [1, 2, 4, 8], "slices": [1, 2], "warmup": 1, "iters": 3, "progress": False}


def _profile(**over: object) -> dict[str, object]:
    """The ``profile`` group of conf/profile/default.yaml with ``over`` changed."""
    return {**group_defaults("profile"), **over}


def test_default_batch_sizes() -> None:
    assert default_batch_sizes(16) == (1, 2, 4, 8, 16)
    assert default_batch_sizes(1) == (1,)
    assert default_batch_sizes(12) == (1, 2, 4, 8, 12)


def test_settings_from_config_defaults_come_from_the_cluster() -> None:
    s = ProfileSettings.from_config(
        {
            "profile": _profile(max_batch=4, device="cpu"),
            "cluster": {"cpu_threads": [1, 2, 4], "cores_per_node": 8},
        }
    )
    assert s.batch_sizes == (1, 2, 4) and s.slices == (1.0, 2.0, 4.0) and s.device_kind == "cpu"
    assert s.cores_per_node == 8 and s.warmup == 2 and s.iters == 10
    s2 = ProfileSettings.from_config({"profile": _profile(threads=[3], batch_sizes=[2, 5], device="cpu")})
    assert s2.slices == (3.0,) and s2.batch_sizes == (2, 5)
    assert SETTINGS["profile"] is ProfileSettings


def test_settings_list_every_problem_at_once() -> None:
    with pytest.raises(ConfigError) as ei:
        ProfileSettings.from_config(
            {"profile": _profile(device="tpu", batch_sizes=[4, 2], threads=[1.5], iters=0, itres=3)}
        )
    msg = str(ei.value)
    for part in ("profile.device = 'tpu'", "profile.batch_sizes = [4, 2]", "whole thread counts",
                 "profile.iters = 0", "profile.itres is not a setting (did you mean 'iters'?)"):
        assert part in msg, msg


@pytest.mark.parametrize("cluster", ["local", "dev"])
def test_settings_from_the_composed_config(cluster: str, compose: Any, tmp_path: Path) -> None:
    cfg = compose(f"cluster={cluster}", "profile.device=cpu", "+experiment=toy")
    s = ProfileSettings.from_config(cfg)
    assert s.batch_sizes == default_batch_sizes(cfg["profile"]["max_batch"])
    assert s.slices == tuple(float(t) for t in cfg["cluster"]["cpu_threads"]) and s.device_kind == "cpu"
    assert AnalyzeSettings.from_config(cfg).analysis_dir is None
    with pytest.raises(ConfigError, match="profile.analysis_dri is not a setting .did you mean 'analysis_dir'"):
        run_analyze({**cfg, "profile": {**cfg["profile"], "analysis_dri": "x"}}, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_requested_without_cuda_says_so() -> None:
    with pytest.raises(ConfigError, match="torch.cuda.is_available\\(\\) is False"):
        ProfileSettings.from_config({"profile": _profile(device="cuda")})


def test_measure_callable_on_a_plain_callable() -> None:
    big = 1_000_000  # floats: 4 MB allocated inside the call and alive at its peak

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x.new_zeros(big)
        z = y + 1.0
        return (x * 2, z.sum())

    x = torch.ones(8, 16)
    m = measure_callable(fn, (x,), warmup=1, iters=5, param_bytes=100, threads=1, cores_per_node=4)
    assert len(m.latency_ms) == 5 and all(t > 0 for t in m.latency_ms) and not m.oom
    assert m.input_bytes == 8 * 16 * 4 and m.output_bytes == 8 * 16 * 4 + 4
    # parameters + inputs + y and z alive together
    assert m.peak_mem_bytes >= 100 + x.numel() * 4 + 2 * big * 4
    assert m.peak_mem_bytes < 100 + x.numel() * 4 + 4 * big * 4
    assert m.utilization == pytest.approx(0.25)
    # process CPU time / wall time: positive, and bounded by the cores (plus timer granularity)
    assert 0.0 < m.cpu_busy_fraction < (os.cpu_count() or 1) + 0.5


def test_measure_callable_records_oom_and_propagates_other_errors() -> None:
    def oom(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 GB")

    m = measure_callable(oom, (torch.ones(2),), warmup=1, iters=2)
    assert m.oom and m.latency_ms == () and "can't allocate" in m.error

    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        measure_callable(broken, (torch.ones(2),), warmup=1, iters=2)


def test_measure_callable_abandons_the_cell_when_asked_to_stop() -> None:
    from hpcsplit.core.device import CellAbandoned

    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x + 1

    with pytest.raises(CellAbandoned):
        measure_callable(fn, (torch.ones(2),), warmup=2, iters=50, stop=lambda: len(calls) >= 4)
    assert len(calls) == 4  # stopped before the 5th run, not after all 52


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_nvml_sampler_without_gpu_gives_nan() -> None:
    from hpcsplit.core.device import NvmlSampler as _NvmlSampler

    with _NvmlSampler(0, 5.0) as s:
        pass
    assert math.isnan(s.mean_fraction())


def test_toy_profile_stops_a_slice_at_its_first_oom(tmp_path: Path) -> None:
    out = tmp_path / "oom.h5"
    summary = profile_components(ToySwitchboard(oom_above=2), out=out, **GRID)
    assert summary["complete"]
    prof = read_profile(out)
    head, enc = prof.components["head"], prof.components["enc"]
    assert not enc.oom.any()
    # batch 4 ran out of memory, batch 8 was not run (inferred), on both slices
    assert head.oom.tolist() == [[False, False], [False, False], [True, True], [True, True]]
    assert head.oom_inferred.tolist() == [[False, False], [False, False], [False, False], [True, True]]
    assert np.isnan(head.latency_ms[2:]).all() and np.isfinite(head.latency_ms[:2]).all()
    assert math.isnan(head.throughput_rps(3, 0))


def test_component_subset_and_unknown_component(tmp_path: Path) -> None:
    out = tmp_path / "sub.h5"
    profile_components(ToySwitchboard(), out=out, components=["head"], **GRID)
    assert list(read_profile(out).components) == ["head"]
    with pytest.raises(ProfileError, match=r"unknown component\(s\) \['tail'\]"):
        profile_components(ToySwitchboard(), out=tmp_path / "x.h5", components=["tail"], **GRID)
    with pytest.raises(ProfileError, match=r"batch_sizes=\[4, 2\] \(need increasing"):
        profile_components(ToySwitchboard(), out=tmp_path / "y.h5", **{**GRID, "batch_sizes": [4, 2]})


def test_threads_slice_is_applied_and_restored(tmp_path: Path) -> None:
    seen: list[int] = []
    sb = ToySwitchboard()
    orig = sb.load_component

    def spy(name: str):  # type: ignore[no-untyped-def]
        fn = orig(name)

        def run(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            seen.append(torch.get_num_threads())
            return fn(*xs)

        return run

    sb.load_component = spy  # type: ignore[method-assign]
    before = torch.get_num_threads()
    profile_components(sb, out=tmp_path / "t.h5", **{**GRID, "batch_sizes": [1], "slices": [1, 2]})
    assert set(seen) == {1, 2}
    assert torch.get_num_threads() == before


def test_analyze_writes_tables_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "run" / "profile.h5"
    profile_components(ToySwitchboard(oom_above=2), out=out, **GRID)
    res = run_analyze({"profile": {"path": str(out)}}, tmp_path / "run")
    assert res["complete"] and res["cells_total"] == 16
    names = sorted(Path(p).name for p in res["plots"])
    assert names == ["latency_vs_batch.png", "peak_mem_vs_batch.png", "throughput_vs_batch.png"]
    for p in res["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Path(res["table_csv"]).open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 16 and {"latency_p50_ms", "latency_p99_ms", "throughput_rps"} <= set(rows[0])
    head4 = next(
        r for r in rows if r["component"] == "head" and r["batch_size"] == "4" and r["slice_threads"] == "1"
    )
    assert head4["status"] == "oom" and head4["latency_p50_ms"] == ""
    ok = next(r for r in rows if r["component"] == "enc" and r["batch_size"] == "8")
    assert float(ok["throughput_rps"]) == pytest.approx(8 / (float(ok["latency_p50_ms"]) / 1e3), rel=1e-3)
    assert "| enc | 1 | 1 | ok |" in Path(res["table_md"]).read_text()


def test_assign_rows_gives_whole_rows_and_balances() -> None:
    from hpcsplit.profiling.runner import _assign_rows

    missing = [(n, b, s) for n in ("big", "small") for s in range(2) for b in range(3)]
    share = _assign_rows(missing, 2, {"big": 10.0, "small": 1.0}, [1.0, 2.0], "cpu")
    assert sorted(c for part in share for c in part) == sorted(missing)  # every cell exactly once
    for part in share:  # a (component, slice) row is never split: OOM inference stays on one rank
        rows = {(n, s) for n, _b, s in part}
        assert all(sum(1 for c in part if (c[0], c[2]) == r) == 3 for r in rows)
    assert {(n, s) for n, _b, s in share[0]} == {("big", 0)}  # the heaviest row alone on rank 0
    assert _assign_rows(missing, 3, {}, [1.0, 2.0], "cpu")[2]  # no rank idle while rows are left


def test_mpi_stage_merges_part_files_left_by_a_killed_job(tmp_path: Path) -> None:
    from hpcsplit.core.mpi import MPI

    out = tmp_path / "profile.h5"
    grid = {**GRID, "batch_sizes": [1, 2]}
    # what a killed 2-rank job leaves: an incomplete main file and rank 1's part file
    profile_components(ToySwitchboard(), out=out, cells=[("enc", 0, 0)], **grid)
    part = tmp_path / "profile.h5.part1"
    profile_components(ToySwitchboard(), out=part, cells=[("head", 0, 1), ("head", 1, 1)], **grid)
    before = read_profile(part, allow_incomplete=True).components["head"].latency_ms[:, 1].copy()
    s = ProfileSettings.from_config(
        {"profile": _profile(batch_sizes=[1, 2], threads=[1, 2], warmup=1, iters=3, progress=False)}
    )
    res = profile_components_mpi(ToySwitchboard(), s, out, comm=MPI.COMM_SELF, rank_silence_s=s.rank_silence_s)
    assert res is not None and res["complete"] and res["cells_measured_now"] == 8 - 3
    assert not part.exists()
    after = read_profile(out).components["head"]
    assert after.latency_ms[:, 1].tobytes() == before.tobytes()


def test_profile_job_is_checkpointable() -> None:
    pytest.importorskip("submitit")
    from hpcsplit.launch.slurm import ProfileJob

    job = ProfileJob("tests.unit.profile_toys:main")
    delayed = job.checkpoint("hpcsplit.profiling.stage:mpi_main", {"a": 1}, "/tmp/run")
    assert delayed.function is job
    assert delayed.args == ("hpcsplit.profiling.stage:mpi_main", {"a": 1}, "/tmp/run")


# ------------------------------------------------------------------------ real switchboards (toy, tiny CLIP)

_HAS_SB = importlib.util.find_spec("hpcsplit.switchboard.reader") is not None


@pytest.mark.skipif(not _HAS_SB, reason="hpcsplit.switchboard.reader not available")
@pytest.mark.parametrize("model", ["toy_mlp", "clip_tiny"])
def test_profile_real_switchboard(tmp_path: Path, model: str, switchboards: Callable[..., Path]) -> None:
    sb_dir = switchboards(model, dims=(16, 32, 4)) if model == "toy_mlp" else switchboards(model)
    out = tmp_path / "profile.h5"
    summary = profile_components(sb_dir, out=out, **{**GRID, "batch_sizes": [1, 2], "slices": [1]})
    assert summary["complete"]
    prof = read_profile(out)
    from hpcsplit.switchboard.reader import Switchboard

    sb = Switchboard.load(sb_dir)
    assert prof.meta.switchboard_sha256 == sb.sha256
    assert list(prof.components) == list(sb.components)
    for name, c in prof.components.items():
        assert c.measured.all() and not c.oom.any() and np.isfinite(c.latency_ms).all()
        assert c.param_bytes == int(sb.components[name].param_bytes)
        assert (c.input_bytes > 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_on_gpu_with_memory_slices(tmp_path: Path) -> None:
    out = tmp_path / "gpu.h5"
    sb = ToySwitchboard()  # CPU modules: the profiler moves each component to the GPU and back
    summary = profile_components(
        sb, out=out, batch_sizes=[1, 4], slices=[1, 2], warmup=1, iters=3, util_window_ms=200, progress=False
    )
    assert summary["complete"]
    prof = read_profile(out)
    assert prof.meta.device_kind == "cuda" and prof.meta.slice_unit == "gb"
    assert "soft cap via per-process memory fraction" in prof.meta.slice_semantics
    c = prof.components["enc"]
    assert np.isfinite(c.latency_ms).all() and (c.peak_mem_bytes >= c.param_bytes).all()
    assert all(p.device.type == "cpu" for m in sb.mods.values() for p in m.parameters())
