"""Bring your own model (issue 17): ``model=factory`` (the user's function) and ``model=hf`` (any
transformers class), their errors, and one export of each from the composed config."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from hpcsplit.errors import ConfigError, HpcsplitError
from hpcsplit.switchboard.models import MAX_TEXT_LEN, build_factory, build_hf, hf_text_length
from hpcsplit.switchboard.stage import FactoryModelSettings, HFModelSettings, model_settings, run_export

ROOT = Path(__file__).resolve().parents[2]

USER_MODULE = '''
import torch
from torch import nn

def build(width=8, batch_size=2):
    return nn.Linear(4, width).eval(), torch.randn(batch_size, 4)

def keyword_inputs():
    class M(nn.Module):
        def forward(self, a, b):
            return a + b
    return M(), {"a": torch.randn(2, 3), "b": torch.randn(2, 3)}

class Iface:
    def model(self):
        return nn.Linear(4, 2)
    def example_inputs(self, batch_size):
        return (torch.randn(batch_size, 4),)

NOT_CALLABLE = 3
def returns_int():
    return 3
def returns_no_module():
    return "model", torch.randn(2, 4)
def returns_bad_inputs():
    return nn.Linear(4, 2), [1, 2]
def raises():
    raise RuntimeError("no GPU here")
'''


@pytest.fixture
def user_pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pkg = tmp_path / "userpkg_17"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(textwrap.dedent(USER_MODULE))
    (pkg / "broken.py").write_text("import this_module_does_not_exist_17\n")
    (pkg / "typo.py").write_text("def build(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "userpkg_17"


def test_factory_forms(user_pkg: str) -> None:
    model, args, kw = build_factory(f"{user_pkg}.models:build", {"width": 5}, batch_size=3)
    assert isinstance(model, torch.nn.Linear) and model.out_features == 5 and not model.training
    assert args[0].shape == (3, 4) and kw == {}  # batch_size= passed since build takes it
    model, args, kw = build_factory(f"{user_pkg}.models:keyword_inputs")
    assert args == () and set(kw) == {"a", "b"}
    model, args, kw = build_factory(f"{user_pkg}.models:Iface", batch_size=4)
    assert args[0].shape == (4, 4)


@pytest.mark.parametrize(
    ("target", "kwargs", "says"),
    [
        ("userpkg_17.models.build", {}, "needed 'package.module:function'"),
        ("no_such_pkg_17.models:build", {}, "found no module 'no_such_pkg_17' on the Python path"),
        ("userpkg_17.nothing:build", {}, "found no module 'userpkg_17.nothing'"),
        ("userpkg_17.broken:build", {}, "importing userpkg_17.broken failed: No module named 'this_module"),
        ("userpkg_17.typo:build", {}, "importing userpkg_17.typo raised SyntaxError"),
        ("userpkg_17.models:buidl", {}, "has no 'buidl'; its callables: Iface, build,"),
        ("userpkg_17.models:NOT_CALLABLE", {}, "is a int, not a function"),
        ("userpkg_17.models:build", {"depth": 3}, "takes (width=8, batch_size=2); model.kwargs={'depth': 3}"),
        ("userpkg_17.models:returns_int", {}, "returned a int; needed (model, example_inputs) or an object"),
        ("userpkg_17.models:returns_no_module", {}, "gave a model that is a str; needed a torch.nn.Module"),
        ("userpkg_17.models:returns_bad_inputs", {}, "gave example inputs that are a list of 2 (int, int)"),
        ("userpkg_17.models:raises", {}, "calling it raised RuntimeError: no GPU here"),
    ],
)
def test_factory_errors_name_the_target(user_pkg: str, target: str, kwargs: dict, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_factory(target, kwargs)
    assert isinstance(e.value, HpcsplitError)
    assert target in str(e.value) and says in str(e.value), str(e.value)


def test_factory_config_needs_a_target(compose: Any) -> None:
    with pytest.raises(ConfigError, match=r"model.target = '\?\?\?': needs 'package.module:function'"):
        model_settings(compose("model=factory"))
    ms = model_settings(compose("model=factory", "model.target=examples.custom.model:build",
                                "model.kwargs={hidden: 32}", "model.batch_size=3"))
    assert isinstance(ms, FactoryModelSettings) and ms.kwargs == {"hidden": 32}


def test_export_stage_takes_the_example_custom_model(compose: Any, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # examples/ is importable from the repository root (pytest's root, as `python -m` from there)
    cfg = compose("model=factory", "model.target=examples.custom.model:build", "model.kwargs={hidden: 32}",
                  "partition.force=true", "partition.timing_repeats=1")
    out = run_export(cfg, tmp_path / "run")
    assert out["model"] == "TwoTowerRanker" and out["verification"]["passed"]
    assert {"query_tower", "doc_tower"} <= set(out["components"]), out["components"]
    assert "TwoTowerRanker" in capsys.readouterr().out


# ----------------------------------------------------------------------------- hf

transformers = pytest.importorskip("transformers")

TINY = {"text_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                        "num_attention_heads": 2, "vocab_size": 64, "max_position_embeddings": 12},
        "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 16, "patch_size": 8}}


def test_hf_builds_from_a_config_with_inputs_from_it() -> None:
    model, args = build_hf("SiglipModel", config=TINY, inputs=["pixel_values", "input_ids"],
                           outputs=["logits_per_image"], batch_size=3, seq_len=5)
    assert [tuple(a.shape) for a in args] == [(3, 3, 16, 16), (3, 5)]
    assert int(args[1].max()) < 64
    with torch.no_grad():
        out = model(*args)
    assert list(out) == ["logits_per_image"] and out["logits_per_image"].shape == (3, 3)
    import inspect

    assert list(inspect.signature(model.forward).parameters) == ["pixel_values", "input_ids"]


def _text(positions: int) -> dict[str, Any]:
    return {"text_config": {**TINY["text_config"], "max_position_embeddings": positions},
            "vision_config": TINY["vision_config"]}


def test_hf_text_length_defaults_to_the_models_context() -> None:
    # CLIP and SigLIP: every position takes a token (CLIP's 77, SigLIP's 64 at full size)
    for cls in ("CLIPModel", "SiglipModel"):
        _, (_, ids) = build_hf(cls, config=_text(12), inputs=["pixel_values", "input_ids"], batch_size=2)
        assert tuple(ids.shape) == (2, 12), cls
    # CLAP's text tower is RoBERTa-style: positions start after padding_idx (1), so 2 fewer tokens fit
    from tests.zoo.families import HF

    clap = HF["clap"][1]
    assert clap["text_config"]["max_position_embeddings"] == 18
    model, (_, ids) = build_hf("ClapModel", config=clap, inputs=["input_features", "input_ids"], batch_size=2)
    assert tuple(ids.shape) == (2, 16) and hf_text_length(model.model) == 16
    # a long context is capped; model.seq_len wins over the default
    _, (_, ids) = build_hf("CLIPModel", config=_text(MAX_TEXT_LEN + 88), inputs=["pixel_values", "input_ids"])
    assert ids.shape[1] == MAX_TEXT_LEN
    _, (_, ids) = build_hf("CLIPModel", config=_text(12), inputs=["pixel_values", "input_ids"], seq_len=7)
    assert ids.shape[1] == 7


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"cls": "SiglipModle"}, "found model.cls='SiglipModle'; needed a model class of transformers"),
        ({"cls": "SiglipConfig"}, "needed a model class of transformers"),
        ({"inputs": ["pixel_values", "image_ids"]}, ("(image_ids unknown); SiglipModel.forward takes input_ids, "
                                                    "pixel_values, attention_mask, position_ids")),
        ({"outputs": ["logits"]}, ("found model.outputs=['logits'] (logits not a tensor output); SiglipModel "
                                  "returns the tensors logits_per_image, logits_per_text, text_embeds")),
        ({"outputs": ["vision_model_output"]}, "(and text_model_output, vision_model_output, which are not"),
        ({"config": {"text_config": {"hidden_size": 15}}}, "SiglipConfig / SiglipModel refused it"),
        ({"checkpoint": "/nonexistent/17", "config": {}}, "needed a local directory (nothing is downloaded)"),
        ({"checkpoint": "/tmp", "config": TINY}, "found both model.checkpoint and model.config"),
    ],
)
def test_hf_errors_list_what_exists(kwargs: dict[str, Any], says: str) -> None:
    args: dict[str, Any] = {"cls": "SiglipModel", "config": TINY, "inputs": ["pixel_values", "input_ids"],
                            "outputs": None, **kwargs}
    with pytest.raises(ConfigError) as e:
        build_hf(args.pop("cls"), **args)
    assert says in str(e.value), str(e.value)


def test_hf_close_class_names_are_offered() -> None:
    with pytest.raises(ConfigError, match="close: .*SiglipModel"):
        build_hf("SiglipModle", inputs=["pixel_values"])


def test_hf_input_without_example_maker() -> None:
    from hpcsplit.switchboard.models import hf_example_inputs

    config = transformers.CLIPConfig(text_config=TINY["text_config"], vision_config=TINY["vision_config"])
    with pytest.raises(ConfigError, match="'cache_position'; hpcsplit makes example inputs for pixel_values, "
                                          "input_ids.*write a factory"):
        hf_example_inputs(config, ["pixel_values", "cache_position"])


def test_hf_local_checkpoint(tmp_path: Path, compose: Any) -> None:
    model, args = build_hf("CLIPModel", config=TINY, inputs=["pixel_values", "input_ids"],
                           outputs=["logits_per_image"])
    model.model.save_pretrained(tmp_path / "ckpt")
    cfg = compose("model=hf", "model.cls=CLIPModel", f"model.checkpoint={tmp_path / 'ckpt'}",
                  "model.inputs=[pixel_values,input_ids]", "model.outputs=[logits_per_image]")
    ms = model_settings(cfg)
    assert isinstance(ms, HFModelSettings) and ms.name == "CLIPModel"
    loaded, args2, _ = ms.build()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args)["logits_per_image"], model(*args)["logits_per_image"])
    assert [a.shape for a in args2] == [a.shape for a in args]


def test_hf_config_problems_listed_together(compose: Any) -> None:
    with pytest.raises(ConfigError) as e:
        model_settings(compose("model=hf", "model.inputs=[1]", "model.outputs=[1]"))
    msg = str(e.value)
    assert "model.cls = '???': needs a transformers model class" in msg
    assert "model.inputs = [1]: needs a non-empty list of distinct names" in msg
    assert "model.outputs = [1]" in msg


def test_hf_inputs_come_from_the_forward_and_the_config(compose: Any) -> None:
    """model.inputs null: the forward's ids/pixels/features/values (decoder ids for an encoder-decoder) with
    their masks, in the forward's order; the example decoder ids take the decoder's own context."""
    from hpcsplit.switchboard.models import hf_default_inputs

    cfg = compose("model=hf", "model.cls=WhisperModel",
                  "model.config={vocab_size: 64, d_model: 16, encoder_layers: 1, decoder_layers: 1, "
                  "encoder_attention_heads: 2, decoder_attention_heads: 2, encoder_ffn_dim: 32, decoder_ffn_dim: 32, "
                  "num_mel_bins: 8, max_source_positions: 16, max_target_positions: 6, pad_token_id: 0, "
                  "bos_token_id: 1, eos_token_id: 2, decoder_start_token_id: 3}")
    ms = model_settings(cfg)
    assert isinstance(ms, HFModelSettings) and ms.inputs is None
    model, args, _ = ms.build()
    assert model.input_names == ("input_features", "decoder_input_ids")
    assert [tuple(a.shape) for a in args] == [(2, 8, 32), (2, 6)]
    assert not model.model.config.use_cache  # export-friendly: no key/value cache
    import transformers as tf

    assert hf_default_inputs(tf.GPT2LMHeadModel, tf.GPT2Config()) == ["input_ids", "attention_mask"]
    assert hf_default_inputs(tf.DetrForObjectDetection, tf.DetrConfig()) == ["pixel_values", "pixel_mask"]
    assert hf_default_inputs(tf.Wav2Vec2Model, tf.Wav2Vec2Config()) == ["input_values"]
    assert hf_default_inputs(tf.BertModel, tf.BertConfig()) == ["input_ids", "attention_mask"]


def test_hf_without_inputs_it_can_make_says_so() -> None:
    with pytest.raises(ConfigError, match=r"found no model.inputs, and .* set model.inputs"):
        build_hf("TimeSeriesTransformerModel", config={"prediction_length": 4, "context_length": 4})
