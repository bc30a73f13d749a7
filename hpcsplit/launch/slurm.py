"""SLURM side of the launch layer: submitit parameters, the job function, waiting with progress.

Only :mod:`hpcsplit.launch.app` and :mod:`hpcsplit.launch.serve_watch` import this module; submitit is
imported inside functions so that a login node without SLURM never needs it.  The job shape and ``#SBATCH`` options come from the
cluster's ``slurm:`` block (:class:`~hpcsplit.core.cluster.SlurmSpec`), the waiting from
:class:`~hpcsplit.launch.stages.SlurmLauncherSettings`; :func:`run_mpi_slurm` builds both from the config.

[Note: SLURM job shape]
One MPI stage is one SLURM job of ``nodes x tasks_per_node`` tasks (``cluster.slurm``), or exactly
``ranks`` tasks when the stage fixes its rank count (a plan's world size, ``profile.ranks``,
``launcher.ranks``): then ``nodes = min(nodes, ranks)`` and ``tasks_per_node = ceil(ranks / nodes)``,
with ``--ntasks=ranks`` when that does not divide evenly.  A plan whose nodes hold different numbers of
ranks (3 + 2) allocates its most ranks of one node on every node and places the ranks with a
``SLURM_HOSTFILE`` and ``srun --ntasks=<world size> --distribution=arbitrary`` (:func:`hostfile_setup`,
as ``stage=sbatch`` does), so rank r runs on the plan's node for r.  Stages that are not requeueable
are submitted ``--no-requeue``: a node failure (``NODE_FAIL``) ends the job instead of putting it back in
the queue, where it would wait for the lost node.  submitit writes the sbatch script; its
srun line gets ``--mpi=<srun_mpi> --kill-on-bad-exit=1`` (the setup lines also export
``SLURM_MPI_TYPE``), so the tasks form one MPI world and one dead task ends the step instead of
leaving the others blocked in a collective; a server's gets ``--kill-on-bad-exit=0`` instead
(``[Note: serving through faults]`` in :mod:`hpcsplit.runtime.server.failover`).  Each task runs :func:`job_main`, which is
``hpcsplit.launch.rank.run_rank`` (reached by name: that module imports mpi4py, which the login
side must not): it checks the world size against ``SLURM_NTASKS`` and aborts the whole
job on any exception.  Rank 0 writes its return value as JSON (``RunPaths.rank_result``); the
login side reads that file, never submitit's result pickle.

[Note: waiting without hanging]
submitit's ``job.result()`` polls ``sacct`` at growing intervals and can wait forever on a job that
died without a result when accounting is broken.  :func:`wait_for_job` polls on its own:
``squeue`` for live jobs, then ``sacct``, then ``scontrol show job`` for finished ones, each with a
subprocess timeout.  A job that left the queue without a result is reported at once with its state,
exit code, the ``[rank N]`` error lines, the nodes that are down or not responding with the ranks the job
had there (:func:`node_report`), and the tail of its logs.  A job that neither squeue,
sacct nor scontrol knows for ``_VANISHED_S`` seconds is reported as lost.

[Note: preemption]
A ``requeueable`` stage of the stage table (profile) is submitted as ``launch.slurm.ProfileJob()``
(it has a submitit ``checkpoint``) with
``max_num_timeout = launcher.max_requeue`` (3).  submitit's sbatch script carries
``--signal=USR2@90``; on that warning, on a preemption (USR2 from ``scancel --signal=USR2``) or on
``scontrol requeue`` (SIGTERM), every rank finishes its current cell and flushes it to its HDF5
part file, rank 0 merges, and submitit (task 0) requeues the same call; the requeued job resumes
the profile and measures only the missing cells.  While a job is ``REQUEUED`` / ``PENDING`` again
the login side keeps waiting; it reads rank 0's result only once the job has ``COMPLETED``.
``stage=serve runtime.mode=batch`` is requeueable the same way (:func:`requeueable`): on USR2 rank 0
stops admitting rows, flushes the outputs file and calls submitit's handler, and the requeued job
serves only the rows not done (``docs/batch-inference.md``).
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcsplit.core.cluster import ClusterSpec, SlurmSpec
from hpcsplit.core.paths import MPI_INIT_DIR_VAR, RunPaths
from hpcsplit.core.plan import Plan
from hpcsplit.errors import ConfigError, JobTimedOut, LaunchError
from hpcsplit.launch.keeper import server_lost_ranks, serves_through_faults, survival_env
from hpcsplit.launch.stages import STAGES, SlurmLauncherSettings, cluster_spec, launcher_settings, resolve

__all__ = [
    "RANK_ENTRY",
    "JobGeometry",
    "JobStatus",
    "ProfileJob",
    "executor_parameters",
    "geometry",
    "hostfile_setup",
    "job_main",
    "job_status",
    "requeueable",
    "run_mpi_slurm",
    "sbatch_text",
    "site_options",
    "startup_failed",
    "submit",
    "wait_for_job",
]

_ACTIVE = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "REQUEUED",
        "REQUEUE_HOLD",
        "REQUEUE_FED",
        "RESIZING",
        "SUSPENDED",
        "STAGE_OUT",
        "SIGNALING",
        "STOPPED",
        "RESV_DEL_HOLD",
        "PREEMPTED",
    }
)
_VANISHED_S = 60.0
_RESULT_GRACE_S = 10.0
_CMD_TIMEOUT_S = 20.0
RANK_ENTRY = "hpcsplit.launch.rank:run_rank"  # what each task runs; imports mpi4py, so only by name


@dataclass(frozen=True, slots=True)
class JobGeometry:
    """Nodes and tasks of one SLURM job (see ``[Note: SLURM job shape]``)."""

    nodes: int
    tasks_per_node: int
    ntasks: int

    @property
    def even(self) -> bool:
        return self.nodes * self.tasks_per_node == self.ntasks


@dataclass(frozen=True, slots=True)
class JobStatus:
    """A job's state as the scheduler reports it; ``source`` names the command that answered."""

    state: str
    exit_code: str | None = None
    elapsed: str | None = None
    source: str = "none"
    reason: str | None = None

    @property
    def active(self) -> bool:
        return self.state in _ACTIVE or self.state == "UNKNOWN"


def _slurm_of(cluster: ClusterSpec) -> SlurmSpec:
    if cluster.slurm is None:
        raise ConfigError(
            f"launcher=slurm needs a cluster with a `slurm:` block; cluster={cluster.name!r} has none. "
            "Use cluster=dev or cluster=perlmutter, or add a slurm block to your conf/cluster/<site>.yaml."
        )
    return cluster.slurm


def geometry(
    cluster: ClusterSpec,
    ranks: int | None = None,
    nodes: int | None = None,
    tasks_per_node: int | None = None,
) -> JobGeometry:
    """The job shape for ``ranks`` MPI ranks (None: the cluster's nodes x tasks_per_node).

    ``nodes`` / ``tasks_per_node`` come from a plan (its node count, the most ranks on one node);
    SLURM's block distribution then puts consecutive ranks on the same node, as plans number them.

    Examples
    --------
    >>> c = ClusterSpec.from_config({"nodes": 2, "cores_per_node": 4, "mem_gb_per_node": 8,
    ...     "cpu_threads": [1], "slurm": {"tasks_per_node": 4}})
    >>> geometry(c), geometry(c, 3), geometry(c, 1)
    (JobGeometry(nodes=2, tasks_per_node=4, ntasks=8), JobGeometry(nodes=2, tasks_per_node=2, ntasks=3), \
JobGeometry(nodes=1, tasks_per_node=1, ntasks=1))
    """
    slurm = _slurm_of(cluster)
    if nodes is None:
        nodes = int(slurm.extra.get("nodes") or cluster.nodes)
    if ranks is None:
        tpn = int(tasks_per_node or slurm.tasks_per_node or 1)
        return JobGeometry(nodes, tpn, nodes * tpn)
    nodes = max(1, min(nodes, ranks))
    tpn = max(tasks_per_node or 0, math.ceil(ranks / nodes))
    return JobGeometry(nodes, tpn, ranks)


def site_options(slurm: SlurmSpec) -> dict[str, str]:
    """The site's own job options of a ``slurm:`` block that are set: partition, account, qos, constraint."""
    return {key: str(value) for key in ("partition", "account", "qos", "constraint")
            if (value := getattr(slurm, key))}


def hostfile_setup(counts: list[int], hostfile: str) -> list[str]:
    """Bash lines (in the job, before ``srun``) writing ``SLURM_HOSTFILE``: ``counts[i]`` lines naming the i-th
    node of the allocation, in rank order, for ``srun --distribution=arbitrary``.

    ``hostfile`` may use shell variables of the job (``$SLURM_JOB_ID``).

    Examples
    --------
    >>> hostfile_setup([3, 2], "/r/hostfile.$SLURM_JOB_ID")[0]
    'COUNTS=(3 2)'
    """
    return [
        f"COUNTS=({' '.join(str(int(c)) for c in counts)})",
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f'export SLURM_HOSTFILE="{hostfile}"',
        ('for i in "${!COUNTS[@]}"; do for ((k = 0; k < COUNTS[i]; k++)); do echo "${HOSTS[i]}"; done; done'
         ' >"$SLURM_HOSTFILE"'),
        "unset SLURM_NTASKS_PER_NODE  # the step's placement is the hostfile's",
    ]


def executor_parameters(
    cluster: ClusterSpec,
    stage: str,
    ranks: int | None = None,
    shape: tuple[int, int] | None = None,
    counts: list[int] | None = None,
    hostfile: str = "hostfile.$SLURM_JOB_ID",
    requeue: bool | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``submitit.SlurmExecutor.update_parameters`` for one stage's job.

    ``shape`` is a plan's ``(nodes, most ranks on one node)``, see :func:`geometry`; ``counts`` its ranks
    per node: when they differ, the job places its ranks with ``hostfile`` (see ``[Note: SLURM job shape]``).
    ``requeue``: whether SLURM may requeue the job (None: the stage table's ``requeueable``).
    """
    slurm = _slurm_of(cluster)
    geo = geometry(cluster, ranks, *(shape or (None, None)))
    uneven = counts is not None and len(set(counts)) > 1 and ranks == sum(counts) and geo.nodes == len(counts)
    params: dict[str, Any] = {
        "job_name": f"hpcsplit-{stage}",
        "time": int(slurm.time_min or 30),
        "nodes": geo.nodes,
        "ntasks_per_node": geo.tasks_per_node,
        "cpus_per_task": int(slurm.cpus_per_task or 1),
        "wckey": None,
        "setup": list(slurm.setup),
    }
    params.update(site_options(slurm))
    if slurm.gpus_per_node:
        params["gpus_per_node"] = int(slurm.gpus_per_node)
    if slurm.mem_gb:
        params["mem"] = f"{int(slurm.mem_gb)}GB"
    srun_args = ["--kill-on-bad-exit=1"]
    mpi = slurm.srun_mpi
    if mpi:
        srun_args.insert(0, f"--mpi={mpi}")
        if not any("SLURM_MPI_TYPE" in s for s in params["setup"]):
            params["setup"].append(f"export SLURM_MPI_TYPE={mpi}")
    if uneven:
        assert counts is not None
        params["ntasks_per_node"] = max(counts)  # room on every node for the plan's ranks there
        params["setup"] += hostfile_setup(counts, hostfile)
        srun_args += [f"--ntasks={geo.ntasks}", "--distribution=arbitrary"]
    params["srun_args"] = srun_args
    extra = dict(slurm.extra.get("sbatch_args") or {})
    if not geo.even and not uneven:
        extra["ntasks"] = geo.ntasks
    if not (requeueable(stage, {}) if requeue is None else requeue):
        extra.setdefault("no_requeue", True)  # a NODE_FAIL ends the job (it would wait for the lost node)
    if extra:
        params["additional_parameters"] = extra
    return params


def _submit_command(folder: str | Path, python: str | None = None) -> str:
    py = shlex.quote(sys.executable) if python is None else python
    return f"{py} -u -m submitit.core._submit {shlex.quote(str(folder))}"


def sbatch_text(
    cluster: ClusterSpec, stage: str, ranks: int | None, folder: str | Path, python: str | None = None
) -> str:
    """The sbatch script submitit would submit for ``stage`` (used by the golden test and ``--dry``)."""
    from submitit.slurm import slurm as submitit_slurm

    params = executor_parameters(cluster, stage, ranks)
    return submitit_slurm._make_sbatch_string(
        command=_submit_command(folder, python), folder=folder, **params
    )


def job_main(entry: str, cfg: dict[str, Any], run_dir: str) -> Any:
    """What every SLURM task runs (submitit calls it inside ``srun``): :data:`RANK_ENTRY`.

    Any exception prints ``[rank N] ...`` and aborts every rank (``comm.Abort(1)``); the world size
    is checked against ``SLURM_NTASKS`` first.
    """
    resolve(RANK_ENTRY)(entry, cfg, run_dir)
    return None  # rank 0's value is in the result JSON; nothing to pickle


def _run(cmd: list[str]) -> str | None:
    """stdout of ``cmd``, or None when it fails, times out or does not exist."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def job_status(job_id: str) -> JobStatus:
    """Ask squeue, then sacct, then scontrol about ``job_id`` (see ``[Note: waiting without hanging]``)."""
    out = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%M|%r"])
    if out and out.strip():
        state, elapsed, reason = (out.strip().splitlines()[0].split("|") + ["", ""])[:3]
        why = reason.strip() if reason.strip() not in ("", "None") else None
        return JobStatus(state.strip(), None, elapsed.strip() or None, "squeue", why)
    out = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,Elapsed"])
    if out and out.strip():
        # the last line is the newest job with this id (ids restart when a cluster's state is wiped)
        fields = out.strip().splitlines()[-1].split("|") + ["", ""]
        return JobStatus(
            fields[0].split()[0] if fields[0] else "UNKNOWN", fields[1] or None, fields[2] or None, "sacct"
        )
    out = _run(["scontrol", "show", "job", "-o", job_id])
    if out and "JobState=" in out:
        kv = dict(tok.partition("=")[::2] for tok in out.split() if "=" in tok)
        return JobStatus(kv.get("JobState", "UNKNOWN"), kv.get("ExitCode"), kv.get("RunTime"), "scontrol")
    return JobStatus("UNKNOWN")


def _tail(path: Path, n: int = 25) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def _expand_nodes(nodelist: str) -> list[str]:
    out = _run(["scontrol", "show", "hostnames", nodelist]) if nodelist and nodelist != "None assigned" else None
    return out.split() if out else []


def node_report(job_id: str, counts: tuple[int, ...] = ()) -> list[str]:
    """Lines naming each node of job ``job_id`` that SLURM has down, failing or not responding, with the ranks
    the job had there (``counts``: ranks per node of the allocation, in order; rank numbering is node by node).

    Empty when every node is fine or nothing answers.
    """
    out = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "NodeList"])
    nodes = _expand_nodes(out.strip().splitlines()[-1]) if out and out.strip() else []
    if not nodes:
        return []
    lines = []
    first = 0
    for i, node in enumerate(nodes):
        n_here = counts[i] if i < len(counts) else 0
        ranks = list(range(first, first + n_here))
        first += n_here
        info = _run(["scontrol", "show", "node", "-o", node]) or ""
        kv = dict(tok.partition("=")[::2] for tok in info.split() if "=" in tok)
        state = kv.get("State", "")
        if not any(w in state for w in ("DOWN", "FAIL", "NOT_RESPONDING", "DRAIN")) and "*" not in state:
            continue
        where = (f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}") if ranks else "its ranks"
        reason = f" ({kv['Reason']})" if kv.get("Reason") and kv["Reason"] != "(null)" else ""
        lines.append(f"node {node} (node {i} of the job, {where}) is {state}{reason}")
    return lines


def failure_report(job_id: str, folder: Path, status: JobStatus, stage: str, counts: tuple[int, ...] = ()) -> str:
    """A failed job's state, rank error lines, failed nodes (:func:`node_report`) and log tails, as one message."""
    logs = sorted(folder.glob(f"{job_id}_*_log.err")) + sorted(folder.glob(f"{job_id}_*_log.out"))
    rank_lines: list[str] = []
    srun_lines: list[str] = []
    for log in logs:
        for line in _tail(log, 400):
            if line.startswith("[rank ") and line not in rank_lines:
                rank_lines.append(line)
            elif line.startswith(("srun: error", "slurmstepd: error")) and line not in srun_lines:
                srun_lines.append(line)
    err0 = folder / f"{job_id}_0_log.err"
    head = f"SLURM job {job_id} (stage={stage}) ended {status.state} (exit code {status.exit_code or '?'})"
    parts = [f"{head} without a result."]
    errors = [x for x in rank_lines if any(w in x for w in ("Error", "Exception", "abort", "Killed", "signal"))]
    rank_lines = errors or rank_lines[-5:]  # the errors, else the last progress lines
    if rank_lines:
        parts += ["Rank errors:" if errors else "Last rank lines:", *(f"  {x}" for x in rank_lines[:20])]
    if srun_lines:
        parts += ["srun:", *(f"  {x}" for x in srun_lines[:10])]
    bad_nodes = node_report(job_id, counts)
    if bad_nodes:
        parts += ["Nodes:", *(f"  {x}" for x in bad_nodes)]
    if not rank_lines:  # rank 0 died before it printed (MPI_Init, an import): its own last lines say why
        parts += [f"Tail of {err0}:", *(f"  {x}" for x in _tail(err0))]
    parts.append(f"Logs: {folder}/{job_id}_<task>_log.{{out,err}}")
    if status.state in ("TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED"):
        parts.append("Raise cluster.slurm.time_min / mem_gb, or resubmit (a preempted job can be requeued).")
    return "\n".join(parts)


@dataclass(frozen=True, slots=True)
class SubmittedJob:
    """A submitted stage: id, log folder and where rank 0's result will appear."""

    job_id: str
    folder: Path
    result: Path
    stage: str
    ntasks: int
    time_min: int
    counts: tuple[int, ...] = ()  # ranks per node of the allocation, in order (naming a failed node's ranks)


def requeueable(stage: str, cfg: dict[str, Any]) -> bool:
    """A stage whose job may be requeued and resume: the profile, and batch inference (``runtime.mode=batch``
    of ``stage=serve``, whose outputs file records the rows done)."""
    row = STAGES.get(stage)
    if row is not None and row.requeueable:
        return True
    rt = cfg.get("runtime") if isinstance(cfg, dict) else None
    return stage == "serve" and isinstance(rt, dict) and rt.get("mode") in ("batch", None)


def _job_function(stage: str, cfg: dict[str, Any], launcher: SlurmLauncherSettings) -> tuple[Callable[..., Any], int]:
    """The submitted function and how often a timed-out job may requeue itself.

    See ``[Note: preemption]``: a :func:`requeueable` stage is checkpointable (``launch.slurm.ProfileJob``);
    other stages run :func:`job_main` and are not requeued on time-out.
    """
    if requeueable(stage, cfg):
        return ProfileJob(), launcher.max_requeue
    return job_main, 0


def submit(
    entry: str,
    cfg: dict[str, Any],
    paths: RunPaths,
    stage: str,
    cluster: ClusterSpec,
    launcher: SlurmLauncherSettings,
    ranks: int | None = None,
    shape: tuple[int, int] | None = None,
    counts: list[int] | None = None,
) -> SubmittedJob:
    """Submit ``entry`` as one SLURM job through submitit (does not wait).

    ``cfg`` (the resolved config) is what the ranks read; ``cluster.slurm`` shapes the job and
    ``launcher.max_requeue`` bounds a requeueable stage's requeues; ``counts`` are a plan's ranks per node.
    """
    try:
        import submitit
    except ImportError as e:  # pragma: no cover - a dependency
        raise LaunchError("launcher=slurm needs submitit: pip install submitit") from e
    if shutil.which("sbatch") is None:
        raise LaunchError(
            "launcher=slurm but there is no `sbatch` on PATH: run on a SLURM login node, or use "
            "launcher=local (or start a dev cluster with slurm/dev-cluster.sh up)."
        )
    folder = paths.slurm_dir
    params = executor_parameters(cluster, stage, ranks, shape, counts, str(folder / "hostfile.$SLURM_JOB_ID"),
                                 requeue=requeueable(stage, cfg))
    params["setup"].append(f"export {MPI_INIT_DIR_VAR}={shlex.quote(str(folder))}/init.$SLURM_JOB_ID")
    if serves_through_faults(cfg, stage):  # a dead task must not end the step ([Note: serving through faults])
        params["srun_args"] = ["--kill-on-bad-exit=0" if a == "--kill-on-bad-exit=1" else a for a in params["srun_args"]]
        params["setup"] += [f"export {k}=${{{k}:-{v}}}" for k, v in survival_env(cfg).items()]
    folder.mkdir(parents=True, exist_ok=True)
    paths.stage_config(stage).write_text(json.dumps(cfg, indent=2, default=str))
    result = paths.rank_result(entry)
    result.unlink(missing_ok=True)
    fn, requeues = _job_function(stage, cfg, launcher)
    ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=requeues)
    try:
        ex.update_parameters(**params)
    except ValueError as e:
        raise ConfigError(f"submitit rejected the SLURM parameters {sorted(params)}: {e}") from e
    try:
        job = ex.submit(fn, entry, cfg, str(paths.run_dir))
    except Exception as e:
        raise LaunchError(
            f"sbatch refused the {stage} job ({', '.join(f'{k}={v}' for k, v in params.items() if k != 'setup')}):"
            f"\n{e}\nCheck partition/account/qos in cluster.slurm (sinfo, sacctmgr show assoc user=$USER)."
        ) from e
    geo = geometry(cluster, ranks, *(shape or (None, None)))
    if counts is None or sum(counts) != geo.ntasks:  # block distribution: full nodes first
        counts = [min(geo.tasks_per_node, geo.ntasks - i * geo.tasks_per_node) for i in range(geo.nodes)]
    return SubmittedJob(str(job.job_id), folder, result, stage, geo.ntasks, int(params["time"]), tuple(counts))


def wait_for_job(
    job: SubmittedJob,
    timeout_s: float | None = None,
    poll_s: float = 2.0,
    poll_max_s: float = 30.0,
    progress_s: float = 30.0,
    echo: Callable[[str], None] = print,
    status_fn: Callable[[str], JobStatus] = job_status,
    drain_s: float | None = None,
) -> Any:
    """Wait for ``job`` with progress lines; return rank 0's result or raise :class:`LaunchError`.

    Ctrl-C (or any exception) while waiting cancels the job and re-raises, except for a server job
    (``drain_s`` given): Ctrl-C is how a server ends, so its ranks get SIGTERM (``scancel --signal=TERM``,
    which leaves the job to finish), it drains, and if it ends within ``drain_s`` its result is returned
    as for any job that finished; otherwise it is cancelled and the interrupt re-raised.

    Parameters
    ----------
    job : SubmittedJob
    timeout_s : float, optional
        Limit on the whole wait; None: the job's time limit plus 5 minutes once it runs (a pending
        job waits as long as the queue takes, printing progress).
    poll_s, poll_max_s : float
        First and largest interval between scheduler polls (the interval grows on long jobs).
    progress_s : float
        A progress line at least this often, and at every state change.
    echo : callable
        Where progress lines go.
    status_fn : callable
        ``job_id -> JobStatus`` (tests replace it).
    """
    t0 = time.monotonic()
    run_t0: float | None = None
    last_state, last_echo, unknown_since = "", 0.0, None
    interval = poll_s
    status = JobStatus("UNKNOWN")
    try:
        while True:
            now = time.monotonic()
            status = status_fn(job.job_id)
            if status.state == "RUNNING" and run_t0 is None:
                run_t0 = now
            if status.state == "PENDING" and run_t0 is not None:
                # it ran and is pending again: requeued.  After a preemption (or its own script's requeue) its
                # nodes are fine and it runs again; after a node failure it would wait for that node: end it
                lost = node_report(job.job_id, job.counts)
                if lost:
                    _scancel(job.job_id)
                    raise LaunchError(
                        f"SLURM job {job.job_id} ({job.stage}) lost a node and SLURM requeued it (NODE_FAIL): "
                        + "; ".join(lost) + f". Cancelled it instead of waiting for the node. What was finished is "
                        f"kept in the run folder; run the same command again to go on from there. Logs: {job.folder}")
            shown = status.state + (
                f" ({status.reason})" if status.reason and status.state == "PENDING" else ""
            )
            if shown != last_state or now - last_echo >= progress_s:
                echo(f"[hpcsplit] job {job.job_id} {job.stage}: {shown:<11} elapsed {_fmt(now - t0)}"
                     + _batch_progress(job.result.parent))
                last_state, last_echo = shown, now
            if not status.active:
                break
            if status.state == "UNKNOWN" and status.source == "none":
                unknown_since = now if unknown_since is None else unknown_since
                if now - unknown_since > _VANISHED_S:
                    break
            else:
                unknown_since = None
            limit = timeout_s
            if limit is None and run_t0 is not None:
                limit = (run_t0 - t0) + job.time_min * 60 + 300
            if limit is not None and now - t0 > limit:
                _scancel(job.job_id)
                raise JobTimedOut(
                    f"gave up waiting for SLURM job {job.job_id} ({job.stage}) after {_fmt(now - t0)} "
                    f"(state {status.state}); cancelled it. Raise launcher.timeout_min or cluster.slurm.time_min. "
                    f"Logs: {job.folder}"
                )
            time.sleep(interval)
            interval = min(poll_max_s, max(poll_s, (time.monotonic() - t0) / 10))
    except LaunchError:
        raise
    except KeyboardInterrupt:
        ended = _drain_server(job, drain_s, echo, status_fn) if drain_s is not None else None
        if ended is None:
            _scancel(job.job_id)
            echo(f"[hpcsplit] interrupted: cancelled job {job.job_id}")
            raise
        status = ended
        if status.state == "COMPLETED":
            echo(f"[hpcsplit] job {job.job_id}: the server drained and stopped cleanly")
    except BaseException:  # a test timeout, a failing poll: never leave the job behind
        _scancel(job.job_id)
        echo(f"[hpcsplit] interrupted: cancelled job {job.job_id}")
        raise
    deadline = time.monotonic() + _RESULT_GRACE_S
    while status.state == "COMPLETED" and not job.result.exists() and time.monotonic() < deadline:
        time.sleep(0.5)  # shared filesystems may show the file late
    faults = server_lost_ranks(job.result) if drain_s is not None and job.result.exists() else None
    if faults is not None:  # a server that served on without some tasks, then ended (stopped, or to start again)
        echo(f"[hpcsplit] job {job.job_id} {job.stage}: {status.state}: the server served on without "
             f"{len(faults['lost_ranks'])} lost rank(s), then ended; logs in {job.folder}")
        return json.loads(job.result.read_text())
    if status.state in ("COMPLETED", "UNKNOWN") and job.result.exists():
        echo(
            f"[hpcsplit] job {job.job_id} {job.stage}: COMPLETED in {_fmt(time.monotonic() - t0)}; "
            f"logs in {job.folder}"
        )
        return json.loads(job.result.read_text())
    if status.state == "UNKNOWN":
        status = JobStatus("LOST (no scheduler knows it)", None, None, "none")
    raise LaunchError(failure_report(job.job_id, job.folder, status, job.stage, job.counts))


def _scancel(job_id: str) -> None:
    _run(["scancel", job_id])


def _drain_server(job: SubmittedJob, drain_s: float, echo: Callable[[str], None],
                  status_fn: Callable[[str], JobStatus]) -> JobStatus | None:
    """Ctrl-C on a server job: SIGTERM to its steps and wait up to ``drain_s`` for the job to end.

    The job's final status, or None when it did not end in time (or a second Ctrl-C came).
    """
    echo(f"[hpcsplit] Ctrl-C: stopping the server job {job.job_id} (it drains; at most {drain_s:g} s, "
         "Ctrl-C again to cancel it at once)")
    try:
        _run(["scancel", "--signal=TERM", job.job_id])
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline:
            status = status_fn(job.job_id)
            if not status.active:
                return status
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    return None


def _batch_progress(run_dir: Path) -> str:
    """``; batch progress: ...`` from the batch job's ``batch-progress.txt`` (docs/batch-inference.md), or ""."""
    try:
        line = (run_dir / "batch-progress.txt").read_text().strip()
    except OSError:
        return ""
    return f"; {line}" if line else ""


def _fmt(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"


def run_mpi_slurm(
    entry: str,
    cfg: dict[str, Any],
    run_dir: Path,
    stage: str,
    ranks: int | None = None,
    echo: Callable[[str], None] = print,
    shape: tuple[int, int] | None = None,
) -> Any:
    """Submit ``entry`` as one SLURM job, wait with progress and return rank 0's result.

    The launch settings come from ``cfg`` (``launcher``, ``cluster``, ``paths``); ``shape`` is a
    plan's ``(nodes, most ranks on one node)``.

    Raises
    ------
    ConfigError
        When the launcher is not ``slurm`` or the cluster has no ``slurm:`` block.
    LaunchError
        When the job cannot be submitted, fails or is lost.
    """
    launcher = launcher_settings(cfg)
    if not isinstance(launcher, SlurmLauncherSettings):
        raise ConfigError(f"run_mpi_slurm needs launcher=slurm, found launcher={launcher.name}")
    paths = RunPaths.from_config(cfg, run_dir)
    counts = _plan_counts(paths, shape, ranks)
    for attempt in range(1 + STARTUP_RETRIES):
        job = submit(entry, cfg, paths, stage, cluster_spec(cfg), launcher, ranks, shape, counts)
        echo(
            f"[hpcsplit] submitted {stage} as SLURM job {job.job_id} ({job.ntasks} task(s)); "
            f"logs: {job.folder}/{job.job_id}_<task>_log.{{out,err}}"
        )
        try:
            return wait_for_job(
                job,
                timeout_s=None if launcher.timeout_min is None else launcher.timeout_min * 60,
                poll_s=launcher.poll_s,
                poll_max_s=launcher.poll_max_s,
                progress_s=launcher.progress_s,
                echo=echo,
                drain_s=_server_drain_s(stage, cfg),
            )
        except LaunchError:
            stuck = startup_failed(job)
            if not stuck or attempt == STARTUP_RETRIES:
                raise
            echo(f"[hpcsplit] job {job.job_id}: the ranks never formed an MPI world ({stuck}); nothing ran, "
                 "submitting the job once more")
    raise AssertionError("unreachable")  # pragma: no cover


def _server_drain_s(stage: str, cfg: dict[str, Any]) -> float | None:
    """How long a server job (``stage=serve runtime.mode=server``) may take to drain after Ctrl-C; None otherwise."""
    rt = cfg.get("runtime")
    if stage != "serve" or not isinstance(rt, dict) or rt.get("mode") != "server":
        return None
    drain = rt.get("server_drain_s", 10.0)
    return (float(drain) if isinstance(drain, int | float) else 10.0) + 60.0  # + the steps' exit and accounting


STARTUP_RETRIES = 1  # a job whose MPI_Init failed or hung (nothing ran) is submitted again this often


def startup_failed(job: SubmittedJob) -> str:
    """What went wrong when ``job``'s ranks did not all get through MPI_Init ("" when they did).

    Each rank records ``started`` / ``ready`` / ``timeout`` (:func:`hpcsplit.core.mpi.init_with_deadline`)
    in ``<slurm folder>/init.<job id>/``: a rank that started MPI_Init and never finished it means the
    job died in its startup (an MPI_Init that hung past its deadline, or aborted), before any work.
    """
    folder = job.folder / f"init.{job.job_id}"
    stuck: list[str] = []
    try:
        files = sorted(folder.glob("rank-*.txt"))
    except OSError:
        return ""
    for f in files:
        try:
            words = f.read_text(errors="replace").split()
        except OSError:
            continue
        if words and words[0] in ("started", "timeout"):
            host = words[1] if len(words) > 1 else "?"
            stuck.append(f"task {f.stem.removeprefix('rank-')} on {host}: MPI_Init "
                         + ("hung past its deadline" if words[0] == "timeout" else "did not finish"))
    return "; ".join(stuck[:4]) + (f"; {len(stuck) - 4} more" if len(stuck) > 4 else "")


def _plan_counts(paths: RunPaths, shape: tuple[int, int] | None, ranks: int | None) -> list[int] | None:
    """The ranks per node of the plan a ``shape`` came from (None without one, or when it does not match)."""
    if shape is None or not paths.plan.is_file():
        return None
    plan = Plan.load(paths.plan)  # checked when the stage read it (app.run_stage)
    per_node = [sum(1 for r in plan.ranks if r.node == n) for n in range(plan.nodes)]
    return per_node if plan.nodes == shape[0] and sum(per_node) == ranks and all(per_node) else None


class ProfileJob:
    """A checkpointable submitit job function for the profile stage.

    Submit ``ProfileJob()(entry, cfg, run_dir)`` instead of ``hpcsplit.launch.slurm.job_main`` (with
    ``max_num_timeout > 0``): on SLURM's USR2 warning or a preemption the ranks stop after their current run
    and flush, then submitit calls :meth:`checkpoint` and requeues the same call, which resumes
    the profile file.
    """

    def __init__(self, job_fn: str = "hpcsplit.launch.slurm:job_main") -> None:
        self.job_fn = job_fn

    def __call__(self, entry: str, cfg: dict[str, Any], run_dir: str) -> Any:
        return resolve(self.job_fn)(entry, cfg, run_dir)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Resubmit the same call (the profile file keeps what was measured)."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)
