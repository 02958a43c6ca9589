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


_KINDS = {
    "a size": (("B",), "B", "24GiB or 64GB"),
    "a bandwidth": (("B/s", "Bps"), "GB/s", "936GB/s or 25GB/s"),
    "a FLOP rate": (("FLOPS", "FLOP/s", "flops"), "TFLOPS", "165TFLOPS"),
}
"""What each kind of quantity accepts: its unit spellings, the unit a bare number should get, examples."""


def quantity(text, what: str) -> float:
    """Parse ``text`` (a string: number, optional SI/IEC prefix, unit) as ``what`` (a key of
    ``_KINDS``) -> a positive finite number in SI base units. Raises ValueError saying what is
    wrong and how to write it: a bare number has no unit and is refused (is ``24`` bytes or GiB?)."""
    units, unit_hint, examples = _KINDS[what]
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"expected {what} such as {examples}, got {text!r}")
    s = str(text).strip().replace(" ", "")
    unit_alt = "|".join(re.escape(u) for u in sorted(units, key=len, reverse=True))
    m = re.fullmatch(_NUMBER + r"(Ki|Mi|Gi|Ti|Pi|[kKMGTP])?(" + unit_alt + r")?", s)
    if not m:
        raise ValueError(f"cannot read {text!r} as {what} (write e.g. {examples})")
    if not m.group(3):
        prefix = m.group(2) or ""
        suggestion = f"{m.group(1)}{prefix or ('Gi' if unit_hint == 'B' else '')}{unit_hint}"
        raise ValueError(f"{text!r} has no unit; write it with one, e.g. {suggestion}")
    value = float(m.group(1)) * _scale(m.group(2) or "")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"must be a positive finite quantity, got {text!r}")
    return value


def _parse(text, what: str, key: str) -> float:
    try:
        return quantity(text, what)
    except ValueError as e:
        raise HetplanError(f"{key}: {e}") from None


def parse_bytes(text, key: str = "value") -> int:
    """``24GiB`` -> 25769803776; ``64GB`` -> 64e9; ``512B`` -> 512. A bare number is refused."""
    return int(round(_parse(text, "a size", key)))


def parse_bandwidth(text, key: str = "value") -> float:
    """``936GB/s`` -> 9.36e11 bytes/s. A bare number is refused."""
    return _parse(text, "a bandwidth", key)


def parse_flops(text, key: str = "value") -> float:
    """``165TFLOPS`` -> 1.65e14 FLOP/s. A bare number is refused."""
    return _parse(text, "a FLOP rate", key)


def format_bytes(n: float) -> str:
    """Human-readable IEC size: 25769803776 -> '24.00 GiB'; beyond 1024 PiB, 3 significant digits
    with an exponent ('2.66e+25 PiB') rather than a wall of digits."""
    if abs(n) >= 2**60:
        return f"{n / 2**50:.3g} PiB"
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_percent(fraction: float) -> str:
    """A relative gap as a percentage a reader can use: below 0.01 % it is '0%' (rounding noise
    of the solver), else two significant digits ('2.5%', '0.013%')."""
    pct = 100 * fraction
    return "0%" if abs(pct) < 0.01 else f"{pct:.2g}%"


def format_seconds(t: float) -> str:
    """Human-readable duration: 0.0123 -> '12.30 ms'; beyond a day, 3 significant digits."""
    if t >= 86400:
        return f"{t:.3g} s"
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.2f} ms"
    return f"{t * 1e6:.1f} us"
