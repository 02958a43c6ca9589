"""Plans over several GPUs of one node: contiguous layer ranges as pipeline stages.

Each stage is an ordinary single-GPU problem (``hetplan.problem``) over a slice of the model,
solved by the same strategies as a one-GPU node (resident / streamed / CPU, KV tier per block),
on that GPU alone with its own memory budget; ``hetplan.solvers.pipeline`` chooses the stage
boundaries. Between consecutive stages the hidden state crosses the link between their GPUs
(``cost.peer_seconds``). The host's DRAM is shared: the stages' CPU bytes together must fit.
Knows nothing about torch or about executing a plan.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hetplan import cost
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.hardware import HardwareSpec
from hetplan.model import ModelSpec
from hetplan.problem import Problem, build_problem
from hetplan.workload import Workload

ENDS = ("embed", "head")


def slice_model(spec: ModelSpec, first: int, end: int) -> ModelSpec:
    """The model's layers ``[first, end)`` as a model of their own (a dense prefix of an MoE
    model, e.g. DeepSeek's first layers, kept where it falls)."""
    if spec.extra.get("source") == "onnx" or spec.block_bytes:
        raise HetplanError(f"{spec.name}: several GPUs are planned for preset and config.json models; "
                           f"a model whose blocks are priced from its file (GGUF, ONNX) is planned on one "
                           f"GPU: pass a node with one GPU")
    dense = min(end - first, max(0, spec.first_dense_layers - first))
    return dataclasses.replace(spec, n_layers=end - first, first_dense_layers=dense)


def without_ends(problem: Problem, keep: set) -> Problem:
    """``problem`` with the embedding and/or head not in ``keep`` made free: no bytes, no time.
    They belong to the first and the last stage only; a free block is placed anywhere at no cost."""
    drop = set(ENDS) - keep
    blocks = tuple(dataclasses.replace(b, weight_bytes=0.0) if b.name in drop else b for b in problem.blocks)
    stages = {ph: tuple(dataclasses.replace(sc, gpu_s=0.0, cpu_s=0.0, up_s=0.0, down_s=0.0)
                        if sc.stage.block in drop else sc for sc in chain)
              for ph, chain in problem.stages.items()}
    load_s = {b: 0.0 if b in drop else s for b, s in problem.load_s.items()}
    return dataclasses.replace(problem, graph=dataclasses.replace(problem.graph, blocks=blocks),
                               stages=stages, load_s=load_s)


def stage_problem(spec: ModelSpec, hw: HardwareSpec, wl: Workload, k: int, first: int, end: int) -> Problem:
    """Layers ``[first, end)`` on GPU ``k`` alone (with the embedding when ``first == 0``, the
    head when ``end == n_layers``)."""
    keep = {"embed"} if first == 0 else set()
    if end == spec.n_layers:
        keep.add("head")
    return without_ends(build_problem(slice_model(spec, first, end), hw.single_gpu(k), wl), keep)


def hidden_bytes(spec: ModelSpec, wl: Workload, phase: str) -> float:
    """The hidden state one stage hands the next: tokens x hidden x bytes per activation."""
    tokens = wl.batch * (wl.prompt_len if phase == "prefill" else 1)
    return tokens * spec.hidden * cost.activation_bytes_per_elem(spec)


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
                            "weights": _tiers(s.plan)} for s in self.stages],
                "links": [dict(l) for l in self.links],
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
    count, holds embed, holds head, dense layers) and cached; a stage's seconds are its
    ``ttft_s`` (prefill) plus ``gen_len`` x ``tpot_s`` for ``sum``, its ``tpot_s`` for ``max``."""
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
        return pred_ttft + wl.gen_len * pred_tpot if objective == "sum" else pred_tpot

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
