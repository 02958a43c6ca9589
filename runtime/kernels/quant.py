"""Quantised formats: byte sizes, quantise and dequantise, for weights and for KV-cache rows.

Every format quantises runs of values: a 2-D linear weight ``[out, in]`` flattened row by row,
so a block of 32 weights runs along the input dim (rows whose length is a multiple of 32 hold
whole blocks; the last block of a tensor is zero-padded). A packed weight is one flat uint8
buffer; its sections come widest element first (fp32, then fp16, then bytes) so each one is a
valid typed view.

- ``q8_0``: blocks of 32: fp16 scale d = max|x| / 127, int8 q = round(x / d). 34 B / 32 weights.
- ``q4_0``: blocks of 32: fp16 scale d = max|x| / 7, q = round(x / d) in [-8, 7] stored as
  q + 8, two per byte (low nibble first). 18 B / 32 weights (4.5 bits).
- ``int8``: per output row: fp32 scale d = max|x| / 127, int8 values. in + 4 B per row.
- ``int4``: per output row: fp32 scale d = max|x| / 7, 4-bit values as in q4_0, packed over the
  flattened tensor. in / 2 + 4 B per row.
- ``q4_k_m``: super-blocks of 256 = 8 sub-blocks of 32. Per sub-block j: an fp16 scale d_j and
  an 8-bit min index m_j; per super-block one fp32 min scale dmin; weights x = d_j * q - dmin * m_j
  with 4-bit q in [0, 15]. 4 + 8 * 2 + 8 + 128 = 156 B / 256 weights = 4.875 bits, the rate the
  planner prices (GGUF's q4_k_m mixes 4.5-bit q4_K and 6.5625-bit q6_K tensors, about 4.85
  bits; this format is one fixed rate, not bit-compatible with GGUF).
All scales are computed in fp32 (then rounded to their stored dtype); rounding is half to even.

KV-cache rows (``quantise_rows``/``dequantise_rows``): each row (one token's values) is
quantised on its own in the same format, zero-padded to whole blocks (int8/int4: one scale per
row), and kept as per-row arrays ``[..., count]`` (``row_parts``: scales, then values), so rows
can be written one token at a time. ``row_nbytes`` gives a row's bytes.

Embeddings, norms and biases are not quantised (``quantises``). Knows nothing about plans,
devices or models beyond a tensor's local name.
"""

from __future__ import annotations

import torch

FORMATS = ("q8_0", "q4_0", "int8", "int4", "q4_k_m")
"""Plan weight (and KV) dtypes stored quantised."""
EMBEDDINGS = ("tok", "pos")
"""Local names of lookup tables, kept in fp16 (looked up by row, never multiplied)."""
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


def nbytes(fmt: str, shape: tuple) -> int:
    """Bytes of a packed ``[out, in]`` tensor: q8_0 34 * ceil(n / 32), q4_0 18 * ceil(n / 32),
    int8 out * (in + 4), int4 4 * out + ceil(n / 2), q4_k_m 156 * ceil(n / 256) (n = out * in)."""
    rows, cols = shape
    n = rows * cols
    if fmt in _BLOCKED:
        return row_nbytes(fmt, n)
    if fmt == "int8":
        return rows * (cols + 4)
    if fmt == "int4":
        return 4 * rows + _blocks(n, 2)
    raise ValueError(fmt)


def row_parts(fmt: str, n: int) -> tuple:
    """The per-row arrays of a row of ``n`` values, ((dtype, count), ...): q8_0/q4_0 fp16 scales
    [ceil(n / 32)] and int8 values [32 per block] / packed nibbles [16 per block]; int8/int4 an
    fp32 scale [1] and int8 values [n] / nibbles [ceil(n / 2)]; q4_k_m per super-block an fp32
    dmin, 8 fp16 scales, 8 uint8 mins and 128 bytes of nibbles."""
    if fmt in ("q8_0", "q4_0"):
        nb = _blocks(n, 32)
        return ((torch.float16, nb), (torch.int8, 32 * nb) if fmt == "q8_0" else (torch.uint8, 16 * nb))
    if fmt in ("int8", "int4"):
        return ((torch.float32, 1), (torch.int8, n) if fmt == "int8" else (torch.uint8, _blocks(n, 2)))
    if fmt == "q4_k_m":
        s = _blocks(n, 256)
        return ((torch.float32, s), (torch.float16, 8 * s), (torch.uint8, 8 * s), (torch.uint8, 128 * s))
    raise ValueError(fmt)


def row_nbytes(fmt: str, n: int) -> int:
    """Bytes of one quantised row of ``n`` values: q8_0 34 * ceil(n / 32), q4_0 18 * ceil(n / 32),
    int8 n + 4, int4 ceil(n / 2) + 4, q4_k_m 156 * ceil(n / 256)."""
    return sum(count * torch.empty((), dtype=dtype).element_size() for dtype, count in row_parts(fmt, n))


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values < 16, even count in the last dim -> bytes: low nibble the even element,
    high the odd. [..., 2k] -> [..., k]."""
    q = q.reshape(*q.shape[:-1], -1, 2).to(torch.uint8)
    return q[..., 0] | (q[..., 1] << 4)


def _unpack4(b: torch.Tensor) -> torch.Tensor:
    """[..., k] bytes -> [..., 2k] nibbles."""
    return torch.stack((b & 15, b >> 4), dim=-1).reshape(*b.shape[:-1], -1)


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
    if fmt in ("q8_0", "q4_0"):
        d, q = _symmetric(x.view(m, -1, 32), 127 if fmt == "q8_0" else 7, torch.float16)  # [M, nb, 1], [M, nb, 32]
        vals = q.to(torch.int8) if fmt == "q8_0" else _pack4(q + 8)
        parts = (d.view(m, -1), vals.reshape(m, -1))
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
        q = vals.float() if fmt == "q8_0" else _unpack4(vals).float() - 8
        x = q.reshape(*lead, -1, 32) * d.float()[..., None]              # [..., nb, 32]
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


def quantise(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """w [out, in] (any float dtype) -> packed uint8 [nbytes(fmt, w.shape)] on w's device."""
    if fmt in _BLOCKED:  # one row over the flattened tensor: its blocks, scales first
        return torch.cat([_bytes(p) for p in quantise_rows(fmt, w.reshape(1, -1))])
    if fmt == "int8":
        return torch.cat([_bytes(p) for p in quantise_rows(fmt, w)])
    if fmt == "int4":  # per-row scales, nibbles packed over the flattened tensor
        d, q = _symmetric(w.float(), 7, torch.float32)                   # [out, 1], [out, in]
        q = q.reshape(-1)
        if q.numel() % 2:
            q = torch.cat((q, q.new_zeros(1)))
        return torch.cat((_bytes(d), _pack4(q + 8)))
    raise ValueError(fmt)


def dequantise(fmt: str, packed: torch.Tensor, shape: tuple, out: torch.Tensor) -> torch.Tensor:
    """packed uint8 (from ``quantise``) -> ``out`` [out, in] (any float dtype, same device)."""
    rows, cols = shape
    n = rows * cols
    if fmt in _BLOCKED:
        parts, offset = [], 0
        for dtype, count in row_parts(fmt, n):
            size = count * torch.empty((), dtype=dtype).element_size()
            parts.append(packed[offset:offset + size].view(dtype).view(1, count))
            offset += size
        x = dequantise_rows(fmt, tuple(parts), n)
    elif fmt in ("int8", "int4"):
        d = packed[:4 * rows].view(torch.float32).view(rows, 1)
        if fmt == "int8":
            x = dequantise_rows(fmt, (d, packed[4 * rows:].view(torch.int8).view(rows, cols)), cols)
        else:
            x = (_unpack4(packed[4 * rows:])[:n].float() - 8).view(rows, cols) * d
    else:
        raise ValueError(fmt)
    return out.copy_(x.reshape(rows, cols))
