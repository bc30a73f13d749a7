"""Model factories used by the configs (``conf/model/*.yaml``, read by
:mod:`hpcsplit.switchboard.stage`) and the examples.

- ``toy_mlp``: a two-branch MLP shaped as the nested diamond
  A->B,C; B->D,E; C->E; D->F; E->G; F,G->H (``stem``; ``left``, ``right``; ``left_tail``;
  ``mixer``; ``head``).
- ``clip``: ``transformers.CLIPModel`` (ViT-B/32 shapes with random weights, a tiny config for
  tests, or a local checkpoint), wrapped so that
  ``forward(pixel_values, input_ids, attention_mask)`` returns ``logits_per_image``
  (or ``(logits_per_image, logits_per_text)``).
- ``factory`` (:func:`build_factory`): the user's own function ``pkg.module:build``, imported from the
  Python path, returning the model and its example inputs.
- ``hf`` (:func:`build_hf`): any ``transformers`` model class from a config (random weights) or a local
  checkpoint, wrapped as :class:`HFTensors` (keyword tensors in, a dict of the chosen outputs out), with
  example inputs shaped from the config (:func:`hf_example_inputs`).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hpcsplit.errors import ConfigError

__all__ = [
    "HF_INPUTS",
    "ClipLogits",
    "HFTensors",
    "ToyMLP",
    "build_clip",
    "build_factory",
    "build_hf",
    "build_toy",
    "example_inputs",
    "hf_default_inputs",
    "hf_example_inputs",
    "hf_text_length",
    "import_target",
]


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


# ---------------------------------------------------------------------------------------------------
# The user's own model: ``model=factory`` (a function of the user's) and ``model=hf`` (a transformers
# class). [Note: user models] Importing the user's module runs the user's code: that is the user's own
# choice on the command line (``model.target=``), unlike loading a switchboard, profile or plan, which
# never runs code from the file.


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value[:4])})"
    return f"a {type(value).__name__}"


def _tensor_inputs(target: str, inputs: Any) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Example inputs as ``(args, kwargs)``: a tensor, a tuple/list of tensors or a dict name -> tensor."""
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, tuple | list) and inputs and all(isinstance(t, torch.Tensor) for t in inputs):
        return tuple(inputs), {}
    if (
        isinstance(inputs, Mapping)
        and inputs
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in inputs.items())
    ):
        return (), dict(inputs)
    raise ConfigError(
        f"model.target={target!r} gave example inputs that are {_describe(inputs)}; needed a tensor, a "
        "non-empty tuple of tensors or a dict name -> tensor (dim 0 is the batch)"
    )


def import_target(target: str) -> Any:
    """The object ``pkg.module:name`` names, imported from the Python path.

    Raises
    ------
    ConfigError
        A malformed target, a module that is not on the path or fails to import, a missing name.
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr or not all(p.isidentifier() for p in module_name.split(".")) \
            or not all(p.isidentifier() for p in attr.split(".")):
        raise ConfigError(
            f"found model.target={target!r}; needed 'package.module:function' "
            "(e.g. model.target=examples.custom.model:build)"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise ConfigError(
                f"model.target={target!r}: found no module {e.name!r} on the Python path (the current "
                f"directory is {os.getcwd()}); run from the folder that holds it, or add that folder to "
                "PYTHONPATH"
            ) from e
        raise ConfigError(f"model.target={target!r}: importing {module_name} failed: {e}") from e
    except Exception as e:  # the user's module raised while importing
        raise ConfigError(
            f"model.target={target!r}: importing {module_name} raised {type(e).__name__}: {e}"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise ConfigError(
                f"model.target={target!r}: module {module_name} has no {attr!r}; its callables: "
                f"{', '.join(names) or 'none'}"
            )
        obj = getattr(obj, part)
    return obj


def build_factory(
    target: str, kwargs: Mapping[str, Any] | None = None, *, batch_size: int = 2, seed: int = 0
) -> tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """``(model, args, kwargs)`` from the user's function ``target`` (``pkg.module:function``).

    The function is called with ``kwargs`` (plus ``batch_size=`` when it takes one and ``kwargs``
    does not set it), after ``torch.manual_seed(seed)``. It returns ``(model, example_inputs)`` or an
    object with ``model()`` and ``example_inputs(batch_size)``; the example inputs are a tensor, a
    tuple of tensors or a dict name -> tensor (keyword inputs).

    Raises
    ------
    ConfigError
        The target cannot be imported, is not callable, does not take ``kwargs``, raises, or
        returns something else; the message names the target.
    """
    fn = import_target(target)
    if not callable(fn):
        raise ConfigError(f"model.target={target!r} is {_describe(fn)}, not a function; needed a callable")
    call_kwargs = dict(kwargs or {})
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        sig = None
    if sig is not None:
        if "batch_size" in sig.parameters and "batch_size" not in call_kwargs:
            call_kwargs["batch_size"] = batch_size
        try:
            sig.bind(**call_kwargs)
        except TypeError as e:
            raise ConfigError(
                f"model.target={target!r} takes {sig}; model.kwargs={dict(kwargs or {})!r} does not fit: {e}"
            ) from e
    torch.manual_seed(seed)
    try:
        made = fn(**call_kwargs)
    except Exception as e:
        raise ConfigError(f"model.target={target!r}: calling it raised {type(e).__name__}: {e}") from e
    if isinstance(made, tuple | list) and len(made) == 2:
        model, inputs = made
    elif callable(getattr(made, "model", None)) and callable(getattr(made, "example_inputs", None)):
        try:
            model, inputs = made.model(), made.example_inputs(batch_size)
        except Exception as e:
            raise ConfigError(
                f"model.target={target!r}: its model() or example_inputs({batch_size}) raised "
                f"{type(e).__name__}: {e}"
            ) from e
    else:
        raise ConfigError(
            f"model.target={target!r} returned {_describe(made)}; needed (model, example_inputs) or an "
            "object with model() and example_inputs(batch_size)"
        )
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.target={target!r} gave a model that is {_describe(model)}; needed a torch.nn.Module")
    args, kw = _tensor_inputs(target, inputs)
    return model.eval(), args, kw


# Example inputs of a transformers model, by forward parameter: which sub-config to read them from.
HF_INPUTS = (
    "pixel_values", "input_ids", "attention_mask", "token_type_ids", "position_ids",
    "pixel_mask", "input_features", "is_longer", "input_values", "decoder_input_ids", "decoder_attention_mask",
)
# What model.inputs is when not given (hf_default_inputs): the forward parameters among these, in the
# forward's order; the masks join the input they mask.
HF_PRIMARY_INPUTS = ("input_ids", "pixel_values", "input_features", "input_values", "decoder_input_ids")
WAVE_FRAMES = 50  # input_values of a Wav2Vec2-like encoder: this many frames of its convolutions (1 s at 16 kHz)


class HFTensors(nn.Module):
    """A transformers model with tensor-only inputs and outputs: the tensors ``inputs`` names, in that
    order, in; a dict of the chosen ``outputs`` out. Build it with :meth:`wrap`, whose class has a
    ``forward`` signature naming the inputs (torch.export names the switchboard's inputs after it)."""

    def __init__(self, model: nn.Module, inputs: Sequence[str], outputs: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.input_names = tuple(inputs)
        self.output_names = tuple(outputs)

    def forward(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model(**dict(zip(self.input_names, inputs, strict=True)), return_dict=True)
        return {name: out[name] for name in self.output_names}

    @classmethod
    def wrap(cls, model: nn.Module, inputs: Sequence[str], outputs: Sequence[str]) -> HFTensors:
        """``cls(model, inputs, outputs)`` as an instance of a subclass whose forward is
        ``forward(<inputs...>)``."""

        def forward(self: HFTensors, *args: torch.Tensor) -> dict[str, torch.Tensor]:
            return HFTensors.forward(self, *args)

        p = inspect.Parameter
        forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [p("self", p.POSITIONAL_OR_KEYWORD)] + [p(n, p.POSITIONAL_OR_KEYWORD) for n in inputs]
        )
        sub = type(type(model).__name__, (cls,), {"forward": forward, "__doc__": cls.__doc__})
        return sub(model, inputs, outputs)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - transformers is an extra
        raise ConfigError(
            "found no 'transformers' package; needed for model=hf; pip install 'hpcsplit[clip]'"
        ) from e
    return transformers


def _sub(config: Any, *names: str) -> Any:
    """The first of ``config.<name>`` that exists, else ``config`` (single-tower models)."""
    for n in names:
        sub = getattr(config, n, None)
        if sub is not None:
            return sub
    return config


MAX_TEXT_LEN = 512  # the longest default text length of hf example inputs (Longformer-like configs have 4096)


def hf_text_length(model: nn.Module) -> int:
    """The text length of a transformers model's example inputs when ``model.seq_len`` is null: its context
    (the text config's ``max_position_embeddings``: CLIP 77, SigLIP 64, BERT 512), less the positions a
    RoBERTa-style position embedding keeps before the first token (``padding_idx + 1``: CLAP's and
    XLM-R's text towers), at most :data:`MAX_TEXT_LEN`.  The export fixes this length (only the batch is
    symbolic), so it is what requests must carry, and what the towers' FLOPs, which decide the split, are
    computed at: a tokenizer padding to the model's length (``padding="max_length"``) fits it.
    """
    max_pos = int(getattr(_sub(model.config, "text_config"), "max_position_embeddings", None) or 16)
    reserved = max((m.padding_idx + 1 for name, m in model.named_modules()
                    if isinstance(m, nn.Embedding) and name.endswith("position_embeddings")
                    and m.num_embeddings == max_pos and m.padding_idx is not None), default=0)
    return max(1, min(max_pos - reserved, MAX_TEXT_LEN))


def hf_example_inputs(
    config: Any, names: Sequence[str], batch_size: int = 2, *, seq_len: int | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random example inputs for a transformers model, shaped from its config.

    ``pixel_values`` from the vision config (channels, image size), ``input_ids`` (and
    ``attention_mask``, ``token_type_ids``, ``position_ids``) from the text config (vocabulary;
    ``seq_len`` tokens, default the config's ``max_position_embeddings``, at most :data:`MAX_TEXT_LEN`:
    :func:`build_hf` passes :func:`hf_text_length`, which knows the model's reserved positions),
    ``input_features`` from the audio config (CLAP: ``spec_size`` x ``num_mel_bins``; Whisper-like:
    ``num_mel_bins`` x 2 ``max_source_positions``).
    """
    gen = torch.Generator().manual_seed(seed)
    text = _sub(config, "text_config")
    vision = _sub(config, "vision_config")
    audio = _sub(config, "audio_config")
    length = seq_len or min(int(getattr(text, "max_position_embeddings", None) or 16), MAX_TEXT_LEN)
    # the decoder's length: its own context where the config has one (Whisper's max_target_positions)
    target = min(int(getattr(text, "max_target_positions", None) or length), length)
    size = getattr(vision, "image_size", 32)
    hw = (size, size) if isinstance(size, int) else tuple(size)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name == "pixel_values":
            out[name] = torch.randn(batch_size, getattr(vision, "num_channels", 3), *hw, generator=gen)
        elif name == "pixel_mask":
            out[name] = torch.ones(batch_size, *hw, dtype=torch.long)
        elif name in ("input_ids", "decoder_input_ids"):
            vocab = int(getattr(text, "vocab_size", 128))
            low = 4 if vocab > 8 else 0
            n = target if name == "decoder_input_ids" else length
            out[name] = torch.randint(low, vocab, (batch_size, n), generator=gen)
        elif name == "decoder_attention_mask":
            out[name] = torch.ones(batch_size, target, dtype=torch.long)
        elif name == "input_values":  # raw audio: WAVE_FRAMES frames of the feature encoder's strides
            hop = math.prod(int(k) for k in getattr(audio, "conv_stride", (320,)))
            out[name] = torch.randn(batch_size, hop * WAVE_FRAMES, generator=gen)
        elif name == "attention_mask":
            out[name] = torch.ones(batch_size, length, dtype=torch.long)
        elif name == "token_type_ids":
            out[name] = torch.zeros(batch_size, length, dtype=torch.long)
        elif name == "position_ids":
            out[name] = torch.arange(length).expand(batch_size, length).contiguous()
        elif name == "input_features":
            mel = int(getattr(audio, "num_mel_bins", 64))
            if getattr(audio, "spec_size", None):  # CLAP: a spec_size x spec_size image after reshaping
                spec = int(audio.spec_size)
                out[name] = torch.randn(batch_size, 1, spec * max(1, spec // mel), mel, generator=gen)
            else:  # Whisper-like encoders: [batch, mel bins, frames]
                frames = 2 * int(getattr(audio, "max_source_positions", 1500))
                out[name] = torch.randn(batch_size, mel, frames, generator=gen)
        elif name == "is_longer":
            out[name] = torch.zeros(batch_size, 1, dtype=torch.bool)
        else:
            raise ConfigError(
                f"found model.inputs entry {name!r}; hpcsplit makes example inputs for {', '.join(HF_INPUTS)} "
                "(for others, write a factory: model=factory model.target=pkg.module:build)"
            )
    return out


def _subclass(obj: Any, base: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, base)


def hf_default_inputs(cls: Any, config: Any) -> list[str]:
    """``model.inputs`` when not given: the forward parameters of ``cls`` among :data:`HF_PRIMARY_INPUTS`
    (``decoder_input_ids`` only for an encoder-decoder config), in the forward's order, with
    ``attention_mask`` when ``input_ids`` is one and ``pixel_mask`` when ``pixel_values`` is.

    >>> from transformers import CLIPConfig, CLIPModel, T5Config, T5Model
    >>> hf_default_inputs(CLIPModel, CLIPConfig()), hf_default_inputs(T5Model, T5Config())
    (['input_ids', 'pixel_values', 'attention_mask'], ['input_ids', 'attention_mask', 'decoder_input_ids'])
    """
    params = _forward_params(cls)
    chosen = {n for n in params if n in HF_PRIMARY_INPUTS}
    if not getattr(config, "is_encoder_decoder", False):
        chosen.discard("decoder_input_ids")
    if "input_ids" in chosen:
        chosen.add("attention_mask")
    if "pixel_values" in chosen:
        chosen.add("pixel_mask")
    return [n for n in params if n in chosen]


def _forward_params(cls: Any) -> list[str]:
    skip = {"self", "kwargs", "args", "return_loss", "return_dict", "output_attentions", "output_hidden_states",
            "interpolate_pos_encoding", "inputs_embeds", "labels", "use_cache", "past_key_values"}
    params = inspect.signature(cls.forward).parameters.values()
    return [p.name for p in params if p.name not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def build_hf(
    cls: str,
    *,
    config: Mapping[str, Any] | None = None,
    checkpoint: str | None = None,
    inputs: Sequence[str] | None = None,
    outputs: Sequence[str] | None = None,
    batch_size: int = 2,
    seq_len: int | None = None,
    seed: int = 0,
) -> tuple[HFTensors, tuple[torch.Tensor, ...]]:
    """A transformers model class wrapped as :class:`HFTensors`, and its example inputs (in ``inputs`` order).

    Parameters
    ----------
    cls
        A model class of ``transformers`` (``SiglipModel``, ``ClapModel``, ...).
    config
        Keyword arguments of the class's config (``cls.config_class``); random weights. Nothing is
        downloaded.
    checkpoint
        A local directory for ``cls.from_pretrained`` (``local_files_only``; no remote code).
    inputs, outputs
        Forward parameters to feed (in this order; null: :func:`hf_default_inputs`, from the forward's
        signature and the config) and output fields to return (null: every tensor output).
    batch_size, seq_len, seed
        The example batch, the text length (null: :func:`hf_text_length`, the model's context), and the seed
        of the weights and inputs.

    Raises
    ------
    ConfigError
        An unknown class, input or output (the message lists what exists), a missing checkpoint, a
        config the class rejects.
    """
    tf = _transformers()
    model_cls: Any = getattr(tf, cls, None) if cls.isidentifier() else None
    base = getattr(tf, "PreTrainedModel", nn.Module)
    if not _subclass(model_cls, base):
        near = difflib.get_close_matches(cls, [n for n in dir(tf) if n.endswith("Model")], n=6, cutoff=0.5)
        raise ConfigError(
            f"found model.cls={cls!r}; needed a model class of transformers {tf.__version__}"
            + (f"; close: {', '.join(near)}" if near else " (e.g. CLIPModel, SiglipModel, ClapModel)")
        )
    params = _forward_params(model_cls)
    unknown = [n for n in inputs or () if n not in params]
    if unknown or (inputs is not None and not inputs):
        raise ConfigError(
            f"found model.inputs={list(inputs or ())!r}" + (f" ({', '.join(unknown)} unknown)" if unknown else "")
            + f"; {cls}.forward takes {', '.join(params)}"
        )
    config = dict(config or {})
    torch.manual_seed(seed)
    if checkpoint:
        if config:
            raise ConfigError("found both model.checkpoint and model.config; needed one (the checkpoint has its config)")
        if not os.path.isdir(checkpoint):
            raise ConfigError(f"found model.checkpoint={checkpoint!r}; needed a local directory (nothing is downloaded)")
        try:
            model = model_cls.from_pretrained(checkpoint, local_files_only=True, trust_remote_code=False)
        except Exception as e:
            raise ConfigError(f"{cls}.from_pretrained({checkpoint!r}) failed: {type(e).__name__}: {e}") from e
    else:
        config_cls = model_cls.config_class
        try:
            cfg = config_cls(**config)
            model = model_cls(cfg)
        except Exception as e:
            raise ConfigError(
                f"model.config={config!r}: {config_cls.__name__} / {cls} refused it: {type(e).__name__}: {e}"
            ) from e
    model.eval()
    # export-friendly: no key/value cache (it exists for generate loops, which hpcsplit refuses; one forward
    # computes everything, and a cache object is not a tensor output)
    if getattr(model.config, "use_cache", None):
        model.config.use_cache = False
    if inputs is None:
        inputs = hf_default_inputs(model_cls, model.config)
        if not inputs:
            raise ConfigError(
                f"found no model.inputs, and {cls}.forward takes none that hpcsplit makes by itself "
                f"({', '.join(HF_PRIMARY_INPUTS)}); it takes {', '.join(params)}: set model.inputs=[...]"
            )
    example = hf_example_inputs(model.config, inputs, batch_size, seq_len=seq_len or hf_text_length(model), seed=seed)
    try:
        with torch.no_grad():
            out = model(**example, return_dict=True)
    except Exception as e:
        raise ConfigError(
            f"{cls} did not run on example inputs {', '.join(f'{k}{list(v.shape)}' for k, v in example.items())}: "
            f"{type(e).__name__}: {e}; set model.inputs (and model.seq_len) to what it needs"
        ) from e
    tensors = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
    chosen = list(outputs) if outputs else tensors
    bad = [n for n in chosen if n not in tensors]
    if bad or not chosen:
        others = [k for k in out if k not in tensors]
        raise ConfigError(
            f"found model.outputs={list(chosen)!r}" + (f" ({', '.join(bad)} not a tensor output)" if bad else "")
            + f"; {cls} returns the tensors {', '.join(tensors) or 'none'}"
            + (f" (and {', '.join(others)}, which are not tensors)" if others else "")
        )
    return HFTensors.wrap(model, inputs, chosen).eval(), tuple(example[n] for n in inputs)
