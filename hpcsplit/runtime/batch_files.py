"""Batch mode's files: model inputs from ``.npz`` / HDF5, outputs (one row per request) to ``.npz`` / HDF5.

``runtime.input_path`` holds one array per model input, samples first (by name, or positional
``arr_i``); the outputs file (``runtime.output_path``, default ``RunPaths.batch_outputs``) holds each
output in request order, a ``done`` mask (rows not done are zeros) and ``latency_ms``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hpcsplit.errors import RuntimeStageError

__all__ = ["host_row", "read_inputs", "write_outputs"]


def read_inputs(path: str | Path, names: tuple[str, ...]) -> list[np.ndarray]:
    """Model inputs from an ``.npz`` or HDF5 file: one array per input name (positional ``arr_i`` too)."""
    path = Path(path)
    if not path.exists():
        raise RuntimeStageError(f"runtime.input_path={path} does not exist; give an .npz or .h5 file "
                                f"with arrays {list(names)} (samples first)")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    else:
        import h5py

        try:
            with h5py.File(path, "r") as f:
                data = {k: f[k][()] for k in f if hasattr(f[k], "shape")}
        except OSError as e:
            raise RuntimeStageError(f"cannot read {path} as HDF5: {e}") from e
    out = []
    for i, n in enumerate(names):
        arr = data.get(n, data.get(f"arr_{i}"))
        if arr is None:
            raise RuntimeStageError(f"{path} has arrays {sorted(data)}; the model needs {list(names)}")
        out.append(arr)
    lens = {a.shape[0] for a in out}
    if len(lens) != 1:
        raise RuntimeStageError(f"{path}: the inputs have different sample counts {sorted(lens)}")
    return out


def write_outputs(path: str | Path, names: tuple[str, ...], arrays: list[np.ndarray | None],
                  done: np.ndarray, latency_ms: np.ndarray) -> Path:
    """Write outputs in input order plus a ``done`` mask (rows not done are zeros) to .npz or HDF5."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {n: a for n, a in zip(names, arrays, strict=True) if a is not None}
    data["done"] = done.astype(bool)
    data["latency_ms"] = latency_ms
    if path.suffix == ".npz":
        np.savez(path, **data)  # type: ignore[arg-type]
    else:
        import h5py

        with h5py.File(path, "w") as f:
            for k, v in data.items():
                f.create_dataset(k.replace("/", "_"), data=v)
            f.attrs["outputs"] = list(names)
    return path


def host_row(r: torch.Tensor, rdim: int) -> np.ndarray:
    """One request's output (size 1 along ``rdim``) as the numpy array batch mode writes.

    numpy has no bfloat16: those are written as float32, which holds every bfloat16 value exactly.

    Examples
    --------
    >>> host_row(torch.ones(3, 1, dtype=torch.bfloat16), 1).dtype
    dtype('float32')
    """
    row = r.movedim(rdim, 0)[0].cpu()
    if row.dtype == torch.bfloat16:
        row = row.float()
    return row.numpy()
