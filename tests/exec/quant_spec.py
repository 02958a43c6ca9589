"""The quantised weight formats decoded from their written definitions, in numpy, for tests.

Independent of ``hetplan.runtime.kernels.quant``: the byte layout is restated here from the
format definitions (each output row stored on its own, zero-padded to whole blocks; the row
arrays of all rows one after the other, widest element first):

- q8_0: fp16 d [rows, nb], int8 q [rows, 32 nb]; x = d * q.
- q4_0: fp16 d [rows, nb], bytes [rows, 16 nb]; byte j of a block: low nibble value j, high
  nibble value j + 16; x = d * (nibble - 8).
- int8: fp32 d [rows, 1], int8 q [rows, cols]; x = d * q.
- int4: fp32 d [rows, 1], bytes [rows, ceil(cols / 2)], value k in byte k // 2 (low nibble for
  even k); x = d * (nibble - 8).
- q4_k_m: per super-block of 256: fp32 dmin [rows, s], fp16 d [rows, 8 s], uint8 m [rows, 8 s],
  bytes [rows, 128 s] (nibbles as int4); x = d_j * nibble - dmin * m_j for sub-block j of 32.
"""

from __future__ import annotations

import numpy as np


def _blocks(n: int, size: int) -> int:
    return -(-n // size)


def layout(fmt: str, cols: int) -> list:
    """[(numpy dtype, count per row)] of a row of ``cols`` values."""
    nb, s = _blocks(cols, 32), _blocks(cols, 256)
    return {"q8_0": [(np.float16, nb), (np.int8, 32 * nb)],
            "q4_0": [(np.float16, nb), (np.uint8, 16 * nb)],
            "int8": [(np.float32, 1), (np.int8, cols)],
            "int4": [(np.float32, 1), (np.uint8, _blocks(cols, 2))],
            "q4_k_m": [(np.float32, s), (np.float16, 8 * s), (np.uint8, 8 * s), (np.uint8, 128 * s)]}[fmt]


def nbytes(fmt: str, rows: int, cols: int) -> int:
    return rows * sum(np.dtype(dt).itemsize * count for dt, count in layout(fmt, cols))


def arrays(fmt: str, packed: np.ndarray, rows: int, cols: int) -> list:
    out, at = [], 0
    for dt, count in layout(fmt, cols):
        size = rows * count * np.dtype(dt).itemsize
        out.append(packed[at:at + size].view(dt).reshape(rows, count))
        at += size
    assert at == packed.size
    return out


def _nibbles_adjacent(b: np.ndarray) -> np.ndarray:
    """[rows, k] bytes -> [rows, 2k]: value 2i low nibble of byte i, 2i + 1 its high nibble."""
    return np.stack((b & 15, b >> 4), axis=-1).reshape(b.shape[0], -1).astype(np.float64)


def decode(fmt: str, packed: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Packed uint8 bytes -> float64 [rows, cols]."""
    a = arrays(fmt, packed, rows, cols)
    if fmt == "q8_0":
        x = a[1].astype(np.float64).reshape(rows, -1, 32) * a[0].astype(np.float64)[..., None]
    elif fmt == "q4_0":
        b = a[1].reshape(rows, -1, 16)
        q = np.concatenate((b & 15, b >> 4), axis=-1).astype(np.float64) - 8
        x = q * a[0].astype(np.float64)[..., None]
    elif fmt == "int8":
        x = a[1].astype(np.float64) * a[0].astype(np.float64)
    elif fmt == "int4":
        x = (_nibbles_adjacent(a[1])[:, :cols] - 8) * a[0].astype(np.float64)
    elif fmt == "q4_k_m":
        dmin, d, m, b = (v.astype(np.float64) if i < 3 else v for i, v in enumerate(a))
        q = _nibbles_adjacent(b).reshape(rows, -1, 8, 32)
        x = q * d.reshape(rows, -1, 8, 1) - m.reshape(rows, -1, 8, 1) * dmin.reshape(rows, -1, 1, 1)
    else:
        raise ValueError(fmt)
    return x.reshape(rows, -1)[:, :cols]


def step(fmt: str, w: np.ndarray) -> np.ndarray:
    """Per element, the largest rounding error the format's definition allows, [rows, cols]:
    half a quantisation step (symmetric formats: max|x| / qmax over the block or row; q4_k_m:
    its sub-block's range / 15, plus half its 8-bit min step), plus the fp16 rounding of scales."""
    rows, cols = w.shape
    if fmt in ("int8", "int4"):
        qmax = 127 if fmt == "int8" else 7
        return np.repeat(np.abs(w).max(axis=1, keepdims=True) / qmax * 0.5 * 1.01, cols, axis=1)
    size = 256 if fmt == "q4_k_m" else 32
    pad = _blocks(cols, size) * size - cols
    wp = np.concatenate((w, np.zeros((rows, pad))), axis=1)
    if fmt in ("q8_0", "q4_0"):
        blocks = wp.reshape(rows, -1, 32)
        amax = np.abs(blocks).max(axis=-1, keepdims=True)
        # q from the fp32 scale, x from its fp16 rounding: + 2^-11 d per unit of |q| (127 or 8);
        # q4_0: d = max / -8, so a value near -max clips at 7 d: up to one step
        s = amax / 127 * (0.5 + 127 * 2.0 ** -11) if fmt == "q8_0" else amax / 8 * (1 + 8 * 2.0 ** -11)
        return np.broadcast_to(s * 1.001 + 1e-7, blocks.shape).reshape(rows, -1)[:, :cols]
    sub = wp.reshape(rows, -1, 8, 32)
    mins = np.clip(-sub.min(axis=-1), 0, None)
    dmin = mins.max(axis=-1, keepdims=True) / 255
    rng = sub.max(axis=-1) + mins + dmin
    s = (rng / 15 * 0.5 + dmin) * 1.02 + 1e-7
    return np.broadcast_to(s[..., None], sub.shape).reshape(rows, -1)[:, :cols]
