"""The compile driver: MODEL + NODE + WORKLOAD + strategy -> Plan.

The library function the CLI, ``hetplan check`` and the tests all call. Handles the choices
around a solve (automatic weight dtype, the throughput objective's batch search, infeasibility
diagnosis); the solving itself is in ``hetplan.solvers``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

from hetplan.dtypes import bytes_per_element
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.evaluate import fits, make_plan, objective_s, predictions
from hetplan.hardware import HardwareSpec, load_node
from hetplan.model import ModelSpec
from hetplan.frontends.resolve import load_model
from hetplan.plan import Plan
from hetplan.graph import workspace_bytes
from hetplan.problem import Problem, build_problem
from hetplan.schedule import build_schedule
from hetplan.units import format_bytes, parse_bytes
from hetplan.workload import Workload, chunk_candidates

STRATEGIES = ("ilp", "all-gpu", "greedy", "ngl", "stream", "cpu-moe", "n-cpu-moe")
COUNTED = ("ngl", "n-cpu-moe")
"""Strategies that take a layer count (``ngl:N``, ``n-cpu-moe:N``)."""
AUTO_DTYPES = ("q8_0", "q4_k_m")
"""Tried in order when ``--weight-dtype auto`` finds the native dtype does not fit."""


@dataclass(frozen=True)
class CompileRequest:
    model: str
    hw: str
    batch: int = 1
    prompt_len: int = 512
    gen_len: int = 128
    objective: str = "latency"
    strategy: str = "ilp"
    weight_dtype: str = "auto"
    kv_dtype: str | None = None
    gpu_mem: str | None = None
    cpu_mem: str | None = None
    time_limit_s: float = 120.0
    max_nodes: int = 30
    mip_gap: float = 1e-4
    stream_cold_experts: bool = False
    prefill_chunk: int | None = None
    """``--prefill-chunk``: prompt tokens per prefill chunk (None: the planner chooses)."""
    routing: str | dict | None = None
    """Routing statistics of an MoE model: a file path (``--routing``) or the parsed document
    (what a plan records, so that it recompiles without the file)."""
    dump_lp: str | None = None
    notes: list = field(default_factory=list, compare=False)
    """Messages for the user (e.g. which dtype ``auto`` chose); filled while compiling."""

    def cli_args(self, routing=None) -> dict:
        """The request as a plan records it: ``routing`` (RoutingStats) replaces the path by its
        document; keys at their default ``None`` that older plans lack are left out."""
        d = dataclasses.asdict(self)
        for k in ("notes", "dump_lp"):
            d.pop(k)
        d.pop("routing")
        if routing is not None:
            d["routing"] = json.loads(routing.to_json())
        if d["mip_gap"] == 1e-4:
            d.pop("mip_gap")
        if not d["stream_cold_experts"]:
            d.pop("stream_cold_experts")
        if d["prefill_chunk"] is None:
            d.pop("prefill_chunk")
        return d


def parse_strategy(text: str) -> tuple[str, int | None]:
    name, _, arg = text.partition(":")
    if name not in STRATEGIES:
        raise HetplanError(f"--strategy: unknown strategy {text!r}; choose one of "
                           f"ilp, all-gpu, greedy, ngl[:N], stream, cpu-moe, n-cpu-moe[:N]")
    if arg and name not in COUNTED:
        raise HetplanError(f"--strategy {text}: only ngl and n-cpu-moe take an argument (ngl:N, n-cpu-moe:N)")
    if arg:
        if not arg.isdigit():
            raise HetplanError(f"--strategy {text}: N must be a non-negative integer")
        return name, int(arg)
    return name, None


def load_inputs(req: CompileRequest) -> tuple[ModelSpec, HardwareSpec]:
    hw = load_node(req.hw)
    hw = hw.with_budgets(parse_bytes(req.gpu_mem, "--gpu-mem") if req.gpu_mem else None,
                         parse_bytes(req.cpu_mem, "--cpu-mem") if req.cpu_mem else None)
    dtype = None if req.weight_dtype == "auto" else req.weight_dtype
    spec = load_model(req.model, dtype, req.kv_dtype)
    return spec, hw


def load_request_routing(req: CompileRequest, spec: ModelSpec):
    """The request's routing statistics for ``spec`` (RoutingStats), or None."""
    from hetplan.routing import load_routing, stats_from_dict

    if req.routing is None:
        return None
    if isinstance(req.routing, dict):
        return stats_from_dict(req.routing, spec, source="plan inputs.cli_args.routing")
    return load_routing(req.routing, spec)


def _workload(req: CompileRequest, batch: int | None = None) -> Workload:
    """The request's workload, with its ``--prefill-chunk`` or else the smallest chunk the planner
    would try (what fit checks and diagnoses assume)."""
    chunk = req.prefill_chunk or chunk_candidates(req.prompt_len)[0]
    return Workload(batch=batch or req.batch, prompt_len=req.prompt_len, gen_len=req.gen_len,
                    objective=req.objective, prefill_chunk=min(chunk, req.prompt_len))


def decide(problem: Problem, strategy: str, arg: int | None, req: CompileRequest):
    """Run one strategy on a problem -> (Decision or None, solver info dict, solve seconds)."""
    from hetplan.solvers import baselines, ilp

    if strategy != "ilp":
        t0 = time.perf_counter()
        fn = baselines.applicable(problem).get(strategy) or baselines.MOE_BASELINES[strategy]
        dec = fn(problem, arg) if strategy in COUNTED else fn(problem)
        name = strategy if arg is None else f"{strategy}:{arg}"
        info = {"strategy": name, "status": "heuristic", "mip_gap": None, "lower_bound_s": None, "options": {}}
        return dec, info, time.perf_counter() - t0
    opts = ilp.IlpOptions(time_limit_s=req.time_limit_s, max_nodes=req.max_nodes, mip_rel_gap=req.mip_gap,
                          stream_cold=req.stream_cold_experts, dump_lp=req.dump_lp)
    baseline = baselines.best_fitting(problem) if problem.has_gpu else (None, None, float("inf"))
    res = ilp.solve(problem, opts)
    if res.decision is not None and res.objective_s is None:
        # No GPU: the all-CPU plan is the only placement, so it is its own bound.
        obj = objective_s(problem, predictions(problem, build_schedule(problem, res.decision)))
        res = dataclasses.replace(res, objective_s=obj, bound_s=obj)
    info = {"strategy": "ilp", "status": res.status, "mip_gap": res.mip_gap, "lower_bound_s": res.bound_s,
            "milp_objective_s": res.objective_s,
            "options": {"time_limit_s": opts.time_limit_s, "max_nodes": opts.max_nodes,
                        "mip_rel_gap": opts.mip_rel_gap, "depths": list(opts.depths)},
            "size": {"binaries": res.n_binaries, "constraints": res.n_constraints}}
    dec = res.decision
    if dec is not None and res.status != "optimal":
        # Not proven optimal: never hand out something worse than a baseline that fits.
        dec, info = _at_least_baselines(problem, dec, info, baseline)
    return dec, info, res.solve_seconds


def _at_least_baselines(problem: Problem, dec, info, baseline: tuple):
    """``dec``, or the best fitting baseline (``baselines.best_fitting``) when it is better."""
    best, best_obj = dec, objective_s(problem, predictions(problem, build_schedule(problem, dec)))
    name, cand, obj = baseline
    if obj < best_obj:
        best, best_obj = cand, obj
        info = dict(info, incumbent=f"baseline {name}")
    if info.get("lower_bound_s") is not None and best_obj > 0:
        info = dict(info, mip_gap=max(0.0, (best_obj - info["lower_bound_s"]) / best_obj))
    return best, info


def compile_plan(req: CompileRequest) -> tuple[Plan, float]:
    """Compile ``req`` -> (plan, solve seconds). Raises InfeasibleError with the missing bytes."""
    strategy, arg = parse_strategy(req.strategy)
    spec, hw = load_inputs(req)
    routing = load_request_routing(req, spec)
    if req.weight_dtype == "auto":
        spec = _auto_dtype(spec, hw, _workload(req), req)
    if req.objective == "throughput":
        return _best_batch(spec, hw, req, strategy, arg, routing)
    return _compile_one(spec, hw, _workload(req), req, strategy, arg, routing)


def _compile_one(spec, hw, wl, req, strategy, arg, routing=None) -> tuple[Plan, float]:
    """Compile at ``--prefill-chunk``, or else at each of ``chunk_candidates`` (smallest first),
    keeping the first chunk size whose objective no larger one beats: the smallest workspace that
    wins."""
    if req.prefill_chunk is not None:
        return _compile_chunk(spec, hw, wl.with_chunk(min(req.prefill_chunk, wl.prompt_len)), req, strategy,
                              arg, routing)
    best, total, failure = None, 0.0, None
    for chunk in chunk_candidates(wl.prompt_len):
        try:
            plan, secs = _compile_chunk(spec, hw, wl.with_chunk(chunk), req, strategy, arg, routing)
        except InfeasibleError as e:
            failure = failure or e
            continue
        total += secs
        if best is None or _objective(plan) < _objective(best) * (1 - 1e-9):  # strictly better
            best = plan
    if best is None:
        raise failure
    return best, total


def _objective(plan: Plan) -> float:
    """What the plan's objective minimises (``evaluate.objective_s`` on its predictions)."""
    key = {"ttft": "ttft_s", "tpot": "tpot_s"}.get(plan.workload.objective, "latency_s")
    return plan.predicted[key]


def _compile_chunk(spec, hw, wl, req, strategy, arg, routing=None) -> tuple[Plan, float]:
    problem = build_problem(spec, hw, wl, routing=routing)
    dec, info, secs = decide(problem, strategy, arg, req)
    if dec is None:
        raise InfeasibleError(diagnose(problem))
    inputs = {"model_source": req.model, "hw_source": req.hw, "cli_args": req.cli_args(routing)}
    plan = make_plan(problem, dec, info, inputs=inputs)
    if not fits(plan):
        raise InfeasibleError(f"strategy {info['strategy']}: " + over_budget(plan))
    return plan, secs


def _best_batch(spec, hw, req, strategy, arg, routing=None) -> tuple[Plan, float]:
    """Throughput objective: batches 1, 2, 4, ... up to --batch; keep the most tokens/s."""
    best, total, batch = None, 0.0, 1
    while batch <= req.batch:
        try:
            plan, secs = _compile_one(spec, hw, _workload(req, batch), req, strategy, arg, routing)
        except InfeasibleError:
            break
        total += secs
        if best is None or plan.predicted["throughput_tokens_per_s"] > best.predicted["throughput_tokens_per_s"]:
            best = plan
        batch *= 2
    if best is None:
        raise InfeasibleError(diagnose(build_problem(spec, hw, _workload(req, 1))))
    return best, total


def _auto_dtype(spec, hw, wl, req) -> ModelSpec:
    """Keep the checkpoint's dtype when the model fits; else the widest of q8_0, q4_k_m that does."""
    native_bytes = None
    for dtype in (spec.weight_dtype,) + AUTO_DTYPES:
        cand = spec.with_dtypes(weight_dtype=dtype, kv_dtype=req.kv_dtype or spec.kv_dtype)
        problem = build_problem(cand, hw, wl)
        if native_bytes is None:
            native_bytes = sum(b.weight_bytes for b in problem.blocks)
        if _fits_at_all(problem):
            if dtype != spec.weight_dtype:
                req.notes.append(f"weights do not fit in {spec.weight_dtype} ({format_bytes(native_bytes)}); "
                                 f"planning {dtype} (pass --weight-dtype to choose)")
            return cand
    return spec


def _fits_at_all(problem: Problem) -> bool:
    """A necessary condition for feasibility: everything fits in GPU + CPU together."""
    need = sum(b.weight_bytes + b.kv_bytes for b in problem.blocks) + problem.cpu_workspace_bytes
    if problem.gpu_workspace_bytes <= problem.gpu_budget_bytes:
        return need + problem.gpu_workspace_bytes <= problem.gpu_budget_bytes + problem.cpu_budget_bytes
    return need <= problem.cpu_budget_bytes  # the GPU cannot even hold a workspace: all-CPU


def diagnose(problem: Problem) -> str:
    """Say which tier lacks how many bytes, and what would fix it."""
    weights = sum(b.weight_bytes for b in problem.blocks)
    kv = sum(b.kv_bytes for b in problem.blocks)
    ws = problem.gpu_workspace_bytes + problem.cpu_workspace_bytes
    have = problem.gpu_budget_bytes + problem.cpu_budget_bytes
    need = weights + kv + ws
    spec, wl = problem.model, problem.workload
    lines = [f"no placement fits: weights {format_bytes(weights)} ({spec.weight_dtype}) + KV cache "
             f"{format_bytes(kv)} (batch {wl.batch} x {wl.context_len} tokens) + workspace {format_bytes(ws)}"
             f" = {format_bytes(need)}, but GPU {format_bytes(problem.gpu_budget_bytes)} + CPU "
             f"{format_bytes(problem.cpu_budget_bytes)} = {format_bytes(have)} are available"]
    if need > have:
        lines.append(f"missing {format_bytes(need - have)} in total. Fixes: " + ", ".join(_fixes(problem, need - have)))
    elif problem.gpu_workspace_bytes > problem.gpu_budget_bytes:
        lines.append(f"the GPU budget is smaller than one forward pass's activation workspace "
                     f"({format_bytes(problem.gpu_workspace_bytes)} for batch {wl.batch} x prompt "
                     f"{wl.prompt_len}), so only an all-CPU plan is possible and the CPU lacks "
                     f"{format_bytes(weights + kv + problem.cpu_workspace_bytes - problem.cpu_budget_bytes)}: "
                     f"give the GPU more memory (--gpu-mem), the CPU more DRAM (--cpu-mem), or use a "
                     f"smaller batch, prompt or weight dtype")
    else:
        lines.append("the CPU tier cannot hold what the GPU cannot: give it more DRAM (--cpu-mem) "
                     "or use a smaller batch, context or weight dtype")
    return "; ".join(lines)


KV_DTYPES = ("bf16", "q8_0", "q4_0")
"""KV dtypes the diagnosis may suggest, widest first."""


def _fixes(problem: Problem, missing: float) -> list:
    """What would recover ``missing`` bytes, each computed for this problem: a smaller prefill
    chunk (workspace), a narrower KV dtype, a smaller weight dtype, a smaller batch; never a
    dtype or chunk already in use."""
    spec, wl, hw = problem.model, problem.workload, problem.hw
    kv = sum(b.kv_bytes for b in problem.blocks)
    weights = sum(b.weight_bytes for b in problem.blocks)
    ws = problem.gpu_workspace_bytes + problem.cpu_workspace_bytes
    out = []
    if wl.chunk_len > 512:
        small = wl.with_chunk(512)
        ws_small = workspace_bytes(spec, small, "cpu") + (workspace_bytes(spec, small, "gpu") if problem.has_gpu else 0)
        out.append(f"--prefill-chunk 512 (workspace {format_bytes(ws)} -> {format_bytes(ws_small)})")
    for dtype in KV_DTYPES:
        if bytes_per_element(dtype) < bytes_per_element(spec.kv_dtype):
            smaller = kv * bytes_per_element(dtype) / bytes_per_element(spec.kv_dtype)
            out.append(f"--kv-dtype {dtype} (KV {format_bytes(kv)} -> about {format_bytes(smaller)}"
                       f"{', enough' if kv - smaller >= missing else ''})")
            break
    narrower = [d for d in ("q8_0", "q4_k_m") if bytes_per_element(d) < spec.weight_bytes_per_param]
    enough = [d for d in narrower if weights * (1 - bytes_per_element(d) / spec.weight_bytes_per_param) >= missing]
    if narrower:  # the widest dtype that is enough, else the narrowest
        dtype = (enough or narrower[-1:])[0]
        smaller = weights * bytes_per_element(dtype) / spec.weight_bytes_per_param
        out.append(f"--weight-dtype {dtype} (weights {format_bytes(weights)} -> about {format_bytes(smaller)}"
                   f"{', enough' if dtype in enough else ''})")
    if wl.batch > 1:
        per_seq = kv / wl.batch
        fit = max(1, wl.batch - int(-(-missing // per_seq))) if per_seq else wl.batch
        out.append(f"a smaller --batch (KV is {format_bytes(per_seq)} per sequence; --batch {fit} frees "
                   f"{format_bytes(per_seq * (wl.batch - fit))})")
    else:
        out.append(f"a shorter context (KV is {format_bytes(kv)} for {wl.context_len} tokens)")
    out.append("or more memory (--cpu-mem / --gpu-mem, or a bigger node)")
    return out


def over_budget(plan: Plan) -> str:
    m = plan.memory
    parts = []
    for tier in ("gpu", "cpu"):
        used, budget = m[f"{tier}_bytes"], m[f"{tier}_budget_bytes"]
        if used > budget:
            parts.append(f"{tier.upper()} needs {format_bytes(used - budget)} more "
                         f"({format_bytes(used)} > budget {format_bytes(budget)})")
    return "; ".join(parts) + ": use --strategy ilp, a smaller batch/context or weight dtype, or more memory"
