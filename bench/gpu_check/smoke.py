"""Smoke run of ``bench/gpu_check.sh``: a tiny Llama planned with half its blocks streamed, run on
the CUDA GPU and on the emulated one; the greedy tokens must agree. Prints TTFT cold/warm, the
pinned bytes and the reserved/allocated peaks against the plan."""

import json
import sys
from pathlib import Path

import transformers

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.runtime.session import RunOptions, run_plan

out = Path(sys.argv[1]) / "tiny"
out.mkdir(parents=True, exist_ok=True)
transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512).save_pretrained(out)
plan = compile_plan(CompileRequest(model=str(out), hw="h200-128g", strategy="stream", weight_dtype="fp32",
                                   gpu_mem="6MiB", prompt_len=32, gen_len=8))[0]
cuda = run_plan(plan, RunOptions(weights="random", emulate=False))
emulated = run_plan(plan, RunOptions(weights="random", emulate=True))
print(json.dumps({"mode": cuda.mode, "measured": cuda.measured, "peak_bytes": cuda.peak_bytes,
                  "planned_bytes": cuda.planned_bytes, "pinned_bytes": cuda.pinned_bytes}, indent=1))
assert cuda.mode == "cuda", cuda.mode
assert cuda.tokens == emulated.tokens, (cuda.tokens, emulated.tokens)
assert cuda.peak_bytes["gpu"] <= plan.memory["gpu_bytes"], (cuda.peak_bytes, plan.memory["gpu_bytes"])
print("smoke ok: CUDA and emulated tokens agree")
