"""The devices a pipeline runs on and what a hop between two of them costs.

A topology is one node (node.yaml) or several (cluster.yaml) joined by a network. Its devices,
in pipeline order, are every GPU of node 0, then of node 1, ...; a node with no GPU contributes
its CPU. A stage on a device is planned as an ordinary single-device problem (``device_hw``):
the node with that GPU alone, or the node as an all-CPU machine. Knows nothing about models,
stages or solvers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hetplan import cost
from hetplan.hardware import HardwareSpec


@dataclass(frozen=True)
class Network:
    """The network between nodes: one link between every pair, ``bytes_per_s`` each way."""
    bytes_per_s: float
    latency_s: float


@dataclass(frozen=True)
class Topology:
    name: str
    nodes: tuple
    """HardwareSpecs, node 0 first."""
    network: Network | None = None
    """None for a single node."""

    @classmethod
    def of(cls, hw) -> "Topology":
        """``hw`` itself when it is a Topology, else the single node ``hw``."""
        return hw if isinstance(hw, Topology) else cls(hw.name, (hw,))

    @property
    def devices(self) -> tuple:
        """(node, gpu index or None for the node's CPU) in pipeline order."""
        return tuple((n, g) for n, hw in enumerate(self.nodes)
                     for g in (range(len(hw.gpus)) if hw.gpus else (None,)))

    def device_hw(self, device: tuple) -> HardwareSpec:
        """The single-device machine a stage on ``device`` is planned on."""
        n, g = device
        hw = self.nodes[n]
        return hw.single_gpu(g) if g is not None else dataclasses.replace(hw, gpus=(), peers=())

    def device_name(self, device: tuple) -> str:
        n, g = device
        hw = self.nodes[n]
        where = f"node {n} " if len(self.nodes) > 1 else ""
        return f"{where}GPU {g}" if g is not None else f"{where}CPU"

    def legs(self, a: tuple, b: tuple) -> tuple:
        """What a hop from device ``a`` to device ``b`` is made of, as plan.json records it for
        the simulator: (via, bytes per second achieved, latency) per leg in turn, a leg taking
        ``bytes / bytes_per_s + latency_s``; the legs ``hop`` prices."""
        (na, ga), (nb, gb) = a, b

        def copy(node, via):
            hw = self.nodes[node]
            rate = hw.h2d_bytes_per_s if via == "h2d" else hw.d2h_bytes_per_s
            return via, rate * hw.efficiency["link"], hw.latency_s["link_task"]

        if na == nb:
            hw = self.nodes[na]
            if ga is not None and gb is not None and hw.peer(ga, gb).kind != "host":
                link = hw.peer(ga, gb)
                return ((link.kind, link.bytes_per_s * hw.efficiency["link"], hw.latency_s["link_task"]),)
            return ((copy(na, "d2h"),) if ga is not None else ()) + ((copy(nb, "h2d"),) if gb is not None else ())
        net = self.network
        return (((copy(na, "d2h"),) if ga is not None else ()) + (("network", net.bytes_per_s, net.latency_s),)
                + ((copy(nb, "h2d"),) if gb is not None else ()))

    def hop(self, a: tuple, b: tuple, nbytes: float) -> tuple:
        """(kind, seconds) of ``nbytes`` of activations from device ``a`` to device ``b``.

        On one node: between GPUs ``cost.peer_seconds`` (peer link, or d2h then h2d through the
        host); from a GPU to its own host's CPU a d2h copy, from the CPU to a GPU an h2d copy.
        Between nodes: out of the sender's GPU (d2h, when it is one), across the network
        ``bytes / bandwidth + latency``, into the receiver's GPU (h2d, when it is one)."""
        (na, ga), (nb, gb) = a, b
        if na == nb:
            hw = self.nodes[na]
            if ga is not None and gb is not None:
                return hw.peer(ga, gb).kind, cost.peer_seconds(nbytes, hw, ga, gb)
            out = cost.d2h_seconds(nbytes, hw) if ga is not None else 0.0
            return "host", out + (cost.h2d_seconds(nbytes, hw) if gb is not None else 0.0)
        net = self.network
        out = cost.d2h_seconds(nbytes, self.nodes[na]) if ga is not None else 0.0
        into = cost.h2d_seconds(nbytes, self.nodes[nb]) if gb is not None else 0.0
        return "network", out + nbytes / net.bytes_per_s + net.latency_s + into
