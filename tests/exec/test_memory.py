"""The runtime holds one copy of the weights: an all-CPU run from a safetensors checkpoint grows
the process by at most 1.15x (weights + KV cache + workspace), measured by the kernel (VmHWM of
a fresh process) against sizes derived here from the model's shapes. With quantised weights the
fp32 checkpoint is quantised at load time, tensor by tensor and rows at a time, its pages let
go as they are read: the bound is then the packed bytes (``tests.exec.quant_spec``'s sizes from
the format definitions, the embedding table in fp16) + KV + workspace, beyond what a run of a
model with almost no weights grows by (libraries, thread pools, allocator arenas: a constant
that is a few percent of a real model's bytes but a third of this test model's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.runtime.backend import backend_for
from hetplan.runtime.weights import random_state_dict
from tests.exec import quant_spec

CPU_NODE = """
name: cpu-only
cpu: {name: cpu, cores: 2, memory: 8GiB, mem_bandwidth: 10GB/s, flops: {fp32: 100GFLOPS, bf16: 100GFLOPS}}
reserve: {cpu: 1KiB}
"""
D, I, L, H, KVH, V = 512, 1536, 6, 8, 4, 32000
HD = D // H
BATCH, PROMPT, GEN = 1, 32, 4

PROBE = r"""
import json, sys
from pathlib import Path
from hetplan.plan import Plan
from hetplan.runtime.session import RunOptions, run_plan

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

plan = Plan.from_json(Path(sys.argv[1]).read_text())
opts = RunOptions(weights=sys.argv[2], prompt_ids=(tuple(range(1, 1 + int(sys.argv[3]))),), gen_len=int(sys.argv[4]))
try:
    Path("/proc/self/clear_refs").write_text("5")   # VmHWM := VmRSS from here on
except OSError:
    pass
before = status("VmRSS")
run_plan(plan, opts)
print(json.dumps({"before": before, "hwm": status("VmHWM")}))
"""


def weight_bytes() -> int:
    """fp32 Llama: embedding and untied head V x D; per layer q, o D x D, k, v D x KVH*hd,
    gate, up, down D x I, two norms D; the final norm D."""
    per_layer = 2 * D * D + 2 * D * KVH * HD + 3 * D * I + 2 * D
    return 4 * (2 * V * D + L * per_layer + D)


def packed_weight_bytes(fmt: str) -> int:
    """The same model with its linears (head included) packed in ``fmt``, each padded to 16
    bytes, the embedding table in fp16, norms fp32."""
    def linear(rows, cols):
        return -(-quant_spec.nbytes(fmt, rows, cols) // 16) * 16
    per_layer = (2 * linear(D, D) + 2 * linear(KVH * HD, D) + 2 * linear(I, D) + linear(D, I) + 4 * 2 * D)
    return 2 * V * D + linear(V, D) + L * per_layer + 4 * D


def kv_bytes() -> int:
    """k and v, fp32, for every layer and every position of the context."""
    return 4 * 2 * L * BATCH * (PROMPT + GEN) * KVH * HD


def workspace_bytes() -> int:
    """The widest prefill activations, fp32: the residual, q, k, v, o and the attention output
    (6 x P x D), gate, up and their product (3 x P x I), the scores (H x P x P) and one row of
    logits (V)."""
    return 4 * BATCH * (PROMPT * (6 * D + 3 * I + H * PROMPT) + V)


def save_model(root: Path, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int) -> dict:
    """A random fp32 Llama checkpoint in ``root`` and its all-CPU plans per weight dtype."""
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    cfg.save_pretrained(root)
    (root / "node.yaml").write_text(CPU_NODE)
    for fmt in ("fp32", "q8_0", "q4_0"):
        plan = compile_plan(CompileRequest(model=str(root), hw=str(root / "node.yaml"), strategy="ilp",
                                           weight_dtype=fmt, prompt_len=PROMPT, gen_len=GEN))[0]
        (root / f"plan-{fmt}.json").write_text(plan.to_json())
    backend = backend_for(plan.model)
    blocks = [(p["block"], p["kind"], p["layer"]) for p in plan.placement]
    state = random_state_dict(backend, blocks, torch.float32, seed=3)
    save_file({k: v.contiguous() for k, v in state.items()}, str(root / "model.safetensors"))
    return state


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("rss")
    state = save_model(root, D, I, L, H, KVH, V)
    assert sum(t.numel() * 4 for t in state.values()) == weight_bytes()
    return root


@pytest.fixture(scope="module")
def fixed_growth(tmp_path_factory):
    """What a run grows by whatever its model (the kernels' library, thread pools, allocator
    arenas): the same probe on a model of about 40 KiB of weights."""
    root = tmp_path_factory.mktemp("rss-empty")
    save_model(root, 32, 64, 1, 2, 1, 64)
    return {fmt: peak_growth(root, fmt) for fmt in ("q8_0", "q4_0")}


def peak_growth(checkpoint, fmt: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, str(checkpoint / f"plan-{fmt}.json"), str(checkpoint),
                          str(PROMPT), str(GEN)], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    return rss["hwm"] - rss["before"]


def test_all_cpu_run_holds_one_copy_of_the_weights(checkpoint):
    grown = peak_growth(checkpoint, "fp32")
    bound = 1.15 * (weight_bytes() + kv_bytes() + workspace_bytes())
    # two copies (placed + mapped) would be about 2x the weights
    assert grown <= bound, f"peak RSS grew {grown / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB"


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantised_all_cpu_run_holds_the_packed_bytes_not_the_checkpoint(checkpoint, fixed_growth, fmt):
    grown = peak_growth(checkpoint, fmt) - fixed_growth[fmt]
    bound = 1.15 * (packed_weight_bytes(fmt) + kv_bytes() + workspace_bytes())
    # the fp32 checkpoint resident while quantising would add weight_bytes() (about 3.8x q8_0's)
    assert grown <= bound, f"peak RSS grew {grown / 2**20:.1f} MiB, bound {bound / 2**20:.1f} MiB"
