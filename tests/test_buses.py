"""Shared buses: tasks that overlap divide the DRAM bus and HBM (``hetplan/buses.py``), in the
schedule builder and in the independent simulator alike; the MILP bounds the result.

Expected timelines are derived by hand from the max-min fair rule (every running task's
bandwidth rises equally until it reaches its demand bytes / duration or a bus it uses is full),
with the arithmetic written out beside each case. Bus bounds on real scenarios are checked on
freshly compiled plans of the golden scenarios' recorded inputs (the goldens themselves are
regenerated separately).
"""

import dataclasses
import random
from pathlib import Path

import pytest
from tests.conftest import MILP_REPLAY_REL_TOL, tiny_node, tiny_spec

from hetplan.buses import fluid_times
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.evaluate import objective_s, predictions
from hetplan.plan import Task
from hetplan.plan.check import request_of
from hetplan.plan.format import load_plan
from hetplan.plan.simulate import check_plan, replay
from hetplan.problem import build_problem
from hetplan.schedule import build_schedule
from hetplan.solvers import ilp
from hetplan.workload import Workload

PLANS_DIR = Path(__file__).resolve().parent.parent / "plans"
GOLDENS = sorted(PLANS_DIR.glob("*.json"))


def _t(tid, resource, duration_s, nbytes):
    return Task(id=tid, resource=resource, block="b", kind="mlp", duration_s=duration_s, bytes=nbytes)


def both_replays(tasks, edges, caps):
    """(start, end) by id from the schedule builder's timing and from the simulator's replay."""
    times = fluid_times(tasks, edges, caps)
    start, end = replay(tasks, edges, "test", caps)
    return ({k: v[0] for k, v in times.items()}, {k: v[1] for k, v in times.items()}), (start, end)


def _assert_times(got, expected):
    start, end = got
    for tid, (s, e) in expected.items():
        assert start[tid] == pytest.approx(s, rel=1e-12, abs=1e-12), tid
        assert end[tid] == pytest.approx(e, rel=1e-12, abs=1e-12), tid


def test_tasks_under_a_bus_capacity_keep_their_durations():
    # demands 30 + 40 = 70 <= 80 B/s: nobody slows
    tasks = [_t("cpu", "cpu", 1.0, 30.0), _t("load", "h2d", 2.0, 80.0)]
    for got in both_replays(tasks, [], {"dram": 80.0, "hbm": 1e9}):
        _assert_times(got, {"cpu": (0.0, 1.0), "load": (0.0, 2.0)})


def test_a_copy_below_its_fair_share_keeps_its_rate_beside_a_cpu_task():
    # DRAM 80 B/s; CPU demands 60, the copy 40 (= its fair share 80 / 2): the copy gets 40, the
    # CPU the other 40 = 2/3 of its speed. The copy ends at 1; the CPU has done 2/3 of its 1 s
    # and runs the last 1/3 alone: ends at 1 + 1/3.
    tasks = [_t("cpu", "cpu", 1.0, 60.0), _t("load", "h2d", 1.0, 40.0)]
    for got in both_replays(tasks, [], {"dram": 80.0, "hbm": 1e9}):
        _assert_times(got, {"cpu": (0.0, 4 / 3), "load": (0.0, 1.0)})


def test_two_bandwidth_bound_tasks_split_the_bus_evenly():
    # DRAM 80; both demand 60 over 1 s: 40 each (2/3 speed) until the first ends at 1.5, which
    # both do together: (60 + 60) / 80 = 1.5.
    tasks = [_t("cpu", "cpu", 1.0, 60.0), _t("load", "h2d", 1.0, 60.0)]
    for got in both_replays(tasks, [], {"dram": 80.0, "hbm": 1e9}):
        _assert_times(got, {"cpu": (0.0, 1.5), "load": (0.0, 1.5)})


def test_three_tasks_over_two_buses():
    # DRAM 80, HBM 110. cpu: 1 s, 60 B (DRAM, demand 60); load: 2 s, 60 B (both buses,
    # demand 30); gpu: 1 s, 100 B (HBM, demand 100). Filling: all three rise to 30, where the
    # load reaches its demand; DRAM then has 80 - 60 = 20 left for the CPU (50 = 5/6 speed,
    # DRAM full) and HBM 110 - 60 = 50 for the GPU (80 = 0.8 speed, HBM full).
    # Events: the CPU ends at 1 / (5/6) = 1.2; by then the GPU has done 0.96 and the load 1.2.
    # Load and GPU: HBM gives the load 30 and the GPU 80 again: the GPU ends at
    # 1.2 + 0.04 / 0.8 = 1.25; the load, 1.25 done, runs alone to 1.25 + 0.75 = 2.0.
    tasks = [_t("cpu", "cpu", 1.0, 60.0), _t("load", "h2d", 2.0, 60.0), _t("gpu", "gpu", 1.0, 100.0)]
    for got in both_replays(tasks, [], {"dram": 80.0, "hbm": 110.0}):
        _assert_times(got, {"cpu": (0.0, 1.2), "gpu": (0.0, 1.25), "load": (0.0, 2.0)})


def test_a_task_that_starts_later_slows_only_the_overlap():
    # DRAM 60; a: cpu 2 s at 60 B/s (120 B); c: h2d 1 s at 60 B/s, after b (gpu, 0.5 s, no DRAM).
    # [0, 0.5): a alone at full speed (0.5 done). [0.5, ...): a and c share 30/30 (1/2 speed):
    # c needs 1 s of nominal time -> ends at 2.5; a has 1.5 left, done 1.0 by 2.5, 0.5 left
    # alone -> ends at 3.0.
    tasks = [_t("a", "cpu", 2.0, 120.0), _t("b", "gpu", 0.5, 0.0), _t("c", "h2d", 1.0, 60.0)]
    for got in both_replays(tasks, [("b", "c")], {"dram": 60.0, "hbm": 1e9}):
        _assert_times(got, {"a": (0.0, 3.0), "b": (0.0, 0.5), "c": (0.5, 2.5)})


# -- plans of real scenarios ------------------------------------------------------------------------

def _dram_hbm_bytes(sched) -> tuple[float, float]:
    """Bytes over DRAM (CPU tasks and copies) and over HBM (GPU tasks and copies), restated."""
    dram = sum(t.bytes for t in sched.tasks if t.resource != "gpu")
    hbm = sum(t.bytes for t in sched.tasks if t.resource != "cpu")
    return dram, hbm


def _capacity(hw) -> tuple[float, float]:
    """Effective DRAM and HBM bandwidth: spec times the node's memory efficiency."""
    dram = hw.cpu.mem_bytes_per_s * hw.efficiency["cpu_mem"]
    hbm = hw.gpu.mem_bytes_per_s * hw.efficiency["gpu_mem"] if hw.gpu else float("inf")
    return dram, hbm


_FRESH = {}


def fresh(path: Path):
    """The golden scenario at ``path`` compiled again from its recorded inputs."""
    if path not in _FRESH:
        _FRESH[path] = compile_plan(request_of(load_plan(path), str(path)))[0]
    return _FRESH[path]


@pytest.mark.parametrize("path", GOLDENS, ids=[p.stem for p in GOLDENS])
def test_no_phase_of_a_golden_scenario_beats_its_buses(path):
    plan = fresh(path)
    check_plan(plan)
    c_dram, c_hbm = _capacity(plan.hardware)
    for phase, key in (("prefill", "ttft_s"), ("decode", "tpot_s")):
        dram, hbm = _dram_hbm_bytes(plan.schedule[phase])
        assert plan.predicted[key] >= dram / c_dram * (1 - 1e-9), phase
        assert plan.predicted[key] >= hbm / c_hbm * (1 - 1e-9), phase


@pytest.mark.parametrize("path", GOLDENS, ids=[p.stem for p in GOLDENS])
def test_the_milp_bounds_the_replay_of_a_golden_scenario_tightly(path):
    plan = fresh(path)
    milp, replayed = plan.solver["milp_objective_s"], plan.solver["objective_s"]
    assert milp <= replayed * (1 + 1e-6)
    assert replayed <= milp * (1 + MILP_REPLAY_REL_TOL)


def test_70b_q4_k_m_on_a_4090_respects_the_dram_bus_in_decode():
    plan, _ = compile_plan(CompileRequest(model="llama-3.1-70b", hw="rtx4090-64g", weight_dtype="q4_k_m"))
    c_dram, _ = _capacity(plan.hardware)
    dram, _ = _dram_hbm_bytes(plan.schedule["decode"])
    assert dram / plan.predicted["tpot_s"] <= c_dram * (1 + 1e-9)
    # the streaming that rode on two full shares of one bus no longer pays: decode is llama.cpp's
    ngl, _ = compile_plan(CompileRequest(model="llama-3.1-70b", hw="rtx4090-64g", weight_dtype="q4_k_m",
                                         strategy="ngl"))
    assert plan.predicted["tpot_s"] <= ngl.predicted["tpot_s"] * (1 + 1e-9)


def _random_case(rng):
    hidden = rng.choice([512, 1024, 2048])
    spec = tiny_spec(n_layers=rng.choice([1, 2, 3, 4]), hidden=hidden, intermediate=hidden * rng.choice([2, 4]),
                     n_heads=8, n_kv_heads=rng.choice([2, 8]), head_dim=hidden // 8, vocab=8000)
    wl = Workload(batch=rng.choice([1, 4, 16]), prompt_len=rng.choice([64, 512, 2048]),
                  gen_len=rng.choice([8, 64]), objective=rng.choice(["latency", "ttft", "tpot"]))
    link = rng.choice([8e9, 16e9, 32e9, 64e9])
    node = tiny_node(64, 64, h2d_bytes_per_s=link, d2h_bytes_per_s=link)
    node = dataclasses.replace(node, cpu=dataclasses.replace(node.cpu, mem_bytes_per_s=rng.choice([30e9, 50e9, 100e9])))
    roomy = build_problem(spec, node, wl)
    total = sum(b.weight_bytes + b.kv_bytes for b in roomy.blocks)
    hw = node.with_budgets(gpu_mem=int(roomy.gpu_workspace_bytes + rng.choice([0.1, 0.25, 0.4, 0.6, 0.8]) * total),
                           cpu_mem=int(roomy.cpu_workspace_bytes + 1.5 * total))
    return build_problem(spec, hw, wl)


@pytest.mark.parametrize("seed", range(12))
def test_the_milp_bounds_the_replay_of_random_small_cases(seed):
    problem = _random_case(random.Random(seed))
    res = ilp.solve(problem, ilp.IlpOptions(mip_rel_gap=1e-9, max_nodes=100_000))
    replayed = objective_s(problem, predictions(problem, build_schedule(problem, res.decision)))
    alone = objective_s(problem, predictions(problem, build_schedule(problem, res.decision, shared_buses=False)))
    # every task at its exclusive rate <= the MILP's value <= the replay with shared buses
    assert alone <= res.objective_s * (1 + 1e-6) + 1e-9
    assert res.objective_s <= replayed * (1 + 1e-6) + 1e-9
    assert replayed <= res.objective_s * (1 + MILP_REPLAY_REL_TOL)
