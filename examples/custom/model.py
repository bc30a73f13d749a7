"""A user's own model, in its own module: a two-tower ranker (query tower, document tower, a score).

hpcsplit imports it from the command line (run from the repository root, which holds ``examples/``)::

    python -m hpcsplit stage=export model=factory model.target=examples.custom.model:build
    python -m hpcsplit stage=export model=factory model.target=examples.custom.model:build \\
        'model.kwargs={hidden: 512, layers: 4}'

``build`` returns the model and example inputs; ``Ranker`` (below) shows the other form a target may
take: an object with ``model()`` and ``example_inputs(batch_size)``.
"""

from __future__ import annotations

import torch
from torch import nn


class Tower(nn.Module):
    """Embedding-free MLP tower: features -> a unit-length vector."""

    def __init__(self, d_in: int, hidden: int, d_out: int, layers: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        d = d_in
        for _ in range(layers):
            blocks += [nn.Linear(d, hidden), nn.GELU()]
            d = hidden
        blocks.append(nn.Linear(d, d_out))
        self.net = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.net(x), dim=-1)


class TwoTowerRanker(nn.Module):
    """score(query, doc) = <query_tower(query), doc_tower(doc)> * scale."""

    def __init__(self, d_query: int = 64, d_doc: int = 96, hidden: int = 256, d_out: int = 32,
                 layers: int = 3) -> None:
        super().__init__()
        self.query_tower = Tower(d_query, hidden, d_out, layers)
        self.doc_tower = Tower(d_doc, hidden, d_out, layers)
        self.scale = nn.Parameter(torch.tensor(10.0))

    def forward(self, query: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        return (self.query_tower(query) * self.doc_tower(doc)).sum(dim=-1) * self.scale


def example_inputs(model: TwoTowerRanker, batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A random query and document batch."""
    q_in = model.query_tower.net[0].in_features
    d_in = model.doc_tower.net[0].in_features
    return torch.randn(batch_size, q_in), torch.randn(batch_size, d_in)


def build(hidden: int = 256, layers: int = 3, batch_size: int = 2) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The target of ``model.target=examples.custom.model:build``: ``(model, example_inputs)``."""
    model = TwoTowerRanker(hidden=hidden, layers=layers).eval()
    return model, example_inputs(model, batch_size)


class Ranker:
    """The other form: ``model.target=examples.custom.model:Ranker`` (the class is the callable, its
    instance has ``model()`` and ``example_inputs(batch_size)``)."""

    def __init__(self, hidden: int = 256) -> None:
        self._model = TwoTowerRanker(hidden=hidden).eval()

    def model(self) -> nn.Module:
        return self._model

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return example_inputs(self._model, batch_size)
