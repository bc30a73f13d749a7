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
chunked inputs, a resumable outputs file written as rows finish, each with its latency, so that a job
killed outright loses only the rows in flight); the whole-file readers and writer here serve small files
and callers that hold their rows in memory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from hpcsplit.core.hdf5 import open_self_contained
from hpcsplit.errors import RuntimeStageError
from hpcsplit.switchboard.layout import TensorSpec

__all__ = ["MARKER", "check_array_meta", "check_output_path", "host_row",
           "read_inputs", "write_outputs"]

MARKER = "hpcsplit_outputs"  # HDF5 attribute / .npz entry naming an hpcsplit batch outputs file


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
