"""Which runtime format each GGUF tensor is held in, and what every block costs as held.

The conversion rule (the runtime's ``hetplan.runtime.gguf`` applies the same one, so the bytes
planned are the bytes held):

    file type        linear weight held as                     exact?
    Q8_0             q8_0, blocks repacked                      bit for bit
    Q4_0             q4_0, blocks repacked                      bit for bit
    Q4_K             q4_k_m: per 32 values an fp16 scale        scales d * sc_j rounded to fp16
                     d * sc_j, the 6-bit min index m_j, the     (|error| <= 15 * |fp16(d sc_j) -
                     super-block's fp32 dmin, the same nibbles  d sc_j|); mins exact
    Q6_K, Q5_K,      q8_0, requantised from the decoded values  |error| <= d8 / 2 + 127 |fp16(d8) - d8|
    Q5_0                                                        per block of 32 (d8 = max|x| / 127)
    F32, F16, BF16   unquantised, in the compute dtype          exact (fp32 on the CPU)
    attn_k_b/_v_b    (MLA's kv_b split) joined into kv_b, decoded exact

A plan with any quantised linear is a quantised plan: its linears are held packed as above
(each 16-byte aligned, ``hetplan.dtypes.packed_bytes``), its norms, biases and unquantised
linears (a router kept in F32) at 4 bytes per value (the widest compute dtype), and its token
embedding as an fp16 table (any file type, dequantised; |error| <= 2^-11 relative). A file
whose every linear is F32/F16/BF16 is a float plan in the linears' type (fp32 where F16 and
BF16 mix), every tensor held in it. The plan's ``weight_dtype`` is then the runtime format holding most of the linear
bytes (``q4_k_m`` for a Q4_K_M file), and ``extra["gguf"]`` records the file's own bytes per
block and its tensor types. Knows nothing about torch.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter

from hetplan.dtypes import packed_bytes
from hetplan.errors import HetplanError
from hetplan.frontends.gguf.families import block_of
from hetplan.frontends.gguf.header import GgufHeader, GgufTensor
from hetplan.model import ModelSpec

FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_K": "q4_k_m", "Q6_K": "q8_0", "Q5_K": "q8_0", "Q5_0": "q8_0"}
"""Quantised file type -> the runtime format its linears are held in."""
FLOATS = {"F32": "fp32", "F16": "fp16", "BF16": "bf16"}
"""Unquantised file types -> plan dtype."""
FLOAT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
RAW_BYTES = 4
"""Bytes per value of a quantised plan's unpacked tensors (norms, biases, float linears)."""
EMBED_BYTES = 2
"""Bytes per value of a quantised plan's token embedding (fp16)."""


def is_linear(t: GgufTensor) -> bool:
    """A weight multiplied with (2-D, or 3-D stacked experts), not the token embedding."""
    return len(t.shape) >= 2 and t.name != "token_embd.weight"


def runtime_format(t: GgufTensor) -> str | None:
    """The runtime format linear ``t`` is held in (None: unquantised); unsupported types raise."""
    if t.type in FORMATS:
        return FORMATS[t.type]
    if t.type in FLOATS:
        return None
    raise HetplanError(f"tensor {t.name!r} is {t.type}, a ggml type hetplan cannot hold or price; "
                       f"supported: {', '.join([*FORMATS, *FLOATS])} (requantise the file, e.g. with "
                       f"llama-quantize to Q4_K_M or Q8_0)")


def matrices(t: GgufTensor) -> tuple[int, int, int]:
    """(count, rows, cols) of the matrices a linear tensor holds: 3-D stacked experts are
    ``count`` matrices; ggml shape ``(cols, rows[, count])``."""
    cols, rows = t.shape[0], t.shape[1]
    return (t.shape[2] if len(t.shape) > 2 else 1), rows, cols


def float_plan(h: GgufHeader) -> str | None:
    """The plan dtype of a file whose linears are all unquantised (their widest type), else None."""
    types = {t.type for t in h.tensors.values() if is_linear(t)}
    for t in h.tensors.values():
        runtime_format(t)  # every type is checked, also those of unplaced tensors
    if types and types <= set(FLOATS):
        # one type: as it is; F16 beside BF16: fp32, which holds both exactly
        return FLOATS[types.pop()] if len(types) == 1 else "fp32"
    return None


SPLIT_KV_B = (".attn_k_b.weight", ".attn_v_b.weight")
"""MLA's ``kv_b_proj`` as llama.cpp's converter splits it: the runtime joins the pair back into one
linear, decoded (MLA reads it per head, so a quantised plan holds it at ``RAW_BYTES``)."""


def held_bytes(t: GgufTensor, plan_float: str | None) -> int:
    """Bytes tensor ``t`` takes as the runtime holds it (module docstring)."""
    if plan_float is not None:
        return t.numel * FLOAT_BYTES[plan_float]
    if t.name == "token_embd.weight":   # the embed block's lookup table
        return t.numel * EMBED_BYTES
    if t.name.endswith(SPLIT_KV_B):
        runtime_format(t)   # a type the runtime can decode
        return t.numel * RAW_BYTES
    fmt = runtime_format(t) if is_linear(t) else None
    if fmt is None:
        return t.numel * RAW_BYTES
    count, rows, cols = matrices(t)
    return count * int(packed_bytes(fmt, rows, cols))


def head_tie(h: GgufHeader, plan_float: str | None) -> int:
    """Bytes of a tied head's output linear: the token embedding held as a linear."""
    t = h.tensors["token_embd.weight"]
    if plan_float is not None:
        return t.numel * FLOAT_BYTES[plan_float]
    fmt = runtime_format(t)
    return t.numel * RAW_BYTES if fmt is None else int(packed_bytes(fmt, t.shape[1], t.shape[0]))


def describe(spec: ModelSpec) -> str:
    """One line on what a GGUF-sourced plan holds: the file's types, and how they are held."""
    g = spec.extra["gguf"]
    types = ", ".join(f"{n} {t}" for t, n in sorted(g["types"].items(), key=lambda kv: -kv[1]))
    file_total = sum(g["file_bytes"].values())
    if not spec.block_bytes:
        return (f"GGUF tensors ({types}) requantised to {spec.weight_dtype} at load, as --weight-dtype asked; "
                f"priced from the shapes")
    held = sum(v for k, v in spec.block_bytes.items() if k != "expert")
    rule = ", ".join(f"{t} -> {FORMATS[t]}" for t in sorted(g["types"]) if t in FORMATS)
    return (f"GGUF tensors ({types}) priced one by one as held ({rule or 'unquantised'}; norms fp32, "
            f"embedding fp16): {held / 2**30:.3g} GiB held for {file_total / 2**30:.3g} GiB in the file; "
            f"weight dtype {spec.weight_dtype} is the format holding most bytes")


def directory_digest(h: GgufHeader) -> str:
    """sha256 (16 hex digits) of the tensor directory: every tensor's name, type and shape, so
    that a run can tell the file a plan was compiled from."""
    blob = "\n".join(f"{t.name} {t.type} {list(t.shape)}" for t in h.tensors.values())
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def price(h: GgufHeader, spec: ModelSpec, weight_dtype: str | None) -> ModelSpec:
    """``spec`` with each block priced as held (``block_bytes``), its weight dtype the dominant
    runtime format (or the float plan's dtype), the file's bytes per block in ``extra["gguf"]``.
    A ``weight_dtype`` other than that one plans the weights requantised to it instead."""
    plan_float = float_plan(h)
    held, file_bytes = Counter(), Counter()
    linear_bytes, expert = Counter(), Counter()
    for name, t in h.tensors.items():
        block = block_of(name, spec)
        if block is None:
            continue
        b = held_bytes(t, plan_float)
        held[block] += b
        file_bytes[block] += t.nbytes
        if is_linear(t) and plan_float is None and runtime_format(t) is not None and not name.endswith(SPLIT_KV_B):
            linear_bytes[runtime_format(t)] += b
        if "_exps." in name:
            expert[block] += b // matrices(t)[0]
    if spec.tie_embeddings:
        held["head"] += head_tie(h, plan_float)
        t = h.tensors["token_embd.weight"]
        if plan_float is None and runtime_format(t) is not None:
            linear_bytes[runtime_format(t)] += head_tie(h, plan_float)
    native = plan_float or max(sorted(linear_bytes), key=linear_bytes.get)
    types = Counter(t.type for t in h.tensors.values())
    gguf = {"file_bytes": dict(sorted(file_bytes.items())), "types": dict(sorted(types.items())),
            "tensors": directory_digest(h)}
    spec = dataclasses.replace(spec, weight_dtype=native, extra={**spec.extra, "gguf": gguf})
    if weight_dtype is not None and weight_dtype != native:
        return spec.with_dtypes(weight_dtype=weight_dtype)
    blocks = dict(sorted(held.items()))
    if expert:
        blocks["expert"] = max(expert.values())
    return dataclasses.replace(spec, block_bytes=blocks)
