"""More real model families (issue 32): encoder-decoders, decoder-only language models, vision backbones, a
DETR-style detector, an audio encoder and a model whose inputs are dicts of int64 ids and bool masks, each
split as an expert would, equal to the model at the export batch and at 3x it, and giving the same
components when exported twice, also beside a CPU burner (the slow tier).

The transformers models come from ``model=hf`` (``build_hf``) with tiny configs and ``model.inputs``
derived from the forward's signature. Sequential cuts are asked with ``stages=2`` and the FLOP cost (the
stage cuts then do not depend on the timing pass; [Note: test switchboards]); ``force`` as in the zoo:
the tiny models' stages do not pay, and a test below shows that they stay whole then.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from hpcsplit.switchboard.reader import Switchboard
from tests.zoo import families as F
from tests.zoo.helpers import before, export, inputs, only_holder, parallel, signature

STAGES: dict[str, Any] = {"stages": 2, "cost": "flops"}
SLOW = {"t5", "bart", "whisper", "llama", "swin", "detr", "wav2vec2"}  # 3-8 s an export on two cores


def _fresh(xs: tuple[Any, ...], batch_size: int) -> tuple[Any, ...]:
    """New random inputs like ``xs`` (tensors in dicts too) at ``batch_size``: floats, ids below the largest
    example id + 1, bool masks keeping at least the first position."""
    g = torch.Generator().manual_seed(7)

    def new(t: torch.Tensor) -> torch.Tensor:
        shape = (batch_size, *t.shape[1:])
        if t.dtype.is_floating_point:
            return torch.randn(shape, generator=g, dtype=t.dtype)
        if t.dtype == torch.bool:
            m = torch.rand(shape, generator=g) > 0.3
            m[:, 0] = True
            return m
        return torch.randint(int(t.min()), int(t.max()) + 1, shape, generator=g, dtype=t.dtype)

    return tuple(pytree.tree_map(new, x) for x in xs)


def _same_outputs(sb: Switchboard, model: torch.nn.Module, xs: tuple[Any, ...]) -> None:
    assert sb.layout.verification["passed"]
    b = pytree.tree_leaves(xs)[0].shape[0]
    for x in (xs, _fresh(xs, 3 * b)):
        with torch.no_grad():
            want = model(*x)
        torch.testing.assert_close(sb(*x), want, atol=1e-5, rtol=1e-4)


def _crossing(sb: Switchboard, a: str, b: str) -> list[str]:
    return sorted({e.src_name for e in sb.edges if e.src == a and e.dst == b})


def _seq2seq(source: str, layers: str = "layers") -> Callable[[Switchboard], None]:
    """Encoder, then decoder: two stages, the encoder's output the one tensor crossing between them."""

    def expect(sb: Switchboard) -> None:
        assert sb.order == ("encoder", "decoder") and all(sb.components[c].kind == "stage" for c in sb.order)
        assert only_holder(sb, f"model.encoder.{layers}") == "encoder"
        assert only_holder(sb, f"model.decoder.{layers}") == "decoder"
        assert source in inputs(sb, "encoder") and "decoder_input_ids" not in inputs(sb, "encoder")
        assert "decoder_input_ids" in inputs(sb, "decoder")
        assert len(_crossing(sb, "encoder", "decoder")) == 1  # the encoder's output, once

    return expect


def _blocks_in_order(prefix: str, count: int, stages: int = 2, *, every_stage: bool = True
                     ) -> Callable[[Switchboard], None]:
    """Balanced stages (on FLOPs), each block whole in one stage and blocks in order; with ``every_stage``
    the first block is in the first stage and the last in the last (a backbone's stem may fill a stage)."""

    def expect(sb: Switchboard) -> None:
        assert len(sb.order) == stages and all(sb.components[c].kind == "stage" for c in sb.order)
        assert all(before(sb, a, b) for a, b in zip(sb.order, sb.order[1:], strict=False))
        where = [sb.order.index(only_holder(sb, f"{prefix}.{i}")) for i in range(count)]
        assert where == sorted(where)
        if every_stage:
            assert where[0] == 0 and where[-1] == stages - 1

    return expect


def _detr(sb: Switchboard) -> None:
    """The backbone (a tower from pixel_values) is a stage; encoder, decoder and heads after it."""
    backbone = only_holder(sb, "model.model.backbone")
    assert inputs(sb, backbone) == {"pixel_values"} and sb.order[0] == backbone
    rest = only_holder(sb, "model.model.encoder")
    assert only_holder(sb, "model.model.decoder") == rest == only_holder(sb, "model.bbox_predictor")
    assert "pixel_mask" in inputs(sb, rest) and len(_crossing(sb, backbone, rest)) == 1


def _wav2vec2(sb: Switchboard) -> None:
    """The convolutional feature encoder in the first stage, the transformer layers whole and in order."""
    _blocks_in_order("model.encoder.layers", 4)(sb)
    assert only_holder(sb, "model.feature_extractor") == sb.order[0]


def _retrieval(sb: Switchboard) -> None:
    """Two inputs (dicts of int64 ids and a bool mask) with independent paths: parallel branches."""
    q, d = only_holder(sb, "query"), only_holder(sb, "document")
    assert parallel(sb, q, d) and sb.components[q].kind == sb.components[d].kind == "branch"
    assert inputs(sb, q) == {"query_ids", "query_mask"} and inputs(sb, d) == {"document_ids", "document_mask"}
    dtypes = {t.name: t.dtype for t in sb.layout.inputs}
    assert dtypes == {"query_ids": "int64", "query_mask": "bool", "document_ids": "int64", "document_mask": "bool"}


MORE: dict[str, tuple[Callable[[], Any], Callable[[Switchboard], None], dict[str, Any]]] = {
    "t5": (F.hf_more("t5"), _seq2seq("input_ids", "block"), STAGES),
    "bart": (F.hf_more("bart"), _seq2seq("input_ids"), STAGES),
    "whisper": (F.hf_more("whisper"), _seq2seq("input_features"), STAGES),
    "gpt2": (F.hf_more("gpt2"), _blocks_in_order("model.transformer.h", 2), STAGES),
    "llama": (F.hf_more("llama"), _blocks_in_order("model.model.layers", 4), STAGES),
    "vit": (F.hf_more("vit"), _blocks_in_order("model.vit.layers", 2), STAGES),
    "swin": (F.hf_more("swin"), _blocks_in_order("model.swin.encoder.layers", 2), STAGES),
    "resnet": (F.hf_more("resnet"), _blocks_in_order("model.resnet.encoder.stages", 2, every_stage=False), STAGES),
    "detr": (F.hf_more("detr"), _detr, STAGES),
    "wav2vec2": (F.hf_more("wav2vec2"), _wav2vec2, STAGES),
    "retrieval": (F.retrieval, _retrieval, {}),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in MORE])
def test_family_splits_as_an_expert_would(name: str, tmp_path: Path) -> None:
    build, expect, options = MORE[name]
    model, xs, sb = export(build, tmp_path / "quiet", **options)
    print(f"{name}: {list(sb.order)}")
    expect(sb)
    _same_outputs(sb, model, xs)
    _, _, again = export(build, tmp_path / "again", **options)
    assert signature(again) == signature(sb), "exported twice, the components differ"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MORE))
def test_family_splits_the_same_under_load(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Exported beside two processes spinning on both cores (every measured latency differs): the same
    components, regions and stage cuts (30-60 s a family on two cores: the slow tier)."""
    build, _, options = MORE[name]
    _, _, quiet = export(build, tmp_path / "quiet", **options)
    request.getfixturevalue("burner")
    _, _, loaded = export(build, tmp_path / "loaded", **options)
    assert signature(loaded) == signature(quiet), "exported again under load, the components differ"
    for key in ("regions", "stage_cuts"):
        assert loaded.layout.partition[key] == quiet.layout.partition[key]


def test_decoder_only_stays_whole_when_its_stages_do_not_pay(tmp_path: Path) -> None:
    """Tiny GPT-2 in two stages: each stage's hop costs more than the whole model computes; not forced, it
    stays whole, and the stage table says why."""
    _, _, sb = export(F.hf_more("gpt2"), tmp_path / "sb", force=False, **STAGES)
    assert sb.order == ("model",)
    (cut,) = sb.layout.partition["stage_cuts"]
    assert (cut["requested"], cut["made"]) == (2, 1) and cut["slowest_ms"] >= cut["whole_ms"]
    assert "partition.force=true cuts anyway" in cut["reason"]


def test_without_stages_a_model_with_no_parallel_paths_stays_whole(tmp_path: Path) -> None:
    _, _, sb = export(F.hf_more("gpt2"), tmp_path / "sb")
    assert sb.order == ("model",) and sb.layout.partition["stage_cuts"] == []
