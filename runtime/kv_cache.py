"""The values of one attention block's KV cache, plain or quantised per token row.

A cache value (``k``, ``v``; MLA's ``latent``, ``k_rope``) holds ``[B, T, ...]``
(``backend.kv_shapes``). In a plain KV dtype (fp32, fp16, bf16) it is one tensor of that shape.
In a quantised one (q8_0, q4_0, int8, int4, q4_k_m; ``hetplan.runtime.kernels.quant``) it is a
``QuantisedValue``: each token's row, the value's trailing dims flattened (KVH * hd for k and v,
r or rope for MLA), is quantised on its own and kept as per-row arrays ``[B, T, count]``
(scales, values), so a step writes only its tokens' rows and a row never depends on another.

Stages go through ``write`` and ``attend``, which take either kind: ``write`` stores new tokens
(prefill, decode, and ``kv_down`` copying the prompt's values from the GPU, quantised before
they cross); ``attend`` computes attention over the used prefix where it lies, block by block
(``read_blocks``: views of a plain cache in the compute dtype, else ``READ_BLOCK_TOKENS``
positions at a time converted or dequantised), merging the blocks' softmax online, so a step
never copies the prefix. ``in_place`` says when the whole prefix is already a view in the
compute dtype (``read``), which an attention kernel can take as it is.

Knows nothing about plans, schedules or models beyond a value's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetplan.errors import HetplanError
from hetplan.runtime.kernels import quant
from hetplan.runtime.weights import TORCH_DTYPES

KV_DTYPES = (*TORCH_DTYPES, *quant.FORMATS)
"""Plan KV dtypes the runtime stores."""


def storage(kv_dtype: str) -> torch.dtype | str:
    """How a plan's ``--kv-dtype`` is stored: a torch dtype, or the name of a quantised format."""
    if kv_dtype in TORCH_DTYPES:
        return TORCH_DTYPES[kv_dtype]
    if quant.is_quantised(kv_dtype):
        return kv_dtype
    raise HetplanError(f"plan --kv-dtype {kv_dtype}: the torch runtime stores KV caches in "
                       f"{' '.join(KV_DTYPES)}; recompile the plan with --kv-dtype set to one of them")


@dataclass(frozen=True)
class QuantisedValue:
    """One cache value in a quantised format: ``quant.row_parts`` arrays, each [B, T, count]."""
    fmt: str
    shape: tuple
    """[B, T, ...] as the backend sees it."""
    parts: tuple

    @property
    def row_len(self) -> int:
        return _row_len(self.shape)


def allocate(devices, tier: str, shape: tuple, kv: torch.dtype | str, what: str, pinned: bool):
    """A zeroed cache value of ``shape`` in ``tier``, counted by ``devices``: a tensor in a plain
    dtype, or a ``QuantisedValue`` whose arrays take ``quant.row_nbytes`` bytes per token."""
    if not isinstance(kv, str):
        return devices.empty(tier, shape, kv, what, pinned=pinned).zero_()
    b, t = shape[:2]
    parts = tuple(devices.empty(tier, (b, t, count), dtype, f"{what} (array {i})", pinned=pinned).zero_()
                  for i, (dtype, count) in enumerate(quant.row_parts(kv, _row_len(shape))))
    return QuantisedValue(kv, tuple(shape), parts)


def nbytes(value) -> int:
    """Bytes a cache value holds."""
    arrays = value.parts if isinstance(value, QuantisedValue) else (value,)
    return sum(a.numel() * a.element_size() for a in arrays)


def write(value, start: int, x: torch.Tensor, non_blocking: bool = False) -> None:
    """Store x [B, S, ...] at positions [start, start + S) of every sequence. x may live on
    another device than the cache (``kv_down``): then one contiguous copy per sequence and array,
    after quantising on x's device (only the packed rows cross)."""
    b, s = x.shape[:2]
    if isinstance(value, QuantisedValue):
        pairs = zip(value.parts, quant.quantise_rows(value.fmt, x.reshape(b, s, -1)))
    else:
        pairs = ((value, x),)
    for dst, src in pairs:
        if src.device == dst.device:
            dst[:, start:start + s].copy_(src)
            continue
        src = src.contiguous()
        for i in range(b):
            dst[i, start:start + s].copy_(src[i], non_blocking=non_blocking)


READ_BLOCK_TOKENS = 256
"""Positions ``read_blocks`` converts or dequantises at a time (``hetplan.graph.KV_READ_TOKENS``
prices them)."""


def in_place(value, dtype: torch.dtype) -> bool:
    """Whether ``value`` is read as a view in ``dtype``: a plain cache of that dtype."""
    return not isinstance(value, QuantisedValue) and value.dtype == dtype


def read(value, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Positions [0, end) of every sequence, [B, end, ...]: a view of a cache that is
    ``in_place`` in ``dtype``; any other is refused (read it with ``read_blocks``)."""
    if not in_place(value, dtype):
        raise ValueError(f"a {_kind(value)} cache is not read whole in {dtype}: read it with read_blocks")
    return value[:, :end]


def read_blocks(value, end: int, dtype: torch.dtype, block: int = READ_BLOCK_TOKENS):
    """(start, [B, n, ...] in ``dtype``) for positions [0, end) in blocks of ``block``: views of a
    plain cache in ``dtype``; otherwise each block converted, or dequantised (fp32 intermediates
    of its size), on its own: B * block * row_len elements at a time, never the prefix."""
    for s in range(0, end, block):
        e = min(end, s + block)
        if isinstance(value, QuantisedValue):
            rows = quant.dequantise_rows(value.fmt, tuple(p[:, s:e] for p in value.parts), value.row_len)
            yield s, rows.to(dtype).reshape(value.shape[0], e - s, *value.shape[2:])
        else:
            part = value[:, s:e]
            yield s, part if part.dtype == dtype else part.to(dtype)


def attend(queries: tuple, keys: tuple, value, end: int, offset: int, new: int, scale: float) -> torch.Tensor:
    """softmax(sum_i q_i k_i^T * scale, causal) v over cache positions [0, end), in place.

    queries: [B, Hk, M, d_i] each, M rows per cache head; row r is at position
    offset + r mod ``new`` (a head's ``new`` positions in order, the heads of a group stacked).
    keys: cache values [B, T, Hk, d_i] (or [B, T, d_i] for one head); value: a cache value
    [B, T, Hk, dv] (or [B, T, dv]), which may be one of ``keys`` (then read once per block).
    -> [B, Hk, M, dv] in the queries' dtype. Online softmax over ``read_blocks``: per block the
    scores [B, Hk, M, block] in fp32, its running max m, sum l and output rescaled by
    exp(m_old - m_new); a block's keys beyond a row's position are masked."""
    q0 = queries[0]
    dtype, dev = q0.dtype, q0.device
    b, hk, m = q0.shape[:3]
    pos = offset + torch.arange(m, device=dev) % new                         # [M]
    top = torch.full((b, hk, m, 1), float("-inf"), device=dev)
    total = torch.zeros((b, hk, m, 1), device=dev)
    acc = None
    readers = [read_blocks(k, end, dtype) for k in keys]
    shared = next((i for i, k in enumerate(keys) if k is value), None)
    values = read_blocks(value, end, dtype) if shared is None else None
    qf = [q.float() for q in queries]
    for parts in zip(*readers):
        s = parts[0][0]
        blocks = [_heads(p) for _, p in parts]                               # [B, Hk, L, d_i]
        v = blocks[shared] if shared is not None else _heads(next(values)[1])
        scores = sum(q @ k.float().transpose(-1, -2) for q, k in zip(qf, blocks)) * scale  # [B, Hk, M, L]
        keys_at = s + torch.arange(scores.shape[-1], device=dev)
        scores.masked_fill_(keys_at[None, :] > pos[:, None], float("-inf"))
        new_top = torch.maximum(top, scores.amax(dim=-1, keepdim=True))
        p = torch.exp(scores - new_top)
        fix = torch.exp(top - new_top)
        total = total * fix + p.sum(dim=-1, keepdim=True)
        out = p @ v.float()                                                  # [B, Hk, M, dv]
        acc = out if acc is None else acc * fix + out
        top = new_top
    return (acc / total).to(dtype)


def _heads(block: torch.Tensor) -> torch.Tensor:
    """A cache block [B, L, Hk, d] -> [B, Hk, L, d]; [B, L, d] -> [B, 1, L, d] (views)."""
    return block[:, None] if block.dim() == 3 else block.transpose(1, 2)


def _kind(value) -> str:
    return value.fmt if isinstance(value, QuantisedValue) else str(value.dtype)


def _row_len(shape: tuple) -> int:
    n = 1
    for s in shape[2:]:
        n *= s
    return n
