"""Which weight tensors each block of a dense decoder owns, under their Hugging Face names.

Three layouts cover the dense families the planner reads: llama-style (llama, mistral, qwen2,
qwen3: RMSNorm, q/k/v/o and gate/up/down projections), OPT (LayerNorm, learned positions offset
by 2, fc1/fc2) and GPT-2 (LayerNorm, fused ``c_attn``, Conv1D weights stored ``[in, out]``).
Shapes come from the ModelSpec alone, so a checkpoint can be checked before anything is loaded.
Knows nothing about devices, math or plans.
"""

from __future__ import annotations

from hetplan.model import ModelSpec
from hetplan.runtime.backend import TensorSpec


def block_tensors(spec: ModelSpec, kind: str, layer: int | None) -> list[TensorSpec]:
    """The tensors of one block (``kind`` in embed, attn, mlp, head) of ``spec``."""
    table = {"opt": _opt, "gpt2": _gpt2}.get(spec.arch, _llama)
    return table(spec, kind, layer)


FUSED = {"qkv": ("q", "k", "v"), "qkv_bias": ("q_bias", "k_bias", "v_bias"), "gate_up": ("gate", "up"),
         "gate_up_bias": ("gate_bias", "up_bias")}
"""Projections that read the same input, listed consecutively so that one matrix-vector product
over their concatenation replaces several (fewer thread fork/joins per token on a CPU)."""


def _linears(out: list, layers: list, bias: bool) -> None:
    """Weights of ``layers`` ((local, HF module name, shape), ...) back to back, then their biases."""
    for local, name, shape in layers:
        out.append(TensorSpec(local, f"{name}.weight", shape))
    if bias:
        for local, name, shape in layers:
            out.append(TensorSpec(f"{local}_bias", f"{name}.bias", (shape[0],)))


def _linear(out: list, local: str, name: str, shape: tuple, bias: bool) -> None:
    _linears(out, [(local, name, shape)], bias)


def _layernorm(out: list, local: str, name: str, dim: int) -> None:
    out += [TensorSpec(local, f"{name}.weight", (dim,)), TensorSpec(f"{local}_bias", f"{name}.bias", (dim,))]


def _llama(spec: ModelSpec, kind: str, layer: int | None) -> list[TensorSpec]:
    d, hd = spec.hidden, spec.head_dim
    q_dim, kv_dim = spec.n_heads * hd, spec.n_kv_heads * hd
    p = f"model.layers.{layer}"
    out: list[TensorSpec] = []
    if kind == "embed":
        out.append(TensorSpec("tok", "model.embed_tokens.weight", (spec.vocab, d)))
    elif kind == "attn":
        out.append(TensorSpec("norm", f"{p}.input_layernorm.weight", (d,)))
        _linears(out, [(local, f"{p}.self_attn.{local}_proj", (rows, d))
                       for local, rows in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))], spec.attn_bias)
        _linear(out, "o", f"{p}.self_attn.o_proj", (d, q_dim), spec.attn_out_bias)
        if spec.qk_norm:
            out += [TensorSpec("q_norm", f"{p}.self_attn.q_norm.weight", (hd,)),
                    TensorSpec("k_norm", f"{p}.self_attn.k_norm.weight", (hd,))]
    elif kind == "mlp":
        out.append(TensorSpec("norm", f"{p}.post_attention_layernorm.weight", (d,)))
        f = spec.intermediate
        _linears(out, [("gate", f"{p}.mlp.gate_proj", (f, d)), ("up", f"{p}.mlp.up_proj", (f, d))], spec.mlp_bias)
        _linear(out, "down", f"{p}.mlp.down_proj", (d, f), spec.mlp_bias)
    elif kind == "head":
        out.append(TensorSpec("norm", "model.norm.weight", (d,)))
        lm = "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"
        out.append(TensorSpec("lm", lm, (spec.vocab, d)))
    return out


def _opt(spec: ModelSpec, kind: str, layer: int | None) -> list[TensorSpec]:
    d = spec.hidden
    p = f"model.decoder.layers.{layer}"
    out: list[TensorSpec] = []
    if kind == "embed":
        # OPT's learned positions are looked up at position + 2 (two rows reserved upstream).
        out += [TensorSpec("tok", "model.decoder.embed_tokens.weight", (spec.vocab, d)),
                TensorSpec("pos", "model.decoder.embed_positions.weight", (spec.max_positions + 2, d))]
    elif kind == "attn":
        _layernorm(out, "norm", f"{p}.self_attn_layer_norm", d)
        _linears(out, [(local, f"{p}.self_attn.{local}_proj", (d, d)) for local in ("q", "k", "v")], spec.attn_bias)
        _linear(out, "o", f"{p}.self_attn.out_proj", (d, d), spec.attn_out_bias)
    elif kind == "mlp":
        _layernorm(out, "norm", f"{p}.final_layer_norm", d)
        _linear(out, "up", f"{p}.fc1", (spec.intermediate, d), spec.mlp_bias)
        _linear(out, "down", f"{p}.fc2", (d, spec.intermediate), spec.mlp_bias)
    elif kind == "head":
        _layernorm(out, "norm", "model.decoder.final_layer_norm", d)
        lm = "model.decoder.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"
        out.append(TensorSpec("lm", lm, (spec.vocab, d)))
    return out


def _gpt2(spec: ModelSpec, kind: str, layer: int | None) -> list[TensorSpec]:
    """GPT-2's Conv1D layers store weights ``[in, out]``: local names end in ``_t``."""
    d, f = spec.hidden, spec.intermediate
    p = f"transformer.h.{layer}"
    out: list[TensorSpec] = []
    if kind == "embed":
        out += [TensorSpec("tok", "transformer.wte.weight", (spec.vocab, d)),
                TensorSpec("pos", "transformer.wpe.weight", (spec.max_positions, d))]
    elif kind == "attn":
        _layernorm(out, "norm", f"{p}.ln_1", d)
        out += [TensorSpec("qkv_t", f"{p}.attn.c_attn.weight", (d, 3 * d)),
                TensorSpec("qkv_bias", f"{p}.attn.c_attn.bias", (3 * d,)),
                TensorSpec("o_t", f"{p}.attn.c_proj.weight", (d, d)),
                TensorSpec("o_bias", f"{p}.attn.c_proj.bias", (d,))]
    elif kind == "mlp":
        _layernorm(out, "norm", f"{p}.ln_2", d)
        out += [TensorSpec("up_t", f"{p}.mlp.c_fc.weight", (d, f)),
                TensorSpec("up_bias", f"{p}.mlp.c_fc.bias", (f,)),
                TensorSpec("down_t", f"{p}.mlp.c_proj.weight", (f, d)),
                TensorSpec("down_bias", f"{p}.mlp.c_proj.bias", (d,))]
    elif kind == "head":
        _layernorm(out, "norm", "transformer.ln_f", d)
        out.append(TensorSpec("lm", "transformer.wte.weight", (spec.vocab, d)))
    return out
