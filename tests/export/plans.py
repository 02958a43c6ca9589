"""Plans with a placement stated by the test (not chosen by a solver), for the export tests.

``stated_plan(model, node, place)`` compiles MODEL once for its problem, then builds the plan of
the placement ``place(block) -> (weights, kv, experts_on_gpu)`` with llama.cpp-style execution
(a block in DRAM streamed in prefill, computed on the CPU in decode; cold experts on the CPU).
"""

from __future__ import annotations

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.evaluate import make_plan
from hetplan.graph import PHASES
from hetplan.plan import Decision
from hetplan.problem import build_problem


def stated_plan(model: str, node: str, place, depth: int = 1, prompt_len: int = 64):
    base, _ = compile_plan(CompileRequest(model=model, hw=node, strategy="all-gpu", prompt_len=prompt_len,
                                          gen_len=16, weight_dtype="fp16" if not model.endswith(".gguf") else "auto"))
    problem = build_problem(base.model, base.hardware, base.workload)
    weights, kv, experts = {}, {}, {}
    for b in problem.blocks:
        w, k, hot = place(b)
        weights[b.name] = w if (w != "stream" or b.streamable) else "cpu"
        if b.kind == "attn":
            kv[b.name] = k
        if hot is not None:
            experts[b.name] = hot
    exec_ = {ph: {} for ph in PHASES}
    for b in problem.blocks:
        w = weights[b.name]
        exec_["prefill"][b.name] = "stream" if w == "stream" or (b.name in experts and w == "gpu") else w
        exec_["decode"][b.name] = "cpu" if w == "stream" else w
    dec = Decision(weights=weights, exec=exec_, kv=kv, depth=depth, experts=experts)
    info = {"strategy": "stated", "status": "heuristic", "mip_gap": None, "lower_bound_s": None, "options": {}}
    return make_plan(problem, dec, info, inputs={"model_source": model, "hw_source": node, "cli_args": {}})


def residence(plan_or_decision, blocks=None) -> dict:
    """block -> (resident on the GPU?, KV on the GPU?, experts kept on the GPU (None: not MoE))."""
    dec = plan_or_decision.decision() if hasattr(plan_or_decision, "decision") else plan_or_decision
    n = None
    out = {}
    for b, w in dec.weights.items():
        hot = dec.experts.get(b) if w == "gpu" else (0 if b.startswith("moe") else None)
        out[b] = (w == "gpu", dec.kv.get(b, "gpu") == "gpu" if b.startswith("attn") else None,
                  hot if b.startswith("moe") and hot is not None else n)
    return out
