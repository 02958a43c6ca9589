"""MoE and MLA building blocks on this CPU, side by side with their alternatives, in one run.

1. MLA decode, one DeepSeek-V3 attention layer at its real shapes (hidden 7168, 128 heads,
   q_lora 1536, kv_lora 512, rope 64, nope 128, v 128; random fp32 weights), batch 1, one new
   token after ``--context`` cached tokens: the weight-absorbed path (attention in latent space)
   vs the decompressed path (every cached latent expanded to per-head K and V), and the latent
   cache's bytes vs a full per-head K/V cache.
2. One MoE layer at Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of width 768, 8 per
   token; random fp32 weights): ``moe_forward`` with all experts in one subset, with the experts
   split into two subsets (the GPU/CPU split of a plan, run here one after the other), and
   transformers' Qwen3MoeSparseMoeBlock on the same weights, for a decode step (1 token) and a
   prefill chunk (``--tokens``).

Medians of ``--repeats`` rounds after one warm-up, the variants alternating within each round;
same process, same threads.

    python bench/mla_cpu.py [--context 4096] [--tokens 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from hetplan.frontends.hf_config import spec_from_config
from hetplan.runtime.models.mla import LatentCache, MlaWeights, mla_forward, mla_rope
from hetplan.runtime.models.moe.layer import Expert, MoeLayer, Router, moe_forward

DEEPSEEK_V3_ATTN = dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=1, num_attention_heads=128,
                        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                        q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                        v_head_dim=128, vocab_size=129280, max_position_embeddings=163840)
QWEN3_30B_MOE = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     vocab_size=151936, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)


def medians_s(fns: dict, repeats: int) -> dict:
    """name -> median seconds of ``fns[name]()``, after one warm-up call each; every round calls
    each function once, starting with a different one, so bursts of load on a shared machine
    and cache effects of the previous call hit them alike."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times = {name: [] for name in names}
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:  # each goes first in turn
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_mla(context: int, repeats: int) -> None:
    spec = spec_from_config(DEEPSEEK_V3_ATTN, weight_dtype="fp32", kv_dtype="fp32")
    g = torch.Generator().manual_seed(0)
    h, d, qk = spec.n_heads, spec.hidden, spec.qk_nope_head_dim + spec.qk_rope_head_dim
    r, latent_per_token = spec.kv_lora_rank, spec.kv_lora_rank + spec.qk_rope_head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    w = MlaWeights(kv_a=rand(latent_per_token, d), kv_a_norm=torch.ones(r),
                   kv_b=rand(h * (spec.qk_nope_head_dim + spec.v_head_dim), r),
                   o=rand(d, h * spec.v_head_dim), q_a=rand(spec.q_lora_rank, d),
                   q_a_norm=torch.ones(spec.q_lora_rank), q_b=rand(h * qk, spec.q_lora_rank))
    rope = mla_rope(spec)
    step = torch.randn(1, 1, d, generator=g)
    cache = LatentCache(1, context + 1, spec, torch.float32)  # filled with random cached tokens
    cache.latent.normal_(generator=g)
    cache.k_rope.normal_(generator=g)

    def decode(absorbed):
        def run():
            cache.length = context  # overwrite the same slot each call
            mla_forward(step, w, spec, rope, cache, absorbed=absorbed)
        return run

    with torch.no_grad():
        t = medians_s({"absorbed": decode(True), "decompressed": decode(False)}, repeats)
    absorbed_s, naive_s = t["absorbed"], t["decompressed"]
    full_kv_bytes, latent_bytes = context * 2 * h * qk * 4, context * latent_per_token * 4
    print(f"MLA decode, DeepSeek-V3 layer, context {context}, fp32, {torch.get_num_threads()} threads")
    print(f"  absorbed      {absorbed_s * 1e3:9.2f} ms/token")
    print(f"  decompressed  {naive_s * 1e3:9.2f} ms/token   decompressed/absorbed = "
          f"{naive_s / absorbed_s:.2f}")
    print(f"  cache bytes: latent {latent_bytes:,} vs full K/V {full_kv_bytes:,} "
          f"(ratio {full_kv_bytes / latent_bytes:.1f})")


def bench_moe(tokens: int, repeats: int) -> None:
    config = transformers.Qwen3MoeConfig(**QWEN3_30B_MOE)
    torch.manual_seed(0)
    block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    spec = spec_from_config(dict(QWEN3_30B_MOE, model_type="qwen3_moe"), weight_dtype="fp32")
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    layer = MoeLayer(Router(block.gate.weight.detach()),
                     {e: Expert(gate_up[e], down[e]) for e in range(spec.n_experts)})
    everything = [range(spec.n_experts)]
    halves = [range(0, spec.n_experts, 2), range(1, spec.n_experts, 2)]
    print(f"MoE layer, Qwen3-30B-A3B shapes (128 experts x 768, top-8), fp32, "
          f"{torch.get_num_threads()} threads")
    for n in (1, tokens):
        x = torch.randn(n, spec.hidden, generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            t = medians_s({"one": lambda: moe_forward(x, layer, spec, everything),
                           "two": lambda: moe_forward(x, layer, spec, halves),
                           "transformers": lambda: block(x[None])}, repeats)
        one, two, hf = t["one"], t["two"], t["transformers"]
        print(f"  {n:4d} tokens: one subset {one * 1e3:8.2f} ms  two subsets {two * 1e3:8.2f} ms "
              f"(x{two / one:.2f})  transformers {hf * 1e3:8.2f} ms  (hetplan/transformers {one / hf:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    bench_mla(args.context, args.repeats)
    bench_moe(args.tokens, args.repeats)


if __name__ == "__main__":
    main()
