"""A profile written by someone else reads only itself, and every value in it is range-checked.

Crafted from a real toy profile: external links, virtual datasets and external raw storage are refused
before any data is read (the bytes of the outside file never reach a table); out-of-range latencies,
memory, batch sizes and slices are refused naming the component, the cell and the value; a second
writer of one file is refused.  Hypothesis mutates datasets: every outcome is a correct read or a
ProfileFormatError.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcsplit.core.hdf5 import open_self_contained
from hpcsplit.core.profile_format import read_profile
from hpcsplit.core.profile_writer import ProfileWriter
from hpcsplit.errors import ProfileError, ProfileFormatError
from hpcsplit.profiling.runner import profile_components
from tests.unit.profile_toys import ToySwitchboard

GRID = {"batch_sizes": (1, 2, 4), "slices": (1, 2), "warmup": 0, "iters": 3}
SECRET = b"hpcsplit-secret-bytes-0123456789\n" * 8


@pytest.fixture(scope="module")
def toy_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prof") / "toy.h5"
    profile_components(ToySwitchboard(), out=out, progress=False, **GRID)
    return out


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    p = tmp_path / "secret.bin"
    p.write_bytes(SECRET)
    return p


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def _refused(path: Path, *fragments: str) -> str:
    with pytest.raises(ProfileFormatError) as ei:
        read_profile(path)
    msg = str(ei.value)
    assert str(path) in msg
    for frag in fragments:
        assert frag in msg, msg
    assert "hpcsplit-secret" not in msg
    return msg


def test_external_link_is_refused(toy_profile: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f, h5py.File(toy_profile, "r") as src:
        f["lat"] = src["components/enc/latency_ms"][()] * 0 + 1e-9  # what the attacker wants read
    path = _copy(toy_profile, tmp_path / "ext.h5")
    with h5py.File(path, "r+") as f:
        del f["components/enc/latency_ms"]
        f["components/enc/latency_ms"] = h5py.ExternalLink(str(other), "/lat")
    _refused(path, "/components/enc/latency_ms: external link", "self-contained")


def test_virtual_dataset_is_refused(toy_profile: Path, tmp_path: Path) -> None:
    other = tmp_path / "src.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.full((3, 2), 1.0)
    path = _copy(toy_profile, tmp_path / "vds.h5")
    layout = h5py.VirtualLayout(shape=(3, 2), dtype="f8")
    layout[:] = h5py.VirtualSource(str(other), "x", shape=(3, 2))
    with h5py.File(path, "r+") as f:
        del f["components/head/peak_mem_bytes"]
        f["components/head"].create_virtual_dataset("peak_mem_bytes", layout)
    _refused(path, "/components/head/peak_mem_bytes: virtual dataset")


def test_external_raw_storage_is_refused(toy_profile: Path, tmp_path: Path, secret: Path) -> None:
    path = _copy(toy_profile, tmp_path / "raw.h5")
    with h5py.File(path, "r+") as f:
        del f["components/enc/peak_mem_bytes"]
        f["components/enc"].create_dataset("peak_mem_bytes", shape=(3, 2), dtype="f8",
                                           external=[(str(secret), 0, 48)])
    _refused(path, "/components/enc/peak_mem_bytes: external raw storage")


def test_dangling_soft_link_is_refused(toy_profile: Path, tmp_path: Path) -> None:
    path = _copy(toy_profile, tmp_path / "soft.h5")
    with h5py.File(path, "r+") as f:
        f["components/enc/extra"] = h5py.SoftLink("/nowhere")
    _refused(path, "dangling soft link")


def test_the_check_is_shared_by_other_readers(tmp_path: Path, secret: Path) -> None:
    path = tmp_path / "inputs.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("x", shape=(4,), dtype="f8", external=[(str(secret), 0, 32)])
    with pytest.raises(ValueError, match="external raw storage"):
        open_self_contained(path, ValueError, "batch input")
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(4.0)
    with open_self_contained(path, ValueError) as f:
        assert f["x"][()].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("where", "value", "fragments"),
    [
        ("latency_ms", -1.0, ("latency_ms of cell batch_size=2, slice=1", "-1.0", "finite and > 0")),
        ("latency_ms", 0.0, ("latency_ms of cell batch_size=2, slice=1", "finite and > 0")),
        ("latency_ms", np.inf, ("flagged measured without latencies (first: batch_size=2, slice=1)",)),
        ("peak_mem_bytes", np.nan, ("peak_mem_bytes of cell batch_size=2, slice=1", "nan")),
        ("peak_mem_bytes", -5.0, ("peak_mem_bytes of cell batch_size=2, slice=1", "-5.0")),
        ("utilization", 7.0, ("utilization of cell batch_size=2, slice=1", "7.0")),
    ],
)
def test_cell_values_are_range_checked(toy_profile: Path, tmp_path: Path, where: str, value: float,
                                       fragments: tuple[str, ...]) -> None:
    path = _copy(toy_profile, tmp_path / "val.h5")
    with h5py.File(path, "r+") as f:
        ds = f[f"components/enc/{where}"]
        if ds.ndim == 3:
            ds[1, 0, :] = value
        else:
            ds[1, 0] = value
    _refused(path, "component 'enc'", *fragments)


@pytest.mark.parametrize(
    ("axis", "values", "fragment"),
    [
        ("batch_size", [0, 2, 4], "batch sizes [0, 2, 4]"),
        ("batch_size", [-2, 2, 4], "batch sizes [-2, 2, 4]"),
        ("batch_size", [1, 2, 1_000_000_000], "batch sizes [1, 2, 1000000000]"),
        ("batch_size", [4, 2, 1], "increasing"),
        ("slice", [np.nan, 2.0], "slices [nan, 2.0]"),
        ("slice", [0.0, 2.0], "finite numbers > 0"),
    ],
)
def test_axes_are_range_checked(toy_profile: Path, tmp_path: Path, axis: str, values: list[float],
                                fragment: str) -> None:
    path = _copy(toy_profile, tmp_path / "axis.h5")
    with h5py.File(path, "r+") as f:
        f[f"components/head/{axis}"][...] = np.asarray(values, f[f"components/head/{axis}"].dtype)
    _refused(path, "component 'head'", fragment)


def test_strings_where_numbers_belong(toy_profile: Path, tmp_path: Path) -> None:
    path = _copy(toy_profile, tmp_path / "str.h5")
    with h5py.File(path, "r+") as f:
        del f["components/enc/utilization"]
        f["components/enc/utilization"] = np.array([["a", "b"]] * 3, dtype=h5py.string_dtype())
        f["components/head"].attrs["param_bytes"] = "lots"
    _refused(path, "utilization")


def test_a_second_writer_is_refused(toy_profile: Path, tmp_path: Path) -> None:
    path = _copy(toy_profile, tmp_path / "busy.h5")
    prof = read_profile(path)
    grid = {"meta": prof.meta, "batch_sizes": GRID["batch_sizes"], "slices": (1.0, 2.0),
            "components": [_layout(c) for c in prof.components.values()]}
    with ProfileWriter.open(path, **grid), pytest.raises(ProfileError, match="another process is writing"):
        ProfileWriter.open(path, **grid)
    with ProfileWriter.open(path, **grid) as w:  # released on close
        assert not w.missing_cells()


def _layout(c):  # type: ignore[no-untyped-def]
    from hpcsplit.core.profile_format import ComponentLayout

    return ComponentLayout(c.name, c.param_bytes, c.input_bytes_per_sample, c.output_bytes_per_sample)


_DATASETS = ("latency_ms", "peak_mem_bytes", "utilization", "cpu_busy_fraction", "oom", "measured",
             "batch_size", "slice", "input_bytes", "measured_by_rank")
_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**62), 2**62), st.booleans(),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ds=st.sampled_from(_DATASETS), comp=st.sampled_from(["enc", "head"]), value=_VALUES,
       cell=st.tuples(st.integers(0, 2), st.integers(0, 1)), reshape=st.booleans())
def test_mutated_profiles_read_or_refuse(toy_profile: Path, tmp_path: Path, ds: str, comp: str, value: object,
                                         cell: tuple[int, int], reshape: bool) -> None:
    path = _copy(toy_profile, tmp_path / "mut.h5")
    with h5py.File(path, "r+") as f:
        d = f[f"components/{comp}/{ds}"]
        if reshape:
            del f[f"components/{comp}/{ds}"]
            f[f"components/{comp}/{ds}"] = np.full((2, 2, 2), value if not isinstance(value, bool) else 1.0)
        else:
            arr = d[()]
            idx = tuple(min(i, n - 1) for i, n in zip((*cell, 0), arr.shape, strict=False))
            try:
                arr[idx] = value
            except (OverflowError, ValueError):
                return
            d[...] = arr
    try:
        prof = read_profile(path)
    except ProfileFormatError:
        return
    for c in prof.components.values():  # a read that succeeds holds only sane values
        ran = c.measured & ~c.oom
        assert (c.latency_ms[ran] > 0).all() and np.isfinite(c.latency_ms[ran]).all()
        assert (np.asarray(c.batch_sizes) >= 1).all() and np.isfinite(c.slices).all()
