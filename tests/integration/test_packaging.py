"""A wheel (non-editable install) carries conf/ as hpcsplit/conf, and the package finds it there."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_the_configs_and_finds_them(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w",
         str(tmp_path / "whl")],
        check=False, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "whl").glob("hpcsplit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {"hpcsplit/" + p.relative_to(ROOT).as_posix() for p in (ROOT / "conf").rglob("*.yaml")}
    assert want and want <= names, sorted(want - names)
    target = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=False, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    code = "import hpcsplit.launch.config as c; print(c.conf_dir())"
    got = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert Path(got.stdout.strip()) == target / "hpcsplit" / "conf"
