"""What each engine calls a block's weights: llama.cpp's GGUF tensor names and transformers'
module names, per hetplan block.

GGUF names come from the model's own file when the plan was compiled from one (the header's
tensor directory, read memory-mapped), else from llama.cpp's naming for the family
(``blk.{l}.attn_q.weight``...), as its converter writes them. Module names follow transformers
5.x (``model.layers.{l}.self_attn``, ``model.layers.{l}.mlp.experts``, OPT's
``model.decoder.layers.{l}.fc1``...). Knows nothing about placements or engines' options.
"""

from __future__ import annotations

from pathlib import Path

from hetplan.errors import HetplanError
from hetplan.model import ModelSpec

GGUF_ARCHS = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
              "qwen3_moe": "qwen3moe", "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2"}
"""ModelSpec family -> llama.cpp architecture (families llama.cpp has no architecture for, e.g.
OPT and GPT-2, are absent)."""
EXPERT_SUFFIXES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
"""A MoE layer's routed-expert tensors (every expert of the layer in one tensor each)."""


def gguf_arch(spec: ModelSpec) -> str | None:
    return GGUF_ARCHS.get(spec.arch)


def gguf_tensor_names(spec: ModelSpec, model_source: str | None = None) -> list:
    """Every GGUF tensor name of ``spec``'s model: the file's own when ``model_source`` is a
    readable .gguf file, else the family's names as llama.cpp's converter writes them."""
    if model_source and str(model_source).endswith(".gguf") and Path(model_source).is_file():
        from hetplan.frontends.gguf.header import read_header
        return list(read_header(model_source).tensors)
    if gguf_arch(spec) is None:
        raise HetplanError(f"model {spec.name!r} ({spec.arch}): llama.cpp has no architecture for this family")
    names = ["token_embd.weight"]
    for l in range(spec.n_layers):
        names += [f"blk.{l}.{s}" for s in _attn_suffixes(spec) + _ffn_suffixes(spec, l)]
    names += ["output_norm.weight"] + ([] if spec.tie_embeddings else ["output.weight"])
    return names


def _attn_suffixes(spec: ModelSpec) -> list:
    out = ["attn_norm.weight"]
    if spec.is_mla:
        out += (["attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight"] if spec.q_lora_rank
                else ["attn_q.weight"])
        out += ["attn_kv_a_mqa.weight", "attn_kv_a_norm.weight", "attn_kv_b.weight"]
    else:
        out += ["attn_q.weight", "attn_k.weight", "attn_v.weight"]
        if spec.attn_bias:
            out += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
        if spec.qk_norm:
            out += ["attn_q_norm.weight", "attn_k_norm.weight"]
    out.append("attn_output.weight")
    if spec.attn_out_bias:
        out.append("attn_output.bias")
    return out


def _ffn_suffixes(spec: ModelSpec, l: int) -> list:
    out = ["ffn_norm.weight"]
    if not spec.is_moe_layer(l):
        return out + ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
    out += ["ffn_gate_inp.weight", *EXPERT_SUFFIXES]
    if spec.n_shared_experts:
        out += ["ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight"]
    if spec.arch == "deepseek_v3":
        out.append("exp_probs_b.bias")
    return out


def gguf_block(name: str, spec: ModelSpec) -> str | None:
    """The hetplan block holding GGUF tensor ``name`` (None: outside every block)."""
    from hetplan.frontends.gguf.families import block_of
    return block_of(name, spec)


def is_expert_tensor(name: str) -> bool:
    return name.startswith("blk.") and name.split(".", 2)[2] in EXPERT_SUFFIXES


# -- transformers module names -------------------------------------------------------------------

def hf_modules(spec: ModelSpec) -> dict:
    """hetplan block -> the transformers modules holding its weights, in module order (a MoE
    block's routed experts last, ``model.layers.{l}.mlp.experts``)."""
    if spec.arch == "opt":
        p = "model.decoder"
        out = {"embed": [f"{p}.embed_tokens", f"{p}.embed_positions"]}
        for l in range(spec.n_layers):
            out[f"attn_{l}"] = [f"{p}.layers.{l}.self_attn_layer_norm", f"{p}.layers.{l}.self_attn"]
            out[f"mlp_{l}"] = [f"{p}.layers.{l}.final_layer_norm", f"{p}.layers.{l}.fc1", f"{p}.layers.{l}.fc2"]
        out["head"] = [f"{p}.final_layer_norm", "lm_head"]
        return out
    out = {"embed": ["model.embed_tokens"]}
    for l in range(spec.n_layers):
        out[f"attn_{l}"] = [f"model.layers.{l}.input_layernorm", f"model.layers.{l}.self_attn"]
        if spec.is_moe_layer(l):
            mods = [f"model.layers.{l}.post_attention_layernorm", f"model.layers.{l}.mlp.gate"]
            if spec.n_shared_experts:
                mods.append(f"model.layers.{l}.mlp.shared_experts")
            out[f"moe_{l}"] = mods + [f"model.layers.{l}.mlp.experts"]
        else:
            out[f"mlp_{l}"] = [f"model.layers.{l}.post_attention_layernorm", f"model.layers.{l}.mlp"]
    out["head"] = ["model.norm", "lm_head"]
    return out


def hf_extra_modules(spec: ModelSpec) -> list:
    """Modules outside every block that a device map must still name (buffers only)."""
    return [] if spec.arch == "opt" else ["model.rotary_emb"]
