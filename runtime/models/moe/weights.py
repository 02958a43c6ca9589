"""Checkpoint tensor names of the MoE families -> (block, tensor), and assembly of MoE/MLA pieces.

Both directions, for mixtral, qwen3_moe and deepseek checkpoints: ``block_tensors(spec, kind,
layer)`` lists a block's tensors as ``TensorSpec`` (in-block name, checkpoint name, shape), the
form the runtime's loader reads (``hetplan.runtime.backend``), and ``weight_key(name, spec)``
maps any checkpoint or ``state_dict`` name back to the block that owns it and its in-block
name, so a loader can read each block, and each expert of an MoE block, individually:

    block      tensor names (HF name, after ``model.layers.{l}.``)
    embed      tok (model.embed_tokens.weight)
    head       norm (model.norm.weight), lm (lm_head.weight)
    attn_l     norm (input_layernorm); q, k, v, o (+ _bias), q_norm, k_norm (self_attn.*_proj,
               q_norm, k_norm); MLA: q, q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, o
               (q_proj, q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
               kv_b_proj, o_proj)
    mlp_l      norm (post_attention_layernorm); gate, up, down (mlp.*_proj)
    moe_l      norm (post_attention_layernorm); router (mlp.gate / block_sparse_moe.gate);
               router_bias (mlp.gate.e_score_correction_bias);
               experts.{e}.gate|up|down (experts.{e}.gate_proj|up_proj|down_proj, mixtral's
               experts.{e}.w1|w3|w2); shared.gate|up|down (mlp.shared_experts.*_proj);
               fused, as transformers 5 holds experts in memory: experts.gate_up
               ([E, 2I, D], gate rows first) and experts.down ([E, D, I]) (experts.gate_up_proj,
               experts.down_proj)

``save_pretrained`` of transformers 5 writes experts one by one (``experts.{e}.w1`` /
``experts.{e}.gate_proj``); its in-memory ``state_dict()`` holds them fused. Both are read.
Names a run never needs (deepseek's multi-token-prediction layers past ``n_layers``, rotary
caches) map to None.

This module knows names and shapes; it knows nothing about files, devices or plans.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hetplan.errors import HetplanError
from hetplan.model import ModelSpec
from hetplan.runtime.models import dense_layout
from hetplan.runtime.backend import TensorSpec
from hetplan.runtime.models.mla import MlaWeights
from hetplan.runtime.models.moe.layer import Expert, MoeLayer, Router


@dataclass(frozen=True)
class WeightKey:
    block: str
    """``embed``, ``attn_l``, ``mlp_l``, ``moe_l`` or ``head``."""
    tensor: str
    """Name inside the block (module docstring)."""
    expert: int | None = None
    """The routed expert a per-expert tensor belongs to."""


_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
_ATTN = {"input_layernorm.weight": "norm", "self_attn.q_norm.weight": "q_norm",
         "self_attn.k_norm.weight": "k_norm", "self_attn.q_a_layernorm.weight": "q_a_norm",
         "self_attn.kv_a_layernorm.weight": "kv_a_norm"}
_ATTN_PROJ = re.compile(r"^self_attn\.(q|k|v|o|q_a|q_b|kv_b|kv_a)(?:_proj(?:_with_mqa)?)\.(weight|bias)$")
_DENSE = re.compile(r"^mlp\.(gate|up|down)_proj\.weight$")
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                     r"\.weight$")
_FUSED = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_SHARED = re.compile(r"^mlp\.shared_experts\.(gate|up|down)_proj\.weight$")
_ROUTER = re.compile(r"^(?:mlp|block_sparse_moe)\.gate\.(weight|e_score_correction_bias)$")
_EXPERT_PART = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                "down_proj": "down"}


def weight_key(name: str, spec: ModelSpec) -> WeightKey | None:
    """The block and in-block name of checkpoint tensor ``name``; None for tensors inference
    does not use. Raises HetplanError for a name this family does not have."""
    if name.endswith("_scale_inv") or name.endswith(".weight_scale"):
        raise HetplanError(f"{name}: the checkpoint is block-quantised (fp8 scales); convert it "
                           f"to bf16 (e.g. DeepSeek's fp8_cast_bf16.py) before running it")
    if name in ("model.embed_tokens.weight", "embed_tokens.weight"):
        return WeightKey("embed", "tok")
    if name in ("model.norm.weight", "norm.weight"):
        return WeightKey("head", "norm")
    if name == "lm_head.weight":
        return WeightKey("head", "lm")
    m = _LAYER.match(name)
    if m is None:
        raise _unknown(name, spec)
    l, rest = int(m.group(1)), m.group(2)
    if l >= spec.n_layers or rest.endswith("rotary_emb.inv_freq"):
        return None
    if rest in _ATTN:
        return WeightKey(f"attn_{l}", _ATTN[rest])
    if (a := _ATTN_PROJ.match(rest)) is not None:
        return WeightKey(f"attn_{l}", a.group(1) + ("_bias" if a.group(2) == "bias" else ""))
    mlp_block = f"moe_{l}" if spec.is_moe_layer(l) else f"mlp_{l}"
    if rest == "post_attention_layernorm.weight":
        return WeightKey(mlp_block, "norm")
    if not spec.is_moe_layer(l):
        if (d := _DENSE.match(rest)) is not None:
            return WeightKey(mlp_block, d.group(1))
        raise _unknown(name, spec)
    if (e := _EXPERT.match(rest)) is not None:
        expert = int(e.group(1))
        if expert >= spec.n_experts:
            raise HetplanError(f"{name}: expert {expert} does not exist; the model has "
                               f"{spec.n_experts} experts per layer")
        return WeightKey(mlp_block, f"experts.{expert}.{_EXPERT_PART[e.group(2)]}", expert)
    if (f := _FUSED.match(rest)) is not None:
        return WeightKey(mlp_block, "experts.gate_up" if f.group(1) == "gate_up_proj" else "experts.down")
    if (sh := _SHARED.match(rest)) is not None:
        return WeightKey(mlp_block, f"shared.{sh.group(1)}")
    if (r := _ROUTER.match(rest)) is not None:
        return WeightKey(mlp_block, "router" if r.group(1) == "weight" else "router_bias")
    raise _unknown(name, spec)


_LOCAL_EXPERT = re.compile(r"^experts\.(\d+)\.")


def expert_of(local: str) -> int | None:
    """The routed expert an in-block tensor belongs to (``experts.{e}.gate`` -> e), or None for
    the block's other tensors (norm, router, shared experts)."""
    m = _LOCAL_EXPERT.match(local)
    return int(m.group(1)) if m else None


def block_expert(tensors: Mapping, prefix: str) -> Expert:
    """The expert ``prefix`` (``experts.{e}`` or ``shared``) over a block's in-block tensors: the
    fused ``{prefix}.gate_up`` view when the block is laid out with one, else a concatenation."""
    if f"{prefix}.gate_up" in tensors:
        return Expert(tensors[f"{prefix}.gate_up"], tensors[f"{prefix}.down"])
    return Expert.from_parts(tensors[f"{prefix}.gate"], tensors[f"{prefix}.up"], tensors[f"{prefix}.down"])


class BlockExperts(Mapping):
    """expert id -> ``Expert`` over a block's weights, built when looked up (a quantised block
    dequantises only the experts its tokens chose, each into one region all its experts share:
    use an expert before looking up the next)."""

    def __init__(self, weights: Mapping, ids):
        self._weights, self._ids = weights, tuple(ids)

    def __getitem__(self, e: int):
        if e not in self._ids:
            raise KeyError(e)
        return block_expert(self._weights, f"experts.{e}")

    def __iter__(self):
        return iter(self._ids)

    def __len__(self) -> int:
        return len(self._ids)


def _unknown(name: str, spec: ModelSpec) -> HetplanError:
    return HetplanError(f"{name}: not a tensor of a {spec.arch} model with this config; the "
                        f"checkpoint and the model's config.json disagree")


def group_by_block(tensors: Mapping, spec: ModelSpec) -> dict:
    """HF name -> tensor, to block -> {in-block name -> tensor} (unused tensors dropped)."""
    blocks: dict[str, dict] = {}
    for name, t in tensors.items():
        key = weight_key(name, spec)
        if key is not None:
            blocks.setdefault(key.block, {})[key.tensor] = t
    return blocks


def moe_layer_from_tensors(tensors: Mapping, spec: ModelSpec,
                           experts: Iterable[int] | None = None) -> MoeLayer:
    """Assemble an MoE block from its in-block tensors, keeping only ``experts`` (all if None).
    Per-expert (``experts.{e}.gate``) and fused (``experts.gate_up``) layouts are both read."""
    keep = range(spec.n_experts) if experts is None else sorted(experts)
    if "experts.gate_up" in tensors:
        gate_up, down = tensors["experts.gate_up"], tensors["experts.down"]
        chosen = {e: Expert(gate_up[e], down[e]) for e in keep}
    else:
        chosen = {e: Expert.from_parts(tensors[f"experts.{e}.gate"], tensors[f"experts.{e}.up"],
                                       tensors[f"experts.{e}.down"]) for e in keep}
    shared = None
    if spec.n_shared_experts:
        shared = Expert.from_parts(tensors["shared.gate"], tensors["shared.up"], tensors["shared.down"])
    return MoeLayer(Router(tensors["router"], tensors.get("router_bias")), chosen, shared)


def mla_weights_from_tensors(tensors: Mapping) -> MlaWeights:
    """Assemble MLA weights from an ``attn_l`` block's in-block tensors."""
    return MlaWeights(kv_a=tensors["kv_a"], kv_a_norm=tensors["kv_a_norm"], kv_b=tensors["kv_b"],
                      o=tensors["o"], q=tensors.get("q"), q_a=tensors.get("q_a"),
                      q_a_norm=tensors.get("q_a_norm"), q_b=tensors.get("q_b"))


def block_tensors(spec: ModelSpec, kind: str, layer: int | None) -> list[TensorSpec]:
    """The tensors of one block (``kind`` in embed, attn, mlp, moe, head) of an MoE-family
    ``spec``, routed experts one by one as ``save_pretrained`` writes them. Standard attention,
    dense MLPs, the embedding and the head are laid out as in the dense families."""
    if kind == "moe":
        return _moe_tensors(spec, layer)
    if kind == "attn" and spec.is_mla:
        return _mla_tensors(spec, layer)
    return dense_layout.block_tensors(spec, kind, layer)


def _moe_tensors(spec: ModelSpec, l: int) -> list[TensorSpec]:
    d, i, n_e = spec.hidden, spec.moe_intermediate, spec.n_experts
    p = f"model.layers.{l}." + ("block_sparse_moe." if spec.arch == "mixtral" else "mlp.")
    names = ("w1", "w3", "w2") if spec.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = [TensorSpec("norm", f"model.layers.{l}.post_attention_layernorm.weight", (d,)),
           TensorSpec("router", p + "gate.weight", (n_e, d))]
    if spec.arch == "deepseek_v3" and spec.extra.get("topk_method", "noaux_tc") == "noaux_tc":
        out.append(TensorSpec("router_bias", p + "gate.e_score_correction_bias", (n_e,)))
    for e in range(n_e):
        for part, name, shape in zip(("gate", "up", "down"), names, ((i, d), (i, d), (d, i))):
            out.append(TensorSpec(f"experts.{e}.{part}", f"{p}experts.{e}.{name}.weight", shape))
    if spec.n_shared_experts:
        si = spec.n_shared_experts * i
        for part, shape in (("gate", (si, d)), ("up", (si, d)), ("down", (d, si))):
            out.append(TensorSpec(f"shared.{part}", f"{p}shared_experts.{part}_proj.weight", shape))
    return out


def _mla_tensors(spec: ModelSpec, l: int) -> list[TensorSpec]:
    d, h, r, rd = spec.hidden, spec.n_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    qk = spec.qk_nope_head_dim + rd
    p = f"model.layers.{l}.self_attn."
    out = [TensorSpec("norm", f"model.layers.{l}.input_layernorm.weight", (d,))]
    if spec.q_lora_rank:
        q = spec.q_lora_rank
        out += [TensorSpec("q_a", p + "q_a_proj.weight", (q, d)),
                TensorSpec("q_a_norm", p + "q_a_layernorm.weight", (q,)),
                TensorSpec("q_b", p + "q_b_proj.weight", (h * qk, q))]
    else:
        out.append(TensorSpec("q", p + "q_proj.weight", (h * qk, d)))
    return out + [TensorSpec("kv_a", p + "kv_a_proj_with_mqa.weight", (r + rd, d)),
                  TensorSpec("kv_a_norm", p + "kv_a_layernorm.weight", (r,)),
                  TensorSpec("kv_b", p + "kv_b_proj.weight",
                             (h * (spec.qk_nope_head_dim + spec.v_head_dim), r)),
                  TensorSpec("o", p + "o_proj.weight", (d, h * spec.v_head_dim))]
