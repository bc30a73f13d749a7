"""The Hydra app: ``python -m hpcsplit stage=... launcher=local|slurm``, and the dispatch of one stage.

The only module that imports Hydra.  ``@hydra.main`` resolves the config into a plain dict and calls
:func:`main`, which validates it and dispatches the stage by the stage table
(``[Note: stage table]`` in :mod:`hpcsplit.launch.stages`):

* export, analyze, allocate, sbatch run in this process: ``run_<stage>(cfg, run_dir) -> dict``;
* probe, profile, serve, bench run as MPI ranks: ``python -m mpi4py -m hpcsplit.launch.rank MODULE:FUNC
  CFG.json RUN_DIR`` under ``mpiexec -n N`` (``launcher=local``, :mod:`hpcsplit.launch.local`) or as
  one SLURM job through submitit (``launcher=slurm``, ``[Note: SLURM job shape]`` in
  :mod:`hpcsplit.launch.slurm`);
* ``all`` runs the table's ``in_all`` stages in order (:mod:`hpcsplit.launch.pipeline`), skipping
  stages whose inputs did not change since the last run in the same folder.

Every stage writes into the Hydra run folder (``paths.run_dir``), which is printed at the end.  This
process imports neither mpi4py nor torch: entry points are imported by name when they run, and MPI
stages run them in rank processes.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpcsplit.core.detect import AUTO, detect_gpus, resolve_cluster
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan
from hpcsplit.errors import ConfigError, HpcsplitError, LaunchError
from hpcsplit.launch import slurm as _slurm
from hpcsplit.launch.config import check_plan_on_cluster, conf_dir, plan_roles, validate
from hpcsplit.launch.keeper import serves_through_faults
from hpcsplit.launch.local import find_mpiexec, mpiexec_command, mpiexec_flavour, run_mpi_local
from hpcsplit.launch.pipeline import run_pipeline
from hpcsplit.launch.probe_table import format_table
from hpcsplit.launch.serve_watch import restart_on_cluster, serve_with_restarts
from hpcsplit.launch.stages import (
    STAGES,
    LocalLauncherSettings,
    SlurmLauncherSettings,
    cluster_spec,
    configured_ranks,
    launcher_settings,
    resolve,
)
from hpcsplit.runtime.settings import RuntimeSettings

__all__ = [
    "find_mpiexec",
    "hydra_main",
    "main",
    "mpiexec_command",
    "mpiexec_flavour",
    "run_mpi",
    "run_mpi_local",
    "run_stage",
]

Echo = Callable[[str], None]


def _echo(msg: str) -> None:
    print(msg, flush=True)


def _available(entry: str, load: bool = True) -> tuple[Callable[..., Any] | None, str]:
    """The stage function (``load``), or None and why it is not available.

    With ``load=False`` only the module's existence is checked: an MPI stage's module is imported by
    its ranks, not by this process (it may import torch or mpi4py); the function is still returned
    as None then, with an empty reason.
    """
    mod, _, func = entry.partition(":")
    try:
        spec = importlib.util.find_spec(mod)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return None, f"module {mod} does not exist yet"
    if not load:
        return None, ""
    try:
        return resolve(entry), ""
    except AttributeError:
        return None, f"{mod} has no {func}() yet"


def _plan_of(stage: str, paths: RunPaths) -> Plan:
    if not (paths.plan_given or paths.plan.exists()):
        raise LaunchError(
            f"stage={stage} needs a plan: run stage=allocate first ({paths.plan.name} in the run folder) "
            "or pass plan=PATH"
        )
    return Plan.load(paths.plan)


def _check_switchboard(stage: str, paths: RunPaths) -> None:
    """Refuse to start ranks for a switchboard folder that is not there (each rank would fail alone)."""
    sb = paths.switchboard
    if not sb.is_dir() or not (sb / "layout.json").is_file():
        given = "switchboard=" + str(sb) if paths.switchboard_given else f"the run folder's {sb.name}/"
        raise LaunchError(
            f"stage={stage} needs a switchboard, but {given} is not a switchboard folder (no {sb / 'layout.json'}): "
            "pass switchboard=PATH (the export's folder) or run stage=export in this run folder first"
        )


def _plan_shape(plan: Plan) -> tuple[int, int]:
    """A plan's ``(nodes, most ranks on one node)`` for the SLURM job shape."""
    per_node = Counter(r.node for r in plan.ranks)
    return plan.nodes, max(per_node.values())


def _mpi_ranks(stage: str, cfg: Mapping[str, Any], run_dir: Path) -> int | None:
    """An MPI stage's rank count: its plan's world size, or the configured count (local default 1).

    None leaves it to the cluster's geometry (``launcher=slurm``).
    """
    row = STAGES[stage]
    if row.ranks == "plan":
        return _plan_of(stage, RunPaths.from_config(cfg, run_dir)).world_size
    launcher = launcher_settings(cfg)
    ranks = configured_ranks(row, cfg, launcher)
    if ranks is None and isinstance(launcher, LocalLauncherSettings):
        return 1
    return ranks


def run_mpi(
    entry: str,
    cfg: dict[str, Any],
    run_dir: Path,
    stage: str,
    ranks: int | None,
    echo: Echo = _echo,
    shape: tuple[int, int] | None = None,
    roles: Mapping[int, str] | None = None,
) -> Any:
    """Run an MPI entry point with the configured launcher (local mpiexec or SLURM).

    ``shape`` (a plan's nodes and most ranks per node) only matters under SLURM; ``roles`` (rank ->
    what it runs) names a rank that dies under local mpiexec.
    """
    launcher = launcher_settings(cfg)
    if isinstance(launcher, SlurmLauncherSettings):
        return _slurm.run_mpi_slurm(entry, cfg, run_dir, stage, ranks, echo=echo, shape=shape)
    paths = RunPaths.from_config(cfg, run_dir)
    return run_mpi_local(entry, cfg, paths, stage, ranks or 1, launcher, echo=echo, roles=roles)


def _serve(run: Callable[[dict[str, Any]], Any], cfg: dict[str, Any], run_dir: Path, echo: Echo) -> Any:
    """``stage=serve runtime.mode=server``: the login side's endpoint wait and status lines, and the restarts
    (``[Note: server restarts]`` in :mod:`hpcsplit.launch.serve_watch`)."""
    rt = RuntimeSettings.from_config(cfg)
    launcher = launcher_settings(cfg)
    slurm = isinstance(launcher, SlurmLauncherSettings)
    return serve_with_restarts(run, cfg, RunPaths.from_config(cfg, run_dir), echo, rt.server_status_s,
                               launcher.restarts, launcher.restart_backoff_s, rt.tls_cert,
                               (lambda c: restart_on_cluster(c, run_dir, echo)) if slurm else None)


def run_stage(stage: str, cfg: dict[str, Any], run_dir: Path, echo: Echo = _echo) -> Any:
    """Run one stage (not ``all``) and return its result (a summary dict, or rank 0's value)."""
    row = STAGES[stage]
    fn, why = _available(row.entry, load=not row.mpi)
    if why:
        raise LaunchError(f"stage={stage} is not available in this version: {why}")
    if fn is not None:
        return fn(cfg, run_dir)
    def run(c: dict[str, Any]) -> Any:
        shape = None
        roles: dict[int, str] = {}
        if row.ranks == "plan":  # read each time: a server restarted on fewer nodes runs another plan
            paths = RunPaths.from_config(c, run_dir)
            plan = _plan_of(stage, paths)
            check_plan_on_cluster(plan, cluster_spec(c), echo)
            _check_switchboard(stage, paths)
            ranks: int | None = plan.world_size
            shape = _plan_shape(plan)
            roles = plan_roles(plan)
        else:
            ranks = _mpi_ranks(stage, c, run_dir)
        return run_mpi(row.entry, c, run_dir, stage, ranks, echo=echo, shape=shape, roles=roles)

    result = _serve(run, cfg, run_dir, echo) if serves_through_faults(cfg, stage) else run(cfg)
    if stage == "probe" and isinstance(launcher_settings(cfg), SlurmLauncherSettings) and isinstance(result, list):
        echo(format_table(result))
    return result


def _preflight(stage: str, cfg: dict[str, Any]) -> None:
    """Fail before any work when the launcher the stages need is missing (not after a long export)."""
    if stage != "all" and not STAGES[stage].mpi:
        return
    launcher = launcher_settings(cfg)
    if isinstance(launcher, SlurmLauncherSettings):
        if shutil.which("sbatch") is None:
            raise LaunchError(
                "launcher=slurm but there is no `sbatch` on PATH: run on a SLURM login node (module load "
                "slurm), use launcher=local, or start a dev cluster with `slurm/dev-cluster.sh up`."
            )
    else:
        find_mpiexec(launcher.mpiexec)


def _timed(stage: str, cfg: dict[str, Any], run_dir: Path, echo: Echo) -> Any:
    t0 = time.monotonic()
    echo(f"[hpcsplit] stage {stage}: starting")
    out = run_stage(stage, cfg, run_dir, echo)
    echo(f"[hpcsplit] stage {stage}: done in {time.monotonic() - t0:.1f} s")
    return out


def main(cfg: Mapping[str, Any], run_dir: str | Path | None = None, echo: Echo = _echo) -> dict[str, Any]:
    """Validate ``cfg`` and run ``cfg["stage"]`` with outputs in ``run_dir``.

    Parameters
    ----------
    cfg : mapping or DictConfig
        The resolved config (``OmegaConf.to_container(cfg, resolve=True)``).
    run_dir : path, optional
        The run folder (default ``cfg["paths"]["run_dir"]``, Hydra's output dir).
    echo : callable
        Where progress lines go.

    Returns
    -------
    dict
        ``{"stage": ..., "run_dir": ..., "result": ...}``; also written to ``RUN_DIR/launch.json``.

    Raises
    ------
    ConfigError
        Listing every invalid launch setting.
    LaunchError
        When a stage cannot start or its job fails.
    """
    if not isinstance(cfg, dict):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    return _main(json.loads(json.dumps(cfg, default=str)), run_dir, echo)  # a private, JSON-able copy


def _main(cfg: dict[str, Any], run_dir: str | Path | None, echo: Echo) -> dict[str, Any]:
    if "cluster" in cfg:  # cluster=auto: this machine's GPUs, or the CPU spec ([Note: cluster auto])
        cfg["cluster"] = resolve_cluster(cfg["cluster"], echo)
    validate(cfg)
    if run_dir is None:
        run_dir = (cfg.get("paths") or {}).get("run_dir") or Path.cwd()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.setdefault("paths", {})["run_dir"] = str(run_dir)
    paths = RunPaths.from_config(cfg, run_dir)
    stage = cfg["stage"]
    launcher = launcher_settings(cfg).name
    cluster = (cfg.get("cluster") or {}).get("name")
    _preflight(stage, cfg)
    echo(f"[hpcsplit] stage={stage} launcher={launcher} cluster={cluster} run folder {run_dir}")
    t0 = time.monotonic()
    if stage == "all":
        result = run_pipeline(cfg, run_dir, echo, run_stage)
    else:
        result = _timed(stage, cfg, run_dir, echo)
    summary = {
        "stage": stage,
        "launcher": launcher,
        "run_dir": str(run_dir),
        "elapsed_s": time.monotonic() - t0,
    }
    paths.launch_record.write_text(json.dumps({**summary, "result": result}, indent=2, default=str))
    if stage == "all":
        echo(f"[hpcsplit] done in {summary['elapsed_s']:.1f} s. Results: {run_dir} (read {paths.summary} "
             f"first); {len(result.get('plots') or [])} plot(s) listed there")
    else:
        echo(f"[hpcsplit] outputs of stage={stage} are in {run_dir}")
    return {**summary, "result": result}


def cluster_slurm(key: str, _root_: Any) -> Any:
    """``${hpcsplit_slurm:KEY}`` in conf/hydra/launcher/slurm_*.yaml: ``cluster.slurm.KEY`` of the run's config.

    The Hydra launcher presets read the cluster's ``slurm:`` block instead of restating it (one
    Perlmutter SLURM block).  ``node_cpus`` is ``tasks_per_node x cpus_per_task``: the Hydra launcher
    runs ``main()`` as one task, whose MPI ranks come from mpiexec inside the job.

    Raises
    ------
    ConfigError
        When the cluster has no ``slurm:`` block (e.g. hydra/launcher=slurm_dev without cluster=dev).
    """
    cluster = _root_.get("cluster")
    if cluster is None:  # Hydra composes its own config before the run's: nothing to read yet
        return None
    slurm = cluster.get("slurm")
    if slurm is None:
        name = cluster.get("name")
        if name == AUTO:  # what cluster=auto is on this machine (local without GPUs)
            name = "auto" if detect_gpus().gpus else "local"
        raise ConfigError(
            f"the Hydra SLURM launcher preset reads cluster.slurm.{key}, but cluster={name!r} has no slurm "
            "block: add cluster=dev (hydra/launcher=slurm_dev) or cluster=perlmutter (slurm_perlmutter)"
        )
    if key == "node_cpus":
        return int(slurm.get("tasks_per_node") or 1) * int(slurm.get("cpus_per_task") or 1)
    return slurm.get(key)


def hydra_main() -> None:
    """``python -m hpcsplit``: Hydra parses the command line and calls :func:`main`."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    OmegaConf.register_new_resolver("hpcsplit_slurm", cluster_slurm, replace=True)

    @hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="config")
    def _app(cfg: DictConfig) -> None:
        plain = OmegaConf.to_container(cfg, resolve=True)
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            main(plain, run_dir)  # type: ignore[arg-type]
        except HpcsplitError as e:
            sys.stdout.flush()
            print(f"hpcsplit: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except KeyboardInterrupt:  # Ctrl-C in an in-process stage, or while waiting for a SLURM job
            sys.stdout.flush()
            print("hpcsplit: interrupted (Ctrl-C); a SLURM job being waited for was cancelled. "
                  f"Outputs so far are in {run_dir}", file=sys.stderr, flush=True)
            raise SystemExit(130) from None

    _app()
