"""Parsing of quantities with units at the edge of the program.

``24GiB`` -> 25769803776 (bytes), ``936GB/s`` -> 9.36e11 (bytes/s), ``165TFLOPS`` -> 1.65e14
(FLOP/s). Nothing inside hetplan sees a string with a unit: these functions run when a node.yaml
or a CLI flag is read, and every number after that is in SI base units (bytes, seconds, FLOP).
"""

from __future__ import annotations

import re

from hetplan.errors import HetplanError

_DECIMAL = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def _scale(prefix: str) -> float:
    if prefix in _BINARY:
        return _BINARY[prefix]
    if prefix.upper() in _DECIMAL and len(prefix) <= 1:
        return _DECIMAL[prefix.upper()]
    raise ValueError(prefix)


def _parse(text, units: tuple[str, ...], what: str, key: str) -> float:
    """Parse ``text`` as a number followed by an optional prefix and one of ``units``."""
    if isinstance(text, bool):
        raise HetplanError(f"{key}: expected {what}, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = str(text).strip().replace(" ", "")
        unit_alt = "|".join(re.escape(u) for u in sorted(units, key=len, reverse=True))
        m = re.fullmatch(_NUMBER + r"(Ki|Mi|Gi|Ti|Pi|[kKMGTP])?(" + unit_alt + r")?", s)
        if not m:
            examples = {"a size": "24GiB or 64GB", "a bandwidth": "936GB/s or 25GB/s",
                        "a FLOP rate": "165TFLOPS"}[what]
            raise HetplanError(f"{key}: cannot read {text!r} as {what} (write e.g. {examples})")
        value = float(m.group(1)) * _scale(m.group(2) or "")
    if not value > 0 or value != value or value == float("inf"):
        raise HetplanError(f"{key}: must be a positive finite number, got {text!r}")
    return value


def parse_bytes(text, key: str = "value") -> int:
    """``24GiB`` -> 25769803776; ``64GB`` -> 64e9; a bare number is bytes."""
    return int(round(_parse(text, ("B",), "a size", key)))


def parse_bandwidth(text, key: str = "value") -> float:
    """``936GB/s`` -> 9.36e11 bytes/s; a bare number is bytes/s."""
    return _parse(text, ("B/s", "Bps"), "a bandwidth", key)


def parse_flops(text, key: str = "value") -> float:
    """``165TFLOPS`` -> 1.65e14 FLOP/s; a bare number is FLOP/s."""
    return _parse(text, ("FLOPS", "FLOP/s", "flops"), "a FLOP rate", key)


def format_bytes(n: float) -> str:
    """Human-readable IEC size: 25769803776 -> '24.00 GiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_seconds(t: float) -> str:
    """Human-readable duration: 0.0123 -> '12.30 ms'."""
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"
