"""Plan / RankEntry: JSON round trip, invariants and the errors PlanError names."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hpcsplit.core.plan import PLAN_SCHEMA_VERSION, Plan, RankEntry, device_key
from hpcsplit.errors import PlanError


def _plan(**kw) -> Plan:
    ranks = (
        RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0),
        RankEntry(1, "component", 0, 0, 10.0, 4, "text", 8, 0),
        RankEntry(2, "component", 0, 1, 10.0, 4, "text", 8, 1),
        RankEntry(3, "component", 1, 0, 20.0, 4, "image", 4, 0),
    )
    args = {
        "model": "clip",
        "switchboard_sha256": "ab" * 32,
        "device_kind": "cuda",
        "nodes": 2,
        "ranks": ranks,
        "predicted_throughput_rps": {"text": 200.0, "image": 50.0},
        "utilization": {"n0/g0": 0.3, "n0/g1": 0.3, "n1/g0": 0.6},
        "meta": {"solver": "HIGHS"},
    }
    args.update(kw)
    return Plan(**args)


def test_round_trip_and_queries(tmp_path):
    plan = _plan()
    path = plan.save(tmp_path / "plan.json")
    back = Plan.load(path)
    assert back == plan
    assert back.world_size == 4
    assert back.frontend.role == "frontend"
    assert [r.rank for r in back.replicas("text")] == [1, 2]
    assert back.components == ("text", "image")
    raw = json.loads(path.read_text())
    assert raw["schema_version"] == PLAN_SCHEMA_VERSION and raw["world_size"] == 4
    table = plan.format()
    assert "frontend" in table and "image" in table and "n1/g0" in table
    assert len([ln for ln in table.splitlines() if ln.strip().startswith(("0 ", "1 ", "2 ", "3 "))]) == 4


def test_replicas_of_unknown_component_names_known_ones():
    with pytest.raises(PlanError, match="'audio'.*text"):
        _plan().replicas("audio")


def test_device_key():
    assert device_key(2, 3) == "n2/g3"
    assert device_key(0, None) == "n0/cpu"
    assert _plan().ranks[3].device == "n1/g0"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda rs: (replace(rs[0], role="component", component="text"),) + rs[1:], "rank 0"),
        (lambda rs: rs[:1] + (replace(rs[1], rank=5),) + rs[2:], "ranks must be listed"),
        (lambda rs: rs[:2] + (replace(rs[2], replica=3),) + rs[3:], "replica indices"),
        (lambda rs: rs[:1] + (replace(rs[1], gpu=None),) + rs[2:], "gpu index"),
        (lambda rs: rs[:1] + (replace(rs[1], node=7),) + rs[2:], "node 7"),
        (lambda rs: rs[:1] + (replace(rs[1], batch_size=0),) + rs[2:], "batch_size"),
        (lambda rs: rs[:1], "at least one component rank"),
    ],
)
def test_invalid_plans_raise(change, needle):
    ranks = _plan().ranks
    with pytest.raises(PlanError, match=needle):
        _plan(ranks=change(ranks), predicted_throughput_rps={})


def test_cpu_plan_rejects_gpu_fields():
    ranks = (
        RankEntry(0, "frontend", 0, None, None, 1, None, 1, 0),
        RankEntry(1, "component", 0, 0, 5.0, 2, "a", 1, 0),
    )
    with pytest.raises(PlanError, match="device_kind cpu"):
        Plan("m", None, "cpu", 1, ranks, {"a": 1.0}, {"n0/cpu": 0.5})


def test_throughput_for_component_without_rank():
    with pytest.raises(PlanError, match="'audio', which has no rank"):
        _plan(predicted_throughput_rps={"text": 1.0, "audio": 2.0})


def test_load_errors(tmp_path):
    with pytest.raises(PlanError, match="no plan file"):
        Plan.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(bad)
    d = _plan().to_dict()
    d["schema_version"] = 99
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="schema_version 99"):
        Plan.load(bad)
    d = _plan().to_dict()
    d["world_size"] = 9
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="world_size 9"):
        Plan.load(bad)
    d = _plan().to_dict()
    d["ranks"][1]["colour"] = "red"
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="unknown keys"):
        Plan.load(bad)
