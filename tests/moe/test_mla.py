"""Multi-head latent attention: the runtime's MLA equals transformers' DeepseekV3Attention, its
cache holds only the compressed latent, and the weight-absorbed path equals the decompressed one.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention,  # noqa: E402
                                                                  DeepseekV3RotaryEmbedding)

from hetplan.errors import HetplanError  # noqa: E402
from hetplan.frontends.hf_config import spec_from_config  # noqa: E402
from hetplan.runtime.models.mla import LatentCache, Rope, mla_forward, mla_rope, softmax_scale  # noqa: E402
from hetplan.runtime.models.moe.weights import group_by_block, mla_weights_from_tensors  # noqa: E402

_BASE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=128, n_routed_experts=8,
             num_experts_per_tok=2, n_group=4, topk_group=2, kv_lora_rank=32, q_lora_rank=48,
             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256)
VARIANTS = {
    "compressed_q_interleaved_rope": {},
    "plain_q_rope_halves_yarn": dict(q_lora_rank=None, rope_interleave=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}),
}


def _attention(variant: str):
    """(transformers attention module, its rotary embedding, ModelSpec, MlaWeights), fp32."""
    config = transformers.DeepseekV3Config(**dict(_BASE, **VARIANTS[variant]))
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    module = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "norm" in name else 0.2 * torch.randn(p.shape))
    spec = spec_from_config(config.to_dict(), name=variant, weight_dtype="fp32",
                            kv_dtype="fp32")
    tensors = {f"model.layers.0.self_attn.{n}": p.detach() for n, p in module.named_parameters()}
    weights = mla_weights_from_tensors(group_by_block(tensors, spec)["attn_0"])
    return module, DeepseekV3RotaryEmbedding(config), spec, weights


def _transformers_attention(module, rotary, x, cache=None, start=0):
    s = x.shape[1]
    positions = torch.arange(start, start + s)[None]
    mask = torch.full((s, start + s), float("-inf")).triu(start + 1)[None, None]
    with torch.no_grad():
        return module(x, rotary(x, positions), mask, cache=cache)[0]


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mla_prefill_matches_transformers_attention(variant, absorbed):
    module, rotary, spec, weights = _attention(variant)
    x = torch.randn(2, 11, spec.hidden, generator=torch.Generator().manual_seed(1))
    want = _transformers_attention(module, rotary, x)
    got = mla_forward(x, weights, spec, mla_rope(spec), LatentCache(2, 11, spec, torch.float32), absorbed)
    assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_latent_cache_holds_what_transformers_caches_and_nothing_more(variant):
    module, rotary, spec, weights = _attention(variant)
    x = torch.randn(1, 7, spec.hidden, generator=torch.Generator().manual_seed(2))
    hf_cache = DynamicCache(config=module.config)
    _transformers_attention(module, rotary, x, cache=hf_cache)
    cache = LatentCache(1, 7, spec, torch.float32)
    mla_forward(x, weights, spec, mla_rope(spec), cache, absorbed=True)
    layer = hf_cache.layers[0]  # the compressed latent and the rotated rope key, one "head" each
    torch.testing.assert_close(cache.latent, layer.keys[:, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(cache.k_rope, layer.values[:, 0], rtol=1e-5, atol=1e-6)  # fp32 rope: rounding of its products
    per_token = spec.kv_lora_rank + spec.qk_rope_head_dim
    assert cache.nbytes == 7 * per_token * 4 == 7 * spec.kv_bytes_per_token()
    full_kv = 2 * spec.n_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
    assert per_token < full_kv


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_absorbed_decode_equals_decompressed_decode_and_transformers(variant):
    module, rotary, spec, weights = _attention(variant)
    rope = mla_rope(spec)
    g = torch.Generator().manual_seed(3)
    prompt, steps = torch.randn(2, 9, spec.hidden, generator=g), torch.randn(2, 6, spec.hidden, generator=g)
    caches = {mode: LatentCache(2, 15, spec, torch.float32) for mode in (False, True)}
    hf_cache = DynamicCache(config=module.config)
    _transformers_attention(module, rotary, prompt, cache=hf_cache)
    for mode, cache in caches.items():
        mla_forward(prompt, weights, spec, rope, cache, absorbed=mode)
    for i in range(steps.shape[1]):
        x = steps[:, i:i + 1]
        want = _transformers_attention(module, rotary, x, cache=hf_cache, start=9 + i)
        naive = mla_forward(x, weights, spec, rope, caches[False], absorbed=False)
        absorbed = mla_forward(x, weights, spec, rope, caches[True], absorbed=True)
        assert (absorbed - naive).abs().max().item() <= 1e-5
        assert (naive - want).abs().max().item() <= 1e-5
    assert caches[True].length == 15


@pytest.mark.parametrize("yarn", [
    {"factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0,
     "beta_fast": 32, "beta_slow": 1},
])
def test_yarn_frequencies_and_softmax_scale_match_transformers(yarn):
    params = dict(yarn, rope_type="yarn", rope_theta=10000.0)
    config = transformers.DeepseekV3Config(**dict(_BASE, max_position_embeddings=163840,
                                                  rope_parameters=params))
    spec = spec_from_config(config.to_dict())
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    rope = mla_rope(spec)
    torch.testing.assert_close(rope.inv_freq, want_inv_freq, rtol=1e-6, atol=0)
    assert rope.attention_factor == pytest.approx(want_factor, rel=1e-12)
    assert softmax_scale(spec) == pytest.approx(DeepseekV3Attention(config, 0).scaling, rel=1e-12)


def test_rope_scaling_other_than_default_and_yarn_is_refused():
    with pytest.raises(HetplanError, match="type 'llama3' is not supported"):
        Rope.build(8, 10000.0, {"rope_type": "llama3", "factor": 8.0}, 4096, interleaved=True)


def test_latent_cache_refuses_tokens_beyond_its_length():
    spec = spec_from_config(transformers.DeepseekV3Config(**_BASE).to_dict())
    cache = LatentCache(1, 4, spec, torch.float32)
    cache.append(torch.zeros(1, 3, spec.kv_lora_rank), torch.zeros(1, 3, spec.qk_rope_head_dim))
    with pytest.raises(ValueError, match="holds 4 tokens"):
        cache.append(torch.zeros(1, 2, spec.kv_lora_rank), torch.zeros(1, 2, spec.qk_rope_head_dim))
