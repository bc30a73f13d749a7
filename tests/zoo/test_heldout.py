"""The zoo's held-out set (issue 17: "fix the causes, not the cases"): models whose expected splits the
partition's authors did not tune against. Same checks as test_zoo.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hpcsplit.switchboard.reader import Switchboard
from tests.zoo.families import B, Tower, mlp
from tests.zoo.helpers import before, check_outputs, export, holders, inputs, only_holder, parallel, signature

pytestmark = pytest.mark.slow


class MultiTask(nn.Module):
    """A shared trunk, then three task heads."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.trunk = Tower(d)
        self.heads = nn.ModuleList(mlp(d, 256, k, depth=3) for k in (3, 5, 7))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.trunk(x)
        return tuple(head(h) for head in self.heads)


class Siamese(nn.Module):
    """One encoder (shared weights) on two inputs, then a classifier on |e1 - e2|."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.encoder = Tower(d)
        self.classifier = mlp(d, 64, 2, depth=2)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.classifier((self.encoder(a) - self.encoder(b)).abs())


class DenseMoE(nn.Module):
    """Four experts on the input, mixed by a softmax gate (a tiny branch beside them)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.experts = nn.ModuleList(mlp(d, 256, d, depth=3) for _ in range(4))
        self.gate = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.gate(x), dim=-1)
        out = torch.stack([e(x) for e in self.experts], dim=-1)
        return (out * w.unsqueeze(1)).sum(dim=-1)


def _multitask(sb: Switchboard) -> None:
    trunk = only_holder(sb, "trunk")
    heads = [only_holder(sb, f"heads.{i}") for i in range(3)]
    assert parallel(sb, *heads) and all(before(sb, trunk, h) for h in heads)


def _siamese(sb: Switchboard) -> None:
    enc = holders(sb, "encoder")
    assert len(enc) == 2 and parallel(sb, *enc)  # the shared weights are copied into both
    assert sorted(inputs(sb, c).pop() for c in enc) == ["a", "b"]
    cls = only_holder(sb, "classifier")
    assert all(before(sb, c, cls) for c in enc)


def _moe(sb: Switchboard) -> None:
    experts = [only_holder(sb, f"experts.{i}") for i in range(4)]
    assert parallel(sb, *experts)
    gate = only_holder(sb, "gate")  # the tiny gate joins an expert or the entry/exit: no branch of its own
    assert gate in experts or sb.components[gate].kind != "branch"


HELD_OUT = {
    "multitask": (lambda: (MultiTask().eval(), (torch.randn(B, 8, 64),)), _multitask),
    "siamese": (lambda: (Siamese().eval(), (torch.randn(B, 8, 64), torch.randn(B, 8, 64))), _siamese),
    "dense_moe": (lambda: (DenseMoE().eval(), (torch.randn(B, 64),)), _moe),
}


@pytest.mark.parametrize("name", list(HELD_OUT))
def test_held_out_model_splits_as_expected(name: str, tmp_path: Path) -> None:
    build, expect = HELD_OUT[name]
    model, xs, sb = export(build, tmp_path / "a")
    print(f"{name}: {list(sb.order)}")
    expect(sb)
    check_outputs(sb, model, xs)
    _, _, again = export(build, tmp_path / "b")
    assert signature(again) == signature(sb), "exported twice, the components differ"
