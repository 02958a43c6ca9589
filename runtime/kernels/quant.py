"""Quantised formats: byte sizes, quantise and dequantise, for weights and for KV-cache rows.

Every format stores each row on its own: an output row of a linear weight ``[out, in]`` (so a
block of 32 weights runs along the input dim), or one token's KV values. A row of n values is
zero-padded to whole blocks and kept as the arrays ``hetplan.dtypes.row_parts`` lists (the
single definition of the bytes, priced by the planner and allocated here): a packed weight is
those arrays ``[out, count]`` one after the other in one flat uint8 buffer, widest element
first so each is a valid typed view (``split``); a KV cache keeps them as ``[..., count]``.

- ``q8_0`` (GGUF's, bit for bit): blocks of 32: d = max|x| / 127 in fp32, q = roundf(x * (1 / d))
  (half away from zero), d stored fp16; x = d * q. 34 B / 32 weights.
- ``q4_0`` (GGUF's, bit for bit): blocks of 32: m = the value of largest |x| (first on ties),
  d = m / -8 in fp32, q = min(15, trunc(x * (1 / d) + 8.5)), d stored fp16; byte j of a
  block holds q_j (low nibble) and q_{j+16} (high); x = d * (q - 8). 18 B / 32 weights.
- ``int8``: per row: fp32 scale d = max|x| / 127, int8 values q = round(x / d). n + 4 B.
- ``int4``: per row: fp32 scale d = max|x| / 7, q = round(x / d) in [-8, 7] stored as q + 8, two
  per byte (low nibble the even element). ceil(n / 2) + 4 B.
- ``q4_k_m``: super-blocks of 256 = 8 sub-blocks of 32. Per sub-block j: an fp16 scale d_j and
  an 8-bit min index m_j; per super-block one fp32 min scale dmin; weights x = d_j * q - dmin * m_j
  with 4-bit q in [0, 15], nibbles as int4. 4 + 8 * 2 + 8 + 128 = 156 B / 256 weights = 4.875
  bits (GGUF's q4_k_m mixes 4.5-bit q4_K and 6.5625-bit q6_K tensors, about 4.85 bits; this
  format is one fixed rate, not bit-compatible with GGUF).
int8/int4/q4_k_m scales are computed in fp32 (then rounded to their stored dtype), rounding
half to even.

The kernels that multiply with these bytes are ``hetplan.runtime.kernels.linear``'s. Embeddings,
norms and biases are not quantised (``quantises``; tables in ``TABLE_DTYPE``). Knows nothing about plans, devices or
models beyond a tensor's local name.
"""

from __future__ import annotations

import torch

from hetplan import dtypes

FORMATS = ("q8_0", "q4_0", "int8", "int4", "q4_k_m")
"""Plan weight (and KV) dtypes stored quantised."""
EMBEDDINGS = ("tok", "pos")
"""Local names of lookup tables (looked up by row, never multiplied): kept unquantised."""
TABLE_DTYPE = torch.float16
"""What a quantised plan's lookup tables hold: copies are fp16, and rows read from a checkpoint's
file (``residency.looked_up_in_place``) are rounded to it, so that a table's values do not
depend on where the plan puts it."""
_BLOCKED = {"q8_0": 32, "q4_0": 32, "q4_k_m": 256}
"""Block-wise formats -> values per (super-)block; the others scale whole rows."""


def is_quantised(weight_dtype: str) -> bool:
    return weight_dtype in FORMATS


def quantises(local: str, shape: tuple) -> bool:
    """A 2-D weight other than an embedding table is a linear weight: quantised."""
    return len(shape) == 2 and local not in EMBEDDINGS


def stored_shape(local: str, shape: tuple) -> tuple:
    """``[out, in]`` as quantised: GPT-2's Conv1D weights (local names ending ``_t``) are stored
    ``[in, out]`` in checkpoints and transposed before quantising."""
    return (shape[1], shape[0]) if local.endswith("_t") else tuple(shape)


def compute_dtype(mode: str) -> torch.dtype:
    """Dtype quantised weights are dequantised into: bf16 on a CUDA GPU, fp32 on the CPU."""
    return torch.bfloat16 if mode == "cuda" else torch.float32


def _blocks(n: int, size: int) -> int:
    return -(-n // size)


TORCH = {"fp32": torch.float32, "fp16": torch.float16, "int8": torch.int8, "uint8": torch.uint8}


def nbytes(fmt: str, shape: tuple) -> int:
    """Bytes of a packed ``[out, in]`` tensor: out * row_nbytes(fmt, in)."""
    rows, cols = shape
    return rows * row_nbytes(fmt, cols)


def row_parts(fmt: str, n: int) -> tuple:
    """The arrays of a row of ``n`` values, ((torch dtype, count), ...): ``dtypes.row_parts``."""
    return tuple((TORCH[dtype], count) for dtype, count in dtypes.row_parts(fmt, n))


def row_nbytes(fmt: str, n: int) -> int:
    """Bytes of one quantised row of ``n`` values (``dtypes.row_bytes``): q8_0 34 * ceil(n / 32),
    q4_0 18 * ceil(n / 32), int8 n + 4, int4 ceil(n / 2) + 4, q4_k_m 156 * ceil(n / 256)."""
    return int(dtypes.row_bytes(fmt, n))


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values < 16, even count in the last dim -> bytes: low nibble the even element,
    high the odd. [..., 2k] -> [..., k]."""
    q = q.reshape(*q.shape[:-1], -1, 2).to(torch.uint8)
    return q[..., 0] | (q[..., 1] << 4)


def _unpack4(b: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2k] nibbles."""
    return torch.stack((b & 15, b >> 4), dim=-1).reshape(*b.shape[:-1], -1)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, 0 where d == 0 (as GGUF's quantisers)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero), computed as GGUF's reference does."""
    a = v.abs()
    floored = torch.floor(a)
    return torch.sign(v) * (floored + torch.floor(2 * (a - floored)))


def _safe(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.ones_like(d), d)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def _symmetric(x: torch.Tensor, qmax: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., m] -> scale d [..., 1] = max|x| / qmax (in ``scale_dtype``), q [..., m] =
    round(x / d) in [-qmax, qmax] ([-8, 7] for 4-bit), as floats."""
    d = (x.abs().amax(dim=-1, keepdim=True) / qmax).to(scale_dtype)
    q = torch.round(x / _safe(d.float())).clamp_(-qmax - (qmax == 7), qmax)
    return d, q


def quantise_rows(fmt: str, x: torch.Tensor) -> tuple:
    """x [..., n] (any float dtype) -> the ``row_parts`` arrays, each [..., count], on x's device;
    every row quantised on its own."""
    lead, n = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, n).float()                                         # [M, n]
    m = x.shape[0]
    if fmt in _BLOCKED:
        pad = _blocks(n, _BLOCKED[fmt]) * _BLOCKED[fmt] - n
        x = torch.cat((x, x.new_zeros(m, pad)), dim=1) if pad else x
    if fmt == "q8_0":
        blocks = x.view(m, -1, 32)                                       # [M, nb, 32]
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127                # fp32
        q = _roundf(blocks * _inverse(d))
        parts = (d.half().view(m, -1), q.to(torch.int8).reshape(m, -1))
    elif fmt == "q4_0":
        blocks = x.view(m, -1, 32)
        big = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))  # the value of largest |x|
        d = big / -8
        q = torch.trunc(blocks * _inverse(d) + 8.5).clamp_(0, 15).to(torch.uint8)
        vals = q[..., :16] | (q[..., 16:] << 4)                           # [M, nb, 16]
        parts = (d.half().view(m, -1), vals.reshape(m, -1))
    elif fmt in ("int8", "int4"):
        d, q = _symmetric(x, 127 if fmt == "int8" else 7, torch.float32)   # [M, 1], [M, n]
        if fmt == "int4" and n % 2:
            q = torch.cat((q, q.new_zeros(m, 1)), dim=1)
        parts = (d, q.to(torch.int8) if fmt == "int8" else _pack4(q + 8))
    elif fmt == "q4_k_m":
        x = x.view(m, -1, 8, 32)                                         # [M, s, 8, 32]
        mins = (-x.amin(dim=3)).clamp_(min=0)                            # [M, s, 8] mins to subtract
        dmin = mins.amax(dim=2, keepdim=True) / 255                      # [M, s, 1] fp32
        mq = torch.round(mins / _safe(dmin)).clamp_(0, 255)
        mins = mq * dmin
        d = ((x.amax(dim=3) + mins) / 15).half()                         # [M, s, 8]
        q = torch.round((x + mins[..., None]) / _safe(d.float())[..., None]).clamp_(0, 15)
        parts = (dmin.view(m, -1), d.view(m, -1), mq.to(torch.uint8).view(m, -1), _pack4(q.view(m, -1)))
    else:
        raise ValueError(fmt)
    return tuple(p.reshape(*lead, p.shape[-1]) for p in parts)


def dequantise_rows(fmt: str, parts: tuple, n: int) -> torch.Tensor:
    """``quantise_rows``' arrays (each [..., count]; any leading dims, e.g. a cache's prefix)
    -> fp32 [..., n] on their device."""
    lead = parts[0].shape[:-1]
    if fmt in ("q8_0", "q4_0"):
        d, vals = parts
        if fmt == "q8_0":
            q = vals.float().reshape(*lead, -1, 32)
        else:
            b = vals.reshape(*lead, -1, 16)
            q = torch.cat((b & 15, b >> 4), dim=-1).float() - 8          # [..., nb, 32]
        x = q * d.float()[..., None]                                     # [..., nb, 32]
    elif fmt in ("int8", "int4"):
        d, vals = parts
        q = vals.float() if fmt == "int8" else _unpack4(vals)[..., :n].float() - 8
        x = q * d
    elif fmt == "q4_k_m":
        dmin, d, mq, vals = parts
        q = _unpack4(vals).float().reshape(*lead, -1, 8, 32)            # [..., s, 8, 32]
        x = (q * d.float().reshape(*lead, -1, 8, 1)
             - mq.float().reshape(*lead, -1, 8, 1) * dmin.reshape(*lead, -1, 1, 1))
    else:
        raise ValueError(fmt)
    return x.reshape(*lead, -1)[..., :n]


QUANTISE_CHUNK_BYTES = 256 << 10
"""fp32 bytes of a weight quantised at a time: ``quantise_rows``' temporaries (a few times its
input) stay this small whatever the weight's size."""


def quantise(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """w [out, in] (any float dtype) -> packed uint8 [nbytes(fmt, w.shape)] on w's device: each
    row quantised on its own, the ``row_parts`` arrays [out, count] one after the other."""
    return quantise_into(fmt, w, torch.empty(nbytes(fmt, tuple(w.shape)), dtype=torch.uint8, device=w.device))


def quantise_into(fmt: str, w: torch.Tensor, out: torch.Tensor, done=None) -> torch.Tensor:
    """``quantise(fmt, w)`` written into ``out`` (uint8 [nbytes], any device) rows at a time,
    ``QUANTISE_CHUNK_BYTES`` of fp32 values per step; ``done(r0, r1)`` after rows [r0, r1) (the
    caller lets their source pages go)."""
    rows, cols = w.shape
    parts = split(fmt, out, (rows, cols))
    step = max(1, QUANTISE_CHUNK_BYTES // (4 * max(1, cols)))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        for dst, src in zip(parts, quantise_rows(fmt, w[r0:r1].to(out.device))):
            dst[r0:r1].copy_(src)
        if done is not None:
            done(r0, r1)
    return out


def split(fmt: str, packed: torch.Tensor, shape: tuple) -> tuple:
    """packed uint8 (from ``quantise``) -> its ``row_parts`` arrays, typed views [out, count]."""
    rows, cols = shape
    parts, offset = [], 0
    for dtype, count in row_parts(fmt, cols):
        size = rows * count * torch.empty((), dtype=dtype).element_size()
        parts.append(packed[offset:offset + size].view(dtype).view(rows, count))
        offset += size
    return tuple(parts)


def dequantise(fmt: str, packed: torch.Tensor, shape: tuple, out: torch.Tensor) -> torch.Tensor:
    """packed uint8 (from ``quantise``) -> ``out`` [out, in] (any float dtype, same device)."""
    return out.copy_(dequantise_rows(fmt, split(fmt, packed, shape), shape[1]))
