"""Export CLIP (tiny config; full ViT-B/32 in a slow test): image tower, text tower, join."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import hpcsplit
from hpcsplit.switchboard.models import build_clip, example_inputs
from hpcsplit.switchboard.reader import Switchboard


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return build_clip("tiny")


@pytest.fixture(scope="module")
def sb(tiny: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Switchboard:
    out = tmp_path_factory.mktemp("clip") / "switchboard"
    return hpcsplit.export(
        tiny, example_inputs("clip_tiny", 2, model=tiny), out=out, cost="flops", timing_repeats=1, force=True
    )


def test_clip_splits_into_towers_and_join(sb: Switchboard) -> None:
    assert list(sb.order) == ["vision_model", "text_model", "head"]
    assert [t.name for t in sb.components["vision_model"].inputs] == ["pixel_values"]
    assert [t.name for t in sb.components["text_model"].inputs] == ["input_ids", "attention_mask"]
    srcs = {e.src for e in sb.edges if e.dst == "head"}
    assert srcs == {"vision_model", "text_model"}
    assert sb.components["vision_model"].param_bytes > sb.components["head"].param_bytes


@pytest.mark.parametrize("batch_size", [2, 3])
def test_clip_reproduces_the_model(sb: Switchboard, tiny: torch.nn.Module, batch_size: int) -> None:
    xs = example_inputs("clip_tiny", batch_size, model=tiny, seed=7)
    with torch.no_grad():
        want = tiny(*xs)
    got = sb(*xs)
    assert got.shape == (batch_size, batch_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_clip_component_inputs_tile_every_batch_dim(sb: Switchboard) -> None:
    ex = sb.component_example_inputs(5)
    assert tuple(ex["vision_model"][0].shape) == (5, 3, 32, 32)
    shapes = [tuple(t.shape) for t in ex["head"]]
    assert all(5 in s for s in shapes)
    (out,) = sb.load_component("head")(*ex["head"])
    assert tuple(out.shape) == (5, 5)


def test_clip_output_structure_is_restored(tmp_path: Path) -> None:
    model = build_clip("tiny", both_logits=True)
    xs = example_inputs("clip_tiny", 2, model=model)
    sb = hpcsplit.export(model, xs, out=tmp_path / "sb", cost="flops", timing_repeats=1, force=True)
    got = sb(*xs)
    assert isinstance(got, tuple) and len(got) == 2
    with torch.no_grad():
        want = model(*xs)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert [t.name for t in sb.layout.outputs] == ["output_0", "output_1"]


def test_raw_clip_model_with_keyword_inputs(tiny: torch.nn.Module, tmp_path: Path) -> None:
    # kwargs in, a transformers ModelOutput out: the switchboard takes and returns the same
    clip = tiny.clip
    pv, ids, am = example_inputs("clip_tiny", 2, model=tiny)
    kw = {"pixel_values": pv, "input_ids": ids, "attention_mask": am}
    sb = hpcsplit.export(clip, (), kw, out=tmp_path / "sb", cost="flops", timing_repeats=1, force=True)
    assert list(sb.order) == ["vision_model", "text_model", "head"]
    got = sb(**kw)
    with torch.no_grad():
        want = clip(**kw)
    assert type(got) is type(want)
    torch.testing.assert_close(got.logits_per_image, want.logits_per_image)
    torch.testing.assert_close(got.text_embeds, want.text_embeds)


def test_clip_towers_cut_into_stages(tiny: torch.nn.Module, tmp_path: Path) -> None:
    # cuts inside the towers: pieces recompute the symbolic batch from their own inputs
    xs = example_inputs("clip_tiny", 2, model=tiny)
    sb = hpcsplit.export(tiny, xs, out=tmp_path / "sb", stages=3, cost="flops", timing_repeats=1, force=True)
    vision = [n for n in sb.order if n.startswith("vision_model")]
    assert vision == ["vision_model_0", "vision_model_1", "vision_model_2"]
    assert all(sb.components[n].kind == "stage" for n in vision)
    mid = sb.components["vision_model_1"]
    assert [t.shape[0] for t in mid.inputs] == ["batch"] * len(mid.inputs)
    assert "pixel_values" not in [t.name for t in mid.inputs]
    x3 = example_inputs("clip_tiny", 3, model=tiny, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(sb(*x3), tiny(*x3), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_full_vit_b32_clip_export_and_verify(tmp_path: Path) -> None:
    model = build_clip("base")
    xs = example_inputs("clip", 2, model=model)
    t0 = time.perf_counter()
    sb = hpcsplit.export(model, xs, out=tmp_path / "sb")
    seconds = time.perf_counter() - t0
    assert list(sb.order) == ["vision_model", "text_model", "head"]
    assert sb.layout.verification["passed"]
    print(f"ViT-B/32 CLIP export + verification: {seconds:.1f} s")
