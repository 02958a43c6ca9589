"""The routing-statistics schema (``--routing`` files, ``--record-routing`` output, and the copy a
plan of an MoE model records in ``inputs.cli_args.routing``).

Structure and physics only: an exact fingerprint, one share in [0, 1] per expert, layer indices
as decimal strings. Whether the statistics fit a model (its fingerprint, its MoE layers, its
expert count, shares summing to experts_per_token) is ``hetplan.routing.check_stats``'s job.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from hetplan.schema.fields import DIM_MAX, Fingerprint, Share, Strict, count

def _layer_index(key: str) -> str:
    if not re.fullmatch(r"0|[1-9][0-9]{0,7}", key):
        raise ValueError(f"key {key!r} is not a layer index (a decimal string such as \"3\")")
    return key


LayerIndex = Annotated[str, AfterValidator(_layer_index)]
"""A layer index as JSON object keys must be: a decimal string without sign or leading zeros."""


class Routing(Strict):
    model_fingerprint: Fingerprint = Field(description="the model's routing fingerprint (its "
                                           "fingerprint with the dtypes set aside)")
    tokens: count(2**50, 1) | None = Field(None, description="tokens each layer routed while recording")
    layers: dict[LayerIndex, Annotated[list[Share], Field(min_length=1, max_length=DIM_MAX)]] = Field(
        description="MoE layer index -> the share of tokens choosing each routed expert "
                    "(a layer's shares sum to experts_per_token)")


SECTIONS = (("", Routing),)
"""Where each model sits in the file, for the README's key table."""
