"""Stage ``export``: the config dict in, a verified switchboard out (``python -m hpcsplit stage=export``).

The only reader of the ``model``, ``partition`` and ``verify`` config groups ([Note: settings] in
:mod:`hpcsplit.core.settings`): each becomes a frozen settings dataclass, every problem listed at once,
and :func:`run_export` makes one typed call of :func:`hpcsplit.switchboard.writer.export`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcsplit.core.calibration import Calibration, calibration_for
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.settings import Checker
from hpcsplit.errors import ConfigError
from hpcsplit.switchboard.models import build_clip, build_factory, build_hf, build_toy, example_inputs
from hpcsplit.switchboard.writer import export, region_table

__all__ = [
    "SETTINGS",
    "ClipModelSettings",
    "FactoryModelSettings",
    "HFModelSettings",
    "ModelSettings",
    "PartitionSettings",
    "ToyModelSettings",
    "VerifySettings",
    "model_settings",
    "run_export",
]

TOY_NAMES = ("toy_mlp", "toy")
CLIP_NAMES = ("clip", "clip_tiny")
Built = tuple[nn.Module, tuple[torch.Tensor, ...], dict[str, Any]]


def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class ToyModelSettings:
    """``conf/model/toy_mlp.yaml``: the toy two-branch MLP and its example batch."""

    name: str
    batch_size: int
    d_in: int
    hidden: int
    d_out: int
    seed: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ToyModelSettings:
        """Read ``cfg["model"]`` (``cfg`` is the whole resolved config); every problem in one ConfigError."""
        c = Checker("model", cfg.get("model"), _fields(cls))
        s = cls(
            name=c.choice("name", TOY_NAMES),
            batch_size=c.integer("batch_size", lo=1),
            d_in=c.integer("d_in", lo=1),
            hidden=c.integer("hidden", lo=1),
            d_out=c.integer("d_out", lo=1),
            seed=c.integer("seed"),
        )
        c.done()
        return s

    def build(self) -> Built:
        """``(model, args, kwargs)``: the model with seeded weights and its example inputs."""
        model = build_toy(self.d_in, self.hidden, self.d_out, self.seed)
        return model, example_inputs("toy_mlp", self.batch_size, model=model, seed=self.seed), {}


@dataclass(frozen=True, slots=True)
class ClipModelSettings:
    """``conf/model/clip.yaml`` and ``clip_tiny.yaml``: CLIP (random weights or a local checkpoint)."""

    name: str
    size: str
    checkpoint: str | None
    both_logits: bool
    seq_len: int | None
    batch_size: int
    seed: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ClipModelSettings:
        """Read ``cfg["model"]``; every problem in one ConfigError."""
        c = Checker("model", cfg.get("model"), _fields(cls))
        s = cls(
            name=c.choice("name", CLIP_NAMES),
            size=c.choice("size", ("base", "tiny")),
            checkpoint=c.string("checkpoint", none=True),
            both_logits=c.boolean("both_logits"),
            seq_len=c.integer("seq_len", lo=1, none=True),
            batch_size=c.integer("batch_size", lo=1),
            seed=c.integer("seed"),
        )
        c.done()
        return s

    def build(self) -> Built:
        """``(model, args, kwargs)``: CLIP wrapped as ``ClipLogits`` and its example inputs."""
        model = build_clip(self.size, self.checkpoint, both_logits=self.both_logits, seed=self.seed)
        args = example_inputs(self.name, self.batch_size, model=model, seed=self.seed, seq_len=self.seq_len)
        return model, args, {}


def _names(c: Checker, key: str, *, none: bool) -> tuple[str, ...] | None:
    """A list of identifiers (``model.inputs=[pixel_values,input_ids]``)."""
    v = c.get(key)
    if v is None and none:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list | tuple) or not v or not all(isinstance(x, str) and x.isidentifier() for x in v) \
            or len(set(v)) != len(v):
        c.problem(f"model.{key} = {v!r}: needs a non-empty list of distinct names, e.g. [pixel_values,input_ids]")
        return ()
    return tuple(v)


@dataclass(frozen=True, slots=True)
class FactoryModelSettings:
    """``conf/model/factory.yaml``: the user's own model, ``model.target=pkg.module:function``.

    The function (imported from the Python path; ``python -m`` puts the current directory first) is
    called with ``kwargs`` and returns ``(model, example_inputs)`` or an object with ``model()`` and
    ``example_inputs(batch_size)``; see :func:`hpcsplit.switchboard.models.build_factory`.
    """

    name: str | None
    target: str
    kwargs: dict[str, Any]
    batch_size: int
    seed: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> FactoryModelSettings:
        """Read ``cfg["model"]``; every problem in one ConfigError."""
        c = Checker("model", cfg.get("model"), _fields(cls))
        target = c.get("target")
        if not isinstance(target, str) or ":" not in target:
            c.problem(
                f"model.target = {target!r}: needs 'package.module:function' of your own, "
                "e.g. model.target=examples.custom.model:build"
            )
        s = cls(
            name=c.string("name", none=True),
            target=str(target),
            kwargs=c.mapping("kwargs"),
            batch_size=c.integer("batch_size", lo=1),
            seed=c.integer("seed"),
        )
        c.done()
        return s

    def build(self) -> Built:
        """``(model, args, kwargs)`` from the user's function (its module is imported now)."""
        return build_factory(self.target, self.kwargs, batch_size=self.batch_size, seed=self.seed)


@dataclass(frozen=True, slots=True)
class HFModelSettings:
    """``conf/model/hf.yaml``: any transformers model class (``model.cls=SiglipModel``) from a config
    (random weights) or a local checkpoint, fed ``inputs`` and returning ``outputs``; see
    :func:`hpcsplit.switchboard.models.build_hf`."""

    name: str | None
    cls: str
    config: dict[str, Any]
    checkpoint: str | None
    inputs: tuple[str, ...] | None
    outputs: tuple[str, ...] | None
    seq_len: int | None
    batch_size: int
    seed: int

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> HFModelSettings:
        """Read ``cfg["model"]``; every problem in one ConfigError."""
        c = Checker("model", cfg.get("model"), _fields(cls))
        model_cls = c.get("cls")
        if not isinstance(model_cls, str) or not model_cls.isidentifier():
            c.problem(f"model.cls = {model_cls!r}: needs a transformers model class, e.g. model.cls=SiglipModel")
        s = cls(
            name=c.string("name", none=True),
            cls=str(model_cls),
            config=c.mapping("config"),
            checkpoint=c.string("checkpoint", none=True),
            inputs=_names(c, "inputs", none=True),
            outputs=_names(c, "outputs", none=True),
            seq_len=c.integer("seq_len", lo=1, none=True),
            batch_size=c.integer("batch_size", lo=1),
            seed=c.integer("seed"),
        )
        if s.checkpoint is not None and s.config:
            c.problem("found both model.checkpoint and model.config; needed one (a checkpoint has its config)")
        c.done()
        if s.name is None:
            return dataclasses.replace(s, name=s.cls)
        return s

    def build(self) -> Built:
        """``(model, args, kwargs)``: the class wrapped as ``HFTensors`` and example inputs from its config."""
        model, args = build_hf(
            self.cls, config=self.config, checkpoint=self.checkpoint, inputs=self.inputs, outputs=self.outputs,
            batch_size=self.batch_size, seq_len=self.seq_len, seed=self.seed,
        )
        return model, args, {}


ModelSettings = ToyModelSettings | ClipModelSettings | FactoryModelSettings | HFModelSettings


def model_settings(cfg: Mapping[str, Any]) -> ModelSettings:
    """The settings of ``cfg["model"]``: by its ``name`` (toy, CLIP), or ``model=factory`` (a ``target``
    key) and ``model=hf`` (a ``cls`` key), whose ``name`` is free.

    Raises
    ------
    ConfigError
        An unknown model name, or invalid settings of the model.
    """
    node = cfg.get("model")
    name = node.get("name") if isinstance(node, Mapping) else None
    if name in TOY_NAMES:
        return ToyModelSettings.from_config(cfg)
    if name in CLIP_NAMES:
        return ClipModelSettings.from_config(cfg)
    if isinstance(node, Mapping) and "target" in node:
        return FactoryModelSettings.from_config(cfg)
    if isinstance(node, Mapping) and "cls" in node:
        return HFModelSettings.from_config(cfg)
    raise ConfigError(
        f"found model.name={name!r}; needed one of toy_mlp, clip, clip_tiny (conf/model/), or your own model: "
        "model=factory model.target=pkg.module:build, or model=hf model.cls=SiglipModel"
    )


@dataclass(frozen=True, slots=True)
class PartitionSettings:
    """``conf/partition/dominator.yaml``: how the model is split (see :mod:`hpcsplit.switchboard.regions`)."""

    method: str
    stages: int | None
    max_stage_ms: float | None
    min_branch_fraction: float
    min_component_fraction: float
    max_branches: int
    force: bool
    compute_gflops: float | None  # None: from the calibration (calibration=PATH or the run folder's), else the defaults
    transport_gb_s: float | None
    hop_ms: float | None
    cut_slack: float
    tie_margin: float
    cost: str
    timing_batch: int | None
    timing_repeats: int
    device: str | None

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> PartitionSettings:
        """Read ``cfg["partition"]``; every problem in one ConfigError."""
        c = Checker("partition", cfg.get("partition"), _fields(cls))
        method = c.get("method")
        if method != "dominator":
            c.problem(f"found partition.method={method!r}; needed 'dominator' (the only method)")
        s = cls(
            method=str(method),
            stages=c.integer("stages", lo=1, none=True),
            max_stage_ms=c.number("max_stage_ms", lo=0, lo_open=True, none=True),
            min_branch_fraction=c.number("min_branch_fraction", lo=0, hi=1),
            min_component_fraction=c.number("min_component_fraction", lo=0, hi=1),
            max_branches=c.integer("max_branches", lo=1),
            force=c.boolean("force"),
            compute_gflops=c.number("compute_gflops", lo=0, lo_open=True, none=True),
            transport_gb_s=c.number("transport_gb_s", lo=0, lo_open=True, none=True),
            hop_ms=c.number("hop_ms", lo=0, none=True),
            cut_slack=c.number("cut_slack", lo=0),
            tie_margin=c.number("tie_margin", lo=0, hi=1),
            cost=c.choice("cost", ("measured", "flops")),
            timing_batch=c.integer("timing_batch", lo=1, none=True),
            timing_repeats=c.integer("timing_repeats", lo=1),
            device=c.string("device", none=True),
        )
        if s.stages is not None and s.max_stage_ms is not None:
            c.problem(
                f"found both partition.stages={s.stages} and partition.max_stage_ms={s.max_stage_ms:g}; "
                "needed at most one; set the other to null"
            )
        c.done()
        return s

    def export_options(self, calibration: Calibration | None = None) -> dict[str, Any]:
        """The keyword arguments of :func:`hpcsplit.switchboard.writer.export` these settings give.

        The split rule's figures left null come from ``calibration`` (its :meth:`~Calibration.split_rule`; the
        documented defaults without one); ``constants`` says where they came from.
        """
        out = {f: getattr(self, f) for f in _fields(type(self)) if f != "method"}
        cal = calibration or Calibration.defaults()
        rule = cal.split_rule()
        unset = [k for k in rule if out[k] is None]
        for k in unset:
            out[k] = rule[k]
        given = [k for k in rule if k not in unset]
        where = f"constants from {cal.origin()}" if unset else "constants from the partition settings"
        out["constants"] = where + (f" (partition.{', partition.'.join(given)} as set)" if unset and given else "")
        return out


@dataclass(frozen=True, slots=True)
class VerifySettings:
    """``conf/verify/default.yaml``: the tolerance of the export's verification."""

    atol: float
    rtol: float

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> VerifySettings:
        """Read ``cfg["verify"]``; every problem in one ConfigError."""
        c = Checker("verify", cfg.get("verify"), _fields(cls))
        s = cls(atol=c.number("atol", lo=0), rtol=c.number("rtol", lo=0))
        c.done()
        return s


SETTINGS: dict[str, type | dict[str, type]] = {
    "model": {
        "toy_mlp": ToyModelSettings, "clip": ClipModelSettings, "clip_tiny": ClipModelSettings,
        "factory": FactoryModelSettings, "hf": HFModelSettings,
    },
    "partition": PartitionSettings,
    "verify": VerifySettings,
}


def _settings(cfg: Mapping[str, Any]) -> tuple[ModelSettings, PartitionSettings, VerifySettings]:
    """All three groups, their problems in one ConfigError."""
    found: list[Any] = []
    problems: list[str] = []
    for read in (model_settings, PartitionSettings.from_config, VerifySettings.from_config):
        try:
            found.append(read(cfg))
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))
    return found[0], found[1], found[2]


def run_export(cfg: dict, run_dir: Path) -> dict:
    """The ``export`` stage: build ``cfg['model']``, export it into the run folder, print a table.

    Returns
    -------
    dict
        ``switchboard`` (path), ``sha256``, ``model``, ``components``, ``verification``, ``seconds``.

    Raises
    ------
    ConfigError
        Invalid ``model``, ``partition``, ``verify`` or ``paths`` settings (all of them listed).
    """
    t0 = time.perf_counter()
    ms, ps, vs = _settings(cfg)
    paths = RunPaths.from_config(cfg, run_dir)
    out = paths.own_switchboard
    model, args, kwargs = ms.build()
    sb = export(
        model,
        args,
        kwargs,
        out=out,
        name=ms.name,
        atol=vs.atol,
        rtol=vs.rtol,
        **ps.export_options(calibration_for(paths.calibration, paths.calibration_given)),
    )
    v = sb.layout.verification
    print(f"switchboard {out}  ({sb.model_name}, sha256 {sb.sha256[:12]})")
    print(sb.table())
    print(region_table(sb.layout.partition))
    print(
        f"verified at batch {v.get('batch_size')}: max abs diff {v.get('max_abs_diff'):.3g}, "
        f"max rel diff {v.get('max_rel_diff'):.3g} (atol {v.get('atol')}, rtol {v.get('rtol')})"
    )
    return {
        "switchboard": str(out),
        "sha256": sb.sha256,
        "model": sb.model_name,
        "components": list(sb.order),
        "verification": v,
        "seconds": time.perf_counter() - t0,
    }
