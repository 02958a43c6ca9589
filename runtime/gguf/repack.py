"""ggml blocks -> the runtime's formats, and -> fp32, for the types the planner prices.

Each function takes one tensor's rows as stored, uint8 ``[rows, bytes per row]`` (a row of a
linear weight is ``cols / block`` blocks back to back), and returns torch tensors:

- ``to_runtime(type, data, cols)``: the ``hetplan.dtypes.row_parts`` arrays of the runtime
  format ``hetplan.frontends.gguf.held.FORMATS`` names, each ``[rows, count]``:
  Q8_0 and Q4_0 blocks (fp16 d, then 32 int8 values / 16 bytes of nibbles) are split into the
  scales and the values, unchanged; Q4_K super-blocks (fp16 d, fp16 dmin, 12 bytes of 6-bit
  scales sc_j and mins m_j, 128 bytes of nibbles: sub-blocks 2p and 2p + 1 in the low and high
  nibbles of bytes 32p..32p + 31) become q4_k_m's fp32 dmin, fp16 d * sc_j, uint8 m_j and the
  nibbles repacked in element order; Q6_K, Q5_K and Q5_0 are decoded and requantised to q8_0.
- ``dequantise(type, data, cols)``: the values, fp32 ``[rows, cols]``: Q8_0 d q; Q4_0
  d (q - 8); Q4_K (d sc_j) q - (dmin m_j); Q6_K (d sc_k)(q - 32), q the 6-bit value of 4 low bits
  (ql) and 2 high bits (qh); Q5_K (d sc_j)(q + 16 h) - dmin m_j; Q5_0 d (q + 16 h - 16), h the
  fifth bit (qh); F16/BF16/F32 as stored.

Knows nothing about files, names or models.
"""

from __future__ import annotations

import torch

from hetplan.runtime.kernels import quant

BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 144), "Q6_K": (256, 210), "Q5_0": (32, 22),
         "Q5_K": (256, 176)}
"""ggml type -> (values, bytes) per block."""
REQUANTISED = ("Q6_K", "Q5_K", "Q5_0")
"""Types decoded and requantised to q8_0 (``hetplan.frontends.gguf.held.FORMATS``)."""
FLOAT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> [...] fp16 values (little endian)."""
    return b.contiguous().view(torch.float16).squeeze(-1)


def _nibbles(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return b & 15, b >> 4


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of 6-bit scales and mins of a Q4_K / Q5_K super-block -> (sc, m), each [..., 8]."""
    lo, hi, mix = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)), dim=-1)
    m = torch.cat((hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)), dim=-1)
    return sc, m


def _q4k_fields(data: torch.Tensor, cols: int):
    """Q4_K rows -> (d [R, s], dmin [R, s], sc [R, s, 8], m [R, s, 8], q [R, s, 8, 32])."""
    rows = data.shape[0]
    b = data.reshape(rows, cols // 256, 144)
    d, dmin, qs = _fp16(b[..., 0:2]), _fp16(b[..., 2:4]), b[..., 16:]
    sc, m = _k_scales(b[..., 4:16])
    low, high = _nibbles(qs.reshape(rows, -1, 4, 32))
    q = torch.stack((low, high), dim=-2).reshape(rows, -1, 8, 32)       # sub-block 2p low, 2p + 1 high
    return d, dmin, sc, m, q


def _q5k_values(data: torch.Tensor, cols: int) -> torch.Tensor:
    """Q5_K rows -> fp32 [R, cols]: fp16 d, fp16 dmin, 12 bytes of scales and mins, 32 bytes qh,
    128 bytes of low nibbles laid out as Q4_K's; value (d sc_j)(q + 16 h) - dmin m_j, where bit j
    of qh[l] is the high bit h of element l of sub-block j."""
    rows = data.shape[0]
    b = data.reshape(rows * (cols // 256), 176)
    n = b.shape[0]
    d, dmin, qh = _fp16(b[:, 0:2]).float(), _fp16(b[:, 2:4]).float(), b[:, 16:48]
    sc, m = _k_scales(b[:, 4:16])
    low, high = _nibbles(b[:, 48:176].reshape(n, 4, 32))
    q = torch.stack((low, high), dim=2).reshape(n, 8, 32).to(torch.int16)
    bits = torch.stack([(qh >> j) & 1 for j in range(8)], dim=1).to(torch.int16)     # [n, 8, 32]
    q = (q + 16 * bits).float()
    value = (d[:, None] * sc.float())[..., None] * q - (dmin[:, None] * m.float())[..., None]
    return value.reshape(rows, cols)


def _q5_0_values(data: torch.Tensor, cols: int) -> torch.Tensor:
    """Q5_0 rows -> fp32 [R, cols]: per 32 values fp16 d, 4 bytes qh (bit j: the high bit of
    value j), 16 bytes of nibbles (values 0..15 low, 16..31 high); value d (q + 16 h - 16)."""
    rows = data.shape[0]
    b = data.reshape(rows, cols // 32, 22)
    d = _fp16(b[..., 0:2]).float()
    bits = ((b[..., 2:6, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(rows, -1, 32)
    low, high = _nibbles(b[..., 6:22])
    q = torch.cat((low, high), dim=-1).to(torch.int16) + 16 * bits.to(torch.int16) - 16
    return (q.float() * d[..., None]).reshape(rows, cols)


def _q6k_values(data: torch.Tensor, cols: int) -> torch.Tensor:
    """Q6_K rows -> fp32 [R, cols]."""
    rows = data.shape[0]
    b = data.reshape(rows * (cols // 256), 210)
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _fp16(b[:, 208:210])
    low = torch.stack(_nibbles(ql.reshape(n, 2, 64)), dim=2).reshape(n, 8, 32)      # [n, 8, 32]
    high = torch.stack([(qh.reshape(n, 2, 32) >> s) & 3 for s in (0, 2, 4, 6)], dim=2).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int16) - 32).reshape(n, 16, 16).float()
    scale = d.float()[:, None] * scales.contiguous().view(torch.int8).float()          # [n, 16]
    return (scale[..., None] * q).reshape(rows, cols)


def to_runtime(kind: str, data: torch.Tensor, cols: int) -> tuple:
    """Rows of ggml type ``kind`` -> the runtime format's row-part arrays (module docstring)."""
    rows = data.shape[0]
    if kind in ("Q8_0", "Q4_0"):
        b = data.reshape(rows, -1, BLOCK[kind][1])
        vals = b[..., 2:].reshape(rows, -1)
        return _fp16(b[..., 0:2]).contiguous(), (vals.view(torch.int8) if kind == "Q8_0" else vals).contiguous()
    if kind == "Q4_K":
        d, dmin, sc, m, q = _q4k_fields(data, cols)
        scales = (d.float()[..., None] * sc.float()).half().reshape(rows, -1)
        pairs = q.reshape(rows, -1, 2)
        nibbles = pairs[..., 0] | (pairs[..., 1] << 4)
        return dmin.float().contiguous(), scales, m.reshape(rows, -1).contiguous(), nibbles.contiguous()
    if kind in REQUANTISED:
        return quant.quantise_rows("q8_0", dequantise(kind, data, cols))
    raise ValueError(f"{kind} has no runtime format")


def dequantise(kind: str, data: torch.Tensor, cols: int) -> torch.Tensor:
    """Rows of ggml type ``kind`` -> fp32 [rows, cols] (module docstring)."""
    rows = data.shape[0]
    if kind in FLOAT:
        return data.contiguous().view(FLOAT[kind]).reshape(rows, cols).to(torch.float32, copy=True)
    if kind == "Q8_0":
        d, vals = to_runtime(kind, data, cols)
        return (vals.float().reshape(rows, -1, 32) * d.float()[..., None]).reshape(rows, cols)
    if kind == "Q4_0":
        d, vals = to_runtime(kind, data, cols)
        low, high = _nibbles(vals.reshape(rows, -1, 16))
        q = torch.cat((low, high), dim=-1).float() - 8
        return (q * d.float()[..., None]).reshape(rows, cols)
    if kind == "Q4_K":
        d, dmin, sc, m, q = _q4k_fields(data, cols)
        scale = d.float()[..., None] * sc.float()
        low = dmin.float()[..., None] * m.float()
        return (scale[..., None] * q.float() - low[..., None]).reshape(rows, cols)
    if kind == "Q6_K":
        return _q6k_values(data, cols)
    if kind == "Q5_K":
        return _q5k_values(data, cols)
    if kind == "Q5_0":
        return _q5_0_values(data, cols)
    raise ValueError(f"{kind} cannot be dequantised here")


def row_bytes(kind: str, cols: int) -> int:
    """Bytes of one stored row of ``cols`` values."""
    if kind in FLOAT:
        return cols * torch.empty((), dtype=FLOAT[kind]).element_size()
    values, size = BLOCK[kind]
    return cols // values * size
