"""The zoo's models (issue 17): tiny members of model families hpcsplit does not ship, each with the
split it should get. Every builder returns ``(model, example_inputs)`` at batch 2 with seeded weights.

The transformers dual encoders are built through ``model=hf`` (:func:`hpcsplit.switchboard.models.build_hf`)
from tiny configs: nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

B = 2  # the export batch

# ----------------------------------------------------------------------------- dual encoders

TEXT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "vocab_size": 128, "max_position_embeddings": 16}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "image_size": 32, "patch_size": 8}

HF: dict[str, tuple[str, dict[str, Any], list[str], list[str]]] = {
    # name: (class, config, inputs, outputs)
    "clip": ("CLIPModel", {"text_config": TEXT, "vision_config": VISION, "projection_dim": 16},
             ["pixel_values", "input_ids"], ["logits_per_image"]),
    "siglip": ("SiglipModel", {"text_config": TEXT, "vision_config": VISION},
               ["pixel_values", "input_ids"], ["logits_per_image"]),
    "clap": ("ClapModel", {
        "text_config": {**TEXT, "max_position_embeddings": 18},
        "audio_config": {"spec_size": 32, "num_mel_bins": 8, "hidden_size": 32, "depths": [1, 1],
                         "num_attention_heads": [2, 2], "patch_embeds_hidden_size": 16, "window_size": 4,
                         "projection_hidden_size": 32},
        "projection_dim": 16}, ["input_features", "input_ids"], ["logits_per_audio"]),
    "chinese_clip": ("ChineseCLIPModel", {"text_config": TEXT, "vision_config": VISION, "projection_dim": 16},
                     ["pixel_values", "input_ids"], ["logits_per_image"]),
}


def hf(name: str) -> Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        from hpcsplit.switchboard.models import build_hf

        cls, config, inputs, outputs = HF[name]
        return build_hf(cls, config=config, inputs=inputs, outputs=outputs, batch_size=B)

    return build


# ----------------------------------------------------------------------------- small pieces


def mlp(d_in: int, d_hidden: int, d_out: int, depth: int = 2) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(depth - 1):
        layers += [nn.Linear(d, d_hidden), nn.ReLU()]
        d = d_hidden
    layers.append(nn.Linear(d, d_out))
    return nn.Sequential(*layers)


class Tower(nn.Module):
    """A small transformer encoder tower on ``[batch, tokens, d]``, mean-pooled."""

    def __init__(self, d: int = 64, layers: int = 1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x.mean(dim=1)


# ----------------------------------------------------------------------------- families


class Inception(nn.Module):
    """Stem conv, then an inception block: 1x1 | 1x1->3x3 | 1x1->5x5 | maxpool->1x1, concatenated."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU())
        self.b1 = nn.Sequential(nn.Conv2d(c, 2 * c, 1), nn.ReLU(), nn.Conv2d(2 * c, c, 3, padding=1), nn.ReLU())
        self.b3 = nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU())
        self.b5 = nn.Sequential(nn.Conv2d(c, c // 2, 1), nn.ReLU(), nn.Conv2d(c // 2, c, 5, padding=2), nn.ReLU())
        self.bpool = nn.Sequential(nn.MaxPool2d(3, 1, padding=1), nn.Conv2d(c, c, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.Conv2d(4 * c, c, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                  nn.Linear(c, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stem(x)
        return self.head(torch.cat([self.b1(s), self.b3(s), self.b5(s), self.bpool(s)], dim=1))


def inception() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Inception().eval(), (torch.randn(B, 3, 16, 16),)


class Ensemble(nn.Module):
    """Three independent MLP members on the same input, averaged."""

    def __init__(self, d: int = 64, members: int = 3) -> None:
        super().__init__()
        self.members = nn.ModuleList(mlp(d, 256, 10, depth=3) for _ in range(members))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.members]).mean(dim=0)


def ensemble() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Ensemble().eval(), (torch.randn(B, 64),)


class DLRM(nn.Module):
    """DLRM-like recommender: dense features through a bottom MLP; three sparse ids through embedding
    tables, each pooled vector projected by a small MLP; pairwise dot products of the four vectors (the
    interaction); then a top MLP on the bottom output and the interactions."""

    def __init__(self, d_dense: int = 16, d: int = 32, tables: int = 3, rows: int = 100) -> None:
        super().__init__()
        self.bottom_mlp = mlp(d_dense, 256, d, depth=3)
        self.embeddings = nn.ModuleList(nn.EmbeddingBag(rows, d, mode="mean") for _ in range(tables))
        self.projections = nn.ModuleList(mlp(d, 256, d, depth=3) for _ in range(tables))
        n = tables + 1
        self.top_mlp = mlp(d + n * (n - 1) // 2, 256, 1, depth=3)
        self.register_buffer("pairs", torch.triu_indices(n, n, offset=1), persistent=False)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom_mlp(dense)
        sp = [p(e(sparse[:, i])) for i, (e, p) in enumerate(zip(self.embeddings, self.projections, strict=True))]
        vecs = torch.stack([x, *sp], dim=1)
        inter = torch.bmm(vecs, vecs.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return torch.sigmoid(self.top_mlp(torch.cat([x, inter], dim=1)))


def dlrm() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return DLRM().eval(), (torch.randn(B, 16, generator=g), torch.randint(0, 100, (B, 3, 4), generator=g))


class SkipTowers(nn.Module):
    """Two towers side by side; the input also skips past both straight to the head."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.tower_a = Tower(d)
        self.tower_b = Tower(d)
        self.head = nn.Linear(3 * d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embed(x)
        return self.head(torch.cat([self.tower_a(e), self.tower_b(e), x.mean(dim=1)], dim=-1))


def skip_towers() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return SkipTowers().eval(), (torch.randn(B, 8, 64),)


class AttnPoolTower(nn.Module):
    """A vision-style tower whose head pools with ``nn.MultiheadAttention``: its averaged attention
    weights are returned beside the output and never used (a dead end)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.tower = Tower(d)
        self.query = nn.Parameter(torch.randn(1, 1, d))
        self.pool = nn.MultiheadAttention(d, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for blk in self.tower.blocks:
            h = blk(h)
        pooled, _weights = self.pool(self.query.expand(x.shape[0], -1, -1), h, h)
        return pooled[:, 0]


class DeadEnd(nn.Module):
    """Image and text towers, the image one with an attention-pooling head (a dead end inside)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.image = AttnPoolTower(d)
        self.text = Tower(d)
        self.head = nn.Linear(d, 10)

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        return self.head(self.image(img) * self.text(txt))


def dead_end() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return DeadEnd().eval(), (torch.randn(B, 8, 64), torch.randn(B, 6, 64))


class Nested(nn.Module):
    """Two towers side by side, one of which forks inside into two sub-towers of its own."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.left = nn.ModuleDict({"pre": Tower(d, 1), "deep": mlp(d, 512, d, 3), "wide": mlp(d, 512, d, 3)})
        self.right = Tower(d, 3)
        self.head = nn.Linear(2 * d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.left["pre"](x)
        left = self.left["deep"](h) + self.left["wide"](h)
        return self.head(torch.cat([left, self.right(x)], dim=-1))


def nested() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Nested().eval(), (torch.randn(B, 8, 64),)


class Chain(nn.Module):
    """A long chain of residual MLP blocks (no branches): cut into stages with ``stages=``."""

    def __init__(self, d: int = 64, blocks: int = 12) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(mlp(d, 2 * d, d, 2) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return x


def chain() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Chain().eval(), (torch.randn(B, 64),)


class Interaction(nn.Module):
    """Two towers and an interaction term ``(a * b).sum()`` of their inputs beside them."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.tower_a = Tower(d)
        self.tower_b = Tower(d)
        self.head = nn.Linear(2 * d + 1, 1)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        inter = (a * b).sum(dim=(1, 2)).unsqueeze(-1)
        return self.head(torch.cat([self.tower_a(a), self.tower_b(b), inter], dim=-1))


def interaction() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Interaction().eval(), (torch.randn(B, 8, 64), torch.randn(B, 8, 64))


# ----------------------------------------------------------------------------- issue 32: more families
# Built through model=hf with model.inputs derived from the forward's signature (hf_default_inputs), tiny
# configs: two layers, hidden size 32. Nothing is downloaded.

TINY_TF = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
SEQ2SEQ = {"vocab_size": 128, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
           "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}
TINY_RESNET = {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "layer_type": "basic"}
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

HF_MORE: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    # name: (class, config, outputs); inputs: derived from the class's forward and the config
    "t5": ("T5Model", {"vocab_size": 128, "d_model": 32, "d_kv": 16, "d_ff": 64, "num_layers": 2,
                       "num_decoder_layers": 2, "num_heads": 2, "relative_attention_num_buckets": 8},
           ["last_hidden_state"]),
    "bart": ("BartModel", {**SEQ2SEQ, "max_position_embeddings": 32}, ["last_hidden_state"]),
    "whisper": ("WhisperModel", {**SEQ2SEQ, **TOKENS, "decoder_start_token_id": 3, "num_mel_bins": 8,
                                 "max_source_positions": 16, "max_target_positions": 16}, ["last_hidden_state"]),
    "gpt2": ("GPT2LMHeadModel", {"vocab_size": 128, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 16,
                                 **TOKENS}, ["logits"]),
    # four layers: with two, the last layer's attention is where the fewest bytes cross (the mask and the
    # rotary tables are dead after it), and the lm_head puts the FLOP midpoint there
    "llama": ("LlamaForCausalLM", {**TINY_TF, "num_hidden_layers": 4, "vocab_size": 128, "num_key_value_heads": 1,
                                   "max_position_embeddings": 16, **TOKENS}, ["logits"]),
    "vit": ("ViTForImageClassification", {**TINY_TF, "image_size": 32, "patch_size": 8, "num_labels": 10},
            ["logits"]),
    "swin": ("SwinForImageClassification", {"image_size": 32, "patch_size": 4, "embed_dim": 16, "depths": [1, 1],
                                            "num_heads": [1, 2], "window_size": 4, "num_labels": 10}, ["logits"]),
    "resnet": ("ResNetForImageClassification", {**TINY_RESNET, "num_labels": 10}, ["logits"]),
    "detr": ("DetrForObjectDetection", {
        "use_timm_backbone": False, "use_pretrained_backbone": False,
        "backbone_config": {"model_type": "resnet", **TINY_RESNET, "out_features": ["stage2"]},
        "d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "num_queries": 8,
        "num_labels": 5}, ["logits", "pred_boxes"]),
    "wav2vec2": ("Wav2Vec2Model", {**TINY_TF, "num_hidden_layers": 4, "conv_dim": [16, 16], "conv_stride": [5, 4], "conv_kernel": [10, 4],
                                   "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2},
                 ["last_hidden_state"]),
}


def hf_more(name: str) -> Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        from hpcsplit.switchboard.models import build_hf

        cls, config, outputs = HF_MORE[name]
        return build_hf(cls, config=config, outputs=outputs, batch_size=B)

    return build


class TokenTower(nn.Module):
    """Embeds int64 ids, runs a transformer layer that ignores the padding (a bool mask), mean-pools the
    tokens the mask keeps."""

    def __init__(self, vocab: int = 100, d: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.block = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(ids), src_key_padding_mask=~mask)
        keep = mask.unsqueeze(-1).to(h.dtype)
        return (h * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)


class Retrieval(nn.Module):
    """A query tower and a document tower, each fed a dict of int64 ids and a bool mask; their score."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.query = TokenTower(d=d)
        self.document = TokenTower(d=d)
        self.scale = nn.Parameter(torch.tensor(10.0))

    def forward(self, query: dict[str, torch.Tensor], document: dict[str, torch.Tensor]) -> torch.Tensor:
        q = self.query(query["ids"], query["mask"])
        d = self.document(document["ids"], document["mask"])
        return self.scale * torch.nn.functional.cosine_similarity(q, d, dim=-1)


def _tokens(g: torch.Generator, n: int) -> dict[str, torch.Tensor]:
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[0, n // 2:] = False  # the first sample is padded
    return {"ids": torch.randint(1, 100, (B, n), generator=g), "mask": mask}


def retrieval() -> tuple[nn.Module, tuple[Any, ...]]:
    g = torch.Generator().manual_seed(1)
    return Retrieval().eval(), (_tokens(g, 8), _tokens(g, 12))
