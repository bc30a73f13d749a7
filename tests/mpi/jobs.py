"""Run a small Python job under real ``mpiexec`` and read the ranks' results (shared by the MPI tests)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

MPIEXEC = shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))


def run_job(tmp_path: Path, script: str, ranks: int, timeout_s: float = 180.0) -> list[Any]:
    """Write ``script`` to ``tmp_path`` and run it on ``ranks`` ranks; return rank 0's ``RESULT`` line.

    The script prints ``RESULT <json>`` on rank 0 (usually ``comm.gather`` of every rank's dict).
    """
    if MPIEXEC is None:  # pragma: no cover
        pytest.skip("no mpiexec on PATH")
    path = tmp_path / "job.py"
    path.write_text(script)
    p = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, str(path)], check=False,
                       capture_output=True, text=True, timeout=timeout_s)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])
