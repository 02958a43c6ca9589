"""DeepSeek multi-head latent attention (MLA) over the compressed latent cache.

Per token MLA caches only ``kv_lora_rank`` elements of normalised latent ``c`` and
``qk_rope_head_dim`` elements of the shared, rotated rope key ``k_r`` (``ModelSpec.
kv_elems_per_token``), instead of full K and V for every head. With H heads,
``W_kvb = kv_b_proj`` viewed as [H, nope + v, r] = [W_UK; W_UV]:

    q = q_b(norm(q_a x))              (or q_proj x)        -> per head [q_nope, q_rope]
    [c, k_r] = kv_a x;  c = norm(c);  q_rope, k_r = rope(q_rope), rope(k_r)
    score[h, s, l] = scale * (q_nope[h, s] . (W_UK[h] c_l) + q_rope[h, s] . k_r[l])
    out[h, s] = sum_l softmax(score)[h, s, l] * (W_UV[h] c_l);    y = o_proj(concat_h out)

Two ways to compute it, equal up to rounding:

- *decompressed* (``decompressed_attention``): expand every cached c into per-head K and V
  (what transformers' DeepseekV3Attention does);
- *absorbed* (``absorb_query`` -> ``latent_attention`` -> ``expand_output``): fold W_UK into the
  query, q_lat[h] = W_UK[h]^T q_nope[h], attend in latent space (keys [c, k_r], values c) and
  apply W_UV to the attention output. The attention itself then needs no weights, so a
  latent cache in CPU memory can be attended on the CPU with only q_lat, q_rope and the
  latent output crossing PCIe.

Decode should use the absorbed path (it reads the cache once instead of expanding it per head:
an order of magnitude faster for a DeepSeek-V3 layer at 4096 cached tokens on a CPU,
bench/mla_cpu.py);
a long prefill the decompressed one (its per-head dims suit fused attention kernels, while the
latent-space scores are H * S x L).

``scale`` = (nope + rope)^-1/2, times mscale(factor, mscale_all_dim)^2 under yarn rope scaling.
Rope (default or yarn, interleaved pairs or halves) is in ``Rope``, shared with the standard
attention of the reference driver. Tensor layout: [B, H, S, d] per head, [B, S, d] latent.

This module knows MLA's arithmetic; it knows nothing about plans, devices or checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetplan.runtime.kernels.linear import PackedLinear, linear
from hetplan.errors import HetplanError
from hetplan.model import ModelSpec

LATENT_NORM_EPS = 1e-6
"""eps of the q_a and kv_a RMSNorms (DeepSeek builds them with the norm's default, not
``rms_norm_eps``)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), the mean in fp32."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# -- rope ----------------------------------------------------------------------------------------
def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(scale) + 1 for scale > 1, else 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


@dataclass(frozen=True)
class Rope:
    inv_freq: torch.Tensor
    """[dim / 2] fp32 angle per position per rotated pair."""
    attention_factor: float
    """Multiplies cos and sin (yarn's magnitude correction; 1 otherwise)."""
    interleaved: bool
    """Pairs are (x0, x1), (x2, x3), ... (deepseek) instead of (x_i, x_{i + dim/2})."""

    @classmethod
    def build(cls, dim: int, theta: float, scaling: dict | None, max_positions: int,
              interleaved: bool) -> "Rope":
        """Default rope: inv_freq_i = theta^(-2i / dim). Yarn: per pair, blend the interpolated
        (inv_freq / factor) and the original frequency with a linear ramp between the
        dimensions that rotate beta_fast and beta_slow times within the original context."""
        pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        kind = _rope_type(scaling)
        if kind == "default":
            return cls(1.0 / pos, 1.0, interleaved)
        if kind != "yarn":
            raise HetplanError(f"rope_scaling: type {kind!r} is not supported here; supported: "
                               f"default, yarn")
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or max_positions / original
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
            attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                                if mscale and mscale_all else _yarn_mscale(factor))
        beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def correction_dim(rotations):
            return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        inv_freq = (1.0 / (factor * pos)) * (1 - extrapolation) + (1.0 / pos) * extrapolation
        return cls(inv_freq, float(attention_factor), interleaved)

    def to(self, device) -> "Rope":
        """The same rope with its frequencies on ``device`` (no copy per call there)."""
        return dataclasses.replace(self, inv_freq=self.inv_freq.to(device))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [S] -> cos, sin: [S, dim / 2] in ``dtype`` (angles in fp32)."""
        angles = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        return ((angles.cos() * self.attention_factor).to(dtype),
                (angles.sin() * self.attention_factor).to(dtype))

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x: [..., S, dim] by cos, sin: [S, dim / 2]. Output pairs are laid out as
        halves [x1 cos - x2 sin, x2 cos + x1 sin] in both conventions."""
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mla_rope(spec: ModelSpec) -> Rope:
    return Rope.build(spec.qk_rope_head_dim, spec.rope_theta, spec.rope_scaling, spec.max_positions,
                      interleaved=bool(spec.extra.get("rope_interleave", True)))


def softmax_scale(spec: ModelSpec) -> float:
    """(qk_nope + qk_rope)^-1/2, times mscale(factor, mscale_all_dim)^2 under yarn scaling."""
    scale = (spec.qk_nope_head_dim + spec.qk_rope_head_dim) ** -0.5
    scaling = spec.rope_scaling
    if _rope_type(scaling) != "default" and scaling.get("mscale_all_dim"):
        scale *= _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


# -- weights, cache, attention -------------------------------------------------------------------
@dataclass(frozen=True)
class MlaWeights:
    kv_a: torch.Tensor
    """[r + rope, D] ``kv_a_proj_with_mqa``"""
    kv_a_norm: torch.Tensor
    """[r]"""
    kv_b: torch.Tensor
    """[H * (nope + v), r] ``kv_b_proj`` = per head [W_UK; W_UV]"""
    o: torch.Tensor
    """[D, H * v]"""
    q: torch.Tensor | None = None
    """[H * (nope + rope), D] when q_lora_rank == 0"""
    q_a: torch.Tensor | None = None
    """[q_rank, D]"""
    q_a_norm: torch.Tensor | None = None
    q_b: torch.Tensor | None = None
    """[H * (nope + rope), q_rank]"""


class LatentCache:
    """One layer's MLA cache: [B, max_len, kv_lora_rank] latent and [B, max_len, qk_rope_head_dim]
    rotated rope key, preallocated; ``length`` tokens are filled (the same for every sequence)."""

    def __init__(self, batch: int, max_len: int, spec: ModelSpec, dtype: torch.dtype, device="cpu"):
        self.latent = torch.zeros(batch, max_len, spec.kv_lora_rank, dtype=dtype, device=device)
        self.k_rope = torch.zeros(batch, max_len, spec.qk_rope_head_dim, dtype=dtype, device=device)
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.latent.nbytes + self.k_rope.nbytes

    def append(self, latent: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write S new tokens ([B, S, r], [B, S, rope]); return views of everything cached."""
        s = latent.shape[1]
        if self.length + s > self.latent.shape[1]:
            raise ValueError(f"latent cache holds {self.latent.shape[1]} tokens; "
                             f"{self.length} + {s} requested")
        self.latent[:, self.length:self.length + s].copy_(latent)
        self.k_rope[:, self.length:self.length + s].copy_(k_rope)
        self.length += s
        return self.latent[:, :self.length], self.k_rope[:, :self.length]


@dataclass(frozen=True)
class MlaProjection:
    """What the attention input stage produces for S new tokens."""
    q_nope: torch.Tensor
    """[B, H, S, nope]"""
    q_rope: torch.Tensor
    """[B, H, S, rope], rotated"""
    latent: torch.Tensor
    """[B, S, r], normalised: what the cache stores"""
    k_rope: torch.Tensor
    """[B, S, rope], rotated: what the cache stores"""


def mla_project(x: torch.Tensor, w: MlaWeights, spec: ModelSpec, rope: Rope,
                positions: torch.Tensor) -> MlaProjection:
    """Query, latent and rope key of x: [B, S, D] (already normed) at ``positions`` [S]."""
    b, s, _ = x.shape
    h, nope, rd, r = spec.n_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
    if w.q_a is not None:
        q = linear(rms_norm(linear(x, w.q_a), w.q_a_norm, LATENT_NORM_EPS), w.q_b)
    else:
        q = linear(x, w.q)
    q = q.view(b, s, h, nope + rd).transpose(1, 2)  # [B, H, S, nope + rope]
    q_nope, q_rope = q.split([nope, rd], dim=-1)
    latent, k_rope = linear(x, w.kv_a).split([r, rd], dim=-1)  # [B, S, r], [B, S, rope]
    cos, sin = rope.cos_sin(positions, x.dtype)
    return MlaProjection(q_nope, rope.apply(q_rope, cos, sin),
                         rms_norm(latent, w.kv_a_norm, LATENT_NORM_EPS), rope.apply(k_rope, cos, sin))


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, offset: int) -> torch.Tensor:
    """Causal attention of S queries at positions offset..offset+S-1 over L = offset + S keys.
    q: [B, H, S, d]; k: [B, Hk, L, d]; v: [B, Hk, L, dv], Hk dividing H -> [B, H, S, dv].

    The G = H / Hk query heads sharing a key head are folded into its query rows
    ([B, Hk, G * S, d]), so shared keys and values (one latent head in MLA) are never copied."""
    b, n_h, s, _ = q.shape
    n_kv, n_k = k.shape[1], k.shape[2]
    g = n_h // n_kv
    q = q.reshape(b, n_kv, g * s, q.shape[-1])  # heads of one group are adjacent
    if s == 1:
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    elif g == 1 and offset == 0 and s == n_k:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        allowed = (torch.arange(n_k, device=q.device)[None, :]
                   <= offset + torch.arange(s, device=q.device)[:, None])  # [S, L]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.repeat(g, 1), scale=scale)
    return out.view(b, n_h, s, v.shape[-1])


def decompressed_attention(p: MlaProjection, latent: torch.Tensor, k_rope: torch.Tensor,
                           w: MlaWeights, spec: ModelSpec, offset: int) -> torch.Tensor:
    """Attention with every cached latent expanded to per-head K and V.
    latent: [B, L, r], k_rope: [B, L, rope] (the cache) -> [B, S, H * v]."""
    b, n_l, _ = latent.shape
    h, nope, v_dim = spec.n_heads, spec.qk_nope_head_dim, spec.v_head_dim
    kv = linear(latent, w.kv_b).view(b, n_l, h, nope + v_dim).transpose(1, 2)  # [B, H, L, nope+v]
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_rope[:, None].expand(b, h, n_l, spec.qk_rope_head_dim)], dim=-1)
    q = torch.cat([p.q_nope, p.q_rope], dim=-1)
    out = sdpa(q, k, v, softmax_scale(spec), offset)  # [B, H, S, v]
    return out.transpose(1, 2).reshape(b, -1, h * v_dim)


def _kv_b_heads(w: MlaWeights, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK [H, nope, r] and W_UV [H, v, r], views of kv_b."""
    kv_b = (w.kv_b.dense() if isinstance(w.kv_b, PackedLinear) else w.kv_b).view(spec.n_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank)
    return kv_b[:, :spec.qk_nope_head_dim], kv_b[:, spec.qk_nope_head_dim:]


def absorb_query(q_nope: torch.Tensor, w: MlaWeights, spec: ModelSpec) -> torch.Tensor:
    """q_lat[b, h, s] = W_UK[h]^T q_nope[b, h, s]: [B, H, S, nope] -> [B, H, S, r]."""
    w_uk, _ = _kv_b_heads(w, spec)
    return torch.einsum("bhsn,hnr->bhsr", q_nope, w_uk)


def latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                     k_rope: torch.Tensor, spec: ModelSpec, offset: int) -> torch.Tensor:
    """Weight-free attention in latent space: keys [c, k_r], values c, one shared KV head.
    q_latent: [B, H, S, r], q_rope: [B, H, S, rope], cache [B, L, r], [B, L, rope] -> [B, H, S, r]."""
    q = torch.cat([q_latent, q_rope], dim=-1)
    k = torch.cat([latent, k_rope], dim=-1)[:, None]  # [B, 1, L, r + rope]
    return sdpa(q, k, latent[:, None], softmax_scale(spec), offset)


def expand_output(o_latent: torch.Tensor, w: MlaWeights, spec: ModelSpec) -> torch.Tensor:
    """out[b, s, h] = W_UV[h] o_lat[b, h, s]: [B, H, S, r] -> [B, S, H * v]."""
    _, w_uv = _kv_b_heads(w, spec)
    out = torch.einsum("bhsr,hvr->bshv", o_latent, w_uv)
    return out.reshape(out.shape[0], out.shape[1], -1)


def mla_forward(x: torch.Tensor, w: MlaWeights, spec: ModelSpec, rope: Rope, cache: LatentCache,
                absorbed: bool) -> torch.Tensor:
    """One MLA layer (no norm, no residual) for S new tokens after ``cache.length`` cached ones;
    appends them to the cache. x: [B, S, D] -> [B, S, D]."""
    offset = cache.length
    positions = torch.arange(offset, offset + x.shape[1], device=x.device)
    p = mla_project(x, w, spec, rope, positions)
    latent, k_rope = cache.append(p.latent, p.k_rope)
    if absorbed:
        o_latent = latent_attention(absorb_query(p.q_nope, w, spec), p.q_rope, latent, k_rope,
                                    spec, offset)
        out = expand_output(o_latent, w, spec)
    else:
        out = decompressed_attention(p, latent, k_rope, w, spec, offset)
    return linear(out, w.o)
