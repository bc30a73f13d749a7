"""Plans over the two nodes of the dev cluster beyond one serve: ``stage=bench`` (idle ranks on the UDP doorbell
path), ``stage=sbatch`` for an uneven plan (3 ranks on one node, 2 on the other), and the whole pipeline
``+experiment=toy launcher=slurm cluster=dev2``.  Skipped unless two SLURM nodes are up."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.multinode import helpers as mn

pytestmark = mn.pytestmark


def test_bench_across_nodes_idle_ranks_sleep_on_the_udp_doorbell(
        tmp_path: Path, switchboards: Callable[..., Path]) -> None:
    from hpcsplit.switchboard.reader import Switchboard

    sb_dir = switchboards("toy_mlp", stages=2, max_branches=1, force=True)
    order = Switchboard.load(sb_dir).order
    mn.two_node_plan(sb_dir, tmp_path / "plan.json", [order[:1], [*order[1:], order[-1]]])
    run = tmp_path / "run"
    res = mn.hpcsplit(run, "stage=bench", f"plan={tmp_path / 'plan.json'}", f"switchboard={sb_dir}",
                      "bench.qps=[2]", "bench.duration_s=3", "bench.warmup_s=0.2")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads((run / "runtime.mpi_main.result.json").read_text())
    logs = "".join(p.read_text(errors="replace") for p in sorted((run / "slurm").glob("*_log.err")))
    assert "match the reference" in logs  # the split's end-to-end outputs equal the whole model's (verify)
    # every rank could be rung from the other node (its UDP socket on the bridge, the test ring arrived)
    assert "cannot ring" not in logs and "did not reach" not in logs, logs[-3000:]
    # ranks 2 and 3 (node 1) serve the split's second stage: every request reaches them from rank 1 on node 0,
    # and at 2 requests/s they are asleep when it comes, so rings over UDP woke them
    split = {s["rank"]: s for s in result["ranks"] if s.get("variant") == "split"}
    rung = sum(int(split[r].get("doorbell_wakeups", 0)) for r in (2, 3))
    assert rung > 0, {r: split[r] for r in (2, 3)}
    # the whole-model variant runs on one rank of each replica set: at 2 requests/s the ranks are idle nearly
    # all the time and sleep: a few per cent of a core at most (1-3 % on this VM, by its speed of the hour),
    # where a rank that spins takes most of one
    whole = {s["rank"]: s["cpu_pct_of_core"] for s in result["ranks"] if s.get("variant") == "whole"}
    print(f"idle ranks' CPU (% of a core) in the whole variant at 2 req/s: {whole}; doorbell wake-ups of ranks "
          f"2 and 3 in the split variant: {rung}")
    assert {2, 3} <= set(whole) and all(whole[r] < 10.0 for r in (2, 3)), whole


def test_sbatch_script_for_a_three_plus_two_plan_runs_there(
        tmp_path: Path, switchboards: Callable[..., Path]) -> None:
    from hpcsplit.switchboard.reader import Switchboard
    from tests.mpi.test_serve import _inputs, _read, _whole_per_request

    sb_dir = switchboards("toy_mlp", stages=2, max_branches=1, force=True)
    order = Switchboard.load(sb_dir).order
    first, last = order[0], order[-1]
    n = mn.two_node_plan(sb_dir, tmp_path / "plan.json", [[first, first], [last, last]])  # 1 + 2 | 2
    assert n == 5
    inputs = _inputs(sb_dir, 9, tmp_path / "in.npz")
    run = tmp_path / "run"
    res = mn.hpcsplit(run, "stage=sbatch", f"plan={tmp_path / 'plan.json'}", f"switchboard={sb_dir}",
                      f"runtime.input_path={tmp_path / 'in.npz'}", f"runtime.output_path={tmp_path / 'out.npz'}")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    script = run / "serve.sbatch"
    text = script.read_text()
    assert "COUNTS=(3 2)" in text and "--ntasks=5 --distribution=arbitrary" in text
    job = subprocess.run(["sbatch", "--parsable", "--wait", str(script)], capture_output=True, text=True,
                         timeout=600, check=False, env=mn.env())
    assert job.returncode == 0, job.stdout + job.stderr + "".join(p.read_text() for p in run.glob("serve-*.out"))
    job_id = job.stdout.strip().split(";")[0]
    hosts = (run / f"hostfile.{job_id}").read_text().split()
    assert len(hosts) == 5 and hosts[:3] == [hosts[0]] * 3 and hosts[3:] == [hosts[3]] * 2 and hosts[0] != hosts[3]
    out = _read(tmp_path / "out.npz")
    assert out["done"].all()
    np.testing.assert_allclose(out["output"], _whole_per_request(sb_dir, inputs)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # five SLURM jobs in turn
def test_toy_pipeline_on_two_nodes_completes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = mn.hpcsplit(run, "+experiment=toy", "profile.max_batch=2", "profile.iters=3", "bench.qps=[20]",
                      "bench.duration_s=1", "bench.warmup_s=0.2", timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "submitted profile as SLURM job" in res.stdout and "submitted bench as SLURM job" in res.stdout
    assert (run / "plan.json").is_file() and (run / "summary.md").is_file()


def test_profile_split_over_both_nodes_merges_to_the_one_node_cells(
        tmp_path: Path, switchboards: Callable[..., Path]) -> None:
    from hpcsplit.core.profile_format import read_profile

    sb_dir = switchboards("toy_mlp", stages=2, max_branches=1, force=True)
    fast = [f"switchboard={sb_dir}", "stage=profile", "profile.max_batch=2", "profile.iters=3"]
    two = mn.hpcsplit(tmp_path / "two", *fast, "profile.ranks=4")  # cluster=dev2: 2 ranks on each node
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = mn.hpcsplit(tmp_path / "one", *fast, "profile.ranks=2", cluster="dev")  # one node
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    p2, p1 = read_profile(tmp_path / "two" / "profile.h5"), read_profile(tmp_path / "one" / "profile.h5")
    assert p2.complete and p1.complete and sorted(p2.components) == sorted(p1.components)
    for name, c2 in p2.components.items():
        c1 = p1.components[name]
        assert (c2.batch_sizes, c2.slices) == (c1.batch_sizes, c1.slices)
        np.testing.assert_array_equal(c2.measured, c1.measured)
        np.testing.assert_array_equal(c2.oom, c1.oom)
    ranks = {int(r) for c in p2.components.values() for r in c.measured_by_rank.ravel()}
    assert len(ranks) > 1 and ranks & {2, 3}, ranks  # cells were measured by ranks of node 1 too
