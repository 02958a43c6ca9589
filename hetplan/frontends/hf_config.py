"""Hugging Face ``config.json`` -> ModelSpec, for the families hetplan plans and runs.

Knows the key names each family's config uses and nothing about costs or devices. Every key it
reads is first checked against ``hetplan.schema.config`` (types, ranges, typos of read keys);
a key a family needs and the file lacks is an error that names the key and the file.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from hetplan.errors import HetplanError
from hetplan.files import parse_json, read_text
from hetplan.model import FAMILIES, ModelSpec
from hetplan.schema.config import HfConfig, near_miss, typo_message
from hetplan.schema.errors import looks_like, schema_error
from hetplan.schema.positions import json_line

_ALIASES = {"mistral": "mistral", "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "opt": "opt",
            "gpt2": "gpt2", "mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3",
            "deepseek_v2": "deepseek_v3", "deepseek_r1": "deepseek_v3"}


DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""The checkpoint dtypes ``torch_dtype`` may name (absent: fp16)."""


def load_config_file(path: str | Path) -> dict:
    """Read a config.json (or a directory holding one) into a dict, with readable errors."""
    return read_config(path)[0]


def read_config(path: str | Path) -> tuple[dict, str, Path]:
    """A config.json (or a directory holding one) -> (its dict, its text, the file's path)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    text = read_text(p, "file (expected a model preset name, a config.json, or a directory holding one)",
                     "a config.json")
    cfg = parse_json(text, p)
    if not isinstance(cfg, dict):
        raise HetplanError(f"{p}: expected a JSON object at the top level")
    return cfg, text, p


def spec_from_config(cfg: dict, name: str | None = None, source: str = "config.json",
                     weight_dtype: str | None = None, kv_dtype: str | None = None,
                     text: str | None = None) -> ModelSpec:
    """Build a ModelSpec from a parsed HF config dict (``text``, the file's JSON, gives errors
    their line)."""
    if not isinstance(cfg, dict):
        raise HetplanError(f"{source}: expected a JSON object at the top level")
    typo = near_miss(cfg)
    if typo:
        line = json_line(text, (typo[0],)) if text is not None else None
        raise HetplanError(f"{source}{f':{line}' if line else ''}: {typo_message(*typo)}")
    if "model_type" not in cfg and looks_like(cfg):
        raise HetplanError(f"{source}: no model_type{looks_like(cfg)}; MODEL is a config.json, a preset, an "
                           f".onnx or a .gguf file")
    try:
        HfConfig.model_validate(cfg)
    except ValidationError as e:
        raise schema_error(e, HfConfig, source, text, line_of=json_line) from None
    mt = cfg["model_type"]
    arch = _ALIASES.get(mt)
    if arch is None:
        raise HetplanError(f"{source}: model_type {mt!r} is not supported; supported: "
                           f"{', '.join(sorted(_ALIASES))}")

    def get(key, default=...):
        """``cfg[key]`` (its type and range checked by the schema), or ``default`` when absent."""
        if key not in cfg or cfg[key] is None:
            if default is ...:
                raise HetplanError(f"{source}: missing key {key!r} (needed for model_type {mt!r})")
            return default
        return cfg[key]

    name = name or cfg.get("_name_or_path") or mt
    native = _dtype_name(cfg.get("torch_dtype") or cfg.get("dtype"), source)
    # the KV cache keeps the checkpoint's dtype when only the weights are requantised
    kw = dict(name=name, arch=arch, weight_dtype=weight_dtype or native, kv_dtype=kv_dtype or native)
    builder = {"opt": _opt, "gpt2": _gpt2}.get(arch, _llama_like)
    try:
        kw.update(builder(get, cfg, arch))
        return ModelSpec(**kw)
    except HetplanError as e:
        msg = str(e)  # errors from ``get`` already name the source
        raise HetplanError(msg if msg.startswith(f"{source}: ") else f"{source}: {msg}") from None


def _dtype_name(torch_dtype, source: str = "config.json") -> str:
    if torch_dtype is None:
        return "fp16"
    name = str(torch_dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise HetplanError(f"{source}: torch_dtype {torch_dtype!r} is not a checkpoint dtype hetplan reads; "
                           f"accepted: {', '.join(DTYPES)}")
    return DTYPES[name]


def _rope(get, cfg) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def _llama_like(get, cfg, arch) -> dict:
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if hidden % heads and "head_dim" not in cfg:
        raise HetplanError(f"num_attention_heads: {heads} does not divide hidden_size {hidden}")
    theta, scaling = _rope(get, cfg)
    kw = dict(n_layers=get("num_hidden_layers"), hidden=hidden, intermediate=get("intermediate_size"),
              n_heads=heads, n_kv_heads=get("num_key_value_heads", heads),
              head_dim=get("head_dim", hidden // heads), vocab=get("vocab_size"),
              max_positions=get("max_position_embeddings", 4096),
              tie_embeddings=bool(get("tie_word_embeddings", False)),
              norm="rmsnorm", norm_eps=float(get("rms_norm_eps", 1e-6)),
              act=get("hidden_act", "silu"), gated_mlp=True, pos="rope",
              rope_theta=theta, rope_scaling=scaling,
              attn_bias=bool(get("attention_bias", arch == "qwen2")),
              attn_out_bias=bool(get("attention_bias", False)),
              mlp_bias=bool(get("mlp_bias", False)), qk_norm=arch in ("qwen3", "qwen3_moe"))
    if arch == "mixtral":
        kw.update(n_experts=get("num_local_experts"), experts_per_token=get("num_experts_per_tok"),
                  moe_intermediate=get("intermediate_size"))
    elif arch == "qwen3_moe":
        if cfg.get("mlp_only_layers") or get("decoder_sparse_step", 1) != 1:
            raise HetplanError("mlp_only_layers/decoder_sparse_step: interleaved dense layers are "
                               "not supported for qwen3_moe")
        # transformers 5 writes the expert count of a saved qwen3_moe config as num_local_experts
        n_experts = get("num_experts") if "num_experts" in cfg else get("num_local_experts")
        kw.update(n_experts=n_experts, experts_per_token=get("num_experts_per_tok"),
                  moe_intermediate=get("moe_intermediate_size"),
                  extra={"norm_topk_prob": bool(get("norm_topk_prob", True))})
    elif arch == "deepseek_v3":
        nope, rope_d = get("qk_nope_head_dim"), get("qk_rope_head_dim")
        kw.update(n_kv_heads=heads, head_dim=nope + rope_d,
                  n_experts=get("n_routed_experts"), experts_per_token=get("num_experts_per_tok"),
                  moe_intermediate=get("moe_intermediate_size"),
                  n_shared_experts=get("n_shared_experts", 0),
                  first_dense_layers=get("first_k_dense_replace", 0),
                  q_lora_rank=get("q_lora_rank", 0), kv_lora_rank=get("kv_lora_rank"),
                  qk_rope_head_dim=rope_d, qk_nope_head_dim=nope, v_head_dim=get("v_head_dim"),
                  attn_bias=False, attn_out_bias=False, qk_norm=False,
                  extra={k: cfg[k] for k in ("n_group", "topk_group", "routed_scaling_factor",
                                             "norm_topk_prob", "topk_method", "scoring_func",
                                             "rope_interleave")
                         if k in cfg})
    return kw


def _opt(get, cfg, arch) -> dict:
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if hidden % heads:
        raise HetplanError(f"num_attention_heads: {heads} does not divide hidden_size {hidden}")
    proj = get("word_embed_proj_dim", hidden)
    if proj != hidden or not get("do_layer_norm_before", True):
        raise HetplanError("word_embed_proj_dim/do_layer_norm_before: only pre-norm OPT models with "
                           "word_embed_proj_dim == hidden_size (opt-125m, 1.3b and up) are supported")
    return dict(n_layers=get("num_hidden_layers"), hidden=hidden, intermediate=get("ffn_dim"),
                n_heads=heads, n_kv_heads=heads, head_dim=hidden // heads, vocab=get("vocab_size"),
                max_positions=get("max_position_embeddings", 2048),
                tie_embeddings=bool(get("tie_word_embeddings", True)), norm="layernorm",
                norm_eps=1e-5, act=get("activation_function", "relu"), gated_mlp=False,
                pos="learned", attn_bias=bool(get("enable_bias", True)),
                attn_out_bias=bool(get("enable_bias", True)), mlp_bias=bool(get("enable_bias", True)))


def _gpt2(get, cfg, arch) -> dict:
    hidden, heads = get("n_embd"), get("n_head")
    if hidden % heads:
        raise HetplanError(f"n_head: {heads} does not divide n_embd {hidden}")
    return dict(n_layers=get("n_layer"), hidden=hidden, intermediate=get("n_inner", 4 * hidden),
                n_heads=heads, n_kv_heads=heads, head_dim=hidden // heads, vocab=get("vocab_size"),
                max_positions=get("n_positions", 1024), tie_embeddings=True, norm="layernorm",
                norm_eps=float(get("layer_norm_epsilon", 1e-5)),
                act=get("activation_function", "gelu_new"), gated_mlp=False, pos="learned",
                attn_bias=True, attn_out_bias=True, mlp_bias=True)


assert set(_ALIASES.values()) <= set(FAMILIES)
