"""The cluster.yaml schema: the nodes of a cluster (each a node preset or a node.yaml path) and
the network between them. Strict like node.yaml: an unknown key is refused with the accepted
ones listed, a bandwidth or a latency must carry its unit (``10Gbit/s`` or ``1.25GB/s``;
``50us``, ``0.1ms``). Knows nothing about planning: ``hetplan.pipeline.cluster`` loads the nodes.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, Field, model_validator

from hetplan.schema.fields import Text
from hetplan.schema.node import _Strict
from hetplan.units import quantity

_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _bandwidth(v) -> float:
    """``10Gbit/s`` (bits, as network links are sold) or ``1.25GB/s`` (bytes) -> bytes/s."""
    if isinstance(v, str) and re.search(r"(bit/s|bps)\s*$", v):
        bits = quantity(re.sub(r"(bit/s|bps)\s*$", "B/s", v), "a bandwidth")
        x = bits / 8
    else:
        x = quantity(v, "a bandwidth")
    if x < 1e5:
        raise ValueError(f"{v!r} is below 800kbit/s, too slow to be a network between nodes")
    if x > 1e13:
        raise ValueError(f"{v!r} is above 80Tbit/s: no network link is that fast")
    return x


def _latency(v) -> float:
    """``50us`` / ``0.1ms`` / ``0.002s`` -> seconds (a unit is required)."""
    text = str(v).strip() if isinstance(v, (str, int, float)) and not isinstance(v, bool) else None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(s|ms|us|µs|ns)?", text or "")
    if not m:
        raise ValueError(f"cannot read {v!r} as a latency (write e.g. 50us or 0.1ms)")
    if not m.group(2):
        raise ValueError(f"{v!r} has no unit; write it with one, e.g. {m.group(1)}us")
    x = float(m.group(1)) * _SECONDS[m.group(2)]
    if x > 10:
        raise ValueError(f"{v!r} is above 10 s, not a network latency")
    return x


NetBandwidth = Annotated[float, BeforeValidator(_bandwidth),
                         Field(json_schema_extra={"unit": "a bandwidth", "range": "800kbit/s .. 80Tbit/s"})]
Latency = Annotated[float, BeforeValidator(_latency), Field(json_schema_extra={"range": "0 .. 10 s"})]


class Network(_Strict):
    """One link between every pair of nodes (a switch): what one transfer achieves each way."""
    bandwidth: NetBandwidth = Field(description="achieved bandwidth each way, e.g. 9.4Gbit/s on 10 GbE")
    latency: Latency = Field(description="one message's latency, e.g. 50us")


class Cluster(_Strict):
    name: Text | None = Field(None, description="shown in plans (default: the file's name)")
    nodes: Annotated[list[Text], Field(min_length=1, max_length=64)] = Field(
        description="each a node preset name or a node.yaml path (relative to this file)")
    network: Network | None = Field(None, description="between the nodes; required with two or more")

    @model_validator(mode="after")
    def _network_given(self):
        if len(self.nodes) > 1 and self.network is None:
            raise ValueError(f"a cluster of {len(self.nodes)} nodes needs 'network' "
                             f"(e.g. network: {{bandwidth: 10Gbit/s, latency: 50us}})")
        return self
