"""Writing a profile file: create or resume it, one flushed cell at a time (``[Note: profile crash
safety]`` in :mod:`hpcsplit.core.profile_format`, which reads and validates the same format)."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Iterable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, Self

import numpy as np

from hpcsplit.core.hdf5 import WriterLock, open_self_contained
from hpcsplit.core.profile_format import (
    _BATCH_DATASETS,
    _GRID_DATASETS,
    FORMAT_NAME,
    SCHEMA_VERSION,
    CellResult,
    ComponentLayout,
    ProfileMeta,
    _attr_str,
    _h5py,
    read_profile,
)
from hpcsplit.errors import ProfileError, ProfileFormatError

__all__ = ["ProfileWriter", "grid_cells"]


def _utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ProfileWriter:
    """Create or resume a profile file and write measured cells into it, one flush per cell.

    Use :meth:`open` (creates the file, or resumes an existing one after checking that it
    has the same grid, components and switchboard), then :meth:`write_cell` per cell,
    :meth:`finish` to mark it complete when every cell is measured, and :meth:`close`.
    """

    def __init__(self, path: Path, h5file: Any, lock: WriterLock | None = None) -> None:
        self.path = path
        self._f = h5file
        self._lock = lock

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
            An existing file was made for another switchboard, grid, device or component set, or another
            process is writing the file (``<path>.lock``).
        """
        path = Path(path)
        lock = WriterLock(path, ProfileError, "profile").acquire()
        try:
            return cls._open_locked(path, lock, meta, components, batch_sizes, slices)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def _open_locked(
        cls,
        path: Path,
        lock: WriterLock,
        meta: ProfileMeta,
        components: Sequence[ComponentLayout],
        batch_sizes: Sequence[int],
        slices: Sequence[float],
    ) -> ProfileWriter:
        h5py = _h5py()
        if path.exists():
            read_profile(path, allow_incomplete=True)  # validates the schema
            try:
                f = h5py.File(path, "r+", locking=False)
            except OSError as e:
                raise ProfileFormatError(f"{path}: cannot be opened for resuming ({e}).") from e
            w = cls(path, f, lock)
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
        return cls(path, h5py.File(path, "r+", locking=False), lock)

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
        n = 0
        with open_self_contained(other, ProfileFormatError, "profile part file") as src:
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
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def grid_cells(names: Iterable[str], n_batch: int, n_slice: int) -> list[tuple[str, int, int]]:
    """All ``(component, b_idx, s_idx)`` cells of a grid, component-major."""
    return [(n, b, s) for n in names for s in range(n_slice) for b in range(n_batch)]
