"""The pipeline plan: stage boundaries chosen by ``hetplan.solvers.pipeline`` over stages
priced by the single-GPU planner, the links between them, and what the whole predicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetplan import cost
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.hardware import HardwareSpec
from hetplan.model import ModelSpec
from hetplan.pipeline.record import stage_record
from hetplan.pipeline.stages import hidden_bytes, stage_problem
from hetplan.workload import Workload


@dataclass(frozen=True)
class StagePlan:
    gpu: int
    first_layer: int
    end_layer: int
    plan: object
    """The stage's single-GPU Plan (its layers numbered from 0)."""


@dataclass(frozen=True)
class PipelinePlan:
    stages: tuple
    links: tuple
    """Per consecutive pair: {from, to, kind, prefill_s, decode_s}."""
    workload: Workload
    objective: str
    """sum (latency: stages one after another) or max (throughput: the slowest stage)."""

    def phase_s(self, phase: str) -> float:
        """One pass of ``phase`` through every stage and link in turn."""
        key = "ttft_s" if phase == "prefill" else "tpot_s"
        return sum(s.plan.predicted[key] for s in self.stages) + sum(l[f"{phase}_s"] for l in self.links)

    def bottleneck_s(self, phase: str) -> float:
        """The slowest stage or link of ``phase``: the interval between micro-batches."""
        key = "ttft_s" if phase == "prefill" else "tpot_s"
        return max([s.plan.predicted[key] for s in self.stages] + [l[f"{phase}_s"] for l in self.links])

    def predicted(self) -> dict:
        wl = self.workload
        ttft, tpot = self.phase_s("prefill"), self.phase_s("decode")
        return {"ttft_s": ttft, "tpot_s": tpot, "latency_s": ttft + wl.gen_len * tpot,
                "decode_tokens_per_s": wl.batch / tpot, "prefill_tokens_per_s": wl.batch * wl.prompt_len / ttft,
                "pipelined_decode_tokens_per_s": wl.batch / self.bottleneck_s("decode")}

    def to_dict(self) -> dict:
        """The stage assignment as plan.json's ``pipeline`` records it."""
        return {"objective": self.objective,
                "stages": [{"gpu": s.gpu, "layers": [s.first_layer, s.end_layer],
                            "ttft_s": s.plan.predicted["ttft_s"], "tpot_s": s.plan.predicted["tpot_s"],
                            "gpu_bytes": s.plan.memory["gpu_bytes"], "cpu_bytes": s.plan.memory["cpu_bytes"],
                            "weights": _tiers(s.plan), "plan": stage_record(s.plan)} for s in self.stages],
                "links": [{"from_gpu": l["from"], "to_gpu": l["to"], "kind": l["kind"], "prefill_s": l["prefill_s"],
                           "decode_s": l["decode_s"]} for l in self.links],
                "predicted": self.predicted()}


def _tiers(plan) -> dict:
    """Blocks per weights tier (gpu / stream / cpu) in a stage's plan, ends not held left out."""
    out = {"gpu": 0, "stream": 0, "cpu": 0}
    for p in plan.placement:
        if p["weight_bytes"] > 0:
            out[p["weights"]] += 1
    return out


def plan_pipeline(spec: ModelSpec, hw: HardwareSpec, wl: Workload, solve_stage, objective: str = "sum") -> PipelinePlan:
    """The best pipeline of ``spec`` over ``hw``'s GPUs. ``solve_stage(problem)`` is the single-GPU
    planner: a Plan, or None when nothing fits. Stages are priced once per distinct (GPU, layer
    count, holds embed, holds head, dense layers) and cached; a stage's seconds are what the
    workload's objective minimises of it (``sum``), or its ``tpot_s`` (``max``)."""
    from hetplan.solvers.pipeline import best_split

    if not hw.gpus:
        raise HetplanError(f"node {hw.name!r} has no GPU: there is no pipeline to plan")
    L = spec.n_layers
    plans: dict = {}

    def stage_plan(k, a, b):
        dense = min(b - a, max(0, spec.first_dense_layers - a))
        key = (hw.gpus.index(hw.gpus[k]), b - a, a == 0, b == L, dense)  # equal GPUs share prices
        if key not in plans:
            plans[key] = solve_stage(stage_problem(spec, hw, wl, k, a, b))
        return plans[key]

    def seconds(pred_ttft: float, pred_tpot: float) -> float:
        """What ``wl.objective`` minimises of a stage or a link (the throughput objective: its
        decode time, the interval the slowest one sets)."""
        if objective == "max":
            return pred_tpot
        return {"ttft": pred_ttft, "tpot": pred_tpot}.get(wl.objective, pred_ttft + wl.gen_len * pred_tpot)

    def stage(k, a, b):
        p = stage_plan(k, a, b)
        return math.inf if p is None else seconds(p.predicted["ttft_s"], p.predicted["tpot_s"])

    def link_s(j, k, phase):
        return cost.peer_seconds(hidden_bytes(spec, wl, phase), hw, j, k)

    def link(j, k):
        return seconds(link_s(j, k, "prefill"), link_s(j, k, "decode"))

    split = best_split(L, len(hw.gpus), stage, link, objective)
    if split is None:
        raise InfeasibleError(f"{spec.name}: no split of its {L} layers over the {len(hw.gpus)} GPUs of "
                              f"{hw.name!r} fits (each stage's GPU, with the host's DRAM)")
    stages = tuple(StagePlan(k, a, b, stage_plan(k, a, b)) for k, a, b in split.stages)
    links = tuple({"from": s.gpu, "to": t.gpu, "kind": hw.peer(s.gpu, t.gpu).kind,
                   "prefill_s": link_s(s.gpu, t.gpu, "prefill"), "decode_s": link_s(s.gpu, t.gpu, "decode")}
                  for s, t in zip(stages, stages[1:]))
    cpu = sum(s.plan.memory["cpu_bytes"] for s in stages)
    if cpu > hw.cpu_budget_bytes():
        from hetplan.units import format_bytes
        raise InfeasibleError(f"{spec.name}: the best split's stages hold {format_bytes(cpu)} in DRAM together, "
                              f"more than the {format_bytes(hw.cpu_budget_bytes())} the host has free; use a "
                              f"smaller --weight-dtype or a node with more DRAM")
    return PipelinePlan(stages, links, wl, objective)


def pipeline_makespan_s(times: list, n_micro: int) -> float:
    """Replay ``n_micro`` micro-batches through a chain of serial resources (stage, link, stage,
    ...) taking ``times[s]`` each: micro-batch ``i`` leaves resource ``s`` at
    ``F[i][s] = max(F[i-1][s], F[i][s-1]) + times[s]``; the makespan is ``F[n_micro-1][-1]``."""
    done = [0.0] * len(times)
    for _ in range(n_micro):
        ready = 0.0
        for s, t in enumerate(times):
            done[s] = max(done[s], ready) + t
            ready = done[s]
    return done[-1]
