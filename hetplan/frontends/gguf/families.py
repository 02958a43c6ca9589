"""GGUF metadata -> ModelSpec, and the file's tensor names <-> the runtime's Hugging Face names.

llama.cpp names each architecture's keys ``{arch}.block_count``, ``{arch}.attention.head_count``...
and each layer's tensors ``blk.{l}.attn_q.weight``...; this module knows those names for the
families the planner plans: ``llama`` (llama, mistral; with ``expert_count`` the Mixtral-style
llama-MoE), ``qwen2``, ``qwen3``, ``qwen3moe`` and ``deepseek2`` (DeepSeek V2/V3, MLA). Every
tensor of the file is checked against the shape the spec implies, and one that disagrees is
named. Knows nothing about costs, devices or torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from hetplan.errors import HetplanError
from hetplan.frontends.gguf.header import GgufHeader, read_f32, read_header
from hetplan.model import ModelSpec

ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v3"}
"""GGUF ``general.architecture`` -> ModelSpec family (``llama`` with experts: ``mixtral``)."""
GATING = {1: "softmax", 2: "sigmoid"}
"""deepseek2 ``expert_gating_func`` -> the config's ``scoring_func``."""


def spec_from_gguf(path: str | Path, weight_dtype: str | None = None, kv_dtype: str | None = None) -> ModelSpec:
    """The ModelSpec of GGUF file ``path``, its blocks priced as the runtime holds the file's
    tensors (``held.price``); with ``weight_dtype`` (a plan dtype) the weights are instead planned,
    and loaded, requantised to it."""
    from hetplan.frontends.gguf.held import price
    header = read_header(path)
    spec = ModelSpec(**spec_fields(header), kv_dtype=kv_dtype or "fp16")
    check_shapes(header, spec)
    return price(header, spec, weight_dtype)


def spec_fields(h: GgufHeader) -> dict:
    """ModelSpec keyword arguments (but dtypes and prices) from the header's metadata."""
    if h.arch not in ARCHS:
        raise HetplanError(f"{h.path}: architecture {h.arch!r} is not supported; supported GGUF "
                           f"architectures: {', '.join(ARCHS)}")
    a = h.arch

    def num(key: str, default=..., kind=int):
        v = h.get(f"{a}.{key}", default)
        if v is default and default is not ...:
            return v
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or float(v).is_integer())
        if not ok or v < 0 or (kind is int and v == 0 and default is ...):
            raise HetplanError(f"{h.path}: metadata key {a}.{key} must be a "
                               f"{'positive integer' if kind is int else 'number'}, got {v!r}")
        return kind(v)

    embd = h.tensors.get("token_embd.weight")
    if embd is None:
        raise HetplanError(f"{h.path}: no tensor 'token_embd.weight'; not a complete {a} model file")
    hidden, heads = num("embedding_length"), num("attention.head_count")
    n_experts = num("expert_count", 0)
    arch = "mixtral" if a == "llama" and n_experts else ARCHS[a]
    kw = dict(name=str(h.metadata.get("general.name") or Path(h.path).stem), arch=arch,
              n_layers=num("block_count"), hidden=hidden, intermediate=num("feed_forward_length", 0),
              n_heads=heads, n_kv_heads=num("attention.head_count_kv", heads),
              head_dim=num("attention.key_length", 0) or hidden // heads,
              vocab=num("vocab_size", 0) or embd.shape[-1], max_positions=num("context_length", 4096),
              tie_embeddings="output.weight" not in h.tensors,
              norm_eps=num("attention.layer_norm_rms_epsilon", 1e-6, float),
              rope_theta=num("rope.freq_base", 10000.0, float), rope_scaling=_rope_scaling(h, num),
              attn_bias="blk.0.attn_q.bias" in h.tensors, attn_out_bias="blk.0.attn_output.bias" in h.tensors,
              qk_norm="blk.0.attn_q_norm.weight" in h.tensors)
    if arch == "mixtral":
        kw.update(n_experts=n_experts, experts_per_token=num("expert_used_count"),
                  moe_intermediate=kw["intermediate"])
    elif arch == "qwen3_moe":
        kw.update(n_experts=num("expert_count"), experts_per_token=num("expert_used_count"),
                  moe_intermediate=num("expert_feed_forward_length"),
                  extra={"norm_topk_prob": bool(h.metadata.get(f"{a}.expert_weights_norm", True))})
    elif arch == "deepseek_v3":
        kw.update(_deepseek(h, num, heads))
    if not kw["intermediate"]:
        kw["intermediate"] = kw.get("moe_intermediate") or 0
    return kw


def _rope_scaling(h: GgufHeader, num) -> dict | None:
    """``rope.scaling.*`` as a config's ``rope_scaling``; Llama 3.1's per-frequency factors, which
    GGUF keeps as a tensor (``rope_freqs.weight``), are named as such."""
    kind = h.metadata.get(f"{h.arch}.rope.scaling.type")
    if "rope_freqs.weight" in h.tensors:
        return {"rope_type": "gguf_rope_freqs", "freq_factors": rope_freqs(h, num)}
    if kind in (None, "none"):
        return None
    out = {"rope_type": str(kind), "factor": num("rope.scaling.factor", 1.0, float)}
    if f"{h.arch}.rope.scaling.original_context_length" in h.metadata:
        out["original_max_position_embeddings"] = num("rope.scaling.original_context_length")
    if f"{h.arch}.rope.scaling.yarn_log_multiplier" in h.metadata:
        # llama.cpp's converter writes 0.1 * mscale_all_dim (DeepSeek's configs have mscale equal to
        # it, the case llama.cpp's attention scale computes)
        mscale = num("rope.scaling.yarn_log_multiplier", 0.0, float) / 0.1
        out.update(mscale=mscale, mscale_all_dim=mscale)
    return out


def rope_freqs(h: GgufHeader, num) -> list[float]:
    """The divisors of each rotary frequency in ``rope_freqs.weight`` (llama.cpp's converter writes
    Llama 3.1's scaling this way: ``theta_i = pos * base^(-2i/d) / f_i``), read from the file: a
    plan keeps them, so it runs from any copy of the weights. Each must be a positive number."""
    heads = num("attention.head_count")
    dim = num("rope.dimension_count", 0) or num("attention.key_length", 0) or num("embedding_length") // heads
    values = read_f32(h, "rope_freqs.weight", dim // 2)
    bad = [i for i, v in enumerate(values) if not (0 < v < 1e6)]
    if bad:
        raise HetplanError(f"{h.path}: tensor 'rope_freqs.weight' holds {values[bad[0]]!r} at index {bad[0]}; "
                           f"each rotary frequency factor must be a positive number below 1e6; the file is corrupt")
    return values


def _deepseek(h: GgufHeader, num, heads: int) -> dict:
    """MLA and the routed/shared experts of a deepseek2 file. Files converted for llama.cpp's
    MLA kernels keep the per-head dims in ``key_length_mla``/``value_length_mla`` (and
    ``key_length`` is then the latent's); older ones in ``key_length``/``value_length``."""
    rope_d = num("rope.dimension_count")
    qk = num("attention.key_length_mla", 0) or num("attention.key_length")
    v = num("attention.value_length_mla", 0) or num("attention.value_length")
    extra = {"routed_scaling_factor": num("expert_weights_scale", 1.0, float),
             "norm_topk_prob": bool(h.metadata.get(f"{h.arch}.expert_weights_norm", False)),
             "scoring_func": GATING.get(num("expert_gating_func", 1), "softmax")}
    # llama.cpp routes over groups only when the file names them; without, every expert is one group
    extra.update(n_group=num("expert_group_count", 1) or 1, topk_group=num("expert_group_used_count", 1) or 1)
    return dict(n_kv_heads=heads, head_dim=qk, n_experts=num("expert_count"),
                experts_per_token=num("expert_used_count"), moe_intermediate=num("expert_feed_forward_length"),
                n_shared_experts=num("expert_shared_count", 0), first_dense_layers=num("leading_dense_block_count", 0),
                q_lora_rank=num("attention.q_lora_rank", 0), kv_lora_rank=num("attention.kv_lora_rank"),
                qk_rope_head_dim=rope_d, qk_nope_head_dim=qk - rope_d, v_head_dim=v,
                attn_bias=False, attn_out_bias=False, qk_norm=False, extra=extra)


# -- tensor names ------------------------------------------------------------------------------
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
IGNORED = ("rope_freqs.weight",)
"""Tensors outside every block: Llama 3.1's rope frequency factors (a few hundred bytes)."""


def block_of(name: str, spec: ModelSpec) -> str | None:
    """The block that holds GGUF tensor ``name`` (None: outside the model inference runs, e.g. a
    deepseek multi-token-prediction layer past ``n_layers``); raises for a name the family does
    not have."""
    if name == "token_embd.weight":
        return "embed"
    if name in ("output_norm.weight", "output.weight"):
        return "head"
    if name in IGNORED:
        return None
    m = _BLK.match(name)
    if m is None:
        raise HetplanError(f"tensor {name!r}: not a tensor of a {spec.arch} model")
    l, rest = int(m.group(1)), m.group(2)
    if l >= spec.n_layers:
        return None
    if rest.startswith("attn_"):
        return f"attn_{l}"
    if rest.startswith("ffn_") or rest.startswith("exp_probs_b"):
        return f"{'moe' if spec.is_moe_layer(l) else 'mlp'}_{l}"
    raise HetplanError(f"tensor {name!r}: not a tensor of a {spec.arch} model")


def expected_shapes(spec: ModelSpec) -> dict:
    """Layer tensor suffix -> its shape in Hugging Face order ([out, in]; experts [E, out, in]),
    as ``spec`` implies it."""
    d, hd, e, i = spec.hidden, spec.head_dim, spec.n_experts, spec.moe_intermediate
    kv, f, s = spec.n_kv_heads * hd, spec.intermediate, spec.n_shared_experts * spec.moe_intermediate
    h, r = spec.n_heads, spec.kv_lora_rank
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    out = {"attn_norm.weight": (d,), "attn_output.weight": (d, spec.attn_out_dim), "attn_output.bias": (d,),
           "ffn_norm.weight": (d,), "ffn_gate.weight": (f, d), "ffn_up.weight": (f, d), "ffn_down.weight": (d, f),
           "ffn_gate_inp.weight": (e, d), "ffn_gate_exps.weight": (e, i, d), "ffn_up_exps.weight": (e, i, d),
           "ffn_down_exps.weight": (e, d, i), "ffn_gate_shexp.weight": (s, d), "ffn_up_shexp.weight": (s, d),
           "ffn_down_shexp.weight": (d, s), "exp_probs_b.bias": (e,)}
    if spec.is_mla:
        out.update({"attn_q_a.weight": (spec.q_lora_rank, d), "attn_q_a_norm.weight": (spec.q_lora_rank,),
                    "attn_q_b.weight": (h * qk, spec.q_lora_rank), "attn_q.weight": (h * qk, d),
                    "attn_kv_a_mqa.weight": (r + spec.qk_rope_head_dim, d), "attn_kv_a_norm.weight": (r,),
                    "attn_kv_b.weight": (h * (spec.qk_nope_head_dim + spec.v_head_dim), r),
                    "attn_k_b.weight": (h, r, spec.qk_nope_head_dim), "attn_v_b.weight": (h, spec.v_head_dim, r)})
    else:
        out.update({"attn_q.weight": (spec.q_dim, d), "attn_k.weight": (kv, d), "attn_v.weight": (kv, d),
                    "attn_q.bias": (spec.q_dim,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
                    "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
    return out


def check_shapes(h: GgufHeader, spec: ModelSpec) -> None:
    """Every tensor of the file has the shape the metadata implies (ggml order is the reverse of
    Hugging Face's). llama.cpp's converter splits MLA's ``kv_b_proj`` ([H (nope + v), r], per
    head W_UK then W_UV) into ``attn_k_b`` = W_UK transposed, [H, r, nope], and ``attn_v_b`` =
    W_UV, [H, v, r]."""
    shapes = expected_shapes(spec)
    top = {"token_embd.weight": (spec.vocab, spec.hidden), "output.weight": (spec.vocab, spec.hidden),
           "output_norm.weight": (spec.hidden,)}
    for name, t in h.tensors.items():
        if block_of(name, spec) is None:
            continue
        rest = name.split(".", 2)[2] if name.startswith("blk.") else name
        want = top.get(name) or shapes.get(rest)
        if want is None:
            raise HetplanError(f"{h.path}: tensor {name!r} is not a tensor of a {spec.arch} model")
        got = tuple(reversed(t.shape))
        if got != tuple(want):
            raise HetplanError(f"{h.path}: tensor {name!r} has shape {list(t.shape)} (ggml order), but the "
                               f"metadata implies {list(reversed(want))}; the file's metadata and tensors disagree")
    for l in range(spec.n_layers if spec.is_mla else 0):
        b = f"blk.{l}."
        split = [n for n in (b + "attn_k_b.weight", b + "attn_v_b.weight") if n in h.tensors]
        if b + "attn_kv_b.weight" not in h.tensors and len(split) < 2:
            missing = b + ("attn_kv_b.weight" if not split else
                           ("attn_v_b.weight" if split[0].endswith("attn_k_b.weight") else "attn_k_b.weight"))
            raise HetplanError(f"{h.path}: no tensor {missing!r} (MLA's kv_b_proj, whole or split into attn_k_b "
                               f"and attn_v_b); the file is incomplete")


# -- Hugging Face names (the runtime's backends) -> GGUF names ------------------------------------
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_HF_IN_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate.weight": "ffn_gate_inp.weight", "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
}
_HF_PROJ = re.compile(r"^self_attn\.(q|k|v)_proj\.(weight|bias)$")
_HF_MLP = re.compile(r"^mlp\.(gate|up|down)_proj\.weight$")
_HF_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def gguf_name(hf_name: str) -> tuple[str, int | None] | None:
    """(GGUF tensor name, routed expert index or None) holding Hugging Face tensor ``hf_name``;
    None for a name with no GGUF counterpart here."""
    if hf_name in _HF_TOP:
        return _HF_TOP[hf_name], None
    m = _HF_LAYER.match(hf_name)
    if m is None:
        return None
    l, rest = m.group(1), m.group(2)
    if rest in _HF_IN_LAYER:
        return f"blk.{l}.{_HF_IN_LAYER[rest]}", None
    if (p := _HF_PROJ.match(rest)) is not None:
        return f"blk.{l}.attn_{p.group(1)}.{p.group(2)}", None
    if (p := _HF_MLP.match(rest)) is not None:
        return f"blk.{l}.ffn_{p.group(1)}.weight", None
    if (p := _HF_EXPERT.match(rest)) is not None:
        return f"blk.{l}.ffn_{_EXPERT_PART[p.group(2)]}_exps.weight", int(p.group(1))
    return None


def permuted_rows(spec: ModelSpec, name: str) -> int | None:
    """llama.cpp's converter permutes the rows of a llama-architecture file's ``attn_q``/``attn_k``
    (rotary pairs interleaved, its rope's layout): the head count to undo it with, else None."""
    if spec.arch not in ("llama", "mixtral"):
        return None
    if name.endswith(".attn_q.weight") or name.endswith(".attn_q.bias"):
        return spec.n_heads
    if name.endswith(".attn_k.weight") or name.endswith(".attn_k.bias"):
        return spec.n_kv_heads
    return None
