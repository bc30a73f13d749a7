"""The stage table and the launch settings: what each stage runs, where, and how the launcher is set.

[Note: stage table]
One row per stage (:class:`Stage`): its entry point (``package.module:function``), whether it runs in
this process (``run_x(cfg, run_dir) -> dict``) or as MPI ranks (``mpi_main(cfg, run_dir, comm=None)``
started by ``python -m mpi4py -m hpcsplit.launch.rank``), whether ``stage=all`` runs it, whether its
SLURM job may requeue itself (a checkpointable profile), and where an MPI stage's rank count comes
from.  :mod:`hpcsplit.launch.config` validates ``stage=`` against it, :mod:`hpcsplit.launch.app`
dispatches by it and :mod:`hpcsplit.launch.pipeline` runs its ``in_all`` rows in table order.  Entry
points are imported by name when a stage runs (:func:`resolve`), so the login-side process never
imports a stage's heavy libraries (torch, mpi4py) it does not run.

[Note: launch settings]
``SETTINGS`` names the settings class of each config group launch reads: ``launcher`` (its options
``local`` and ``slurm`` have different keys), ``cluster`` (:class:`~hpcsplit.core.cluster.ClusterSpec`)
and ``paths`` (:class:`~hpcsplit.core.paths.RunPaths`).  Keys missing from a partial config (tests,
Python callers) take ``conf/launcher/<name>.yaml``'s values; unknown keys are refused with the
closest valid one suggested.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from hpcsplit.core.cluster import ClusterSpec
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.settings import Checker, group_defaults
from hpcsplit.errors import ConfigError

__all__ = [
    "LAUNCHERS",
    "MPI_STAGES",
    "PIPELINE",
    "SETTINGS",
    "STAGES",
    "STAGE_NAMES",
    "LauncherSettings",
    "LocalLauncherSettings",
    "SlurmLauncherSettings",
    "Stage",
    "launcher_settings",
    "resolve",
]


@dataclass(frozen=True, slots=True)
class Stage:
    """One row of the stage table (see ``[Note: stage table]``).

    Attributes
    ----------
    name : str
        ``stage=<name>`` on the command line.
    entry : str
        ``package.module:function``.
    mpi : bool
        True: MPI ranks run ``entry``; False: this process calls it.
    in_all : bool
        Part of ``stage=all`` (in table order).
    requeueable : bool
        Its SLURM job is checkpointable and requeues itself on a time limit (``launcher.max_requeue``).
    ranks : str or None
        Where an MPI stage's rank count comes from: ``"plan"`` (the plan's world size),
        ``"profile"`` (``profile.ranks``, else ``launcher.ranks``), ``"launcher"`` (``launcher.ranks``),
        ``"calibrate"`` (``calibrate.ranks``, else ``launcher.ranks``, else 3 locally and 3 per node on at most
        two nodes under SLURM).

    Examples
    --------
    >>> STAGES["bench"].module, STAGES["bench"].function
    ('hpcsplit.runtime.stage', 'mpi_main')
    """

    name: str
    entry: str
    mpi: bool
    in_all: bool = False
    requeueable: bool = False
    ranks: str | None = None

    @property
    def module(self) -> str:
        return self.entry.partition(":")[0]

    @property
    def function(self) -> str:
        return self.entry.partition(":")[2]


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("export", "hpcsplit.switchboard.stage:run_export", mpi=False, in_all=True),
        Stage("profile", "hpcsplit.profiling.stage:mpi_main", mpi=True, in_all=True, requeueable=True,
              ranks="profile"),
        Stage("analyze", "hpcsplit.profiling.stage:run_analyze", mpi=False, in_all=True),
        Stage("allocate", "hpcsplit.allocation.stage:run_allocate", mpi=False, in_all=True),
        Stage("serve", "hpcsplit.runtime.stage:mpi_main", mpi=True, ranks="plan"),
        Stage("bench", "hpcsplit.runtime.stage:mpi_main", mpi=True, in_all=True, ranks="plan"),
        Stage("probe", "hpcsplit.launch.probe:mpi_main", mpi=True, ranks="launcher"),
        Stage("calibrate", "hpcsplit.launch.calibrate:mpi_main", mpi=True, ranks="calibrate"),
        Stage("simulate", "hpcsplit.launch.simulate:run_simulate", mpi=False),
        Stage("sbatch", "hpcsplit.launch.sbatch:run_sbatch", mpi=False),
    )
}
STAGE_NAMES = (*STAGES, "all")
MPI_STAGES = tuple(s.name for s in STAGES.values() if s.mpi)
PIPELINE = tuple(s.name for s in STAGES.values() if s.in_all)  # stage=all, in this order
LAUNCHERS = ("local", "slurm")
CALIBRATE_RANKS_PER_NODE = 3  # stage=calibrate: a frontend and a two-component chain on its node (and as many on one more)


def resolve(entry: str) -> Any:
    """Import ``"package.module:function"`` and return the function.

    Raises
    ------
    ValueError
        When ``entry`` has no ``:function`` part.
    """
    mod_name, _, func_name = entry.partition(":")
    if not func_name:
        raise ValueError(f"entry point {entry!r} must look like 'package.module:function'")
    return getattr(importlib.import_module(mod_name), func_name)


# ---------------------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class LocalLauncherSettings:
    """``launcher=local`` (``conf/launcher/local.yaml``): MPI stages start ranks with ``mpiexec -n N``."""

    name: str
    ranks: int | None
    mpiexec: str | None
    mpiexec_args: tuple[str, ...]
    timeout_min: float | None
    grace_s: float
    restarts: int
    restart_backoff_s: float

    @classmethod
    def read(cls, c: Checker) -> LocalLauncherSettings:
        args = c.get("mpiexec_args") or []
        if not isinstance(args, list | tuple) or not all(isinstance(a, str) for a in args):
            c.problem(f"launcher.mpiexec_args = {args!r}: needs a list of strings")
            args = []
        return cls(
            name="local",
            ranks=c.integer("ranks", lo=1, none=True),
            mpiexec=c.string("mpiexec", none=True),
            mpiexec_args=tuple(args),
            timeout_min=c.number("timeout_min", lo=0, lo_open=True, none=True),
            grace_s=c.number("grace_s", lo=0, hi=3600),
            restarts=c.integer("restarts", lo=0),
            restart_backoff_s=c.number("restart_backoff_s", lo=0, hi=3600),
        )


@dataclass(frozen=True, slots=True)
class SlurmLauncherSettings:
    """``launcher=slurm`` (``conf/launcher/slurm.yaml``): each MPI stage is one SLURM job (submitit)."""

    name: str
    ranks: int | None
    timeout_min: float | None
    poll_s: float
    poll_max_s: float
    progress_s: float
    max_requeue: int
    restarts: int
    restart_backoff_s: float

    @classmethod
    def read(cls, c: Checker) -> SlurmLauncherSettings:
        return cls(
            name="slurm",
            ranks=c.integer("ranks", lo=1, none=True),
            timeout_min=c.number("timeout_min", lo=0, lo_open=True, none=True),
            poll_s=c.number("poll_s", lo=0, lo_open=True),
            poll_max_s=c.number("poll_max_s", lo=0, lo_open=True),
            progress_s=c.number("progress_s", lo=0, lo_open=True),
            max_requeue=c.integer("max_requeue", lo=0),
            restarts=c.integer("restarts", lo=0),
            restart_backoff_s=c.number("restart_backoff_s", lo=0, hi=3600),
        )


LauncherSettings = LocalLauncherSettings | SlurmLauncherSettings
_LAUNCHER_CLASSES: dict[str, type[LocalLauncherSettings | SlurmLauncherSettings]] = {
    "local": LocalLauncherSettings,
    "slurm": SlurmLauncherSettings,
}

SETTINGS: dict[str, type | dict[str, type]] = {
    "launcher": dict(_LAUNCHER_CLASSES),
    "cluster": ClusterSpec,
    "paths": RunPaths,
}


def launcher_problems(cfg: Mapping[str, Any]) -> tuple[LauncherSettings | None, list[str]]:
    """The launcher settings of ``cfg`` and every problem found (settings None when the name is bad)."""
    node = cfg.get("launcher")
    node = node if isinstance(node, Mapping) else {}
    name = node.get("name", "local")
    if name not in _LAUNCHER_CLASSES:
        return None, [f"launcher.name = {name!r}: needs one of {list(LAUNCHERS)} (launcher=local|slurm)"]
    values = {**group_defaults("launcher", name), **node}
    cls = _LAUNCHER_CLASSES[name]
    c = Checker("launcher", values, [f.name for f in fields(cls)])
    settings = cls.read(c)
    return settings, c.problems


def launcher_settings(cfg: Mapping[str, Any]) -> LauncherSettings:
    """The ``launcher`` group of ``cfg`` as its settings dataclass.

    Raises
    ------
    ConfigError
        Listing every problem (unknown keys with the closest valid key, bad values).

    Examples
    --------
    >>> launcher_settings({"launcher": {"name": "local", "ranks": 3}}).ranks
    3
    >>> launcher_settings({"launcher": {"name": "slurm"}}).max_requeue
    3
    """
    settings, problems = launcher_problems(cfg)
    if problems or settings is None:
        raise ConfigError("invalid launcher settings:\n  - " + "\n  - ".join(problems))
    return settings


def cluster_spec(cfg: Mapping[str, Any]) -> ClusterSpec:
    """The ``cluster`` group of ``cfg`` (``conf/cluster/local.yaml`` when the config has none)."""
    node = cfg.get("cluster")
    return ClusterSpec.from_config(node if node is not None else group_defaults("cluster", "local"))


def configured_ranks(stage: Stage, cfg: Mapping[str, Any], launcher: LauncherSettings) -> int | None:
    """An MPI stage's rank count from the config (``[Note: stage table]``), None when not fixed there.

    ``ranks="plan"`` stages are sized by their plan (:mod:`hpcsplit.launch.app`), not here.
    """
    ranks = launcher.ranks
    if stage.ranks in ("profile", "calibrate"):
        node = cfg.get(stage.ranks)
        given = node.get("ranks") if isinstance(node, Mapping) else None
        ranks = int(given) if given else ranks
    if stage.ranks == "calibrate" and ranks is None:
        ranks = CALIBRATE_RANKS_PER_NODE * (min(2, cluster_spec(cfg).nodes) if launcher.name == "slurm" else 1)
    return ranks
