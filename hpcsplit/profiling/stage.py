"""Stages ``profile`` (MPI ranks) and ``analyze`` (in process): the only readers of their config.

[Note: settings] in :mod:`hpcsplit.core.settings`: the ``profile`` group (with the ``cluster``
group's slices and cores where ``profile`` leaves them null) becomes a frozen
:class:`ProfileSettings`, every problem listed at once; file names come from
:class:`~hpcsplit.core.paths.RunPaths`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from hpcsplit.core.cluster import GIB
from hpcsplit.core.device import cores_here
from hpcsplit.core.paths import RunPaths
from hpcsplit.core.settings import Checker
from hpcsplit.errors import ConfigError
from hpcsplit.profiling.analyze import analyze_file
from hpcsplit.profiling.runner import ProfileOptions, default_batch_sizes, profile_components_mpi

__all__ = ["SETTINGS", "AnalyzeSettings", "ProfileSettings", "mpi_main", "run_analyze"]

# the keys of conf/profile/default.yaml
PROFILE_KEYS = (
    "path", "max_batch", "batch_sizes", "slices_gb", "threads", "device", "warmup", "iters",
    "util_window_ms", "util_sample_ms", "components", "ranks", "progress", "analysis_dir", "rank_silence_s",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ProfileSettings(ProfileOptions):
    """The profile stage's settings, resolved from ``cfg`` (``conf/profile/default.yaml``).

    The grid is resolved: ``batch_sizes`` from ``profile.batch_sizes`` or ``max_batch``; ``slices``
    from ``profile.slices_gb`` (GPU) or ``profile.threads`` (CPU), else the cluster's; the device
    kind from ``profile.device`` and what this machine has.  ``path``, ``ranks`` and ``analysis_dir``
    are read by :class:`~hpcsplit.core.paths.RunPaths`, the launcher and :class:`AnalyzeSettings`.
    """

    rank_silence_s: float  # the final gather names a rank silent this long (``profile.rank_silence_s``)

    CONFIG_KEYS: ClassVar[tuple[str, ...]] = PROFILE_KEYS

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ProfileSettings:
        """Read ``cfg["profile"]`` (and ``cfg["cluster"]`` where it leaves slices or cores null).

        Raises
        ------
        ConfigError
            Listing every problem at once.
        """
        c = Checker("profile", cfg.get("profile"), PROFILE_KEYS)
        cluster = cfg.get("cluster") or {}
        c.string("path", none=True)
        c.string("analysis_dir", none=True)
        c.integer("ranks", lo=1)
        kind = "cpu"
        device = c.choice("device", ("auto", "cpu", "cuda"))
        if device == c.get("device"):
            try:
                kind = _device_kind(device)
            except ConfigError as e:
                c.problem(str(e))
        max_batch = c.integer("max_batch", lo=1)
        bs = c.get("batch_sizes")
        batch_sizes = _increasing(bs, whole=True) if bs else default_batch_sizes(max(max_batch, 1))
        if batch_sizes is None:
            c.problem(f"profile.batch_sizes = {bs!r}: needs increasing positive integers "
                      "(or null: 1, 2, 4, ... up to max_batch)")
        key = "slices_gb" if kind == "cuda" else "threads"
        sl = c.get(key) or cluster.get("slices_gb" if kind == "cuda" else "cpu_threads") or []
        if kind == "cuda" and not sl:
            sl = [_whole_gpu_gb()]
        elif kind == "cpu" and not sl:
            sl = [1]
        slices = _increasing(sl, whole=False)
        if slices is None:
            c.problem(f"profile.{key} = {sl!r}: needs increasing positive numbers (GB on GPU, threads on CPU)")
        elif kind == "cpu" and any(x != int(x) for x in slices):
            c.problem(f"profile.threads = {list(sl)!r}: CPU slices are whole thread counts")
        warmup, iters = c.integer("warmup", lo=0), c.integer("iters", lo=1)
        window = c.number("util_window_ms", lo=0, lo_open=True)
        sample = c.number("util_sample_ms", lo=0, lo_open=True)
        comps = c.get("components")
        if comps is not None and (isinstance(comps, str) or not isinstance(comps, Sequence)
                                  or not all(isinstance(n, str) for n in comps)):
            c.problem(f"profile.components = {comps!r}: needs a list of component names or null")
        progress = c.boolean("progress")
        silence = c.number("rank_silence_s", lo=0, lo_open=True)
        cores = cluster.get("cores_per_node") or cores_here()
        c.done()
        return cls(
            batch_sizes=tuple(int(b) for b in batch_sizes or ()),
            slices=slices or (),
            device_kind=kind,
            warmup=warmup,
            iters=iters,
            util_window_ms=window,
            util_sample_ms=sample,
            cores_per_node=int(cores),
            components=tuple(comps) if comps else None,
            progress=progress,
            rank_silence_s=silence,
        )


@dataclass(frozen=True, slots=True)
class AnalyzeSettings:
    """What the analyze stage reads of the ``profile`` group: where the tables and plots go."""

    CONFIG_KEYS: ClassVar[tuple[str, ...]] = PROFILE_KEYS

    analysis_dir: Path | None  # null: the run folder's (RunPaths.analysis_dir)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> AnalyzeSettings:
        """Read ``cfg["profile"]`` (unknown keys are errors, as for :class:`ProfileSettings`)."""
        c = Checker("profile", cfg.get("profile"), PROFILE_KEYS)
        c.string("path", none=True)
        out = c.string("analysis_dir", none=True)
        c.done()
        return cls(Path(out) if out else None)


SETTINGS: dict[str, type | dict[str, type]] = {"profile": ProfileSettings}


def _increasing(values: Any, *, whole: bool) -> tuple[float, ...] | None:
    """``values`` as a tuple when it is a list of increasing positive numbers (integers with ``whole``)."""
    if isinstance(values, str) or not isinstance(values, Sequence) or not values:
        return None
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in values):
        return None
    if whole and any(v != int(v) for v in values):
        return None
    out = tuple(float(v) for v in values)
    if min(out) <= 0 or list(out) != sorted(set(out)):
        return None
    return out


def _device_kind(device: str) -> str:
    if device == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if device == "cuda":
        raise ConfigError(
            "profile.device=cuda but torch.cuda.is_available() is False (CPU-only torch build or no GPU "
            "visible; SLURM gres alone does not provide CUDA); use profile.device=auto or cpu."
        )
    return "cpu"


def _whole_gpu_gb() -> float:
    """GiB of GPU 0: the one slice when neither ``profile.slices_gb`` nor the cluster lists any."""
    return round(torch.cuda.get_device_properties(0).total_memory / GIB, 3)


def mpi_main(cfg: dict[str, Any], run_dir: str, comm: Any | None = None) -> dict[str, Any] | None:
    """The profile stage on MPI ranks: divide the missing cells, profile, merge on rank 0.

    Rank 0 opens (or resumes) the profile, folds in part files left by an interrupted run and
    broadcasts the missing cells; every rank measures whole (component, slice) rows into its
    own part file (flushed per cell); rank 0 merges the parts into the profile and marks it
    complete when nothing is missing.  See [Note: stage entry points] (docs/architecture.md).

    Returns
    -------
    dict or None
        On rank 0 a summary (path, cells, complete, interrupted, wall time); None elsewhere.
    """
    from hpcsplit.core import mpi  # initialises MPI: this module also serves stage=analyze on the login side

    s = ProfileSettings.from_config(cfg)
    paths = RunPaths.from_config(cfg, run_dir)
    return profile_components_mpi(paths.switchboard, s, paths.profile, mpi.get_comm(comm), s.rank_silence_s)


def run_analyze(cfg: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The analyze stage: ``profile.path`` (default: the run folder's profile) -> tables + PNGs.

    Returns
    -------
    dict
        Paths of the tables and plots, and how many cells the profile holds.

    Raises
    ------
    ProfileFormatError
        The profile is missing or malformed.
    """
    paths = RunPaths.from_config(cfg, run_dir)
    a = AnalyzeSettings.from_config(cfg)
    return analyze_file(paths.profile, a.analysis_dir or paths.analysis_dir)
