"""The compile driver: MODEL + NODE + WORKLOAD + strategy -> Plan.

The library function the CLI, ``hetplan check`` and the tests all call. Handles the choices
around a solve (automatic weight dtype, the throughput objective's batch search, infeasibility
diagnosis); the solving itself is in ``hetplan.solvers``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field

from hetplan.diagnose import diagnose, fits_at_all, over_budget  # noqa: F401  (diagnose is part of this API)
from hetplan import progress
from hetplan.dtypes import BITS_PER_ELEMENT
from hetplan.errors import HetplanError, InfeasibleError
from hetplan.evaluate import fits, objective_s, plan_within_budget, predictions
from hetplan.pipeline.forked import cpu_seconds
from hetplan.hardware import HardwareSpec
from hetplan.model import ModelSpec
from hetplan.pipeline.topology import Topology
from hetplan.frontends.resolve import load_model
from hetplan.plan import Plan
from hetplan.graph import workspace_bytes
from hetplan.problem import Problem, build_problem
from hetplan.schedule import build_schedule
from hetplan.units import format_bytes, parse_bytes
from hetplan.workload import Workload, chunk_candidates

STRATEGIES = ("ilp", "all-gpu", "greedy", "ngl", "ngl-nkvo", "stream", "flexgen", "cpu-moe", "n-cpu-moe",
              "ktransformers")
IMPORTED_FORMS = ("from-llama.cpp:ARGS", "from-accelerate:FILE|JSON", "from-vllm:ARGS", "from-ktransformers:FILE")
"""Strategies that re-read an engine's configuration (hetplan.solvers.imported), as each is written."""
IMPORTED = tuple(form.partition(":")[0] for form in IMPORTED_FORMS)
COUNTED = ("ngl", "ngl-nkvo", "n-cpu-moe", "flexgen")
"""Strategies that take a number: a layer count (``ngl:N``, ``ngl-nkvo:N``, ``n-cpu-moe:N``) or
FlexGen's GPU weight percent (``flexgen:W``)."""
def _with_arg(name: str, open_: str, close: str) -> str:
    """``name`` as written with its argument, when it takes one (``ngl[:N]``, ``flexgen:W``)."""
    if name not in COUNTED:
        return name
    return f"{name}{open_}{'W' if name == 'flexgen' else 'N'}{close}"


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
    replicas: int = 1
    """Alike groups of a node's (or cluster's) devices the plan runs as many replicas of one
    pipeline (``hetplan.pipeline.replicas``): set by ``compile --serve``'s search, which weighs
    every count; not an option of its own, and not recorded (``check`` searches again)."""
    ceiling_s: float | None = None
    """A pipeline's latency (``ttft + gen_len x tpot``) above which its search stops
    (``hetplan.pipeline.plan.Outclassed``): set by ``compile --serve``'s search for a candidate
    that must beat a plan found already; not an option, not recorded."""
    stage_memo: dict | None = field(default=None, compare=False, repr=False)
    """Pipeline stages priced (plans, refined bounds) by the single-device planner, kept for the
    next compile of the same request at another batch or replica count (``hetplan.pipeline.plan``'s
    memos): set by ``compile --serve``'s search, one for all its candidates; not recorded."""
    notes: list = field(default_factory=list, compare=False)
    """Messages for the user (e.g. which dtype ``auto`` chose); filled while compiling."""

    def cli_args(self, routing=None) -> dict:
        """The request as a plan records it: ``routing`` (RoutingStats) replaces the path by its
        document; keys at their default ``None`` that older plans lack are left out."""
        d = dataclasses.asdict(dataclasses.replace(self, stage_memo=None))   # (not a copy of the memo's plans)
        for k in ("notes", "dump_lp", "replicas", "ceiling_s", "stage_memo"):
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


def parse_strategy(text: str) -> tuple[str, int | str | None]:
    name, colon, arg = text.partition(":")
    if name in IMPORTED:
        from hetplan.solvers.imported import check_argument
        return name, check_argument(name, arg)
    if name not in STRATEGIES:
        raise HetplanError(f"--strategy: unknown strategy {text!r}; choose one of "
                           f"{', '.join([_with_arg(s, '[:', ']') for s in STRATEGIES] + list(IMPORTED_FORMS))}")
    if colon and not arg:
        raise HetplanError(f"--strategy {text}: N is missing after ':'; give {name}:N or {name} alone")
    if arg and name not in COUNTED:
        raise HetplanError(f"--strategy {text}: only {', '.join(COUNTED[:-1])} and {COUNTED[-1]} take an argument "
                           f"({', '.join(_with_arg(s, ':', '') for s in COUNTED)})")
    if arg:
        if not arg.isdigit():
            what = "W (the GPU weight percent)" if name == "flexgen" else "N"
            raise HetplanError(f"--strategy {text}: {what} must be a non-negative integer")
        return name, int(arg)
    return name, None


def load_inputs(req: CompileRequest) -> tuple[ModelSpec, HardwareSpec]:
    """The model and the machine: a HardwareSpec, or a ``Topology`` for a cluster."""
    hw = load_machine(req)
    dtype = None if req.weight_dtype == "auto" else req.weight_dtype
    spec = load_model(req.model, dtype, req.kv_dtype)
    if "gguf" in spec.extra:
        from hetplan.frontends.gguf.held import describe
        req.notes.append(describe(spec))
    return spec, hw


def load_machine(req: CompileRequest):
    """The machine of ``req.hw`` with ``--gpu-mem`` and ``--cpu-mem`` applied: a HardwareSpec, or
    a ``Topology`` for a cluster."""
    from hetplan.pipeline.cluster import load_hardware
    from hetplan.pipeline.compile import with_gpu_budgets

    hw = load_hardware(req.hw)
    cpu_mem = parse_bytes(req.cpu_mem, "--cpu-mem") if req.cpu_mem else None
    for node in getattr(hw, "nodes", (hw,)):
        if cpu_mem is not None and cpu_mem > node.cpu.memory_bytes:
            raise HetplanError(f"--cpu-mem {req.cpu_mem}: more than the {node.cpu.name} of node {node.name!r} has "
                               f"({format_bytes(node.cpu.memory_bytes)} in all); give at most that, or describe "
                               f"the real machine in a node.yaml")
    return with_gpu_budgets(hw, req.gpu_mem, cpu_mem)


def several_devices(hw, strategy: str) -> bool:
    """Whether ``hw`` is planned as a pipeline over several devices (``_compile_devices``): a
    cluster, or a node with several GPUs under ``--strategy ilp`` (another strategy plans GPU 0)."""
    return isinstance(hw, Topology) or (len(hw.gpus) > 1 and strategy == "ilp")


def _compile_devices(spec, hw, req: CompileRequest, strategy: str, routing) -> tuple[Plan, float]:
    """Several devices: the pipeline plan (``hetplan.pipeline.compile``); a cluster takes
    --strategy ilp only."""
    from hetplan.pipeline.compile import compile_pipeline

    if strategy != "ilp":
        raise HetplanError(f"--strategy {req.strategy}: a cluster is planned with --strategy ilp (stages over "
                           f"its nodes); plan one node with --hw NODE to use another strategy")
    if req.dump_lp:
        raise HetplanError("--dump-lp: a plan over several devices solves one MILP per stage; dump them by "
                           "compiling one GPU's node (--hw with a single-GPU node.yaml)")
    return compile_pipeline(spec, hw, req, routing)


PLAN_STATUSES = ("optimal", "node_limit", "time_limit", "interrupted")
"""MILP statuses whose incumbent is a plan (proven optimal, or the best found when a limit or
Ctrl-C stopped the search); any other status with a solution is a failed solve."""


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


def decide(problem: Problem, strategy: str, arg: int | None, req: CompileRequest, moe_chain: bool = False,
           lp_bounds: dict | None = None, floors: dict | None = None):
    """Run one strategy on a problem -> (Decision or None, solver info dict, solve seconds).
    ``moe_chain``: a MoE problem of identical layers goes to the chain DP rather than the count
    MILP (both exact; the DP is much the faster on the short slices pipeline stages are);
    ``lp_bounds``, ``floors``: see ``ilp.solve``."""
    from hetplan.solvers import baselines, ilp

    if strategy in IMPORTED:
        from hetplan.solvers.imported import decide as decide_imported
        t0 = time.perf_counter()
        dec = decide_imported(problem, strategy, arg, req.model)
        info = {"strategy": f"{strategy}:{arg}", "status": "heuristic", "mip_gap": None, "lower_bound_s": None,
                "options": {}}
        return dec, info, time.perf_counter() - t0
    if strategy != "ilp":
        t0 = time.perf_counter()
        fn = baselines.applicable(problem).get(strategy) or baselines.MOE_BASELINES[strategy]
        dec = fn(problem, arg) if strategy in COUNTED else fn(problem)
        name = strategy if arg is None else f"{strategy}:{arg}"
        info = {"strategy": name, "status": "heuristic", "mip_gap": None, "lower_bound_s": None, "options": {}}
        return dec, info, time.perf_counter() - t0
    opts = ilp.IlpOptions(time_limit_s=req.time_limit_s, max_nodes=req.max_nodes, mip_rel_gap=req.mip_gap,
                          stream_cold=req.stream_cold_experts, dump_lp=req.dump_lp,
                          count_layers=not (moe_chain and bool(problem.experts)))
    res = ilp.solve(problem, opts, lp_bounds, floors)
    if res.decision is not None and res.objective_s is None:
        # No GPU: the all-CPU plan is the only placement, so it is its own bound.
        obj = objective_s(problem, predictions(problem, build_schedule(problem, res.decision)))
        res = dataclasses.replace(res, objective_s=obj, bound_s=obj)
    info = {"strategy": "ilp", "status": res.status, "mip_gap": res.mip_gap, "lower_bound_s": res.bound_s,
            "milp_objective_s": res.objective_s,
            "options": {"time_limit_s": opts.time_limit_s, "max_nodes": opts.max_nodes,
                        "mip_rel_gap": opts.mip_rel_gap, "depths": list(opts.depths)}}
    if res.formulation == "milp":
        info["size"] = {"binaries": res.n_binaries, "constraints": res.n_constraints}
    else:  # the chain DP decided some configuration (solvers/ilp/chain/): no MILP size to state
        info["formulation"] = res.formulation
    dec = res.decision
    if dec is None and res.status.startswith(("time_limit", "node_limit")):  # not proof that nothing fits
        flag, value = (("--time-limit", f"{opts.time_limit_s:g} s") if res.status.startswith("time_limit")
                       else ("--max-nodes", f"{opts.max_nodes}"))
        raise HetplanError(f"the MILP stopped at {flag} {value} before it found any plan, so nothing was "
                           f"written; raise {flag}, or take a heuristic plan with --strategy ngl")
    if dec is not None and problem.has_gpu and not res.status.startswith(PLAN_STATUSES):
        raise HetplanError(f"the MILP solver stopped with status {res.status!r} and no usable plan, so nothing "
                           f"was written; this usually means extreme inputs (check the node's sizes and "
                           f"bandwidths), or try a heuristic plan with --strategy ngl")
    if dec is not None:
        # Never hand out something worse than a baseline that fits: a plan not proven optimal
        # may be, and even a proven one is optimal for the MILP, whose bus terms only bound
        # the replay (README, Strategies).
        dec, info = _at_least_baselines(problem, dec, info, res, res.status != "optimal")
    return dec, info, res.solve_seconds


def stage_solver(req: CompileRequest, strategy: str = "ilp", arg: int | None = None, moe_stages: bool = False):
    """The single-GPU planner one pipeline stage is priced with (``hetplan.pipeline``): a
    problem -> its Plan under ``strategy``, or None when nothing fits (``moe_stages``: see
    ``decide``'s ``moe_chain``); its ``lower_bound(problem)`` bounds that plan's objective
    cheaply (the MILP's LP relaxation), or is None; its ``count_bounds(problem)`` bounds it at
    every layer count of the same kind of stage from the same relaxations (``ilp.count_bounds``),
    or is None; its ``count_lines`` bound the count MILPs at every count by a line each (a few
    MILPs), for ``solve``'s ``floors``; its ``gap``, the relative gap its plans are proven
    optimal to (``--mip-gap`` for the MILP, 0 for a heuristic, whose plan is its own price)."""
    def solve(problem: Problem, lp_bounds: dict | None = None, floors: dict | None = None) -> Plan | None:
        """``lp_bounds``: ``count_bounds(problem)``'s values where known; ``floors``: its count
        MILPs' lines there (``count_lines``; both ``ilp.solve``'s)."""
        if not fits_at_all(problem):
            return None
        plan, _, _ = plan_within_budget(problem, lambda p: decide(p, strategy, arg, req, moe_chain=moe_stages,
                                                                  lp_bounds=lp_bounds if p is problem else None,
                                                                  floors=floors if p is problem else None))
        return plan if plan is not None and fits(plan) else None

    def lower_bound(problem: Problem, floor: float = -math.inf) -> float | None:
        """At most the objective (``objective_s``) of the plan ``solve`` returns, far cheaper (the
        MILP's LP relaxation; given up at ``floor``, a bound known already: ``lp_bound_s``); None
        where there is none to take."""
        from hetplan.solvers import ilp

        if not fits_at_all(problem):
            return math.inf
        if strategy != "ilp":
            return None
        return ilp.lp_bound_s(problem, relaxed(problem), floor)

    def count_bounds(problem: Problem, known: dict | None = None) -> dict | None:
        """``ilp.count_bounds`` of ``problem`` (``known``: its); None where ``lower_bound`` is not
        the LP's, or the stage cannot fit (``lower_bound`` says inf)."""
        from hetplan.solvers import ilp

        if strategy != "ilp" or not fits_at_all(problem):
            return None
        return ilp.count_bounds(problem, relaxed(problem), known)

    def count_lines(problem: Problem, slopes: dict, hi: int) -> dict:
        """``ilp.count_lines``: the lines, over every count from 2 to ``hi`` of the stages of
        ``problem``'s kind, of the count MILPs of the (depth, slot) configurations ``slopes``
        gives a slope; {} where ``count_bounds`` is None."""
        from hetplan.solvers import ilp

        if strategy != "ilp" or not fits_at_all(problem):
            return {}
        return ilp.count_lines(problem, slopes, hi, relaxed(problem))

    def relaxed(problem: Problem):
        from hetplan.solvers import ilp

        return ilp.IlpOptions(stream_cold=req.stream_cold_experts,
                              count_layers=not (moe_stages and bool(problem.experts)))

    solve.lower_bound = lower_bound
    solve.gap = req.mip_gap if strategy == "ilp" else 0.0   # how exact its prices are: the split's as well
    solve.count_bounds = count_bounds
    solve.count_lines = count_lines
    if req.stage_memo is not None:
        solve.memo = req.stage_memo.setdefault((strategy, arg, moe_stages), {})
        solve.shared_memo = req.stage_memo   # what holds for every strategy (the StageBounds)
    return solve


def _at_least_baselines(problem: Problem, dec, info, res, regap: bool = True):
    """``dec``, or the best fitting baseline (``baselines.best_fitting``) when it replays
    better; ``regap``: the MIP gap restated against the replayed objective. ``res``: the MILP's
    result; its bound bounds the replay of every plan that fits the problem's budget, a
    baseline's too, so where ``dec``'s replay is within ``PROVEN`` of it (and no HBM is held
    back, which a baseline fitting the whole budget may use) no baseline can beat ``dec`` and
    none is replayed."""
    from hetplan.solvers import baselines

    best, best_obj = dec, objective_s(problem, predictions(problem, build_schedule(problem, dec)))
    proven = (problem.gpu_held_back_bytes == 0 and res.bound_s is not None
              and best_obj <= res.bound_s * (1 + PROVEN))
    if problem.has_gpu and not proven:
        progress.activity("replaying the baselines (the plan is never worse than one that fits)")
        name, cand, obj = baselines.best_fitting(problem)
        if obj < best_obj:
            best, best_obj = cand, obj
            info = dict(info, incumbent=f"baseline {name}")
    if regap and info.get("lower_bound_s") is not None and best_obj > 0:
        info = dict(info, mip_gap=max(0.0, (best_obj - info["lower_bound_s"]) / best_obj))
    return best, info


PROVEN = 1e-9
"""Relative slack within which a replay equal to the MILP's bound counts as proven optimal (the
replay and the MILP sum the same times in another order)."""


@dataclass(frozen=True)
class CompileTime:
    """How long a compile took, every stage included (inputs, problem building, LP bounds,
    every MILP, plan assembly; every batch of a throughput search)."""
    wall_s: float
    cpu_s: float
    """CPU time of the process (all threads) and of the children it forked (``hetplan.pipeline.forked``)."""
    solve_s: float
    """Of which the solver's own time (the MILPs, or a baseline's decision)."""


def compile_plan(req: CompileRequest) -> tuple[Plan, CompileTime]:
    """Compile ``req`` -> (plan, compile time). Raises InfeasibleError with the missing bytes."""
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    strategy, arg = parse_strategy(req.strategy)
    with progress.step("reading the model and the node"):
        spec, hw = load_inputs(req)
        routing = load_request_routing(req, spec)
    if req.stream_cold_experts and not spec.is_moe:
        raise HetplanError(f"--stream-cold-experts: model {spec.name!r} has no experts to stream; drop the flag")
    if several_devices(hw, strategy):
        plan, solve_s = _compile_devices(spec, hw, req, strategy, routing)
        return plan, CompileTime(time.perf_counter() - wall0, cpu_seconds() - cpu0, solve_s)
    if spec.n_layers > BOUND_FIRST_LAYERS:
        weights_bound(spec, hw, req.weight_dtype == "auto")
    tried = ""
    if req.weight_dtype == "auto":
        native = spec.weight_dtype
        with progress.step("choosing the weight dtype (--weight-dtype auto)"):
            spec = _auto_dtype(spec, hw, _workload(req), req)
        if spec.weight_dtype == AUTO_DTYPES[-1] and native != AUTO_DTYPES[-1] and not any(
                AUTO_DTYPES[-1] in n for n in req.notes):
            tried = f"--weight-dtype auto tried {', '.join((native,) + AUTO_DTYPES)}: "
    try:
        if req.objective == "throughput":
            plan, solve_s = _best_batch(spec, hw, req, strategy, arg, routing)
        else:
            plan, solve_s = _compile_one(spec, hw, _workload(req), req, strategy, arg, routing)
    except InfeasibleError as e:
        if tried:
            raise InfeasibleError(tried + str(e)) from None
        raise
    if len(hw.gpus) > 1:
        req.notes.append(f"node {hw.name!r} has {len(hw.gpus)} GPUs; --strategy {req.strategy} plans GPU 0 "
                         f"alone (--strategy ilp plans a pipeline over all of them)")
    return plan, CompileTime(time.perf_counter() - wall0, cpu_seconds() - cpu0, solve_s)


BOUND_FIRST_LAYERS = 2000
"""Above this many layers a problem takes seconds to build, so the cheap weights bound is checked
first; below it the full diagnosis (KV and workspace counted, fixes computed) is as quick."""


def weights_bound(spec: ModelSpec, hw: HardwareSpec, auto: bool) -> None:
    """The cheap bound checked before any problem is built: the weights alone,
    ``total_params x bits / 8`` (at the smallest dtype there is when ``auto``), must fit in the
    GPU and CPU budgets together. A model that fails it fails in milliseconds, not after pricing
    every block."""
    have = hw.gpu_budget_bytes() + hw.cpu_budget_bytes()
    params = spec.total_params()
    dtype = min(BITS_PER_ELEMENT, key=BITS_PER_ELEMENT.get) if auto else spec.weight_dtype
    need = params * BITS_PER_ELEMENT[dtype] / 8
    if need <= have:
        return
    if auto or dtype == min(BITS_PER_ELEMENT, key=BITS_PER_ELEMENT.get):
        raise InfeasibleError(f"{spec.name}: {params:.4g} parameters need at least {format_bytes(need)} even "
                              f"in {dtype}, but GPU + CPU hold {format_bytes(have)}: no dtype, batch or "
                              f"placement fits; use a machine with at least that much memory")
    raise InfeasibleError(f"{spec.name}: its weights alone need {format_bytes(need)} in {dtype} ({params:.4g} "
                          f"parameters), but GPU + CPU hold {format_bytes(have)}: missing {format_bytes(need - have)}; "
                          f"pass --weight-dtype auto "
                          f"(it picks a smaller dtype that fits, if one does) or use a machine with more memory")


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
    chunked = f", prompt in chunks of {wl.chunk_len}" if wl.n_chunks > 1 else ""
    with progress.step(f"building the problem ({spec.n_layers} layers, batch {wl.batch}{chunked})"):
        problem = build_problem(spec, hw, wl, routing=routing)
    if not fits_at_all(problem):  # the cheap bound first: no solver can place more than fits
        raise InfeasibleError(diagnose(problem, strategy))
    inputs = {"model_source": req.model, "hw_source": req.hw, "cli_args": req.cli_args(routing)}
    with progress.step(f"solving with strategy {strategy} (Ctrl-C stops)"):
        plan, problem, secs = plan_within_budget(problem, lambda p: decide(p, strategy, arg, req), inputs)
    if plan is None:
        raise InfeasibleError(diagnose(problem, strategy))
    if not fits(plan):
        raise InfeasibleError(f"strategy {plan.solver['strategy']}: " + over_budget(plan, problem))
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
        raise InfeasibleError(diagnose(build_problem(spec, hw, _workload(req, 1), routing=routing), strategy))
    return best, total


def _auto_dtype(spec, hw, wl, req) -> ModelSpec:
    """Keep the checkpoint's dtype when the model fits; else the widest of q8_0, q4_k_m that
    does; when none does, the last tried (so the error's fixes start below it)."""
    native_bytes, cand = None, spec
    for dtype in (spec.weight_dtype,) + AUTO_DTYPES:
        cand = spec.with_dtypes(weight_dtype=dtype, kv_dtype=req.kv_dtype or spec.kv_dtype)
        problem = build_problem(cand, hw, wl)
        if native_bytes is None:
            native_bytes = sum(b.weight_bytes for b in problem.blocks)
        if fits_at_all(problem):
            if dtype != spec.weight_dtype:
                req.notes.append(f"weights do not fit in {spec.weight_dtype} ({format_bytes(native_bytes)}); "
                                 f"planning {dtype} (pass --weight-dtype to choose)")
            return cand
    return cand
