#!/usr/bin/env bash
# Issue 31's targets that need spare cores, on a machine that has them (a lent GPU machine: 16 cores), prepared
# as one short run: the transport against raw MPI on one node, then the server bench with the servers and
# perf_analyzer on separate halves of the cores (taskset) and 0, 2 and 4 protocol workers. Everything goes to one
# folder with a summary.md; each step has its own timeout and log, going on after a failure; exit 1 if any failed.
# docs/serving.md ("On a node with spare cores").
#
#   ./scripts/device-cpu-check.sh                          # outputs/cpu-check-<UTC time>
#   CPU_CHECK_OUT=/tmp/cc CPU_CHECK_T_SERVER=400 ./scripts/device-cpu-check.sh
#   CPU_CHECK_SERVER_CPUS=0 CPU_CHECK_CLIENT_CPUS=1 CPU_CHECK_WORKERS=0,1 CPU_CHECK_CONCURRENCY=8 ...   # any split
#
# Needs .venv (scripts/setup.sh, or scripts/device-setup.sh offline) and perf_analyzer (scripts/setup-perf.sh,
# or carried in .whl/perf: PERF=1 ./scripts/device-wheels.sh).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=$(pwd)/.venv/bin/python
OUT=${CPU_CHECK_OUT:-outputs/cpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
T0=$SECONDS
FAILED=0
declare -a ROWS=()

if [[ ! -x $PY ]]; then
    if compgen -G "${HPCSPLIT_WHEELS:-.whl}/*.whl" >/dev/null; then
        timeout -k 5 "${CPU_CHECK_T_SETUP:-90}" ./scripts/device-setup.sh >"$OUT/setup.log" 2>&1 \
            || { echo "cpu-check: setup failed ($OUT/setup.log)"; exit 1; }
    else
        echo "cpu-check: no .venv: run ./scripts/setup.sh (or carry .whl and let scripts/device-setup.sh make it)"
        exit 1
    fi
fi
CORES=$(nproc)
if (( CORES < 4 )) && [[ -z ${CPU_CHECK_SERVER_CPUS:-} ]]; then
    echo "cpu-check: $CORES cores here: the servers and the clients need cores of their own (4 at least)"
    exit 1
fi
HALF=$(( CORES / 2 ))
SERVER_CPUS=${CPU_CHECK_SERVER_CPUS:-0-$(( HALF - 1 ))}
CLIENT_CPUS=${CPU_CHECK_CLIENT_CPUS:-$HALF-$(( CORES - 1 ))}
WORKERS=${CPU_CHECK_WORKERS:-0,$(( HALF / 4 > 1 ? HALF / 4 : 1 )),$(( HALF / 2 > 2 ? HALF / 2 : 2 ))}
CONCURRENCY=${CPU_CHECK_CONCURRENCY:-8,64}

step() {
    local name=$1 limit=$2
    shift 2
    local log=$OUT/$name.log t=$SECONDS rc verdict=PASS
    echo "cpu-check: [$name] (limit ${limit} s) $*"
    timeout --kill-after=20 "$limit" "$@" >"$log" 2>&1
    rc=$?
    if (( rc == 124 || rc == 137 )); then verdict="FAIL (timed out after ${limit} s)"
    elif (( rc != 0 )); then verdict="FAIL (exit $rc)"; fi
    [[ $verdict == PASS ]] || FAILED=1
    ROWS+=("| $name | $verdict | $(( SECONDS - t )) | $name.log |")
    echo "cpu-check: [$name] $verdict in $(( SECONDS - t )) s"
    return 0
}

step transport "${CPU_CHECK_T_TRANSPORT:-90}" "$PY" -m hpcsplit.bench transport --sizes 4K,16K,64K,1M,4M
step server "${CPU_CHECK_T_SERVER:-270}" "$PY" -m hpcsplit.bench server --concurrency "$CONCURRENCY" \
    --protocols http-binary,grpc --interval-ms 1000 --rounds 1 --workers "$WORKERS" \
    --server-cpus "$SERVER_CPUS" --client-cpus "$CLIENT_CPUS" --out "$OUT/server"

{
    echo "# hpcsplit CPU check (issue 31 on spare cores)"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'),"
    echo "$CORES cores (servers on $SERVER_CPUS, perf_analyzer on $CLIENT_CPUS, workers $WORKERS), $(( SECONDS - T0 )) s"
    echo
    echo "| step | result | seconds | log |"
    echo "|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    for name in transport server; do
        echo
        echo "## $name"
        echo
        echo '```'
        tail -n 60 "$OUT/$name.log"
        echo '```'
    done
} >"$OUT/summary.md"
printf '%s\n' "${ROWS[@]}"
echo "cpu-check: everything is in $OUT (read $OUT/summary.md)"
exit "$FAILED"
