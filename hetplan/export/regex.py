"""Compact regular expressions for sets of layer indices (``0-15, 20`` -> ``[0-9]|1[0-5]|20``).

The subset of regex syntax used (``^ $ | ( ) [0-9] \\.``) means the same in Python's ``re`` and
in C++'s ``std::regex`` (ECMAScript), which llama.cpp and kTransformers match tensor and
module names with. Knows nothing about models.
"""

from __future__ import annotations


def runs(indices) -> list:
    """Sorted distinct ``indices`` as maximal runs of consecutive integers: [(first, last), ...]."""
    out: list = []
    for i in sorted(set(indices)):
        if out and i == out[-1][1] + 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def number_range(lo: int, hi: int) -> list:
    """Alternatives that together match exactly the decimal numbers ``lo..hi`` (no leading
    zeros): one group of alternatives per digit count, each split where a digit stops being free."""
    if lo < 0 or hi < lo:
        raise ValueError(f"bad range {lo}..{hi}")
    out = []
    for digits in range(len(str(lo)), len(str(hi)) + 1):
        a = max(lo, 10 ** (digits - 1) if digits > 1 else 0)
        b = min(hi, 10 ** digits - 1)
        if a <= b:
            out += _same_length(str(a), str(b))
    return out


def _same_length(lo: str, hi: str) -> list:
    """Alternatives for the digit strings ``lo..hi`` of one length (zero padding allowed inside)."""
    if len(lo) == 1:
        return [_digit_class(lo, hi)]
    if lo[0] == hi[0]:
        return [lo[0] + rest for rest in _same_length(lo[1:], hi[1:])]
    n = len(lo) - 1
    out, first, last = [], lo[0], hi[0]
    if lo[1:] != "0" * n:
        out += [lo[0] + rest for rest in _same_length(lo[1:], "9" * n)]
        first = str(int(lo[0]) + 1)
    tail = []
    if hi[1:] != "9" * n:
        tail = [hi[0] + rest for rest in _same_length("0" * n, hi[1:])]
        last = str(int(hi[0]) - 1)
    if first <= last:
        out.append(_digit_class(first, last) + "[0-9]" * n)
    return out + tail


def _digit_class(a: str, b: str) -> str:
    return a if a == b else f"[{a}-{b}]"


def layers_regex(indices) -> str:
    """One alternation matching exactly the decimal strings of ``indices`` (to be placed between
    delimiters, e.g. ``blk\\.(...)\\.``)."""
    alts = [alt for a, b in runs(indices) for alt in number_range(a, b)]
    return alts[0] if len(alts) == 1 else "(" + "|".join(alts) + ")"
