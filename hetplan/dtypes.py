"""Storage dtypes and their size per element, quantisation scales included.

Block-quantised formats store scales beside the weights, so their cost per weight is more than
the nominal bit width: q4_0 packs 32 weights in 18 bytes (4.5 bits), q8_0 32 in 34 bytes (8.5
bits), q4_k_m here is one fixed format of 256-value super-blocks at 4.875 bits (GGUF's q4_k_m
mixes q4_k and q6_k super-blocks for about 4.85 bits on llama-class models).
``int8``/``int4`` are per-channel formats whose scales are negligible.
"""

from __future__ import annotations

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
"""Dtypes stored packed; the runtime dequantises a block's linears before it computes with them."""
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


def packed_bytes(name: str, rows: int, cols: int) -> float:
    """Bytes of a ``[rows, cols]`` linear weight stored in a quantised format, flattened row by
    row (the runtime's layout), 16-byte aligned: q8_0 34 and q4_0 18 B per 32 values, q4_k_m
    156 B per 256 (the last block zero-padded); int8 rows * (cols + 4) and int4 4 * rows +
    ceil(rows * cols / 2) (an fp32 scale per row)."""
    n = rows * cols
    if name == "int8":
        b = rows * (cols + 4)
    elif name == "int4":
        b = 4 * rows + -(-n // 2)
    else:
        b = row_bytes(name, n)
    return float(-(-b // 16) * 16)


def row_bytes(name: str, n: int) -> float:
    """Bytes of one row of ``n`` values stored on its own, as a KV cache stores each token's
    rows: unquantised n * bytes per element; quantised rows are padded to whole blocks and keep
    their own scales (q8_0 34 B and q4_0 18 B per 32 values; int8 n + 4 and int4 ceil(n/2) + 4,
    an fp32 scale per row; q4_k_m 156 B per 256 values)."""
    blocks = lambda size: -(-n // size)  # noqa: E731
    packed = {"q8_0": lambda: 34 * blocks(32), "q4_0": lambda: 18 * blocks(32), "int8": lambda: n + 4,
              "int4": lambda: blocks(2) + 4, "q4_k_m": lambda: 156 * blocks(256)}
    if name in packed:
        return float(packed[name]())
    return n * bytes_per_element(name)


def compute_dtype(name: str) -> str:
    """The dtype whose FLOP peak applies to math on weights stored as ``name``."""
    return COMPUTE_DTYPE.get(name, "fp16")
