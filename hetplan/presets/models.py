"""Model presets: public Hugging Face ``config.json`` contents, trimmed to the keys hetplan reads.

Each entry goes through the same parser as a user's config.json, so a preset is exactly what a
user gets by pointing ``hetplan compile`` at the downloaded config.
"""

from __future__ import annotations

from hetplan.errors import HetplanError
from hetplan.frontends.hf_config import spec_from_config
from hetplan.model import ModelSpec

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

MODEL_PRESETS: dict[str, dict] = {
    # meta-llama/Llama-2-7b-hf config.json
    "llama-2-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       rope_theta=10000.0, torch_dtype="float16"),
    # meta-llama/Llama-3.2-1B config.json
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling=dict(_LLAMA31_ROPE, factor=32.0), torch_dtype="bfloat16"),
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, torch_dtype="bfloat16"),
    # meta-llama/Llama-3.1-70B config.json
    "llama-3.1-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
                          rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, torch_dtype="bfloat16"),
    # mistralai/Mistral-7B-v0.1 config.json
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5,
                       rope_theta=10000.0, torch_dtype="bfloat16"),
    # Qwen/Qwen2.5-72B-Instruct config.json
    "qwen2.5-72b": dict(model_type="qwen2", hidden_size=8192, intermediate_size=29568,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
                        rope_theta=1000000.0, torch_dtype="bfloat16"),
    # facebook/opt-6.7b config.json
    "opt-6.7b": dict(model_type="opt", hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                     num_attention_heads=32, vocab_size=50272, max_position_embeddings=2048,
                     word_embed_proj_dim=4096, do_layer_norm_before=True, torch_dtype="float16"),
    # facebook/opt-30b config.json
    "opt-30b": dict(model_type="opt", hidden_size=7168, ffn_dim=28672, num_hidden_layers=48,
                    num_attention_heads=56, vocab_size=50272, max_position_embeddings=2048,
                    word_embed_proj_dim=7168, do_layer_norm_before=True, torch_dtype="float16"),
    # OPT-175B (metaseq release; same shape family as facebook/opt-66b config.json)
    "opt-175b": dict(model_type="opt", hidden_size=12288, ffn_dim=49152, num_hidden_layers=96,
                     num_attention_heads=96, vocab_size=50272, max_position_embeddings=2048,
                     word_embed_proj_dim=12288, do_layer_norm_before=True, torch_dtype="float16"),
    # openai-community/gpt2 config.json
    "gpt2": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                 n_positions=1024, activation_function="gelu_new", layer_norm_epsilon=1e-5,
                 torch_dtype="float32"),
    # mistralai/Mixtral-8x7B-v0.1 config.json
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=32000, max_position_embeddings=32768, rms_norm_eps=1e-5,
                         rope_theta=1000000.0, num_local_experts=8, num_experts_per_tok=2,
                         torch_dtype="bfloat16"),
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          torch_dtype="bfloat16"),
    # Qwen/Qwen3-235B-A22B config.json
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, vocab_size=151936,
                            max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                            num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                            torch_dtype="bfloat16"),
    # deepseek-ai/DeepSeek-V3 config.json
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_routed_experts=256, num_experts_per_tok=8,
                        n_shared_experts=1, first_k_dense_replace=3, q_lora_rank=1536,
                        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                        vocab_size=129280, max_position_embeddings=163840, rms_norm_eps=1e-6,
                        rope_theta=10000.0, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                        norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
                        rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                                      "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "original_max_position_embeddings": 4096},
                        torch_dtype="bfloat16"),
}


def model_preset(name: str, weight_dtype: str | None = None, kv_dtype: str | None = None) -> ModelSpec:
    if name not in MODEL_PRESETS:
        raise HetplanError(f"unknown model preset {name!r}; known presets: "
                           f"{', '.join(sorted(MODEL_PRESETS))} (or pass a config.json path)")
    return spec_from_config(MODEL_PRESETS[name], name=name, source=f"preset {name}",
                            weight_dtype=weight_dtype, kv_dtype=kv_dtype)
