"""Up-front config validation and plan-on-cluster checks of ``python -m hpcsplit`` (issue 16, items 5-6).

In process: :func:`hpcsplit.launch.app.main` on a config composed by Hydra (the conftest ``compose``
fixture), so each case is what ``python -m hpcsplit OVERRIDES`` would see.  Every bad input must end in
an :class:`~hpcsplit.errors.HpcsplitError` naming the problem, before any work (no switchboard written,
no mpiexec started).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.plan import Plan, RankEntry
from hpcsplit.core.settings import group_defaults
from hpcsplit.errors import ConfigError, HpcsplitError, PlanError
from hpcsplit.launch import app
from hpcsplit.launch.config import key_problems, plan_cluster_problems, plan_roles

Compose = Callable[..., dict[str, Any]]


def _main(cfg: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    return app.main(cfg, tmp_path / "run", echo=lambda _m: None)


@pytest.fixture
def no_mpiexec_start(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Fail the test if a job would start: these cases must be refused before."""
    started: list[Any] = []

    def boom(*a: Any, **k: Any) -> None:
        started.append(a)
        raise AssertionError("a job was started for an input that should have been refused")

    monkeypatch.setattr(app, "run_mpi_local", boom)
    return started


# ------------------------------------------------------------------------------------ unknown keys


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("+runtime.max_infligth=3", "runtime.max_infligth is not a setting (did you mean 'max_inflight'?)"),
        ("+bench.duraton_s=2", "bench.duraton_s is not a setting (did you mean 'duration_s'?)"),
        ("+profile.itres=3", "profile.itres is not a setting (did you mean 'iters'?)"),
        ("+allocate.solverr=HIGHS", "allocate.solverr is not a setting (did you mean 'solver'?)"),
        ("+verify.atoll=1", "verify.atoll is not a setting (did you mean 'atol'?)"),
        ("+partition.stagse=2", "partition.stagse is not a setting (did you mean 'stages'?)"),
        ("+model.hiden=3", "model.hiden is not a setting (did you mean 'hidden'?)"),
        ("+paths.plan_filenam=x", "paths.plan_filenam is not a setting (did you mean 'plan_filename'?)"),
        ("+cluster.node=2", "cluster.node is not a setting (did you mean 'nodes'?)"),
        ("+launcher.grace=3", "launcher.grace is not a setting (did you mean 'grace_s'?)"),
        ("+runtime.trace.start_stp=1", "runtime.trace.start_stp is not a setting (did you mean 'start_step'?)"),
        ("+sede=1", "sede is not a setting (did you mean 'seed'?)"),
        ("+stag=serve", "stag is not a setting (did you mean 'stage'?)"),
    ],
)
def test_unknown_keys_of_every_group_fail_up_front(
    compose: Compose, tmp_path: Path, override: str, fragment: str
) -> None:
    cfg = compose("+experiment=toy", override)
    with pytest.raises(ConfigError) as e:
        _main(cfg, tmp_path)
    assert fragment in str(e.value)
    assert "valid:" in str(e.value)
    assert not (tmp_path / "run" / "switchboard").exists()  # nothing ran


def test_nested_slurm_keys_and_model_options(compose: Compose) -> None:
    cfg = compose("cluster=dev", "+cluster.slurm.partiton=debug", "+experiment=clip_tiny", "+model.d_in=3")
    errs = key_problems(cfg)
    assert any("cluster.slurm.partiton is not a setting (did you mean 'partition'?)" in e for e in errs)
    assert any(e.startswith("model.d_in is not a setting") for e in errs)  # a toy_mlp key on a clip model
    assert len(errs) == 2


@pytest.mark.parametrize("experiment", ["toy", "clip", "clip_tiny"])
@pytest.mark.parametrize("cluster", ["local", "dev", "perlmutter"])
@pytest.mark.parametrize("launcher", ["local", "slurm"])
def test_every_preset_passes_the_key_check(compose: Compose, experiment: str, cluster: str, launcher: str) -> None:
    assert key_problems(compose(f"+experiment={experiment}", f"cluster={cluster}", f"launcher={launcher}")) == []


def test_force_is_a_known_top_level_key(compose: Compose) -> None:
    assert key_problems(compose("+force=[bench]")) == []


def test_all_problems_listed_at_once(compose: Compose, tmp_path: Path) -> None:
    cfg = compose("+runtime.max_infligth=3", "+sede=1", "launcher.grace_s=-1", "bench.qps=[-1]")
    with pytest.raises(ConfigError) as e:
        _main(cfg, tmp_path)
    msg = str(e.value)
    assert "4 config problem(s)" in msg, msg
    assert "launcher.grace_s = -1" in msg and "bench.qps" in msg


def test_grace_s_default_comes_from_conf(compose: Compose) -> None:
    from hpcsplit.launch.stages import launcher_settings

    s = launcher_settings(compose())
    assert s.grace_s == group_defaults("launcher", "local")["grace_s"] > 0


# ------------------------------------------------------------------------------- plan on the cluster


def _cluster(**kw: Any) -> ClusterSpec:
    base = {**group_defaults("cluster", "perlmutter"), "cores_per_node": 8, "nodes": 1}
    base.update(kw)
    return ClusterSpec.from_config(base)


def _plan(kind: str = "cuda", nodes: int = 1, ranks: tuple[RankEntry, ...] | None = None) -> Plan:
    if ranks is None:
        ranks = (
            RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0),
            RankEntry(1, "component", 0, 0 if kind == "cuda" else None, 10.0 if kind == "cuda" else None, 2,
                      "enc", 4, 0),
            RankEntry(2, "component", nodes - 1, 0 if kind == "cuda" else None, 10.0 if kind == "cuda" else None,
                      2, "head", 4, 0),
        )
    rps = {r.component: 1.0 for r in ranks if r.component}
    return Plan(model="toy_mlp", switchboard_sha256="ab" * 32, device_kind=kind, nodes=nodes, ranks=ranks,
                predicted_throughput_rps=rps, utilization={}, meta={})


def test_a_fitting_plan_passes() -> None:
    cluster = _cluster()
    slice_gb = cluster.slices_gb[0]
    ranks = (
        RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0),
        RankEntry(1, "component", 0, 0, slice_gb, 2, "enc", 4, 0),
    )
    assert plan_cluster_problems(_plan(ranks=ranks), cluster) == ([], [])


def test_two_node_plan_on_one_node_names_both() -> None:
    refuse, _ = plan_cluster_problems(_plan(nodes=2), _cluster(nodes=1))
    assert any("2 node(s)" in r and "has 1" in r for r in refuse), refuse


def test_cuda_plan_on_cpu_cluster() -> None:
    cpu = ClusterSpec.from_config({**group_defaults("cluster", "local"), "cores_per_node": 8})
    refuse, _ = plan_cluster_problems(_plan("cuda"), cpu)
    assert any("device_kind cuda" in r and "has none" in r for r in refuse), refuse


def test_slice_larger_than_the_gpu_and_unknown_gpu_are_refused() -> None:
    cluster = _cluster()
    ranks = (
        RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0),
        RankEntry(1, "component", 0, 0, cluster.gpu_mem_gb * 2, 2, "enc", 4, 0),
        RankEntry(2, "component", 0, cluster.gpus_per_node, cluster.slices_gb[0], 2, "head", 4, 0),
    )
    refuse, _ = plan_cluster_problems(_plan(ranks=ranks), cluster)
    assert any("rank 1" in r and "larger than" in r for r in refuse), refuse
    assert any("rank 2" in r and f"gpu {cluster.gpus_per_node}" in r for r in refuse), refuse


def test_odd_slice_and_oversubscribed_cores_only_warn() -> None:
    cluster = _cluster(cores_per_node=4)
    odd = min(cluster.slices_gb) / 2
    ranks = (
        RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0),
        RankEntry(1, "component", 0, 0, odd, 3, "enc", 4, 0),
        RankEntry(2, "component", 0, 1, cluster.slices_gb[0], 3, "head", 4, 0),
    )
    refuse, warn = plan_cluster_problems(_plan(ranks=ranks), cluster)
    assert refuse == []
    assert any("not one of cluster.slices_gb" in w for w in warn), warn
    assert any("7 threads on 4 cores" in w for w in warn), warn


def test_one_rank_with_more_threads_than_cores_is_refused() -> None:
    ranks = (
        RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0),
        RankEntry(1, "component", 0, None, None, 64, "enc", 4, 0),
    )
    cpu = ClusterSpec.from_config({**group_defaults("cluster", "local"), "cores_per_node": 8})
    refuse, _ = plan_cluster_problems(_plan("cpu", ranks=ranks), cpu)
    assert any("64 threads" in r and "8 cores" in r for r in refuse), refuse


def test_plan_roles_name_components() -> None:
    roles = plan_roles(_plan())
    assert roles[0].startswith("frontend") and roles[2] == "component head, replica 0, node 0, gpu 0"


def test_serve_refuses_a_plan_that_does_not_fit_before_starting(
    compose: Compose, tmp_path: Path, no_mpiexec_start: list[Any]
) -> None:
    plan = _plan("cpu", nodes=2).save(tmp_path / "plan.json")
    cfg = compose("stage=serve", f"plan={plan}", "cluster.cores_per_node=8")
    with pytest.raises(PlanError) as e:
        _main(cfg, tmp_path)
    assert "2 node(s)" in str(e.value) and "'local' has 1" in str(e.value)
    assert no_mpiexec_start == []


# ---------------------------------------------------------------------------- bad files, no traceback


def _bad_plan_files(tmp_path: Path) -> dict[str, Path]:
    good = _plan("cpu").to_dict()
    strings = json.loads(json.dumps(good))
    strings["ranks"][1]["threads"] = "2"
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 100000 + "]" * 100000)
    out = {
        "malformed": tmp_path / "malformed.json",
        "empty": tmp_path / "empty.json",
        "strings_for_numbers": tmp_path / "strings.json",
        "a_directory": tmp_path / "adir",
        "missing": tmp_path / "missing.json",
        "not_an_object": tmp_path / "list.json",
        "deeply_nested": nested,
        "binary": tmp_path / "binary.json",
    }
    out["malformed"].write_text("{not json")
    out["empty"].write_text("")
    out["strings_for_numbers"].write_text(json.dumps(strings))
    out["a_directory"].mkdir()
    out["not_an_object"].write_text("[1, 2]")
    out["binary"].write_bytes(bytes(range(256)) * 4)
    return out


@pytest.mark.parametrize("case", ["malformed", "empty", "strings_for_numbers", "a_directory", "missing",
                                  "not_an_object", "deeply_nested", "binary"])
@pytest.mark.parametrize("stage", ["serve", "bench", "sbatch"])
def test_bad_plan_files_end_in_an_hpcsplit_error(
    compose: Compose, tmp_path: Path, no_mpiexec_start: list[Any], case: str, stage: str
) -> None:
    path = _bad_plan_files(tmp_path)[case]
    cfg = compose(f"stage={stage}", f"plan={path}")
    with pytest.raises(HpcsplitError) as e:
        _main(cfg, tmp_path)
    assert path.name in str(e.value) or "plan" in str(e.value).lower(), str(e.value)
    assert no_mpiexec_start == []


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file")
def test_unreadable_plan(compose: Compose, tmp_path: Path, no_mpiexec_start: list[Any]) -> None:
    path = _plan("cpu").save(tmp_path / "plan.json")
    path.chmod(0)
    try:
        with pytest.raises(HpcsplitError):
            _main(compose("stage=serve", f"plan={path}"), tmp_path)
    finally:
        path.chmod(0o600)


@pytest.mark.parametrize("stage", ["analyze", "allocate"])
@pytest.mark.parametrize("content", [b"", b"{not hdf5", None])
def test_bad_profile_files_end_in_an_hpcsplit_error(
    compose: Compose, tmp_path: Path, stage: str, content: bytes | None
) -> None:
    path = tmp_path / "p.h5"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(HpcsplitError):
        _main(compose(f"stage={stage}", f"profile.path={path}"), tmp_path)


def test_missing_switchboard_for_serve(compose: Compose, tmp_path: Path, no_mpiexec_start: list[Any]) -> None:
    plan = _plan("cpu").save(tmp_path / "plan.json")
    cfg = compose("stage=serve", f"plan={plan}", f"switchboard={tmp_path / 'nope'}", "cluster.cores_per_node=8")
    with pytest.raises(HpcsplitError) as e:
        _main(cfg, tmp_path)
    assert "nope" in str(e.value)


def test_allocate_and_paths_values_are_checked_up_front(compose: Compose, tmp_path: Path) -> None:
    cfg = compose("allocate.time_limit_s=-1", "paths.plan_filename=../x")
    with pytest.raises(ConfigError) as e:
        _main(cfg, tmp_path)
    msg = str(e.value)
    assert "allocate.time_limit_s = -1" in msg and "paths.plan_filename = '../x'" in msg, msg
    assert not (tmp_path / "run" / "switchboard").exists()
