"""Comparing a switchboard's outputs with a reference, and tiling example tensors to a batch size.

Both sides of a switchboard use these: the writer (:func:`hpcsplit.switchboard.writer.export`) checks
the whole-model program against the eager model's golden outputs, and the reader
(:meth:`hpcsplit.switchboard.reader.Switchboard.verify`) checks the components.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Comparison", "VerifyReport", "compare_outputs", "tile_batch"]


@dataclass(frozen=True, slots=True)
class Comparison:
    """How far ``got`` is from ``ref`` (see :func:`compare_outputs`)."""

    max_abs_diff: float
    max_rel_diff: float
    passed: bool


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Split components against a reference on the same inputs."""

    batch_size: int
    max_abs_diff: float
    max_rel_diff: float
    atol: float
    rtol: float
    passed: bool
    reference: str  # "golden" (the eager model's outputs) or "whole" (the unsplit program)
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "max_abs_diff": self.max_abs_diff,
            "max_rel_diff": self.max_rel_diff,
            "atol": self.atol,
            "rtol": self.rtol,
            "passed": self.passed,
            "reference": self.reference,
            "seconds": self.seconds,
        }


def compare_outputs(
    got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], atol: float, rtol: float
) -> Comparison:
    """Compare outputs elementwise: passed when every ``|got - ref| <= atol + rtol * |ref|``.

    Tensors of another shape or dtype fail with infinite differences; integer tensors must be equal.
    The relative difference is taken where ``|ref| > atol``.

    Examples
    --------
    >>> c = compare_outputs([torch.tensor([1.0, 2.0])], [torch.tensor([1.0, 2.1])], 1e-5, 1e-4)
    >>> round(c.max_abs_diff, 3), c.passed
    (0.1, False)
    >>> compare_outputs([torch.ones(2)], [torch.ones(3)], 1e-5, 1e-4).passed
    False
    """
    max_abs = max_rel = 0.0
    ok = True
    for a, b in zip(got, ref, strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return Comparison(float("inf"), float("inf"), False)
        if not a.is_floating_point():
            same = bool(torch.equal(a, b))
            ok &= same
            max_abs = max(max_abs, 0.0 if same else float("inf"))
            continue
        a, b = a.detach().double(), b.detach().double()
        d = (a - b).abs()
        if d.numel():
            max_abs = max(max_abs, float(d.max()))
            big = b.abs() > atol
            if bool(big.any()):
                max_rel = max(max_rel, float((d[big] / b.abs()[big]).max()))
            ok &= bool((d <= atol + rtol * b.abs()).all())
    return Comparison(max_abs, max_rel, ok)


def tile_batch(t: torch.Tensor, dims: Sequence[int], batch_size: int) -> torch.Tensor:
    """Repeat ``t`` along each of its batch ``dims`` and cut it to ``batch_size`` there (contiguous).

    Examples
    --------
    >>> tile_batch(torch.tensor([[1], [2]]), (0,), 3).tolist()
    [[1], [2], [1]]
    """
    for d in dims:
        n = t.shape[d]
        if n == batch_size:
            continue
        reps = [1] * t.dim()
        reps[d] = -(-batch_size // n)
        t = t.repeat(*reps).narrow(d, 0, batch_size)
    return t.contiguous()
