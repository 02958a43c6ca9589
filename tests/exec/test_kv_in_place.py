"""Decode attention reads the KV cache where it lies: no step allocates a tensor of the prefix's size.

A plain cache in the compute dtype is attended over as a view; a quantised cache, or one in
another dtype, is read ``kv_cache.READ_BLOCK_TOKENS`` positions at a time (converted or
dequantised per block) with the blocks' softmax merged online; DeepSeek's latent attention
scores the latent and its rope part separately instead of concatenating them. Every op a decode
step runs is watched (a dispatch mode over the storages op outputs own); the largest is compared
with one cache value's prefix in the compute dtype. The results equal attention over the whole
prefix dequantised up front (the reference may allocate).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hetplan.runtime import kv_cache
from hetplan.runtime.devices import Devices
from hetplan.runtime.models.dense import attention, cached_attention
from hetplan.runtime.models.moe.backend import cached_latent_attention
from hetplan.runtime.models.mla import latent_attention
from tests.conftest import tiny_spec

B, T, END, H, KVH, HD = 2, 4096, 1500, 8, 2, 32
"""Batch, cache positions, positions used (the prefix), query heads, KV heads, head dim."""


class LargestAllocation(TorchDispatchMode):
    """The largest storage an op's outputs own that none of its inputs owns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def cache(kv: str, shape: tuple, seed: int, end: int = END):
    value = kv_cache.allocate(Devices("cpu"), "cpu", shape, kv_cache.storage(kv), "test cache", pinned=False)
    x = torch.randn(shape[0], end, *shape[2:], generator=torch.Generator().manual_seed(seed))
    kv_cache.write(value, 0, x)
    return value


def whole(value, end: int = END) -> torch.Tensor:
    """The reference's copy of the prefix, fp32."""
    return torch.cat([blk for _, blk in kv_cache.read_blocks(value, end, torch.float32)], dim=1)


def decode_step(kv: str, end: int):
    """(largest allocation, output, reference) of one decode query per sequence after ``end - 1``
    cached positions."""
    shape = (B, T, KVH, HD)
    k, v = cache(kv, shape, 1, end), cache(kv, shape, 2, end)
    q = torch.randn(B, 1, H, HD, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), LargestAllocation() as watch:
        if kv_cache.in_place(k, torch.float32):
            got = attention(q, kv_cache.read(k, end, torch.float32), kv_cache.read(v, end, torch.float32),
                            end - 1, scale=None)
        else:
            got = cached_attention(q, {"k": k, "v": v}, end, end - 1, HD ** -0.5)
    kk, vv = whole(k, end).transpose(1, 2), whole(v, end).transpose(1, 2)  # [B, KVH, end, HD]
    want = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, enable_gqa=True)
    return watch.largest, got, want.transpose(1, 2).reshape(B, 1, H * HD)


@pytest.mark.parametrize("kv", ["fp32", "fp16", "bf16", "q8_0", "q4_0", "int8", "q4_k_m"])
def test_decode_attention_allocates_no_tensor_of_the_prefixs_size(kv):
    """The largest allocation is below one value's prefix in fp32 and does not grow when the
    prefix doubles."""
    largest, got, want = decode_step(kv, END)
    assert largest < B * END * KVH * HD * 4, f"{largest} B allocated at once"
    assert decode_step(kv, 2 * END)[0] == largest
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_chunked_queries_attend_causally_over_the_blocks():
    """Four queries at positions END-4 .. END-1 over a q8_0 cache: each sees only the keys up to its
    own position, across block boundaries."""
    shape = (B, T, KVH, HD)
    k, v = cache("q8_0", shape, 4), cache("q8_0", shape, 5)
    q = torch.randn(B, 4, H, HD, generator=torch.Generator().manual_seed(6))
    got = cached_attention(q, {"k": k, "v": v}, END, END - 4, HD ** -0.5)
    kk, vv = whole(k).transpose(1, 2), whole(v).transpose(1, 2)
    allowed = torch.arange(END)[None, :] <= (END - 4 + torch.arange(4))[:, None]
    want = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=allowed, enable_gqa=True)
    assert torch.allclose(got, want.transpose(1, 2).reshape(B, 4, H * HD), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", ["fp32", "q8_0"])
def test_latent_attention_reads_the_latent_cache_in_place(kv):
    spec = tiny_spec(arch="deepseek_v3", n_heads=4, n_kv_heads=4, kv_lora_rank=64, qk_rope_head_dim=16,
                     qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=0, n_experts=4, experts_per_token=2,
                     moe_intermediate=32, weight_dtype="fp32", kv_dtype=kv)
    r, rope = spec.kv_lora_rank, spec.qk_rope_head_dim
    latent, k_rope = cache(kv, (B, T, r), 7), cache(kv, (B, T, rope), 8)
    g = torch.Generator().manual_seed(9)
    q_lat, q_rope = torch.randn(B, spec.n_heads, 1, r, generator=g), torch.randn(B, spec.n_heads, 1, rope, generator=g)
    with torch.inference_mode(), LargestAllocation() as watch:
        got = cached_latent_attention(q_lat, q_rope, {"latent": latent, "k_rope": k_rope}, END, END - 1, spec)
    assert watch.largest * 4 <= B * END * r * 4
    want = latent_attention(q_lat, q_rope, whole(latent), whole(k_rope), spec, END - 1)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", ["fp16", "q8_0", "q4_0", "int8", "q4_k_m"])
def test_the_plans_kv_read_bytes_cover_what_a_decode_read_holds(kv):
    """Peak bytes live while one decode attention reads a cache block by block (op outputs,
    counted until freed) are at most what the planner's workspace adds for it."""
    from hetplan.graph import kv_read_bytes
    from hetplan.workload import Workload
    from tests.exec.stage_memory import LiveBytes

    spec = tiny_spec(n_heads=H, n_kv_heads=KVH, head_dim=HD, hidden=H * HD, weight_dtype="fp32", kv_dtype=kv)
    shape = (B, T, KVH, HD)
    k, v = cache(kv, shape, 1), cache(kv, shape, 2)
    q = torch.randn(B, 1, H, HD, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode(), LiveBytes() as live:
        cached_attention(q, {"k": k, "v": v}, END, END - 1, HD ** -0.5)
    planned = kv_read_bytes(spec, Workload(B, END - 1, 1))
    assert 0 < live.peak <= planned, f"held {live.peak} B, planned {planned} B"
