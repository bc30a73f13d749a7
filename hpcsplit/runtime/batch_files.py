"""Batch mode's files: model inputs from ``.npz`` / HDF5, outputs (one row per request) to ``.npz`` / HDF5.

``runtime.input_path`` holds one array per model input, samples first (by name, or positional
``arr_i``); the outputs file (``runtime.output_path``, default ``RunPaths.batch_outputs``) holds each
output in request order, a ``done`` mask (rows not done are zeros) and ``latency_ms``.

[Note: batch outputs on disk]
Inputs are checked at the frontend before any request is sent (:func:`read_inputs`: names, dtypes,
shapes against the switchboard's layout, equal sample counts; ``.npz`` without pickles, ``.h5`` only
when self-contained, ``[Note: self-contained HDF5]`` in :mod:`hpcsplit.core.hdf5`).  The output path is
checked before any work too (:func:`check_output_path`): its folder must be writable, and an existing
file is replaced only when it is an earlier hpcsplit outputs file (HDF5 attribute / ``.npz`` entry
:data:`MARKER`) or ``runtime.overwrite`` is true.

Batch mode itself streams (``[Note: streaming batch mode]`` in :mod:`hpcsplit.runtime.batch_stream`:
chunked inputs, a resumable outputs file); the whole-file readers and :class:`OutputWriter` here serve
small files and callers that hold their rows in memory.

A job can be killed outright (a rank SIGKILLed: hydra then kills every rank at once), so the outputs
are written as they finish (:class:`OutputWriter`): an HDF5 file of fixed-size contiguous datasets,
rows written first and their ``done`` flags after them, flushed at most every
:data:`FLUSH_EVERY_S`; the file on disk is readable at any moment and its ``done`` rows are whole.  An
``.npz`` cannot grow, so it is written at the end (or on error) from the stream kept next to it in
``<output>.partial.h5``, which is removed once the ``.npz`` is there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcsplit.core.hdf5 import open_self_contained
from hpcsplit.errors import RuntimeStageError
from hpcsplit.switchboard.layout import TensorSpec

__all__ = ["FLUSH_EVERY_S", "MARKER", "OutputWriter", "check_array_meta", "check_output_path", "host_row",
           "read_inputs", "write_outputs"]

MARKER = "hpcsplit_outputs"  # HDF5 attribute / .npz entry naming an hpcsplit batch outputs file
FLUSH_EVERY_S = 0.5


# ------------------------------------------------------------------------------------------- inputs
def _load_arrays(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except ValueError as e:  # object arrays need pickle: refused
            raise RuntimeStageError(f"runtime.input_path={path}: {e}; save plain numeric arrays "
                                    "(np.savez with numpy arrays, no Python objects)") from e
        except (OSError, EOFError) as e:
            raise RuntimeStageError(f"runtime.input_path={path}: cannot be read as .npz ({e})") from e
    f = open_self_contained(path, RuntimeStageError, "batch input file")
    try:
        out = {}
        for k in f:
            obj = f[k]
            if hasattr(obj, "shape"):
                if obj.dtype.kind in "OSUV":
                    raise RuntimeStageError(f"runtime.input_path={path}: array {k!r} has dtype {obj.dtype}; "
                                            "the model takes numeric arrays")
                out[k] = obj[()]
        return out
    finally:
        f.close()


def check_array_meta(path: Path, name: str, shape: tuple[int, ...], dtype: np.dtype,
                     spec: TensorSpec | None) -> None:
    """Check one input array's dtype and per-sample shape (samples first) against ``spec``; the error
    names the file, the array and what was expected."""
    if dtype.kind in "OSUV":
        raise RuntimeStageError(f"runtime.input_path={path}: array {name!r} has dtype {dtype}; the model "
                                "takes numeric arrays")
    if len(shape) == 0:
        raise RuntimeStageError(f"runtime.input_path={path}: array {name!r} is a single value (0-d); it needs "
                                "the samples first (shape (n, ...))")
    if spec is None:
        return
    want = list(spec.shape)
    if "batch" in want:
        want.remove("batch")  # samples first in the file
    need = ("n", *want)
    fixed = [(i + 1, d) for i, d in enumerate(want) if isinstance(d, int)]
    if len(shape) != len(need) or any(shape[i] != d for i, d in fixed):
        raise RuntimeStageError(
            f"runtime.input_path={path}: array {name!r} has shape {tuple(shape)}; the model needs "
            f"{tuple(need)} (samples first, then the shape of one sample). Reshape it, or check it is the "
            "input of this switchboard"
        )
    dt = str(dtype)
    if dt != spec.dtype and not (spec.dtype == "bfloat16" and dt == "float32"):
        # (numpy has no bfloat16: float32 holds every value; converted by torch)
        raise RuntimeStageError(
            f"runtime.input_path={path}: array {name!r} has dtype {dt}; the model needs {spec.dtype}. Convert "
            f"it (numpy: a.astype('{spec.dtype}')) and save the file again"
        )


def _check_array(path: Path, name: str, arr: np.ndarray, spec: TensorSpec | None) -> np.ndarray:
    check_array_meta(path, name, tuple(arr.shape), arr.dtype, spec)
    return arr


def read_inputs(path: str | Path, names: tuple[str, ...],
                specs: Sequence[TensorSpec] | None = None) -> list[np.ndarray]:
    """Model inputs from an ``.npz`` or HDF5 file: one array per input name (positional ``arr_i`` too).

    With ``specs`` (the switchboard's ``layout.inputs``, in ``names`` order) each array's dtype and
    per-sample shape are checked too; every error names the file, the array and what was expected.
    """
    path = Path(path)
    if not path.exists():
        raise RuntimeStageError(f"runtime.input_path={path} does not exist; give an .npz or .h5 file "
                                f"with arrays {list(names)} (samples first)")
    data = _load_arrays(path)
    out = []
    for i, n in enumerate(names):
        key = n if n in data else f"arr_{i}"
        arr = data.get(key)
        if arr is None:
            raise RuntimeStageError(f"{path} has arrays {sorted(data)}; the model needs {list(names)}")
        out.append(_check_array(path, key, arr, specs[i] if specs is not None else None))
    lens = {a.shape[0] for a in out}
    if len(lens) != 1:
        raise RuntimeStageError(f"{path}: the inputs have different sample counts {sorted(lens)}")
    if not lens or 0 in lens:
        raise RuntimeStageError(f"{path}: the inputs hold no samples")
    return out


# ------------------------------------------------------------------------------------------ outputs
def _is_ours(path: Path) -> bool:
    """Whether ``path`` is an hpcsplit batch outputs file (:data:`MARKER`)."""
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                return MARKER in z.files
        import h5py

        with h5py.File(path, "r", locking=False) as f:
            return bool(f.attrs.get(MARKER, False))
    except Exception:  # noqa: BLE001 - anything unreadable is not ours
        return False


def check_output_path(path: str | Path, overwrite: bool = False) -> Path:
    """Check, before any work, that the outputs can be written to ``path`` (``[Note: batch outputs on disk]``).

    Raises
    ------
    RuntimeStageError
        When its folder cannot be created or written, when it is a directory, or when it exists and is
        not an earlier hpcsplit outputs file (unless ``overwrite``).
    """
    path = Path(path)
    if path.suffix not in (".npz", ".h5", ".hdf5"):
        raise RuntimeStageError(f"runtime.output_path={path}: give a file ending in .npz or .h5")
    if path.is_dir():
        raise RuntimeStageError(f"runtime.output_path={path} is a directory; give a file path (.npz or .h5)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeStageError(f"runtime.output_path={path}: cannot create its folder ({e.strerror}); "
                                "give a path you can write") from e
    if not os.access(path.parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise RuntimeStageError(f"runtime.output_path={path} is not writable; give a path you can write")
    if path.exists() and not overwrite and not _is_ours(path):
        raise RuntimeStageError(
            f"runtime.output_path={path} exists and is not an hpcsplit outputs file; refusing to replace it. "
            "Give another path, or set runtime.overwrite=true to replace it on purpose"
        )
    return path


def write_outputs(path: str | Path, names: tuple[str, ...], arrays: list[np.ndarray | None],
                  done: np.ndarray, latency_ms: np.ndarray) -> Path:
    """Write outputs in input order plus a ``done`` mask (rows not done are zeros) to .npz or HDF5."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {n: a for n, a in zip(names, arrays, strict=True) if a is not None}
    data["done"] = done.astype(bool)
    data["latency_ms"] = latency_ms
    if path.suffix == ".npz":
        data[MARKER] = np.array(list(names))
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, **data)  # type: ignore[arg-type]
        os.replace(tmp, path)
    else:
        import h5py

        tmp = path.with_name(path.name + ".tmp.h5")
        with h5py.File(tmp, "w", locking=False) as f:
            for k, v in data.items():
                f.create_dataset(k.replace("/", "_"), data=v)
            f.attrs["outputs"] = list(names)
            f.attrs[MARKER] = True
        os.replace(tmp, path)
    return path


class OutputWriter:
    """Batch outputs written as requests finish (``[Note: batch outputs on disk]``).

    Call :meth:`row` for each finished request, :meth:`close` at the end (with the session's final
    ``done`` and latencies); :attr:`stream` is the HDF5 file on disk while the job runs.
    """

    def __init__(self, path: str | Path, names: tuple[str, ...], n: int) -> None:
        self.path = Path(path)
        self.names = names
        self.n = n
        self.stream = self.path if self.path.suffix != ".npz" else self.path.with_name(self.path.name + ".partial.h5")
        self.arrays: list[np.ndarray | None] = [None] * len(names)
        self.done = np.zeros(n, dtype=bool)
        self.latency_ms = np.full(n, np.nan)
        self._new: list[int] = []
        self._t0 = time.perf_counter()
        self._last_flush = self._t0
        import h5py

        try:
            self._f: Any = h5py.File(self.stream, "w", locking=False)
        except OSError as e:
            raise RuntimeStageError(f"runtime.output_path={self.path}: cannot create {self.stream} ({e})") from e
        self._f.attrs["outputs"] = list(names)
        self._f.attrs[MARKER] = True
        self._f.create_dataset("done", data=self.done)
        self._f.create_dataset("latency_ms", data=self.latency_ms)
        self._f.flush()

    def row(self, i: int, rows: list[np.ndarray]) -> None:
        """Request ``i`` finished with one array per output."""
        for j, r in enumerate(rows):
            a = self.arrays[j]
            if a is None:
                a = self.arrays[j] = np.zeros((self.n, *r.shape), dtype=r.dtype)
                self._f.create_dataset(self.names[j].replace("/", "_"), shape=a.shape, dtype=a.dtype)
            a[i] = r
        self.done[i] = True
        self.latency_ms[i] = (time.perf_counter() - self._t0) * 1e3
        self._new.append(i)
        if time.perf_counter() - self._last_flush > FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        """Rows first, then their ``done`` flags, each flushed: the file's done rows are whole."""
        if self._f is None or not self._new:
            return
        idx = sorted(self._new)
        self._new = []
        for j, a in enumerate(self.arrays):
            if a is not None:
                self._f[self.names[j].replace("/", "_")][idx] = a[idx]
        self._f.flush()
        self._f["done"][idx] = True
        self._f["latency_ms"][idx] = self.latency_ms[idx]
        self._f.flush()
        self._last_flush = time.perf_counter()

    def close(self, done: np.ndarray | None = None, latency_ms: np.ndarray | None = None) -> Path:
        """Write the final file (``done`` / ``latency_ms``: the session's, where known) and return its path."""
        if done is not None:
            self.done = np.asarray(done, dtype=bool) & self.done
        if latency_ms is not None:
            self.latency_ms = np.where(self.done, latency_ms, np.nan)
        if self._f is not None:
            self._f.close()
            self._f = None
        write_outputs(self.path, self.names, self.arrays, self.done, self.latency_ms)
        if self.stream != self.path:
            self.stream.unlink(missing_ok=True)
        return self.path


def host_row(r: torch.Tensor, rdim: int) -> np.ndarray:
    """One request's output (size 1 along ``rdim``) as the numpy array batch mode writes.

    numpy has no bfloat16: those are written as float32, which holds every bfloat16 value exactly.

    Examples
    --------
    >>> host_row(torch.ones(3, 1, dtype=torch.bfloat16), 1).dtype
    dtype('float32')
    """
    if r.dtype != torch.bfloat16 and r.device.type == "cpu":  # fast path: a numpy view, no torch op per row
        return r.numpy()[(slice(None),) * rdim + (0,)]
    row = r.movedim(rdim, 0)[0].cpu()
    if row.dtype == torch.bfloat16:
        row = row.float()
    return row.numpy()
