#!/usr/bin/env bash
# The first run on a GPU machine, prepared: from a fresh clone, in under 8 minutes, it sets up (CUDA torch),
# prints nvidia-smi and what hpcsplit detects (cluster=auto), runs `pytest -m gpu`, runs the clip_tiny
# pipeline on the GPU end to end, then full ViT-B/32 CLIP with 2-3 memory slices and a short split-vs-whole
# bench, and writes everything (logs, profiles, plans, bench CSVs, plots, summary.md with pass/fail per
# step) under one folder, named at the end. Each step has its own timeout; the exit code is 1 if any failed.
# On a machine without an NVIDIA GPU it says so and exits 0 having run nothing.  See docs/gpu.md.
#
#   ./scripts/gpu-check.sh
#   HPCSPLIT_TORCH_INDEX=https://download.pytorch.org/whl/cu126 ./scripts/gpu-check.sh   # another CUDA build
#   HPCSPLIT_TORCH_INDEX=none ./scripts/gpu-check.sh     # torch from pip's own index/config (e.g. a local mirror)
#   GPU_CHECK_OUT=/scratch/check ./scripts/gpu-check.sh  # the folder (default outputs/gpu-check-<UTC time>)
#   GPU_CHECK_T_SETUP=600 ./scripts/gpu-check.sh         # a step's timeout in s (SETUP DETECT TESTS TINY CLIP)
# On a machine that reaches no package index (the lent GPU machines), carry the wheels of
# scripts/device-wheels.sh in .whl/ (or HPCSPLIT_WHEELS=DIR): setup is then scripts/device-setup.sh, offline,
# on the machine's own python3 and its CUDA torch.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)

# ------------------------------------------------------------------------------------------ any GPU?
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU here (no nvidia-smi on PATH): nothing to check, nothing was run."
    exit 0
fi
if ! gpus=$(timeout 30 nvidia-smi -L 2>&1) || ! grep -q '^GPU ' <<<"$gpus"; then
    echo "gpu-check: no NVIDIA GPU here (nvidia-smi -L: ${gpus:-no output}): nothing to check, nothing was run."
    exit 0
fi

TORCH_VERSION=2.13.0                     # the pin of scripts/setup.sh
TORCH_INDEX=${HPCSPLIT_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}
OUT=${GPU_CHECK_OUT:-outputs/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=$REPO/.venv/bin/python
T0=$SECONDS
declare -a ROWS=()
FAILED=0
echo "gpu-check: $(grep -c '^GPU ' <<<"$gpus") GPU(s); everything goes to $OUT"

# step NAME TIMEOUT_S CMD...: run CMD with its own time limit, log to $OUT/NAME.log, record pass/fail
step() {
    local name=$1 limit=$2
    shift 2
    local log=$OUT/$name.log t=$SECONDS rc
    echo "gpu-check: [$name] (limit ${limit} s) $*"
    timeout --kill-after=20 "$limit" bash -c '"$@"' "$name" "$@" >"$log" 2>&1  # bash -c: functions too
    rc=$?
    local took=$(( SECONDS - t )) verdict=PASS
    if (( rc == 124 || rc == 137 )); then verdict="FAIL (timed out after ${limit} s)"
    elif (( rc != 0 )); then verdict="FAIL (exit $rc)"; fi
    [[ $verdict == PASS ]] || FAILED=1
    ROWS+=("| $name | $verdict | $took | $name.log |")
    echo "gpu-check: [$name] $verdict in ${took} s"
    [[ $verdict == PASS ]] || tail -n 15 "$log" | sed 's/^/    /'
    return 0
}

do_setup() {
    # Carried wheels (scripts/device-wheels.sh): a machine that reaches no index, whose python3 holds a CUDA
    # torch (the lent GPU machines): scripts/device-setup.sh builds .venv on it, offline.
    if compgen -G "${HPCSPLIT_WHEELS:-.whl}/*.whl" >/dev/null; then
        ./scripts/device-setup.sh || return 1
        "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "the torch of this Python sees no GPU")' || return 1
        return 0
    fi
    # A CUDA torch of the pinned version first (pip's default index may give the CPU wheel), then
    # scripts/setup.sh, which keeps a torch 2.13.0 it finds and installs hpcsplit with its extras.
    if [[ -x $PY ]] && "$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda and torch.__version__.split("+")[0] == sys.argv[1] else 1)' "$TORCH_VERSION" 2>/dev/null; then
        echo "CUDA torch already in .venv: $("$PY" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')"
    else
        [[ -x $PY ]] || "${PYTHON:-python3}" -m venv .venv || return 1
        if "$PY" -c 'import torch' 2>/dev/null; then  # a CPU (or other) build: replace it
            echo "replacing $("$PY" -c 'import torch; print("torch", torch.__version__)') (no CUDA)"
            "$PY" -m pip uninstall -y -q torch || return 1
        fi
        if [[ $TORCH_INDEX == none ]]; then
            "$PY" -m pip install "torch==$TORCH_VERSION" || return 1
        else
            echo "installing torch==$TORCH_VERSION from $TORCH_INDEX (HPCSPLIT_TORCH_INDEX)"
            "$PY" -m pip install --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" || return 1
        fi
    fi
    ./scripts/setup.sh || return 1
    "$PY" -c 'import torch, sys; print("torch", torch.__version__, "CUDA", torch.version.cuda, "available:", torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)'
}

do_detect() {
    nvidia-smi
    nvidia-smi -L
    nvidia-smi --query-gpu=index,name,memory.total,mig.mode.current,driver_version --format=csv || true
    "$PY" -m hpcsplit.core.detect >"$OUT/detected.json.txt" || return 1
    cat "$OUT/detected.json.txt"
    # nvidia-smi sees a GPU: cluster=auto must too (else NVML, the driver or torch is what is broken)
    "$PY" -c 'import sys; from hpcsplit.core.detect import detect_gpus; d = detect_gpus(); sys.exit(0 if d.gpus else f"cluster=auto found no GPU: {d.why}")' || return 1
    "$PY" -c 'import torch; [print(f"torch cuda:{i}", torch.cuda.get_device_properties(i)) for i in range(torch.cuda.device_count())]'
    "$PY" -m hpcsplit --cfg job --resolve >/dev/null  # the config composes with cluster=auto
}

# The largest 2-3 slices of what cluster=auto finds (MIG: its instance sizes), as a Hydra list.
clip_slices() {
    "$PY" - <<'EOF'
from hpcsplit.core.detect import detect_gpus
s = detect_gpus().cluster_fields().get("slices_gb") or []
print("[" + ",".join(f"{x:g}" for x in s[-3:]) + "]")
EOF
}

export REPO PY OUT TORCH_INDEX TORCH_VERSION
export -f do_setup do_detect
step setup "${GPU_CHECK_T_SETUP:-200}" do_setup
if [[ ! -x $PY ]]; then
    echo "gpu-check: setup made no .venv: the other steps cannot run"
else
    step detect "${GPU_CHECK_T_DETECT:-40}" do_detect
    step gpu-tests "${GPU_CHECK_T_TESTS:-110}" "$PY" -m pytest tests -m gpu -q -p no:cacheprovider -rs \
        --junitxml="$OUT/gpu-tests.xml"
    step clip-tiny-pipeline "${GPU_CHECK_T_TINY:-70}" "$PY" -m hpcsplit +experiment=clip_tiny \
        "hydra.run.dir=$OUT/clip_tiny" profile.max_batch=8 \
        bench.qps=[20,80] bench.duration_s=2 bench.min_requests=10 bench.warmup_s=0.5
    SLICES=$(clip_slices 2>/dev/null || echo "[]")
    slices=()  # none found: cluster=auto's own (the step then says why it has no GPU)
    [[ $SLICES == "[]" ]] || slices=("cluster.slices_gb=$SLICES")
    step clip-vitb32-slices "${GPU_CHECK_T_CLIP:-140}" "$PY" -m hpcsplit +experiment=clip \
        "hydra.run.dir=$OUT/clip" "${slices[@]}" profile.max_batch=8 profile.iters=5 \
        profile.util_window_ms=100 bench.qps=[10,40] bench.duration_s=3 bench.min_requests=10 bench.warmup_s=1
fi

# ------------------------------------------------------------------------------------------ summary
{
    echo "# hpcsplit GPU check"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'),"
    echo "$(( SECONDS - T0 )) s in all; torch index: $TORCH_INDEX (HPCSPLIT_TORCH_INDEX)"
    echo
    echo '```'
    echo "$gpus"
    [[ -f $OUT/detected.json.txt ]] && tail -n 1 "$OUT/detected.json.txt"
    echo '```'
    echo
    echo "| step | result | seconds | log |"
    echo "|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "## Files"
    (cd "$OUT" && find . -type f \( -name '*.h5' -o -name 'plan.json' -o -name '*.csv' -o -name '*.png' \
        -o -name 'summary.md' -o -name '*.xml' \) | sort | sed 's/^\.\//- /')
    for run in clip_tiny clip; do
        if [[ -f $OUT/$run/summary.md ]]; then
            echo
            echo "## $run: the pipeline's summary"
            echo
            sed 's/^#/##/' "$OUT/$run/summary.md"
        fi
    done
} >"$OUT/summary.md"

echo
printf '%s\n' "${ROWS[@]}"
if (( FAILED )); then
    echo "gpu-check: FAILED steps above; everything is in $OUT (read $OUT/summary.md)"
    exit 1
fi
echo "gpu-check: all steps passed; everything is in $OUT (read $OUT/summary.md)"
