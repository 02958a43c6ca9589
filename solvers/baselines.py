"""Baseline placements: what a user gets from today's tools, under hetplan's cost model.

Each is a few lines from a Problem to a Decision. They double as test oracles: the ILP must
never be worse than any of them. On a node without a GPU every baseline is the all-CPU plan.
"""

from __future__ import annotations

from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.plan import Decision
from hetplan.problem import Problem


def _decision(problem: Problem, weights: dict, kv: dict, depth: int) -> Decision:
    exec_ = {ph: {n: w for n, w in weights.items()} for ph in PHASES}
    return Decision(weights=weights, exec=exec_, kv=kv, depth=depth)


def all_cpu(problem: Problem) -> Decision:
    return _decision(problem, {b.name: "cpu" for b in problem.blocks},
                     {b.name: "cpu" for b in problem.blocks if b.kind == "attn"}, depth=1)


def all_gpu(problem: Problem) -> Decision:
    """Everything resident on the GPU (what works when the model fits)."""
    if not problem.has_gpu:
        return all_cpu(problem)
    return _decision(problem, {b.name: "gpu" for b in problem.blocks},
                     {b.name: "gpu" for b in problem.blocks if b.kind == "attn"}, depth=1)


def greedy(problem: Problem) -> Decision:
    """Accelerate ``device_map="auto"``: fill the GPU in module order by memory after reserving the
    KV cache, workspace and one offload buffer for the largest block; the rest stays in DRAM and
    is copied to the GPU synchronously right before use (depth 1). KV caches live on the GPU,
    where every layer executes."""
    if not problem.has_gpu:
        return all_cpu(problem)
    blocks = problem.blocks
    kv = sum(b.kv_bytes for b in blocks)
    free = problem.gpu_budget_bytes - kv - problem.gpu_workspace_bytes - max(
        b.weight_bytes for b in blocks if b.streamable)
    weights, full = {}, False
    for b in blocks:
        if not full and b.weight_bytes <= free:
            weights[b.name] = "gpu"
            free -= b.weight_bytes
        else:
            full = True
            weights[b.name] = "stream" if b.streamable else "cpu"
    return _decision(problem, weights, {b.name: "gpu" for b in blocks if b.kind == "attn"}, depth=1)


def ngl(problem: Problem, n: int | None = None) -> Decision:
    """llama.cpp ``-ngl N``: the last N layers (attention, MLP and KV cache) on the GPU, the rest
    computed on the CPU; token embeddings on the CPU; the output layer on the GPU when
    N > n_layers. ``n=None`` picks the largest N that fits."""
    spec = problem.model
    if not problem.has_gpu:
        return all_cpu(problem)
    if n is None:
        for k in range(spec.n_layers + 1, -1, -1):
            dec = ngl(problem, k)
            if _gpu_bytes(problem, dec) <= problem.gpu_budget_bytes:
                return dec
        return ngl(problem, 0)
    if n < 0:
        raise HetplanError(f"--strategy ngl:{n}: N must be >= 0")
    first_gpu = spec.n_layers - min(n, spec.n_layers)
    weights, kv = {}, {}
    for b in problem.blocks:
        on_gpu = (b.layer is not None and b.layer >= first_gpu) or (b.kind == "head" and n > spec.n_layers)
        weights[b.name] = "gpu" if on_gpu else "cpu"
        if b.kind == "attn":
            kv[b.name] = "gpu" if on_gpu else "cpu"
    return _decision(problem, weights, kv, depth=1)


def stream(problem: Problem) -> Decision:
    """FlexGen/ZeRO-Inference: every weight in pinned DRAM, prefetched one block ahead into two
    staging slots (depth 2); KV caches on the GPU when they fit with the slots, else in DRAM."""
    if not problem.has_gpu:
        return all_cpu(problem)
    blocks = problem.blocks
    weights = {b.name: "stream" if b.streamable else "cpu" for b in blocks}
    slots = 2 * max(b.weight_bytes for b in blocks if b.streamable)
    kv_total = sum(b.kv_bytes for b in blocks)
    kv_on = "gpu" if kv_total + slots + problem.gpu_workspace_bytes <= problem.gpu_budget_bytes else "cpu"
    if kv_on == "cpu":  # attention without a separate core stage (ONNX blocks) computes beside its cache
        split = {st.block for st in problem.graph.stages["decode"] if st.follows == "kv"}
        weights.update({b.name: "cpu" for b in blocks if b.kind == "attn" and b.name not in split})
    return _decision(problem, weights, {b.name: kv_on for b in blocks if b.kind == "attn"}, depth=2)


def cpu_moe(problem: Problem) -> Decision:
    """llama.cpp ``--cpu-moe`` / kTransformers: every routed expert in DRAM and computed on the
    CPU; everything else (attention, KV caches, routers, shared experts, dense layers, the
    embedding and the head) resident on the GPU."""
    return n_cpu_moe(problem, problem.model.n_layers)


def n_cpu_moe(problem: Problem, n: int | None = None) -> Decision:
    """llama.cpp ``--n-cpu-moe N``: the routed experts of the first N layers on the CPU, every
    other weight resident on the GPU. ``n=None`` picks the smallest N that fits."""
    _need_experts(problem, "n-cpu-moe")
    if not problem.has_gpu:
        return all_cpu(problem)
    spec = problem.model
    if n is None:
        for k in range(spec.n_layers + 1):
            dec = n_cpu_moe(problem, k)
            if _gpu_bytes(problem, dec) <= problem.gpu_budget_bytes:
                return dec
        return n_cpu_moe(problem, spec.n_layers)
    if n < 0:
        raise HetplanError(f"--strategy n-cpu-moe:{n}: N must be >= 0")
    dec = all_gpu(problem)
    experts = {b.name: 0 if b.layer < n else spec.n_experts for b in problem.blocks if b.kind == "moe"}
    return Decision(dec.weights, dec.exec, dec.kv, depth=dec.depth, experts=experts)


def _need_experts(problem: Problem, name: str) -> None:
    if not problem.model.is_moe:
        raise HetplanError(f"--strategy {name}: model {problem.model.name!r} has no experts; "
                           f"use ngl, greedy, stream or all-gpu")


def _gpu_bytes(problem: Problem, dec: Decision) -> float:
    from hetplan.evaluate import memory_report
    return memory_report(problem, dec)[0]["gpu_bytes"]


BASELINES = {"all-gpu": all_gpu, "greedy": greedy, "ngl": ngl, "stream": stream}
"""Baselines for every model."""
MOE_BASELINES = {"cpu-moe": cpu_moe, "n-cpu-moe": n_cpu_moe}
"""Baselines for mixture-of-experts models only."""


def applicable(problem: Problem) -> dict:
    """name -> baseline function, for the baselines that apply to ``problem``'s model."""
    return {**BASELINES, **MOE_BASELINES} if problem.model.is_moe else dict(BASELINES)


def best_fitting(problem: Problem) -> tuple:
    """(name, decision, objective in s) of the baseline with the least objective among those
    that fit the budgets; (None, None, inf) when none fits."""
    from hetplan.evaluate import memory_report, objective_s, predictions
    from hetplan.schedule import build_schedule

    best = (None, None, float("inf"))
    for name, fn in applicable(problem).items():
        dec = fn(problem)
        mem = memory_report(problem, dec)[0]
        if mem["gpu_bytes"] > problem.gpu_budget_bytes or mem["cpu_bytes"] > problem.cpu_budget_bytes:
            continue
        obj = objective_s(problem, predictions(problem, build_schedule(problem, dec)))
        if obj < best[2]:
            best = (name, dec, obj)
    return best
