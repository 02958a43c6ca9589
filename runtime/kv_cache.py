"""The values of one attention block's KV cache, plain or quantised per token row.

A cache value (``k``, ``v``; MLA's ``latent``, ``k_rope``) holds ``[B, T, ...]``
(``backend.kv_shapes``). In a plain KV dtype (fp32, fp16, bf16) it is one tensor of that shape.
In a quantised one (q8_0, q4_0, int8, int4, q4_k_m; ``hetplan.runtime.kernels.quant``) it is a
``QuantisedValue``: each token's row, the value's trailing dims flattened (KVH * hd for k and v,
r or rope for MLA), is quantised on its own and kept as per-row arrays ``[B, T, count]``
(scales, values), so a step writes only its tokens' rows and a row never depends on another.

Stages go through ``write`` and ``read``, which take either kind: ``write`` stores new tokens
(prefill, decode, and ``kv_down`` copying the prompt's values from the GPU, quantised before
they cross), ``read`` returns the used prefix in the compute dtype (a view of a plain cache, a
dequantised copy of a quantised one).

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


def read(value, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Positions [0, end) of every sequence, [B, end, ...], in ``dtype``.

    A quantised value is dequantised here into a transient copy of the prefix: B * end * row_len
    elements of ``dtype``, plus fp32 intermediates of that size while dequantising. An attention
    stage reads both values of its layer, so it holds B * end * kv_elems_per_token such elements
    until its attention returns (llama-3-8B, one sequence of 8192 tokens, fp32 on the CPU:
    64 MiB), one layer at a time per device. The planner's workspace does not count it."""
    if isinstance(value, QuantisedValue):
        rows = quant.dequantise_rows(value.fmt, tuple(p[:, :end] for p in value.parts), value.row_len)
        return rows.to(dtype).reshape(value.shape[0], end, *value.shape[2:])
    prefix = value[:, :end]
    return prefix if prefix.dtype == dtype else prefix.to(dtype)


def _row_len(shape: tuple) -> int:
    n = 1
    for s in shape[2:]:
        n *= s
    return n
