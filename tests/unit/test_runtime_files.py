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
    assert set(data) - {"hpcsplit_outputs"} == {"logits", "done", "latency_ms"}
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


# ---------------------------------------------------------------- inputs checked against the layout
def _spec(name: str, dtype: str, shape: tuple) -> object:
    from hpcsplit.switchboard.layout import TensorSpec

    return TensorSpec(name, dtype, shape, 0)


SPECS = [_spec("x", "float32", ("batch", 4)), _spec("mask", "int64", ("batch", 2))]


def test_inputs_checked_against_the_layout(tmp_path: Path) -> None:
    x, m = np.ones((3, 4), np.float32), np.zeros((3, 2), np.int64)
    np.savez(tmp_path / "ok.npz", x=x, mask=m)
    assert [a.shape for a in read_inputs(tmp_path / "ok.npz", ("x", "mask"), SPECS)] == [(3, 4), (3, 2)]
    np.savez(tmp_path / "dtype.npz", x=x.astype(np.float64), mask=m)
    with pytest.raises(RuntimeStageError, match=r"dtype.npz: array 'x' has dtype float64; the model needs float32"):
        read_inputs(tmp_path / "dtype.npz", ("x", "mask"), SPECS)
    np.savez(tmp_path / "shape.npz", x=np.ones((3, 5), np.float32), mask=m)
    with pytest.raises(RuntimeStageError, match=r"array 'x' has shape \(3, 5\); the model needs \('n', 4\)"):
        read_inputs(tmp_path / "shape.npz", ("x", "mask"), SPECS)
    np.savez(tmp_path / "rank.npz", x=np.ones((3, 4, 1), np.float32), mask=m)
    with pytest.raises(RuntimeStageError, match="has shape"):
        read_inputs(tmp_path / "rank.npz", ("x", "mask"), SPECS)
    np.savez(tmp_path / "zero_d.npz", x=np.float32(1), mask=m)
    with pytest.raises(RuntimeStageError, match=r"array 'x' is a single value \(0-d\)"):
        read_inputs(tmp_path / "zero_d.npz", ("x", "mask"), SPECS)
    np.savez(tmp_path / "names.npz", pixel_values=x, mask=m)
    with pytest.raises(RuntimeStageError, match=r"has arrays \['mask', 'pixel_values'\]; the model needs"):
        read_inputs(tmp_path / "names.npz", ("x", "mask"), SPECS)
    np.savez(tmp_path / "count.npz", x=x, mask=np.zeros((4, 2), np.int64))
    with pytest.raises(RuntimeStageError, match="different sample counts"):
        read_inputs(tmp_path / "count.npz", ("x", "mask"), SPECS)
    np.savez(tmp_path / "empty.npz", x=x[:0], mask=m[:0])
    with pytest.raises(RuntimeStageError, match="no samples"):
        read_inputs(tmp_path / "empty.npz", ("x", "mask"), SPECS)


def test_object_arrays_and_outside_hdf5_refused(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    marker = tmp_path / "pwned"
    np.savez(tmp_path / "obj.npz", x=np.array([{"a": 1}, None], dtype=object))
    with pytest.raises(RuntimeStageError, match="obj.npz.*no Python objects"):
        read_inputs(tmp_path / "obj.npz", ("x",))
    assert not marker.exists()
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = np.ones((3, 4), np.float32)
    with h5py.File(tmp_path / "link.h5", "w") as f:
        f["x"] = h5py.ExternalLink("other.h5", "x")
    with pytest.raises(RuntimeStageError, match="link.h5: refused, it reads data outside itself"):
        read_inputs(tmp_path / "link.h5", ("x",))
    with h5py.File(tmp_path / "str.h5", "w") as f:
        f["x"] = np.array([b"a", b"b"])
    with pytest.raises(RuntimeStageError, match="array 'x' has dtype"):
        read_inputs(tmp_path / "str.h5", ("x",))


# ------------------------------------------------------------------------------ the output path
def test_output_path_checked_before_any_work(tmp_path: Path) -> None:
    import os

    h5py = pytest.importorskip("h5py")
    from hpcsplit.runtime.batch_files import check_output_path

    foreign = tmp_path / "profile.h5"
    with h5py.File(foreign, "w") as f:
        f["cells"] = np.arange(3)
    with pytest.raises(RuntimeStageError, match="not an hpcsplit outputs file; refusing.*runtime.overwrite=true"):
        check_output_path(foreign)
    assert check_output_path(foreign, overwrite=True) == foreign
    (tmp_path / "notes.npz").write_bytes(b"not an npz")
    with pytest.raises(RuntimeStageError, match="not an hpcsplit outputs file"):
        check_output_path(tmp_path / "notes.npz")
    ours = write_outputs(tmp_path / "ours.npz", ("y",), [np.ones((2, 1))], np.ones(2, bool), np.ones(2))
    assert check_output_path(ours) == ours  # an earlier outputs file is replaced
    ours_h5 = write_outputs(tmp_path / "ours.h5", ("y",), [np.ones((2, 1))], np.ones(2, bool), np.ones(2))
    assert check_output_path(ours_h5) == ours_h5
    with pytest.raises(RuntimeStageError, match="ending in .npz or .h5"):
        check_output_path(tmp_path / "out.txt")
    (tmp_path / "d.h5").mkdir()
    with pytest.raises(RuntimeStageError, match="is a directory"):
        check_output_path(tmp_path / "d.h5")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(RuntimeStageError, match="not writable"):
            check_output_path(ro / "out.h5")


def test_output_writer_keeps_finished_rows_on_disk(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    from hpcsplit.runtime.batch_files import OutputWriter

    w = OutputWriter(tmp_path / "out.npz", ("y",), 4)
    w.row(2, [np.array([5.0, 6.0])])
    w.flush()
    with h5py.File(w.stream, "r", locking=False) as f:  # what a SIGKILL would leave
        assert f["done"][()].tolist() == [False, False, True, False]
        assert f["y"][2].tolist() == [5.0, 6.0]
        assert f.attrs["hpcsplit_outputs"]
    w.row(0, [np.array([1.0, 2.0])])
    p = w.close(np.array([True, False, True, False]), np.array([1.0, np.nan, 2.0, np.nan]))
    assert not w.stream.exists()
    with np.load(p) as z:
        assert z["done"].tolist() == [True, False, True, False]
        assert z["y"][1].tolist() == [0.0, 0.0] and z["y"][2].tolist() == [5.0, 6.0]
