"""ModelSpec: the shape of a decoder-only transformer, and nothing about where it runs.

A spec is built from a Hugging Face ``config.json`` (``hetplan.frontends.hf_config``), a preset name
(``hetplan.presets.models``), an ONNX graph or a GGUF file (``hetplan.frontends.gguf``, whose
mixed tensor types price each block: ``block_bytes``). Derived sizes (parameters per block, KV bytes per
token) are properties, never stored. Index names: ``l`` is a layer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

from hetplan.canonical import rounded
from hetplan.dtypes import QUANTISED, bytes_per_element, check_dtype, packed_bytes, row_bytes
from hetplan.errors import HetplanError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "opt", "gpt2", "mixtral", "qwen3_moe", "deepseek_v3")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    """Human name (preset name or the config's ``_name_or_path``)."""
    arch: str
    """Family, one of ``FAMILIES``; selects the runtime implementation."""
    n_layers: int
    hidden: int
    intermediate: int
    """Dense MLP width (SwiGLU: per gate/up projection; GELU/ReLU: the single hidden width)."""
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    tie_embeddings: bool = False
    norm: str = "rmsnorm"
    """``rmsnorm`` or ``layernorm``."""
    norm_eps: float = 1e-6
    act: str = "silu"
    gated_mlp: bool = True
    """SwiGLU-style gate+up+down (True) or up+down (False)."""
    pos: str = "rope"
    """``rope`` or ``learned`` (absolute position embeddings, opt/gpt2)."""
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attn_bias: bool = False
    """Bias on q/k/v projections (qwen2, opt, gpt2)."""
    attn_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (qwen3)."""
    # Mixture of experts (0 experts = dense).
    n_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    n_shared_experts: int = 0
    first_dense_layers: int = 0
    """Leading layers with a dense MLP (deepseek ``first_k_dense_replace``)."""
    # Multi-head latent attention (deepseek); 0 = standard attention.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    weight_dtype: str = "fp16"
    kv_dtype: str = "fp16"
    extra: dict = field(default_factory=dict)
    """Family-specific settings the runtime needs but costs do not (e.g. opt's
    ``word_embed_proj_dim``); part of the fingerprint."""
    block_bytes: dict = field(default_factory=dict)
    """Bytes each block's weights are held in, when a file prices its tensors one by one (a
    GGUF file's mixed types: ``hetplan.frontends.gguf.held``): {block name: bytes, "expert":
    the largest routed expert}. Empty: derived from the shapes and ``weight_dtype``."""

    def __post_init__(self):
        if self.arch not in FAMILIES:
            raise HetplanError(f"model_type: unsupported architecture {self.arch!r}; "
                               f"supported: {', '.join(FAMILIES)}")
        for key in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab", "max_positions"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                raise HetplanError(f"{key}: must be a positive integer, got {getattr(self, key)!r}")
        if self.n_heads % self.n_kv_heads:
            raise HetplanError(f"num_key_value_heads: {self.n_kv_heads} does not divide "
                               f"num_attention_heads {self.n_heads}")
        if self.is_moe and not 0 < self.experts_per_token <= self.n_experts:
            raise HetplanError(f"num_experts_per_tok: must be in 1..{self.n_experts}, "
                               f"got {self.experts_per_token}")
        check_dtype(self.weight_dtype, "weight_dtype")
        check_dtype(self.kv_dtype, "kv_dtype")

    # -- derived ---------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, l: int) -> bool:
        return self.is_moe and l >= self.first_dense_layers

    @property
    def weight_bytes_per_param(self) -> float:
        return bytes_per_element(self.weight_dtype)

    @property
    def kv_bytes_per_elem(self) -> float:
        return bytes_per_element(self.kv_dtype)

    @property
    def q_dim(self) -> int:
        if self.is_mla:
            return self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.n_heads * self.head_dim

    @property
    def attn_out_dim(self) -> int:
        return self.n_heads * (self.v_head_dim if self.is_mla else self.head_dim)

    def attn_params(self) -> int:
        """Weights of one attention block: projections, biases, norms."""
        d = self.hidden
        if self.is_mla:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.n_heads * qk_head
                 if self.q_lora_rank else d * self.n_heads * qk_head)
            kv = (d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                  + self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim))
            return q + kv + self.attn_out_dim * d + d
        kv_dim = self.n_kv_heads * self.head_dim
        p = d * self.q_dim + 2 * d * kv_dim + self.attn_out_dim * d
        if self.attn_bias:
            p += self.q_dim + 2 * kv_dim
        if self.attn_out_bias:
            p += d
        if self.qk_norm:
            p += 2 * self.head_dim
        return p + d * (2 if self.norm == "layernorm" else 1)

    def dense_mlp_params(self) -> int:
        d, f = self.hidden, self.intermediate
        p = (3 if self.gated_mlp else 2) * d * f
        if self.mlp_bias:
            p += (2 if self.gated_mlp else 1) * f + d
        return p + d * (2 if self.norm == "layernorm" else 1)

    def expert_params(self) -> int:
        """One routed expert (SwiGLU of width ``moe_intermediate``)."""
        return 3 * self.hidden * self.moe_intermediate

    def moe_shared_params(self) -> int:
        """Router, shared experts and the layer norm of an MoE layer."""
        return (self.hidden * self.n_experts + self.n_shared_experts * self.expert_params()
                + self.hidden)

    def mlp_params(self, l: int) -> int:
        """All weights of layer ``l``'s MLP block (every expert of an MoE layer)."""
        if self.is_moe_layer(l):
            return self.moe_shared_params() + self.n_experts * self.expert_params()
        return self.dense_mlp_params()

    def mlp_active_params(self, l: int) -> int:
        """Weights one token multiplies with in layer ``l``'s MLP block."""
        if self.is_moe_layer(l):
            return self.moe_shared_params() + self.experts_per_token * self.expert_params()
        return self.dense_mlp_params()

    def linear_shapes(self, kind: str) -> list:
        """[rows, cols] of each linear weight of a block of ``kind`` (attn, mlp, moe, head;
        an MoE block's routed experts last, three per expert), as the runtime stores them."""
        d = self.hidden
        if kind == "attn" and self.is_mla:
            qk, h = self.qk_nope_head_dim + self.qk_rope_head_dim, self.n_heads
            q = ([(self.q_lora_rank, d), (h * qk, self.q_lora_rank)] if self.q_lora_rank else [(h * qk, d)])
            return q + [(self.kv_lora_rank + self.qk_rope_head_dim, d),
                        (h * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank), (d, self.attn_out_dim)]
        if kind == "attn":
            kv = self.n_kv_heads * self.head_dim
            return [(self.q_dim, d), (kv, d), (kv, d), (d, self.attn_out_dim)]
        if kind == "mlp":
            f = self.intermediate
            return [(f, d)] * (2 if self.gated_mlp else 1) + [(d, f)]
        if kind == "moe":
            expert = [(self.moe_intermediate, d)] * 2 + [(d, self.moe_intermediate)]
            shared = [(self.n_shared_experts * self.moe_intermediate, d)] * 2 + [
                (d, self.n_shared_experts * self.moe_intermediate)] if self.n_shared_experts else []
            return [(self.n_experts, d)] + shared + expert * self.n_experts
        if kind == "head":
            return [(self.vocab, d)]
        return []

    def block_weight_bytes(self, kind: str, layer: int | None = None) -> float:
        """Bytes of a block's weights as the runtime holds them: params * bytes per element; in
        a quantised dtype each linear packed (``dtypes.packed_bytes``) and the norms and biases
        at fp32 (the widest compute dtype). deepseek_v3 MoE layers add the router's score
        correction bias (E values, a buffer rather than a parameter). A priced file's
        ``block_bytes`` override all of this."""
        name = kind if layer is None else f"{'moe' if kind in ('mlp', 'moe') and self.is_moe_layer(layer) else kind}_{layer}"
        if name in self.block_bytes:
            return float(self.block_bytes[name])
        params = {"attn": self.attn_params, "head": self.head_params}.get(kind)
        params = params() if params else self.mlp_params(layer)
        kind = "moe" if kind in ("mlp", "moe") and self.is_moe_layer(layer) else kind
        extra = self.n_experts if kind == "moe" and self.arch == "deepseek_v3" else 0
        if self.weight_dtype not in QUANTISED:
            return (params + extra) * self.weight_bytes_per_param
        shapes = Counter(self.linear_shapes(kind))   # an MoE block: 3 shapes, 3 x n_experts linears
        vectors = params - sum(n * r * c for (r, c), n in shapes.items())
        return sum(n * packed_bytes(self.weight_dtype, r, c) for (r, c), n in shapes.items()) + 4.0 * (vectors + extra)

    def expert_bytes(self) -> float:
        """Bytes of one routed expert's weights as the runtime holds them."""
        if "expert" in self.block_bytes:
            return float(self.block_bytes["expert"])
        if self.weight_dtype not in QUANTISED:
            return self.expert_params() * self.weight_bytes_per_param
        return sum(packed_bytes(self.weight_dtype, r, c) for r, c in self.linear_shapes("moe")[-3:])

    def expert_read_bytes(self) -> float:
        """Bytes a stage reads to compute with one routed expert: its held bytes when a file
        prices it tensor by tensor (``block_bytes["expert"]``, a GGUF file's mixed types: the
        largest layer's), else its parameters at ``weight_bytes_per_param``."""
        if "expert" in self.block_bytes:
            return float(self.block_bytes["expert"])
        return self.expert_params() * self.weight_bytes_per_param

    def embed_params(self) -> int:
        p = self.vocab * self.hidden
        if self.pos == "learned":
            # OPT's position table has 2 extra rows: positions are looked up at index pos + 2.
            p += (self.max_positions + (2 if self.arch == "opt" else 0)) * self.hidden
        return p

    def head_params(self) -> int:
        """lm_head and the final norm; a tied head still costs its bytes where it computes."""
        return self.vocab * self.hidden + self.hidden * (2 if self.norm == "layernorm" else 1)

    def total_params(self) -> int:
        p = self.embed_params() + self.head_params()
        if self.tie_embeddings:
            p -= self.vocab * self.hidden
        return p + sum(self.attn_params() + self.mlp_params(l) for l in range(self.n_layers))

    def kv_elems_per_token(self) -> int:
        """KV-cache elements per token per layer: 2 * kv_heads * head_dim, or MLA's latent."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.n_kv_heads * self.head_dim

    def kv_rows(self) -> tuple:
        """Values per row of what a KV cache stores per token and layer: K and V
        (kv_heads * head_dim each), or MLA's latent and rope key."""
        if self.is_mla:
            return (self.kv_lora_rank, self.qk_rope_head_dim)
        return (self.n_kv_heads * self.head_dim,) * 2

    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes per token per layer, in the KV dtype (a quantised one stores each row
        on its own: ``dtypes.row_bytes``)."""
        return sum(row_bytes(self.kv_dtype, n) for n in self.kv_rows())

    def with_dtypes(self, weight_dtype: str | None = None, kv_dtype: str | None = None) -> "ModelSpec":
        """The spec in other dtypes; weights in another dtype than a priced file's are priced
        from the shapes (``block_bytes`` dropped)."""
        weight_dtype = weight_dtype or self.weight_dtype
        blocks = self.block_bytes if weight_dtype == self.weight_dtype else {}
        return dataclasses.replace(self, weight_dtype=weight_dtype, kv_dtype=kv_dtype or self.kv_dtype,
                                   block_bytes=blocks)

    # -- serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = self._fields()
        d["fingerprint"] = self.fingerprint()
        return d

    def _fields(self) -> dict:
        """Every field, but ``block_bytes`` only where a file priced the blocks (so that a spec
        of any other source reads, and fingerprints, as it did before the field existed)."""
        d = dataclasses.asdict(self)
        if not d["block_bytes"]:
            del d["block_bytes"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names - {"fingerprint"}
        if unknown:
            raise HetplanError(f"model: unknown keys {sorted(unknown)}")
        spec = cls(**{k: v for k, v in d.items() if k in names})
        if "fingerprint" in d and d["fingerprint"] != spec.fingerprint():
            raise HetplanError("model.fingerprint does not match the model's fields: the plan was "
                               "edited or truncated; recompile it with `hetplan compile`")
        return spec

    def fingerprint(self) -> str:
        """sha256 over every shape-determining field (16 hex digits)."""
        d = rounded(self._fields())
        d.pop("name")
        blob = json.dumps(d, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
