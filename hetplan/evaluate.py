"""Assemble a Plan from a Decision: schedule, memory per tier, predictions, bounds.

Shared by every strategy so that plans differ only in what their solver decided.
"""

from __future__ import annotations

from hetplan import cost
from hetplan.bounds import phase_lower_bound_s
from hetplan.graph import PHASES
from hetplan.plan import Decision, Plan
from hetplan.plan.pending import copies_out_bytes
from hetplan.problem import Problem
from hetplan.schedule import build_schedule


def memory_report(problem: Problem, dec: Decision) -> dict:
    """Bytes per tier: resident weights, KV cache, staging slots, workspace; and the budgets.
    These are the bytes every solver places (within ``problem.gpu_budget_bytes``); the plan adds
    what copies to the host leave waiting in HBM (``make_plan``), which needs the schedule.

    GPU: weights of ``gpu`` blocks (less their cold experts) + KV of ``gpu`` caches + depth *
    slot + workspace (when any block computes on the GPU). CPU: weights of ``cpu``/``stream``
    blocks + cold experts + KV of ``cpu`` caches + workspace.

    Slots come in block sizes: a slot is the smallest streamable block size that holds what is
    loaded into it (the largest streamed block, or a resident MoE block's streamed cold experts,
    which round up to the next block size). The MILP enumerates exactly these sizes."""
    gpu_w = cpu_w = gpu_kv = cpu_kv = 0.0
    slot = 0.0
    for b in problem.blocks:
        cold = cold_expert_bytes(problem, dec, b)
        if dec.weights[b.name] == "gpu":
            gpu_w += b.weight_bytes - cold
            cpu_w += cold
        else:
            cpu_w += b.weight_bytes
        if any(dec.exec[ph][b.name] == "stream" for ph in PHASES):
            slot = max(slot, cold if dec.weights[b.name] == "gpu" else b.weight_bytes)
        if b.kind == "attn":
            if dec.kv[b.name] == "gpu":
                gpu_kv += b.kv_bytes
            else:
                cpu_kv += b.kv_bytes
    if slot:
        slot = min(w for w in (b.weight_bytes for b in problem.blocks if b.streamable) if w >= slot)
    gpu_used = any(dec.exec[ph][b.name] != "cpu" for ph in PHASES for b in problem.blocks)
    gpu = {"weights": gpu_w, "kv": gpu_kv, "staging": dec.depth * slot,
           "workspace": problem.gpu_workspace_bytes if gpu_used else 0.0}
    cpu = {"weights": cpu_w, "kv": cpu_kv, "workspace": problem.cpu_workspace_bytes}
    return {"gpu_bytes": sum(gpu.values()), "gpu_budget_bytes": problem.gpu_budget_bytes + problem.gpu_held_back_bytes,
            "cpu_bytes": sum(cpu.values()), "cpu_budget_bytes": problem.cpu_budget_bytes,
            "breakdown": {"gpu": gpu, "cpu": cpu}}, slot


def cold_expert_bytes(problem: Problem, dec: Decision, block) -> float:
    """Bytes of the routed experts of a GPU-resident MoE block that stay in DRAM."""
    if block.kind != "moe" or dec.weights[block.name] != "gpu" or not problem.experts:
        return 0.0
    x = problem.experts["decode"][block.name]
    return (x.n_experts - dec.hot_experts(block.name, x.n_experts)) * x.expert_bytes


def _expert_fields(problem: Problem, dec: Decision, b) -> dict:
    """Placement fields of an MoE block: how many and which routed experts live in HBM, and the
    bytes of those that stay in DRAM."""
    if b.kind != "moe":
        return {"experts_on_gpu": None}
    if not problem.experts:
        return {"experts_on_gpu": 0, "gpu_experts": [], "cold_expert_bytes": 0.0}
    x = problem.experts["decode"][b.name]
    n = dec.hot_experts(b.name, x.n_experts)
    return {"experts_on_gpu": n, "gpu_experts": sorted(x.ranked[:n]),
            "cold_expert_bytes": cold_expert_bytes(problem, dec, b)}


def predictions(problem: Problem, schedule: dict) -> dict:
    wl, hw = problem.workload, problem.hw
    ttft = schedule["prefill"].makespan_s
    tpot = schedule["decode"].makespan_s
    total = ttft + wl.gen_len * tpot
    pred = {
        "ttft_s": ttft, "tpot_s": tpot, "latency_s": total,
        "decode_tokens_per_s": wl.batch / tpot,
        "prefill_tokens_per_s": wl.batch * wl.prompt_len / ttft,
        "throughput_tokens_per_s": wl.batch * wl.gen_len / total,
        "lower_bound_ttft_s": phase_lower_bound_s(problem, "prefill"),
        "lower_bound_tpot_s": phase_lower_bound_s(problem, "decode"),
        "bottleneck": {ph: _bottleneck(schedule[ph]) for ph in PHASES},
    }
    if hw.price_per_hour:
        pred["tokens_per_dollar"] = pred["throughput_tokens_per_s"] * 3600 / hw.price_per_hour
    return pred


def _bottleneck(sched) -> str:
    busy = {}
    for t in sched.tasks:
        busy[t.resource] = busy.get(t.resource, 0.0) + t.duration_s
    return max(sorted(busy), key=lambda r: busy[r])


def objective_s(problem: Problem, pred: dict) -> float:
    """The number the objective minimises, in seconds."""
    obj = problem.workload.objective
    if obj == "ttft":
        return pred["ttft_s"]
    if obj == "tpot":
        return pred["tpot_s"]
    return pred["latency_s"]


def kv_source_bytes_per_byte(problem: Problem) -> float:
    """GPU bytes a ``kv_down`` holds per byte it copies: the prompt's K/V rows in the activation
    dtype (before they are quantised for the cache) per byte of them in the KV dtype."""
    spec = problem.model
    per_token = spec.kv_bytes_per_token()
    return spec.kv_elems_per_token() * cost.activation_bytes_per_elem(spec) / per_token if per_token else 0.0


def kv_down_source_bytes(problem: Problem, block) -> float:
    """The GPU bytes the prefill's copy of ``block``'s prompt K/V to a cache in DRAM holds until
    it ends (``hetplan.plan.pending``: the copy's bytes times ``kv_source_bytes_per_byte``)."""
    wl = problem.workload
    return wl.batch * wl.prompt_len * block.kv_bytes_per_token * kv_source_bytes_per_byte(problem)


def with_copies_out(memory: dict, problem: Problem, schedule: dict) -> dict:
    """``memory`` with the GPU bytes that copies to the host leave waiting (the most over both
    phases, ``hetplan.plan.pending``) as ``breakdown.gpu.copies_out``, added to ``gpu_bytes``."""
    ratio = kv_source_bytes_per_byte(problem)
    held = max((copies_out_bytes(schedule[ph].tasks, schedule[ph].edges, ratio) for ph in PHASES), default=0.0)
    gpu = dict(memory["breakdown"]["gpu"], copies_out=held)
    return dict(memory, gpu_bytes=memory["gpu_bytes"] + held, breakdown=dict(memory["breakdown"], gpu=gpu))


def make_plan(problem: Problem, dec: Decision, solver: dict, inputs: dict | None = None) -> Plan:
    schedule = build_schedule(problem, dec)
    memory, slot = memory_report(problem, dec)
    memory = with_copies_out(memory, problem, schedule)
    pred = predictions(problem, schedule)
    placement = []
    for b in problem.blocks:
        placement.append({
            "block": b.name, "kind": b.kind, "layer": b.layer, "weights": dec.weights[b.name],
            "exec": {ph: dec.exec[ph][b.name] for ph in PHASES},
            "kv": dec.kv.get(b.name) if b.kind == "attn" else None,
            **_expert_fields(problem, dec, b),
            "weight_bytes": b.weight_bytes, "kv_bytes": b.kv_bytes,
        })
    solver = dict(solver, objective_s=objective_s(problem, pred))
    return Plan(model=problem.model, hardware=problem.hw, workload=problem.workload, solver=solver,
                placement=tuple(placement), staging={"depth": dec.depth, "slot_bytes": slot},
                memory=memory, predicted=pred, schedule=schedule, inputs=inputs or {},
                cpu_attention_bytes_per_cache_byte=dec.cpu_attention_bytes_per_cache_byte)


def fits(plan: Plan) -> bool:
    m = plan.memory
    return m["gpu_bytes"] <= m["gpu_budget_bytes"] * (1 + 1e-9) and m["cpu_bytes"] <= m["cpu_budget_bytes"] * (1 + 1e-9)


HELD_BACK_ROUNDS = 8
"""Solves at most, each holding back the HBM the previous plan's copies to the host left waiting."""


def plan_within_budget(problem: Problem, solve, inputs: dict | None = None):
    """Solve ``problem`` (``solve(problem) -> (Decision or None, info, seconds)``) and assemble
    the plan; while the plan overflows the GPU budget by the values its copies to the host leave
    waiting (``memory.breakdown.gpu.copies_out``, which the solvers cannot see: it follows from
    the schedule), solve again with that much HBM held back (``Problem.held_back``, never less
    than before). -> (plan or None when nothing fits, the problem last solved, solve seconds)."""
    total = 0.0
    plan = None
    for _ in range(HELD_BACK_ROUNDS):
        dec, info, secs = solve(problem)
        total += secs
        if dec is None:
            return None, problem, total
        plan = make_plan(problem, dec, info, inputs=inputs)
        held = plan.memory["breakdown"]["gpu"]["copies_out"]
        if fits(plan) or held <= problem.gpu_held_back_bytes:
            break
        problem = problem.held_back(held)
    return plan, problem, total
