"""Storage dtypes and their size per element, quantisation scales included.

Block-quantised formats store scales beside the weights, so their cost per weight is more than
the nominal bit width: q4_0 packs 32 weights in 18 bytes (4.5 bits), q8_0 32 in 34 bytes (8.5
bits), q4_k_m mixes q4_k and q6_k super-blocks (about 4.85 bits on llama-class models).
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
    "q4_k_m": 4.85,
    "q4_0": 4.5,
}

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


def compute_dtype(name: str) -> str:
    """The dtype whose FLOP peak applies to math on weights stored as ``name``."""
    return COMPUTE_DTYPE.get(name, "fp16")
