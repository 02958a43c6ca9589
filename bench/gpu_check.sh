#!/usr/bin/env bash
# GPU checks of the torch runtime, for one H200 in at most 8 minutes (so that a second try fits
# in a 15-minute lease). Steps, in this order, each under its own timeout and all within one
# overall deadline; a failing step is recorded and the next one runs; a table sums up at the end:
#   0. venv      its own virtualenv (system site-packages: the image's torch, transformers,
#                accelerate, safetensors), PuLP and HiGHS from wheels in .whl/, hetplan editable
#   1. smoke     a tiny model planned half on the GPU and run (30 s)
#   2. tests     every CUDA test: dense, MoE, quantised weights, quantised KV, devices, delays
#   3. delays    numerics under injected delays on the GPU stream and on every copy stream
#   4. llama-8b  profile this machine; llama-3.1-8b bf16 with --gpu-mem 9GiB (about half of the
#                16 GB of weights off the GPU), prompt 512, 64 tokens: cold and warm TTFT, TPOT vs
#                the plan (target |error| <= 15%), pinned bytes, reserved and allocated GPU peaks vs
#                the plan, GPU-lane idle time per decode step vs the plan, streamed-load bandwidth
#   5. accel     the same model and cap under Accelerate: decode tokens/s hetplan / Accelerate (>= 2)
#   6. moe       a Mixtral-shaped model (4 of Mixtral-8x7B's layers, 11.5 GB bf16), --gpu-mem 7GiB:
#                ILP plan vs cpu-moe plan, TPOT measured vs predicted
# The device cannot reach PyPI; bring the wheels once from a machine that can:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pulp==3.3.2 highspy==1.16.0
# and run `bash bench/gpu_check.sh` from the repository root with .whl carried along.
# Results land in $OUT (default /tmp/hetplan-gpu-check): one log per step, plans, traces, metrics.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hetplan-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
TOTAL_S=${TOTAL_S:-470}
start=$(date +%s)
VENV=${VENV:-/tmp/hetplan-gpu-venv}
PY="$VENV/bin/python"
declare -a NAMES STATUS SECS

# step NAME CAP_S COMMAND...: run COMMAND under min(CAP_S, time left), log to $OUT/NAME.log
step() {
  local name=$1 cap=$2; shift 2
  local left=$(( TOTAL_S - ($(date +%s) - start) ))
  local limit=$(( cap < left ? cap : left ))
  local t0=$(date +%s) status
  if (( limit < 5 )); then
    status="skipped (no time left)"
  else
    echo "== [$(( t0 - start )) s] $name (limit ${limit} s)"
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    case $rc in
      0) status=ok ;;
      124|137) status="TIMEOUT after ${limit} s" ;;
      *) status="FAILED (rc $rc)" ;;
    esac
    tail -4 "$OUT/$name.log"
  fi
  NAMES+=("$name"); STATUS+=("$status"); SECS+=($(( $(date +%s) - t0 )))
}

setup() {
  python3 -m venv --system-site-packages "$VENV" || return 1
  if ! "$PY" -c "import pulp, highspy" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl || return 1
  fi
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . || return 1
  "$PY" -c "import torch, transformers, accelerate, safetensors, pulp, highspy
assert torch.cuda.is_available(), 'no CUDA device'
print(torch.cuda.get_device_name(0), 'torch', torch.__version__, 'transformers', transformers.__version__)"
}

smoke() {
  "$PY" bench/gpu_check/smoke.py "$OUT"
}

# pytest in one process, whatever pyproject's addopts ask (its -n 2 needs pytest-xdist, which the
# device's image may lack; the tests share one GPU anyway)
run_pytest() { "$PY" -m pytest -o addopts= -q -p no:cacheprovider "$@"; }

cuda_tests() {
  # every test with a CUDA parameter or a CUDA-only test: -k cuda selects both
  run_pytest -W ignore::DeprecationWarning -k "cuda" \
    tests/exec tests/moe tests/distributed
}

delays() {
  run_pytest -W ignore::DeprecationWarning tests/exec/test_delays.py -k cuda
}

llama8b() {
  "$PY" -m hetplan profile --out "$OUT/node.yaml" --budget 40s --model llama-3.1-8b &&
  "$PY" -m hetplan compile llama-3.1-8b --hw "$OUT/node.yaml" --weight-dtype bf16 --gpu-mem 9GiB \
    --prompt-len 512 --gen-len 64 -o "$OUT/plan.json" &&
  "$PY" -m hetplan exec "$OUT/plan.json" --weights random --trace "$OUT/trace.json" --json > "$OUT/exec.json" &&
  "$PY" bench/gpu_check/pinned_copy.py "$OUT/pinned.json"
}

accel() {
  "$PY" bench/gpu_check/accelerate_8b.py "$OUT/accelerate.json"
}

moe() {
  "$PY" - "$OUT/mixtral4/config.json" <<'PYEOF' || return 1
import json, os, sys
os.makedirs(os.path.dirname(sys.argv[1]), exist_ok=True)
json.dump({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
           "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2,
           "rope_theta": 1e6, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}, open(sys.argv[1], "w"))
PYEOF
  local hw="$OUT/node.yaml"
  [[ -f $hw ]] || hw=h200-128g   # the profiled node if step 4 wrote it
  for strategy in ilp cpu-moe; do
    "$PY" -m hetplan compile "$OUT/mixtral4" --hw "$hw" --weight-dtype bf16 --gpu-mem 7GiB \
      --prompt-len 512 --gen-len 32 --strategy $strategy -o "$OUT/moe-$strategy.json" &&
    "$PY" -m hetplan exec "$OUT/moe-$strategy.json" --weights random --json > "$OUT/moe-$strategy.exec.json" || return 1
  done
}

step venv 90 setup
if [[ ! -x $PY ]]; then
  PY=python3   # no venv: carry on with the image's interpreter; later steps say what is missing
fi
step smoke 45 smoke
step tests 150 cuda_tests
step delays 45 delays
step llama-8b 150 llama8b
step accel 75 accel
step moe 90 moe

echo
echo "== [$(( $(date +%s) - start )) s] summary"
printf '%-10s %-26s %6s\n' step status seconds
for i in "${!NAMES[@]}"; do
  printf '%-10s %-26s %6s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}"
done
"$PY" bench/gpu_check/summary.py "$OUT" || echo "(no figures: the steps that make them failed)"
