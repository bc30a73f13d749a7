"""The versioned HDF5 profile schema: :class:`Profile` and :func:`read_profile` (the writer is
:mod:`hpcsplit.core.profile_writer`).

[Note: profile contract] (docs/architecture.md) — the allocator only sees the frozen
dataclasses of this module, never h5py.  The on-disk format is documented in
``docs/profile-format.md``; keep both in step and bump :data:`SCHEMA_VERSION` on any
incompatible change.

[Note: profile crash safety]
- Every dataset is written whole at creation (contiguous, space allocated at once), so
  measuring a cell only overwrites raw data in place and never changes HDF5 metadata;
  the file stays openable whatever moment a process is killed.
- A cell is written data first, then flushed, then its ``measured`` flag is set and
  flushed again: a kill between the two leaves the cell unmeasured (it is measured
  again on resume), never half-measured but flagged.
- The root attribute ``complete`` is ``False`` from creation until every cell is measured;
  :func:`read_profile` refuses an incomplete file unless ``allow_incomplete=True``.
- Resuming never rewrites a measured cell, so earlier cells stay byte-identical.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from hpcsplit.core.hdf5 import open_self_contained
from hpcsplit.errors import ProfileFormatError

__all__ = [
    "FORMAT_NAME",
    "SCHEMA_VERSION",
    "CellResult",
    "ComponentLayout",
    "ComponentProfile",
    "Profile",
    "ProfileMeta",
    "read_profile",
]

FORMAT_NAME = "hpcsplit-profile"
SCHEMA_VERSION = 1

# name -> (axes, dtype, fill); the per-component datasets of schema version 1.
_GRID_DATASETS: dict[str, tuple[tuple[str, ...], str, Any]] = {
    "latency_ms": (("batch_size", "slice", "iteration"), "f8", np.nan),
    "peak_mem_bytes": (("batch_size", "slice"), "f8", np.nan),
    "utilization": (("batch_size", "slice"), "f8", np.nan),
    "cpu_busy_fraction": (("batch_size", "slice"), "f8", np.nan),
    "oom": (("batch_size", "slice"), "bool", False),
    "oom_inferred": (("batch_size", "slice"), "bool", False),
    "measured_by_rank": (("batch_size", "slice"), "i4", -1),
    "measured_unix_s": (("batch_size", "slice"), "f8", np.nan),
    "measured": (("batch_size", "slice"), "bool", False),
}
_BATCH_DATASETS: dict[str, tuple[tuple[str, ...], str, Any]] = {
    "input_bytes": (("batch_size",), "i8", -1),
    "output_bytes": (("batch_size",), "i8", -1),
}
_COMPONENT_ATTRS = ("param_bytes", "input_bytes_per_sample", "output_bytes_per_sample", "order")


@dataclass(frozen=True, slots=True)
class ProfileMeta:
    """File-level attributes of a profile (one per HDF5 root attribute of the same name)."""

    schema_version: int
    hpcsplit_version: str
    switchboard_sha256: str
    model: str
    host: str
    device_kind: str  # "cuda" | "cpu"
    device_name: str
    device_mem_bytes: int  # total memory of the device (0 on CPU)
    driver_version: str  # NVIDIA driver ("" on CPU)
    torch_version: str
    cuda_version: str  # torch.version.cuda ("" on CPU builds)
    created_utc: str
    slice_unit: str  # "gb" | "threads"
    slice_semantics: str
    latency_timer: str
    peak_mem_method: str
    utilization_method: str
    cores_per_node: int
    warmup: int
    iters: int
    mig_device: str  # MIG device/instance the rank ran in, "" if none
    mps_active_thread_percentage: str  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, "" if unset
    mps_pinned_device_mem_limit: str  # CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "" if unset
    component_order: tuple[str, ...]
    complete: bool = False
    updated_utc: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class ComponentProfile:
    """Measurements of one component over the batch-size x slice grid.

    Arrays are read-only numpy arrays; NaN where not measured (or out of memory).
    """

    name: str
    batch_sizes: tuple[int, ...]
    slices: tuple[float, ...]  # GB on GPU, threads on CPU (see ProfileMeta.slice_unit)
    latency_ms: np.ndarray  # [n_batch, n_slice, n_iter]
    peak_mem_bytes: np.ndarray  # [n_batch, n_slice]
    utilization: np.ndarray  # [n_batch, n_slice], 0..1
    oom: np.ndarray  # bool [n_batch, n_slice]
    measured: np.ndarray  # bool [n_batch, n_slice]
    param_bytes: int
    input_bytes_per_sample: int
    output_bytes_per_sample: int
    cpu_busy_fraction: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    oom_inferred: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), bool))
    input_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    output_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    measured_by_rank: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int32))

    @property
    def n_iter(self) -> int:
        return int(self.latency_ms.shape[2])

    def latency_quantile_ms(self, b_idx: int, s_idx: int, q: float) -> float:
        """Quantile ``q`` (0..1) of the timed runs of one cell; NaN if not measured or OOM."""
        row = self.latency_ms[b_idx, s_idx]
        row = row[~np.isnan(row)]
        return float(np.quantile(row, q)) if row.size else math.nan

    def latency_p50_ms(self, b_idx: int, s_idx: int) -> float:
        """Median latency of one cell in ms (NaN if not measured or OOM)."""
        return self.latency_quantile_ms(b_idx, s_idx, 0.5)

    def latency_p99_ms(self, b_idx: int, s_idx: int) -> float:
        """99th percentile latency of one cell in ms."""
        return self.latency_quantile_ms(b_idx, s_idx, 0.99)

    def throughput_rps(self, b_idx: int, s_idx: int) -> float:
        """Samples per second of one cell: batch size / p50 latency (NaN if not measured)."""
        p50 = self.latency_p50_ms(b_idx, s_idx)
        return self.batch_sizes[b_idx] / (p50 / 1e3) if p50 > 0 else math.nan


@dataclass(frozen=True, slots=True)
class Profile:
    """A whole profile: file metadata and one :class:`ComponentProfile` per component."""

    meta: ProfileMeta
    components: dict[str, ComponentProfile]

    @property
    def complete(self) -> bool:
        return self.meta.complete

    def n_cells(self) -> tuple[int, int]:
        """``(measured, total)`` cells over all components."""
        done = sum(int(c.measured.sum()) for c in self.components.values())
        total = sum(int(c.measured.size) for c in self.components.values())
        return done, total


@dataclass(frozen=True, slots=True)
class ComponentLayout:
    """What the writer needs to lay out one component's group."""

    name: str
    param_bytes: int
    input_bytes_per_sample: int
    output_bytes_per_sample: int


@dataclass(frozen=True, slots=True)
class CellResult:
    """One measured cell (one component, batch size and slice)."""

    component: str
    b_idx: int
    s_idx: int
    latency_ms: tuple[float, ...]  # n_iter values, empty when OOM
    peak_mem_bytes: float
    utilization: float
    cpu_busy_fraction: float
    oom: bool
    oom_inferred: bool
    input_bytes: int
    output_bytes: int
    rank: int
    measured_unix_s: float


# ---------------------------------------------------------------------------------------------- reading


def _h5py() -> Any:
    import h5py

    return h5py


def _attr_str(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _meta_from_attrs(attrs: Any, path: Path) -> ProfileMeta:
    missing = [f.name for f in fields(ProfileMeta) if f.name not in attrs and f.name != "updated_utc"]
    if missing:
        raise ProfileFormatError(
            f"{path}: root attributes missing: {', '.join(missing)} (schema version {SCHEMA_VERSION} needs "
            "them all); the file was not written by hpcsplit's profiler or is damaged: profile again."
        )
    kw: dict[str, Any] = {}
    for f in fields(ProfileMeta):
        v = attrs.get(f.name, "")
        if f.name == "component_order":
            kw[f.name] = tuple(_attr_str(x) for x in np.atleast_1d(v))
        elif f.name == "complete":
            kw[f.name] = bool(v)
        elif f.type == "int":
            kw[f.name] = int(v)
        else:
            kw[f.name] = _attr_str(v)
    return ProfileMeta(**kw)


def _check_header(f: Any, path: Path) -> None:
    fmt = _attr_str(f.attrs.get("format", ""))
    if fmt != FORMAT_NAME:
        raise ProfileFormatError(
            f"{path}: root attribute format={fmt!r}, expected {FORMAT_NAME!r}: not an hpcsplit profile."
        )
    ver = f.attrs.get("schema_version")
    if ver is None or int(ver) != SCHEMA_VERSION:
        found = "missing" if ver is None else f"{_attr_str(ver)}"
        raise ProfileFormatError(
            f"{path}: schema_version={found}, this hpcsplit reads schema version {SCHEMA_VERSION}; "
            "profile again with this version (or read it with the hpcsplit that wrote it)."
        )


def _read_component(g: Any, name: str, path: Path) -> ComponentProfile:
    where = f"{path}: component {name!r}"
    problems = []
    for ds in ("batch_size", "slice", *_GRID_DATASETS, *_BATCH_DATASETS):
        if ds not in g:
            problems.append(f"dataset {ds!r} missing")
    for a in _COMPONENT_ATTRS:
        if a not in g.attrs:
            problems.append(f"attribute {a!r} missing")
    if problems:
        raise ProfileFormatError(f"{where}: {'; '.join(problems)}; the file is damaged: profile again.")
    problems += _check_kinds(g)
    if problems:
        raise ProfileFormatError(f"{where}: {'; '.join(problems)}; the file is damaged: profile again.")
    bs_arr, sl_arr = np.asarray(g["batch_size"][()]), np.asarray(g["slice"][()])
    problems += _check_axes(bs_arr, sl_arr)
    if g["latency_ms"].ndim != 3 or g["latency_ms"].shape[2] < 1:
        problems.append(f"dataset 'latency_ms' has shape {g['latency_ms'].shape}, needs 3 axes and >= 1 timed run")
    if problems:
        raise ProfileFormatError(f"{where}: {'; '.join(problems)}; the file is damaged: profile again.")
    bs = tuple(int(x) for x in bs_arr)
    sl = tuple(float(x) for x in sl_arr)
    n_iter = int(g["latency_ms"].shape[2])
    arrays: dict[str, np.ndarray] = {}
    for ds, (axes, _dtype, _fill) in {**_GRID_DATASETS, **_BATCH_DATASETS}.items():
        arr = np.asarray(g[ds][()])
        want = {"batch_size": len(bs), "slice": len(sl), "iteration": n_iter}
        shape = tuple(want[x] for x in axes)
        if arr.shape != shape:
            problems.append(f"dataset {ds!r} has shape {arr.shape}, expected {shape} (axes {axes})")
        arr.flags.writeable = False
        arrays[ds] = arr
    if problems:
        raise ProfileFormatError(f"{where}: {'; '.join(problems)}; the file is damaged: profile again.")
    measured, oom = arrays["measured"].astype(bool), arrays["oom"].astype(bool)
    holes = measured & ~oom & ~np.isfinite(arrays["latency_ms"]).all(axis=2)
    if holes.any():
        b, s = (int(i[0]) for i in np.nonzero(holes))
        problems.append(
            f"{int(holes.sum())} cell(s) flagged measured without latencies (first: batch_size={bs[b]}, "
            f"slice={sl[s]:g})"
        )
    else:
        problems += _check_cells(arrays, measured & ~oom, bs, sl)
    for a in _COMPONENT_ATTRS:
        v = g.attrs[a]
        if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer) or not 0 <= int(v) < _MAX_BYTES:
            problems.append(f"attribute {a!r} = {v!r}: needs a whole number in [0, 2**50)")
    if problems:
        raise ProfileFormatError(f"{where}: {'; '.join(problems)}; the file is damaged: profile again.")
    return ComponentProfile(
        name=name,
        batch_sizes=bs,
        slices=sl,
        latency_ms=arrays["latency_ms"],
        peak_mem_bytes=arrays["peak_mem_bytes"],
        utilization=arrays["utilization"],
        oom=oom,
        measured=measured,
        param_bytes=int(g.attrs["param_bytes"]),
        input_bytes_per_sample=int(g.attrs["input_bytes_per_sample"]),
        output_bytes_per_sample=int(g.attrs["output_bytes_per_sample"]),
        cpu_busy_fraction=arrays["cpu_busy_fraction"],
        oom_inferred=arrays["oom_inferred"].astype(bool),
        input_bytes=arrays["input_bytes"],
        output_bytes=arrays["output_bytes"],
        measured_by_rank=arrays["measured_by_rank"],
    )


_MAX_BATCH = 1 << 20  # batch sizes above this are not a profile's
_MAX_BYTES = 1 << 50
_KINDS = {"f8": "f", "bool": "b", "i4": "iu", "i8": "iu"}


def _check_kinds(g: Any) -> list[str]:
    """Datasets of the wrong element kind (a string where numbers belong) or not plain arrays."""
    out = []
    for ds, (_axes, dtype, _fill) in {**_GRID_DATASETS, **_BATCH_DATASETS}.items():
        if not hasattr(g[ds], "dtype"):
            out.append(f"{ds!r} is not a dataset")
        elif g[ds].dtype.kind not in _KINDS[dtype]:
            out.append(f"dataset {ds!r} holds {g[ds].dtype}, needs {dtype}")
    for ds, kinds in (("batch_size", "iu"), ("slice", "fiu")):
        d = g[ds]
        if not hasattr(d, "dtype") or d.dtype.kind not in kinds or d.ndim != 1:
            out.append(f"dataset {ds!r} needs a 1-d array of numbers")
    return out


def _check_axes(bs: np.ndarray, sl: np.ndarray) -> list[str]:
    out = []
    if bs.size == 0 or (bs < 1).any() or (bs > _MAX_BATCH).any() or (np.diff(bs) <= 0).any():
        out.append(f"batch sizes {bs.tolist()[:8]}: need increasing integers in [1, {_MAX_BATCH}]")
    if sl.size == 0 or not np.isfinite(sl).all() or (sl <= 0).any() or (np.diff(sl) <= 0).any():
        out.append(f"slices {sl.tolist()[:8]}: need increasing finite numbers > 0")
    return out


def _check_cells(arrays: dict[str, np.ndarray], ran: np.ndarray, bs: Sequence[int], sl: Sequence[float]) -> list[str]:
    """Range checks of the cells that ran (measured, not out of memory), naming the first bad cell."""
    checks = (
        ("latency_ms", lambda a: np.isfinite(a).all(axis=-1) & (a > 0).all(axis=-1), "finite and > 0"),
        ("peak_mem_bytes", lambda a: np.isfinite(a) & (a >= 0) & (a < _MAX_BYTES), "finite, >= 0 and < 2**50"),
        ("utilization", lambda a: np.isnan(a) | ((a >= 0) & (a <= 1.0 + 1e-6)), "in [0, 1] or NaN"),
        ("cpu_busy_fraction", lambda a: np.isnan(a) | ((a >= 0) & np.isfinite(a)), ">= 0 or NaN"),
    )
    out = []
    for ds, ok, need in checks:
        bad = ran & ~ok(arrays[ds])
        if bad.any():
            b, s = (int(i[0]) for i in np.nonzero(bad))
            v = arrays[ds][b, s]
            shown = v.tolist() if np.ndim(v) == 0 else [float(x) for x in v[:4]]
            out.append(f"{ds} of cell batch_size={bs[b]}, slice={sl[s]:g} is {shown} (needs {need}; "
                       f"{int(bad.sum())} such cell(s))")
    for ds in _BATCH_DATASETS:
        a = arrays[ds]
        if ((a < -1) | (a >= _MAX_BYTES)).any():
            out.append(f"{ds} holds {a.tolist()[:8]} (needs -1 for unknown or bytes in [0, 2**50))")
    return out


def read_profile(path: str | Path, *, allow_incomplete: bool = False) -> Profile:
    """Read and validate a profile file.

    Parameters
    ----------
    path
        An HDF5 file written by :func:`hpcsplit.profiling.runner.profile_components`.
    allow_incomplete
        Accept a file whose profiling run has not finished (``complete=False``); its
        unmeasured cells are NaN and ``measured`` is ``False`` there.

    Returns
    -------
    Profile

    Raises
    ------
    ProfileFormatError
        The file is missing, not HDF5 (e.g. truncated), of another schema version, lacks a
        required attribute or dataset, or is incomplete (unless ``allow_incomplete``).
    """
    path = Path(path)
    if path.is_dir():
        raise ProfileFormatError(f"{path} is a folder, not a profile file; pass the profile.h5 inside it.")
    if not path.is_file():
        raise ProfileFormatError(f"profile file {path} does not exist; run the profile stage first.")
    f = open_self_contained(path, lambda msg: ProfileFormatError(msg + ": profile again."), "profile")
    try:
        with f:
            _check_header(f, path)
            meta = _meta_from_attrs(f.attrs, path)
            if "components" not in f:
                raise ProfileFormatError(f"{path}: group '/components' missing; profile again.")
            cg = f["components"]
            missing = [n for n in meta.component_order if n not in cg]
            if missing:
                raise ProfileFormatError(
                    f"{path}: component group(s) {missing} listed in component_order are missing; profile again."
                )
            comps = {n: _read_component(cg[n], n, path) for n in meta.component_order}
    except (OSError, KeyError, ValueError, TypeError, AttributeError) as e:
        raise ProfileFormatError(f"{path}: unreadable ({type(e).__name__}: {e}); profile again.") from e
    prof = Profile(meta=meta, components=comps)
    done, total = prof.n_cells()
    if meta.complete and done != total:
        raise ProfileFormatError(
            f"{path}: marked complete but only {done}/{total} cells are measured; the file is damaged."
        )
    if not meta.complete and not allow_incomplete:
        raise ProfileFormatError(
            f"{path}: profiling did not finish (complete=False, {done}/{total} cells measured); "
            "resume it by running the profile stage again with the same profile.path, "
            "or pass allow_incomplete=True to read what is there."
        )
    return prof


# ---------------------------------------------------------------------------------------------- writing
