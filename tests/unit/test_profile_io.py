"""The HDF5 profile schema: round trip, validation, crash safety and resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcsplit.core.profile_format import SCHEMA_VERSION, read_profile
from hpcsplit.core.profile_writer import ProfileWriter
from hpcsplit.errors import ProfileError, ProfileFormatError
from hpcsplit.profiling.runner import profile_components
from tests.unit.profile_toys import ToySwitchboard

REPO = Path(__file__).resolve().parents[2]
GRID = {"batch_sizes": [1, 2, 4], "slices": [1, 2], "warmup": 1, "iters": 3}


@pytest.fixture(scope="module")
def toy_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prof") / "toy.h5"
    profile_components(ToySwitchboard(), out=out, progress=False, **GRID)
    return out


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


def test_round_trip(toy_profile: Path) -> None:
    prof = read_profile(toy_profile)
    assert prof.complete and prof.n_cells() == (12, 12)
    m = prof.meta
    assert m.schema_version == SCHEMA_VERSION and m.model == "toy" and m.device_kind == "cpu"
    assert m.slice_unit == "threads" and m.switchboard_sha256 == "0" * 63 + "1"
    assert m.component_order == ("enc", "head") and m.iters == 3
    enc = prof.components["enc"]
    assert enc.batch_sizes == (1, 2, 4) and enc.slices == (1.0, 2.0)
    assert enc.latency_ms.shape == (3, 2, 3) and enc.peak_mem_bytes.shape == (3, 2)
    assert enc.measured.all() and not enc.oom.any()
    assert np.isfinite(enc.latency_ms).all() and (enc.latency_ms > 0).all()
    assert (enc.peak_mem_bytes >= enc.param_bytes).all()
    assert enc.param_bytes == (32 * 32 + 32) * 4 and enc.input_bytes_per_sample == 32 * 4
    assert list(enc.input_bytes) == [b * 32 * 4 for b in (1, 2, 4)]
    np.testing.assert_allclose(enc.utilization[:, 1], 2 / m.cores_per_node)
    p50 = enc.latency_p50_ms(2, 0)
    assert p50 == pytest.approx(float(np.median(enc.latency_ms[2, 0])))
    assert enc.throughput_rps(2, 0) == pytest.approx(4 / (p50 / 1e3))
    with pytest.raises(ValueError):
        enc.latency_ms[0, 0, 0] = 1.0  # read-only arrays


def test_named_axes_and_units(toy_profile: Path) -> None:
    with h5py.File(toy_profile, "r") as f:
        g = f["components/enc"]
        lat = g["latency_ms"]
        assert [d.label for d in lat.dims] == ["batch_size", "slice", "iteration"]
        assert list(lat.attrs["axes"]) == ["batch_size", "slice", "iteration"]
        assert lat.dims[0][0].name.endswith("/batch_size")
        assert g["slice"].attrs["units"] == "threads"
        assert "soft cap" not in f.attrs["slice_semantics"]  # CPU file: threads
        assert bool(f.attrs["complete"]) is True


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("version", "schema_version=99"),
        ("dataset", "dataset 'peak_mem_bytes' missing"),
        ("attr", "root attributes missing: switchboard_sha256"),
        ("format", "not an hpcsplit profile"),
        ("shape", "dataset 'utilization' has shape (2,)"),
        ("hole", "1 cell(s) flagged measured without latencies (first: batch_size=2, slice=1)"),
    ],
)
def test_damaged_files_are_refused(toy_profile: Path, tmp_path: Path, damage: str, message: str) -> None:
    path = _copy(toy_profile, tmp_path / "bad.h5")
    with h5py.File(path, "r+") as f:
        if damage == "version":
            f.attrs["schema_version"] = 99
        elif damage == "dataset":
            del f["components/head/peak_mem_bytes"]
        elif damage == "attr":
            del f.attrs["switchboard_sha256"]
        elif damage == "format":
            f.attrs["format"] = "something-else"
        elif damage == "hole":
            f["components/enc/latency_ms"][1, 0, 1] = np.nan
        elif damage == "shape":
            del f["components/enc/utilization"]
            f["components/enc/utilization"] = np.zeros(2)
    with pytest.raises(ProfileFormatError) as ei:
        read_profile(path)
    assert message in str(ei.value)
    assert str(path) in str(ei.value)


def test_truncated_file_is_refused(toy_profile: Path, tmp_path: Path) -> None:
    data = toy_profile.read_bytes()
    path = tmp_path / "cut.h5"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ProfileFormatError, match="truncated or not a profile|unreadable"):
        read_profile(path)
    with pytest.raises(ProfileFormatError, match="does not exist"):
        read_profile(tmp_path / "nothing.h5")


def test_incomplete_file_is_refused_unless_asked(toy_profile: Path, tmp_path: Path) -> None:
    path = _copy(toy_profile, tmp_path / "partial.h5")
    with h5py.File(path, "r+") as f:
        f.attrs["complete"] = False
        m = f["components/head/measured"]
        m[2, 1] = False
    with pytest.raises(ProfileFormatError, match=r"did not finish .*11/12 cells"):
        read_profile(path)
    prof = read_profile(path, allow_incomplete=True)
    assert not prof.complete and prof.n_cells() == (11, 12)
    # complete=True with an unmeasured cell is a lie: refused
    with h5py.File(path, "r+") as f:
        f.attrs["complete"] = True
    with pytest.raises(ProfileFormatError, match="marked complete but only 11/12"):
        read_profile(path)


def test_resume_refuses_another_grid(toy_profile: Path, tmp_path: Path) -> None:
    path = _copy(toy_profile, tmp_path / "p.h5")
    with pytest.raises(ProfileError, match=r"batch sizes: file has \[1, 2, 4\], this run \[1, 2\]"):
        profile_components(ToySwitchboard(), out=path, progress=False, **{**GRID, "batch_sizes": [1, 2]})


def _snapshot(path: Path) -> dict[str, dict[str, np.ndarray]]:
    prof = read_profile(path, allow_incomplete=True)
    return {
        n: {
            "measured": c.measured.copy(),
            "latency_ms": c.latency_ms.copy(),
            "peak_mem_bytes": c.peak_mem_bytes.copy(),
            "cpu_busy_fraction": c.cpu_busy_fraction.copy(),
        }
        for n, c in prof.components.items()
    }


def _start_toy(out: Path, sleep_s: float) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.unit.profile_toys", str(out), str(sleep_s)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for_cells(proc: subprocess.Popen[str], n: int, timeout_s: float = 120) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if f"profile {n}/" in line:
            return lines
    proc.kill()
    raise AssertionError(f"the toy profile never reached cell {n}:\n" + "".join(lines))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGUSR2])  # SIGTERM: tests/mpi
def test_killed_run_resumes_and_keeps_earlier_cells(tmp_path: Path, sig: signal.Signals) -> None:
    out = tmp_path / "killed.h5"
    proc = _start_toy(out, sleep_s=0.05)
    _wait_for_cells(proc, 3)
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=120)
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:  # stops cleanly after the cell in progress, the file flushed and marked incomplete
        assert proc.returncode == 0, rest
        assert "'interrupted': True" in rest and f"'signal': '{sig.name}'" in rest
    with pytest.raises(ProfileFormatError, match="did not finish"):
        read_profile(out)
    before = _snapshot(out)
    n_before = sum(int(v["measured"].sum()) for v in before.values())
    assert 3 <= n_before < 16
    summary = profile_components(
        ToySwitchboard(), out=out, batch_sizes=[1, 2, 4, 8], slices=[1, 2], warmup=1, iters=3, progress=False
    )
    assert summary["complete"] and summary["cells_measured"] == 16 - n_before
    after = _snapshot(out)
    assert read_profile(out).complete
    for name, old in before.items():
        keep = old["measured"]
        for key in ("latency_ms", "peak_mem_bytes", "cpu_busy_fraction"):
            # bit-for-bit equal where measured before the kill
            assert old[key][keep].tobytes() == after[name][key][keep].tobytes(), (name, key)


def test_merge_from_copies_only_missing_cells(toy_profile: Path, tmp_path: Path) -> None:
    ref = read_profile(toy_profile)
    part = _copy(toy_profile, tmp_path / "part.h5")
    main = _copy(toy_profile, tmp_path / "main.h5")
    with h5py.File(main, "r+") as f:  # main lacks row slice=1 of 'enc'
        f.attrs["complete"] = False
        f["components/enc/measured"][:, 1] = False
        f["components/enc/latency_ms"][:, 1, :] = np.nan
    with h5py.File(part, "r+") as f:  # the part file has only that row
        f["components/enc/measured"][:, 0] = False
        f["components/head/measured"][...] = False
    w = ProfileWriter(main, h5py.File(main, "r+"))
    with w:
        assert len(w.missing_cells()) == 3
        assert w.merge_from(part) == 3
        assert w.finish()
    got = read_profile(main)
    assert got.components["enc"].latency_ms.tobytes() == ref.components["enc"].latency_ms.tobytes()
