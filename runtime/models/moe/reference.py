"""A plain-torch forward pass of the MoE families (mixtral, qwen3_moe, deepseek), built from the
runtime's MoE and MLA pieces, with a KV or latent cache for greedy decoding.

It shows how the pieces compose into a model, which is what a plan executor's MoE and MLA
stages must compute, and the tests check it against transformers. Each layer is RMSNorm ->
attention (GQA with rope and qwen3's per-head q/k norm, or MLA) -> residual -> RMSNorm -> MLP
(dense, or MoE with the experts split into ``expert_subsets`` as a plan splits them between
devices) -> residual; then the final norm and the LM head. Everything runs on one device, one
stage after the other.

This module knows the model's arithmetic; it knows nothing about plans, schedules, streams
or where tensors live.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F

from hetplan.errors import HetplanError
from hetplan.model import ModelSpec
from hetplan.runtime.models.mla import LatentCache, Rope, mla_forward, mla_rope, rms_norm, sdpa
from hetplan.runtime.models.moe.layer import Expert, RoutingRecorder, moe_forward, swiglu
from hetplan.runtime.models.moe.weights import mla_weights_from_tensors, moe_layer_from_tensors


class KvCache:
    """One layer's K and V: [B, Hkv, max_len, head_dim] each, ``length`` positions filled."""

    def __init__(self, batch: int, max_len: int, spec: ModelSpec, dtype: torch.dtype, device):
        shape = (batch, spec.n_kv_heads, max_len, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = k.shape[2]
        self.k[:, :, self.length:self.length + s].copy_(k)
        self.v[:, :, self.length:self.length + s].copy_(v)
        self.length += s
        return self.k[:, :, :self.length], self.v[:, :, :self.length]


class ReferenceModel:
    """Forward passes of an MoE-family model from in-block tensors (``group_by_block``)."""

    def __init__(self, spec: ModelSpec, blocks: Mapping, expert_subsets: Iterable[Iterable[int]],
                 absorbed: bool = True, recorder: RoutingRecorder | None = None):
        """``expert_subsets`` partition each MoE layer's experts (e.g. GPU-side, CPU-side);
        ``absorbed`` selects MLA's weight-absorbed attention over the decompressed one."""
        if not spec.is_moe:
            raise HetplanError(f"{spec.name}: the MoE reference runs mixture-of-experts models only")
        self.spec, self.blocks, self.absorbed, self.recorder = spec, blocks, absorbed, recorder
        self.subsets = [frozenset(s) for s in expert_subsets]
        self.mla = ({l: mla_weights_from_tensors(blocks[f"attn_{l}"]) for l in range(spec.n_layers)}
                    if spec.is_mla else {})
        self.moe = {l: moe_layer_from_tensors(blocks[f"moe_{l}"], spec)
                    for l in range(spec.n_layers) if spec.is_moe_layer(l)}
        self.dense = {l: Expert.from_parts(blocks[f"mlp_{l}"]["gate"], blocks[f"mlp_{l}"]["up"],
                                           blocks[f"mlp_{l}"]["down"])
                      for l in range(spec.n_layers) if not spec.is_moe_layer(l)}
        rope = mla_rope(spec) if spec.is_mla else Rope.build(
            spec.head_dim, spec.rope_theta, spec.rope_scaling, spec.max_positions, interleaved=False)
        self.rope = rope.to(blocks["embed"]["tok"].device)
        self.caches: list = []

    def start(self, batch: int, max_len: int) -> None:
        """Allocate empty caches for ``batch`` sequences of up to ``max_len`` tokens."""
        t = self.blocks["embed"]["tok"]
        cache = LatentCache if self.spec.is_mla else KvCache
        self.caches = [cache(batch, max_len, self.spec, t.dtype, t.device) for _ in range(self.spec.n_layers)]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, S, V] of tokens ids [B, S] following the cached ones (appends them)."""
        spec = self.spec
        x = F.embedding(ids, self.blocks["embed"]["tok"])  # [B, S, D]
        for l in range(spec.n_layers):
            attn = self.blocks[f"attn_{l}"]
            h = rms_norm(x, attn["norm"], spec.norm_eps)
            if spec.is_mla:
                x = x + mla_forward(h, self.mla[l], spec, self.rope, self.caches[l], self.absorbed)
            else:
                x = x + self._attention(h, attn, self.caches[l])
            mlp_block = self.blocks[f"moe_{l}" if spec.is_moe_layer(l) else f"mlp_{l}"]
            h = rms_norm(x, mlp_block["norm"], spec.norm_eps)
            if spec.is_moe_layer(l):
                y = moe_forward(h.reshape(-1, spec.hidden), self.moe[l], spec, self.subsets,
                                self.recorder, l).view_as(h)
            else:
                y = swiglu(h, self.dense[l], spec.act)
            x = x + y
        head = self.blocks["head"]
        lm_head = head.get("lm", self.blocks["embed"]["tok"])
        return F.linear(rms_norm(x, head["norm"], spec.norm_eps), lm_head)

    def _attention(self, x: torch.Tensor, w: Mapping, cache: KvCache) -> torch.Tensor:
        """GQA with rope (and qwen3's per-head q/k RMSNorm). x: [B, S, D] -> [B, S, D]."""
        spec = self.spec
        b, s, _ = x.shape
        q = F.linear(x, w["q"], w.get("q_bias")).view(b, s, spec.n_heads, spec.head_dim)
        k = F.linear(x, w["k"], w.get("k_bias")).view(b, s, spec.n_kv_heads, spec.head_dim)
        v = F.linear(x, w["v"], w.get("v_bias")).view(b, s, spec.n_kv_heads, spec.head_dim)
        if spec.qk_norm:
            q, k = rms_norm(q, w["q_norm"], spec.norm_eps), rms_norm(k, w["k_norm"], spec.norm_eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, hd]
        offset = cache.length
        cos, sin = self.rope.cos_sin(torch.arange(offset, offset + s, device=x.device), x.dtype)
        k_all, v_all = cache.append(self.rope.apply(k, cos, sin), v)
        out = sdpa(self.rope.apply(q, cos, sin), k_all, v_all, spec.head_dim ** -0.5, offset)
        return F.linear(out.transpose(1, 2).reshape(b, s, -1), w["o"], w.get("o_bias"))

    def greedy(self, prompt: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """Prefill ``prompt`` [B, P], then decode ``n_tokens`` greedily -> [B, n_tokens]."""
        self.start(prompt.shape[0], prompt.shape[1] + n_tokens)
        token = self.forward(prompt)[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        out = [token]
        for _ in range(n_tokens - 1):
            token = self.forward(token)[:, -1].argmax(-1, keepdim=True)
            out.append(token)
        return torch.cat(out, dim=1)
