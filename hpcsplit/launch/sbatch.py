"""``python -m hpcsplit stage=sbatch plan=PATH``: a ready, commented sbatch script that serves a plan.

The script needs neither Hydra nor submitit: it runs ``srun --mpi=pmi2 python -m mpi4py -m
hpcsplit.launch.rank hpcsplit.runtime.stage:mpi_main CFG.json RUN_DIR`` with the resolved config written
beside it (absolute plan and switchboard paths), so ``sbatch RUN_DIR/serve.sbatch`` works from any
folder with the hpcsplit environment active.

[Note: plan -> sbatch]
* ``--nodes`` is the plan's node count, ``--ntasks`` its world size.  Plans number ranks node by node
  (rank 0, the frontend, on node 0).  When every node has the same number of ranks the script uses
  ``--ntasks-per-node`` and SLURM's block distribution matches the plan; otherwise it allocates the
  most ranks of a node on every node (``--ntasks-per-node=max``: each node has CPUs for the ranks the
  plan gives it, whichever allocated node is which), writes a ``SLURM_HOSTFILE`` from the allocation's
  node list and the plan's per-node counts, and runs ``srun --ntasks=<world size>
  --distribution=arbitrary``, so rank r lands on the plan's node for r (node i of the plan is the i-th
  host of ``SLURM_JOB_NODELIST``).  Tested on the two-node dev cluster with 3 + 2 ranks
  (``tests/multinode``).
* GPU plans get ``--gpus-per-node`` = the cluster's GPUs per node and no per-task binding: every rank
  sees all GPUs of its node and picks the plan's ``gpu`` (``runtime/rank.py``, ``bind_device``).
* ``--cpus-per-task`` is the largest ``threads`` of a rank in the plan (at least
  ``cluster.slurm.cpus_per_task`` when that is larger on GPU plans); ``OMP_NUM_THREADS`` is left to
  the runtime, which uses the plan's per-rank threads.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from hpcsplit.core.cluster import ClusterSpec, SlurmSpec
from hpcsplit.core.paths import RunPaths, result_name
from hpcsplit.core.plan import Plan
from hpcsplit.errors import ConfigError
from hpcsplit.launch.slurm import hostfile_setup
from hpcsplit.launch.stages import STAGES, cluster_spec

__all__ = ["run_sbatch", "sbatch_script"]


def _opt(lines: list[str], key: str, value: Any, comment: str) -> None:
    flag = f"#SBATCH --{key}={value}" if value not in (None, "") else f"##SBATCH --{key}=..."
    lines.append(f"{flag:<40} # {comment}")


def sbatch_script(
    plan: Plan, cluster: ClusterSpec, cfg_path: Path, run_dir: Path, stage: str = "serve", python: str | None = None
) -> str:
    """The sbatch text serving ``plan`` (see ``[Note: plan -> sbatch]``).

    Parameters
    ----------
    plan : Plan
    cluster : ClusterSpec
        Its GPUs per node and ``slurm`` block (partition, account, qos, constraint, time, setup).
    cfg_path, run_dir : Path
        Where the job reads its config and writes its results.
    stage : str
        ``serve`` (batch mode) or ``bench``.
    python : str, optional
        The Python of the job (default: this one).
    """
    slurm = cluster.slurm or SlurmSpec()
    per_node = Counter(r.node for r in plan.ranks)
    counts = [per_node.get(n, 0) for n in range(plan.nodes)]
    even = len(set(counts)) == 1
    threads = max(int(r.threads or 1) for r in plan.ranks)
    gpus = int(cluster.gpus_per_node or slurm.gpus_per_node or 0) if plan.device_kind == "cuda" else 0
    cpus = max(threads, int(slurm.cpus_per_task or 1)) if gpus else threads
    mpi = slurm.srun_mpi or "pmi2"
    time_min = int(slurm.time_min or 30)
    py = python or sys.executable
    lines = [
        "#!/bin/bash",
        (f"# hpcsplit {stage} of plan {plan.model!r}: {plan.world_size} MPI ranks on {plan.nodes} node(s), "
        f"device {plan.device_kind}."),
        "# Written by `python -m hpcsplit stage=sbatch plan=PATH`; submit with `sbatch THIS_FILE` (any folder).",
        "# Rank 0 is the frontend; the other ranks serve the plan's components (see plan.json).",
        "#",
        "# ---- the options that matter ----",
        "#SBATCH --job-name=hpcsplit-" + stage,
        f"#SBATCH --nodes={plan.nodes:<26} # the plan's nodes",
    ]
    if even:
        lines += [
            f"#SBATCH --ntasks={plan.world_size:<25} # MPI ranks = the plan's world size (each rank checks it)",
            f"#SBATCH --ntasks-per-node={counts[0]:<16} # ranks per node, numbered node by node as in the plan",
        ]
    else:
        lines += [
            f"# ranks per node differ ({counts}): every node gets room for the most ranks of one node, and srun",
            f"# starts the plan's {plan.world_size} ranks with SLURM_HOSTFILE + --distribution=arbitrary below",
            f"#SBATCH --ntasks-per-node={max(counts):<16} # the most ranks of one node in the plan",
        ]
    lines.append(f"#SBATCH --cpus-per-task={cpus:<18} # cores per rank: the plan's largest per-rank thread count")
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={gpus:<18} # every rank sees all GPUs of its node, uses the plan's gpu")
    else:
        lines.append("##SBATCH --gpus-per-node=4              # CPU plan: no GPUs needed")
    lines.append(f"#SBATCH --time={time_min:<27} # minutes")
    _opt(lines, "partition", slurm.partition, "site-specific (sinfo)")
    _opt(lines, "account", slurm.account, "site-specific (sacctmgr show assoc user=$USER)")
    _opt(lines, "qos", slurm.qos, "site-specific")
    _opt(lines, "constraint", slurm.constraint, "e.g. gpu on Perlmutter")
    for k, v in (slurm.extra.get("sbatch_args") or {}).items():
        lines.append(f"#SBATCH --{k}={v}")
    lines.append(f"#SBATCH --output={run_dir}/{stage}-%j.out")
    lines += [
        "set -euo pipefail",
        "",
        f"RUN_DIR={shlex.quote(str(run_dir))}",
        f"CFG={shlex.quote(str(cfg_path))}",
        f"PYTHON=${{HPCSPLIT_PYTHON:-{shlex.quote(py)}}}",
        "",
        "# MPICH (the mpich wheel) talks PMI-2 to srun; Open MPI needs pmix. Without --mpi srun starts",
        "# singletons of world size 1 and every rank aborts with WorldSizeError.",
        f"export SLURM_MPI_TYPE=${{SLURM_MPI_TYPE:-{mpi}}}",
        "export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}   # ranks that share cores must not spin",
        "export PYTHONUNBUFFERED=1",
    ]
    lines += [s for s in slurm.setup if "SLURM_MPI_TYPE" not in s]
    srun = ['srun --mpi="$SLURM_MPI_TYPE" --kill-on-bad-exit=1']
    if not even:
        lines += [
            "",
            "# Place rank r on the plan's node: one hostfile line per rank, in rank order.",
            *hostfile_setup(counts, "$RUN_DIR/hostfile.$SLURM_JOB_ID"),
        ]
        srun += [f"--ntasks={plan.world_size}", "--distribution=arbitrary"]
    entry = STAGES[stage].entry
    lines += [
        "",
        "# --kill-on-bad-exit=1: a rank that dies ends the step instead of leaving the others blocked.",
        "# MPI_Init can hang or fail in the PMI exchange with srun before anything runs (each rank records its",
        "# start in $HPCSPLIT_MPI_INIT_DIR, and stops after HPCSPLIT_MPI_INIT_TIMEOUT_S): then start them once more.",
        "for attempt in 1 2; do",
        "    export HPCSPLIT_MPI_INIT_DIR=$RUN_DIR/mpi-init/${SLURM_JOB_ID:-0}.$attempt",
        "    rc=0",
        "    " + " ".join(srun) + " \\",
        f'        "$PYTHON" -m mpi4py -m hpcsplit.launch.rank {entry} "$CFG" "$RUN_DIR" || rc=$?',
        ("    [[ $rc -ne 0 && $attempt -eq 1 ]] && grep -qs -e '^started' -e '^timeout' "
        '"$HPCSPLIT_MPI_INIT_DIR"/rank-*.txt || break'),
        (f'    echo "hpcsplit {stage}: the ranks never formed an MPI world (MPI_Init failed or hung): starting them '
        'once more" >&2'),
        "done",
        '[[ $rc -eq 0 ]] || { echo "hpcsplit ' + stage + ': FAILED: the ranks exited with code $rc" >&2; exit "$rc"; }',
        f'echo "hpcsplit {stage}: done; rank 0 summary in $RUN_DIR/{result_name(entry)}"',
        "",
    ]
    return "\n".join(lines)


def run_sbatch(cfg: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """``stage=sbatch``: write ``RUN_DIR/<stage>.sbatch`` and its config for the plan ``plan=PATH``.

    ``runtime.mode=bench`` writes a benchmark job (``bench.sbatch``), otherwise a serve job.

    Raises
    ------
    ConfigError
        No plan given or found, or no switchboard for it.
    PlanError
        The plan file is malformed.
    """
    paths = RunPaths.from_config(cfg, run_dir)
    plan_path = paths.plan
    if not plan_path.is_file():
        raise ConfigError(
            f"stage=sbatch needs a plan, but {plan_path} "
            + ("is a folder, not a plan file" if plan_path.is_dir() else "does not exist")
            + ": pass plan=PATH (a plan.json from "
            "stage=allocate or stage=all)"
        )
    plan = Plan.load(plan_path)
    # the plan's switchboard: switchboard=PATH, else the one beside the plan (the run that made it)
    sb = paths.switchboard if paths.switchboard_given else RunPaths.from_config(cfg, plan_path.parent).own_switchboard
    if not sb.is_dir():
        raise ConfigError(
            f"stage=sbatch: the plan's switchboard was not found at {sb}; pass switchboard=PATH "
            "(the switchboard/ folder of the run that made the plan)"
        )
    cluster = cluster_spec(cfg)
    stage = "bench" if (cfg.get("runtime") or {}).get("mode") == "bench" else "serve"
    job_cfg = json.loads(json.dumps(cfg, default=str))
    job_cfg.update(stage=stage, plan=str(plan_path.resolve()), switchboard=str(sb.resolve()))
    job_cfg.setdefault("paths", {})["run_dir"] = str(paths.run_dir)
    cfg_path = paths.sbatch_config(stage)
    cfg_path.write_text(json.dumps(job_cfg, indent=2))
    script = paths.sbatch_script(stage)
    script.write_text(sbatch_script(plan, cluster, cfg_path, paths.run_dir, stage))
    script.chmod(0o755)
    print(script.read_text(), flush=True)
    print(f"[hpcsplit] wrote {script}: submit with `sbatch {script}`", flush=True)
    return {"script": str(script), "cfg": str(cfg_path), "world_size": plan.world_size, "nodes": plan.nodes}
