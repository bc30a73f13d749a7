"""Every file name of a run folder, in one place.

[Note: run folder]
A run folder (Hydra's output dir, ``paths.run_dir``) holds what each stage writes: the switchboard
(``paths.switchboard_dirname``), the profile (``paths.profile_filename``), the plan
(``paths.plan_filename``) and its picture, ``calibration.json``, ``analysis/``, ``bench/``, ``simulate/``, batch
outputs, traces, logs, the
pipeline's ``manifest.json``, ``launch.json`` and ``summary.md``.  The inputs a stage reads may come
from elsewhere: ``switchboard=PATH``, ``profile.path=PATH``, ``plan=PATH`` and ``calibration=PATH`` override the run folder's
own; :class:`RunPaths` resolves both, so no stage spells a file name itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from hpcsplit.core.settings import Checker, group_defaults
from hpcsplit.errors import ConfigError

__all__ = ["CALIBRATION_FILE", "MPI_INIT_DIR_VAR", "RANKS_SURVIVE_VAR", "RunPaths", "result_name"]

# Where each rank records that it started and finished MPI_Init (hpcsplit.core.mpi.init_with_deadline);
# launcher=slurm sets it to <slurm folder>/init.<job id> and reads it when a job fails
# (hpcsplit.launch.slurm.startup_failed).
MPI_INIT_DIR_VAR = "HPCSPLIT_MPI_INIT_DIR"
# set to 1 by the launcher of a server job whose ranks may end without ending the job (hydra run with
# -disable-auto-cleanup and each rank under hpcsplit.launch.keeper; srun --kill-on-bad-exit=0): see
# [Note: serving through faults] in hpcsplit.runtime.server.failover
RANKS_SURVIVE_VAR = "HPCSPLIT_RANKS_SURVIVE"

_FIELDS = ("run_dir", "switchboard_dirname", "profile_filename", "plan_filename")
CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True, slots=True)
class RunPaths:
    """The files of one run folder, and the inputs a stage reads (given paths or the folder's own).

    Examples
    --------
    >>> p = RunPaths.from_config({"paths": {"switchboard_dirname": "switchboard",
    ...     "profile_filename": "profile.h5", "plan_filename": "plan.json"}}, "/runs/a")
    >>> str(p.profile), str(p.plan), str(p.switchboard)
    ('/runs/a/profile.h5', '/runs/a/plan.json', '/runs/a/switchboard')
    >>> str(RunPaths.from_config({"plan": "/elsewhere/p.json"}, "/runs/a").plan)
    '/elsewhere/p.json'
    >>> [str(p) for p in RunPaths.from_config({"profile": {"path": ["/a.h5", "/b.h5"]}}, "/r").profiles]
    ['/a.h5', '/b.h5']
    """

    run_dir: Path
    switchboard: Path  # the switchboard to read (switchboard=PATH, else the run folder's)
    profile: Path  # the profile to read or write (profile.path=PATH, else the run folder's)
    profiles: tuple[Path, ...]  # allocate reads several (profile.path=[A, B]); else (profile,)
    plan: Path  # the plan to read (plan=PATH, else the run folder's)
    calibration: Path  # the calibration to read (calibration=PATH, else the run folder's)
    own_switchboard: Path  # where this run folder's export writes
    own_plan: Path  # where this run folder's allocate writes
    analysis_dir: Path  # where analyze writes (profile.analysis_dir, else <run_dir>/analysis)
    switchboard_given: bool = False
    profile_given: bool = False
    plan_given: bool = False
    calibration_given: bool = False

    CONFIG_KEYS: ClassVar[tuple[str, ...]] = _FIELDS  # the keys of conf/paths/default.yaml

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], run_dir: str | Path) -> RunPaths:
        run = Path(run_dir)
        given = cfg.get("paths")
        # a partial paths group (a rank's config written by hand) takes conf/paths/default.yaml's names
        values = {**group_defaults("paths"), **given} if isinstance(given, Mapping) else given
        c = Checker("paths", group_defaults("paths") if given is None else values, _FIELDS)
        sb_name = c.string("switchboard_dirname")
        prof_name = c.string("profile_filename")
        plan_name = c.string("plan_filename")
        for key, name in (("switchboard_dirname", sb_name), ("profile_filename", prof_name),
                          ("plan_filename", plan_name)):
            if name and (Path(name).name != name or name in (".", "..")):
                c.problem(f"paths.{key} = {name!r}: needs a plain file name (no folders)")
        c.done()
        prof_cfg = cfg.get("profile")
        prof_given = prof_cfg.get("path") if isinstance(prof_cfg, Mapping) else None
        many = tuple(Path(p) for p in prof_given) if isinstance(prof_given, list | tuple) else ()
        if isinstance(prof_given, list | tuple):
            if not prof_given or not all(isinstance(p, str) and p for p in prof_given):
                raise ConfigError(f"profile.path = {prof_given!r}: needs a path or a non-empty list of paths")
            prof_given = prof_given[0]
        elif prof_given is not None and not isinstance(prof_given, str | Path):
            raise ConfigError(f"profile.path = {prof_given!r}: needs a path, a list of paths or null")
        sb_given, plan_given, cal_given = cfg.get("switchboard"), cfg.get("plan"), cfg.get("calibration")
        for key, v in (("switchboard", sb_given), ("plan", plan_given), ("calibration", cal_given)):
            if v is not None and not isinstance(v, str | Path):
                raise ConfigError(f"{key} = {v!r}: needs a path or null")
        profile = Path(prof_given) if prof_given else run / prof_name
        analysis = prof_cfg.get("analysis_dir") if isinstance(prof_cfg, Mapping) else None
        if analysis is not None and not isinstance(analysis, str | Path):
            raise ConfigError(f"profile.analysis_dir = {analysis!r}: needs a path or null")
        return cls(
            run_dir=run,
            switchboard=Path(sb_given) if sb_given else run / sb_name,
            profile=profile,
            profiles=many or (profile,),
            plan=Path(plan_given) if plan_given else run / plan_name,
            calibration=Path(cal_given) if cal_given else run / CALIBRATION_FILE,
            own_switchboard=run / sb_name,
            own_plan=run / plan_name,
            analysis_dir=Path(analysis) if analysis else run / "analysis",
            switchboard_given=bool(sb_given),
            profile_given=bool(prof_given),
            plan_given=bool(plan_given),
            calibration_given=bool(cal_given),
        )

    # ------------------------------------------------------------------------------ what stages write
    @property
    def plan_png(self) -> Path:
        return self.own_plan.with_suffix(".png")

    @property
    def own_calibration(self) -> Path:
        """Where this run folder's ``stage=calibrate`` writes."""
        return self.run_dir / CALIBRATION_FILE

    @property
    def simulate_dir(self) -> Path:
        """``stage=simulate``'s tables and plots."""
        return self.run_dir / "simulate"

    @property
    def bench_dir(self) -> Path:
        return self.run_dir / "bench"

    @property
    def bench_summary(self) -> Path:
        """The bench mode's table, one row per variant and load."""
        return self.bench_dir / "summary.csv"

    @property
    def bench_record(self) -> Path:
        """The bench's plan (sha256 of the file), schedule and serving settings, written before its first level."""
        return self.bench_dir / "bench.json"

    @property
    def bench_levels(self) -> Path:
        """The bench mode's finished levels, one CSV row appended as each level ends (a killed job keeps them)."""
        return self.bench_dir / "levels.csv"

    @property
    def bench_rank_cpu(self) -> Path:
        """The CPU of each rank on the frontend's node per finished level (appended as each level ends)."""
        return self.bench_dir / "rank_cpu.csv"

    @property
    def slurm_dir(self) -> Path:
        """submitit's folder of job scripts and logs."""
        return self.run_dir / "slurm"

    @property
    def probe_table(self) -> Path:
        return self.run_dir / "probe.txt"

    @property
    def batch_outputs(self) -> Path:
        return self.run_dir / "outputs.h5"

    @property
    def trace_dir(self) -> Path:
        return self.run_dir / "trace"

    @property
    def server_endpoint(self) -> Path:
        """Server mode: host, ports, model and token file of the running server (written once it is ready)."""
        return self.run_dir / "endpoint.json"

    @property
    def server_token(self) -> Path:
        """Server mode: the job's bearer token (0600)."""
        return self.run_dir / "server.token"

    @property
    def manifest(self) -> Path:
        return self.run_dir / "manifest.json"

    @property
    def launch_record(self) -> Path:
        return self.run_dir / "launch.json"

    @property
    def summary(self) -> Path:
        return self.run_dir / "summary.md"

    def stage_config(self, stage: str) -> Path:
        """The resolved config an MPI stage's ranks read."""
        return self.run_dir / f"{stage}.cfg.json"

    def stage_log(self, stage: str) -> Path:
        return self.run_dir / f"{stage}.log"

    def rank_result(self, entry: str) -> Path:
        """Where rank 0 writes the return value of ``entry`` (``package.module:function``): named after the
        module, or after its folder for a stage's ``stage.py`` (``runtime.mpi_main.result.json``)."""
        return self.run_dir / result_name(entry)

    def sbatch_script(self, stage: str) -> Path:
        return self.run_dir / f"{stage}.sbatch"

    def sbatch_config(self, stage: str) -> Path:
        """The resolved config a ``stage=sbatch`` script's ranks read (as ``slurm/*.sbatch`` name it)."""
        return self.run_dir / f"{stage}.sbatch.cfg.json"


def result_name(entry: str) -> str:
    """The file name of rank 0's result of ``entry``.

    >>> result_name("hpcsplit.runtime.stage:mpi_main"), result_name("hpcsplit.launch.probe:mpi_main")
    ('runtime.mpi_main.result.json', 'probe.mpi_main.result.json')
    """
    mod, _, func = entry.partition(":")
    parts = mod.split(".")
    name = parts[-2] if parts[-1] == "stage" and len(parts) > 1 else parts[-1]
    return f"{name}.{func}.result.json"
