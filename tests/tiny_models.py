"""Tiny machines and MoE configs shared by the runtime tests.

The GPU node makes the CPU slow (0.2 GB/s, 2 GFLOPS) so that small budgets push the planner
into mixed plans, with near-zero fixed task costs so that tiny models' times are dominated by
bytes and FLOPs.
"""

import torch

TINY_GPU_NODE = """
name: tiny-gpu-node
gpus: [{name: test gpu, memory: 1GiB, mem_bandwidth: 100GB/s, flops: {fp32: 10TFLOPS}}]
cpu: {name: slow cpu, cores: 2, memory: 4GiB, mem_bandwidth: 0.2GB/s, flops: {fp32: 2GFLOPS}}
links: {h2d: 10GB/s, d2h: 10GB/s}
reserve: {gpu: 1KiB, cpu: 1KiB}
latency: {gpu_task: 1.0e-6, cpu_task: 1.0e-6, link_task: 1.0e-6}
"""

VOCAB = 128

MOE_FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True)),
}
"""Tiny Mixtral and Qwen3-MoE configs: (transformers config class, model class, kwargs)."""


def randomise_moe(model, seed: int = 1) -> None:
    """Weights ~ N(0, 0.2), norms ~ 1 + N(0, 0.1), deepseek's correction bias ~ N(0, 0.1).

    transformers' own init (std 0.02) leaves router scores nearly tied and logits nearly flat,
    so which expert or token wins would hinge on rounding; wider weights make every choice
    decisive, and a non-zero correction bias makes it matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def saved_moe_model(families: dict, family: str, tmp_path_factory):
    """(model, directory): a tiny random ``family`` model (``families[family]`` = (config class,
    model class, kwargs)), weights widened by ``randomise_moe``, saved with ``save_pretrained``."""
    import transformers

    config_cls, model_cls, kw = families[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kw)).eval()
    randomise_moe(model)
    directory = tmp_path_factory.mktemp(family)
    model.save_pretrained(directory)
    return model, directory


def greedy_reference(model, ids: torch.Tensor, gen_len: int) -> dict:
    """transformers on ``ids`` alone, greedy: prefill logits [B, P, V], the logits of each of
    ``gen_len`` steps [G, B, V] and the generated tokens; refuses a prompt whose greedy choices
    come near a tie."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        full = model(ids).logits
        out = model.generate(ids, max_new_tokens=gen_len, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    steps = torch.stack(out.logits)
    top2 = steps.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3, "prompt too close to a greedy tie"
    return {"prefill": full, "steps": steps, "tokens": out.sequences[:, ids.shape[1]:].tolist()}
