"""A rank's keeper: it runs one MPI rank of a server as its child, so that the rank's death does not end the job.

[Note: rank keeper]
MPICH's hydra (5.0.2, the PyPI wheel) SIGKILLs every rank of a node when one of the processes it started
ends by a signal (``proxy/pmip.c``: ``WIFSIGNALED``), whatever ``-disable-auto-cleanup`` says; with that
flag it only leaves the others running when the process *exits*, and sends them SIGUSR1 (whose default
action would end them as well).  So under ``launcher=local`` every rank of a server
(``runtime.mode=server``) is started as::

    mpiexec -disable-auto-cleanup -n N python -m hpcsplit.launch.keeper python -m mpi4py -m hpcsplit.launch.rank ...

The keeper imports nothing heavy and does no MPI: it runs the command as its child (same process group:
hydra's signals reach both), ignores SIGUSR1, passes SIGTERM, SIGINT and SIGUSR2 on, and exits with the
child's exit code, or ``128 + signal`` when the child was killed, after a line naming the rank.  The
child has ``HPCSPLIT_KEEPER`` (:data:`KEEPER_VAR`) in its environment: that tells the rank from its keeper
in a process listing.  :func:`survival_env` gives the variables the launcher sets for such a job
(``[Note: serving through faults]`` in :mod:`hpcsplit.runtime.server.failover`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpcsplit.core.paths import RANKS_SURVIVE_VAR

__all__ = ["KEEPER_VAR", "main", "server_faults", "server_lost_ranks", "serves_through_faults", "survival_env"]

KEEPER_VAR = "HPCSPLIT_KEEPER"  # in the rank's environment: the pid of its keeper


def serves_through_faults(cfg: Mapping[str, Any], stage: str) -> bool:
    """Whether the job is a server (``stage=serve runtime.mode=server``), whose ranks may die without ending it."""
    rt = cfg.get("runtime")
    return stage == "serve" and isinstance(rt, Mapping) and rt.get("mode") == "server"


def survival_env(cfg: Mapping[str, Any]) -> dict[str, str]:
    """The environment a server job's ranks need to go on without a lost rank (MPICH's variables measured in
    docs/serving.md "Faults"): messages to a dead rank of the node hold the sender's shared-memory cells for
    good, so there are enough of them for every sample in flight (``runtime.max_inflight``) twice over (a
    header and a payload each) and then some; ``MPI_Finalize`` must not wait for the dead rank.

    Examples
    --------
    >>> survival_env({"runtime": {"max_inflight": 64}})["MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS"]
    '1024'
    """
    rt = cfg.get("runtime")
    inflight = rt.get("max_inflight") if isinstance(rt, Mapping) else None
    inflight = inflight if isinstance(inflight, int) and not isinstance(inflight, bool) and inflight > 0 else 64
    return {RANKS_SURVIVE_VAR: "1", "MPIR_CVAR_NO_COLLECTIVE_FINALIZE": "1",
            "MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_NUM_CELLS": str(max(1024, 8 * inflight + 256))}


def server_faults(out: Any) -> dict[str, Any] | None:
    """From rank 0's result of a server job that lost ranks while serving: ``{"lost_ranks": {rank: what}, "restart":
    why it must start again, or None, "http_port", "grpc_port"}`` (``[Note: serving through faults]``); None when
    it lost none."""
    if not isinstance(out, dict) or not isinstance(out.get("lost_ranks"), dict):
        return None
    variants = out.get("variants")
    servers = [v["server"] for v in (variants.values() if isinstance(variants, dict) else ())
               if isinstance(v, dict) and isinstance(v.get("server"), dict)]
    server = servers[0] if servers else {}
    restart = server.get("restart")
    return {"lost_ranks": out["lost_ranks"], "restart": restart if isinstance(restart, str) else None,
            "http_port": server.get("http_port"), "grpc_port": server.get("grpc_port")}


def server_lost_ranks(result: Path) -> dict[str, Any] | None:
    """:func:`server_faults` of the result file ``result`` (None: unreadable, or no rank lost)."""
    try:
        return server_faults(json.loads(result.read_text()))
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Run ``argv`` (the rank's command) as the child; its exit code, or ``128 + signal``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m hpcsplit.launch.keeper COMMAND [ARGS...]", file=sys.stderr)
        return 2
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # hydra: a rank of this node ended (the rank ignores it too)
    try:
        # the rank inherits every descriptor: hydra's PMI socket (PMI_FD) above all
        child = subprocess.Popen(argv, env={**os.environ, KEEPER_VAR: str(os.getpid())}, close_fds=False)
    except OSError as e:
        print(f"[hpcsplit keeper] cannot start {argv[0]}: {e.strerror}", file=sys.stderr)
        return 127

    def forward(signum: int, _frame: Any) -> None:
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(s, forward)
    rc = child.wait()
    if rc >= 0:
        return rc
    sig = -rc
    try:
        what = signal.Signals(sig).name
    except ValueError:
        what = f"signal {sig}"
    rank = os.environ.get("PMI_RANK", "?")
    sys.stderr.write(f"[rank {rank}] was killed by {what} (pid {child.pid}); its keeper exits {128 + sig}, so "
                     "that the job's other ranks go on\n")
    return 128 + sig


if __name__ == "__main__":
    raise SystemExit(main())
