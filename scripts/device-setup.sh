#!/usr/bin/env bash
# Offline setup on a machine whose Python already holds torch and that reaches no package index: the lent GPU
# machines (docs/gpu.md). .venv goes on top of that Python (its site-packages added behind the venv's own by a
# .pth: its CUDA torch, numpy, h5py, ... stay as they are), the carried wheels of .whl/ (scripts/device-wheels.sh, made where an index is reachable)
# are installed without an index, and hpcsplit editable without its dependencies. It says which torch it found:
# the image's may differ from the pin of scripts/setup.sh (2.13.0), which is what a check there then tests.
#
#   ./scripts/device-setup.sh                   # python3, .whl
#   PYTHON=/opt/torch/.venv/bin/python3 HPCSPLIT_WHEELS=/scratch/w ./scripts/device-setup.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
t0=$SECONDS
PYTHON=${PYTHON:-python3}
WHEELS=${HPCSPLIT_WHEELS:-.whl}
say() { echo "[device-setup] $*"; }
die() { echo "[device-setup] $*" >&2; exit 1; }

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
(( ${#wheels[@]} )) || die "no wheels in $WHEELS: run ./scripts/device-wheels.sh where pip reaches an index and carry the folder"
"$PYTHON" -c 'import torch' 2>/dev/null || die "$PYTHON cannot import torch: this setup builds on a Python that has it (PYTHON=...); elsewhere use ./scripts/setup.sh"

if [[ ! -x .venv/bin/python ]]; then
    say "creating .venv with $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    # (a Python without ensurepip makes no venv with pip: then one without, which runs the image's pip)
    "$PYTHON" -m venv .venv 2>/dev/null || { rm -rf .venv && "$PYTHON" -m venv --without-pip .venv; } \
        || die "'$PYTHON -m venv' failed"
fi
PY=.venv/bin/python
# That Python's packages stay visible behind the venv's own (the image's python3 is itself a venv, whose
# packages --system-site-packages would not show: the base interpreter's would)
"$PYTHON" -c 'import site; print("".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages()))' \
    >"$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/device-base-python.pth"
say "installing ${#wheels[@]} wheels from $WHEELS (no index)"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-warn-script-location "${wheels[@]}"
if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>/tmp/device-setup-editable.log; then
    # (an image whose setuptools cannot build an editable install: the checkout goes on the path as it is)
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$(pwd)" >"$site/hpcsplit-checkout.pth"
    say "the checkout is on the path through $site/hpcsplit-checkout.pth (the setuptools here cannot install it editable: /tmp/device-setup-editable.log)"
fi

# everything hpcsplit imports, and the MPI it will launch with
"$PY" - <<'EOF' || die "the environment is not complete (above)"
import importlib, shutil, sys
from pathlib import Path
missing = []
for name in ("torch", "numpy", "h5py", "networkx", "cvxpy", "highspy", "hydra", "submitit", "mpi4py", "pynvml",
             "matplotlib", "graphviz", "safetensors", "yaml", "aiohttp", "grpc", "prometheus_client",
             "tritonclient.grpc", "transformers", "cryptography.x509", "hpcsplit"):
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - each one named with why
        missing.append(f"{name} ({type(e).__name__}: {e})")
if missing:
    sys.exit("cannot import: " + "; ".join(missing))
import cvxpy
import torch
from mpi4py import MPI
from hpcsplit.launch.local import find_mpiexec
if "HIGHS" not in cvxpy.installed_solvers():
    sys.exit(f"cvxpy has no HiGHS solver (it has {cvxpy.installed_solvers()})")
print(f"[device-setup] torch {torch.__version__} (CUDA {torch.version.cuda}, a GPU: {torch.cuda.is_available()}); "
      f"MPI {MPI.Get_library_version().splitlines()[0].strip()}; mpiexec {find_mpiexec()}; "
      f"cvxpy {cvxpy.__version__} with HiGHS")
EOF
say "ready in $(( SECONDS - t0 )) s"
