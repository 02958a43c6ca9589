"""Replicas (data parallel): the devices cut into ``r`` alike groups, each running the same
pipeline over its own sequences, so that the whole serves ``r`` times one group's throughput.

A group is ``devices / r`` consecutive devices: GPUs ``[i q, (i+1) q)`` of a single node, or
nodes ``[i q, (i+1) q)`` of a cluster (a cluster of multi-GPU nodes is cut along its nodes only).
The groups must be alike (the same GPUs and the same links between them, or the same nodes),
so that one pipeline planned on the first group serves every group. Replicas on the same node
share its DRAM: their stages' CPU bytes together must fit; and its CPU: each is planned with
``1 / r`` of the cores, FLOP/s and DRAM bandwidth (``cpu_share``). The groups exchange nothing, so no
link between them is priced. Knows nothing about models or solvers.
"""

from __future__ import annotations

import dataclasses

from hetplan.hardware import PeerLink
from hetplan.pipeline.topology import Topology


def replica_counts(topo: Topology) -> list:
    """Every ``r > 1`` that cuts ``topo`` into ``r`` alike groups, ascending."""
    n = len(topo.nodes) if len(topo.nodes) > 1 else len(topo.nodes[0].gpus)
    return [r for r in range(2, n + 1) if n % r == 0 and first_group(topo, r) is not None]


def first_group(topo: Topology, r: int) -> Topology | None:
    """The first of ``r`` alike groups of ``topo`` as a topology of its own; None when the
    devices do not cut into ``r`` alike groups."""
    if len(topo.nodes) > 1:
        nodes = topo.nodes
        if len(nodes) % r:
            return None
        q = len(nodes) // r
        groups = [nodes[i * q:(i + 1) * q] for i in range(r)]
        if any(tuple(map(_alike, g)) != tuple(map(_alike, groups[0])) for g in groups):
            return None
        return Topology(topo.name, groups[0], topo.network if q > 1 else None)
    hw = topo.nodes[0]
    if not hw.gpus or len(hw.gpus) % r:
        return None
    q = len(hw.gpus) // r
    groups = [_gpu_group(hw, i * q, q) for i in range(r)]
    if any(_alike(g) != _alike(groups[0]) for g in groups):
        return None
    return Topology(topo.name, (cpu_share(groups[0], r),))


def cpu_share(hw, r: int):
    """Node ``hw`` as one of ``r`` replicas side by side on it sees it: ``1 / r`` of its CPU's
    cores, FLOP/s and DRAM bandwidth (every replica busy at once, as a serving or batch plan has
    them; the runtime gives each ``cores // r`` threads), and all of its DRAM's capacity, which
    ``replicas_fit_dram`` shares out."""
    if r == 1:
        return hw
    cpu = hw.cpu
    return dataclasses.replace(hw, cpu=dataclasses.replace(
        cpu, cores=max(1, cpu.cores // r) if cpu.cores else 0, mem_bytes_per_s=cpu.mem_bytes_per_s / r,
        flops_per_s={k: v / r for k, v in cpu.flops_per_s.items()}))


def replica_step(topo: Topology, r: int) -> dict:
    """How far apart the ``r`` groups' devices are: ``{"nodes": q}`` on a cluster (group ``i``
    is nodes ``[i q, (i+1) q)``), else ``{"gpus": q}`` (GPUs ``[i q, (i+1) q)`` of the node)."""
    if len(topo.nodes) > 1:
        return {"nodes": len(topo.nodes) // r}
    return {"gpus": len(topo.nodes[0].gpus) // r}


def _alike(hw):
    """What must match between groups: the node with its GPUs' NUMA nodes left out (each group
    sits on its own socket alike)."""
    return dataclasses.replace(hw, gpus=tuple(dataclasses.replace(g, numa=None) for g in hw.gpus))


def _gpu_group(hw, first: int, q: int):
    """GPUs ``[first, first + q)`` of node ``hw`` as a node of their own, their links renumbered."""
    gpus = hw.gpus[first:first + q]
    peers = tuple(PeerLink(a - first, b - first, hw.peer(a, b).kind, hw.peer(a, b).bytes_per_s)
                  for a in range(first, first + q) for b in range(a + 1, first + q)
                  if hw.peer(a, b).kind != "host")
    return dataclasses.replace(hw, gpus=gpus, peers=peers)


def replicas_fit_dram(topo: Topology, r: int, stages) -> bool:
    """Whether ``r`` replicas of a pipeline whose first replica runs ``stages`` (StagePlans on
    the first group's nodes) fit in each node's DRAM: on a single node all ``r`` share it; on a
    cluster each group has nodes of its own."""
    per_node: dict = {}
    for s in stages:
        per_node[s.node] = per_node.get(s.node, 0.0) + s.plan.memory["cpu_bytes"]
    share = r if len(topo.nodes) == 1 else 1
    return all(share * nbytes <= topo.nodes[n].cpu_budget_bytes() for n, nbytes in per_node.items())


def replicas_may_fit_dram(spec, topo: Topology, r: int, wl) -> bool:
    """Before any stage is solved: whether ``r`` replicas sharing one node's DRAM can fit at all.
    A replica's weights and KV caches beyond its group's whole GPU budget sit in DRAM, so ``r``
    of them need at least ``r x (weights + KV - GPU budgets)`` there (``replicas_fit_dram``
    checks the plan's own bytes, at least that much). Replicas on nodes of their own: True."""
    from hetplan.problem import build_problem

    if len(topo.nodes) > 1 or r == 1:
        return True
    group = first_group(topo, r)
    hw = group.nodes[0]
    need = sum(b.weight_bytes + b.kv_bytes for b in build_problem(spec, group.device_hw(group.devices[0]), wl).blocks)
    gpus = sum(max(0, g.memory_bytes - hw.gpu_reserve_bytes) for g in hw.gpus)
    return r * max(0.0, need - gpus) <= hw.cpu_budget_bytes()

