"""Pipeline plans of tiny models on tiny two-GPU nodes: the chosen split against every split
priced by the same single-GPU planner, the hand-derived link cost, and single-GPU nodes as
before."""

import dataclasses
import math

import pytest

from hetplan.compiler import CompileRequest, stage_solver
from hetplan.hardware import PeerLink
from hetplan.pipeline import plan_pipeline, slice_model, stage_problem
from hetplan.pipeline.stages import device_problem as pipeline_device_problem
from hetplan.workload import Workload
from tests.conftest import GIB, tiny_node, tiny_spec

WL = Workload(batch=1, prompt_len=64, gen_len=16, objective="latency", prefill_chunk=64)
SOLVE = stage_solver(CompileRequest(model="tiny", hw="tiny"))


def two_gpus(gpu_gib: float, second_gib: float | None = None, link=PeerLink(0, 1, "pcie", 8e9)):
    hw = tiny_node(gpu_gib)
    second = dataclasses.replace(hw.gpu, memory_bytes=int((second_gib or gpu_gib) * GIB),
                                 mem_bytes_per_s=250e9)
    return dataclasses.replace(hw, gpus=(hw.gpu, second), peers=(link,) if link else ())


def every_split_cost(spec, hw, wl):
    """Brute force: GPU 0 alone, GPU 1 alone, or [0, s) on GPU 0 and [s, L) on GPU 1."""
    L = spec.n_layers
    link = {"prefill": wl.batch * wl.prompt_len * spec.hidden * 2, "decode": wl.batch * spec.hidden * 2}
    costs = {}
    for gpus, cuts in [((0,), (0, L)), ((1,), (0, L))] + [((0, 1), (0, s, L)) for s in range(1, L)]:
        total = 0.0
        for k, a, b in zip(gpus, cuts, cuts[1:]):
            plan = SOLVE(stage_problem(spec, hw, wl, k, a, b))
            total += math.inf if plan is None else plan.predicted["ttft_s"] + wl.gen_len * plan.predicted["tpot_s"]
        if len(gpus) == 2:  # hand-derived: bytes / (8 GB/s x 0.9) + 10 us, each phase
            total += link["prefill"] / (8e9 * 0.9) + 10e-6 + wl.gen_len * (link["decode"] / (8e9 * 0.9) + 10e-6)
        costs[(gpus, cuts)] = total
    return costs


@pytest.mark.parametrize("gpu_mib, second_mib", [(3, 3), (4, 8), (100, 100), (2.5, 100)])
def test_the_pipeline_is_the_cheapest_of_every_split(gpu_mib, second_mib):
    spec = tiny_spec(n_layers=4)
    hw = two_gpus(gpu_mib / 1024, second_mib / 1024)
    costs = every_split_cost(spec, hw, WL)
    pp = plan_pipeline(spec, hw, WL, SOLVE)
    got = pp.predicted()["latency_s"]
    assert got == pytest.approx(min(costs.values()), rel=1e-9)
    key = (tuple(s.gpu for s in pp.stages), (0,) + tuple(s.end_layer for s in pp.stages))
    assert costs[key] == pytest.approx(got, rel=1e-9)


def test_a_gpu_too_small_for_the_model_splits_it_with_the_other():
    spec = tiny_spec(n_layers=4)
    hw = two_gpus(3 / 1024)  # ~3 MiB each: neither holds all four layers, together they do
    pp = plan_pipeline(spec, hw, WL, SOLVE)
    assert [s.gpu for s in pp.stages] == [0, 1]
    assert all(s.plan.memory["gpu_bytes"] <= 3 * 2**20 for s in pp.stages)


def test_the_link_between_stages_costs_bytes_over_bandwidth_plus_latency():
    spec = tiny_spec(n_layers=4)
    for link, per_byte in [(PeerLink(0, 1, "nvlink", 100e9), 1 / (100e9 * 0.9)),
                           (None, 1 / (16e9 * 0.9) * 2)]:  # through the host: d2h, then h2d
        hw = two_gpus(3 / 1024, link=link)
        pp = plan_pipeline(spec, hw, WL, SOLVE)
        latency = 10e-6 if link else 2 * 10e-6
        (l,) = pp.links
        assert l["prefill_s"] == pytest.approx(64 * 256 * 2 * per_byte + latency)
        assert l["decode_s"] == pytest.approx(256 * 2 * per_byte + latency)
        assert l["kind"] == (link.kind if link else "host")
        ttft = sum(s.plan.predicted["ttft_s"] for s in pp.stages) + l["prefill_s"]
        assert pp.predicted()["ttft_s"] == pytest.approx(ttft)


def test_only_the_first_stage_holds_the_embedding_and_only_the_last_the_head():
    spec = tiny_spec(n_layers=4)
    pp = plan_pipeline(spec, two_gpus(3 / 1024), WL, SOLVE)
    first, last = pp.stages[0].plan, pp.stages[-1].plan
    held = [{p["block"] for p in s.plan.placement if p["weight_bytes"] > 0} for s in pp.stages]
    assert "embed" in held[0] and "head" not in held[0]
    assert "head" in held[-1] and "embed" not in held[-1]
    assert first.model.n_layers + last.model.n_layers == 4


def test_a_slice_keeps_a_dense_prefix_where_it_falls():
    spec = tiny_spec(n_layers=6, n_experts=4, experts_per_token=2, moe_intermediate=128, first_dense_layers=2)
    assert slice_model(spec, 0, 3).first_dense_layers == 2
    assert slice_model(spec, 1, 3).first_dense_layers == 1
    assert slice_model(spec, 3, 6).first_dense_layers == 0


def test_the_throughput_pipeline_minimises_its_slowest_stage():
    spec = tiny_spec(n_layers=4)
    hw = two_gpus(3 / 1024)
    wl = dataclasses.replace(WL, objective="throughput")
    pp = plan_pipeline(spec, hw, wl, SOLVE, objective="max")
    decode_link = 256 * 2 / (8e9 * 0.9) + 10e-6
    slowest = {}
    for k in (0, 1):  # one GPU alone
        alone = SOLVE(stage_problem(spec, hw, wl, k, 0, 4))
        if alone is not None:
            slowest[("alone", k)] = alone.predicted["tpot_s"]
    for s in range(1, 4):  # every two-stage split, each stage holding a KV cache per micro-batch: 2
        a = SOLVE(stage_problem(spec, hw, wl, 0, 0, s, kv_copies=2))
        b = SOLVE(stage_problem(spec, hw, wl, 1, s, 4, kv_copies=2))
        if a is not None and b is not None:
            slowest[s] = max(a.predicted["tpot_s"], b.predicted["tpot_s"], decode_link)
    assert 1 / pp.predicted()["pipelined_decode_tokens_per_s"] == pytest.approx(min(slowest.values()), rel=1e-9)


@pytest.mark.parametrize("wl", [WL, dataclasses.replace(WL, batch=4, prompt_len=256, prefill_chunk=64),
                                dataclasses.replace(WL, batch=16, prompt_len=128, prefill_chunk=128)])
@pytest.mark.parametrize("moe", [False, True])
def test_the_cheap_stage_bound_never_exceeds_the_solved_stage(moe, wl):
    from hetplan.pipeline.bounds import StageBound

    extra = dict(n_experts=8, experts_per_token=2, moe_intermediate=256, first_dense_layers=1) if moe else {}
    spec = tiny_spec(n_layers=4, **extra)
    for gpu_mib in (2, 3, 6, 8, 12, 100):  # CPU, split, streamed and resident MoE blocks among them
        hw = two_gpus(gpu_mib / 1024)
        bound = StageBound(spec, hw.single_gpu(0), wl)
        for a in range(4):
            for b in range(a + 1, 5):
                plan = SOLVE(stage_problem(spec, hw, wl, 0, a, b))
                if plan is None:
                    continue
                prefill, decode = bound(a, b)
                assert prefill <= plan.predicted["ttft_s"] * (1 + 1e-9), (gpu_mib, a, b)
                assert decode <= plan.predicted["tpot_s"] * (1 + 1e-9), (gpu_mib, a, b)
                lp = SOLVE.lower_bound(stage_problem(spec, hw, wl, 0, a, b))   # the MILP's LP relaxation
                assert lp is None or lp <= plan.solver["objective_s"] * (1 + 1e-9), (gpu_mib, a, b)
                assert lp is not None or moe, "a dense stage's count MILP has an LP bound"


@pytest.mark.parametrize("gpu_mib", [None, 0.01, 2])   # no GPU; one smaller than its workspace; a GPU
@pytest.mark.parametrize("moe", [False, True])
def test_the_stage_bound_is_inf_exactly_where_the_stage_cannot_fit_at_all(moe, gpu_mib):
    from hetplan.diagnose import fits_at_all
    from hetplan.pipeline.bounds import StageBound
    from hetplan.problem import build_problem

    extra = dict(n_experts=8, experts_per_token=2, moe_intermediate=256, first_dense_layers=1) if moe else {}
    spec = tiny_spec(n_layers=6, **extra)
    whole = build_problem(spec, tiny_node(gpu_mib and gpu_mib / 1024), WL)
    need = sum(b.weight_bytes + b.kv_bytes for b in whole.blocks)
    seen = set()
    for part in (0.2, 0.45, 0.7, 1.1):   # DRAM for about that part of the model: some stages fit, some not
        hw = tiny_node(gpu_mib and gpu_mib / 1024, cpu_gib=(part * need + whole.cpu_workspace_bytes) / GIB)
        bound = StageBound(spec, hw, WL)
        for a in range(6):
            for b in range(a + 1, 7):
                fits = fits_at_all(stage_problem(spec, hw, WL, 0, a, b) if gpu_mib else
                                   pipeline_device_problem(spec, hw, WL, a, b))
                assert (math.inf not in bound(a, b)) == fits, (part, a, b)
                seen.add(fits)
    assert seen == {True, False}


def test_searches_sharing_a_memo_price_a_stage_once_and_choose_as_a_search_alone():
    spec = tiny_spec(n_layers=4)
    solve = stage_solver(CompileRequest(model="tiny", hw="tiny", stage_memo={}))
    calls = []

    def counted(problem):
        calls.append(problem)
        return solve(problem)
    counted.lower_bound, counted.memo = solve.lower_bound, solve.memo
    hw = two_gpus(3 / 1024, 2.5 / 1024)
    first = plan_pipeline(spec, hw, WL, counted)
    priced = len(calls)
    assert priced > 0
    second = plan_pipeline(spec, hw, WL, counted)             # everything it prices is known
    assert len(calls) == priced
    assert second.predicted() == first.predicted() == plan_pipeline(spec, hw, WL, SOLVE).predicted()
    swapped = dataclasses.replace(hw, gpus=hw.gpus[::-1])     # the same devices in another order
    alone = plan_pipeline(spec, swapped, WL, SOLVE)
    assert plan_pipeline(spec, swapped, WL, counted).predicted() == alone.predicted()
    other = plan_pipeline(spec, hw, dataclasses.replace(WL, batch=2), counted)   # another workload: priced anew
    assert len(calls) > priced
    assert other.predicted() == plan_pipeline(spec, hw, dataclasses.replace(WL, batch=2), SOLVE).predicted()


def test_the_offload_bound_is_the_least_time_link_and_cpu_together_move_the_bytes_beyond_hbm():
    from hetplan.pipeline.bounds import FREE, offload_s

    # 100 bytes off HBM, a 10 B/s link, a 1 s chain; 20 bytes free, then 40 bytes read at 40 B/s
    # of CPU time, then 100 at 5 B/s. At t = 2 the link has carried 20 and the CPU 20 + 40, 20
    # short; from there the link and the CPU at 5 B/s add 15 B/s: t = 2 + 20 / 15 = 10 / 3.
    assert offload_s(100, 10, 1, [(FREE, 20), (40, 40), (5, 100)]) == pytest.approx(10 / 3)
    assert offload_s(5, 10, 1, []) == 1                   # the link carries it within the chain
    assert offload_s(100, 10, 0, []) == pytest.approx(10)  # no CPU: the link alone
    assert offload_s(100, 10, 0, [(FREE, 100)]) == 0      # the CPU reads it all at no cost
    # the CPU takes both classes whole by t = 2 (60 bytes); the link needs t = 40 / 10 = 4
    assert offload_s(100, 10, 0, [(40, 40), (20, 20)]) == pytest.approx(4)


def test_gpu_mem_sets_each_gpu_budget_and_refuses_a_gpu_that_is_not_there():
    from hetplan.errors import HetplanError
    from hetplan.pipeline.compile import with_gpu_budgets

    hw = dataclasses.replace(two_gpus(1), gpu_reserve_bytes=1 << 20)
    got = with_gpu_budgets(hw, "0=100MiB, 1=200MiB")
    assert [g.memory_bytes - (1 << 20) for g in got.gpus] == [100 << 20, 200 << 20]
    assert [g.memory_bytes for g in with_gpu_budgets(hw, "300MiB").gpus] == [(300 << 20) + (1 << 20)] * 2
    for bad, says in [("2=1GiB", "no GPU 2"), ("x=1GiB", "cannot read 'x'"), ("0=2GiB", "more than")]:
        with pytest.raises(HetplanError, match=says):
            with_gpu_budgets(hw, bad)


@pytest.mark.parametrize("gpu_mib, second_mib", [(3, 3), (4, 8), (2.5, 100)])
def test_learnt_lp_bounds_and_stages_priced_side_by_side_change_no_choice(gpu_mib, second_mib, monkeypatch):
    """The search that learns every stage length's LP bound from the stages it refines
    (``count_bounds``) and each kind of stage's count MILP lines from the first it prices
    (``count_lines``: bounds for the DP, floors for the MILPs of the stages priced after it), and
    prices stages in forked children, chooses the stages the plain search chooses, each as fast
    (one process, each stage's own LP bound)."""
    spec = tiny_spec(n_layers=8)
    hw = two_gpus(gpu_mib / 1024, second_mib / 1024)
    solve = stage_solver(CompileRequest(model="tiny", hw="tiny"))
    taught = []

    def plain(problem):
        return solve(problem)
    plain.lower_bound = solve.lower_bound

    def learning(problem, lp_bounds=None, floors=None):
        return solve(problem, lp_bounds=lp_bounds, floors=floors)
    learning.lower_bound = solve.lower_bound
    learning.count_bounds = lambda problem, known=None: taught.append(problem) or solve.count_bounds(problem, known)
    learning.count_lines = solve.count_lines
    monkeypatch.setenv("HETPLAN_JOBS", "1")
    want = plan_pipeline(spec, hw, WL, plain)
    monkeypatch.setenv("HETPLAN_JOBS", "2")
    got = plan_pipeline(spec, hw, WL, learning)
    assert [(s.gpu, s.first_layer, s.end_layer) for s in got.stages] == \
        [(s.gpu, s.first_layer, s.end_layer) for s in want.stages]
    assert got.predicted() == want.predicted()
    # each stage as fast (a count MILP stopped at its line takes the first plan that reaches it:
    # between plans of equal cost, a placement may differ)
    assert [s.plan.predicted for s in got.stages] == [s.plan.predicted for s in want.stages]
    assert taught or len(want.stages) == 1
