"""The launch layer: ``python -m hpcsplit stage=... launcher=local|slurm``.

The only module that imports Hydra (and, through :mod:`hpcsplit._slurm`, submitit).
``@hydra.main`` resolves the config into a plain dict and calls :func:`main`, which validates it and
dispatches the stage (see ``[Note: stage entry points]`` in docs/architecture.md):

* export, analyze, allocate, sbatch run in this process: ``run_<stage>(cfg, run_dir) -> dict``;
* probe, profile, serve, bench run as MPI ranks: ``python -m mpi4py -m hpcsplit._rank MODULE:FUNC
  CFG.json RUN_DIR`` under ``mpiexec -n N`` (``launcher=local``) or as one SLURM job through submitit
  (``launcher=slurm``, see ``[Note: SLURM job shape]`` in :mod:`hpcsplit._slurm`);
* ``all`` runs export, profile, analyze, allocate and bench in order (:mod:`hpcsplit.pipeline`),
  skipping stages whose inputs did not change since the last run in the same folder.

Every stage writes into the Hydra run folder (``paths.run_dir``), which is printed at the end.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

from hpcsplit import _rank
from hpcsplit.config import conf_dir, validate
from hpcsplit.errors import HpcsplitError, LaunchError

__all__ = ["find_mpiexec", "hydra_main", "main", "mpiexec_command", "run_mpi", "run_mpi_local", "run_stage"]

# [Note: stage table] stage -> (module, function); MPI stages name their rank entry point.
LOCAL_STAGES: dict[str, tuple[str, str]] = {
    "export": ("hpcsplit.switchboard", "run_export"),
    "analyze": ("hpcsplit.analyze", "run_analyze"),
    "allocate": ("hpcsplit.allocate", "run_allocate"),
    "sbatch": ("hpcsplit.sbatch", "run_sbatch"),
}
MPI_ENTRIES: dict[str, tuple[str, str]] = {
    "probe": ("hpcsplit.probe", "mpi_main"),
    "profile": ("hpcsplit.profiling", "mpi_main"),
    "serve": ("hpcsplit.runtime.worker", "mpi_main"),
    "bench": ("hpcsplit.runtime.worker", "mpi_main"),
}
ALL_STAGES = ("export", "profile", "analyze", "allocate", "bench")  # hpcsplit.pipeline.PIPELINE

Echo = Callable[[str], None]


def _echo(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------- local


def find_mpiexec(name: str | None = None) -> str:
    """Path of ``mpiexec``: ``name`` if given, else the one beside this Python (the mpich wheel), else PATH.

    Raises
    ------
    LaunchError
        When none is found.
    """
    if name:
        found = shutil.which(name)
        if found is None:
            raise LaunchError(f"launcher.mpiexec = {name!r} was not found or is not executable; fix the path")
        return found
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if found is None:
        raise LaunchError(
            "found no `mpiexec` (next to this Python or on PATH), but MPI stages need one: "
            "`pip install mpich` (the [mpich] extra, scripts/setup.sh does it), load your site's MPI "
            "module, or set launcher.mpiexec=/path/to/mpiexec"
        )
    return found


@lru_cache(maxsize=8)
def mpiexec_flavour(mpiexec: str) -> str:
    """``"openmpi"``, ``"mpich"`` or ``"unknown"``, from ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = out.stdout + out.stderr
    if "Open MPI" in text or "OpenRTE" in text or "open-mpi" in text.lower():
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        return "mpich"
    return "unknown"


def mpiexec_command(
    mpiexec: str, ranks: int, entry: str, cfg_path: Path, run_dir: Path, extra_args: list[str] | None = None
) -> list[str]:
    """The ``mpiexec -n N python -m mpi4py -m hpcsplit._rank ...`` command line.

    Open MPI gets ``--oversubscribe`` (more ranks than cores) and, as root, ``--allow-run-as-root``.
    """
    cmd = [mpiexec]
    if mpiexec_flavour(mpiexec) == "openmpi":
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")
    cmd += list(extra_args or [])
    cmd += ["-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "hpcsplit._rank", entry]
    cmd += [str(cfg_path), str(run_dir)]
    return cmd


# Variables of the SLURM step this process may run in; they do not describe a local mpiexec world.
_STEP_VARS = (
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
)


def _local_env(mpiexec: str, echo: Echo) -> dict[str, str]:
    """Environment of local ranks.  Inside an srun step (e.g. Hydra's submitit launcher) MPICH's
    mpiexec would start its proxies with srun, which waits for resources the step already holds;
    in a one-node batch script the proxy's step variables would reach the ranks.  In both cases
    fork the ranks on this node instead, and hide the outer step's task variables from them.
    In a multi-node batch script mpiexec uses the allocation (srun) as usual."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    in_step = "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env
    # A one-node batch script (slurm/pipeline.sbatch): MPICH would start its proxy with srun, whose
    # step variables (SLURM_NTASKS = 1 proxy) reach the ranks and fail their world-size check.
    one_node_batch = "SLURM_JOB_ID" in env and not in_step and env.get("SLURM_JOB_NUM_NODES", "1") == "1"
    if in_step or one_node_batch:
        if mpiexec_flavour(mpiexec) == "mpich" and "HYDRA_BOOTSTRAP" not in env:
            env["HYDRA_BOOTSTRAP"] = "fork"
            where = f"step {env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}" if in_step else f"job {env['SLURM_JOB_ID']}"
            echo(f"[hpcsplit] inside SLURM {where} (one node): ranks forked here")
        for var in _STEP_VARS:
            env.pop(var, None)
    elif "SLURM_JOB_ID" in env:
        echo("[hpcsplit] launcher=local inside a multi-node SLURM allocation: mpiexec starts ranks through srun; "
             "if they fail their world-size check, use launcher=slurm (one job per MPI stage) instead")
    return env


def _pump(src: IO[str], sinks: list[IO[str]], keep: deque[str] | None) -> None:
    for line in src:
        for sink in sinks:
            try:
                sink.write(line)
                sink.flush()
            except (OSError, ValueError):
                pass
        if keep is not None:
            keep.append(line.rstrip("\n"))


def _kill_group(proc: subprocess.Popen[str]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_mpi_local(
    entry: str,
    cfg: dict[str, Any],
    run_dir: Path,
    stage: str,
    ranks: int,
    echo: Echo = _echo,
) -> Any:
    """Run ``entry`` on ``ranks`` local MPI ranks; return rank 0's result.

    Rank output goes to this terminal and to ``RUN_DIR/<stage>.log``.

    Raises
    ------
    LaunchError
        When mpiexec exits non-zero (with the ranks' error lines and the tail of stderr), runs past
        ``launcher.timeout_min``, or rank 0 wrote no result.
    """
    launcher = cfg.get("launcher") or {}
    mpiexec = find_mpiexec(launcher.get("mpiexec"))
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / f"{stage}.cfg.json"
    cfg_path.write_text(json.dumps(cfg, indent=2, default=str))
    result = _rank.result_path(run_dir, entry)
    result.unlink(missing_ok=True)
    cmd = mpiexec_command(mpiexec, ranks, entry, cfg_path, run_dir, launcher.get("mpiexec_args"))
    timeout_min = launcher.get("timeout_min")
    timeout_s = None if timeout_min is None else float(timeout_min) * 60
    log_path = run_dir / f"{stage}.log"
    echo(f"[hpcsplit] {stage}: {ranks} MPI rank(s): {' '.join(cmd[:3])} ... {entry}; log {log_path}")
    env = _local_env(mpiexec, echo)
    t0 = time.monotonic()
    tail: deque[str] = deque(maxlen=60)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
        assert proc.stdout is not None and proc.stderr is not None
        pumps = [
            threading.Thread(target=_pump, args=(proc.stdout, [sys.stdout, log], tail), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, [sys.stderr, log], tail), daemon=True),
        ]
        for p in pumps:
            p.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            for p in pumps:
                p.join(timeout=5)
            raise LaunchError(
                f"{stage}: {ranks} MPI rank(s) ran past launcher.timeout_min={timeout_min} and were killed. "
                f"Raise launcher.timeout_min if the stage is just slow. Log: {log_path}\n"
                + "\n".join(list(tail)[-20:])
            ) from None
        except KeyboardInterrupt:
            _kill_group(proc)
            raise
        for p in pumps:
            p.join(timeout=10)
    elapsed = time.monotonic() - t0
    if rc != 0:
        lines = [x for x in tail if x.strip() and not set(x.strip()) <= {"="}]
        rank_lines = [x for x in lines if x.startswith("[rank ")]
        shown = rank_lines[:10] + ["--- tail of the output:"] + lines[-12:] if rank_lines else lines[-25:]
        raise LaunchError(
            f"{stage}: `mpiexec -n {ranks} ... {entry}` exited with code {rc}{_signal_name(rc)} "
            f"after {elapsed:.1f} s.\n" + "\n".join(shown) + f"\nFull log: {log_path}"
        )
    if not result.exists():
        raise LaunchError(
            f"{stage}: the MPI ranks exited cleanly but rank 0 wrote no result ({result}); see {log_path}"
        )
    return json.loads(result.read_text())


def _signal_name(rc: int) -> str:
    """`` (a rank was killed by SIGKILL)`` for MPICH's 9 / a shell's 137, else empty."""
    sig = rc - 128 if rc > 128 else (-rc if rc < 0 else rc if rc in (6, 9, 11, 15) else 0)
    try:
        return f" (a rank was killed by {signal.Signals(sig).name})" if sig else ""
    except ValueError:
        return ""


# -------------------------------------------------------------------------------------------- stages


def _available(mod: str, func: str) -> tuple[Callable[..., Any] | None, str]:
    """The stage function, or None and why it is not available."""
    try:
        spec = importlib.util.find_spec(mod)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return None, f"module {mod} does not exist yet"
    module = importlib.import_module(mod)
    fn = getattr(module, func, None)
    if fn is None:
        return None, f"{mod} has no {func}() yet"
    return fn, ""


def _mpi_ranks(stage: str, cfg: Mapping[str, Any], run_dir: Path) -> int | None:
    launcher = cfg.get("launcher") or {}
    local = launcher.get("name", "local") == "local"
    if stage in ("serve", "bench"):
        plan_path = _input_path(cfg, run_dir, "plan")
        if plan_path is None:
            raise LaunchError(
                f"stage={stage} needs a plan: run stage=allocate first (plan.json in the run folder) "
                "or pass plan=PATH"
            )
        from hpcsplit.runtime.plan import Plan

        return Plan.load(plan_path).world_size
    if stage == "profile":
        ranks = (cfg.get("profile") or {}).get("ranks") or launcher.get("ranks")
    else:
        ranks = launcher.get("ranks")
    if ranks is None and local:
        return 1
    return None if ranks is None else int(ranks)


def _plan_shape(cfg: Mapping[str, Any], run_dir: Path) -> tuple[int, int] | None:
    """A plan's ``(nodes, most ranks on one node)`` for the SLURM job shape."""
    plan_path = _input_path(cfg, run_dir, "plan")
    if plan_path is None:
        return None
    from collections import Counter

    from hpcsplit.runtime.plan import Plan

    plan = Plan.load(plan_path)
    per_node = Counter(r.node for r in plan.ranks)
    return plan.nodes, max(per_node.values())


def _input_path(cfg: Mapping[str, Any], run_dir: Path, what: str) -> Path | None:
    """An earlier stage's output: the configured path, else the file in this run folder, else None."""
    paths = cfg.get("paths") or {}
    if what == "profile":
        given = (cfg.get("profile") or {}).get("path")
        default = run_dir / paths.get("profile_filename", "profile.h5")
    elif what == "plan":
        given = cfg.get("plan")
        default = run_dir / paths.get("plan_filename", "plan.json")
    else:
        given = cfg.get("switchboard")
        default = run_dir / paths.get("switchboard_dirname", "switchboard")
    if given:
        return Path(given)
    return default if default.exists() else None


def run_mpi(
    entry: str,
    cfg: dict[str, Any],
    run_dir: Path,
    stage: str,
    ranks: int | None,
    echo: Echo = _echo,
    shape: tuple[int, int] | None = None,
) -> Any:
    """Run an MPI entry point with the configured launcher (local mpiexec or SLURM).

    ``shape`` (a plan's nodes and most ranks per node) only matters under SLURM.
    """
    launcher = (cfg.get("launcher") or {}).get("name", "local")
    if launcher == "slurm":
        from hpcsplit import _slurm

        return _slurm.run_mpi_slurm(entry, cfg, run_dir, stage, ranks, echo=echo, shape=shape)
    return run_mpi_local(entry, cfg, run_dir, stage, ranks or 1, echo=echo)


def run_stage(stage: str, cfg: dict[str, Any], run_dir: Path, echo: Echo = _echo) -> Any:
    """Run one stage (not ``all``) and return its result (a summary dict, or rank 0's value)."""
    if stage in LOCAL_STAGES:
        fn, why = _available(*LOCAL_STAGES[stage])
        if fn is None:
            raise LaunchError(f"stage={stage} is not available in this version: {why}")
        return fn(cfg, run_dir)
    mod, func = MPI_ENTRIES[stage]
    fn, why = _available(mod, func)
    if fn is None:
        raise LaunchError(f"stage={stage} is not available in this version: {why}")
    ranks = _mpi_ranks(stage, cfg, run_dir)
    shape = _plan_shape(cfg, run_dir) if stage in ("serve", "bench") else None
    result = run_mpi(f"{mod}:{func}", cfg, run_dir, stage, ranks, echo=echo, shape=shape)
    if stage == "probe" and (cfg.get("launcher") or {}).get("name") == "slurm" and isinstance(result, list):
        from hpcsplit.probe import format_table

        echo(format_table(result))
    return result


def _preflight(stage: str, cfg: dict[str, Any]) -> None:
    """Fail before any work when the launcher the stages need is missing (not after a long export)."""
    if stage not in (*MPI_ENTRIES, "all"):
        return
    if cfg["launcher"]["name"] == "slurm":
        if shutil.which("sbatch") is None:
            raise LaunchError(
                "launcher=slurm but there is no `sbatch` on PATH: run on a SLURM login node (module load "
                "slurm), use launcher=local, or start a dev cluster with `slurm/dev-cluster.sh up`."
            )
    else:
        find_mpiexec((cfg.get("launcher") or {}).get("mpiexec"))


def _run_all(cfg: dict[str, Any], run_dir: Path, echo: Echo) -> dict[str, Any]:
    """``stage=all``: see :mod:`hpcsplit.pipeline` (skips up-to-date stages, writes summary.md)."""
    from hpcsplit.pipeline import run_pipeline

    return run_pipeline(cfg, run_dir, echo, run_stage)


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
    validate(cfg)
    if run_dir is None:
        run_dir = (cfg.get("paths") or {}).get("run_dir") or Path.cwd()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.setdefault("paths", {})["run_dir"] = str(run_dir)
    stage = cfg["stage"]
    launcher = cfg["launcher"]["name"]
    cluster = (cfg.get("cluster") or {}).get("name")
    _preflight(stage, cfg)
    echo(f"[hpcsplit] stage={stage} launcher={launcher} cluster={cluster} run folder {run_dir}")
    t0 = time.monotonic()
    result = _run_all(cfg, run_dir, echo) if stage == "all" else _timed(stage, cfg, run_dir, echo)
    summary = {
        "stage": stage,
        "launcher": launcher,
        "run_dir": str(run_dir),
        "elapsed_s": time.monotonic() - t0,
    }
    (run_dir / "launch.json").write_text(json.dumps({**summary, "result": result}, indent=2, default=str))
    if stage == "all":
        echo(f"[hpcsplit] done in {summary['elapsed_s']:.1f} s. Results: {run_dir} (read {run_dir / 'summary.md'} "
             f"first); {len(result.get('plots') or [])} plot(s) listed there")
    else:
        echo(f"[hpcsplit] outputs of stage={stage} are in {run_dir}")
    return {**summary, "result": result}


def hydra_main() -> None:
    """``python -m hpcsplit``: Hydra parses the command line and calls :func:`main`."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

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

    _app()
