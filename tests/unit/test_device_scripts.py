"""scripts/device-setup.sh and scripts/device-wheels.sh refuse what they cannot work with, and say what to do."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _copy(tmp_path: Path, name: str) -> Path:
    """A copy of the script in a repository of its own (``tmp_path``), so nothing it makes lands in this one."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    script = tmp_path / "scripts" / name
    shutil.copy(REPO / "scripts" / name, script)
    return script


def _run(script: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script)], cwd=script.parent.parent, capture_output=True, text=True,
                          timeout=60, check=False, env={"PATH": "/usr/bin:/bin", "HOME": str(script.parent), **env})


def test_device_setup_without_wheels_names_the_script_that_makes_them(tmp_path: Path) -> None:
    res = _run(_copy(tmp_path, "device-setup.sh"))
    assert res.returncode == 1
    assert "no wheels in .whl" in res.stderr and "device-wheels.sh" in res.stderr
    assert not (tmp_path / ".venv").exists()


def test_device_setup_refuses_a_python_without_torch(tmp_path: Path) -> None:
    script = _copy(tmp_path, "device-setup.sh")
    wheels = tmp_path / "w"
    wheels.mkdir()
    (wheels / "x-1.0-py3-none-any.whl").write_bytes(b"")
    fake = tmp_path / "python-without-torch"
    fake.write_text("#!/bin/sh\nexit 1\n")  # every `-c` fails as an import of torch would
    fake.chmod(0o755)
    res = _run(script, PYTHON=str(fake), HPCSPLIT_WHEELS=str(wheels))
    assert res.returncode == 1
    assert f"{fake} cannot import torch" in res.stderr and "scripts/setup.sh" in res.stderr
    assert not (tmp_path / ".venv").exists()


def test_device_wheels_needs_the_tested_versions_of_a_venv(tmp_path: Path) -> None:
    res = _run(_copy(tmp_path, "device-wheels.sh"))
    assert res.returncode == 1 and "run ./scripts/setup.sh first" in res.stderr
    assert not (tmp_path / ".whl").exists()


def test_setup_perf_uses_a_carried_perf_analyzer_with_its_libraries_on_the_path(tmp_path: Path) -> None:
    """No index needed: .whl/perf's binary (here a stand-in that prints its library path) behind the launcher."""
    script = _copy(tmp_path, "setup-perf.sh")
    perf = tmp_path / ".whl" / "perf"
    perf.mkdir(parents=True)
    (perf / "perf_analyzer").write_text('#!/bin/sh\necho "args: $* lib: $LD_LIBRARY_PATH"\n')
    (perf / "perf_analyzer").chmod(0o755)
    res = _run(script, VENV_PERF=str(tmp_path / "vp"))
    assert res.returncode == 0, res.stderr
    launcher = Path(res.stdout.strip())
    assert launcher == tmp_path / "vp" / "bin" / "perf_analyzer-hpcsplit"
    ran = subprocess.run([str(launcher), "-m", "x"], capture_output=True, text=True, timeout=30, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert ran.stdout.strip() == f"args: -m x lib: {perf}"


def test_device_cpu_check_without_a_venv_says_how_to_make_one(tmp_path: Path) -> None:
    res = _run(_copy(tmp_path, "device-cpu-check.sh"), CPU_CHECK_OUT=str(tmp_path / "cc"))
    assert res.returncode == 1 and "no .venv: run ./scripts/setup.sh" in res.stdout
