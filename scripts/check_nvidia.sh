#!/usr/bin/env bash
# Checks the NVIDIA back end on a machine with a CUDA GPU, where deepinfer is importable:
#   bash scripts/check_nvidia.sh [OUT_DIR]        (default: nvidia-check/)
# 1. the machine (nvidia-smi, torch) and `deepinfer doctor`;
# 2. the NVIDIA tests: the GPU tests (engine on the GPU vs the cpu back end) and the plumbing tests;
# 3. the conformance kit on `nvidia` (report: OUT_DIR/conformance.json);
# 4. a small benchmark: random `default`-size V4 and V4.1 checkpoints, bf16, then the V4 `bench` size.
# Every step has its own time limit and log (OUT_DIR/*.log); a failing step does not stop the others.
# The exit status is the number of failed steps.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-nvidia-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DEEPINFER_ACCELERATOR=nvidia
failed=0

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, report the outcome
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: rc=$rc in $(( $(date +%s) - start )) s"
    tail -n 4 "$OUT/$name.log" | sed 's/^/   /'
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

{ nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
step doctor 60 "$PY" -m deepinfer.cli doctor
step tests 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_nvidia_gpu.py tests/test_nvidia_backend.py
step conformance 180 "$PY" -m deepinfer.cli conformance nvidia --conformance-report "$OUT/conformance.json"

# the benchmark's parallel scale is the length of CUDA_VISIBLE_DEVICES (one device unless set)
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
models=$(mktemp -d)
for family in v4 v41; do
    step "make-$family" 120 "$PY" -m deepinfer.cli make-model "$models/$family" --family "$family" --size default
    DEEPINFER_USE_NEXTN_DECODE=0 step "bench-$family" 150 "$PY" examples/benchmark.py --preset cpu \
        --model_name "$models/$family" --dtype bfloat16 --decode_num_requests 32
done
DEEPINFER_USE_NEXTN_DECODE=5 step bench-v4-nextn5 150 "$PY" examples/benchmark.py --preset cpu \
    --model_name "$models/v4" --dtype bfloat16 --decode_num_requests 32
DEEPINFER_USE_NEXTN_DECODE=0 PROFILE=1 step profile-v4 150 "$PY" examples/benchmark.py --preset cpu \
    --model_name "$models/v4" --dtype bfloat16 --decode_num_requests 32 --profile_dir "$models/profiles"
step make-v4-bench 180 "$PY" -m deepinfer.cli make-model "$models/v4-bench" --family v4 --size bench
DEEPINFER_USE_NEXTN_DECODE=0 step bench-v4-bench 180 "$PY" examples/benchmark.py --preset cpu \
    --model_name "$models/v4-bench" --dtype bfloat16 --decode_num_requests 64 --context_length 1024
rm -rf "$models"
echo "failed steps: $failed"
exit "$failed"
