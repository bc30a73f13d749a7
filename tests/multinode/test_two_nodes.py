"""hpcsplit over the two nodes of the dev cluster (``slurm/dev-cluster.sh up --nodes 2``, ``cluster=dev2``).

* ``stage=probe``: ranks on both nodes, each reporting its own node's hostname and address;
* ``stage=serve`` (batch mode) for the toy MLP and tiny CLIP with components on both nodes: outputs equal to
  the whole model, and the ranks' libfabric logs show the MPI traffic between the nodes going over TCP;
* ``stage=bench``: the same, and component ranks woken over the UDP doorbell stay under 2% of a core.

Skipped unless two SLURM nodes are up.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.multinode import helpers as mn

pytestmark = mn.pytestmark


def test_probe_has_ranks_on_both_nodes_each_with_its_address(tmp_path: Path) -> None:
    res = mn.hpcsplit(tmp_path / "run", "stage=probe")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads((tmp_path / "run" / "probe.mpi_main.result.json").read_text())
    net = mn.bridge_network()
    assert [r["rank"] for r in rows] == [0, 1, 2, 3] and {r["world_size"] for r in rows} == {4}
    hosts = [r["host"] for r in rows]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], hosts  # 2 tasks per node, block distribution
    assert set(hosts) <= set(mn.NODES)
    addr = {r["host"]: r["address"] for r in rows}
    assert all(r["address"] == addr[r["host"]] for r in rows)  # one address per node
    assert len(set(addr.values())) == 2 and all(ipaddress.IPv4Address(a) in net for a in addr.values()), addr
    assert "4 rank(s) on 2 host(s)" in res.stdout and addr[hosts[2]] in res.stdout  # the login side's table


def _serve(tmp_path: Path, sb_dir: Path, nodes: list[list[str]], n_inputs: int, *args: str,
           stage: str = "serve") -> tuple[dict, Path]:
    from tests.mpi.test_serve import _inputs

    mn.two_node_plan(sb_dir, tmp_path / "plan.json", nodes)
    _inputs(sb_dir, n_inputs, tmp_path / "in.npz")
    run = tmp_path / "run"
    res = mn.hpcsplit(run, f"stage={stage}", f"plan={tmp_path / 'plan.json'}", f"switchboard={sb_dir}",
                      f"runtime.input_path={tmp_path / 'in.npz'}", f"runtime.output_path={tmp_path / 'out.npz'}",
                      *args, **mn.OFI_TRACE)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads((run / "runtime.mpi_main.result.json").read_text()), run


def _assert_tcp_between_nodes(run: Path) -> None:
    providers, addresses = mn.ofi_over_tcp(sorted((run / "slurm").glob("*_log.*")))
    # MPI took libfabric's tcp provider on the bridge, and ranks bound endpoints on both nodes' addresses
    assert providers == {("tcp", str(mn.bridge_network()))}, providers
    assert len(addresses) == 2 and all(ipaddress.IPv4Address(a) in mn.bridge_network() for a in addresses), addresses


@pytest.mark.parametrize("model", ["toy_mlp", pytest.param("clip_tiny", marks=pytest.mark.slow)])
def test_batch_serve_with_components_on_both_nodes_equals_whole_model(
        tmp_path: Path, model: str, switchboards: Callable[..., Path]) -> None:
    from hpcsplit.switchboard.reader import Switchboard
    from tests.mpi.test_serve import _inputs, _read, _whole_per_request

    sb_dir = switchboards(model, stages=2, max_branches=1, force=True)
    order = Switchboard.load(sb_dir).order
    assert len(order) >= 2, order
    # node 0: the frontend and the first component; node 1: the rest (the last twice: two replicas)
    result, run = _serve(tmp_path, sb_dir, [order[:1], [*order[1:], order[-1]]], 7)
    out = _read(tmp_path / "out.npz")
    assert out["done"].all() and result["variants"]["split"]["done"] == 7
    ref = _whole_per_request(sb_dir, _inputs(sb_dir, 7, tmp_path / "ref.npz"))
    keys = sorted(k for k in out if k.startswith("output"))
    for k, want in zip(keys, ref, strict=True):
        np.testing.assert_allclose(out[k], want, rtol=1e-4, atol=1e-5)
    _assert_tcp_between_nodes(run)
