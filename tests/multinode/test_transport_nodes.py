"""``python -m hpcsplit.bench transport --slurm``: both ranks on one node, then a rank on each of the two nodes of
the dev cluster, printed side by side; the two-node run's libfabric log shows its messages went over TCP.

Skipped unless two SLURM nodes are up.
"""

from __future__ import annotations

import csv
import json
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

