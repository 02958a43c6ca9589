#!/usr/bin/env bash
# GPU checks of the torch runtime, sized for one H200 in under 10 minutes:
#   1. the runtime's tests on CUDA (numerics of every family under every kind of plan vs
#      transformers; streamed weights arriving before use; staging slots not overwritten in use);
#   2. llama-3.1-8b, bf16, random weights, --gpu-mem 9GiB (about half the 16 GB of weights off
#      the GPU), prompt 512, 64 new tokens, planned on this machine as `hetplan profile` measures
#      it: measured vs predicted TTFT and TPOT (target |error| <= 15%), and the bandwidth achieved
#      by streamed weight loads vs a plain pinned host-to-device copy (target >= 80%);
#   3. the same model and cap under Accelerate (device_map from max_memory {0: 9GiB}):
#      decode tokens/s of hetplan / Accelerate (target >= 2);
#   4. a Mixtral-shaped model (Mixtral-8x7B's layers, 8 of them: 23 GB bf16), random weights,
#      --gpu-mem 14GiB so that about half of the experts stay on the CPU: the ILP plan's measured
#      vs predicted TPOT (target |error| <= 15%) and its decode tokens/s vs the cpu-moe plan's.
# Prints what it measured; writes plan, trace and metrics under $OUT (default /tmp/hetplan-gpu-check).
#
# The GPU machine's image has torch, transformers, accelerate and safetensors but not PuLP and
# HiGHS; bring them as wheels in .whl/ (ignored by git) from a machine with PyPI:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl pulp==3.3.2 highspy==1.16.0
# and run `bash bench/gpu_check.sh` from the repository root with .whl carried along.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hetplan-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
start=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - start )) s] $*"; }

if ! $PY -c "import pulp, highspy" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), torch.__version__)"

stamp "1. numerics on CUDA"
$PY -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/test_exec_numerics.py tests/test_runtime_scheduling.py tests/test_exec_moe.py tests/test_exec_moe_split.py -k cuda > "$OUT/pytest.log" 2>&1 \
  || echo "CUDA TESTS FAILED (see $OUT/pytest.log)"
tail -3 "$OUT/pytest.log"

stamp "2. profile this machine, plan llama-3.1-8b bf16 with --gpu-mem 9GiB"
$PY -m hetplan profile --out "$OUT/node.yaml" --budget 75s --model llama-3.1-8b | tail -2
$PY -m hetplan compile llama-3.1-8b --hw "$OUT/node.yaml" --weight-dtype bf16 --gpu-mem 9GiB \
  --prompt-len 512 --gen-len 64 -o "$OUT/plan.json"

stamp "   hetplan exec"
$PY -m hetplan exec "$OUT/plan.json" --weights random --trace "$OUT/trace.json" --json > "$OUT/exec.json"

stamp "   pinned host-to-device bandwidth"
$PY - "$OUT/pinned.json" <<'EOF'
import json, sys, torch
src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
dst = torch.empty_like(src, device="cuda")
rates = []
for _ in range(6):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); dst.copy_(src, non_blocking=True); b.record(); b.synchronize()
    rates.append(src.numel() / (a.elapsed_time(b) / 1e3))
json.dump({"pinned_h2d_bytes_per_s": sorted(rates)[len(rates) // 2]}, open(sys.argv[1], "w"))
EOF

stamp "3. Accelerate device_map with max_memory {0: 9GiB}"
$PY - "$OUT/accelerate.json" <<'EOF'
import json, sys, time, torch, transformers
from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
from hetplan.frontends.resolve import load_model
spec = load_model("llama-3.1-8b", "bf16")
cfg = transformers.LlamaConfig(hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                               num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads,
                               num_key_value_heads=spec.n_kv_heads, vocab_size=spec.vocab,
                               max_position_embeddings=spec.max_positions, rope_theta=spec.rope_theta,
                               tie_word_embeddings=spec.tie_embeddings)
with init_empty_weights():
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.to_empty(device="cpu")
with torch.no_grad():  # constant weights: decode speed does not depend on the values
    for name, p in model.named_parameters():
        p.fill_(1.0 if "norm" in name else 0.01)
for name, m in list(model.named_modules()):  # rotary tables are buffers to_empty left unset
    if name.endswith("rotary_emb"):
        setattr(model.get_submodule(name.rsplit(".", 1)[0]), "rotary_emb", type(m)(config=cfg))
model.eval()
device_map = infer_auto_device_map(model, max_memory={0: "9GiB", "cpu": "100GiB"},
                                   no_split_module_classes=["LlamaDecoderLayer"])
model = dispatch_model(model, device_map=device_map)
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0

class Stamp(transformers.LogitsProcessor):
    def __init__(self): self.t = []
    def __call__(self, ids, scores): self.t.append(time.perf_counter()); return scores

ids = torch.randint(0, spec.vocab, (1, 512), device="cuda")
stamp = Stamp()
with torch.inference_mode():
    model.generate(ids, max_new_tokens=24, do_sample=False, logits_processor=[stamp],
                   attention_mask=torch.ones_like(ids))
gaps = [b - a for a, b in zip(stamp.t, stamp.t[1:])]
on_gpu = sum(1 for d in device_map.values() if d == 0)
json.dump({"tpot_s": sum(gaps) / len(gaps), "modules_on_gpu": on_gpu, "modules": len(device_map)},
          open(sys.argv[1], "w"))
EOF

stamp "4. Mixtral-shaped model, 8 layers, bf16, --gpu-mem 14GiB: ilp and cpu-moe plans"
mkdir -p "$OUT/mixtral8"
$PY - "$OUT/mixtral8/config.json" <<'EOF'
import json, sys
json.dump({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 8,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
           "max_position_embeddings": 32768, "num_local_experts": 8, "num_experts_per_tok": 2,
           "rope_theta": 1e6, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}, open(sys.argv[1], "w"))
EOF
for strategy in ilp cpu-moe; do
  $PY -m hetplan compile "$OUT/mixtral8" --hw "$OUT/node.yaml" --weight-dtype bf16 --gpu-mem 14GiB \
    --prompt-len 512 --gen-len 64 --strategy $strategy -o "$OUT/moe-$strategy.json"
  $PY -m hetplan exec "$OUT/moe-$strategy.json" --weights random --json > "$OUT/moe-$strategy.exec.json"
done

stamp "summary"
$PY - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
r = json.load(open(f"{out}/exec.json"))
pinned = json.load(open(f"{out}/pinned.json"))["pinned_h2d_bytes_per_s"]
acc = json.load(open(f"{out}/accelerate.json"))
print(f"{'':18}{'measured':>12}{'predicted':>12}{'error':>9}   target |error| <= 15%")
for k in ("ttft_s", "tpot_s"):
    print(f"{k:18}{r['measured'][k] * 1e3:10.2f}ms{r['predicted'][k] * 1e3:10.2f}ms{r['relative_error'][k]:+9.1%}")
print(f"peak GPU {r['peak_bytes']['gpu'] / 2**30:.2f} GiB (plan {r['planned_bytes']['gpu'] / 2**30:.2f} GiB)")
h2d = r.get("h2d_bytes_per_s")
if h2d:
    print(f"streamed loads {h2d / 1e9:.1f} GB/s vs pinned copy {pinned / 1e9:.1f} GB/s: {h2d / pinned:.0%} (target >= 80%)")
else:
    print(f"no streamed loads in decode; pinned copy {pinned / 1e9:.1f} GB/s")
ours = r["measured"]["decode_tokens_per_s"]
theirs = 1 / acc["tpot_s"]
print(f"decode tokens/s: hetplan {ours:.2f}, Accelerate {theirs:.2f} ({acc['modules_on_gpu']}/{acc['modules']} "
      f"modules on GPU): ratio {ours / theirs:.2f} (target >= 2)")
plans = {s: json.load(open(f"{out}/moe-{s}.json")) for s in ("ilp", "cpu-moe")}
runs = {s: json.load(open(f"{out}/moe-{s}.exec.json")) for s in ("ilp", "cpu-moe")}
hot = sum(p["experts_on_gpu"] for p in plans["ilp"]["placement"] if p["kind"] == "moe")
print(f"mixtral-shaped, {hot}/64 experts on the GPU under the ILP plan:")
for s, r in runs.items():
    print(f"  {s:8} TPOT measured {r['measured']['tpot_s'] * 1e3:.2f} ms, predicted {r['predicted']['tpot_s'] * 1e3:.2f} ms "
          f"({r['relative_error']['tpot_s']:+.1%}, target |error| <= 15%), {r['measured']['decode_tokens_per_s']:.2f} tok/s")
ratio = runs["ilp"]["measured"]["decode_tokens_per_s"] / runs["cpu-moe"]["measured"]["decode_tokens_per_s"]
print(f"  decode tokens/s ilp / cpu-moe: {ratio:.2f}")
EOF
stamp "done"
