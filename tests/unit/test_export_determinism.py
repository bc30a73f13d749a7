"""The same model and options give the same components on a quiet and on a loaded machine (issue 17).

Regions, branches and the benefit-vs-cost decision are made on FLOPs and bytes from shapes; the
timing pass only fills ``work_ms`` (and balances stage cuts). The second export runs beside two
processes spinning on both cores, which changes every measured latency.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import hpcsplit
from hpcsplit.switchboard.writer import EXPORT_TIMES_FILE


class Towers(nn.Module):
    """Two MLP towers over two inputs and an interaction term ``(a * b).sum()`` beside them."""

    def __init__(self, d: int = 512, depth: int = 3) -> None:
        super().__init__()
        self.tower_a = nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(d, d), nn.ReLU())))
        self.tower_b = nn.Sequential(*(m for _ in range(depth) for m in (nn.Linear(d, d), nn.ReLU())))
        self.head = nn.Linear(2 * d + 1, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        inter = (a * b).sum(dim=1, keepdim=True)
        return self.head(torch.cat([self.tower_a(a), self.tower_b(b), inter], dim=-1))


def _export(out: Path, **options: str) -> hpcsplit.Switchboard:
    torch.manual_seed(0)
    model = Towers().eval()
    g = torch.Generator().manual_seed(1)
    xs = (torch.randn(32, 512, generator=g), torch.randn(32, 512, generator=g))
    return hpcsplit.export(model, xs, out=out, **options)  # the defaults: measured timing, no force


def _components(sb: hpcsplit.Switchboard) -> list[dict]:
    d = json.loads((sb.path / "layout.json").read_text())
    keep = ("name", "kind", "inputs", "outputs", "param_bytes")
    return [{k: c[k] for k in keep} for c in d["components"]]


def test_export_under_load_gives_the_same_components(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    quiet = _export(tmp_path / "quiet")
    assert list(quiet.order) == ["tower_a", "tower_b", "head"]  # pays: the towers are worth their ranks
    request.getfixturevalue("burner")
    loaded = _export(tmp_path / "loaded")
    assert _components(loaded) == _components(quiet)
    assert loaded.layout.partition["regions"] == quiet.layout.partition["regions"]
    (towers,) = [r for r in quiet.layout.partition["regions"] if r["split"]]
    assert towers["absorbed"] == [["exit", 32 * 512 + 32]]  # (a * b).sum(): FLOPs at the batch of 32
    assert towers["benefit_ms"] > towers["cost_ms"]
    # what the timing pass measured did differ
    assert [c.work_ms for c in loaded.components.values()] != [c.work_ms for c in quiet.components.values()]


def test_the_same_model_exported_twice_is_the_same_switchboard_byte_for_byte(tmp_path: Path) -> None:
    """[Note: programs byte for byte]: every program (the components cut out of the whole graph too) and the
    layout are the same bytes in a second export, so the switchboard's sha256 is the same and a profile or a
    calibration of one applies to the other; no program holds a path of this install."""
    first = _export(tmp_path / "first", cost="flops")
    again = _export(tmp_path / "again", cost="flops")
    assert list(first.order) == ["tower_a", "tower_b", "head"]
    side = {"graph.svg", "graph.png", EXPORT_TIMES_FILE}  # not in the layout: not hashed
    def listing(sb: hpcsplit.Switchboard) -> list[Path]:
        return sorted(p.relative_to(sb.path) for p in sb.path.rglob("*") if p.is_file() and p.name not in side)

    files = listing(first)
    assert files == listing(again) and {f.suffix for f in files} == {".json", ".safetensors", ".pt2"}
    for f in files:
        assert (first.path / f).read_bytes() == (again.path / f).read_bytes(), f
    assert first.sha256 == again.sha256
    times = json.loads((first.path / EXPORT_TIMES_FILE).read_text())
    assert times["export_seconds"] > 0 and "verify_components" in times["phases_s"]
    here = [str(Path(torch.__file__).parent), str(Path(__file__).parent)]
    for prog in (first.path / "programs").iterdir():
        data = prog.read_bytes()
        assert not [h for h in here if h.encode() in data], prog.name
