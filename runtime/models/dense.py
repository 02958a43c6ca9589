"""The dense decoder families in plain torch, one stage at a time: the math behind each task.

llama, mistral, qwen2, qwen3 (RMSNorm, RoPE with default/linear/llama3 scaling, GQA, SwiGLU,
qwen3's per-head q/k norms) and opt, gpt2 (LayerNorm, learned positions, GELU/ReLU MLP, tied
embeddings). Each stage is a function of the block's weights and the activation values it reads
(see ``hetplan.runtime.backend`` for the contract). Knows nothing about plans, queues or tiers:
it computes on whatever device its tensors are on.

Shapes: B batch, S new tokens per sequence, T cached tokens, D hidden, H query heads, KVH key/value
heads, hd head dim, G = H / KVH queries per key/value head, V vocab.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from hetplan.runtime.kernels import native, quant
from hetplan.runtime.kernels.linear import linear, linear_t
from hetplan.errors import HetplanError
from hetplan.model import ModelSpec
from hetplan.runtime import kv_cache
from hetplan.runtime.lookup import lookup
from hetplan.runtime.models import dense_layout
from hetplan.runtime.backend import DEFAULT_MAX_TOKENS, StageCall, TensorSpec

_ACTS = {"silu": F.silu, "swish": F.silu, "relu": F.relu, "gelu": F.gelu,
         "gelu_new": lambda t: F.gelu(t, approximate="tanh"),
         "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}

_READS = {"embed": ("ids",), "attn_in": ("x",), "attn_core": ("q", "k", "v"), "attn_out": ("x", "o"),
          "mlp": ("x",), "head": ("x",)}
_WRITES = {"embed": ("x",), "attn_in": ("q", "k", "v"), "attn_core": ("o",), "attn_out": ("x",),
           "mlp": ("x",), "head": ("logits",)}


def inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Rotary inverse frequencies, fp32 [hd/2]: theta^(-2i/hd), rescaled per ``rope_scaling``
    (``linear``: / factor; ``llama3``: long wavelengths / factor, a smooth blend in between;
    ``gguf_rope_freqs``: each divided by its factor from the GGUF file, as llama.cpp applies them)."""
    hd = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    sc = spec.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if sc.get("partial_rotary_factor", 1.0) != 1.0:
        raise HetplanError(f"model {spec.name!r}: partial rotary embeddings are not supported by the runtime")
    if kind == "linear":
        return inv / sc["factor"]
    if kind == "gguf_rope_freqs":
        factors = torch.tensor(sc["freq_factors"], dtype=torch.float32)
        if factors.shape != inv.shape:
            raise HetplanError(f"model {spec.name!r}: {factors.numel()} rope frequency factors for "
                               f"{inv.numel()} rotary frequencies; recompile the plan from the model file")
        return inv / factors
    if kind == "llama3":
        factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, blended, scaled)
    raise HetplanError(f"model {spec.name!r}: rope scaling {kind!r} is not supported by the runtime "
                       f"(supported: default, linear, llama3, gguf_rope_freqs)")


class DenseBackend:
    """Executes embed, attn_in, attn_core, attn_out, mlp and head stages of a dense family."""

    kinds = frozenset(_READS)

    def __init__(self, spec: ModelSpec):
        if spec.act not in _ACTS:
            raise HetplanError(f"model {spec.name!r}: activation {spec.act!r} is not supported by the "
                               f"runtime (supported: {', '.join(sorted(_ACTS))})")
        self.spec = spec
        self.act = _ACTS[spec.act]
        # The dtype stages compute in: the weights' own, or (quantised weights) the one the run
        # dequantises into, set before ``setup``.
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.weight_dtype, torch.float32)
        # What the lookup tables hold, whatever dtype they are read in (``quant.TABLE_DTYPE``).
        self.table_dtype = quant.TABLE_DTYPE if quant.is_quantised(spec.weight_dtype) else self.dtype
        self.llama_like = spec.arch not in ("opt", "gpt2")
        self.pos_offset = 2 if spec.arch == "opt" else 0
        # OPT scales q before attention (and attends with scale 1); the others scale in attention.
        self.q_scale = spec.head_dim ** -0.5 if spec.arch == "opt" else None
        self.rope_inv_freq = inv_freq(spec) if spec.pos == "rope" else None
        self._tables = {}  # device -> (cos [T, hd], sin [T, hd]) in the compute dtype

    # -- the backend interface ---------------------------------------------------------------
    def block_tensors(self, block: str, kind: str, layer: int | None) -> list[TensorSpec]:
        return dense_layout.block_tensors(self.spec, kind, layer)

    def fused(self) -> dict[str, tuple[str, ...]]:
        return dense_layout.FUSED

    def reads(self, kind: str) -> tuple[str, ...]:
        return _READS[kind]

    def writes(self, kind: str) -> tuple[str, ...]:
        return _WRITES[kind]

    def kv_shapes(self, batch: int, max_tokens: int) -> dict[str, tuple]:
        shape = (batch, max_tokens, self.spec.n_kv_heads, self.spec.head_dim)
        return {"k": shape, "v": shape}

    def setup(self, device: torch.device, max_tokens: int | None = None) -> None:
        if self.rope_inv_freq is None or device in self._tables:
            return
        max_tokens = max_tokens or min(self.spec.max_positions, DEFAULT_MAX_TOKENS)
        t = torch.arange(max_tokens, dtype=torch.int64).float()
        freqs = torch.outer(t, self.rope_inv_freq)           # [T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)               # [T, hd]
        self._tables[device] = (emb.cos().to(device, self.dtype), emb.sin().to(device, self.dtype))

    tokenwise = frozenset({"attn_in", "attn_out", "mlp"})
    """Stages whose every position is computed from the same position of their inputs: in a
    chunked prefill, run chunk by chunk on slices of the sequence axis (dim 1)."""

    def run(self, call: StageCall) -> dict[str, torch.Tensor]:
        fn = getattr(self, f"_{call.kind}")
        if len(call.step.chunks()) > 1:
            if call.kind == "attn_core":
                return self._attn_core_chunked(call)
            if call.kind in self.tokenwise:
                return by_chunks(fn, call)
        return fn(call)

    # -- stages ------------------------------------------------------------------------------
    def _embed(self, c: StageCall) -> dict:
        ids = c.inputs["ids"]                                  # [B, S] int64
        x = lookup(c.weights["tok"], ids).to(self.table_dtype).to(self.dtype)  # [B, S, D]
        if "pos" in c.weights:
            lo = c.step.start + self.pos_offset
            x += c.weights["pos"][lo:lo + c.step.new_tokens].to(self.table_dtype)  # [S, D] broadcast over B
        return {"x": x}

    def _attn_in(self, c: StageCall) -> dict:
        w, s, x = c.weights, self.spec, c.inputs["x"]
        b, n = x.shape[0], x.shape[1]
        h = self._norm(x, w)
        roped = False   # q and k already rotated, in place in the fused projection
        if "qkv_t" in w:
            q, k, v = linear_t(h.view(b * n, -1), w["qkv_t"]).add_(w["qkv_bias"]).split(s.hidden, dim=-1)
        elif "qkv" in w:
            kv_dim = s.n_kv_heads * s.head_dim
            qkv = linear(h, w["qkv"], w.get("qkv_bias"))
            roped = self.rope_inv_freq is not None and not s.qk_norm and self._rope_in_place(qkv, c)
            q, k, v = qkv.split([s.n_heads * s.head_dim, kv_dim, kv_dim], -1)
        else:
            q, k, v = (linear(h, w[p], w.get(f"{p}_bias")) for p in ("q", "k", "v"))
        q = q.reshape(b, n, s.n_heads, s.head_dim)             # [B, S, H, hd]
        k = k.reshape(b, n, s.n_kv_heads, s.head_dim)          # [B, S, KVH, hd]
        v = v.reshape(b, n, s.n_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = _rms_norm(q, w["q_norm"], s.norm_eps), _rms_norm(k, w["k_norm"], s.norm_eps)
        if self.rope_inv_freq is not None and not roped:
            cos, sin = self._tables[c.device]
            cos = cos[c.step.start:c.step.start + n].view(1, n, 1, -1)
            sin = sin[c.step.start:c.step.start + n].view(1, n, 1, -1)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        return {"q": q, "k": k, "v": v}

    def _rope_in_place(self, qkv: torch.Tensor, c: StageCall) -> bool:
        """Rotate the q and k heads of a fused projection [B, S, (H + 2 KVH) hd] in place with the
        native kernel (one call for what ``_rope`` does in ~14 torch ops); False where it cannot
        (not on the CPU, no native kernel, a layout it does not take): ``_rope`` then runs."""
        mod = native.module() if qkv.device.type == "cpu" and qkv.is_contiguous() else None
        cos, sin = self._tables[c.device]
        if mod is None or cos.dtype != qkv.dtype:
            return False
        s, n = self.spec, qkv.shape[1]
        mod.rope_(qkv.view(-1, qkv.shape[-1]), cos, sin, n, c.step.start, s.n_heads + s.n_kv_heads, s.head_dim)
        return True

    def _attn_core(self, c: StageCall) -> dict:
        q, k, v = c.inputs["q"], c.inputs["k"], c.inputs["v"]
        start, n = c.step.start, c.step.new_tokens
        if c.kv is not None:
            kv_cache.write(c.kv["k"], start, k)
            kv_cache.write(c.kv["v"], start, v)
            if start:  # after the prompt, attend over the cache where it lies
                if not _whole_views(c.kv, q.dtype):
                    return {"o": cached_attention(q, c.kv, start + n, start, self._scale())}
                k, v = kv_cache.read(c.kv["k"], start + n, q.dtype), kv_cache.read(c.kv["v"], start + n, q.dtype)
        return {"o": attention(q, k, v, start, scale=1.0 if self.q_scale is not None else None)}

    def _scale(self) -> float:
        """The softmax scale: 1 when q was scaled in ``attn_in``, else head_dim^-1/2."""
        return 1.0 if self.q_scale is not None else self.spec.head_dim ** -0.5

    def _attn_core_chunked(self, c: StageCall) -> dict:
        """Chunk i (positions s..s+n-1) writes its K/V to the cache and attends over the prefix
        [0, s + n), causally offset by s; its output overwrites its own queries (no later chunk
        reads them; q is read by this stage alone), so [B, S, H*hd] is filled in q's storage."""
        q, k, v = c.inputs["q"], c.inputs["k"], c.inputs["v"]
        start, (b, total, h, hd) = c.step.start, q.shape
        scale = 1.0 if self.q_scale is not None else None
        o = q.view(b, total, h * hd) if q.is_contiguous() else q.new_empty((b, total, h * hd))
        for s, n in c.step.chunks():
            e = s + n
            if c.kv is not None:
                kv_cache.write(c.kv["k"], start + s, k[:, s:e])
                kv_cache.write(c.kv["v"], start + s, v[:, s:e])
            if start and not _whole_views(c.kv, q.dtype):
                o[:, s:e] = cached_attention(q[:, s:e], c.kv, start + e, start + s, self._scale())
                continue
            if start:
                kk, vv = kv_cache.read(c.kv["k"], start + e, q.dtype), kv_cache.read(c.kv["v"], start + e, q.dtype)
            else:
                kk, vv = k[:, :e], v[:, :e]
            o[:, s:e] = attention(q[:, s:e], kk, vv, start + s, scale=scale)
        return {"o": o}

    def _attn_out(self, c: StageCall) -> dict:
        w, o, x = c.weights, c.inputs["o"], c.inputs["x"]
        y = linear_t(o, w["o_t"]) if "o_t" in w else linear(o, w["o"])
        if "o_bias" in w:
            y += w["o_bias"]
        return {"x": y.add_(x)}

    def _mlp(self, c: StageCall) -> dict:
        w, x = c.weights, c.inputs["x"]
        h = self._norm(x, w)
        if "gate_up" in w:
            gu = linear(h, w["gate_up"], w.get("gate_up_bias"))
            mod = native.module() if gu.device.type == "cpu" and gu.is_contiguous() and self.act is F.silu else None
            if mod is not None:   # one call for chunk, silu and mul
                y = linear(mod.silu_mul(gu), w["down"], w.get("down_bias"))
            else:
                gate, up = gu.chunk(2, dim=-1)
                y = linear(self.act(gate).mul_(up), w["down"], w.get("down_bias"))
        elif "gate" in w:
            y = self.act(linear(h, w["gate"], w.get("gate_bias"))).mul_(linear(h, w["up"], w.get("up_bias")))
            y = linear(y, w["down"], w.get("down_bias"))
        elif "up_t" in w:
            y = linear_t(self.act(linear_t(h, w["up_t"]).add_(w["up_bias"])), w["down_t"]).add_(w["down_bias"])
        else:
            y = linear(self.act(linear(h, w["up"], w.get("up_bias"))), w["down"], w.get("down_bias"))
        return {"x": y.add_(x)}

    def _head(self, c: StageCall) -> dict:
        x = c.inputs["x"]
        if not c.step.all_logits:
            x = x[:, -1]                                       # [B, D]: only the last position
        logits = linear(self._norm(x, c.weights), c.weights["lm"])
        return {"logits": logits.float()}                      # [B, V] or [B, S, V]

    def _norm(self, x: torch.Tensor, w) -> torch.Tensor:
        if self.spec.norm == "rmsnorm":
            return _rms_norm(x, w["norm"], self.spec.norm_eps)
        return F.layer_norm(x, (x.shape[-1],), w["norm"], w["norm_bias"], self.spec.norm_eps)


def by_chunks(fn, c: StageCall) -> dict:
    """Run the token-wise stage ``fn`` once per chunk of ``c.step`` on its inputs' slices
    [:, s:s+n] (sequence axis 1); each output is allocated once at full length and filled."""
    out = {}
    for s, n in c.step.chunks():
        step = dataclasses.replace(c.step, start=c.step.start + s, new_tokens=n, chunk=0)
        part = fn(dataclasses.replace(c, inputs={k: t[:, s:s + n] for k, t in c.inputs.items()}, step=step))
        for k, t in part.items():
            if k not in out:
                out[k] = t.new_empty((t.shape[0], c.step.new_tokens) + tuple(t.shape[2:]))
            out[k][:, s:s + n] = t
        del part
    return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), the mean taken in fp32 over the last dim (on the CPU
    in one native call where the kernel is built: the same roundings, see ``smallops.h``)."""
    if x.device.type == "cpu" and x.is_contiguous() and weight.dtype == x.dtype and weight.is_contiguous():
        mod = native.module()
        if mod is not None:
            return mod.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half([a, b]) = [-b, a] over the last dim."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


SMALL_ATTENTION_ELEMS = 1 << 18
"""Decode attention over at most this many cached key elements runs on one CPU thread: it takes
microseconds, less than forking and joining a team of threads (far less on a busy machine)."""


@contextmanager
def _one_cpu_thread(active: bool):
    if not active:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)   # this thread's setting only
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _whole_views(kv, dtype) -> bool:
    """Whether both cache values read as views in ``dtype`` (then one attention kernel call)."""
    return kv_cache.in_place(kv["k"], dtype) and kv_cache.in_place(kv["v"], dtype)


def cached_attention(q: torch.Tensor, kv, end: int, start: int, scale: float) -> torch.Tensor:
    """q [B, S, H, hd] (positions start..start+S-1) over cache positions [0, end), read block by
    block where it lies (``kv_cache.attend``; a quantised or differently typed cache) -> [B, S, H*hd]."""
    b, n, h, hd = q.shape
    kvh = kv["k"].shape[2]
    rows = q.transpose(1, 2).reshape(b, kvh, (h // kvh) * n, hd)             # [B, KVH, G*S, hd]
    o = kv_cache.attend((rows,), (kv["k"],), kv["v"], end, start, n, scale)   # [B, KVH, G*S, hd]
    return o.reshape(b, h, n, hd).transpose(1, 2).reshape(b, n, h * hd)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float | None) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v over T keys; q [B, S, H, hd] holds positions
    start..start+S-1, k/v [B, T, KVH, hd] positions 0..T-1; returns [B, S, H*hd]."""
    b, n, h, hd = q.shape
    kvh = k.shape[2]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)              # [B, KVH, T, hd]
    if n == 1:
        mod = native.module() if q.device.type == "cpu" and q.dtype == k.dtype == v.dtype else None
        if mod is not None and all(t.stride(3) == 1 and t.stride(2) == hd for t in (q, k, v)):
            # one call for the step's attention over the cache where it lies (smallops.h)
            return mod.decode_attention(q, k, v, hd ** -0.5 if scale is None else scale)
        # One query per sequence sees every cached key: the G query heads sharing a key/value
        # head ride the sequence axis, so no key/value head is ever repeated.
        with _one_cpu_thread(q.device.type == "cpu" and k.numel() <= SMALL_ATTENTION_ELEMS):
            o = F.scaled_dot_product_attention(q.reshape(b, kvh, h // kvh, hd), kt, vt, scale=scale)
        return o.reshape(b, 1, h * hd)
    mask = None
    if start:
        t = k.shape[1]
        mask = torch.ones(n, t, dtype=torch.bool, device=q.device).tril(diagonal=start)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kt, vt, attn_mask=mask, is_causal=not start,
                                       scale=scale, enable_gqa=kvh != h)
    return o.transpose(1, 2).reshape(b, n, h * hd)             # [B, S, H*hd]
