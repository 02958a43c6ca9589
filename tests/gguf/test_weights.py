"""`hetplan exec --weights model.gguf` holds what the file holds: every tensor, placed by the
runtime, against ``gguf.quants.dequantize`` of the same file.

Q8_0, Q4_0 (repacked) and F32/F16/BF16 tensors are held exactly. The two conversions are held
within bounds derived from the formats (``hetplan.frontends.gguf.held``), computed here from
gguf's own dequantised values:

- Q4_K -> q4_k_m rounds each sub-block scale s = d * sc_j to fp16; with q <= 15 the value moves
  by |fp16(s) - s| q <= 2^-11 |s q| (normal) or 2^-25 q (subnormal s), plus fp32 rounding of the
  two products (2^-22 of their magnitudes). s q is gguf's dequantisation of the block with
  dmin set to 0.
- Q6_K, Q5_K, Q5_0 -> q8_0 requantises each block of 32 values x with d = max|x| / 127 stored as fp16:
  |fp16(d) q - x| <= d / 2 + 127 |fp16(d) - d| (+ fp32 rounding).
- The token embedding of a quantised plan is an fp16 table: 2^-11 |x| (2^-25 below fp16's
  normal range).

The blocks the runtime allocates take exactly the bytes the plan priced.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.runtime import kv_cache
from hetplan.runtime.backend import backend_for
from hetplan.runtime.devices import Devices
from hetplan.runtime.kernels.linear import PackedLinear
from hetplan.runtime.residency import Residency
from hetplan.runtime.kernels import quant
from hetplan.runtime.weights import torch_dtype, weight_source
from tests.gguf.files import write_model

KINDS = ("Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q5_K", "Q5_0", "F16", "BF16", "F32")

HF = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
      "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
      "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
      "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
      "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
      "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
      "block_sparse_moe.gate.weight": "ffn_gate_inp.weight"}
"""Hugging Face name (after ``model.layers.L.``) -> llama.cpp name (after ``blk.L.``)."""


def gguf_of(hf: str) -> tuple[str, int | None]:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf], None
    _, _, l, rest = hf.split(".", 3)
    if ".experts." in rest:   # mlp.experts.E.gate_proj (qwen3moe), block_sparse_moe.experts.E.w1 (mixtral)
        _, _, e, part, _ = rest.split(".")
        part = {"w1": "gate", "w3": "up", "w2": "down"}.get(part, part.removesuffix("_proj"))
        return f"blk.{l}.ffn_{part}_exps.weight", int(e)
    return f"blk.{l}.{HF[rest]}", None


def reverse_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's converter's q/k row permutation: it wrote, per head, rows
    ``w.reshape(heads, 2, r, ...).swapaxes(1, 2)`` (the two rotary halves interleaved), so the
    Hugging Face rows are ``f.reshape(heads, r, 2, ...).swapaxes(1, 2)``."""
    r = w.shape[0] // heads // 2
    return w.reshape(heads, r, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def oracle(reader: GGUFReader, hf: str, spec) -> tuple[np.ndarray, np.ndarray]:
    """(gguf's dequantised values in Hugging Face layout, the bound on the held values' error)."""
    name, expert = gguf_of(hf)
    t = next(t for t in reader.tensors if t.name == name)
    kind = t.tensor_type.name
    data = np.array(t.data)
    x = dequantize(data, t.tensor_type).astype(np.float32)
    if kind == "Q4_K":
        no_min = data.reshape(-1, 144).copy()
        no_min[:, 2:4] = 0                                    # dmin = 0: the scale part s q alone
        sq = np.abs(dequantize(no_min, t.tensor_type)).reshape(x.shape)
        bound = 2.0 ** -11 * sq + 15 * 2.0 ** -25 + 2.0 ** -22 * (sq + np.abs(sq - x))
    elif kind in ("Q6_K", "Q5_K", "Q5_0"):
        blocks = np.abs(x.reshape(-1, 32))
        d = blocks.max(axis=1, keepdims=True) / 127
        per = d / 2 + 127 * np.abs(d.astype(np.float16).astype(np.float32) - d) + 2.0 ** -20 * blocks.max(axis=1, keepdims=True)
        bound = np.broadcast_to(per, blocks.shape).reshape(x.shape)
    else:
        bound = np.zeros_like(x)
    if name == "token_embd.weight" and spec.weight_dtype not in ("fp32", "fp16", "bf16") and "embed_tokens" in hf:
        bound = bound + 2.0 ** -11 * np.abs(x) + 2.0 ** -25
    if expert is not None:
        x, bound = x[expert], bound[expert]
    if spec.arch in ("llama", "mixtral") and (".attn_q." in name or ".attn_k." in name):
        heads = spec.n_heads if ".attn_q." in name else spec.n_kv_heads
        x, bound = reverse_permute(x, heads), reverse_permute(bound, heads)
    return x, bound


def placed(path, node):
    plan, _ = compile_plan(CompileRequest(model=str(path), hw=node, strategy="all-gpu", prompt_len=8, gen_len=4))
    spec = plan.model
    backend = backend_for(spec)
    # as a run on the CPU: quantised weights compute in fp32, unquantised ones in their dtype
    dtype = torch.float32 if quant.is_quantised(spec.weight_dtype) else torch_dtype(spec.weight_dtype, "--weight-dtype")
    backend.dtype = dtype
    devices = Devices("emulated", plan.memory["gpu_budget_bytes"])
    source = weight_source(str(path), 0, spec)
    res = Residency(plan, backend, source, devices, dtype, kv_cache.storage(spec.kv_dtype), 1,
                    plan.workload.context_len)
    return plan, backend, res


@pytest.mark.parametrize("arch", ["llama", "qwen3moe", "mixtral"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_held_tensor_matches_ggufs_dequantiser(tmp_path, node, arch, kind):
    """Each linear in ``kind`` (the rest in Q8_0, the embedding in ``kind`` too); for the MoE
    families (mixtral: a llama file with ``expert_count``) the routed experts are slices of the
    stacked ``ffn_*_exps`` tensors."""
    path = tmp_path / "m.gguf"
    linears = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
               "ffn_up.weight", "ffn_down.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
               "ffn_down_exps.weight", "output.weight", "token_embd.weight")
    types = {n: kind for n in linears} | {"blk.1.attn_v.weight": "Q8_0", "blk.0.ffn_down.weight": "Q4_0"}
    write_model(path, "llama" if arch == "mixtral" else arch, types, seed=3, moe=arch == "mixtral")
    plan, backend, res = placed(path, node)
    reader = GGUFReader(str(path))
    for p in plan.placement:
        bw = res.blocks[p["block"]]
        assert bw.flat.numel() * bw.flat.element_size() == p["weight_bytes"]  # planned bytes are held bytes
        w = bw.tensors.materialise() if hasattr(bw.tensors, "materialise") else bw.tensors
        for t in backend.block_tensors(p["block"], p["kind"], p["layer"]):
            held = w[t.local]
            held = (held.dense() if isinstance(held, PackedLinear) else held).float().numpy()
            want, bound = oracle(reader, t.checkpoint, plan.model)
            err = np.abs(held - want)
            assert (err <= bound).all(), (t.checkpoint, float((err - bound).max()))
            if kind in ("Q8_0", "Q4_0", "F16", "BF16", "F32") and "embed_tokens" not in t.checkpoint:
                assert np.array_equal(held, want), t.checkpoint


def test_a_file_of_float_linears_is_a_float_plan(tmp_path, node):
    """F16 linears and embedding, F32 norms: an fp16 plan, every tensor held in fp16 (the F16
    ones exactly, the norms rounded: 2^-11 relative), each block numel x 2 bytes."""
    path = tmp_path / "m.gguf"
    write_model(path, "llama", {"token_embd.weight": "F16", **{n: "F16" for n in (
        "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
        "ffn_up.weight", "ffn_down.weight", "output.weight")}}, seed=4)
    plan, backend, res = placed(path, node)
    assert plan.model.weight_dtype == "fp16"
    reader = GGUFReader(str(path))
    for p in plan.placement:
        bw = res.blocks[p["block"]]
        assert bw.flat.dtype == torch.float16
        assert bw.flat.numel() * 2 == p["weight_bytes"]
        for t in backend.block_tensors(p["block"], p["kind"], p["layer"]):
            held = bw.tensors[t.local].float().numpy()
            want, _ = oracle(reader, t.checkpoint, plan.model)
            if len(t.shape) == 1:
                assert (np.abs(held - want) <= 2.0 ** -11 * np.abs(want)).all(), t.checkpoint
            else:
                assert np.array_equal(held, want), t.checkpoint
