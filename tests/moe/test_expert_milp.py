"""Expert-level placement: the ILP's expert counts are optimal, the hottest experts are the ones
kept on the GPU, and the split's costs are the formulas of ``hetplan.experts``.

On a one-layer MoE model (blocks embed, attn_0, moe_0, head) every decision is enumerated —
each block's way of running (as in ``test_ilp_bruteforce``) and, for the MoE block resident on
the GPU, every count of hot experts 0..E — replayed by the independent simulator and filtered
by the budgets; the ILP's objective must be the best one found.
"""

import dataclasses
import itertools
import math

import pytest
from tests.conftest import tiny_node, tiny_spec
from tests.solver_model import placed_gpu_bytes, with_copies_held_back

from hetplan.compiler import CompileRequest, decide
from hetplan.evaluate import fits, make_plan
from hetplan.plan import Decision
from hetplan.problem import build_problem
from hetplan.routing import RoutingStats, routing_fingerprint
from hetplan.plan.simulate import check_plan
from hetplan.workload import Workload

E, K = 6, 2
SPEC = tiny_spec(arch="mixtral", n_layers=1, hidden=1024, n_heads=8, n_kv_heads=4, head_dim=128, vocab=8000,
                 intermediate=2048, n_experts=E, experts_per_token=K, moe_intermediate=2048)
SKEW = (0.7, 0.05, 0.5, 0.1, 0.45, 0.2)   # expert 0 hottest, then 2, 4, 5, 3, 1; sums to K
ROUTING = {"uniform": None, "skewed": RoutingStats(routing_fingerprint(SPEC), {0: SKEW})}
WORKLOADS = {"chat": Workload(batch=1, prompt_len=256, gen_len=64),
             "batched": Workload(batch=8, prompt_len=512, gen_len=32)}
GPU_SHARES = (0.25, 0.45, 0.65, 1.5)
"""GPU budget = workspace + this share of all weights and KV (the CPU holds everything)."""
_WAYS = {"gpu": ("gpu", "gpu", "gpu"), "cpu": ("cpu", "cpu", "cpu"),
         "stream-decode": ("stream", "cpu", "stream"), "stream-prefill": ("stream", "stream", "cpu"),
         "stream-both": ("stream", "stream", "stream")}


def every_decision(blocks):
    """Every (weights, exec, kv, depth, hot-expert count) the plan format can express; a
    resident MoE block with cold experts runs them on the CPU (exec ``gpu``) or streams them
    (exec ``stream``), per phase."""
    ways = [[_WAYS["gpu"], _WAYS["cpu"]] if not b.streamable else list(_WAYS.values()) for b in blocks]
    for combo in itertools.product(*ways):
        way = {b.name: w for b, w in zip(blocks, combo)}
        kvs = ("gpu", "cpu") if "cpu" not in way["attn_0"][1:] else ("cpu",)
        counts = range(E + 1) if way["moe_0"][0] == "gpu" else (None,)
        for kv, depth, n in itertools.product(kvs, (1, 2), counts):
            colds = itertools.product(("gpu", "stream"), repeat=2) if n is not None and n < E else [None]
            for cold in colds:
                moe = way["moe_0"] if cold is None else ("gpu", *cold)
                yield Decision(weights={b: w[0] for b, w in way.items()},
                               exec={ph: {b: (moe if b == "moe_0" else w)[1 + i] for b, w in way.items()}
                                     for i, ph in enumerate(("prefill", "decode"))},
                               kv={"attn_0": kv}, depth=depth, experts={} if n is None else {"moe_0": n})


_ROWS = {}


def enumerated(routing: str, workload: str):
    """(problem, [(decision, ttft, tpot, gpu bytes, cpu bytes)]) on a roomy machine."""
    key = (routing, workload)
    if key not in _ROWS:
        problem = build_problem(SPEC, tiny_node(64, 64), WORKLOADS[workload], routing=ROUTING[routing])
        rows = []
        for dec in every_decision(problem.blocks):
            plan = make_plan(problem, dec, {"strategy": "enumerated"})
            sim = check_plan(plan)
            rows.append((dec, sim.makespan_s["prefill"], sim.makespan_s["decode"],
                         placed_gpu_bytes(plan), plan.memory["cpu_bytes"]))
        _ROWS[key] = (problem, rows)
    return _ROWS[key]


def streams_cold(dec) -> bool:
    return any(dec.weights[b] == "gpu" and e == "stream" for ph in dec.exec.values() for b, e in ph.items())


@pytest.mark.parametrize("stream", [True, False], ids=["stream-cold", "cold-on-cpu"])
@pytest.mark.parametrize("objective", ["latency", "tpot"])
@pytest.mark.parametrize("share", GPU_SHARES)
@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("routing", list(ROUTING))
def test_ilp_expert_counts_match_the_best_enumerated_decision(routing, workload, share, objective, stream):
    """With ``--stream-cold-experts`` over every decision; without, over those that keep a
    resident block's cold experts on the CPU."""
    roomy, rows = enumerated(routing, workload)
    total = sum(b.weight_bytes + b.kv_bytes for b in roomy.blocks)
    gpu_budget = math.ceil(roomy.gpu_workspace_bytes + share * total)
    hw = tiny_node(1, 64).with_budgets(gpu_mem=gpu_budget)
    wl = dataclasses.replace(WORKLOADS[workload], objective=objective)
    value = (lambda r: r[1] + wl.gen_len * r[2]) if objective == "latency" else (lambda r: r[2])
    feasible = [r for r in rows if r[3] <= gpu_budget and r[4] <= hw.cpu_budget_bytes()
                and (stream or not streams_cold(r[0]))]
    best = min(feasible, key=value)

    problem = with_copies_held_back(build_problem(SPEC, hw, wl, routing=ROUTING[routing]))
    req = CompileRequest(model="tiny-moe", hw="tiny", stream_cold_experts=stream, objective=objective)
    dec, info, _ = decide(problem, "ilp", None, req)
    plan = make_plan(problem, dec, info)
    assert fits(plan)
    check_plan(plan)
    got = value((None, plan.predicted["ttft_s"], plan.predicted["tpot_s"]))
    assert got >= value(best) * (1 - 1e-6), "the ILP beat every decision that fits: its plan cannot be valid"
    assert got <= value(best) * (1 + 1e-6 + info["mip_gap"]), (
        f"ILP {got:.9g} s > enumerated optimum {value(best):.9g} s with {best[0].experts} hot experts")


def test_tight_budgets_give_mixed_expert_counts():
    """The cases above are not all-or-nothing: somewhere the optimum splits the experts."""
    counts = set()
    for routing, workload in itertools.product(ROUTING, WORKLOADS):
        roomy, rows = enumerated(routing, workload)
        total = sum(b.weight_bytes + b.kv_bytes for b in roomy.blocks)
        for share in GPU_SHARES:
            budget = roomy.gpu_workspace_bytes + share * total
            best = min((r for r in rows if r[3] <= budget), key=lambda r: r[1] + 64 * r[2])
            counts.add(best[0].experts.get("moe_0"))
    assert counts & set(range(1, E)), f"no case splits the experts: {counts}"


@pytest.mark.parametrize("share", [0.35, 0.45, 0.65])
def test_the_hottest_experts_are_the_ones_on_the_gpu(share):
    roomy, _ = enumerated("skewed", "chat")
    total = sum(b.weight_bytes + b.kv_bytes for b in roomy.blocks)
    hw = tiny_node(1, 64).with_budgets(gpu_mem=math.ceil(roomy.gpu_workspace_bytes + share * total))
    problem = build_problem(SPEC, hw, WORKLOADS["chat"], routing=ROUTING["skewed"])
    dec, info, _ = decide(problem, "ilp", None, CompileRequest(model="tiny-moe", hw="tiny", stream_cold_experts=True))
    entry = next(p for p in make_plan(problem, dec, info).placement if p["block"] == "moe_0")
    n = entry["experts_on_gpu"]
    assert entry["weights"] == "gpu" and 0 < n < E, entry
    hottest = sorted(range(E), key=lambda e: -SKEW[e])[:n]
    assert entry["gpu_experts"] == sorted(hottest)
    assert entry["cold_expert_bytes"] == pytest.approx((E - n) * 3 * 1024 * 2048 * 2)


def test_split_block_times_are_the_stated_formulas():
    """Hand-derived: decode, batch 1, fp16, 2 hot experts of the skewed profile (0 and 2) on
    tiny_node (GPU 500 GB/s, 50 TFLOPS fp16; CPU 50 GB/s, 1 TFLOPS; links 16 GB/s), every
    efficiency and latency as the node states them. Each task carries its expected time; the
    merge also waits for the later side: E[max(GPU side, CPU side)] - max of their expectations,
    enumerated here over the 2^6 sets of experts one token can hit (each independently with
    probability = its fraction)."""
    hw = tiny_node(64, 64)
    problem = build_problem(SPEC, hw, WORKLOADS["chat"], routing=ROUTING["skewed"])
    dec = Decision(weights={b.name: "gpu" for b in problem.blocks},
                   exec={ph: {b.name: "gpu" for b in problem.blocks} for ph in ("prefill", "decode")},
                   kv={"attn_0": "gpu"}, depth=1, experts={"moe_0": 2})
    tasks = {t.id: t for t in make_plan(problem, dec, {"strategy": "hand"}).schedule["decode"].tasks}
    eff, lat = hw.efficiency, hw.latency_s
    gpu_bw, cpu_bw = 500e9 * eff["gpu_mem"], 50e9 * eff["cpu_mem"]
    link = 16e9 * eff["link"]
    expert = 3 * 1024 * 2048 * 2                    # bytes of one expert
    hot, cold = (0.7, 0.5), (0.45, 0.2, 0.1, 0.05)  # fractions; one token: hit probability = fraction
    row = 1024 * 2                                  # one token's hidden state, fp16
    # decode is bandwidth-bound on both devices at batch 1
    assert tasks["moe_experts/moe_0"].duration_s == pytest.approx(
        (sum(hot) * expert + 2 * row + 2 * sum(hot) * row) / gpu_bw + lat["gpu_task"], rel=1e-9)
    assert tasks["moe_cold/moe_0"].duration_s == pytest.approx(
        (sum(cold) * expert + 2 * sum(cold) * row) / cpu_bw + lat["cpu_task"], rel=1e-9)
    assert tasks["act_down/moe_cold/moe_0"].duration_s == pytest.approx(
        sum(cold) * (row + 8) / link + lat["link_task"], rel=1e-9)
    assert tasks["act_up/moe_merge/moe_0"].duration_s == pytest.approx(sum(cold) * row / link + lat["link_task"],
                                                                       rel=1e-9)
    gpu_side = lambda hits: (sum(hits) * (expert + 2 * row) + 2 * row) / gpu_bw + lat["gpu_task"]  # noqa: E731
    cpu_side = lambda hits: (sum(hits) * (expert + 2 * row) / cpu_bw + lat["cpu_task"]  # noqa: E731
                             + sum(hits) * (2 * row + 8) / link + 2 * lat["link_task"])
    both = mean_hot = mean_cold = 0.0
    for hits in itertools.product((0, 1), repeat=E):
        prob = math.prod(f if h else 1 - f for f, h in zip(hot + cold, hits))
        both += prob * max(gpu_side(hits[:2]), cpu_side(hits[2:]))
        mean_hot += prob * gpu_side(hits[:2])
        mean_cold += prob * cpu_side(hits[2:])
    wait = both - max(mean_hot, mean_cold)
    assert wait > 0
    assert tasks["moe_merge/moe_0"].duration_s == pytest.approx(
        (2 * row + sum(cold) * row) / gpu_bw + lat["gpu_task"] + wait, rel=1e-9)
    assert tasks["moe_route/moe_0"].duration_s == pytest.approx(
        ((1024 * E + 1024) * 2 + 2 * row) / gpu_bw + lat["gpu_task"], rel=1e-9)


def test_a_long_prompt_streams_cold_experts_in_prefill_and_keeps_them_on_the_cpu_in_decode():
    """Four layers, batch 4 x 1024-token prompts, a GPU holding most experts: prefill streams
    each resident block's cold experts through the staging slot (costlier on the CPU than over
    PCIe for 4096 tokens), decode runs them on the CPU. The MILP's objective is the plan's, and
    running the cold experts on the CPU in prefill too is worse."""
    spec = dataclasses.replace(SPEC, n_layers=4, n_experts=8)
    wl = Workload(batch=4, prompt_len=1024, gen_len=32)
    problem = build_problem(spec, tiny_node(560 / 1024, 64), wl)
    dec, info, _ = decide(problem, "ilp", None, CompileRequest(model="tiny-moe", hw="tiny", stream_cold_experts=True))
    plan = make_plan(problem, dec, info)
    check_plan(plan)
    moe = [p for p in plan.placement if p["kind"] == "moe"]
    streamed = [p for p in moe if p["weights"] == "gpu" and p["exec"]["prefill"] == "stream"]
    assert streamed and all(p["exec"]["decode"] == "gpu" and p["experts_on_gpu"] < spec.n_experts for p in streamed)
    loads = {t.block: t for t in plan.schedule["prefill"].tasks if t.kind == "load"}
    for p in streamed:
        assert loads[p["block"]].bytes == pytest.approx(p["cold_expert_bytes"])
        assert not any(t.kind == "moe_cold" and t.block == p["block"] for t in plan.schedule["prefill"].tasks)
        assert any(t.kind == "moe_cold" and t.block == p["block"] for t in plan.schedule["decode"].tasks)
    assert info["milp_objective_s"] == pytest.approx(plan.solver["objective_s"], rel=1e-6 + info["mip_gap"])
    on_cpu = dataclasses.replace(dec, exec={ph: {b: "gpu" if e == "stream" and dec.weights[b] == "gpu" else e
                                                  for b, e in dec.exec[ph].items()} for ph in dec.exec})
    assert make_plan(problem, on_cpu, info).predicted["ttft_s"] > plan.predicted["ttft_s"]
