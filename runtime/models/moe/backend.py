"""The mixture-of-experts families (mixtral, qwen3_moe, deepseek_v3) as plan stages.

Extends the dense backend with two capabilities, each a function of one block's weights:

- the ``moe`` stage: RMSNorm, routing (``runtime/models/moe/layer.py``'s per-family rules), every routed
  expert the tokens chose, the shared experts, residual. The block is placed as a whole, so all
  its experts sit on the stage's device (resident, or in the staging slot a ``load`` filled).
- a GPU-resident block split into ``moe_route``, ``moe_experts``, ``moe_cold`` and ``moe_merge``
  (``runtime/models/moe/split.py``): the same computation with its cold experts on the CPU; or, in a
  phase that streams its cold experts, ``moe_route`` and ``moe_experts`` alone, their weights
  holding every expert (so no pair goes to the CPU).
- DeepSeek's multi-head latent attention (``runtime/models/mla.py``) split into the plan's three
  attention stages, weight-absorbed throughout so that the core reads no weights and can run
  beside a latent cache in DRAM with only small tensors crossing::

      attn_in   x -> q_lat = W_UK^T q_nope [B, H, S, r], q_rope [B, H, S, rope],
                     latent [B, S, r], k_rope [B, S, rope]      (what the cache stores)
      attn_core -> o_lat [B, H, S, r]: attention in latent space over the cache
      attn_out  o_lat, x -> x + o_proj(W_UV o_lat)

  The cache is ``{latent: [B, T, r], k_rope: [B, T, rope]}`` (``ModelSpec.kv_elems_per_token``
  elements per token). Standard attention (mixtral, qwen3_moe), dense MLPs (deepseek's first
  layers), the embedding and the head are the dense backend's.

Optionally counts the experts every ``moe`` or ``moe_route`` stage chooses (``recorder``, a ``RoutingRecorder``).
Knows nothing about plans, queues or tiers.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import torch.nn.functional as F

from hetplan.runtime.kernels.linear import linear
from hetplan.errors import HetplanError
from hetplan.model import ModelSpec
from hetplan.runtime import kv_cache
from hetplan.runtime.models import dense_layout
from hetplan.runtime.models.moe import split as moe_split
from hetplan.runtime.models.moe import weights as moe_weights
from hetplan.runtime.backend import StageCall, TensorSpec
from hetplan.runtime.models.dense import _READS, _WRITES, DenseBackend, _rms_norm
from hetplan.runtime.models.mla import (LATENT_NORM_EPS, MlaWeights, absorb_query, expand_output, latent_attention,
                                 mla_rope, softmax_scale)
from hetplan.runtime.models.moe.layer import Router, experts_forward, route, swiglu
from hetplan.runtime.models.moe.stacked import ExpertStack, stack_key, sync_free_experts_forward, weights_stack
from hetplan.runtime.models.moe.weights import BlockExperts, block_expert

_MLA_READS = {"attn_in": ("x",), "attn_core": ("q_lat", "q_rope", "latent", "k_rope"),
              "attn_out": ("x", "o_lat")}
_MLA_WRITES = {"attn_in": ("q_lat", "q_rope", "latent", "k_rope"), "attn_core": ("o_lat",),
               "attn_out": ("x",)}
_MOE_READS = {"moe": ("x",), **moe_split.READS}
_MOE_WRITES = {"moe": ("x",), **moe_split.WRITES}


class MoeBackend(DenseBackend):
    """Executes the dense stages plus ``moe`` stages (whole or split) and (deepseek) latent attention."""

    kinds = DenseBackend.kinds | frozenset(_MOE_READS)

    def __init__(self, spec: ModelSpec):
        if not spec.is_moe:
            raise HetplanError(f"model {spec.name!r} ({spec.arch}) has no experts: run it with the dense backend")
        if spec.is_mla:
            # The dense rope tables are per head_dim and know no yarn; MLA rotates with its own rope.
            super().__init__(_without_rope(spec))
            self.spec, self.rope_inv_freq = spec, None
            self.mla_rope = mla_rope(spec)
        else:
            super().__init__(spec)
            self.mla_rope = None
        self._ropes = {}              # device -> Rope with its frequencies there
        self.recorder = None
        """A ``RoutingRecorder`` counting the experts each ``moe``/``moe_route`` stage chooses, or None."""
        self._record_lock = threading.Lock()
        self._hot = {}                # (block, device, hot ids) -> moe_split.HotSet of a split block's GPU part
        self._stacks = {}             # (block, device, ids, address) -> stacked.ExpertStack or None
        self._down = tuple(f"experts.{e}.down" for e in range(spec.n_experts))

    # -- the backend interface ---------------------------------------------------------------
    def block_tensors(self, block: str, kind: str, layer: int | None) -> list[TensorSpec]:
        return moe_weights.block_tensors(self.spec, kind, layer)

    def expert_of(self, local: str) -> int | None:
        """The routed expert an in-block tensor belongs to, or None: how a split block's weights
        are divided between HBM (hot experts, everything else) and DRAM (cold experts)."""
        return moe_weights.expert_of(local)

    def fused(self) -> dict[str, tuple[str, ...]]:
        """The dense groups, plus each expert's (and the shared experts') gate and up as one
        ``[2I, D]`` matrix, the layout ``Expert`` computes with."""
        groups = dict(dense_layout.FUSED)
        for e in range(self.spec.n_experts):
            groups[f"experts.{e}.gate_up"] = (f"experts.{e}.gate", f"experts.{e}.up")
        groups["shared.gate_up"] = ("shared.gate", "shared.up")
        return groups

    def reads(self, kind: str) -> tuple[str, ...]:
        if kind in _MOE_READS:
            return _MOE_READS[kind]
        return (_MLA_READS if self.spec.is_mla and kind in _MLA_READS else _READS)[kind]

    def writes(self, kind: str) -> tuple[str, ...]:
        if kind in _MOE_WRITES:
            return _MOE_WRITES[kind]
        return (_MLA_WRITES if self.spec.is_mla and kind in _MLA_WRITES else _WRITES)[kind]

    def kv_shapes(self, batch: int, max_tokens: int) -> dict[str, tuple]:
        if not self.spec.is_mla:
            return super().kv_shapes(batch, max_tokens)
        return {"latent": (batch, max_tokens, self.spec.kv_lora_rank),
                "k_rope": (batch, max_tokens, self.spec.qk_rope_head_dim)}

    def setup(self, device: torch.device, max_tokens: int | None = None) -> None:
        if self.mla_rope is None:
            super().setup(device, max_tokens)
        elif device not in self._ropes:
            self._ropes[device] = self.mla_rope.to(device)

    # -- stages ------------------------------------------------------------------------------
    def _moe(self, c: StageCall) -> dict:
        w, x, s = c.weights, c.inputs["x"], self.spec
        h = _rms_norm(x, w["norm"], s.norm_eps).reshape(-1, s.hidden)     # [T, D], T = B * S
        ids, weights = route(h, Router(w["router"], w.get("router_bias")), s)  # [T, k] each
        self._record(c.layer, ids)
        experts, every = BlockExperts(w, range(s.n_experts)), tuple(range(s.n_experts))
        if c.device.type == "cpu":  # only the experts the tokens chose run
            y = experts_forward(h, ids, weights, experts, every, s.act)
        else:                       # on a GPU without a host sync
            y = sync_free_experts_forward(h, ids, weights, experts, every, s.act, self.stack(c, every))
        if s.n_shared_experts:
            y += swiglu(h, block_expert(w, "shared"), s.act)
        return {"x": y.view_as(x).add_(x)}

    def _moe_route(self, c: StageCall) -> dict:
        out = moe_split.route_stage(c, self.spec, self._hot_set(c))
        self._record(c.layer, out["ids"])
        return out

    def _moe_experts(self, c: StageCall) -> dict:
        hot = self._hot_set(c)
        return moe_split.experts_stage(c, self.spec, hot, self.stack(c, hot.ids))

    def _moe_cold(self, c: StageCall) -> dict:
        return moe_split.cold_stage(c, self.spec)

    def _moe_merge(self, c: StageCall) -> dict:
        return moe_split.merge_stage(c)

    def stack(self, c: StageCall, ids: tuple) -> ExpertStack | None:
        """The stage's experts ``ids`` as one stack (``stacked.weights_stack``), made once per
        block, device, ids and memory they lie in."""
        key = (c.block, c.device, ids, stack_key(c.weights, ids))
        if key[-1] is None:
            return None
        if key not in self._stacks:
            self._stacks[key] = weights_stack(c.weights, ids, self.spec.n_experts)
        return self._stacks[key]

    def _hot_set(self, c: StageCall) -> moe_split.HotSet:
        """The experts the stage's weights hold: the block's GPU part, with its cold experts in a
        phase that streams them. Looked up on every call (one phase may stream them, the other
        not), its mask made once per block and set."""
        ids = tuple(e for e, name in enumerate(self._down) if name in c.weights)
        key = (c.block, c.device, ids)
        if key not in self._hot:
            self._hot[key] = moe_split.HotSet.of(c.weights, self.spec.n_experts, c.device)
        return self._hot[key]

    def _record(self, l: int, ids: torch.Tensor) -> None:
        if self.recorder is not None:
            with self._record_lock:
                self.recorder.record(l, ids)

    @property
    def tokenwise(self) -> frozenset:
        """Chunked stages: the MoE layer too; MLA's projections keep their head-major layout and
        run on the whole prompt (only its attention core is chunked)."""
        base = DenseBackend.tokenwise | {"moe"}
        return base - {"attn_in", "attn_out"} if self.spec.is_mla else base

    def _attn_core_chunked(self, c: StageCall) -> dict:
        if not self.spec.is_mla:
            return super()._attn_core_chunked(c)
        q_lat, q_rope = c.inputs["q_lat"], c.inputs["q_rope"]               # [B, H, S, r], [B, H, S, rope]
        latent, k_rope = c.inputs["latent"], c.inputs["k_rope"]             # [B, S, r], [B, S, rope]
        start = c.step.start
        o = q_lat.new_empty(q_lat.shape)
        for s, n in c.step.chunks():
            e = s + n
            if c.kv is not None:
                kv_cache.write(c.kv["latent"], start + s, latent[:, s:e])
                kv_cache.write(c.kv["k_rope"], start + s, k_rope[:, s:e])
            if start:
                o[:, :, s:e] = cached_latent_attention(q_lat[:, :, s:e], q_rope[:, :, s:e], c.kv, start + e,
                                                       start + s, self.spec)
            else:
                o[:, :, s:e] = latent_attention(q_lat[:, :, s:e], q_rope[:, :, s:e], latent[:, :e], k_rope[:, :e],
                                                self.spec, start + s)
        return {"o_lat": o}

    def _attn_in(self, c: StageCall) -> dict:
        if not self.spec.is_mla:
            return super()._attn_in(c)
        w, x, s = c.weights, c.inputs["x"], self.spec
        b, n = x.shape[0], x.shape[1]
        h = _rms_norm(x, w["norm"], s.norm_eps)
        if "q_a" in w:
            q = linear(_rms_norm(linear(h, w["q_a"]), w["q_a_norm"], LATENT_NORM_EPS), w["q_b"])
        else:
            q = linear(h, w["q"])
        q = q.view(b, n, s.n_heads, -1).transpose(1, 2)                      # [B, H, S, nope + rope]
        q_nope, q_rope = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        kv_a = linear(h, w["kv_a"])
        latent, k_rope = kv_a.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)  # [B, S, r], [B, S, rope]
        rope = self._ropes[c.device]
        positions = torch.arange(c.step.start, c.step.start + n, device=c.device)
        cos, sin = rope.cos_sin(positions, x.dtype)
        return {"q_lat": absorb_query(q_nope, _kv_b(w), s),                   # [B, H, S, r]
                "q_rope": rope.apply(q_rope, cos, sin),
                "latent": _rms_norm(latent, w["kv_a_norm"], LATENT_NORM_EPS),
                "k_rope": rope.apply(k_rope, cos, sin)}

    def _attn_core(self, c: StageCall) -> dict:
        if not self.spec.is_mla:
            return super()._attn_core(c)
        q_lat, q_rope = c.inputs["q_lat"], c.inputs["q_rope"]
        latent, k_rope = c.inputs["latent"], c.inputs["k_rope"]
        start, n = c.step.start, c.step.new_tokens
        if c.kv is not None:
            kv_cache.write(c.kv["latent"], start, latent)
            kv_cache.write(c.kv["k_rope"], start, k_rope)
            if start:  # after the prompt, attend over the cache where it lies
                return {"o_lat": cached_latent_attention(q_lat, q_rope, c.kv, start + n, start, self.spec)}
        return {"o_lat": latent_attention(q_lat, q_rope, latent, k_rope, self.spec, start)}  # [B, H, S, r]

    def _attn_out(self, c: StageCall) -> dict:
        if not self.spec.is_mla:
            return super()._attn_out(c)
        w = c.weights
        o = expand_output(c.inputs["o_lat"], _kv_b(w), self.spec)            # [B, S, H * v]
        return {"x": linear(o, w["o"]).add_(c.inputs["x"])}


def cached_latent_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, kv, end: int, start: int,
                            spec: ModelSpec) -> torch.Tensor:
    """``latent_attention`` over the latent cache's positions [0, end), read block by block where
    it lies (``kv_cache.attend``: scores q_lat c^T + q_rope k_rope^T, values c; the latent is not
    concatenated with its rope part, nor copied). q_lat [B, H, S, r], q_rope [B, H, S, rope] -> [B, H, S, r]."""
    b, h, n, r = q_lat.shape
    rows = (q_lat.reshape(b, 1, h * n, r), q_rope.reshape(b, 1, h * n, q_rope.shape[-1]))  # one shared head
    o = kv_cache.attend(rows, (kv["latent"], kv["k_rope"]), kv["latent"], end, start, n, softmax_scale(spec))
    return o.view(b, h, n, r)


def _kv_b(w) -> MlaWeights:
    """The MLA weights ``absorb_query``/``expand_output`` read (only ``kv_b``)."""
    return MlaWeights(kv_a=None, kv_a_norm=None, kv_b=w["kv_b"], o=None)


def _without_rope(spec: ModelSpec) -> ModelSpec:
    return dataclasses.replace(spec, rope_scaling=None)
