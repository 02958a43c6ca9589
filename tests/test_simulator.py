"""The independent simulator: hand-built task lists replay as list scheduling says; broken plans
are refused with a message; and every strategy's plan on every scenario replays to exactly its
prediction, fits its memory, keeps the staging discipline, and the ILP beats every baseline."""

import dataclasses

import pytest
from tests.conftest import tiny_node, tiny_spec

from hetplan.compiler import CompileRequest, decide
from hetplan.evaluate import fits, make_plan, plan_within_budget
from hetplan.hardware import load_node
from hetplan.frontends.resolve import load_model
from hetplan.plan import Plan, Task
from hetplan.problem import build_problem
from hetplan.plan.simulate import PlanInvalid, check_plan, replay, simulate
from hetplan.workload import Workload

REL = 1e-6


# -- list scheduling on hand-built DAGs -----------------------------------------------------------

def _t(tid, resource, duration_s, block="b", kind="mlp"):
    return Task(id=tid, resource=resource, block=block, kind=kind, duration_s=duration_s)


def test_ready_tasks_start_when_their_predecessors_end():
    tasks = [_t("a", "gpu", 1.0), _t("b", "cpu", 2.0), _t("c", "gpu", 1.0)]
    start, end = replay(tasks, [("b", "c")])
    assert (start["a"], end["a"]) == (0.0, 1.0)
    assert (start["b"], end["b"]) == (0.0, 2.0)
    assert (start["c"], end["c"]) == (2.0, 3.0)   # waits for b, not for a


def test_each_resource_serves_its_tasks_in_list_order():
    # c is listed before a on the gpu: a is ready at 0 but waits behind c, which waits for b.
    tasks = [_t("b", "cpu", 2.0), _t("c", "gpu", 1.0), _t("a", "gpu", 1.0)]
    start, end = replay(tasks, [("b", "c")])
    assert (start["c"], end["c"]) == (2.0, 3.0)
    assert (start["a"], end["a"]) == (3.0, 4.0)


def test_copies_overlap_compute_on_other_resources():
    # load 0.5 on h2d overlaps compute x (1.0); y needs the load and x
    tasks = [_t("x", "gpu", 1.0), _t("y", "gpu", 1.0), _t("load", "h2d", 0.5, kind="load")]
    _, end = replay(tasks, [("x", "y"), ("load", "y")])
    assert end["y"] == 2.0


def test_dependency_cycle_is_refused():
    tasks = [_t("a", "gpu", 1.0), _t("b", "cpu", 1.0)]
    with pytest.raises(PlanInvalid, match=r"cycle.*a on gpu waits for b"):
        replay(tasks, [("a", "b"), ("b", "a")])


def test_edge_against_queue_order_is_a_cycle():
    tasks = [_t("a", "gpu", 1.0), _t("b", "gpu", 1.0)]
    with pytest.raises(PlanInvalid, match="cycle"):
        replay(tasks, [("b", "a")])


def test_edge_to_an_unknown_task_is_refused():
    with pytest.raises(PlanInvalid, match=r"names no task 'ghost'"):
        replay([_t("a", "gpu", 1.0)], [("a", "ghost")])


# -- broken plans ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def streamed_plan():
    """A 4-layer model streamed block by block through two staging slots, over a link fast
    enough that loads outrun compute (so only the slot edges hold them back): the GPU is slow
    enough (10 GFLOPS) that even a load limited by HBM's share finishes well before its block."""
    spec = tiny_spec(n_layers=4, hidden=1024, intermediate=4096, n_heads=8, n_kv_heads=2, head_dim=128,
                     vocab=8000)
    node = tiny_node(0.25, 4.0, h2d_bytes_per_s=2e12)
    slow_gpu = dataclasses.replace(node.gpu, flops_per_s={"fp16": 1e10, "bf16": 1e10, "fp32": 1e10})
    problem = build_problem(spec, dataclasses.replace(node, gpus=(slow_gpu,)),
                            Workload(batch=1, prompt_len=128, gen_len=8))
    dec, info, _ = decide(problem, "stream", None, CompileRequest(model="tiny", hw="tiny"))
    plan = make_plan(problem, dec, info)
    assert fits(plan) and plan.staging["depth"] == 2
    return plan


def _with_tasks(plan, phase, tasks=None, edges=None):
    s = plan.schedule[phase]
    s = dataclasses.replace(s, tasks=tuple(tasks if tasks is not None else s.tasks),
                            edges=tuple(edges if edges is not None else s.edges))
    return dataclasses.replace(plan, schedule={**plan.schedule, phase: s})


def test_streamed_plan_is_valid_and_prefetches_into_both_slots(streamed_plan):
    sim = check_plan(streamed_plan)
    assert sim.max_slots_in_use == {"prefill": 2, "decode": 2}
    largest = max(p["weight_bytes"] for p in streamed_plan.placement if p["weights"] == "stream")
    for phase in ("prefill", "decode"):
        assert largest <= sim.staging_peak_bytes[phase] <= 2 * largest


def test_load_running_ahead_of_a_busy_slot_is_refused(streamed_plan):
    # drop the edges that make a load wait for the block that last used its slot
    edges = [e for e in streamed_plan.schedule["decode"].edges
             if not (e[1].startswith("load/") and not e[0].startswith("load/"))]
    with pytest.raises(PlanInvalid, match=r"decode: load/\S+ overwrites staging slot \d at .* while load/"):
        simulate(_with_tasks(streamed_plan, "decode", edges=edges))


def test_slot_beyond_the_depth_is_refused(streamed_plan):
    tasks = [dataclasses.replace(t, slot=5) if t.id == "load/mlp_0" else t
             for t in streamed_plan.schedule["prefill"].tasks]
    with pytest.raises(PlanInvalid, match=r"load/mlp_0 uses staging slot 5, but the plan has depth 2"):
        simulate(_with_tasks(streamed_plan, "prefill", tasks=tasks))


def test_compute_before_its_weights_arrive_is_refused(streamed_plan):
    # a slow load of attn_2 that its first stage no longer waits for
    tasks = [dataclasses.replace(t, duration_s=1.0) if t.id == "load/attn_2" else t
             for t in streamed_plan.schedule["decode"].tasks]
    edges = [e for e in streamed_plan.schedule["decode"].edges if e != ("load/attn_2", "attn_in/attn_2")]
    with pytest.raises(PlanInvalid, match=r"attn_in/attn_2 starts at .* before its weights arrive"):
        simulate(_with_tasks(streamed_plan, "decode", tasks=tasks, edges=edges))


def test_recorded_start_before_a_predecessor_ends_is_refused(streamed_plan):
    tasks = [dataclasses.replace(t, start_s=t.start_s / 2, end_s=t.start_s / 2 + t.duration_s)
             if t.id == "mlp/mlp_1" else t for t in streamed_plan.schedule["prefill"].tasks]
    with pytest.raises(PlanInvalid, match=r"prefill: mlp/mlp_1 starts at .* before its predecessor"):
        check_plan(_with_tasks(streamed_plan, "prefill", tasks=tasks))


def test_memory_over_budget_is_refused(streamed_plan):
    small = dataclasses.replace(streamed_plan, hardware=streamed_plan.hardware.with_budgets(gpu_mem=1 << 20))
    with pytest.raises(PlanInvalid, match=r"GPU memory: the plan needs \d+ bytes at its peak, over the budget"):
        check_plan(small)


def test_prediction_that_disagrees_with_the_replay_is_refused(streamed_plan):
    edited = dataclasses.replace(streamed_plan, predicted={**streamed_plan.predicted,
                                                           "tpot_s": streamed_plan.predicted["tpot_s"] * 0.9})
    with pytest.raises(PlanInvalid, match=r"predicted\.tpot_s = .* but replaying the decode schedule"):
        check_plan(edited)


def test_task_away_from_its_weights_is_refused(streamed_plan):
    placement = tuple(dict(p, weights="cpu", exec={"prefill": "cpu", "decode": "cpu"})
                      if p["block"] == "mlp_3" else p for p in streamed_plan.placement)
    with pytest.raises(PlanInvalid, match=r"block mlp_3 is loaded, but its placement says exec 'cpu'"):
        check_plan(dataclasses.replace(streamed_plan, placement=placement))


def test_attention_away_from_its_cache_is_refused(streamed_plan):
    placement = tuple(dict(p, kv="cpu") if p["block"] == "attn_1" else p for p in streamed_plan.placement)
    with pytest.raises(PlanInvalid, match=r"prefill: attn_core/attn_1 writes the KV cache on the GPU, but "
                                          r"it lives in DRAM and no kv_down task copies it there"):
        check_plan(dataclasses.replace(streamed_plan, placement=placement))
    decode_only = _with_tasks(dataclasses.replace(streamed_plan, placement=placement), "prefill", tasks=[
        dataclasses.replace(t, resource="cpu") if t.id == "attn_core/attn_1" else t
        for t in streamed_plan.schedule["prefill"].tasks])
    with pytest.raises(PlanInvalid, match=r"decode: attn_core/attn_1 runs on the GPU, but block attn_1's KV "
                                          r"cache lives on the CPU"):
        check_plan(decode_only)


# -- every strategy on every scenario ------------------------------------------------------------

TINY = dict(n_layers=2, hidden=1024, intermediate=4096, n_heads=8, n_kv_heads=2, head_dim=128, vocab=16000)
SCENARIOS = {
    # tiny models on budgets that force offloading
    "tiny-dense-tight": lambda: (tiny_spec(**TINY), tiny_node(0.05, 2.0),
                                 Workload(batch=2, prompt_len=256, gen_len=32)),
    "tiny-moe-tight": lambda: (tiny_spec(**TINY, arch="mixtral", n_experts=8, experts_per_token=2,
                                         moe_intermediate=2048), tiny_node(0.12, 2.0),
                               Workload(batch=1, prompt_len=128, gen_len=64)),
    "tiny-mla-moe": lambda: (tiny_spec(arch="deepseek_v3", n_layers=2, hidden=1024, intermediate=4096,
                                       n_heads=8, n_kv_heads=8, head_dim=192, vocab=16000, n_experts=16,
                                       experts_per_token=2, moe_intermediate=512, n_shared_experts=1,
                                       first_dense_layers=1, q_lora_rank=256, kv_lora_rank=128,
                                       qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
                             tiny_node(0.06, 2.0), Workload(batch=4, prompt_len=256, gen_len=32)),
    "tiny-cpu-only": lambda: (tiny_spec(**TINY), tiny_node(None, 2.0), Workload(batch=1, prompt_len=64, gen_len=8)),
    # real presets on real machines
    "llama-3.1-8b-q4_0-laptop-8g": lambda: (load_model("llama-3.1-8b", "q4_0"), load_node("laptop-8g"),
                                            Workload(batch=1, prompt_len=512, gen_len=128)),
    "llama-3.2-1b-bf16-laptop-8g": lambda: (load_model("llama-3.2-1b", "bf16"), load_node("laptop-8g"),
                                            Workload(batch=8, prompt_len=2048, gen_len=256)),
    "llama-2-7b-t4-208g": lambda: (load_model("llama-2-7b"), load_node("t4-208g"),
                                   Workload(batch=1, prompt_len=512, gen_len=128)),
    "opt-6.7b-rtx3090-128g": lambda: (load_model("opt-6.7b"), load_node("rtx3090-128g"),
                                      Workload(batch=1, prompt_len=512, gen_len=128)),
    "llama-3.1-8b-cpu-64g": lambda: (load_model("llama-3.1-8b"), load_node("cpu-64g"),
                                     Workload(batch=1, prompt_len=128, gen_len=32)),
}
STRATEGIES = ("ilp", "all-gpu", "greedy", "ngl", "ngl:1", "stream", "flexgen", "flexgen:50")
MOE_STRATEGIES = ("cpu-moe", "n-cpu-moe", "n-cpu-moe:1")
_PLANS = {}


def plans_for(scenario: str, objective: str = "latency") -> dict:
    """strategy -> Plan for one scenario (built once per test session: the ILP is the slow part)."""
    key = (scenario, objective)
    if key not in _PLANS:
        spec, hw, wl = SCENARIOS[scenario]()
        problem = build_problem(spec, hw, dataclasses.replace(wl, objective=objective))
        req = CompileRequest(model=scenario, hw=hw.name, objective=objective, time_limit_s=30)
        out = {}
        for strategy in STRATEGIES + (MOE_STRATEGIES if spec.is_moe else ()):
            name, _, arg = strategy.partition(":")
            # as compile does: solved again with HBM held back while copies to the host overflow it
            out[strategy], _, _ = plan_within_budget(
                problem, lambda p: decide(p, name, int(arg) if arg else None, req))
        _PLANS[key] = out
    return _PLANS[key]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_plan_replays_to_its_prediction_and_runs_as_written(scenario, strategy):
    plan = plans_for(scenario)[strategy]
    sim = simulate(plan)
    assert sim.makespan_s["prefill"] == pytest.approx(plan.predicted["ttft_s"], rel=REL)
    assert sim.makespan_s["decode"] == pytest.approx(plan.predicted["tpot_s"], rel=REL)
    assert all(n <= plan.staging["depth"] for n in sim.max_slots_in_use.values())
    reloaded = Plan.from_json(plan.to_json())
    if fits(plan):
        check_plan(plan)
        check_plan(reloaded)
        budgets = {"gpu": plan.hardware.gpu_budget_bytes(), "cpu": plan.hardware.cpu_budget_bytes()}
        for tier, peak in sim.peak_bytes.items():
            assert peak <= plan.memory[f"{tier}_bytes"] * (1 + 1e-12) <= budgets[tier] * (1 + 1e-12)
    else:
        with pytest.raises(PlanInvalid, match="memory"):
            check_plan(plan)


@pytest.mark.parametrize("strategy", MOE_STRATEGIES)
@pytest.mark.parametrize("scenario", ["tiny-moe-tight", "tiny-mla-moe"])
def test_moe_baselines_replay_to_their_prediction(scenario, strategy):
    plan = plans_for(scenario)[strategy]
    sim = simulate(plan)
    assert sim.makespan_s["prefill"] == pytest.approx(plan.predicted["ttft_s"], rel=REL)
    assert sim.makespan_s["decode"] == pytest.approx(plan.predicted["tpot_s"], rel=REL)
    moe = [p for p in plan.placement if p["kind"] == "moe"]
    if strategy == "cpu-moe":
        assert all(p["weights"] == "gpu" and p["experts_on_gpu"] == 0 for p in moe)
    if strategy == "n-cpu-moe:1":
        assert [p["experts_on_gpu"] for p in moe] == [0 if p["layer"] < 1 else plan.model.n_experts for p in moe]
    if fits(plan):
        check_plan(plan)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_memory_report_is_weights_kv_staging_and_workspace(scenario):
    """GPU = resident weights + GPU KV + depth * largest streamed block + workspace + the values
    waiting for copies to the host (the simulator's count over its own replay);
    CPU = host-resident weights + CPU KV + workspace (recomputed here from the placement)."""
    for plan in plans_for(scenario).values():
        p, ws, m = plan.placement, plan.memory["breakdown"], plan.model
        slot = max((b["weight_bytes"] for b in p if "stream" in b["exec"].values()), default=0.0)
        # routed experts of a GPU-resident MoE block that are not hot stay in DRAM
        expert = 3 * m.hidden * m.moe_intermediate * m.weight_bytes_per_param
        cold = {b["block"]: (m.n_experts - b["experts_on_gpu"]) * expert if b["kind"] == "moe" and
                b["weights"] == "gpu" else 0.0 for b in p}
        gpu = (sum(b["weight_bytes"] - cold[b["block"]] for b in p if b["weights"] == "gpu")
               + sum(b["kv_bytes"] for b in p if b["kv"] == "gpu")
               + plan.staging["depth"] * slot + ws["gpu"]["workspace"])
        waiting = max(simulate(plan).waiting_bytes.values())
        assert ws["gpu"]["copies_out"] == pytest.approx(waiting, rel=1e-12)
        gpu += waiting
        cpu = (sum(b["weight_bytes"] for b in p if b["weights"] != "gpu") + sum(cold.values())
               + sum(b["kv_bytes"] for b in p if b["kv"] == "cpu") + ws["cpu"]["workspace"])
        assert plan.memory["gpu_bytes"] == pytest.approx(gpu, rel=1e-12)
        assert plan.memory["cpu_bytes"] == pytest.approx(cpu, rel=1e-12)


@pytest.mark.parametrize("objective", ["latency", "ttft", "tpot"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ilp_is_never_worse_than_a_baseline_that_fits(scenario, objective):
    plans = plans_for(scenario, objective)
    best = plans["ilp"]
    assert fits(best)
    tol = REL + (best.solver["mip_gap"] or 0.0)
    for strategy, plan in plans.items():
        if strategy != "ilp" and fits(plan):
            assert best.solver["objective_s"] <= plan.solver["objective_s"] * (1 + tol), strategy


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ilp_objective_is_the_plans_objective(scenario):
    """The MILP's own objective value equals what the plan's replayed schedule achieves."""
    plan = plans_for(scenario)["ilp"]
    milp, achieved = plan.solver["milp_objective_s"], plan.solver["objective_s"]
    assert milp == pytest.approx(achieved, rel=REL + plan.solver["mip_gap"])


@pytest.mark.parametrize("objective", ["ttft", "tpot"])
def test_ilp_objective_is_the_plans_objective_for_one_phase(objective):
    plan = plans_for("llama-2-7b-t4-208g", objective)["ilp"]
    milp, achieved = plan.solver["milp_objective_s"], plan.solver["objective_s"]
    assert milp == pytest.approx(achieved, rel=REL + plan.solver["mip_gap"])


def test_a_replay_kept_for_its_problem_and_decision_is_the_replay_of_those_alone():
    """``build_schedule`` keeps its last replays by the identity of problem and decision: a
    decision replayed after others gets its own schedule, the same as replayed afresh, and a
    caller changing the dict it got changes nothing kept."""
    from hetplan import schedule as sched

    spec = tiny_spec(n_layers=4, hidden=1024, intermediate=4096, n_heads=8, n_kv_heads=2, head_dim=128,
                     vocab=8000)
    node = tiny_node(0.25, 4.0, h2d_bytes_per_s=2e12)   # as ``streamed_plan``: loads share HBM with compute
    slow_gpu = dataclasses.replace(node.gpu, flops_per_s={"fp16": 1e10, "bf16": 1e10, "fp32": 1e10})
    problem = build_problem(spec, dataclasses.replace(node, gpus=(slow_gpu,)),
                            Workload(batch=1, prompt_len=128, gen_len=8))
    req = CompileRequest(model="tiny", hw="tiny")
    decisions = [decide(problem, s, None, req)[0] for s in ("stream", "ngl", "all-gpu")]
    fresh = []
    for d in decisions:
        sched._RECENT.clear()
        fresh.append(sched.build_schedule(problem, d))
    assert fresh[0] != fresh[1]
    for d, want in list(zip(decisions, fresh)) * 2:
        got = sched.build_schedule(problem, d)
        assert got == want
        got["decode"] = None
    sched._RECENT.clear()
    nominal = sched.build_schedule(problem, decisions[0], shared_buses=False)
    assert nominal != fresh[0]   # the streamed plan's loads share a bus with its compute
    assert sched.build_schedule(problem, decisions[0]) == fresh[0]
    assert sched.build_schedule(problem, decisions[0], shared_buses=False) == nominal
