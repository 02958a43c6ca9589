"""A planning problem: a block graph priced on one machine, plus the memory budgets.

``Problem`` is what every solver reads: per stage its time on the GPU and on the CPU, the time
to move its input activations each way, per block the time to stream its weights, and the
budgets. Pure numbers; derived once, shared by the ILP, the baselines and the plan builder.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hetplan import cost
from hetplan.errors import HetplanError
from hetplan.experts import expert_layer, uniform_fractions
from hetplan.graph import PHASES, BlockGraph, Stage, block_graph, workspace_bytes
from hetplan.hardware import HardwareSpec
from hetplan.model import ModelSpec
from hetplan.workload import Workload


@dataclass(frozen=True)
class StageCost:
    stage: Stage
    gpu_s: float
    cpu_s: float
    up_s: float
    """h2d time of the stage's input activations (when the previous stage ran on the CPU)."""
    down_s: float
    """d2h time of the stage's input activations (when the previous stage ran on the GPU)."""
    gpu_source: str = "analytic"
    """Where ``gpu_s`` came from: ``analytic`` (roofline) or ``profile`` (measured table)."""
    cpu_source: str = "analytic"
    """Where ``cpu_s`` came from: ``analytic`` or ``profile``."""

    def source(self, device: str) -> str:
        return self.gpu_source if device == "gpu" else self.cpu_source


@dataclass(frozen=True)
class Problem:
    graph: BlockGraph
    hw: HardwareSpec
    stages: dict
    """phase -> tuple of StageCost, in chain order."""
    load_s: dict
    """block -> h2d time of its weights (streaming)."""
    kv_down_s: dict
    """attention block -> d2h time of the prompt's KV (prefill on the GPU, cache in DRAM)."""
    gpu_budget_bytes: float
    """HBM the solvers place weights, KV, staging and workspace in: the node's GPU budget less
    ``gpu_held_back_bytes``."""
    cpu_budget_bytes: float
    gpu_workspace_bytes: float
    cpu_workspace_bytes: float
    experts: dict = field(default_factory=dict)
    """phase -> MoE block -> ``hetplan.experts.ExpertLayer`` (only on a node with a GPU): what
    splitting the block's experts between HBM and DRAM costs."""
    routing: object = None
    """The ``hetplan.routing.RoutingStats`` the expert fractions came from, or None (uniform)."""
    gpu_held_back_bytes: float = 0.0
    """HBM held back from the solvers for values that copies to the host leave waiting
    (``hetplan.plan.pending``), which depend on the schedule a decision makes: 0 unless the
    compiler solves again because a plan overflowed by them (``held_back``)."""

    def held_back(self, nbytes: float) -> "Problem":
        """This problem with ``nbytes`` of the node's GPU budget held back from the solvers."""
        node_budget = self.gpu_budget_bytes + self.gpu_held_back_bytes
        return dataclasses.replace(self, gpu_budget_bytes=node_budget - nbytes, gpu_held_back_bytes=nbytes)

    @property
    def model(self) -> ModelSpec:
        return self.graph.model

    @property
    def workload(self) -> Workload:
        return self.graph.workload

    @property
    def blocks(self) -> tuple:
        return self.graph.blocks

    @property
    def has_gpu(self) -> bool:
        return self.hw.gpu is not None


def price(graph: BlockGraph, hw: HardwareSpec, profile=None, routing=None) -> Problem:
    """Attach seconds to every stage and transfer of ``graph`` on ``hw``.

    ``profile`` (a ``hetplan.profile.table.ProfileTable``) overrides analytic compute times with
    measured ones where it has the op (whole-block stages; expert splits are costed
    analytically). ``routing`` gives MoE layers their expert fractions (uniform without)."""
    spec = graph.model
    has_gpu = hw.gpu is not None

    def seconds(device: str, st: Stage) -> tuple[float, str]:
        if profile is not None and (device == "cpu" or has_gpu):
            t = profile.seconds(device, st.work, spec)
            if t is not None:
                return t, "profile"
        if device == "gpu":
            return (cost.gpu_seconds(st.work, spec, hw) if has_gpu else float("inf")), "analytic"
        return cost.cpu_seconds(st.work, spec, hw), "analytic"

    def stage_cost(st: Stage) -> StageCost:
        (gpu_s, gpu_src), (cpu_s, cpu_src) = seconds("gpu", st), seconds("cpu", st)
        return StageCost(st, gpu_s, cpu_s,
                         cost.h2d_seconds(st.in_bytes, hw) if has_gpu and st.in_bytes else 0.0,
                         cost.d2h_seconds(st.in_bytes, hw) if has_gpu and st.in_bytes else 0.0,
                         gpu_source=gpu_src, cpu_source=cpu_src)

    stages = {phase: tuple(stage_cost(st) for st in graph.stages[phase]) for phase in PHASES}
    wl = graph.workload
    load_s = {b.name: cost.h2d_seconds(b.weight_bytes, hw) for b in graph.blocks} if has_gpu else {}
    kv_down_s = {b.name: cost.d2h_seconds(wl.batch * wl.prompt_len * b.kv_bytes_per_token, hw)
                 for b in graph.blocks if b.kind == "attn"} if has_gpu else {}
    ws_gpu, ws_cpu = workspace_bytes(spec, wl, "gpu"), workspace_bytes(spec, wl, "cpu")
    experts = {}
    if has_gpu and spec.is_moe and spec.extra.get("source") != "onnx":
        for phase in PHASES:
            tokens = wl.batch * (wl.prompt_len if phase == "prefill" else 1)
            alike: dict = {}   # layers routed alike share one ExpertLayer (every layer, without a profile)
            experts[phase] = {}
            for b in graph.blocks:
                if b.kind == "moe":
                    f = routing.expert_fractions(b.layer, spec) if routing is not None else uniform_fractions(spec)
                    if tuple(f) not in alike:
                        alike[tuple(f)] = expert_layer(spec, hw, tokens, f)
                    experts[phase][b.name] = alike[tuple(f)]
    return Problem(graph, hw, stages, load_s, kv_down_s,
                   gpu_budget_bytes=float(hw.gpu_budget_bytes()), cpu_budget_bytes=float(hw.cpu_budget_bytes()),
                   gpu_workspace_bytes=ws_gpu if has_gpu else 0.0, cpu_workspace_bytes=ws_cpu,
                   experts=experts, routing=routing)


def build_problem(spec: ModelSpec, hw: HardwareSpec, wl: Workload, profile=None, routing=None) -> Problem:
    if wl.context_len > spec.max_positions:
        raise HetplanError(f"--prompt-len + --gen-len = {wl.context_len} exceeds the model's "
                           f"max_position_embeddings ({spec.max_positions})")
    if spec.extra.get("source") == "onnx":
        from hetplan.frontends.onnx.graph import onnx_block_graph  # only for models imported from ONNX
        graph = onnx_block_graph(spec, wl)
    else:
        graph = block_graph(spec, wl, routing)
    if profile is None and hw.profile:
        from hetplan.profile.table import load_profile
        profile = load_profile(hw.profile)
    return price(graph, hw, profile, routing)
