"""The keys of a Hugging Face ``config.json`` that hetplan reads: each key's type and range.

A config.json carries many keys hetplan has no use for (token ids, dropout, ``architectures``,
the transformers version, ...), and checkpoints add their own, so an unknown top-level key is
left alone, unless it is a near-miss of a key hetplan reads (``num_hiden_layers``): that is a
typo, refused with the key it was meant to be. Every key hetplan reads must have its exact type
(no ``"64"`` for 64, no ``"false"`` for false) and a possible value; the RoPE mappings are strict
at every depth. Which keys a family requires is ``hetplan.frontends.hf_config``'s business.
"""

from __future__ import annotations

import difflib
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hetplan.schema.fields import Count, Dim, Strict, quantity

Name = Annotated[str, Field(max_length=500)]
Eps = quantity("x", 1.0, low_open=True)
Factor = quantity("x", 1e6)


class RopeScaling(Strict):
    """A Hugging Face ``rope_scaling`` (or ``rope_parameters``) mapping: the keys transformers'
    RoPE types read."""
    rope_type: Name | None = Field(None, description="default, linear, dynamic, yarn, longrope, llama3, gguf_rope_freqs")
    type: Name | None = Field(None, description="older name of rope_type")
    rope_theta: quantity("x", 1e12, low_open=True) | None = Field(None, description="RoPE base (rope_parameters)")
    factor: quantity("x", 1e6, low_open=True) | None = Field(None, description="context extension factor")
    original_max_position_embeddings: Dim | None = Field(None, description="context before scaling")
    low_freq_factor: quantity("x", 1e6, low_open=True) | None = Field(None, description="llama3")
    high_freq_factor: quantity("x", 1e6, low_open=True) | None = Field(None, description="llama3")
    beta_fast: Factor | None = Field(None, description="yarn")
    beta_slow: Factor | None = Field(None, description="yarn")
    mscale: Factor | None = Field(None, description="yarn (deepseek)")
    mscale_all_dim: Factor | None = Field(None, description="yarn (deepseek)")
    attention_factor: Factor | None = Field(None, description="yarn, longrope")
    truncate: bool | None = Field(None, description="yarn")
    partial_rotary_factor: quantity("fraction", 1.0, low_open=True) | None = Field(None, description="rotary share of a head")
    short_factor: list[Factor] | None = Field(None, description="longrope")
    long_factor: list[Factor] | None = Field(None, description="longrope")
    freq_factors: list[quantity("x", 1e6, low_open=True)] | None = Field(
        None, description="gguf_rope_freqs: each rotary frequency's divisor (a GGUF file's rope_freqs.weight)")


class HfConfig(BaseModel):
    """The keys hetplan reads, over every family it plans (absent or null: the family's default)."""
    model_config = ConfigDict(extra="allow", strict=True, frozen=True, allow_inf_nan=False)

    model_type: Name = Field(description="the family: llama, mistral, qwen2, qwen3, opt, gpt2, mixtral, "
                             "qwen3_moe, deepseek_v3 (deepseek_v2, deepseek_r1)")
    name_or_path: Name | None = Field(None, alias="_name_or_path", description="shown in plans")
    torch_dtype: Name | None = Field(None, description="checkpoint dtype: float32, bfloat16, float16")
    dtype: Name | None = Field(None, description="newer name of torch_dtype")
    hidden_size: Dim | None = Field(None, description="hidden width")
    num_hidden_layers: Dim | None = Field(None, description="decoder layers")
    intermediate_size: Dim | None = Field(None, description="dense MLP width (mixtral: one expert's)")
    num_attention_heads: Dim | None = Field(None, description="attention heads")
    num_key_value_heads: Dim | None = Field(None, description="key/value heads (default: attention heads)")
    head_dim: Dim | None = Field(None, description="width of one head (default: hidden / heads)")
    vocab_size: Dim | None = Field(None, description="vocabulary")
    max_position_embeddings: Dim | None = Field(None, description="longest context")
    tie_word_embeddings: bool | None = Field(None, description="head shares the embedding's weights")
    rms_norm_eps: Eps | None = Field(None, description="RMSNorm epsilon")
    hidden_act: Name | None = Field(None, description="MLP activation (silu, gelu, ...)")
    attention_bias: bool | None = Field(None, description="bias on q/k/v and the output")
    mlp_bias: bool | None = Field(None, description="bias in the MLP")
    rope_theta: quantity("x", 1e12, low_open=True) | None = Field(None, description="RoPE base")
    rope_scaling: RopeScaling | None = Field(None, description="RoPE scaling")
    rope_parameters: RopeScaling | None = Field(None, description="RoPE settings (transformers 5)")
    num_local_experts: Dim | None = Field(None, description="mixtral: experts per layer")
    num_experts: Dim | None = Field(None, description="qwen3_moe: experts per layer")
    num_experts_per_tok: Dim | None = Field(None, description="experts each token chooses")
    moe_intermediate_size: Dim | None = Field(None, description="width of one expert")
    mlp_only_layers: list[Count] | None = Field(None, description="qwen3_moe: dense layers (unsupported)")
    decoder_sparse_step: Dim | None = Field(None, description="qwen3_moe: MoE every N layers (1 only)")
    norm_topk_prob: bool | None = Field(None, description="renormalise the top-k routing weights")
    n_routed_experts: Dim | None = Field(None, description="deepseek: routed experts per layer")
    n_shared_experts: Count | None = Field(None, description="deepseek: always-chosen experts")
    first_k_dense_replace: Count | None = Field(None, description="deepseek: leading dense layers")
    q_lora_rank: Count | None = Field(None, description="deepseek MLA query rank (null: none)")
    kv_lora_rank: Dim | None = Field(None, description="deepseek MLA key/value rank")
    qk_nope_head_dim: Dim | None = Field(None, description="deepseek: non-rotary part of a head")
    qk_rope_head_dim: Dim | None = Field(None, description="deepseek: rotary part of a head")
    v_head_dim: Dim | None = Field(None, description="deepseek: value head width")
    n_group: Count | None = Field(None, description="deepseek: expert groups")
    topk_group: Count | None = Field(None, description="deepseek: groups a token may choose")
    routed_scaling_factor: Factor | None = Field(None, description="deepseek: routed-output scale")
    topk_method: Name | None = Field(None, description="deepseek: noaux_tc, greedy, group_limited_greedy")
    scoring_func: Name | None = Field(None, description="deepseek: softmax or sigmoid")
    rope_interleave: bool | None = Field(None, description="deepseek: interleaved rotary layout")
    ffn_dim: Dim | None = Field(None, description="opt: MLP width")
    word_embed_proj_dim: Dim | None = Field(None, description="opt: must equal hidden_size")
    do_layer_norm_before: bool | None = Field(None, description="opt: pre-norm (required)")
    activation_function: Name | None = Field(None, description="opt, gpt2: MLP activation")
    enable_bias: bool | None = Field(None, description="opt: biases")
    n_embd: Dim | None = Field(None, description="gpt2: hidden width")
    n_head: Dim | None = Field(None, description="gpt2: attention heads")
    n_layer: Dim | None = Field(None, description="gpt2: layers")
    n_inner: Dim | None = Field(None, description="gpt2: MLP width (default 4 x n_embd)")
    n_positions: Dim | None = Field(None, description="gpt2: longest context")
    layer_norm_epsilon: Eps | None = Field(None, description="gpt2: LayerNorm epsilon")

    @model_validator(mode="before")
    @classmethod
    def _no_near_miss(cls, data):
        typo = near_miss(data) if isinstance(data, dict) else None
        if typo:
            raise ValueError(typo_message(*typo))
        return data


NEAR_MISS = 0.88
"""How alike (difflib ratio) an unknown key and a key hetplan reads must be to call it a typo."""

HF_KEYS_NOT_READ = frozenset({"layer_norm_eps", "num_nextn_predict_layers", "qk_head_dim", "num_kv_heads",
                              "original_max_position_embeddings", "ffn_hidden_size"})
"""Real Hugging Face keys that look like a key hetplan reads but are another setting."""


def near_miss(cfg: dict) -> tuple[str, str] | None:
    """The first (key, the read key it is a near-miss of) among ``cfg``'s unknown keys, or None."""
    read = read_keys()
    for key in cfg:
        if isinstance(key, str) and key not in read and key not in HF_KEYS_NOT_READ:
            near = difflib.get_close_matches(key, read, n=1, cutoff=NEAR_MISS)
            if near:
                return key, near[0]
    return None


def typo_message(key: str, meant: str) -> str:
    return (f"unknown key {key!r}: did you mean {meant!r}? (hetplan reads {meant!r}; keys it does not "
            f"read are ignored)")


def read_keys() -> list[str]:
    """Every top-level key hetplan reads (by its name in the file)."""
    return sorted(f.alias or name for name, f in HfConfig.model_fields.items())


SECTIONS = (("", HfConfig), ("rope_scaling, rope_parameters", RopeScaling))
"""Where each model sits in a config.json, for the README's key table."""
