"""Quantised weight formats: byte sizes, quantise (at load time) and dequantise (per stage).

Every format quantises a 2-D linear weight ``[out, in]`` flattened row by row, so a block of 32
weights runs along the input dim (rows whose length is a multiple of 32 hold whole blocks; the
last block of a tensor is zero-padded). A packed tensor is one flat uint8 buffer; its sections
come widest element first (fp32, then fp16, then bytes) so each one is a valid typed view.

- ``q8_0``: blocks of 32: fp16 scale d = max|x| / 127, int8 q = round(x / d). 34 B / 32 weights.
- ``q4_0``: blocks of 32: fp16 scale d = max|x| / 7, q = round(x / d) in [-8, 7] stored as
  q + 8, two per byte (low nibble first). 18 B / 32 weights (4.5 bits).
- ``int8``: per output row: fp32 scale d = max|x| / 127, int8 values. in + 4 B per row.
- ``int4``: per output row: fp32 scale d = max|x| / 7, 4-bit values as in q4_0, packed over the
  flattened tensor. in / 2 + 4 B per row.
- ``q4_k_m``: super-blocks of 256 = 8 sub-blocks of 32. Per sub-block j: an fp16 scale d_j and
  an 8-bit min index m_j; per super-block one fp32 min scale dmin; weights x = d_j * q - dmin * m_j
  with 4-bit q in [0, 15]. 4 + 8 * 2 + 8 + 128 = 156 B / 256 weights = 4.875 bits, 0.5% above
  the planner's 4.85 (GGUF's q4_k_m mixes 4.5-bit q4_K and 6.5625-bit q6_K tensors; this
  format is one fixed rate, not bit-compatible with GGUF).

Embeddings, norms and biases are not quantised (``quantises``). Knows nothing about plans,
devices or models beyond a tensor's local name.
"""

from __future__ import annotations

import torch

FORMATS = ("q8_0", "q4_0", "int8", "int4", "q4_k_m")
"""Plan weight dtypes stored quantised."""
EMBEDDINGS = ("tok", "pos")
"""Local names of lookup tables, kept in fp16 (looked up by row, never multiplied)."""


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
    if fmt == "q8_0":
        return 34 * _blocks(n, 32)
    if fmt == "q4_0":
        return 18 * _blocks(n, 32)
    if fmt == "int8":
        return rows * (cols + 4)
    if fmt == "int4":
        return 4 * rows + _blocks(n, 2)
    if fmt == "q4_k_m":
        return 156 * _blocks(n, 256)
    raise ValueError(fmt)


def _padded(w: torch.Tensor, size: int) -> torch.Tensor:
    """w flattened to fp32 [blocks, size], zero-padded."""
    flat = w.reshape(-1).float()
    pad = _blocks(flat.numel(), size) * size - flat.numel()
    return torch.cat((flat, flat.new_zeros(pad))).view(-1, size) if pad else flat.view(-1, size)


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values < 16, even count -> bytes: low nibble the even element, high the odd."""
    q = q.reshape(-1, 2).to(torch.uint8)
    return q[:, 0] | (q[:, 1] << 4)


def _unpack4(b: torch.Tensor) -> torch.Tensor:
    return torch.stack((b & 15, b >> 4), dim=-1).reshape(-1)


def _safe(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.ones_like(d), d)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


def quantise(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """w [out, in] (any float dtype) -> packed uint8 [nbytes(fmt, w.shape)] on w's device."""
    rows, cols = w.shape
    if fmt in ("q8_0", "q4_0"):
        x = _padded(w, 32)                                               # [nb, 32]
        qmax = 127 if fmt == "q8_0" else 7
        d = (x.abs().amax(dim=1, keepdim=True) / qmax).half()
        q = torch.round(x / _safe(d.float())).clamp_(-qmax - (fmt == "q4_0"), qmax)
        vals = _bytes(q.to(torch.int8)) if fmt == "q8_0" else _pack4(q + 8)
        return torch.cat((_bytes(d), vals))
    if fmt in ("int8", "int4"):
        x = w.float()
        qmax = 127 if fmt == "int8" else 7
        d = x.abs().amax(dim=1, keepdim=True) / qmax                     # [out, 1] fp32
        q = torch.round(x / _safe(d)).clamp_(-qmax - (fmt == "int4"), qmax).reshape(-1)
        if fmt == "int8":
            return torch.cat((_bytes(d), _bytes(q.to(torch.int8))))
        if q.numel() % 2:
            q = torch.cat((q, q.new_zeros(1)))
        return torch.cat((_bytes(d), _pack4(q + 8)))
    if fmt == "q4_k_m":
        x = _padded(w, 256).view(-1, 8, 32)                              # [nsb, 8, 32]
        m = (-x.amin(dim=2)).clamp_(min=0)                               # [nsb, 8] mins to subtract
        dmin = m.amax(dim=1, keepdim=True) / 255                         # [nsb, 1] fp32
        mq = torch.round(m / _safe(dmin)).clamp_(0, 255)
        m = mq * dmin
        d = ((x.amax(dim=2) + m) / 15).half()                            # [nsb, 8]
        q = torch.round((x + m[..., None]) / _safe(d.float())[..., None]).clamp_(0, 15)
        return torch.cat((_bytes(dmin), _bytes(d), _bytes(mq.to(torch.uint8)), _pack4(q)))
    raise ValueError(fmt)


def dequantise(fmt: str, packed: torch.Tensor, shape: tuple, out: torch.Tensor) -> torch.Tensor:
    """packed uint8 (from ``quantise``) -> ``out`` [out, in] (any float dtype, same device)."""
    rows, cols = shape
    n = rows * cols
    if fmt in ("q8_0", "q4_0"):
        nb = _blocks(n, 32)
        d = packed[:2 * nb].view(torch.float16).float().view(nb, 1)
        if fmt == "q8_0":
            q = packed[2 * nb:].view(torch.int8).float().view(nb, 32)
        else:
            q = _unpack4(packed[2 * nb:]).float().view(nb, 32) - 8
        x = (q * d).view(-1)
    elif fmt in ("int8", "int4"):
        d = packed[:4 * rows].view(torch.float32).view(rows, 1)
        if fmt == "int8":
            q = packed[4 * rows:].view(torch.int8).float()
        else:
            q = _unpack4(packed[4 * rows:]).float() - 8
        x = (q[:n].view(rows, cols) * d).view(-1)
    elif fmt == "q4_k_m":
        nsb = _blocks(n, 256)
        dmin = packed[:4 * nsb].view(torch.float32).view(nsb, 1, 1)
        d = packed[4 * nsb:20 * nsb].view(torch.float16).float().view(nsb, 8, 1)
        mq = packed[20 * nsb:28 * nsb].float().view(nsb, 8, 1)
        q = _unpack4(packed[28 * nsb:]).float().view(nsb, 8, 32)
        x = (q * d - mq * dmin).view(-1)
    else:
        raise ValueError(fmt)
    return out.copy_(x[:n].view(rows, cols))
