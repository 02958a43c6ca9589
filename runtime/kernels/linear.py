"""Linear layers on weights as they are stored: packed quantised bytes, 16-bit or fp32 tensors.

Stages call ``linear(x, w, bias)`` (``F.linear``'s contract: y = x @ w^T + bias) with ``w``
either a tensor or a ``PackedLinear``, the packed rows of one linear (or of several fused ones,
``qkv``/``gate_up``, concatenated along the output dim) as ``quant.split`` views them. Where
it runs:

- a packed weight on the CPU: the native kernel (``native``), which reads the packed bytes.
  For up to 8 rows of x (decode), on a CPU with AVX-512 VNNI or AVX2 (``HETPLAN_INT8_DECODE=0``
  turns it off), x is quantised per block of 32 as q8_0 is and each block's dot product taken in
  int8 (``qdecode.h``, ``qdecode_avx2.h``; the same activation-rounding bound as int8 prefill,
  below); otherwise each block of 32 weights is dequantised in registers and multiplied in fp32
  (exact against the dequantised weights). Either reads each weight byte once per step. For more
  rows (prefill), on a CPU with AVX-512 VNNI or AVX2 (``HETPLAN_INT8_PREFILL=0`` turns it off),
  x is quantised per block of 32 as q8_0 is and each block multiplied in int8 (``qint8.h``,
  ``qdecode_avx2.h``; quantising x moves an output by at most sum
  over blocks b of (max|x_b| / 254) * sum_{k in b} |w_k|, beyond fp32 accumulation); otherwise a
  tile of about 1 MiB of weights is dequantised into cache and multiplied by torch's GEMM.
  The kernels' parallel regions run on torch's intra-op (OpenMP) threads.
- a packed weight elsewhere (CUDA), or where the native kernel did not build: the same tiling
  in torch, a tile of ``TILE_ELEMS`` weights dequantised (``quant.dequantise_rows``) and
  multiplied at a time, never the whole weight.
- a bf16/fp16 tensor on the CPU with up to 8 rows of x: the native kernel, upcasting each block
  of 32 in registers (decode near the bandwidth bound; on a 2-core AVX512-BF16 EPYC 2.7x faster
  than torch's bf16 GEMV), unless ``HETPLAN_CPU_16BIT=1`` asks for torch's on a CPU with native
  16-bit arithmetic (``cpu_has_16bit``). With more rows (prefill): ``F.linear`` where the CPU has
  GEMMs in that dtype (``cpu_gemms_16bit``: AVX512-BF16 or AMX for bf16, AVX512-FP16 or AMX for
  fp16); elsewhere torch's GEMM there is emulated (1.3 GFLOP/s on a 2-core AVX2 EPYC, against 168
  in fp32), so x is multiplied in fp32 by a tile of ``TILE_ELEMS`` weights upcast at a time
  (``upcast_linear``), each output tile rounded back to x's dtype.
- an fp32 tensor on the CPU with up to 8 rows of x: the native kernel's fp32 GEMV (torch's
  reads at about half the DRAM stream on 2 cores); otherwise ``F.linear``.

A ``PackedLinear`` also dequantises whole (``dense()``) for the few stages that need the
matrix itself (MLA's absorbed ``kv_b``). Knows nothing about plans, tiers or models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetplan.graph import DEQUANT_TILE_ELEMS, upcast_rows
from hetplan.runtime.kernels import native, quant

FORMAT_IDS = {"q8_0": 0, "q4_0": 1, "int8": 2, "int4": 3, "q4_k_m": 4, torch.bfloat16: 5, torch.float16: 6,
              torch.float32: 7}
"""The native kernel's format numbers (``qmatmul.cpp``'s ``Fmt``)."""
SMALL_M = 8
"""Rows of x up to which the native kernel multiplies directly (its ``SMALL_M``)."""
TILE_ELEMS = DEQUANT_TILE_ELEMS  # the planner prices this tile (hetplan.graph)
"""Weights dequantised at a time by the torch path."""


@dataclass(frozen=True)
class PackedLinear:
    """A linear weight ``[sum of rows, cols]`` in format ``fmt``: ``segments`` are each one
    packed linear's ``quant.split`` arrays (each ``[rows, count]``), stacked along the output dim."""
    fmt: str
    cols: int
    segments: tuple
    target: torch.Tensor | None = None
    """Where ``dense()`` dequantises to (a view of the stage's dequantisation buffer), if anywhere."""

    @property
    def shape(self) -> tuple:
        return (sum(s[0].shape[0] for s in self.segments), self.cols)

    @property
    def device(self) -> torch.device:
        return self.segments[0][0].device

    def data_ptr(self) -> int:
        """Address of the first packed byte (where the weight lies: a block's bytes or a slot)."""
        return self.segments[0][0].data_ptr()

    @classmethod
    def cat(cls, parts: list) -> "PackedLinear":
        """``parts`` (same format and cols) stacked along the output dim."""
        if len({(p.fmt, p.cols) for p in parts}) != 1:
            raise ValueError("PackedLinear.cat: parts of different formats or widths")
        return cls(parts[0].fmt, parts[0].cols, tuple(s for p in parts for s in p.segments))

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole matrix, dequantised (into ``target`` where one is set)."""
        x = torch.cat([quant.dequantise_rows(self.fmt, seg, self.cols) for seg in self.segments])
        return self.target.copy_(x) if self.target is not None else x.to(dtype)


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w^T (+ bias): ``F.linear`` for a tensor ``w``, the packed kernels for a
    ``PackedLinear``."""
    if isinstance(w, PackedLinear):
        y = packed_linear(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], -1)
    elif _native_dense(x, w):
        y = native.module().matmul(x.reshape(-1, x.shape[-1]).float(), FORMAT_IDS[w.dtype], w.shape[1], [w], False)
        y = y.to(x.dtype).view(*x.shape[:-1], -1)
    elif _upcast(w):
        y = upcast_linear(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], -1)
    else:
        return F.linear(x, w, bias)
    return y.add_(bias) if bias is not None else y


def linear_t(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w for a checkpoint's transposed ``[in, out]`` tensor (GPT-2's Conv1D); a packed one
    holds ``[out, in]`` rows already (``quant.stored_shape``)."""
    if isinstance(w, PackedLinear):
        return linear(x, w)
    if _upcast(w):
        return upcast_linear(x.reshape(-1, x.shape[-1]), w, transposed=True).view(*x.shape[:-1], -1)
    return torch.matmul(x, w)


def upcast_linear(x: torch.Tensor, w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """x [M, K] @ w^T for a 16-bit w [N, K] (``transposed``: x @ w for w [K, N]), multiplied in
    fp32, ``TILE_ELEMS`` weights upcast at a time (into cache, never the whole weight) -> [M, N]
    in x's dtype. x is taken ``upcast_rows(K)`` rows at a time, so besides its output it holds
    those rows, one tile of weights and their products in fp32 (``hetplan.graph.upcast_bytes``
    prices them); a long prompt upcasts each tile once per block of rows, a few per cent of the
    GEMM's time."""
    n, k = (w.shape[1] if transposed else w.shape[0]), x.shape[1]
    out = x.new_empty(x.shape[0], n)
    step, rows = max(1, TILE_ELEMS // max(k, 1)), upcast_rows(k, TILE_ELEMS)
    # one fp32 tile, reused: a fresh one per tile is a large allocation the allocator may map and
    # unmap each time, page faults and all
    buf = torch.empty(min(step, n) * k, dtype=torch.float32, device=w.device)
    for r0 in range(0, x.shape[0], rows):
        xf = x[r0:r0 + rows].float()
        for c0 in range(0, n, step):
            c1 = min(n, c0 + step)
            if transposed:   # w [K, N]: its columns c0:c1 as a [K, c1 - c0] tile
                tile = buf[:k * (c1 - c0)].view(k, c1 - c0).copy_(w[:, c0:c1])
            else:            # w [N, K]: rows c0:c1, multiplied transposed
                tile = buf[:(c1 - c0) * k].view(c1 - c0, k).copy_(w[c0:c1]).t()
            out[r0:r0 + rows, c0:c1] = xf @ tile
    return out


def packed_linear(x: torch.Tensor, w: PackedLinear) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype, reading ``w``'s packed bytes."""
    mod = native.module() if w.device.type == "cpu" else None
    if mod is not None:   # one call for all segments: x read (and quantised) once
        int8 = int8_decode() if x.shape[0] <= SMALL_M else int8_prefill()
        return mod.matmul_cat(x.float(), FORMAT_IDS[w.fmt], w.cols, w.segments, int8).to(x.dtype)
    outs = [_tiled(x, w.fmt, w.cols, seg) for seg in w.segments]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _tiled(x: torch.Tensor, fmt: str, cols: int, seg: tuple) -> torch.Tensor:
    """The torch path: ``TILE_ELEMS`` weights at a time dequantised and multiplied."""
    rows = seg[0].shape[0]
    step = max(1, TILE_ELEMS // max(cols, 1))
    out = x.new_empty(x.shape[0], rows)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        tile = quant.dequantise_rows(fmt, tuple(p[r0:r1] for p in seg), cols).to(x.dtype)
        out[:, r0:r1] = x @ tile.t()
    return out


def int8_prefill() -> bool:
    """Whether the native kernel multiplies prefill-sized x on packed weights in int8: it was
    built with AVX-512 VNNI or AVX2 (``has_int8``) and ``HETPLAN_INT8_PREFILL`` is not 0. On by
    default: 1.7-2.0x the fp32 tiles' prefill of 512 tokens on a 2-core AVX-512 EPYC, and
    about 2x at 64 tokens on a 2-core AVX2 EPYC (bench/RESULTS.md), at the cost of the
    activation-rounding bound."""
    from hetplan.env import switch
    mod = native.module()
    return mod is not None and mod.has_int8() and switch("HETPLAN_INT8_PREFILL", True)


def int8_decode() -> bool:
    """Whether the native kernel multiplies decode-sized x (up to ``SMALL_M`` rows) on packed
    weights in int8: it was built with AVX-512 VNNI or AVX2 (``has_int8``) and
    ``HETPLAN_INT8_DECODE`` is not 0. On by default: 2-4x the fp32 kernel's throughput for the
    4-bit formats, 1.6-1.9x for q8_0 / int8 with VNNI, 2.3-3.2x and 1.4-1.7x with AVX2
    (``bench/quant_kernels.py``), at the cost of the activation-rounding bound."""
    from hetplan.env import switch
    mod = native.module()
    return mod is not None and mod.has_int8() and switch("HETPLAN_INT8_DECODE", True)


_CPU_16BIT: dict = {}


def cpu_has_16bit(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies ``dtype`` natively (AVX512-BF16 for bf16, AVX512-FP16 for
    fp16), when ``HETPLAN_CPU_16BIT=1`` asks for torch's 16-bit GEMV there (default: no, the
    upcasting kernel runs)."""
    from hetplan.env import switch
    if not switch("HETPLAN_CPU_16BIT", False):
        return False
    if dtype not in _CPU_16BIT:
        flags = set(native.cpu_flags().split())
        _CPU_16BIT[dtype] = ("avx512_bf16" if dtype == torch.bfloat16 else "avx512_fp16") in flags
    return _CPU_16BIT[dtype]


_CPU_GEMMS_16BIT = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
"""CPU flags under which torch's (oneDNN's) GEMM multiplies that dtype in hardware."""


def cpu_gemms_16bit(dtype: torch.dtype) -> bool:
    """Whether torch's GEMM in ``dtype`` runs in hardware on this CPU (``_CPU_GEMMS_16BIT``),
    not emulated. ``HETPLAN_CPU_UPCAST=1`` answers no everywhere (the upcasting path, e.g. to
    test it on such a CPU)."""
    from hetplan.env import switch
    if switch("HETPLAN_CPU_UPCAST", False):
        return False
    key = ("gemm", dtype)
    if key not in _CPU_16BIT:
        _CPU_16BIT[key] = bool(set(_CPU_GEMMS_16BIT[dtype]) & set(native.cpu_flags().split()))
    return _CPU_16BIT[key]


def _upcast(w) -> bool:
    """A 16-bit tensor on a CPU without GEMMs in its dtype: ``upcast_linear``'s case (at more rows
    than ``_native_dense`` takes, or where the native kernel did not build)."""
    return (isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dim() == 2
            and w.dtype in _CPU_GEMMS_16BIT and not cpu_gemms_16bit(w.dtype))


def _native_dense(x: torch.Tensor, w) -> bool:
    """An fp32 weight, or a 16-bit one on a CPU that upcasts it, on the CPU at a decode-sized x:
    the native kernel's case."""
    if w.device.type != "cpu" or w.dim() != 2 or w.stride(1) != 1 or x.numel() // max(x.shape[-1], 1) > SMALL_M:
        return False
    if w.dtype == torch.float32:
        return x.dtype == torch.float32 and native.module() is not None
    return (w.dtype in (torch.bfloat16, torch.float16) and not cpu_has_16bit(w.dtype)
            and native.module() is not None)
