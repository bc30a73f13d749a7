"""Launch layer without MPI or SLURM: the stage table, argv shortcuts, config validation, mpiexec lines,
waiting logic.  Configs are composed by Hydra from conf/ (the ``compose`` fixture of tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.paths import RunPaths
from hpcsplit.errors import ConfigError, LaunchError
from hpcsplit.launch import app as launch
from hpcsplit.launch import local, stages
from hpcsplit.launch import slurm as _slurm
from hpcsplit.launch.config import conf_dir, rewrite_argv, validate

REPO = Path(__file__).resolve().parents[2]

Cfg = Callable[..., dict[str, Any]]


@pytest.fixture
def cfg_of(compose: Callable[..., dict[str, Any]]) -> Cfg:
    """``cfg_of("slurm", "dev", stage="all")``: the composed config of ``launcher=... cluster=...``."""

    def _cfg(launcher: str = "local", cluster: str = "local", **top: object) -> dict[str, Any]:
        return {**compose(f"launcher={launcher}", f"cluster={cluster}", "stage=probe"), **top}

    return _cfg


def _cluster(cfg: dict[str, Any]) -> ClusterSpec:
    return ClusterSpec.from_config(cfg["cluster"])


# ------------------------------------------------------------------------------------ stage table


def test_one_stage_table_feeds_validation_dispatch_and_pipeline() -> None:
    assert stages.PIPELINE == ("export", "profile", "analyze", "allocate", "bench")
    assert set(stages.MPI_STAGES) == {"probe", "profile", "serve", "bench", "calibrate"}
    assert stages.STAGE_NAMES[-1] == "all" and set(stages.STAGE_NAMES[:-1]) == set(stages.STAGES)
    assert [s.name for s in stages.STAGES.values() if s.requeueable] == ["profile"]
    for row in stages.STAGES.values():
        assert (row.ranks is not None) == row.mpi, row
        assert row.function == ("mpi_main" if row.mpi else f"run_{row.name}"), row
    from hpcsplit.launch import pipeline

    assert pipeline.PIPELINE is stages.PIPELINE


def test_launcher_settings_refuse_unknown_keys_with_a_suggestion(cfg_of: Cfg) -> None:
    cfg = cfg_of()
    cfg["launcher"]["timeout_mins"] = 5
    with pytest.raises(ConfigError, match="launcher.timeout_mins is not a setting .did you mean 'timeout_min'"):
        validate(cfg)
    s = stages.launcher_settings(cfg_of("slurm", "dev"))
    assert isinstance(s, stages.SlurmLauncherSettings) and s.max_requeue == 3 and s.poll_s == 2.0
    # a partial launcher group takes conf/launcher/<name>.yaml's values
    assert stages.launcher_settings({"launcher": {"name": "local"}}).timeout_min == 120


# ------------------------------------------------------------------------------------------- argv


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    (tmp_path / "conf/profile").mkdir(parents=True)
    (tmp_path / "conf/profile/default.yaml").write_text("path: null\n")
    (tmp_path / "conf/profile/fast.yaml").write_text("path: null\n")
    return tmp_path / "conf"


def test_profile_path_goes_to_profile_path(conf: Path) -> None:
    out = rewrite_argv(["stage=analyze", "profile=runs/a/profile.h5"], conf=conf, cwd=Path("/work"))
    assert out == ["stage=analyze", "profile.path=/work/runs/a/profile.h5"]


def test_profile_option_names_are_kept(conf: Path) -> None:
    assert rewrite_argv(["profile=fast", "profile=default"], conf=conf) == ["profile=fast", "profile=default"]


def test_unknown_profile_name_without_path_is_left_to_hydra(conf: Path) -> None:
    assert rewrite_argv(["profile=fastest"], conf=conf) == ["profile=fastest"]


def test_existing_file_without_dot_or_slash_is_a_path(conf: Path, tmp_path: Path) -> None:
    (tmp_path / "myprofile").write_text("")
    assert rewrite_argv(["profile=myprofile"], conf=conf, cwd=tmp_path) == [
        f"profile.path={tmp_path}/myprofile"
    ]


def test_plan_and_switchboard_become_absolute(conf: Path) -> None:
    out = rewrite_argv(["plan=out/plan.json", "switchboard=/abs/sb", "plan=null"], conf=conf, cwd=Path("/w"))
    assert out == ["plan=/w/out/plan.json", "switchboard=/abs/sb", "plan=null"]


def test_paths_with_spaces_are_quoted_and_other_args_untouched(conf: Path) -> None:
    out = rewrite_argv(
        [
            "plan=my runs/plan.json",
            "+experiment=clip",
            "profile.path=x.h5",
            "cluster=dev",
            "profile=a.h5,b.h5",
        ],
        conf=conf,
        cwd=Path("/w"),
    )
    assert out == [
        "plan='/w/my runs/plan.json'",
        "+experiment=clip",
        "profile.path=x.h5",
        "cluster=dev",
        "profile=a.h5,b.h5",
    ]


def test_conf_dir_is_the_repo_conf() -> None:
    assert conf_dir() == REPO / "conf"
    assert (conf_dir() / "launcher/local.yaml").is_file() and (conf_dir() / "launcher/slurm.yaml").is_file()


# ------------------------------------------------------------------------------------- validation


def test_presets_are_valid(cfg_of: Cfg) -> None:
    validate(cfg_of())
    validate(cfg_of("slurm", "dev"))
    validate(cfg_of("slurm", "perlmutter"))


def test_all_problems_are_listed_at_once(cfg_of: Cfg) -> None:
    cfg = cfg_of("slurm", "dev", stage="nope")
    cfg["launcher"]["ranks"] = 0
    cfg["cluster"]["slurm"].update(time_min=-5, srun_mpi="pmi3", partition="two words")
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    msg = str(err.value)
    assert msg.startswith("5 config problem(s):")
    for part in (
        "stage = 'nope'",
        "launcher.ranks = 0",
        "cluster.slurm.time_min = -5",
        "srun_mpi = 'pmi3'",
        "partition = 'two words'",
    ):
        assert part in msg


def test_slurm_launcher_needs_a_slurm_cluster(cfg_of: Cfg) -> None:
    with pytest.raises(ConfigError, match="cluster='local' has none"):
        validate(cfg_of("slurm", "local"))


def test_unknown_launcher(cfg_of: Cfg) -> None:
    cfg = cfg_of()
    cfg["launcher"]["name"] = "pbs"
    with pytest.raises(ConfigError, match="launcher.name = 'pbs'"):
        validate(cfg)


# ------------------------------------------------------------------------------------------ local


def test_openmpi_as_root_gets_its_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(local, "mpiexec_flavour", lambda m: "openmpi")
    monkeypatch.setattr(local.os, "geteuid", lambda: 0)
    cmd = launch.mpiexec_command("/x/mpiexec", 3, "hpcsplit.launch.probe:mpi_main", tmp_path / "c.json", tmp_path)
    assert cmd[:3] == ["/x/mpiexec", "--allow-run-as-root", "--oversubscribe"]
    assert cmd[3:5] == ["-n", "3"]
    assert cmd[5:10] == [sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank"]
    assert cmd[-3:] == ["hpcsplit.launch.probe:mpi_main", str(tmp_path / "c.json"), str(tmp_path)]


def test_mpich_gets_no_openmpi_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(local, "mpiexec_flavour", lambda m: "mpich")
    cmd = launch.mpiexec_command("mpiexec", 2, "m:f", tmp_path / "c.json", tmp_path, ["--bind-to", "core"])
    assert cmd[:5] == ["mpiexec", "--bind-to", "core", "-n", "2"]


def test_missing_mpiexec_is_a_launch_error() -> None:
    with pytest.raises(LaunchError, match="not found"):
        launch.find_mpiexec("/nonexistent/mpiexec")


def test_unavailable_stage_says_so(tmp_path: Path, cfg_of: Cfg) -> None:
    fn, why = launch._available("hpcsplit.no_such_module:run_x")
    assert fn is None and "does not exist yet" in why
    fn, why = launch._available("hpcsplit.launch.sbatch:run_nothing")
    assert fn is None and "has no run_nothing()" in why
    with pytest.raises(LaunchError, match="stage=serve needs a plan"):
        launch._mpi_ranks("serve", cfg_of(), tmp_path)


def test_mpi_rank_counts(tmp_path: Path, cfg_of: Cfg) -> None:
    assert launch._mpi_ranks("probe", cfg_of(), tmp_path) == 1
    cfg = cfg_of()
    cfg["profile"]["ranks"] = 3
    assert launch._mpi_ranks("profile", cfg, tmp_path) == 3
    assert launch._mpi_ranks("probe", cfg_of("slurm", "dev"), tmp_path) is None  # the cluster's geometry


# ------------------------------------------------------------------------------------------ slurm


def test_geometry_and_parameters(cfg_of: Cfg) -> None:
    cfg = _cluster(cfg_of("slurm", "perlmutter"))
    assert _slurm.geometry(cfg) == _slurm.JobGeometry(2, 4, 8)
    assert _slurm.geometry(cfg, 5) == _slurm.JobGeometry(2, 3, 5)
    # a plan: 9 ranks on 2 nodes, 5 on the first (frontend + 4 components) -> 5 per node, --ntasks=9
    assert _slurm.geometry(cfg, 9, nodes=2, tasks_per_node=5) == _slurm.JobGeometry(2, 5, 9)
    assert _slurm.geometry(cfg, 3, nodes=1, tasks_per_node=3) == _slurm.JobGeometry(1, 3, 3)
    params = _slurm.executor_parameters(cfg, "serve", 5)
    # serve is not requeueable: --no-requeue, so a NODE_FAIL ends the job instead of queueing it again
    assert params["additional_parameters"] == {"ntasks": 5, "no_requeue": True}
    assert params["srun_args"] == ["--mpi=pmi2", "--kill-on-bad-exit=1"]
    assert "no_requeue" not in _slurm.executor_parameters(cfg, "profile", 8).get("additional_parameters", {})
    # a 3 + 2 plan: room for 3 ranks on each node, the ranks placed by a hostfile
    uneven = _slurm.executor_parameters(cfg, "serve", 5, (2, 3), [3, 2], "/r/hostfile.$SLURM_JOB_ID")
    assert uneven["ntasks_per_node"] == 3 and "ntasks" not in uneven["additional_parameters"]
    assert uneven["srun_args"][-2:] == ["--ntasks=5", "--distribution=arbitrary"]
    assert "COUNTS=(3 2)" in uneven["setup"] and 'export SLURM_HOSTFILE="/r/hostfile.$SLURM_JOB_ID"' in uneven["setup"]
    dev = _slurm.executor_parameters(_cluster(cfg_of("slurm", "dev")), "probe")
    assert dev["partition"] == "debug" and dev["gpus_per_node"] == 4 and "account" not in dev


def _job(tmp_path: Path) -> _slurm.SubmittedJob:
    return _slurm.SubmittedJob("42", tmp_path, tmp_path / "probe.mpi_main.result.json", "probe", 2, 5)


def _states(*seq: _slurm.JobStatus):
    it = iter(seq)
    last = [seq[-1]]

    def fn(job_id: str) -> _slurm.JobStatus:
        last[0] = next(it, last[0])
        return last[0]

    return fn


def test_wait_returns_rank0_result(tmp_path: Path) -> None:
    (tmp_path / "probe.mpi_main.result.json").write_text('[{"rank": 0}]')
    lines: list[str] = []
    out = _slurm.wait_for_job(
        _job(tmp_path),
        poll_s=0.01,
        echo=lines.append,
        status_fn=_states(
            _slurm.JobStatus("PENDING", source="squeue"),
            _slurm.JobStatus("RUNNING", source="squeue"),
            _slurm.JobStatus("COMPLETED", "0:0", source="sacct"),
        ),
    )
    assert out == [{"rank": 0}]
    assert [x.split()[4] for x in lines[:3]] == ["PENDING", "RUNNING", "COMPLETED"]
    assert "logs in" in lines[-1]


def test_failed_job_reports_rank_errors_from_logs(tmp_path: Path) -> None:
    (tmp_path / "42_0_log.err").write_text("noise\nsrun: error: n1: task 1: Killed\n")
    (tmp_path / "42_1_log.err").write_text("[rank 1] ValueError: bad input\nTraceback...\n")
    with pytest.raises(LaunchError) as err:
        _slurm.wait_for_job(
            _job(tmp_path),
            poll_s=0.01,
            echo=lambda s: None,
            status_fn=_states(_slurm.JobStatus("FAILED", "1:0", source="sacct")),
        )
    msg = str(err.value)
    assert "ended FAILED (exit code 1:0)" in msg
    assert "[rank 1] ValueError: bad input" in msg and "task 1: Killed" in msg


def test_completed_without_result_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_slurm, "_RESULT_GRACE_S", 0.1)
    with pytest.raises(LaunchError, match="ended COMPLETED"):
        _slurm.wait_for_job(
            _job(tmp_path),
            poll_s=0.01,
            echo=lambda s: None,
            status_fn=_states(_slurm.JobStatus("COMPLETED", "0:0", source="sacct")),
        )


def test_job_no_scheduler_knows_is_reported_lost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # sacct broken, squeue empty: submitit's result() would wait forever here
    monkeypatch.setattr(_slurm, "_VANISHED_S", 0.05)
    with pytest.raises(LaunchError, match="LOST"):
        _slurm.wait_for_job(
            _job(tmp_path), poll_s=0.01, echo=lambda s: None, status_fn=_states(_slurm.JobStatus("UNKNOWN"))
        )


def test_wait_timeout_cancels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cancelled: list[str] = []
    monkeypatch.setattr(_slurm, "_scancel", cancelled.append)
    with pytest.raises(LaunchError, match="gave up waiting"):
        _slurm.wait_for_job(
            _job(tmp_path),
            timeout_s=0.05,
            poll_s=0.01,
            echo=lambda s: None,
            status_fn=_states(_slurm.JobStatus("PENDING", source="squeue")),
        )
    assert cancelled == ["42"]


def _ctrl_c_then(*seq: _slurm.JobStatus):
    """A status function whose second poll is interrupted by Ctrl-C, then goes on with ``seq``."""
    calls = [0]
    rest = _states(*seq)

    def fn(job_id: str) -> _slurm.JobStatus:
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return rest(job_id)

    return fn


def test_ctrl_c_cancels_a_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cancelled: list[str] = []
    monkeypatch.setattr(_slurm, "_scancel", cancelled.append)
    with pytest.raises(KeyboardInterrupt):
        _slurm.wait_for_job(_job(tmp_path), poll_s=0.01, echo=lambda s: None,
                            status_fn=_ctrl_c_then(_slurm.JobStatus("RUNNING", source="squeue")))
    assert cancelled == ["42"]


def test_ctrl_c_drains_a_server_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server job is signalled (SIGTERM to its steps, not cancelled) and its result returned once it ended;
    one that does not end within drain_s is cancelled and the interrupt raised."""
    ran: list[list[str]] = []
    cancelled: list[str] = []
    monkeypatch.setattr(_slurm, "_run", lambda cmd: ran.append(cmd) or "")
    monkeypatch.setattr(_slurm, "_scancel", cancelled.append)
    (tmp_path / "probe.mpi_main.result.json").write_text('{"server": {"ok": 3}}')
    lines: list[str] = []
    out = _slurm.wait_for_job(
        _job(tmp_path), poll_s=0.01, echo=lines.append, drain_s=30.0,
        status_fn=_ctrl_c_then(_slurm.JobStatus("RUNNING", source="squeue"),
                               _slurm.JobStatus("COMPLETED", "0:0", source="sacct")))
    assert out == {"server": {"ok": 3}}
    assert ran == [["scancel", "--signal=TERM", "42"]] and cancelled == []
    assert any("drained and stopped cleanly" in x for x in lines)
    monkeypatch.setattr(_slurm.time, "sleep", lambda s: None)
    with pytest.raises(KeyboardInterrupt):
        _slurm.wait_for_job(_job(tmp_path), poll_s=0.01, echo=lambda s: None, drain_s=0.05,
                            status_fn=_ctrl_c_then(_slurm.JobStatus("RUNNING", source="squeue")))
    assert cancelled == ["42"]
    assert _slurm._server_drain_s("serve", {"runtime": {"mode": "server", "server_drain_s": 5}}) == 65.0
    assert _slurm._server_drain_s("serve", {"runtime": {"mode": "batch"}}) is None
    assert _slurm._server_drain_s("bench", {"runtime": {"mode": "server"}}) is None


def test_a_job_requeued_after_a_node_failure_is_cancelled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pending again after it ran: with a node down (NODE_FAIL) it is cancelled and named; with its nodes fine
    (a preemption) the wait goes on until it completes."""
    cancelled: list[str] = []
    monkeypatch.setattr(_slurm, "_scancel", cancelled.append)
    seq = (_slurm.JobStatus("RUNNING", source="squeue"), _slurm.JobStatus("PENDING", reason="BeginTime", source="squeue"),
           _slurm.JobStatus("RUNNING", source="squeue"), _slurm.JobStatus("COMPLETED", "0:0", source="sacct"))
    down = ["node node2 (node 1 of the job, rank 2) is DOWN* (Not responding)"]
    monkeypatch.setattr(_slurm, "node_report", lambda job_id, counts=(): down)
    with pytest.raises(LaunchError, match=r"NODE_FAIL.*node node2 \(node 1 of the job, rank 2\) is DOWN"):
        _slurm.wait_for_job(_job(tmp_path), poll_s=0.01, echo=lambda s: None, status_fn=_states(*seq))
    assert cancelled == ["42"]
    monkeypatch.setattr(_slurm, "node_report", lambda job_id, counts=(): [])
    (tmp_path / "probe.mpi_main.result.json").write_text("[1]")
    assert _slurm.wait_for_job(_job(tmp_path), poll_s=0.01, echo=lambda s: None, status_fn=_states(*seq)) == [1]
    assert cancelled == ["42"]


def test_submit_without_sbatch_is_a_launch_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cfg_of: Cfg
) -> None:
    monkeypatch.setattr(_slurm.shutil, "which", lambda name: None)
    cfg = cfg_of("slurm", "dev")
    launcher = stages.launcher_settings(cfg)
    assert isinstance(launcher, stages.SlurmLauncherSettings)
    with pytest.raises(LaunchError, match="no `sbatch` on PATH"):
        _slurm.submit("hpcsplit.launch.probe:mpi_main", cfg, RunPaths.from_config(cfg, tmp_path), "probe",
                      _cluster(cfg), launcher)


# -------------------------------------------------------------------------------------------- CLI


def test_cli_reports_config_problems_and_exits_1(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcsplit",
            "stage=nope",
            "launcher=slurm",
            "cluster=local",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        check=False,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    assert "ConfigError: 2 config problem(s)" in res.stderr
    assert "stage = 'nope'" in res.stderr and "cluster='local' has none" in res.stderr


def test_all_stops_at_a_missing_stage_and_keeps_a_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cfg_of: Cfg
) -> None:
    missing = dataclasses.replace(stages.STAGES["export"], entry="hpcsplit.no_such_module:run_export")
    monkeypatch.setitem(stages.STAGES, "export", missing)
    lines: list[str] = []
    with pytest.raises(LaunchError) as ei:
        launch.main(cfg_of(stage="all"), tmp_path, echo=lines.append)
    assert "stage=export is not available" in str(ei.value) and f"resume={tmp_path}" in str(ei.value)
    assert "FAILED" in (tmp_path / "summary.md").read_text()
    assert any(str(tmp_path / "summary.md") in x for x in lines)  # says where the summary is


def test_hydra_slurm_presets_read_the_clusters_slurm_block(tmp_path: Path) -> None:
    """One SLURM block per site: the Hydra presets take their options from cluster.slurm."""

    def show(*overrides: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hpcsplit", "--cfg", "all", "--resolve", *overrides],
                              check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    res = show("hydra/launcher=slurm_perlmutter", "cluster=perlmutter", "cluster.slurm.account=m1234")
    assert res.returncode == 0, res.stderr
    launcher = res.stdout.split("\n  launcher:\n", 1)[1].split("\n  sweeper:", 1)[0]
    for line in ("cpus_per_task: 128", "gpus_per_node: 4", "timeout_min: 30", "qos: regular", "constraint: gpu",
                 "account: m1234", "- export MPICH_GPU_SUPPORT_ENABLED=0"):
        assert line in launcher, (line, launcher)
    res = show("hydra/launcher=slurm_dev")  # cluster=local: no slurm block to read
    assert res.returncode != 0 and "cluster='local' has no slurm block" in res.stderr


def test_cluster_slurm_resolver() -> None:
    root = {"cluster": {"name": "dev", "slurm": {"tasks_per_node": 4, "cpus_per_task": 2, "qos": None}}}
    assert launch.cluster_slurm("node_cpus", root) == 8 and launch.cluster_slurm("qos", root) is None
    assert launch.cluster_slurm("qos", {}) is None  # Hydra's own config, composed before the run's
    with pytest.raises(ConfigError, match="has no slurm block"):
        launch.cluster_slurm("qos", {"cluster": {"name": "local", "slurm": None}})
