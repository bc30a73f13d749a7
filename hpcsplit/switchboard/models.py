"""Model factories used by the configs (``conf/model/*.yaml``, read by
:mod:`hpcsplit.switchboard.stage`) and the examples.

- ``toy_mlp``: a two-branch MLP shaped as the nested diamond
  A->B,C; B->D,E; C->E; D->F; E->G; F,G->H (``stem``; ``left``, ``right``; ``left_tail``;
  ``mixer``; ``head``).
- ``clip``: ``transformers.CLIPModel`` (ViT-B/32 shapes with random weights, a tiny config for
  tests, or a local checkpoint), wrapped so that
  ``forward(pixel_values, input_ids, attention_mask)`` returns ``logits_per_image``
  (or ``(logits_per_image, logits_per_text)``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hpcsplit.errors import ConfigError

__all__ = ["ClipLogits", "ToyMLP", "build_clip", "build_toy", "example_inputs"]


class _Block(nn.Module):
    """Linear + ReLU: one letter of the toy diamond."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class _Mixer(nn.Module):
    """E then G: reads both B and C."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.join = _Block(d, d)  # E
        self.out = _Block(d, d)  # G

    def forward(self, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.out(self.join(b + c))


class ToyMLP(nn.Module):
    """Two-branch MLP: the nested diamond A->B,C; B->D,E; C->E; D->F; E->G; F,G->H.

    A = ``stem``, B = ``left``, C = ``right``, D,F = ``left_tail``, E,G = ``mixer``, H = ``head``.
    """

    def __init__(self, d_in: int = 64, hidden: int = 256, d_out: int = 10) -> None:
        super().__init__()
        self.stem = _Block(d_in, hidden)  # A
        self.left = _Block(hidden, hidden)  # B
        self.right = _Block(hidden, hidden)  # C
        self.left_tail = nn.Sequential(_Block(hidden, hidden), _Block(hidden, hidden))  # D, F
        self.mixer = _Mixer(hidden)  # E, G
        self.head = nn.Linear(2 * hidden, d_out)  # H

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        b = self.left(a)
        c = self.right(a)
        f = self.left_tail(b)
        g = self.mixer(b, c)
        return self.head(torch.cat([f, g], dim=-1))


def build_toy(d_in: int = 64, hidden: int = 256, d_out: int = 10, seed: int = 0) -> ToyMLP:
    """The toy two-branch MLP with deterministic weights."""
    torch.manual_seed(seed)
    return ToyMLP(d_in, hidden, d_out).eval()


class ClipLogits(nn.Module):
    """``CLIPModel`` with a tensor-only forward: ``(pixel_values, input_ids, attention_mask)``."""

    def __init__(self, clip: nn.Module, *, both_logits: bool = False) -> None:
        super().__init__()
        self.clip = clip
        self.both_logits = both_logits

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out = self.clip(pixel_values=pixel_values, input_ids=input_ids, attention_mask=attention_mask)
        if self.both_logits:
            return out.logits_per_image, out.logits_per_text
        return out.logits_per_image


_TINY: dict[str, Any] = {
    "text": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 16,
        "vocab_size": 128,
    },
    "vision": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    },
    "projection_dim": 16,
}


def build_clip(
    size: str = "base", checkpoint: str | None = None, *, both_logits: bool = False, seed: int = 0
) -> ClipLogits:
    """CLIP wrapped as :class:`ClipLogits`.

    Parameters
    ----------
    size
        ``"base"``: ``CLIPConfig()`` (ViT-B/32 shapes, random weights); ``"tiny"``: a 2-layer toy.
    checkpoint
        A local directory for ``CLIPModel.from_pretrained`` (no download); overrides ``size``.
    both_logits
        Return ``(logits_per_image, logits_per_text)`` instead of ``logits_per_image``.
    seed
        Seed for the random weights.
    """
    try:
        from transformers import CLIPConfig, CLIPModel
    except ImportError as e:  # pragma: no cover - transformers is an extra
        raise ConfigError(
            "found no 'transformers' package; needed for the CLIP model; pip install 'hpcsplit[clip]'"
        ) from e
    torch.manual_seed(seed)
    if checkpoint:
        clip = CLIPModel.from_pretrained(checkpoint, local_files_only=True, attn_implementation="eager")
    elif size == "base":
        clip = CLIPModel(CLIPConfig())
    elif size == "tiny":
        clip = CLIPModel(
            CLIPConfig(
                text_config=_TINY["text"],
                vision_config=_TINY["vision"],
                projection_dim=_TINY["projection_dim"],
            )
        )
    else:
        raise ConfigError(f"found clip size={size!r}; needed 'base' or 'tiny' (or a checkpoint path)")
    return ClipLogits(clip.eval(), both_logits=both_logits).eval()


def example_inputs(
    name: str,
    batch_size: int = 2,
    *,
    model: nn.Module | None = None,
    seed: int = 0,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Random example inputs for a named model.

    Parameters
    ----------
    name
        ``"toy_mlp"``, ``"clip"`` or ``"clip_tiny"``.
    batch_size
        Dim 0 of every tensor.
    model
        For CLIP: the built model, to read image size and vocabulary from its config.
    seed
        Generator seed.
    seq_len
        Text length for CLIP (default: 32, or the tiny model's 8).
    """
    gen = torch.Generator().manual_seed(seed)
    if name in ("toy", "toy_mlp"):
        d_in = model.stem.fc.in_features if isinstance(model, ToyMLP) else 64
        return (torch.randn(batch_size, d_in, generator=gen),)
    if name in ("clip", "clip_tiny"):
        if model is not None:
            cfg: Any = model.clip.config  # type: ignore[union-attr]
            image, vocab = cfg.vision_config.image_size, cfg.text_config.vocab_size
            max_pos = cfg.text_config.max_position_embeddings
        elif name == "clip_tiny":
            image, vocab, max_pos = 32, 128, 16
        else:
            image, vocab, max_pos = 224, 49408, 77
        length = seq_len or min(32 if max_pos > 32 else 8, max_pos)
        pixel_values = torch.randn(batch_size, 3, image, image, generator=gen)
        input_ids = torch.randint(1, vocab, (batch_size, length), generator=gen)
        attention_mask = torch.ones(batch_size, length, dtype=torch.long)
        return pixel_values, input_ids, attention_mask
    raise ConfigError(f"found model name {name!r}; needed one of toy_mlp, clip, clip_tiny")
