"""Local launching: MPI stages as ``mpiexec -n N python -m mpi4py -m hpcsplit.launch.rank ...``.

:func:`run_mpi_local` starts the ranks on this machine (``launcher=local``), streams their output to
this terminal and to ``RUN_DIR/<stage>.log``, kills them after ``launcher.timeout_min`` and reads rank
0's result (``RunPaths.rank_result``).  Inside a SLURM step or a one-node batch script the ranks are
forked on this node (:func:`_local_env`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

from hpcsplit.core.paths import RunPaths
from hpcsplit.errors import LaunchError
from hpcsplit.launch.stages import LocalLauncherSettings

__all__ = ["find_mpiexec", "mpiexec_command", "mpiexec_flavour", "run_mpi_local"]

Echo = Callable[[str], None]


def _echo(msg: str) -> None:
    print(msg, flush=True)


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
    """The ``mpiexec -n N python -m mpi4py -m hpcsplit.launch.rank ...`` command line.

    Open MPI gets ``--oversubscribe`` (more ranks than cores) and, as root, ``--allow-run-as-root``.
    """
    cmd = [mpiexec]
    if mpiexec_flavour(mpiexec) == "openmpi":
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")
    cmd += list(extra_args or [])
    cmd += ["-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank", entry]
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
    paths: RunPaths,
    stage: str,
    ranks: int,
    launcher: LocalLauncherSettings,
    echo: Echo = _echo,
) -> Any:
    """Run ``entry`` on ``ranks`` local MPI ranks; return rank 0's result.

    Parameters
    ----------
    entry : str
        ``package.module:function`` the ranks run.
    cfg : dict
        The resolved config, written to ``RUN_DIR/<stage>.cfg.json`` for the ranks.
    paths : RunPaths
        The run folder's files.
    stage : str
        The stage's name (log and config file names, messages).
    ranks : int
        ``mpiexec -n``.
    launcher : LocalLauncherSettings
        mpiexec, its extra arguments and the time limit.
    echo : callable
        Where progress lines go.

    Rank output goes to this terminal and to ``RUN_DIR/<stage>.log``.

    Raises
    ------
    LaunchError
        When mpiexec exits non-zero (with the ranks' error lines and the tail of stderr), runs past
        ``launcher.timeout_min``, or rank 0 wrote no result.
    """
    mpiexec = find_mpiexec(launcher.mpiexec)
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = paths.stage_config(stage)
    cfg_path.write_text(json.dumps(cfg, indent=2, default=str))
    result = paths.rank_result(entry)
    result.unlink(missing_ok=True)
    cmd = mpiexec_command(mpiexec, ranks, entry, cfg_path, paths.run_dir, list(launcher.mpiexec_args))
    timeout_min = launcher.timeout_min
    timeout_s = None if timeout_min is None else float(timeout_min) * 60
    log_path = paths.stage_log(stage)
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
