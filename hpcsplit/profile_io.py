"""The versioned HDF5 profile schema: :class:`Profile`, :func:`read_profile` and the writer.

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

import datetime as _dt
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Self

import numpy as np

from hpcsplit.errors import ProfileError, ProfileFormatError

__all__ = [
    "FORMAT_NAME",
    "SCHEMA_VERSION",
    "CellResult",
    "ComponentLayout",
    "ComponentProfile",
    "Profile",
    "ProfileMeta",
    "ProfileWriter",
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
    bs = tuple(int(x) for x in g["batch_size"][()])
    sl = tuple(float(x) for x in g["slice"][()])
    n_iter = int(g["iteration"].shape[0]) if "iteration" in g else int(g["latency_ms"].shape[2])
    arrays: dict[str, np.ndarray] = {}
    for ds, (axes, _dtype, _fill) in {**_GRID_DATASETS, **_BATCH_DATASETS}.items():
        arr = np.asarray(g[ds][()])
        want = {"batch_size": len(bs), "slice": len(sl), "iteration": n_iter}
        shape = tuple(want[x] for x in axes)
        if arr.shape != shape:
            problems.append(f"dataset {ds!r} has shape {arr.shape}, expected {shape} (axes {axes})")
        arr.flags.writeable = False
        arrays[ds] = arr
    measured, oom = arrays["measured"].astype(bool), arrays["oom"].astype(bool)
    holes = measured & ~oom & ~np.isfinite(arrays["latency_ms"]).all(axis=2)
    if holes.any():
        b, s = (int(i[0]) for i in np.nonzero(holes))
        problems.append(
            f"{int(holes.sum())} cell(s) flagged measured without latencies (first: batch_size={bs[b]}, "
            f"slice={sl[s]:g})"
        )
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


def read_profile(path: str | Path, *, allow_incomplete: bool = False) -> Profile:
    """Read and validate a profile file.

    Parameters
    ----------
    path
        An HDF5 file written by :func:`hpcsplit.profiling.profile_components`.
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
    if not path.is_file():
        raise ProfileFormatError(f"profile file {path} does not exist; run the profile stage first.")
    h5py = _h5py()
    try:
        f = h5py.File(path, "r", locking=False)
    except OSError as e:
        raise ProfileFormatError(
            f"{path}: cannot be opened as HDF5 ({e}); the file is truncated or not a profile: profile again."
        ) from e
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
    except (OSError, KeyError, ValueError) as e:
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


def _utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ProfileWriter:
    """Create or resume a profile file and write measured cells into it, one flush per cell.

    Use :meth:`open` (creates the file, or resumes an existing one after checking that it
    has the same grid, components and switchboard), then :meth:`write_cell` per cell,
    :meth:`finish` to mark it complete when every cell is measured, and :meth:`close`.
    """

    def __init__(self, path: Path, h5file: Any) -> None:
        self.path = path
        self._f = h5file

    # -- opening -------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        meta: ProfileMeta,
        components: Sequence[ComponentLayout],
        batch_sizes: Sequence[int],
        slices: Sequence[float],
    ) -> ProfileWriter:
        """Open ``path`` for writing: create it, or resume it if it holds the same grid.

        Raises
        ------
        ProfileFormatError
            An existing file is unreadable or of another schema version.
        ProfileError
            An existing file was made for another switchboard, grid, device or component set.
        """
        path = Path(path)
        h5py = _h5py()
        if path.exists():
            read_profile(path, allow_incomplete=True)  # validates the schema
            try:
                f = h5py.File(path, "r+", locking=False)
            except OSError as e:
                raise ProfileFormatError(f"{path}: cannot be opened for resuming ({e}).") from e
            w = cls(path, f)
            try:
                w._check_resumable(meta, components, batch_sizes, slices)
            except BaseException:
                f.close()
                raise
            return w
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".creating")
        try:
            with h5py.File(tmp, "w", locking=False) as f:
                cls._create(f, meta, components, batch_sizes, slices)
            tmp.replace(path)  # the file appears whole or not at all
        except OSError as e:
            raise ProfileError(f"cannot create profile file {path}: {e}") from e
        return cls(path, h5py.File(path, "r+", locking=False))

    @staticmethod
    def _create(
        f: Any,
        meta: ProfileMeta,
        components: Sequence[ComponentLayout],
        batch_sizes: Sequence[int],
        slices: Sequence[float],
    ) -> None:
        h5py = _h5py()
        f.attrs["format"] = FORMAT_NAME
        for fl in fields(ProfileMeta):
            v = getattr(meta, fl.name)
            if fl.name == "component_order":
                v = np.array([c.name for c in components], dtype=h5py.string_dtype())
            elif fl.name == "complete":
                v = np.bool_(False)
            elif fl.name == "schema_version":
                v = np.int64(SCHEMA_VERSION)
            elif isinstance(v, str):
                v = str(v)  # plain str (torch.__version__ is a str subclass h5py cannot store)
            elif isinstance(v, int):
                v = np.int64(v)
            f.attrs[fl.name] = v
        n_b, n_s, n_i = len(batch_sizes), len(slices), int(meta.iters)
        cg = f.create_group("components")
        for order, comp in enumerate(components):
            g = cg.create_group(comp.name)
            g.attrs["param_bytes"] = np.int64(comp.param_bytes)
            g.attrs["input_bytes_per_sample"] = np.int64(comp.input_bytes_per_sample)
            g.attrs["output_bytes_per_sample"] = np.int64(comp.output_bytes_per_sample)
            g.attrs["order"] = np.int64(order)
            scales = {
                "batch_size": g.create_dataset("batch_size", data=np.asarray(batch_sizes, np.int64)),
                "slice": g.create_dataset("slice", data=np.asarray(slices, np.float64)),
                "iteration": g.create_dataset("iteration", data=np.arange(n_i, dtype=np.int64)),
            }
            scales["slice"].attrs["units"] = meta.slice_unit
            for name, ds in scales.items():
                ds.make_scale(name)
            sizes = {"batch_size": n_b, "slice": n_s, "iteration": n_i}
            for name, (axes, dtype, fill) in {**_GRID_DATASETS, **_BATCH_DATASETS}.items():
                shape = tuple(sizes[a] for a in axes)
                ds = g.create_dataset(name, data=np.full(shape, fill, dtype=dtype))
                ds.attrs["axes"] = np.array(axes, dtype=h5py.string_dtype())
                for i, a in enumerate(axes):
                    ds.dims[i].label = a
                    ds.dims[i].attach_scale(scales[a])

    def _check_resumable(
        self,
        meta: ProfileMeta,
        components: Sequence[ComponentLayout],
        batch_sizes: Sequence[int],
        slices: Sequence[float],
    ) -> None:
        a = self._f.attrs
        diffs = []
        for key in ("switchboard_sha256", "device_kind", "slice_unit", "iters", "model"):
            old, new = a[key], getattr(meta, key)
            if _attr_str(old) != _attr_str(new):
                diffs.append(f"{key}: file has {_attr_str(old)!r}, this run {new!r}")
        if meta.device_kind == "cuda" and _attr_str(a["device_name"]) != meta.device_name:
            diffs.append(
                f"device_name: file has {_attr_str(a['device_name'])!r}, this run {meta.device_name!r}"
            )
        old_comps = [_attr_str(x) for x in np.atleast_1d(a["component_order"])]
        if old_comps != [c.name for c in components]:
            diffs.append(f"components: file has {old_comps}, this run {[c.name for c in components]}")
        else:
            g0 = self._f["components"][old_comps[0]] if old_comps else None
            if g0 is not None:
                old_b, new_b = [int(x) for x in g0["batch_size"][()]], [int(b) for b in batch_sizes]
                if old_b != new_b:
                    diffs.append(f"batch sizes: file has {old_b}, this run {new_b}")
                old_s, new_s = [float(x) for x in g0["slice"][()]], [float(x) for x in slices]
                if old_s != new_s:
                    diffs.append(f"slices: file has {old_s}, this run {new_s}")
        if diffs:
            raise ProfileError(
                f"{self.path} exists but was made for another profiling run ({'; '.join(diffs)}); "
                "delete it or set profile.path to a new file to profile from scratch."
            )

    # -- cells ----------------------------------------------------------------------------------
    def measured(self, component: str) -> np.ndarray:
        """Boolean ``[n_batch, n_slice]`` mask of the cells already measured."""
        return np.asarray(self._f["components"][component]["measured"][()], dtype=bool)

    def first_oom(self, component: str, s_idx: int) -> int | None:
        """Index of the smallest batch size measured out of memory in one slice's row, or None."""
        g = self._f["components"][component]
        oom = np.asarray(g["oom"][:, s_idx], bool) & np.asarray(g["measured"][:, s_idx], bool)
        idx = np.nonzero(oom)[0]
        return int(idx[0]) if idx.size else None

    def missing_cells(self) -> list[tuple[str, int, int]]:
        """``(component, b_idx, s_idx)`` of every cell not yet measured, in file order."""
        out = []
        for name in self.component_names:
            m = self.measured(name)
            out += [(name, int(b), int(s)) for b, s in zip(*np.nonzero(~m), strict=True)]
        return out

    @property
    def component_names(self) -> list[str]:
        return [_attr_str(x) for x in np.atleast_1d(self._f.attrs["component_order"])]

    def write_cell(self, cell: CellResult) -> None:
        """Write one cell: data, flush, then the ``measured`` flag, flush (see the Note above)."""
        g = self._f["components"][cell.component]
        b, s = cell.b_idx, cell.s_idx
        if bool(g["measured"][b, s]):
            return  # never rewrite a measured cell
        n_i = g["latency_ms"].shape[2]
        lat = np.full(n_i, np.nan)
        if cell.latency_ms:
            if len(cell.latency_ms) != n_i:
                raise ProfileError(f"cell has {len(cell.latency_ms)} timed runs, the file expects {n_i}")
            lat[:] = cell.latency_ms
        g["latency_ms"][b, s, :] = lat
        g["peak_mem_bytes"][b, s] = cell.peak_mem_bytes
        g["utilization"][b, s] = cell.utilization
        g["cpu_busy_fraction"][b, s] = cell.cpu_busy_fraction
        g["oom"][b, s] = cell.oom
        g["oom_inferred"][b, s] = cell.oom_inferred
        g["measured_by_rank"][b, s] = cell.rank
        g["measured_unix_s"][b, s] = cell.measured_unix_s
        if cell.input_bytes >= 0:
            g["input_bytes"][b] = cell.input_bytes
        if cell.output_bytes >= 0:
            g["output_bytes"][b] = cell.output_bytes
        self._f.flush()
        g["measured"][b, s] = True
        self._f.flush()

    def merge_from(self, other: str | Path) -> int:
        """Copy every cell measured in ``other`` (a part file of the same grid) and not here.

        Returns the number of cells copied.  Values are copied exactly (byte-identical).
        """
        h5py = _h5py()
        n = 0
        with h5py.File(other, "r", locking=False) as src:
            for name in self.component_names:
                gs, gd = src["components"][name], self._f["components"][name]
                todo = np.asarray(gs["measured"][()], bool) & ~np.asarray(gd["measured"][()], bool)
                for b, s in zip(*np.nonzero(todo), strict=True):
                    for ds in _GRID_DATASETS:
                        if ds != "measured":
                            gd[ds][b, s] = gs[ds][b, s]
                    for ds in _BATCH_DATASETS:
                        if gs[ds][b] >= 0:
                            gd[ds][b] = gs[ds][b]
                    n += 1
                if todo.any():
                    self._f.flush()
                    m = np.asarray(gd["measured"][()], bool) | todo
                    gd["measured"][...] = m
                    self._f.flush()
        return n

    def finish(self) -> bool:
        """Mark the file complete if every cell is measured; return whether it is."""
        done = not self.missing_cells()
        self._f.attrs["updated_utc"] = _utc_now()
        if done:
            self._f.attrs["complete"] = np.bool_(True)
        self._f.flush()
        return done

    def close(self) -> None:
        if self._f.id.valid:
            self._f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def grid_cells(names: Iterable[str], n_batch: int, n_slice: int) -> list[tuple[str, int, int]]:
    """All ``(component, b_idx, s_idx)`` cells of a grid, component-major."""
    return [(n, b, s) for n in names for s in range(n_slice) for b in range(n_batch)]
