"""The native kernel's fused small ops (``smallops.h``: RMSNorm, rotary embeddings in place on a
fused q|k|v row, SiLU(gate) * up) against the torch expressions they replace, written out here:
bit-identical in bf16 and fp16 (the same roundings), within fp32 rounding in fp32 (a norm's sum of
squares is accumulated in a different order, and contracted multiply-adds round once)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hetplan.runtime.kernels import native

pytestmark = pytest.mark.skipif(native.module() is None, reason="the native kernel did not build here")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def close(a: torch.Tensor, b: torch.Tensor, dtype) -> None:
    if dtype == torch.float32:
        assert torch.allclose(a, b, rtol=2e-6, atol=2e-6 * b.abs().max().item())
    elif dtype == torch.float16:   # the norm's fp32 sum may differ in its last bit: 1 ulp of fp16 at most
        assert ((a.float() - b.float()).abs() <= b.float().abs() * 2**-10 + 2**-24).all()
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 5, 96), (2, 7, 1000), (1, 130, 64)])
def test_rms_norm_is_torchs(dtype, shape):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(shape, generator=g).to(dtype), torch.randn(shape[-1], generator=g).to(dtype)
    xf = x.float()
    ref = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    close(native.module().rms_norm(x, w, 1e-6), ref, dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,seq,start,hq,hk,hd", [(1, 1, 37, 32, 8, 64), (2, 5, 0, 4, 2, 128), (3, 2, 9, 6, 6, 16)])
def test_rope_in_place_rotates_q_and_k_only(dtype, batch, seq, start, hq, hk, hd):
    g = torch.Generator().manual_seed(2)
    table = 64
    cos, sin = torch.randn(table, hd, generator=g).to(dtype), torch.randn(table, hd, generator=g).to(dtype)
    y = torch.randn(batch * seq, (hq + 2 * hk) * hd, generator=g).to(dtype)
    before = y.clone()
    native.module().rope_(y, cos, sin, seq, start, hq + hk, hd)
    c, s = cos[start:start + seq].view(1, seq, 1, hd), sin[start:start + seq].view(1, seq, 1, hd)
    q = before[:, :hq * hd].reshape(batch, seq, hq, hd)
    k = before[:, hq * hd:(hq + hk) * hd].reshape(batch, seq, hk, hd)
    close(y[:, :hq * hd], rotate(q, c, s).reshape(batch * seq, -1), dtype)
    close(y[:, hq * hd:(hq + hk) * hd], rotate(k, c, s).reshape(batch * seq, -1), dtype)
    assert torch.equal(y[:, (hq + hk) * hd:], before[:, (hq + hk) * hd:])   # v untouched


def test_rope_refuses_positions_past_the_table():
    y, t = torch.zeros(2, 3 * 8), torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="covering the positions"):
        native.module().rope_(y, t, t, 2, 3, 2, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 2 * 5632), (2, 3, 2 * 100)])
def test_silu_mul_is_torchs(dtype, shape):
    gu = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    close(native.module().silu_mul(gu), F.silu(gate).mul_(up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,heads,kv_heads,hd,length", [(1, 32, 8, 64, 1), (2, 8, 2, 64, 37), (3, 6, 6, 16, 300),
                                                             (1, 4, 1, 128, 2000), (2, 4, 2, 20, 9)])
def test_decode_attention_over_cache_views(dtype, batch, heads, kv_heads, hd, length):
    """Against softmax(q k^T / sqrt(hd)) v in fp64 on the same (rounded) inputs, the caches read
    as views of longer buffers; the output rounds once to the dtype."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(batch, 1, heads, hd, generator=g).to(dtype)
    kc, vc = (torch.randn(batch, length + 9, kv_heads, hd, generator=g).to(dtype) for _ in range(2))
    k, v = kc[:, :length], vc[:, :length]
    out = native.module().decode_attention(q, k, v, hd ** -0.5)
    rep = heads // kv_heads
    kk = k.double().repeat_interleave(rep, dim=2).permute(0, 2, 3, 1)      # [B, H, hd, T]
    vv = v.double().repeat_interleave(rep, dim=2).transpose(1, 2)          # [B, H, T, hd]
    p = torch.softmax(q.double().transpose(1, 2) @ kk * hd ** -0.5, dim=-1)  # [B, H, 1, T]
    ref = (p @ vv).transpose(1, 2).reshape(batch, 1, heads * hd)
    ulp = {torch.float32: 2**-22, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    assert out.shape == ref.shape and out.dtype == dtype
    assert ((out.double() - ref).abs() <= ref.abs() * ulp + ulp * 1e-2 + 1e-6).all()
