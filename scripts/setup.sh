#!/usr/bin/env bash
# Create .venv (if missing) and install hpcsplit into it: torch 2.13.0 (exact pin), then the package
# editable with its test, clip and mpich extras (mpi4py + the mpich wheel's mpiexec).
# Idempotent: when torch 2.13.0 is there and pyproject.toml has not changed since the last run, it
# returns in about a second.
#   ./scripts/setup.sh            PYTHON=python3.12 ./scripts/setup.sh
#   ./scripts/setup.sh --perf     also perf_analyzer in .venv-perf (scripts/setup-perf.sh; docs/serving.md)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
t0=$SECONDS
PYTHON=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.hpcsplit-setup

if [[ ! -x $VENV/bin/python ]]; then
    echo "[setup] creating $VENV with $($PYTHON --version 2>&1)"
    "$PYTHON" -m venv "$VENV" || {
        echo "[setup] '$PYTHON -m venv' failed: on Debian/Ubuntu install python3-venv (apt-get install python3-venv)" >&2
        exit 1
    }
fi
PY=$VENV/bin/python

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" else 1)' 2>/dev/null; then
    echo "[setup] installing torch==2.13.0"
    "$PY" -m pip install -q torch==2.13.0
fi

want="$(sha256sum pyproject.toml | cut -d' ' -f1) $(pwd)"
if [[ ! -f $STAMP || $(cat "$STAMP") != "$want" ]] || ! "$PY" -c 'import hpcsplit, mpi4py' 2>/dev/null; then
    echo "[setup] installing hpcsplit (editable) with [test,clip,mpich]"
    "$PY" -m pip install -q -e '.[test,clip,mpich]'
    echo "$want" >"$STAMP"
fi
echo "[setup] ready in $(( SECONDS - t0 )) s: $("$PY" -c 'import torch, hpcsplit; print("torch", torch.__version__, "| hpcsplit", hpcsplit.__version__)')"
if [[ ${1:-} == --perf ]]; then
    echo "[setup] perf_analyzer: $(./scripts/setup-perf.sh)"
fi
