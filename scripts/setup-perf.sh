#!/usr/bin/env bash
# Triton's load generator perf_analyzer in its own venv (.venv-perf), for tests/mpi/test_server.py and
# docs/serving.md.  The newest perf_analyzer wheels need glibc 2.38; tritonclient 2.51.0 is the newest whose
# wheel ships bin/perf_analyzer built for Debian 12's glibc 2.36.  It also needs libb64 (Debian libb64-0d)
# and libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12; no GPU needed).  Its own venv, so it does not
# downgrade the tritonclient the project uses.  Idempotent: returns at once when it is there.
#   ./scripts/setup-perf.sh        VENV_PERF=/path ./scripts/setup-perf.sh
# Where .whl/perf/ holds a carried perf_analyzer (PERF=1 ./scripts/device-wheels.sh), that one is used, offline.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV_PERF:-.venv-perf}
PA=$VENV/bin/perf_analyzer-hpcsplit  # a launcher: the wheel's binary with libcudart on the library path
if [[ -x $PA ]]; then
    echo "$PA"
    exit 0
fi
CARRIED=${HPCSPLIT_WHEELS:-.whl}/perf  # a machine with no index: the binary and its two libraries, carried
if [[ -x $CARRIED/perf_analyzer ]]; then  # (PERF=1 ./scripts/device-wheels.sh puts them there)
    mkdir -p "$VENV/bin"
    cat >"$PA" <<WRAP
#!/usr/bin/env bash
LD_LIBRARY_PATH="$(cd "$CARRIED" && pwd)\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$(cd "$CARRIED" && pwd)/perf_analyzer" "\$@"
WRAP
    chmod +x "$PA"
    echo "$PA"
    exit 0
fi
if ! ldconfig -p 2>/dev/null | grep -q libb64.so.0d; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        echo "[setup-perf] apt-get install libb64-0d" >&2
        (apt-get install -y -q libb64-0d >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libb64-0d >/dev/null; }) >&2
    else
        echo "[setup-perf] perf_analyzer needs libb64.so.0d: install Debian's libb64-0d (as root)" >&2
        exit 1
    fi
fi
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV" >&2
"$VENV/bin/python" -m pip install -q 'tritonclient[http,grpc]==2.51.0' 'nvidia-cuda-runtime-cu12>=12.0,<13' >&2
if [[ ! -x $VENV/bin/perf_analyzer ]]; then
    echo "[setup-perf] the tritonclient 2.51.0 wheel installed no bin/perf_analyzer here" >&2
    exit 1
fi
CUDART=$("$VENV/bin/python" -c 'import nvidia.cuda_runtime as m, os; print(os.path.join(list(m.__path__)[0], "lib"))')
cat >"$PA" <<WRAP
#!/usr/bin/env bash
LD_LIBRARY_PATH="$(cd "$CUDART" && pwd)\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$(cd "$VENV/bin" && pwd)/perf_analyzer" "\$@"
WRAP
chmod +x "$PA"
echo "$PA"
