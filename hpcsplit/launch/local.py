"""Local launching: MPI stages as ``mpiexec -n N python -m mpi4py -m hpcsplit.launch.rank ...``.

:func:`run_mpi_local` starts the ranks on this machine (``launcher=local``), streams their output to
this terminal and to ``RUN_DIR/<stage>.log``, kills them after ``launcher.timeout_min`` and reads rank
0's result (``RunPaths.rank_result``).  Inside a SLURM step or a one-node batch script the ranks are
forked on this node (:func:`_local_env`).
"""

from __future__ import annotations

import atexit
import json
import os
import re
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

from hpcsplit.core.detect import Detection, detect_gpus, rank_gpu_env
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.plan import Plan
from hpcsplit.errors import JobTimedOut, LaunchError
from hpcsplit.launch.keeper import server_lost_ranks, serves_through_faults, survival_env
from hpcsplit.launch.proctree import JobTree
from hpcsplit.launch.stages import STAGES, LocalLauncherSettings

__all__ = ["dead_ranks", "find_mpiexec", "gpu_binding", "mpiexec_command", "mpiexec_flavour", "run_mpi_local"]

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
    mpiexec: str, ranks: int, entry: str, cfg_path: Path, run_dir: Path, extra_args: list[str] | None = None,
    keeper: bool = False,
) -> list[str]:
    """The ``mpiexec -n N python -m mpi4py -m hpcsplit.launch.rank ...`` command line.

    Open MPI gets ``--oversubscribe`` (more ranks than cores) and, as root, ``--allow-run-as-root``.
    ``keeper`` (a server, MPICH): ``-disable-auto-cleanup`` and each rank under ``hpcsplit.launch.keeper``
    (``[Note: rank keeper]``), so that a rank's death does not end the job.
    """
    cmd = [mpiexec]
    if mpiexec_flavour(mpiexec) == "openmpi":
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        cmd.append("--oversubscribe")
    cmd += list(extra_args or [])
    cmd += ["-disable-auto-cleanup"] if keeper else []
    cmd += ["-n", str(ranks), *([sys.executable, "-m", "hpcsplit.launch.keeper"] if keeper else [])]
    cmd += [sys.executable, "-m", "mpi4py", "-m", "hpcsplit.launch.rank", entry]
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


def gpu_binding(cfg: Mapping[str, Any], paths: RunPaths, stage: str, ranks: int, env: dict[str, str],
                echo: Echo = _echo, detection: Detection | None = None) -> list[str]:
    """Bind the ranks of a GPU cluster to this machine's GPUs as SLURM would (``[Note: local GPU binding]``).

    Adds the variables to ``env`` and returns the lines it echoed.  Nothing happens on a CPU cluster,
    inside a SLURM job (SLURM has bound the GPUs), or when NVML finds no GPU (the ranks then say that
    CUDA is missing).
    """
    cluster = cfg.get("cluster")
    if not isinstance(cluster, Mapping) or not int(cluster.get("gpus_per_node") or 0) or "SLURM_JOB_ID" in env:
        return []
    det = detect_gpus(env=env) if detection is None else detection
    if not det.gpus:
        return []
    entries = None
    row = STAGES.get(stage)
    if row is not None and row.ranks == "plan" and (paths.plan_given or paths.plan.exists()):
        entries = Plan.load(paths.plan).ranks
    add, lines = rank_gpu_env(det, ranks, entries)
    env.update(add)
    lines = [f"[hpcsplit] {stage}: {x}" for x in lines]
    for line in lines:
        echo(line)
    return lines


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


class _Stopped(Exception):
    """SIGTERM or SIGINT reached the login-side process while a job ran."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, _frame: Any) -> None:
    raise _Stopped(signum)


def _install_handlers() -> dict[int, Any] | None:
    """SIGTERM and SIGINT raise :class:`_Stopped` (main thread only); the previous handlers, to restore."""
    if threading.current_thread() is not threading.main_thread():
        return None
    old: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            old[sig] = signal.signal(sig, _raise_stopped)
        except (ValueError, OSError):
            pass
    return old


def _quiet_handlers() -> None:
    """Further SIGTERM/SIGINT do nothing while the job is being killed (cleanup must not be cut short)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                signal.signal(sig, lambda _s, _f: None)
            except (ValueError, OSError):
                pass


def _restore_handlers(old: dict[int, Any] | None) -> None:
    for sig, handler in (old or {}).items():
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError, TypeError):
            pass


def _stopped_cleanly(cfg: Mapping[str, Any], proc: subprocess.Popen[str], result: Path) -> bool:
    """A server job (``runtime.mode=server``) that a stop signal drained: mpiexec exited 0 and rank 0 wrote its
    result.  Stopping is how a server ends, so that is no failure (a batch or bench job stopped early is).
    A server that lost ranks while serving exits non-zero (the lost rank's code) with its result written."""
    runtime = cfg.get("runtime")
    return (isinstance(runtime, Mapping) and runtime.get("mode") == "server" and result.is_file()
            and (proc.returncode == 0 or server_lost_ranks(result) is not None))


def _stop(proc: subprocess.Popen[str], tree: JobTree, grace_s: float, echo: Echo | None = None) -> None:
    """SIGTERM to the job (mpiexec forwards it to every rank), ``grace_s`` for it to finish, then SIGKILL
    to every process of the tree (``[Note: job process tree]``).  A second signal skips the grace."""
    if proc.poll() is None:
        if echo is not None:
            echo(f"[hpcsplit] sending SIGTERM to the job; SIGKILL in {grace_s:g} s (launcher.grace_s)")
        try:
            tree.refresh()
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError, OSError):
            pass
        try:
            proc.wait(timeout=grace_s)
        except (subprocess.TimeoutExpired, _Stopped, KeyboardInterrupt):
            pass
    _quiet_handlers()
    tree.kill(signal.SIGKILL)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5
    while tree.alive() and time.monotonic() < deadline:  # SIGKILL is not instant
        time.sleep(0.05)


_MPICH_DEAD = re.compile(r"PID (\d+) RUNNING AT (\S+)")
_MPICH_EXIT = re.compile(r"EXIT CODE: (\d+)")
_MPICH_SIGNAL = re.compile(r"\(signal (\d+)\)")
_OMPI_DEAD = re.compile(r"process rank (\d+) with PID (\d+) on node (\S+) exited on signal (\d+)")


def _how(sig: int | None) -> str:
    if not sig:
        return "ended"
    try:
        return f"was killed by {signal.Signals(sig).name}"
    except ValueError:
        return f"exited with code {sig}"


def dead_ranks(
    lines: list[str], pid_ranks: Mapping[int, int], roles: Mapping[int, str], first: int | None = None
) -> list[str]:
    """Sentences naming the rank whose end stopped the job, from mpiexec's output and the process tree.

    Parameters
    ----------
    lines : list of str
        mpiexec's output.
    pid_ranks : mapping
        PID -> MPI rank (:class:`~hpcsplit.launch.proctree.JobTree`).
    roles : mapping
        MPI rank -> what it runs (from the plan), may be empty.
    first : int, optional
        The PID of the first rank seen ending (:meth:`JobTree.watch`); MPICH kills the others then and
        may report any of them, so this one is named when known.

    Examples
    --------
    >>> out = ["=   PID 77 RUNNING AT vm", "=   EXIT CODE: 9", "EXIT STRING: Killed (signal 9)"]
    >>> dead_ranks(out, {77: 2}, {2: "component enc, node 0"})
    ['rank 2 (component enc, node 0), PID 77 on vm, was killed by SIGKILL']
    >>> dead_ranks(out, {77: 0, 78: 1}, {}, first=78)
    ['rank 1, PID 78, ended first (mpiexec then stopped the other ranks; it reports PID 77, rank 0, killed by SIGKILL)']
    >>> dead_ranks(["mpirun noticed that process rank 1 with PID 5 on node n1 exited on signal 9 (Killed)."], {}, {})
    ['rank 1, PID 5 on n1, was killed by SIGKILL']
    """
    text = "\n".join(lines)

    def who(rank: int | None) -> str:
        if rank is None:
            return "a rank (not known which)"
        return f"rank {rank}" + (f" ({roles[rank]})" if roles.get(rank) else "")

    out = [f"{who(int(m.group(1)))}, PID {m.group(2)} on {m.group(3)}, {_how(int(m.group(4)))}"
           for m in _OMPI_DEAD.finditer(text)]
    if out:
        return out
    codes = [int(c) for c in _MPICH_EXIT.findall(text)]
    sigs = [int(c) for c in _MPICH_SIGNAL.findall(text)]
    reported = [(int(m.group(1)), m.group(2)) for m in _MPICH_DEAD.finditer(text)]
    sig = sigs[0] if sigs else (codes[0] if codes and codes[0] in (6, 9, 11, 15) else None)
    if first is not None and first in pid_ranks and all(pid != first for pid, _ in reported):
        line = f"{who(pid_ranks[first])}, PID {first}, ended first"
        if reported:
            pid = reported[0][0]
            rank = pid_ranks.get(pid)
            what = _how(sig).removeprefix("was ")
            line += (f" (mpiexec then stopped the other ranks; it reports PID {pid}"
                     + ("" if rank is None else f", rank {rank}") + f", {what})")
        return [line]
    return [f"{who(pid_ranks.get(pid))}, PID {pid} on {host}, {_how(sig)}" for pid, host in reported]


def run_mpi_local(
    entry: str,
    cfg: dict[str, Any],
    paths: RunPaths,
    stage: str,
    ranks: int,
    launcher: LocalLauncherSettings,
    echo: Echo = _echo,
    roles: Mapping[int, str] | None = None,
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
        mpiexec, its extra arguments, the time limit and the grace period.
    echo : callable
        Where progress lines go.
    roles : mapping, optional
        MPI rank -> what it runs (``component enc, node 0``), to name a rank that dies.

    Rank output goes to this terminal and is appended to ``RUN_DIR/<stage>.log`` (one header line per
    run, so a resumed run keeps the earlier runs' lines).  SIGTERM or SIGINT to this process, the time
    limit, or any exception here sends SIGTERM to the job, waits ``launcher.grace_s`` and then kills
    every process of the job (``[Note: job process tree]``): no rank outlives this process.

    Raises
    ------
    LaunchError
        When mpiexec exits non-zero (naming a rank killed by a signal, its component, with the ranks'
        error lines and the tail of stderr), runs past ``launcher.timeout_min``, is stopped by a
        signal, or rank 0 wrote no result.
    """
    mpiexec = find_mpiexec(launcher.mpiexec)
    paths.run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = paths.stage_config(stage)
    cfg_path.write_text(json.dumps(cfg, indent=2, default=str))
    result = paths.rank_result(entry)
    result.unlink(missing_ok=True)
    keeper = serves_through_faults(cfg, stage) and mpiexec_flavour(mpiexec) == "mpich"  # [Note: rank keeper]
    cmd = mpiexec_command(mpiexec, ranks, entry, cfg_path, paths.run_dir, list(launcher.mpiexec_args), keeper)
    timeout_min = launcher.timeout_min
    timeout_s = None if timeout_min is None else float(timeout_min) * 60
    log_path = paths.stage_log(stage)
    echo(f"[hpcsplit] {stage}: {ranks} MPI rank(s): {' '.join(cmd[:3])} ... {entry}; log {log_path}")
    env = _local_env(mpiexec, echo)
    if keeper:
        env = {**survival_env(cfg), **env}  # the user's own values of MPICH's variables win
    gpu_binding(cfg, paths, stage, ranks, env, echo)
    t0 = time.monotonic()
    tail: deque[str] = deque(maxlen=60)
    roles = dict(roles or {})
    with open(log_path, "a") as log:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        log.write(f"===== hpcsplit {stage} started {stamp}: {ranks} rank(s), login pid {os.getpid()} =====\n")
        log.flush()
        old = _install_handlers()
        proc: subprocess.Popen[str] | None = None
        tree: JobTree | None = None
        done = threading.Event()
        threads: list[threading.Thread] = []
        try:
            try:
                proc = subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
                )
            except OSError as e:
                raise LaunchError(f"{stage}: could not start {mpiexec} ({e}); check launcher.mpiexec") from None
            tree = JobTree(proc.pid, lambda: proc is not None and proc.poll() is None)
            atexit.register(tree.kill)
            assert proc.stdout is not None and proc.stderr is not None
            threads = [
                threading.Thread(target=_pump, args=(proc.stdout, [sys.stdout, log], tail), daemon=True),
                threading.Thread(target=_pump, args=(proc.stderr, [sys.stderr, log], tail), daemon=True),
                threading.Thread(target=tree.watch, args=(ranks, lambda: proc.poll() is None, done), daemon=True),
            ]
            for t in threads:
                t.start()
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _stop(proc, tree, launcher.grace_s, echo)
                _join(threads[:2])
                raise JobTimedOut(
                    f"{stage}: {ranks} MPI rank(s) ran past launcher.timeout_min={timeout_min} and were killed. "
                    f"Raise launcher.timeout_min if the stage is just slow. Log: {log_path}\n"
                    + "\n".join(list(tail)[-20:])
                ) from None
            except (_Stopped, KeyboardInterrupt) as e:
                signum = e.signum if isinstance(e, _Stopped) else int(signal.SIGINT)
                name = signal.Signals(signum).name
                echo(f"[hpcsplit] {name} received: stopping the {stage} job")
                _stop(proc, tree, launcher.grace_s, echo)
                _join(threads[:2])
                if _stopped_cleanly(cfg, proc, result):
                    # a server's normal end: it drained what was in flight and every rank exited 0
                    echo(f"[hpcsplit] {name}: the server drained and stopped cleanly after "
                         f"{time.monotonic() - t0:.1f} s; log: {log_path}")
                    return json.loads(result.read_text())
                raise LaunchError(
                    f"{stage}: stopped by {name} after {time.monotonic() - t0:.1f} s: the job got SIGTERM and "
                    f"{launcher.grace_s:g} s (launcher.grace_s) to save what it had, then every process left was "
                    f"killed. Whatever it saved is in {paths.run_dir}; log: {log_path}"
                ) from None
            _join(threads[:2])
        finally:
            done.set()
            try:
                if proc is not None:
                    if tree is None:  # a signal right after the start
                        tree = JobTree(proc.pid, lambda: proc is not None and proc.poll() is None)
                    if threads:
                        threads[2].join(timeout=2)  # the watcher: no refresh of the tree beside ours
                    if proc.poll() is None or tree.alive():  # an exception here, or ranks left behind
                        _stop(proc, tree, 0 if proc.poll() is not None else launcher.grace_s)
            finally:
                if tree is not None:
                    atexit.unregister(tree.kill)
                _restore_handlers(old)
    elapsed = time.monotonic() - t0
    lost = server_lost_ranks(result) if rc != 0 and serves_through_faults(cfg, stage) else None
    if lost is not None:  # a server that went on without some ranks, then ended (stopped, or to start again)
        for line in dead_ranks(list(tail), tree.ranks if tree else {}, roles, tree.first_ended() if tree else None):
            echo(f"[hpcsplit] {stage}: {line}")
        echo(f"[hpcsplit] {stage}: the server served on without {len(lost['lost_ranks'])} lost rank(s), then ended "
             f"after {elapsed:.1f} s (mpiexec exit code {rc}: a lost rank's); log: {log_path}")
        return json.loads(result.read_text())
    if rc != 0:
        lines = [x for x in tail if x.strip() and not set(x.strip()) <= {"="}]
        rank_lines = [x for x in lines if x.startswith("[rank ")]
        shown = rank_lines[:10] + ["--- tail of the output:"] + lines[-12:] if rank_lines else lines[-25:]
        dead = dead_ranks(list(tail), tree.ranks if tree else {}, roles, tree.first_ended() if tree else None)
        head = "".join(f"\n{d}." for d in dead)
        raise LaunchError(
            f"{stage}: `mpiexec -n {ranks} ... {entry}` exited with code {rc}{_signal_name(rc)} "
            f"after {elapsed:.1f} s.{head}\n" + "\n".join(shown) + f"\nFull log: {log_path}"
        )
    if not result.exists():
        raise LaunchError(
            f"{stage}: the MPI ranks exited cleanly but rank 0 wrote no result ({result}); see {log_path}"
        )
    try:
        return json.loads(result.read_text())
    except (OSError, ValueError) as e:
        raise LaunchError(f"{stage}: rank 0's result {result} is unreadable ({e}); see {log_path}") from None


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=10)


def _signal_name(rc: int) -> str:
    """`` (a rank was killed by SIGKILL)`` for MPICH's 9 / a shell's 137, else empty."""
    sig = rc - 128 if rc > 128 else (-rc if rc < 0 else rc if rc in (6, 9, 11, 15) else 0)
    try:
        return f" (a rank was killed by {signal.Signals(sig).name})" if sig else ""
    except ValueError:
        return ""
