"""Canonical numbers: floats rounded to 10 significant digits, so that what is hashed and what
is written to plan.json are the same values on every platform."""

from __future__ import annotations


def rounded(x):
    """Recursively round floats to 10 significant digits (tuples become lists)."""
    if isinstance(x, float):
        return float(f"{x:.10g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v) for v in x]
    return x
