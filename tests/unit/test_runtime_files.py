"""Batch-mode input/output files (npz and HDF5)."""

from __future__ import annotations

import itertools
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


# ------------------------------------------------------------- streaming inputs ([Note: streaming batch mode])
def _rows(n: int, width: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    return g.standard_normal((n, width)).astype(np.float32), g.integers(0, 9, (n, 2))


@pytest.mark.parametrize("kind", ["h5_chunked", "h5_contiguous", "npz", "npz_compressed", "h5_shards", "npz_shards"])
def test_streamed_inputs_equal_the_file_for_any_rows(tmp_path: Path, kind: str) -> None:
    h5py = pytest.importorskip("h5py")
    from hpcsplit.runtime.batch_stream import ChunkFeed, open_inputs

    x, m = _rows(1000)
    cuts = [0, 1, 333, 1000] if "shards" in kind else [0, 1000]
    path = tmp_path / "in" if "shards" in kind else tmp_path / f"in.{'h5' if 'h5' in kind else 'npz'}"
    if "shards" in kind:
        path.mkdir()
    for k, (a, b) in enumerate(itertools.pairwise(cuts)):
        p = path / f"s{k}.{'h5' if 'h5' in kind else 'npz'}" if "shards" in kind else path
        if "h5" in kind:
            with h5py.File(p, "w") as f:
                f.create_dataset("x", data=x[a:b], chunks=(min(16, b - a), 4) if kind != "h5_contiguous" else None)
                f.create_dataset("mask", data=m[a:b])
        else:
            (np.savez_compressed if kind == "npz_compressed" else np.savez)(p, x=x[a:b], mask=m[a:b])
    src = open_inputs(path, ("x", "mask"), SPECS)
    assert src.n == 1000
    rows = np.array([0, 1, 2, 5, 300, 333, 334, 640, 998, 999])  # sparse, across chunks and shards
    feed = ChunkFeed(src, rows, chunk=64)
    got = [feed.get(np.array(p)) for p in ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9])]
    feed.close()
    np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), x[rows])
    np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), m[rows])
    fp = src.fingerprint()
    src.close()
    assert fp == open_inputs(path, ("x", "mask"), SPECS).fingerprint()  # same input, same fingerprint


def test_npy_file_and_npy_shards_stream_memory_mapped(tmp_path: Path) -> None:
    from hpcsplit.runtime.batch_stream import ChunkFeed, open_inputs

    x, _ = _rows(100)
    np.save(tmp_path / "one.npy", x)
    (tmp_path / "d").mkdir()
    np.save(tmp_path / "d" / "b.npy", x[40:])
    np.save(tmp_path / "d" / "a.npy", x[:40])  # name order, not creation order
    for p in (tmp_path / "one.npy", tmp_path / "d"):
        src = open_inputs(p, ("x",), SPECS[:1])
        feed = ChunkFeed(src, np.arange(100), chunk=32)
        np.testing.assert_array_equal(feed.get(np.arange(100))[0], x)
        feed.close()
        src.close()
    with pytest.raises(RuntimeStageError, match=r"one.npy: a .npy file holds one array; the model needs \['x', 'mask'\]"):
        open_inputs(tmp_path / "one.npy", ("x", "mask"), SPECS)


def test_each_bad_streamed_input_is_refused_naming_file_and_array(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    from hpcsplit.runtime.batch_stream import open_inputs

    x, m = _rows(10)
    cases: dict[str, tuple[object, str]] = {}

    def npz(name: str, **arrays: np.ndarray) -> Path:
        np.savez(tmp_path / name, **arrays)
        return tmp_path / name

    cases["names"] = (npz("names.npz", x=x, other=m), r"names.npz: has arrays \['other', 'x'\]; the model needs")
    cases["dtype"] = (npz("dtype.npz", x=x.astype(np.float64), mask=m), "array 'x' has dtype float64; the model needs float32")
    cases["shape"] = (npz("shape.npz", x=x[:, :3], mask=m), r"array 'x' has shape \(10, 3\); the model needs \('n', 4\)")
    cases["count"] = (npz("count.npz", x=x, mask=m[:9]), "different sample counts")
    cases["object"] = (npz("object.npz", x=np.array([None] * 10, dtype=object), mask=m), "array 'x' holds Python objects")
    np.save(tmp_path / "obj.npy", np.array([None, 1], dtype=object), allow_pickle=True)
    np.savez(tmp_path / "fortran.npz", x=np.asfortranarray(x), mask=m)
    cases["fortran"] = (tmp_path / "fortran.npz", "array 'x' is in Fortran order")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"], f["mask"] = x, m
    with h5py.File(tmp_path / "ext.h5", "w") as f:
        f["x"] = h5py.ExternalLink("other.h5", "x")
        f["mask"] = m
    cases["external link"] = (tmp_path / "ext.h5", "ext.h5: refused, it reads data outside itself .*external link")
    layout = h5py.VirtualLayout(shape=x.shape, dtype=x.dtype)
    layout[:] = h5py.VirtualSource(tmp_path / "other.h5", "x", shape=x.shape)
    with h5py.File(tmp_path / "vds.h5", "w") as f:
        f.create_virtual_dataset("x", layout)
        f["mask"] = m
    cases["virtual dataset"] = (tmp_path / "vds.h5", "vds.h5: refused, .*virtual dataset")
    with h5py.File(tmp_path / "str.h5", "w") as f:
        f["x"], f["mask"] = np.array([b"a"] * 10), m
    cases["strings"] = (tmp_path / "str.h5", r"str.h5: array 'x' has dtype \|S1")
    d = tmp_path / "disagree"
    d.mkdir()
    np.savez(d / "a.npz", x=x, mask=m)
    np.savez(d / "b.npz", x=x, mask=m.astype(np.int32))
    cases["shards disagree"] = (d, "b.npz: array 'mask' has dtype int32")
    (tmp_path / "empty").mkdir()
    cases["no shards"] = (tmp_path / "empty", "the directory holds no shards")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    np.savez(mixed / "a.npz", x=x, mask=m)
    np.save(mixed / "b.npy", x)
    cases["mixed shards"] = (mixed, "the shards mix formats")
    cases["zero rows"] = (npz("zero.npz", x=x[:0], mask=m[:0]), "the inputs hold no samples")
    cases["missing"] = (tmp_path / "nope.h5", "does not exist")
    for what, (path, msg) in cases.items():
        with pytest.raises(RuntimeStageError, match=msg):
            open_inputs(path, ("x", "mask"), SPECS)
            pytest.fail(f"{what}: accepted")
    with pytest.raises(RuntimeStageError, match="obj.npy: .*Python objects"):  # a one-input model
        open_inputs(tmp_path / "obj.npy", ("x",), SPECS[:1])


# ------------------------------------------------------------------------ the resumable outputs file
def test_stream_writer_commits_groups_resumes_and_refuses_a_mismatch(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    from hpcsplit.runtime.batch_stream import FAIL_TIMEOUT, StreamWriter

    out = tmp_path / "out.h5"
    w = StreamWriter(out, ("y",), 6, "in-A", "sb-A", group_rows=100)
    w.row(4, [np.array([4.0, 4.5])], 1.5)
    w.row(1, [np.array([1.0, 1.5])], 2.5)
    with h5py.File(out, "r", locking=False) as f:  # buffered, not committed: a kill now loses only these
        assert not f["done"][()].any()
    w.flush()
    w.fail(np.array([2]), FAIL_TIMEOUT)
    with h5py.File(out, "r", locking=False) as f:  # what a SIGKILL would leave
        assert f["done"][()].tolist() == [False, True, False, False, True, False]
        assert f["y"][4].tolist() == [4.0, 4.5] and f["y"].shape == (6, 2) and f["y"].chunks is not None
        assert f["failed"][2] == FAIL_TIMEOUT
    w.close()
    w = StreamWriter(out, ("y",), 6, "in-A", "sb-A")
    assert w.resumed == 2 and w.todo.tolist() == [0, 2, 3, 5]
    for i in w.todo:
        w.row(int(i), [np.array([float(i), 0.0])], 1.0)
    w.close()
    with h5py.File(out, "r") as f:
        assert f["done"][()].all() and (f["done_count"][()] == 1).all() and not f["failed"][()].any()
        assert f["y"][1].tolist() == [1.0, 1.5] and f["y"][5].tolist() == [5.0, 0.0]
    for other in ({"input_fp": "in-B"}, {"switchboard_fp": "sb-B"}):
        args = {"input_fp": "in-A", "switchboard_fp": "sb-A", **other}
        with pytest.raises(RuntimeStageError, match="refusing to continue it: its rows were made from another"):
            StreamWriter(out, ("y",), 6, **args)
    assert StreamWriter(out, ("y",), 6, "in-B", "sb-A", overwrite=True).resumed == 0  # starts over on purpose


def test_stream_writer_to_npz_converts_when_complete(tmp_path: Path) -> None:
    pytest.importorskip("h5py")
    from hpcsplit.runtime.batch_stream import StreamWriter

    w = StreamWriter(tmp_path / "o.npz", ("y",), 2, "a", "b")
    w.row(0, [np.array([1.0])], 1.0)
    assert w.close() == tmp_path / "o.npz" and w.stream.exists()  # not complete: the resumable stream stays
    with np.load(tmp_path / "o.npz") as z:
        assert z["done"].tolist() == [True, False]
    w = StreamWriter(tmp_path / "o.npz", ("y",), 2, "a", "b")
    w.row(1, [np.array([2.0])], 1.0)
    assert w.close() == tmp_path / "o.npz" and not w.stream.exists()
    with np.load(tmp_path / "o.npz") as z:
        assert z["y"].tolist() == [[1.0], [2.0]] and z["done"].all()


def test_login_side_wait_shows_the_batch_progress_line(tmp_path: Path) -> None:
    from hpcsplit.errors import LaunchError
    from hpcsplit.launch.slurm import JobStatus, SubmittedJob, wait_for_job

    (tmp_path / "batch-progress.txt").write_text("batch progress: 5/10 rows done (50.0%), 5 rows/s, ETA 1 s, 0 failed\n")
    states = iter([JobStatus("RUNNING", source="squeue"), JobStatus("RUNNING", source="squeue")])
    lines: list[str] = []
    job = SubmittedJob("1", tmp_path, tmp_path / "runtime.mpi_main.result.json", "serve", 3, 10)
    with pytest.raises(LaunchError):  # the fake job leaves without a result
        wait_for_job(job, timeout_s=5, poll_s=0.01, poll_max_s=0.01, progress_s=0, echo=lines.append,
                     status_fn=lambda _id: next(states, JobStatus("FAILED", source="sacct")))
    assert any("RUNNING" in ln and "; batch progress: 5/10 rows done" in ln for ln in lines), lines
