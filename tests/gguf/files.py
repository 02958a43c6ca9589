"""Tiny GGUF files written with the ``gguf`` package's writer, for the tests of this package.

``write_model(path, arch, types)`` writes a llama or qwen3moe model with random weights, each
tensor in the type ``types`` gives it (by GGUF name suffix; default F32 for norms, Q8_0 for the
rest). Q8_0, Q4_0 and Q5_0 come from ``gguf.quants.quantize``; gguf-py 0.19 has no quantiser for
Q4_K, Q5_K and Q6_K, so those tensors are written as random valid blocks (``kquant_blocks``: every
byte pattern of the packed fields is a valid block; only the fp16 super-block scales are chosen,
to keep values near the spread of a fresh model), and read back through ``gguf.quants.dequantize``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import quantize

TYPES = {"F32": T.F32, "F16": T.F16, "BF16": T.BF16, "Q8_0": T.Q8_0, "Q4_0": T.Q4_0, "Q4_K": T.Q4_K,
         "Q6_K": T.Q6_K, "Q5_K": T.Q5_K, "Q5_0": T.Q5_0, "Q2_K": T.Q2_K}


@dataclass(frozen=True)
class Dims:
    layers: int = 2
    hidden: int = 256
    ffn: int = 512
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 256
    experts: int = 4
    experts_used: int = 2
    expert_ffn: int = 256
    context: int = 128


def kquant_blocks(kind: str, n_blocks: int, rng: np.random.Generator, spread: float = 0.05) -> np.ndarray:
    """``n_blocks`` random Q4_K (144 B), Q5_K (176 B) or Q6_K (210 B) super-blocks as uint8
    [n_blocks, size], with values within about +-spread.

    Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; value
    d * sc * q - dmin * m, so d = spread / (63 * 15) and dmin = spread / 63 bound it. Q5_K: the
    same with 32 bytes of fifth bits before the nibbles, q <= 31, d = spread / (63 * 31).
    Q6_K: 128 bytes low nibbles, 64 bytes high bits, 16 int8 scales, fp16 d; value d * sc * (q - 32),
    so d = spread / (128 * 32) bounds it."""
    if kind in ("Q4_K", "Q5_K"):   # Q5_K: the same fields, 32 bytes of high bits more, q <= 31
        top = 15 if kind == "Q4_K" else 31
        d = (spread / (63 * top) * rng.uniform(0.5, 1.0, n_blocks)).astype(np.float16)
        dmin = (spread / 63 * rng.uniform(0.5, 1.0, n_blocks)).astype(np.float16)
        rest = rng.integers(0, 256, (n_blocks, 140 if kind == "Q4_K" else 172), dtype=np.uint8)
        return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), rest], axis=1)
    d = (spread / (128 * 32) * rng.uniform(0.5, 1.0, n_blocks)).astype(np.float16)
    bits = rng.integers(0, 256, (n_blocks, 192), dtype=np.uint8)
    scales = rng.integers(-128, 128, (n_blocks, 16), dtype=np.int8).view(np.uint8)
    return np.concatenate([bits, scales, d.view(np.uint8).reshape(-1, 2)], axis=1)


def encode(values: np.ndarray, kind: str, rng: np.random.Generator) -> tuple[np.ndarray, T]:
    """(data, type) for ``GGUFWriter.add_tensor`` of fp32 ``values`` [..., cols] in ``kind``: the
    values themselves (F32/F16/BF16, Q8_0/Q4_0 quantised), or random K-quant blocks of its shape."""
    if kind in ("Q4_K", "Q6_K", "Q5_K", "Q2_K"):
        rows = int(np.prod(values.shape[:-1]))
        n = values.shape[-1] // 256
        size = {"Q4_K": 144, "Q6_K": 210, "Q5_K": 176, "Q2_K": 84}[kind]
        blocks = (kquant_blocks(kind, rows * n, rng) if kind != "Q2_K"
                  else rng.integers(0, 256, (rows * n, size), dtype=np.uint8))   # never decoded
        return blocks.reshape(*values.shape[:-1], n * size), TYPES[kind]
    if kind == "BF16":
        return quantize(values, T.BF16), T.BF16
    if kind in ("F32", "F16"):
        return values.astype(np.float32 if kind == "F32" else np.float16), TYPES[kind]
    return quantize(values, TYPES[kind]), TYPES[kind]


def layer_tensors(arch: str, dims: Dims, moe: bool = False) -> dict:
    """GGUF tensor name suffix -> Hugging Face-order shape of one layer's tensors (``moe``: a
    llama layer with Mixtral-style routed experts)."""
    d, hd = dims.hidden, dims.head_dim
    out = {"attn_norm.weight": (d,), "attn_q.weight": (dims.heads * hd, d), "attn_k.weight": (dims.kv_heads * hd, d),
           "attn_v.weight": (dims.kv_heads * hd, d), "attn_output.weight": (d, dims.heads * hd),
           "ffn_norm.weight": (d,)}
    if arch == "qwen3moe" or moe:
        e, i = dims.experts, dims.expert_ffn if arch == "qwen3moe" else dims.ffn
        if arch == "qwen3moe":
            out.update({"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)})
        out.update({"ffn_gate_inp.weight": (e, d),
                    "ffn_gate_exps.weight": (e, i, d), "ffn_up_exps.weight": (e, i, d),
                    "ffn_down_exps.weight": (e, d, i)})
    else:
        out.update({"ffn_gate.weight": (dims.ffn, d), "ffn_up.weight": (dims.ffn, d), "ffn_down.weight": (d, dims.ffn)})
    return out


def write_model(path, arch: str = "llama", types: dict | None = None, dims: Dims = Dims(), seed: int = 0,
                tied: bool = False, name: str = "tiny", shapes: dict | None = None, moe: bool = False,
                rope_freqs=None, rope_freqs_type=T.F32, tokenizer: bool = False) -> None:
    """A random ``arch`` (llama or qwen3moe) model at ``path``; ``types``: GGUF tensor name or
    suffix (``attn_v.weight``, ``token_embd.weight``, ``blk.1.ffn_down.weight``) -> type name;
    ``shapes``: tensor name -> a shape written instead of the one the metadata implies;
    ``rope_freqs``: values of a ``rope_freqs.weight`` tensor (in ``rope_freqs_type``);
    ``tokenizer``: a byte-level BPE tokenizer with no merges (``byte_tokens``), as Llama 3's
    files carry theirs (``tokenizer.ggml.model = gpt2``): token i is byte i."""
    types = types or {}
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(dims.layers)
    w.add_context_length(dims.context)
    w.add_embedding_length(dims.hidden)
    w.add_feed_forward_length(dims.ffn)
    w.add_head_count(dims.heads)
    w.add_head_count_kv(dims.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(dims.vocab)
    if arch == "qwen3moe":
        w.add_key_length(dims.head_dim)
        w.add_value_length(dims.head_dim)
        w.add_expert_count(dims.experts)
        w.add_expert_used_count(dims.experts_used)
        w.add_expert_feed_forward_length(dims.expert_ffn)
    else:
        w.add_rope_dimension_count(dims.head_dim)
    if moe:
        w.add_expert_count(dims.experts)
        w.add_expert_used_count(dims.experts_used)
    names = {"token_embd.weight": (dims.vocab, dims.hidden), "output_norm.weight": (dims.hidden,)}
    if not tied:
        names["output.weight"] = (dims.vocab, dims.hidden)
    for l in range(dims.layers):
        names.update({f"blk.{l}.{k}": v for k, v in layer_tensors(arch, dims, moe).items()})
    names.update(shapes or {})
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("llama-bpe")
        w.add_token_list(byte_tokens())
        w.add_token_types([1] * 256)
        w.add_token_scores([0.0] * 256)
        w.add_token_merges([])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float16 if rope_freqs_type == T.F16
                                                     else np.float32), raw_dtype=rope_freqs_type)
    for tname, shape in names.items():
        norm = len(shape) == 1
        values = (1 + rng.uniform(-0.1, 0.1, shape) if norm else rng.uniform(-0.05, 0.05, shape)).astype(np.float32)
        suffix = tname.split(".", 2)[2] if tname.startswith("blk.") else tname
        kind = types.get(tname) or types.get(suffix) or ("F32" if norm else "Q8_0")
        data, qtype = encode(values, kind, rng)
        w.add_tensor(tname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def byte_tokens() -> list:
    """GPT-2's byte-level alphabet (bytes_to_unicode, as its paper's encoder defines it): printable
    bytes stand for themselves, the other 68 map to U+0100 onwards, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    extra = iter(range(256, 256 + 256 - len(keep)))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def llama31_8b_q4_k_m_types(layers: int = 32) -> dict:
    """Tensor types of llama.cpp's Q4_K_M recipe for Llama 3.1 8B: Q4_K throughout, but Q6_K
    for the output layer and, in the layers its ``use_more_bits`` picks (the first and last
    eighth, and every third in between), ``attn_v`` and ``ffn_down``."""
    more = [l for l in range(layers) if l < layers // 8 or l >= 7 * layers // 8 or (l - layers // 8) % 3 == 2]
    out = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K"}
    for l in range(layers):
        out[f"blk.{l}.attn_v.weight"] = out[f"blk.{l}.ffn_down.weight"] = "Q6_K" if l in more else "Q4_K"
    return out


def write_header_only(path, dims: Dims, types: dict, rope_freqs: bool = True) -> int:
    """A llama file at ``dims`` whose tensor data are all zeros, written as a sparse file: the
    header and tensor directory, then a hole up to the file's full size (nothing is written, so
    a model of gigabytes takes no disk), but for Llama 3.1's rope factors. Returns the file's size."""
    w = GGUFWriter(str(path), "llama")
    w.add_name("Meta Llama 3.1 8B Instruct")
    w.add_block_count(dims.layers)
    w.add_context_length(dims.context)
    w.add_embedding_length(dims.hidden)
    w.add_feed_forward_length(dims.ffn)
    w.add_head_count(dims.heads)
    w.add_head_count_kv(dims.kv_heads)
    w.add_rope_dimension_count(dims.head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(dims.vocab)
    names = {"token_embd.weight": (dims.vocab, dims.hidden)}
    if rope_freqs:
        names["rope_freqs.weight"] = (dims.head_dim // 2,)
    for l in range(dims.layers):
        names.update({f"blk.{l}.{k}": v for k, v in layer_tensors("llama", dims).items()})
    names.update({"output_norm.weight": (dims.hidden,), "output.weight": (dims.vocab, dims.hidden)})
    sizes = {"F32": (1, 4), "Q4_K": (256, 144), "Q6_K": (256, 210), "Q8_0": (32, 34)}
    total, offsets = 0, {}
    for tname, shape in names.items():
        kind = types.get(tname) or types.get(tname.split(".", 2)[-1]) or ("F32" if len(shape) == 1 else "Q4_K")
        per, size = sizes[kind]
        nbytes = int(np.prod(shape)) // per * size
        w.add_tensor_info(tname, shape, np.dtype(np.float32), nbytes, raw_dtype=TYPES[kind])
        offsets[tname] = total
        total += -(-nbytes // 32) * 32
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    start = w.fout[0].tell()
    w.close()
    start = -(-start // 32) * 32
    with open(path, "r+b") as fh:
        fh.truncate(start + total)
        if rope_freqs:   # Llama 3.1's factors, as its converter writes them
            fh.seek(start + offsets["rope_freqs.weight"])
            fh.write(np.asarray(llama3_rope_factors(500000.0, dims.head_dim, 8.0, 1.0, 4.0, 8192),
                                dtype="<f4").tobytes())
    return start + total


def llama3_rope_factors(base: float, dim: int, factor: float, low: float, high: float, old_context: int) -> list:
    """``rope_freqs.weight`` as llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel``) computes it
    for a ``llama3`` rope scaling: per frequency, 1 for wavelengths under ``old_context / high``,
    ``factor`` above ``old_context / low``, and ``1 / ((1 - s) / factor + s)`` between, with
    ``s = (old_context / wavelength - low) / (high - low)``; llama.cpp divides each frequency by it."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


MLA = dict(q_lora=128, kv_lora=64, rope=32, nope=32, v=32, shared=1, dense=1)
"""deepseek2's attention and expert dims for ``write_deepseek2`` (with ``Dims``)."""


def write_deepseek2(path, dims: Dims = Dims(), types: dict | None = None, seed: int = 0,
                    split_kv_b: bool = False, spread: float = 0.05) -> dict:
    """A random deepseek2 (MLA, routed + shared experts, leading dense layers) file, with
    llama.cpp's key names; returns the metadata written, as the ModelSpec fields it means.
    ``split_kv_b``: each ``attn_kv_b`` written as llama.cpp's converter (``DeepseekV2Model``) writes
    it for its MLA kernels: viewed [H, nope + v, r], split into k_b [H, nope, r] and v_b [H, v, r],
    k_b transposed to [H, r, nope]; saved as ``attn_k_b`` and ``attn_v_b``. Norm weights are
    1 +- 0.1, the other tensors uniform in +-``spread``."""
    types, m = types or {}, MLA
    rng = np.random.default_rng(seed)
    a = "deepseek2"
    w = GGUFWriter(str(path), a)
    w.add_name("tiny-deepseek")
    for key, value in {"block_count": dims.layers, "context_length": dims.context,
                       "embedding_length": dims.hidden, "feed_forward_length": dims.ffn,
                       "attention.head_count": dims.heads, "attention.head_count_kv": dims.heads,
                       "attention.q_lora_rank": m["q_lora"], "attention.kv_lora_rank": m["kv_lora"],
                       "attention.key_length": m["nope"] + m["rope"], "attention.value_length": m["v"],
                       "rope.dimension_count": m["rope"], "expert_count": dims.experts,
                       "expert_used_count": dims.experts_used, "expert_feed_forward_length": dims.expert_ffn,
                       "expert_shared_count": m["shared"], "leading_dense_block_count": m["dense"],
                       "expert_gating_func": 2, "vocab_size": dims.vocab}.items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    w.add_float32(f"{a}.expert_weights_scale", 2.5)
    w.add_bool(f"{a}.expert_weights_norm", True)
    d, h, e, i = dims.hidden, dims.heads, dims.experts, dims.expert_ffn
    qk, r = m["nope"] + m["rope"], m["kv_lora"]
    names = {"token_embd.weight": (dims.vocab, d), "output_norm.weight": (d,), "output.weight": (dims.vocab, d)}
    for l in range(dims.layers):
        layer = {"attn_norm.weight": (d,), "attn_q_a.weight": (m["q_lora"], d), "attn_q_a_norm.weight": (m["q_lora"],),
                 "attn_q_b.weight": (h * qk, m["q_lora"]), "attn_kv_a_mqa.weight": (r + m["rope"], d),
                 "attn_kv_a_norm.weight": (r,), "attn_kv_b.weight": (h * (m["nope"] + m["v"]), r),
                 "attn_output.weight": (d, h * m["v"]), "ffn_norm.weight": (d,)}
        if l < m["dense"]:
            layer.update({"ffn_gate.weight": (dims.ffn, d), "ffn_up.weight": (dims.ffn, d),
                          "ffn_down.weight": (d, dims.ffn)})
        else:
            s = m["shared"] * i
            layer.update({"ffn_gate_inp.weight": (e, d), "exp_probs_b.bias": (e,), "ffn_gate_exps.weight": (e, i, d),
                          "ffn_up_exps.weight": (e, i, d), "ffn_down_exps.weight": (e, d, i),
                          "ffn_gate_shexp.weight": (s, d), "ffn_up_shexp.weight": (s, d), "ffn_down_shexp.weight": (d, s)})
        names.update({f"blk.{l}.{k}": v for k, v in layer.items()})
    for tname, shape in names.items():
        norm = tname.endswith("norm.weight")
        values = (1 + rng.uniform(-0.1, 0.1, shape) if norm else rng.uniform(-spread, spread, shape)).astype(np.float32)
        parts = {tname: values}
        if split_kv_b and tname.endswith("attn_kv_b.weight"):
            kv_b = values.reshape(h, m["nope"] + m["v"], r)
            parts = {tname.replace("kv_b", "k_b"): np.ascontiguousarray(kv_b[:, :m["nope"]].transpose(0, 2, 1)),
                     tname.replace("kv_b", "v_b"): np.ascontiguousarray(kv_b[:, m["nope"]:])}
        for name, part in parts.items():
            suffix = name.split(".", 2)[2] if name.startswith("blk.") else name
            kind = types.get(name) or types.get(suffix) or ("F32" if len(shape) == 1 else "Q8_0")
            data, qtype = encode(part, kind, rng)
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dict(arch="deepseek_v3", n_layers=dims.layers, hidden=d, intermediate=dims.ffn, n_heads=h, n_kv_heads=h,
                head_dim=qk, vocab=dims.vocab, n_experts=e, experts_per_token=dims.experts_used,
                moe_intermediate=i, n_shared_experts=m["shared"], first_dense_layers=m["dense"],
                q_lora_rank=m["q_lora"], kv_lora_rank=r, qk_rope_head_dim=m["rope"], qk_nope_head_dim=m["nope"],
                v_head_dim=m["v"])
