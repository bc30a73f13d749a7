"""Shared pytest setup (keep it small).

Tests run as ``.venv/bin/python -m pytest`` without an activated venv: put this Python's bin folder
(``mpiexec`` from the mpich wheel) first on PATH so that MPI tests find it and subprocesses match.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_BIN = str(Path(sys.executable).parent)
if _BIN not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")
