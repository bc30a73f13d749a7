"""Shared parts of the multi-node tests: the two-node dev cluster (``slurm/dev-cluster.sh up --nodes 2``,
``cluster=dev2``), plans over both nodes, and the libfabric lines that show MPI took TCP between the nodes."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_USABLE = ("idle", "mixed", "allocated", "completing")


def usable_nodes() -> list[str]:
    """The dev cluster's nodes that take jobs (empty without SLURM)."""
    if shutil.which("sinfo") is None:
        return []
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20,
                             check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({n for n, _, s in (line.partition(" ") for line in out.splitlines()) if s.rstrip("*~#") in _USABLE})


NODES = usable_nodes()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.multinode,
    pytest.mark.skipif(len(NODES) < 2, reason=f"needs 2 SLURM nodes up, found {len(NODES)} "
                       "(start them: slurm/dev-cluster.sh up --nodes 2)"),
]


def bridge_network() -> ipaddress.IPv4Network:
    """The nodes' network, as the ``cluster=dev2`` preset exports it (HPCSPLIT_DOORBELL_NETWORK)."""
    text = (REPO / "conf/cluster/dev2.yaml").read_text()
    m = re.search(r"HPCSPLIT_DOORBELL_NETWORK=(\S+)", text)
    assert m, "conf/cluster/dev2.yaml exports no HPCSPLIT_DOORBELL_NETWORK"
    return ipaddress.IPv4Network(m.group(1))


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **extra}


def hpcsplit(run_dir: Path, *args: str, timeout: float = 600, cluster: str = "dev2",
             **extra_env: str) -> subprocess.CompletedProcess[str]:
    """``python -m hpcsplit ARGS`` on the two-node cluster (``launcher=slurm cluster=dev2``, fast polling)."""
    return subprocess.run(
        [sys.executable, "-m", "hpcsplit", "launcher=slurm", f"cluster={cluster}", "launcher.poll_s=1",
         "launcher.poll_max_s=2", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=env(**extra_env), capture_output=True, text=True, timeout=timeout, check=False,
    )


def two_node_plan(sb_dir: Path, path: Path, nodes: Sequence[Sequence[str]], batch: int = 2) -> int:
    """A CPU plan with the frontend (rank 0) on node 0 and the components listed per node (one rank each,
    a component named twice gets two replicas), ranks numbered node by node; returns the world size."""
    from hpcsplit.core.plan import Plan, RankEntry
    from hpcsplit.switchboard.reader import Switchboard

    sb = Switchboard.load(sb_dir)
    ranks = [RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0)]
    replicas: dict[str, int] = {}
    for node, comps in enumerate(nodes):
        for c in comps:
            ranks.append(RankEntry(len(ranks), "component", node, None, None, 1, c, batch, replicas.get(c, 0)))
            replicas[c] = replicas.get(c, 0) + 1
    assert set(replicas) == set(sb.order), "every component needs a rank"
    Plan(sb.model_name, sb.sha256, "cpu", len(nodes), tuple(ranks), dict.fromkeys(sb.order, 0.0), {}).save(path)
    return len(ranks)


# What shows the MPI traffic between the nodes went over TCP (cluster=dev2: MPICH's OFI netmod, libfabric's tcp
# provider): with MPIR_CVAR_DEBUG_SUMMARY=1 rank 0 prints the provider and its network,
#   libfabric provider: tcp - 10.213.0.0/24
# and with FI_LOG_LEVEL=info (FI_LOG_PROV=tcp) every rank's libfabric logs the address its endpoint binds,
#   libfabric:1234:1796298077:ofi_rxm:tcp:core:util_getinfo_ifs():425<info> Chosen addr for using: 10.213.0.12, ...
# Ranks on one node talk through MPICH's shared memory; ranks on two nodes (private /dev/shm, PMI's process
# mapping) only through the provider.
OFI_TRACE = {"MPIR_CVAR_DEBUG_SUMMARY": "1", "FI_LOG_LEVEL": "info", "FI_LOG_PROV": "tcp"}
_OFI_PROVIDER = re.compile(r"^libfabric provider: (\S+) - (\S+)", re.MULTILINE)
_OFI_ADDR = re.compile(r"Chosen addr for using: ([0-9.]+),")


def ofi_over_tcp(logs: Sequence[Path]) -> tuple[set[tuple[str, str]], set[str]]:
    """(provider, network) pairs rank 0 reported, and the addresses the ranks' endpoints bound (OFI_TRACE)."""
    text = "".join(p.read_text(errors="replace") for p in logs)
    return set(_OFI_PROVIDER.findall(text)), set(_OFI_ADDR.findall(text))
