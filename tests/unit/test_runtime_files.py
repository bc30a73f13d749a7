"""Batch-mode input/output files (npz and HDF5)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from hpcsplit.errors import RuntimeStageError
from hpcsplit.runtime.batch_files import host_row, read_inputs, write_outputs


def test_read_npz_by_name_and_position(tmp_path: Path) -> None:
    x, m = np.ones((3, 4), np.float32), np.zeros((3, 2), np.int64)
    np.savez(tmp_path / "a.npz", x=x, mask=m)
    got = read_inputs(tmp_path / "a.npz", ("x", "mask"))
    assert [g.shape for g in got] == [(3, 4), (3, 2)]
    np.savez(tmp_path / "b.npz", x, m)  # arr_0, arr_1
    assert read_inputs(tmp_path / "b.npz", ("x", "mask"))[1].dtype == np.int64


def test_read_h5_and_errors(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["x"] = np.ones((5, 2))
        f["y"] = np.ones((4, 2))
    assert read_inputs(tmp_path / "a.h5", ("x",))[0].shape == (5, 2)
    with pytest.raises(RuntimeStageError, match="different sample counts"):
        read_inputs(tmp_path / "a.h5", ("x", "y"))
    with pytest.raises(RuntimeStageError, match="the model needs"):
        read_inputs(tmp_path / "a.h5", ("pixel_values",))
    with pytest.raises(RuntimeStageError, match="does not exist"):
        read_inputs(tmp_path / "nope.npz", ("x",))


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_write_outputs_with_done_mask(tmp_path: Path, suffix: str) -> None:
    out = np.arange(6.0).reshape(3, 2)
    done = np.array([True, False, True])
    p = write_outputs(tmp_path / f"o{suffix}", ("logits", "missing"), [out, None], done, np.array([1.0, np.nan, 2.0]))
    if suffix == ".npz":
        with np.load(p) as z:
            data = {k: z[k] for k in z.files}
    else:
        import h5py

        with h5py.File(p) as f:
            data = {k: f[k][()] for k in f}
    assert set(data) == {"logits", "done", "latency_ms"}
    np.testing.assert_array_equal(data["done"], done)
    np.testing.assert_array_equal(data["logits"], out)


def test_batch_rows_of_bfloat16_outputs_are_written_as_float32(tmp_path: Path) -> None:
    import torch

    out = torch.tensor([[0.5], [1.0078125], [-3.0]], dtype=torch.bfloat16)  # 3 values, requests in dim 1
    rows = [host_row(out.T[:, [i]], 1) for i in range(3)]  # one request each, as the frontend hands them
    assert all(r.dtype == np.float32 and r.shape == (1,) for r in rows)
    np.testing.assert_array_equal(np.concatenate(rows), out.float().numpy().ravel())  # exact: no rounding
    p = write_outputs(tmp_path / "o.npz", ("logits",), [np.stack(rows)], np.ones(3, bool), np.ones(3))
    with np.load(p) as z:
        assert z["logits"].dtype == np.float32
