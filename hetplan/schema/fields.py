"""The building blocks of the JSON schemas (plan.json, node.profile.json, routing statistics,
config.json as read): a strict base model and SI quantities bounded by physics.

JSON files hetplan writes hold SI numbers whose unit is in the key's name (``memory_bytes``,
``ttft_s``, ``h2d_bytes_per_s``); the bounds below are the same physical limits node.yaml's units
are checked against, in those units. Each quantity carries its unit and range for the README's
key tables (``hetplan.schema.docs``). Knows nothing about any one file.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

BYTES_MAX = float(2**50)
"""1 PiB: more than any machine holds (the largest single machines have 64 TiB of DRAM)."""
SECONDS_MAX = 1e9
"""About 30 years: no prediction or measurement of one inference is longer."""
MEM_BYTES_PER_S_MAX = 20e12
"""No memory is faster than about 8 TB/s (HBM3e); 20 TB/s leaves room for the next parts."""
LINK_BYTES_PER_S_MAX = 2e12
"""No CPU-GPU link is faster than about 900 GB/s (NVLink-C2C)."""
FLOPS_MAX = 1e17
"""No device computes more than about 20 PFLOP/s dense."""
TIME_LIMIT_MAX_S = 1e7
"""The longest ``--time-limit`` (about 4 months): beyond it a value is a typo."""
MAX_NODES_MAX = 10**9
"""The largest ``--max-nodes``."""
DIM_MAX = 1 << 24
"""Largest width, layer count, vocabulary or context a file may name (16.7 M: above any model's)."""


class Strict(BaseModel):
    """Every key known, every type exact (no "64" for 64, no 1 for true), no NaN or infinity."""
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def quantity(unit: str, high: float, low: float = 0.0, low_open: bool = False):
    """A float in ``[low, high]`` (``(low, high]`` when ``low_open``) measured in ``unit``."""
    bound = {"gt": low} if low_open else {"ge": low}
    shown = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    return Annotated[float, Field(le=high, **bound, json_schema_extra={"si": unit, "range": shown})]


def count(high: int, low: int = 0):
    """An integer in ``[low, high]``."""
    return Annotated[int, Field(ge=low, le=high, json_schema_extra={"range": f"{low} .. {high}"})]


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("must not be empty")
    return text


Text = Annotated[str, AfterValidator(_not_blank)]
"""A name or a path: a string that is not empty or blank."""

Bytes = quantity("bytes", BYTES_MAX)
Seconds = quantity("s", SECONDS_MAX)
TokenRate = quantity("tokens/s", 1e12)
MemRate = quantity("bytes/s", MEM_BYTES_PER_S_MAX, low_open=True)
LinkRate = quantity("bytes/s", LINK_BYTES_PER_S_MAX, low_open=True)
FlopRate = quantity("FLOP/s", FLOPS_MAX, low_open=True)
Fraction = quantity("fraction", 1.0, low_open=True)
Share = quantity("fraction", 1.0)
"""A share of tokens: 0 (never chosen) to 1 (always chosen)."""
Dim = count(DIM_MAX, 1)
Count = count(DIM_MAX)
Fingerprint = Annotated[str, Field(pattern=r"^[0-9a-f]{16}$", json_schema_extra={"range": "16 hex digits"})]
