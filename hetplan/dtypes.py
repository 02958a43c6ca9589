"""Storage dtypes and their size per element, quantisation scales included.

Block-quantised formats store scales beside the weights, so their cost per weight is more than
the nominal bit width: q4_0 packs 32 weights in 18 bytes (4.5 bits), q8_0 32 in 34 bytes (8.5
bits), q4_k_m here is one fixed format of 256-value super-blocks at 4.875 bits (GGUF's q4_k_m
mixes q4_k and q6_k super-blocks for about 4.85 bits on llama-class models).
``int8``/``int4`` are per-channel formats whose scales are negligible. ``row_parts`` is the
byte layout of every quantised format, priced here and allocated by the runtime.
"""

from __future__ import annotations

import functools

from hetplan.errors import HetplanError

BITS_PER_ELEMENT = {
    "fp32": 32.0,
    "fp16": 16.0,
    "bf16": 16.0,
    "int8": 8.0,
    "int4": 4.0,
    "q8_0": 8.5,
    "q4_k_m": 4.875,
    "q4_0": 4.5,
}

QUANTISED = ("int8", "int4", "q8_0", "q4_k_m", "q4_0")
"""Dtypes stored packed; the runtime's kernels multiply with the packed bytes."""
DEQUANT_BYTES = {"gpu": 2, "cpu": 4}
"""Bytes per element of the runtime's dequantisation buffer on each device (bf16 on the GPU,
fp32 on the CPU)."""

# The dtype arithmetic happens in once weights are dequantised (what the FLOP peaks are keyed by).
COMPUTE_DTYPE = {"fp32": "fp32", "bf16": "bf16"}


def check_dtype(name: str, key: str) -> str:
    if name not in BITS_PER_ELEMENT:
        known = " ".join(BITS_PER_ELEMENT)
        raise HetplanError(f"{key}: unknown dtype {name!r}; known: {known}")
    return name


def bytes_per_element(name: str) -> float:
    """Bytes per stored element, scales included: q4_0 -> 0.5625."""
    return BITS_PER_ELEMENT[check_dtype(name, "dtype")] / 8.0


def row_parts(name: str, n: int) -> tuple:
    """The arrays one row of ``n`` values is stored as in a quantised format, ((element dtype,
    count), ...), widest element first: the one layout the planner prices and the runtime
    allocates (``hetplan.runtime.kernels.quant``), for a linear's rows and a KV cache's alike.

    - q8_0: fp16 scales [ceil(n / 32)], int8 values [32 per block]
    - q4_0: fp16 scales [ceil(n / 32)], uint8 nibbles [16 per block]
    - int8: fp32 scale [1], int8 values [n]
    - int4: fp32 scale [1], uint8 nibbles [ceil(n / 2)]
    - q4_k_m: per super-block of 256: fp32 dmin [1], fp16 scales [8], uint8 mins [8], nibbles [128]
    """
    blocks = lambda size: -(-n // size)  # noqa: E731
    if name in ("q8_0", "q4_0"):
        return (("fp16", blocks(32)), ("int8", 32 * blocks(32)) if name == "q8_0" else ("uint8", 16 * blocks(32)))
    if name in ("int8", "int4"):
        return (("fp32", 1), ("int8", n) if name == "int8" else ("uint8", blocks(2)))
    if name == "q4_k_m":
        s = blocks(256)
        return (("fp32", s), ("fp16", 8 * s), ("uint8", 8 * s), ("uint8", 128 * s))
    raise ValueError(f"{name} is not a quantised format")


ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "int8": 1, "uint8": 1}


def row_bytes(name: str, n: int) -> float:
    """Bytes of one row of ``n`` values stored on its own: unquantised n * bytes per element;
    quantised the sum of its ``row_parts`` (rows padded to whole blocks, each with its own
    scales): q8_0 34 B and q4_0 18 B per 32 values, int8 n + 4, int4 ceil(n / 2) + 4, q4_k_m
    156 B per 256 values."""
    if name in QUANTISED:
        return float(sum(ELEMENT_BYTES[dtype] * count for dtype, count in row_parts(name, n)))
    return n * bytes_per_element(name)


@functools.lru_cache(maxsize=4096)  # an MoE model asks for the same few shapes a million times
def packed_bytes(name: str, rows: int, cols: int) -> float:
    """Bytes of a ``[rows, cols]`` linear weight stored in a quantised format: every output row
    quantised on its own (``row_parts``, the layout the runtime's kernels read), each array
    ``[rows, count]`` after the other, 16-byte aligned: rows * row_bytes(cols) rounded up to 16."""
    b = rows * int(row_bytes(name, cols))
    return float(-(-b // 16) * 16)


def compute_dtype(name: str) -> str:
    """The dtype whose FLOP peak applies to math on weights stored as ``name``."""
    return COMPUTE_DTYPE.get(name, "fp16")
