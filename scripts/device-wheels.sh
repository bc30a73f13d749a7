#!/usr/bin/env bash
# Download, here, the wheels a lent GPU machine needs for an offline setup (scripts/device-setup.sh; docs/gpu.md).
#
# The lent machines run an image whose python3 (CPython 3.12) already holds a CUDA torch and most of what
# hpcsplit imports (numpy, h5py, networkx, grpcio, aiohttp, prometheus_client, matplotlib, transformers, pytest,
# ...), but nothing outside the machine can be reached from it. This fetches the rest, as wheels for that Python
# and x86-64 Linux, into .whl/ (git-ignored), at the versions this checkout's .venv has (the tested ones): about
# 36 MB, under the 64 MiB a device call carries with the working tree. SCS and sparsediffpy (55 MB) are left out:
# cvxpy imports neither to load or to solve with HiGHS, which is what hpcsplit uses.
#
#   ./scripts/device-wheels.sh                       # CPython 3.12 (the image's), into .whl
#   PYVER=3.11 HPCSPLIT_WHEELS=/tmp/w ./scripts/device-wheels.sh    # (the name device-setup.sh reads too)
#   PERF=1 ./scripts/device-wheels.sh                # and perf_analyzer in .whl/perf (15 MB; device-cpu-check.sh)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYVER=${PYVER:-3.12}
WHEELS=${HPCSPLIT_WHEELS:-.whl}
PY=.venv/bin/python
if [[ ! -x $PY ]]; then
    echo "device-wheels: no .venv here to read the tested versions from: run ./scripts/setup.sh first" >&2
    exit 1
fi

# What the image lacks of hpcsplit's dependencies (KINDS.md's package list of the lent machines), then what only
# the tests import (the HTTP client of tritonclient, the TLS tests' CA).
RUNTIME=(cvxpy highspy clarabel osqp qdldl hydra-core omegaconf antlr4-python3-runtime hydra-submitit-launcher submitit
         graphviz tritonclient python-rapidjson mpich mpi4py)
TESTS=(cryptography cffi pycparser gevent geventhttpclient greenlet zope.event zope.interface brotli)

pins=()
for name in "${RUNTIME[@]}" "${TESTS[@]}"; do
    v=$("$PY" -c 'import sys; from importlib.metadata import version; print(version(sys.argv[1]))' "$name" 2>/dev/null) || {
        echo "device-wheels: $name is not installed in .venv (./scripts/setup.sh installs it)" >&2
        exit 1
    }
    pins+=("$name==$v")
done

mkdir -p "$WHEELS"
rm -f "$WHEELS"/*.whl
[[ ${PERF:-0} != 1 ]] || rm -rf "$WHEELS/perf"
plat=()
for p in manylinux_2_{5,17,24,27,28,31,34}_x86_64 manylinux1_x86_64 manylinux2014_x86_64; do plat+=(--platform "$p"); done
for pin in "${pins[@]}"; do
    if [[ $pin == antlr4-python3-runtime==* ]]; then  # a source release only: built here (pure Python)
        "$PY" -m pip wheel -q --no-deps -w "$WHEELS" "$pin"
    else
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
            "${plat[@]}" -d "$WHEELS" "$pin"
    fi
done
if [[ ${PERF:-0} == 1 ]]; then  # perf_analyzer for scripts/device-cpu-check.sh: the binary (stripped), libb64, libcudart 12
    pa=$(./scripts/setup-perf.sh)
    mkdir -p "$WHEELS/perf"
    cp "$(dirname "$pa")/perf_analyzer" "$WHEELS/perf/perf_analyzer"
    strip "$WHEELS/perf/perf_analyzer" 2>/dev/null || true
    cp -L "$(ldconfig -p | awk '$1 == "libb64.so.0d" {print $NF; exit}')" "$WHEELS/perf/"  # (Debian's libb64-0d)
    cp -L "$(find "$(dirname "$pa")/.." -name libcudart.so.12 | head -n 1)" "$WHEELS/perf/"  # (its venv's nvidia wheel)
fi
n=$(find "$WHEELS" -name '*.whl' | wc -l)
echo "device-wheels: $n wheels for CPython $PYVER in $WHEELS ($(du -sh "$WHEELS" | cut -f1)): ${pins[*]}"
echo "device-wheels: carry $WHEELS with the working tree (the device tool's carry); scripts/gpu-check.sh installs them"
