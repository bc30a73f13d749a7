"""stage=all orchestration without MPI: which stages run, which are skipped, what a failure leaves.

The stages are replaced by fakes that write their outputs where the real ones do
(``[Note: pipeline manifest]`` in hpcsplit/launch/pipeline.py); the real pipeline runs in
tests/integration/test_bad_inputs.py and tests/slurm/test_pipeline_slurm.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.settings import group_defaults
from hpcsplit.errors import ConfigError, LaunchError
from hpcsplit.launch import pipeline
from hpcsplit.launch.config import rewrite_argv, validate

CFG: dict[str, Any] = {
    "stage": "all",
    "model": {"name": "toy_mlp", "batch_size": 2},
    "partition": {"method": "dominator"},
    "verify": {"atol": 1e-5},
    "profile": {"path": None, "max_batch": 4, "iters": 3},
    "allocate": {"solver": "HIGHS"},
    "runtime": {"max_inflight": 64},
    "bench": {"qps": [1, 2], "duration_s": 1.0},
    "launcher": {"name": "local"},
    "cluster": {"name": "local", "nodes": 1, "cpu_threads": [1, 2]},
    "paths": {"switchboard_dirname": "switchboard", "profile_filename": "profile.h5", "plan_filename": "plan.json"},
    "switchboard": None,
    "plan": None,
}


class FakeStages:
    """Writes each stage's output from its config; records the calls; can fail a stage once."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, stage: str, cfg: dict[str, Any], run_dir: Path, echo: Any) -> dict[str, Any]:
        self.calls.append(stage)
        if stage == self.fail:
            self.fail = None
            raise LaunchError(f"{stage}: [rank 3] RuntimeError: boom")
        assert cfg["stage"] == stage
        if stage == "export":
            (run_dir / "switchboard").mkdir(exist_ok=True)
            (run_dir / "switchboard" / "layout.json").write_text(json.dumps({"model": cfg["model"]}))
        elif stage == "profile":
            sb = (Path(cfg["switchboard"]) / "layout.json").read_text()  # a profile names its switchboard
            (run_dir / "profile.h5").write_text(json.dumps(cfg["profile"]) + sb)
            return {"complete": True}
        elif stage == "analyze":
            (run_dir / "analysis").mkdir(exist_ok=True)
            (run_dir / "analysis" / "table.md").write_text((run_dir / "profile.h5").read_text())
            (run_dir / "analysis" / "latency.png").write_bytes(b"png")
        elif stage == "allocate":
            (run_dir / "plan.json").write_text(json.dumps(cfg["allocate"]) + (run_dir / "profile.h5").read_text())
        elif stage == "bench":
            assert cfg["plan"] == str(run_dir / "plan.json")
            (run_dir / "bench").mkdir(exist_ok=True)
            (run_dir / "bench" / "summary.csv").write_text(json.dumps(cfg["bench"]))
            return {"mode": "bench", "table": "QPS ...", "variants": {}}
        return {"stage": stage}


@pytest.fixture(autouse=True)
def _no_switchboard_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pipeline, "_check_reused_switchboard", lambda p, echo: None)


def _run(tmp_path: Path, stages: FakeStages, **changes: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(CFG)
    for dotted, value in changes.items():
        node = cfg
        *head, last = dotted.split("__")
        for k in head:
            node = node[k]
        node[last] = value
    return pipeline.run_pipeline(cfg, tmp_path, lambda s: None, stages)


def test_first_run_runs_everything_then_nothing(tmp_path: Path) -> None:
    first = FakeStages()
    out = _run(tmp_path, first)
    assert first.calls == list(pipeline.PIPELINE)
    assert (tmp_path / "summary.md").is_file() and out["plots"] == [str(tmp_path / "analysis" / "latency.png")]
    again = FakeStages()
    out = _run(tmp_path, again)
    assert again.calls == [] and set(out["skipped"]) == set(pipeline.PIPELINE)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"bench__qps": [5]}, ["bench"]),
        ({"allocate__solver": "SCIPY"}, ["allocate", "bench"]),
        ({"profile__iters": 7}, ["profile", "analyze", "allocate", "bench"]),
        ({"profile__ranks": 4}, []),  # how many ranks measure does not change the profile
        ({"model__hidden": 8}, list(pipeline.PIPELINE)),
    ],
)
def test_a_change_reruns_that_stage_and_what_follows(tmp_path: Path, change: dict, expected: list[str]) -> None:
    _run(tmp_path, FakeStages())
    st = FakeStages()
    _run(tmp_path, st, **change)
    assert st.calls == expected


def test_choosing_by_prediction_reruns_when_the_simulated_policy_changes(tmp_path: Path) -> None:
    """``allocate.rate_rps`` simulates the runtime's window, batching and polling: changing them changes the choice."""
    _run(tmp_path, FakeStages(), allocate__rate_rps=4.0)
    st = FakeStages()
    _run(tmp_path, st, allocate__rate_rps=4.0, runtime__max_inflight=8)
    assert st.calls == ["allocate", "bench"]
    st = FakeStages()
    _run(tmp_path, st, runtime__max_inflight=16)  # (without a rate the plan does not depend on it)
    assert st.calls == ["allocate", "bench"]  # rate_rps went away: allocate's inputs changed
    st = FakeStages()
    _run(tmp_path, st, runtime__max_inflight=32)
    assert st.calls == ["bench"]


def test_choosing_by_prediction_reruns_when_the_ranks_binding_changes(tmp_path: Path) -> None:
    """The choice simulates the ranks bound to cores or placed by the kernel (``core.sim_model.binds_cores``):
    ``simulate.bind`` or ``-bind-to core`` among the launcher's arguments changes it; other arguments do not."""
    _run(tmp_path, FakeStages(), allocate__rate_rps=4.0)
    st = FakeStages()
    _run(tmp_path, st, allocate__rate_rps=4.0, simulate={"bind": "core"})
    assert st.calls == ["allocate"]  # (the same plan here: the bench's inputs are unchanged)
    st = FakeStages()
    _run(tmp_path, st, allocate__rate_rps=4.0, launcher={"name": "local", "mpiexec_args": ["-bind-to", "core"]})
    assert st.calls == []  # bound either way: the same choice (the launcher's arguments do not reach the bench's key)
    st = FakeStages()
    _run(tmp_path, st, allocate__rate_rps=4.0, launcher={"name": "local", "mpiexec_args": ["-v"]})
    assert st.calls == ["allocate"]


def test_changed_outputs_on_disk_rerun_the_stage(tmp_path: Path) -> None:
    _run(tmp_path, FakeStages())
    (tmp_path / "plan.json").write_text("edited by hand")
    st = FakeStages()
    _run(tmp_path, st)
    assert st.calls == ["allocate"]  # it wrote the same plan again, so the bench results still hold
    (tmp_path / "bench" / "summary.csv").unlink()
    st = FakeStages()
    _run(tmp_path, st)
    assert st.calls == ["bench"]


def test_changed_profile_inputs_keep_the_old_profile(tmp_path: Path) -> None:
    _run(tmp_path, FakeStages())
    old = (tmp_path / "profile.h5").read_text()
    _run(tmp_path, FakeStages(), profile__iters=9)
    kept = list(tmp_path.glob("profile.*.h5"))
    assert len(kept) == 1 and kept[0].read_text() == old


def test_force(tmp_path: Path) -> None:
    _run(tmp_path, FakeStages())
    st = FakeStages()
    _run(tmp_path, st, force=["profile"])
    assert st.calls[0] == "profile"  # what follows re-runs only if the new profile differs
    with pytest.raises(ConfigError, match="force"):
        _run(tmp_path, FakeStages(), force=["nope"])


def test_failure_keeps_results_and_resume_runs_only_what_is_left(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as ei:
        _run(tmp_path, FakeStages(fail="bench"))
    msg = str(ei.value)
    assert "[rank 3] RuntimeError: boom" in msg and f"resume={tmp_path}" in msg
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["stages"]["bench"]["status"] == "failed"
    assert manifest["stages"]["profile"]["status"] == "done"
    assert "FAILED" in (tmp_path / "summary.md").read_text()
    st = FakeStages()
    _run(tmp_path, st)
    assert st.calls == ["bench"]


def test_incomplete_profile_is_an_error_with_resume(tmp_path: Path) -> None:
    class Interrupted(FakeStages):
        def __call__(self, stage: str, cfg: dict[str, Any], run_dir: Path, echo: Any) -> dict[str, Any]:
            out = super().__call__(stage, cfg, run_dir, echo)
            if stage == "profile":
                return {"complete": False, "cells_missing": 3, "cells_total": 10, "interrupted": True}
            return out

    with pytest.raises(Exception, match="3 of 10 cells still missing") as ei:
        _run(tmp_path, Interrupted())
    assert f"resume={tmp_path}" in str(ei.value)
    st = FakeStages()
    _run(tmp_path, st)
    assert st.calls[0] == "profile"  # not set aside: same inputs, the profiler resumes the file
    assert not list(tmp_path.glob("profile.*.h5"))


def test_given_switchboard_skips_export(tmp_path: Path) -> None:
    sb = tmp_path / "given"
    sb.mkdir()
    (sb / "layout.json").write_text("{}")
    st = FakeStages()

    def stages(stage: str, cfg: dict[str, Any], run_dir: Path, echo: Any) -> Any:
        if stage == "profile":
            assert cfg["switchboard"] == str(sb)
            (run_dir / "profile.h5").write_text("p")
            st.calls.append(stage)
            return {"complete": True}
        return st(stage, cfg, run_dir, echo)

    (tmp_path / "run").mkdir()
    out = _run(tmp_path / "run", stages, switchboard=str(sb))
    assert "export" not in st.calls and "export" in out["skipped"] and "bench" in st.calls


# ------------------------------------------------------------------------------------------ config


def test_invalid_values_are_listed_together() -> None:
    cfg = copy.deepcopy(CFG)
    cfg["bench"]["qps"] = [-1, 2]
    cfg["model"]["batch_size"] = 0
    cfg["cluster"]["cpu_threads"] = [0]
    cfg["bench"]["min_requests"] = -1
    cfg["bench"]["floor_runs"] = 1.5
    with pytest.raises(ConfigError) as ei:
        validate(cfg)
    msg = str(ei.value)
    assert "5 config problem(s)" in msg and "bench.floor_runs = 1.5" in msg
    assert "bench.qps" in msg and "model.batch_size = 0" in msg and "cluster.cpu_threads" in msg
    assert "bench.min_requests = -1" in msg


def test_resume_shortcut() -> None:
    assert rewrite_argv(["+experiment=toy", "resume=runs/a"], conf=None, cwd=Path("/w")) == [
        "+experiment=toy",
        "hydra.run.dir=/w/runs/a",
    ]


# ------------------------------------------------------------------------------------------ sbatch


def _plan(nodes_of_ranks: list[int], kind: str = "cpu") -> Any:
    from hpcsplit.core.plan import Plan, RankEntry

    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    for r, node in enumerate(nodes_of_ranks[1:], start=1):
        gpu = (r % 4) if kind == "cuda" else None
        ranks.append(RankEntry(r, "component", node, gpu, 10.0 if gpu is not None else None, 2, f"c{r}", 1, 0))
    comps = {f"c{r}": 1.0 for r in range(1, len(nodes_of_ranks))}
    return Plan("m", None, kind, max(nodes_of_ranks) + 1, tuple(ranks), comps, {})


def test_sbatch_script_shapes(tmp_path: Path) -> None:
    from hpcsplit.launch.sbatch import sbatch_script

    gpu = ClusterSpec.from_config({
        **group_defaults("cluster", "perlmutter"),
        "slurm": {"account": "m1234", "time_min": 15, "cpus_per_task": 32, "srun_mpi": "pmi2", "setup": ["export A=1"]},
    })
    even = sbatch_script(_plan([0, 0, 1, 1], "cuda"), gpu, tmp_path / "c.json", tmp_path, "bench", python="py")
    assert "#SBATCH --nodes=2 " in even and "#SBATCH --ntasks=4 " in even and "#SBATCH --ntasks-per-node=2 " in even
    assert "#SBATCH --gpus-per-node=4 " in even and "#SBATCH --cpus-per-task=32 " in even
    assert "#SBATCH --account=m1234 " in even and "#SBATCH --time=15 " in even and "export A=1" in even
    assert 'srun --mpi="$SLURM_MPI_TYPE" --kill-on-bad-exit=1' in even and "hpcsplit.runtime.stage:mpi_main" in even
    cpu = ClusterSpec.from_config(group_defaults("cluster", "local"))
    uneven = sbatch_script(_plan([0, 0, 0, 1]), cpu, tmp_path / "c.json", tmp_path, python="py")
    # every node has room for the most ranks of a node; srun places the 4 ranks 3 + 1 by the hostfile
    assert "#SBATCH --ntasks-per-node=3 " in uneven and "#SBATCH --ntasks=" not in uneven
    assert "COUNTS=(3 1)" in uneven and "--ntasks=4 --distribution=arbitrary" in uneven
    assert "#SBATCH --cpus-per-task=2 " in uneven and "##SBATCH --gpus-per-node" in uneven


def test_run_sbatch_needs_a_plan(tmp_path: Path) -> None:
    from hpcsplit.launch.sbatch import run_sbatch

    with pytest.raises(ConfigError, match="needs a plan"):
        run_sbatch({"plan": str(tmp_path / "none.json")}, tmp_path)
    _plan([0, 0]).save(tmp_path / "plan.json")
    (tmp_path / "switchboard").mkdir()
    out = run_sbatch({"plan": str(tmp_path / "plan.json"), "cluster": group_defaults("cluster", "local")}, tmp_path)
    text = Path(out["script"]).read_text()
    assert out["world_size"] == 2 and "#SBATCH --ntasks=2 " in text
    job_cfg = json.loads(Path(out["cfg"]).read_text())
    assert job_cfg["stage"] == "serve" and job_cfg["switchboard"] == str((tmp_path / "switchboard").resolve())
