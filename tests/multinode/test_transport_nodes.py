"""``python -m hpcsplit.bench transport --slurm``: both ranks on one node, then a rank on each of the two nodes of
the dev cluster, printed side by side; the two-node run's libfabric log shows its messages went over TCP.

Skipped unless two SLURM nodes are up.
"""

from __future__ import annotations

import csv
import json
import shlex
import subprocess
import sys
from pathlib import Path

from tests.multinode import helpers as mn

pytestmark = mn.pytestmark


def test_transport_bench_one_node_beside_two_nodes(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    res = subprocess.run(
        [sys.executable, "-m", "hpcsplit.bench", "transport", "--slurm", "--cluster", "dev2", "--out", str(out),
         "--sizes", "4K,1M", "--iters", "8", "--timeout-s", "300"],
        cwd=mn.REPO, env=mn.env(**mn.OFI_TRACE), capture_output=True, text=True, timeout=700, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    one = json.loads((out / "transport_1node.json").read_text())
    two = json.loads((out / "transport_2node.json").read_text())
    assert len(set(one["hosts"])) == 1 and set(one["hosts"]) <= set(mn.NODES), one["hosts"]
    assert len(set(two["hosts"])) == 2 and set(two["hosts"]) <= set(mn.NODES), two["hosts"]
    # the ranks on different nodes talked through libfabric's tcp provider, bound on both nodes' addresses
    providers, addresses = mn.ofi_over_tcp([out / "transport_2node.log"])
    assert providers == {("tcp", str(mn.bridge_network()))} and len(addresses) == 2, (providers, addresses)
    assert len(mn.ofi_over_tcp([out / "transport_1node.log"])[1]) == 1  # one node: one address
    with (out / "transport_nodes.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["bytes"]) for r in rows] == [4096, 1 << 20]
    assert all(float(v) > 0 for r in rows for k, v in r.items() if k != "bytes")
    assert (out / "transport_nodes.png").stat().st_size > 10_000
    table = res.stdout[res.stdout.index("# transport, one node"):]
    assert f"({two['hosts'][0]} <-> {two['hosts'][1]}, network)" in table
    assert len([ln for ln in table.splitlines() if ln.strip().startswith(("4K |", "1M |"))]) == 2
    # both targets judged for each run, one node and two nodes
    for part in table.split("\none node:")[1].split("\ntwo nodes:"):
        assert "target: one-way latency within 5 us of raw up to 64 KiB" in part
        assert part.count("-> holds") + part.count("-> MISSED") == 4, part



def _srun_script(tmp_path: Path, script: str, ntasks: int, timeout_s: float = 300) -> list:
    """Run ``script`` as ``ntasks`` ranks spread over both nodes (the dev2 preset's setup lines and srun options,
    MPI between the nodes through OFI's tcp provider); rank 0's ``RESULT`` line."""
    from hpcsplit.core.cluster import ClusterSpec
    from hpcsplit.core.settings import group_defaults
    from hpcsplit.launch.slurm import site_options

    sl = ClusterSpec.from_config(group_defaults("cluster", "dev2")).slurm
    assert sl is not None
    (tmp_path / "job.py").write_text(script)
    srun = ["srun", "--nodes", "2", "--ntasks", str(ntasks), "--ntasks-per-node", str(ntasks // 2), "--cpus-per-task",
            "1", f"--mpi={sl.srun_mpi}", "--time=5", "--kill-on-bad-exit=1", "--job-name", "hpcsplit-transport-test"]
    for key, value in site_options(sl).items():
        srun += [f"--{key}", value]
    cmd = "\n".join(["set -e", *sl.setup, "exec " + shlex.join([*srun, sys.executable, str(tmp_path / "job.py")])])
    p = subprocess.run(["bash", "-c", cmd], cwd=mn.REPO, env=mn.env(), capture_output=True, text=True,
                       timeout=timeout_s, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_every_size_class_and_many_in_flight_arrive_intact_across_nodes(tmp_path: Path) -> None:
    """The one-node transport tests' messages (tests/mpi/test_transport.py) between ranks on two nodes: every
    size class and dtype, inline and separate; and three senders, one beside the receiver and two on the
    other node, with many messages in flight, each sender's in its order, long headers among them."""
    from tests.mpi.test_transport import MANY, SIZES

    r0, r1 = _srun_script(tmp_path, SIZES, 2)
    assert r1["bad"] == [] and r1["count"] == r1["n"] + 1 and r1["pending"] == 0, r1
    assert r0["two_nodes"] and r0["limit"] == r1["limit"] == 64 << 10  # the other node's inline limit
    r0 = _srun_script(tmp_path, MANY, 4)[0]
    assert r0["bad"] == [] and r0["pending"] == 0, r0
    assert r0["counts"] == {"1": 60, "2": 60, "3": 60} and r0["order"] == {"1": True, "2": True, "3": True}
    # over the network the long headers were still arriving when taken, and messages behind them waited
    assert r0["arriving"][0] > 0 and r0["arriving"][1] > 0, r0["arriving"]
