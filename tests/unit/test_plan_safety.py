"""A plan.json written by someone else: strict types, bounded values, and only PlanError on bad input.

Hypothesis mutates a valid plan (values of every key and rank entry, nesting, types); every outcome is a
valid Plan or a PlanError, never another exception, and a plan that loads holds only bounded values.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcsplit.core import plan as P
from hpcsplit.core.plan import Plan
from hpcsplit.errors import PlanError
from tests.unit.test_plan import _plan


def _dict() -> dict[str, Any]:
    return _plan().to_dict()


@pytest.mark.parametrize(
    ("rank_key", "value", "fragment"),
    [
        ("threads", 100000, "threads = 100000: needs an integer in [1, 1024]"),
        ("batch_size", 1e12, "batch_size = 1000000000000.0: needs an integer in [1, 1048576]"),
        ("slice_gb", math.inf, "slice_gb = inf: needs a finite number"),
        ("threads", "4", "threads = '4': needs an integer"),
        ("batch_size", True, "batch_size = True: needs an integer"),
        ("node", 0.5, "node = 0.5: needs an integer"),
        ("component", 7, "component = 7: needs a non-empty string"),
    ],
)
def test_bad_rank_values_are_refused(tmp_path: Path, rank_key: str, value: Any, fragment: str) -> None:
    d = _dict()
    d["ranks"][1][rank_key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="rank entry 1") as ei:
        Plan.load(path)
    assert fragment in str(ei.value) and str(path) in str(ei.value)


def test_deeply_nested_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text('{"meta": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(PlanError, match="nests JSON too deeply|not valid JSON"):
        Plan.load(path)


def test_huge_and_binary_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(b"\xff\xfe" * 10)
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(path)
    with path.open("wb") as f:
        f.truncate(P.MAX_PLAN_BYTES + 1)
    with pytest.raises(PlanError, match="more than a plan"):
        Plan.load(path)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=8,
)
_TOP = ["schema_version", "model", "switchboard_sha256", "device_kind", "nodes", "world_size",
        "predicted_throughput_rps", "utilization", "meta", "ranks"]
_RANK = ["rank", "role", "node", "gpu", "slice_gb", "threads", "component", "batch_size", "replica"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.sampled_from(["top", "rank", "drop", "extra"]), top=st.sampled_from(_TOP),
       rank_key=st.sampled_from(_RANK), index=st.integers(0, 3), value=_JSON)
def test_mutated_plans_load_or_refuse(tmp_path: Path, where: str, top: str, rank_key: str, index: int,
                                      value: Any) -> None:
    d = _dict()
    if where == "top":
        d[top] = value
    elif where == "rank":
        d["ranks"][index][rank_key] = value
    elif where == "drop":
        d["ranks"][index].pop(rank_key)
    else:
        d["ranks"][index]["x" + rank_key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d, allow_nan=True))
    try:
        plan = Plan.load(path)
    except PlanError:
        return
    for r in plan.ranks:
        assert 1 <= r.threads <= P.MAX_THREADS and 1 <= r.batch_size <= P.MAX_BATCH
        assert r.slice_gb is None or 0 < r.slice_gb <= P.MAX_SLICE_GB
