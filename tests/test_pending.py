"""Values waiting in HBM for copies to the host: hand-derived timelines, and the plan's graph.

``hetplan.plan.pending`` counts, over a phase's timeline, the most bytes that copies out of the
GPU hold: each ``act_down``/``kv_down`` holds its source from its GPU predecessor's end to its
own end (a ``kv_down``'s rows in the activation dtype). The plan adds that to its GPU peak, the
simulator recomputes it from its own replay, and the schedule orders each copy before the first
GPU stage that starts after it ends, so no interleaving of the runtime's lanes makes a copy wait
beside a GPU stage the timeline does not show it beside.
"""

from __future__ import annotations

import dataclasses

import pytest

from hetplan.buses import capacities, fluid_times
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.evaluate import make_plan
from hetplan.plan import Decision, Task
from hetplan.problem import build_problem
from hetplan.workload import Workload
from tests.conftest import tiny_node, tiny_spec
from hetplan.plan.pending import copies_out_bytes, held_windows
from hetplan.plan.simulate import PlanInvalid, check_plan, simulate
from tests.tiny_models import TINY_GPU_NODE, saved_moe_model
from tests.moe.test_whole_blocks import FAMILIES


def task(id, resource, kind, start, end, nbytes=0.0):
    return Task(id=id, resource=resource, block="b", kind=kind, duration_s=end - start, bytes=nbytes,
                start_s=start, end_s=end)


# G1 [0, 1), G2 [1, 3), G3 [3, 5) on the GPU. A (act_down, 100 B) and A2 (act_down, 40 B) read
# G1's output; K (kv_down, 50 B in the KV dtype, 3 B held per byte) reads G2's.
TIMELINE = [task("G1", "gpu", "attn_in", 0, 1), task("G2", "gpu", "attn_core", 1, 3),
            task("G3", "gpu", "attn_out", 3, 5),
            task("A", "d2h_act", "act_down", 1, 2, 100), task("A2", "d2h_act", "act_down", 2, 3.5, 40),
            task("K", "d2h", "kv_down", 3, 4.5, 50)]
EDGES = [("G1", "G2"), ("G2", "G3"), ("G1", "A"), ("G1", "A2"), ("G2", "K")]


def test_each_copy_holds_its_source_from_its_gpu_predecessor_to_its_own_end():
    windows = {w[3]: w[:3] for w in held_windows(TIMELINE, EDGES, 3.0)}
    assert windows == {"A": (1, 2, 100), "A2": (1, 3.5, 40), "K": (3, 4.5, 150)}


def test_the_peak_is_the_most_bytes_held_at_one_instant():
    # [1, 2): A + A2 = 140; [2, 3): A2 = 40; [3, 3.5): A2 + K = 40 + 3 * 50 = 190; [3.5, 4.5): 150
    assert copies_out_bytes(TIMELINE, EDGES, 3.0) == 190
    # a kv_down held in the KV dtype's bytes (ratio 1): [1, 2) is the peak, 140
    assert copies_out_bytes(TIMELINE, EDGES, 1.0) == 140


def test_a_window_ending_when_another_starts_is_not_counted_with_it():
    tasks = [task("G1", "gpu", "attn_in", 0, 1), task("G2", "gpu", "mlp", 1, 2),
             task("A", "d2h_act", "act_down", 1, 2, 100), task("B", "d2h_act", "act_down", 2, 3, 100)]
    edges = [("G1", "G2"), ("G1", "A"), ("G2", "B")]
    assert copies_out_bytes(tasks, edges, 1.0) == 100


def test_the_latest_gpu_predecessor_opens_the_window():
    tasks = [task("G1", "gpu", "attn_in", 0, 1), task("G2", "gpu", "attn_core", 1, 2),
             task("C", "cpu", "mlp", 0, 1.5), task("A", "d2h_act", "act_down", 2, 4, 10)]
    edges = [("G1", "G2"), ("G1", "A"), ("G2", "A"), ("C", "A")]
    assert [w[:3] for w in held_windows(tasks, edges, 1.0)] == [(2, 4, 10)]


def test_no_copies_hold_nothing():
    tasks = [task("G1", "gpu", "attn_in", 0, 1), task("U", "h2d_act", "act_up", 1, 2, 64)]
    assert copies_out_bytes(tasks, [("G1", "U")], 2.0) == 0


@pytest.fixture(scope="module")
def deepseek_plan(tmp_path_factory):
    """The plan of the once-flaky run: DeepSeek-V3 (tiny) on a 200 KiB GPU, prompt in chunks of 5."""
    _, directory = saved_moe_model(FAMILIES, "deepseek_v3", tmp_path_factory)
    node = tmp_path_factory.mktemp("node") / "node.yaml"
    node.write_text(TINY_GPU_NODE)
    plan, _ = compile_plan(CompileRequest(model=str(directory), hw=str(node), strategy="ilp", weight_dtype="fp32",
                                          gpu_mem="200KiB", prompt_len=24, gen_len=32, prefill_chunk=5))
    return plan


def test_the_plan_counts_the_copies_the_simulator_replays(deepseek_plan):
    plan = deepseek_plan
    sim = check_plan(plan)
    held = plan.memory["breakdown"]["gpu"]["copies_out"]
    assert held > 0 and held == pytest.approx(max(sim.waiting_bytes.values()), rel=1e-9)
    gpu = plan.memory["breakdown"]["gpu"]
    assert plan.memory["gpu_bytes"] == pytest.approx(sum(gpu.values()), rel=1e-12)
    assert plan.memory["gpu_bytes"] <= plan.memory["gpu_budget_bytes"]


@pytest.mark.parametrize("which", ["deepseek_plan", "dram_kv_plan"])
def test_no_interleaving_makes_a_copy_wait_beside_a_stage_the_timeline_does_not(which, request):
    """For every copy c out of the GPU, the GPU stages that some order of the lanes could run
    while c's value waits (after c's GPU predecessor on the GPU queue, and not ordered after c
    by edges and queue orders) all overlap c's window on the timeline."""
    plan = request.getfixturevalue(which)
    for phase, sched in plan.schedule.items():
        after = {t.id: [] for t in sched.tasks}
        for src, dst in sched.edges:
            after[src].append(dst)
        last = {}
        for t in sched.tasks:
            if t.resource in last:
                after[last[t.resource]].append(t.id)
            last[t.resource] = t.id
        gpu = [t for t in sched.tasks if t.resource == "gpu"]
        position = {t.id: i for i, t in enumerate(gpu)}
        windows = {w[3]: w for w in held_windows(sched.tasks, sched.edges, 1.0)}
        for c in (t for t in sched.tasks if t.id in windows):
            preds = [s for s, d in sched.edges if d == c.id and s in position]
            follow, stack = set(), [c.id]
            while stack:
                for n in after[stack.pop()]:
                    if n not in follow:
                        follow.add(n)
                        stack.append(n)
            may_overlap = [g for g in gpu[max(position[p] for p in preds) + 1:] if g.id not in follow]
            start, end = windows[c.id][:2]
            for g in may_overlap:
                assert g.start_s < end and g.end_s > start, f"{phase}: {c.id} may wait beside {g.id}"


@pytest.fixture(scope="module")
def dram_kv_plan():
    """A dense plan whose KV caches live in DRAM while prefill attention runs on the GPU: every
    layer's prompt KV leaves on ``d2h`` (``kv_down``) while the GPU runs on."""
    spec = tiny_spec(n_layers=4)
    problem = build_problem(spec, tiny_node(), Workload(1, 512, 16))
    blocks = [b.name for b in problem.blocks]
    weights = {b: "gpu" for b in blocks}
    dec = Decision(weights=weights, exec={"prefill": dict(weights), "decode": dict(weights)},
                   kv={b: "cpu" for b in blocks if b.startswith("attn")})
    return make_plan(problem, dec, {"strategy": "hand", "status": "heuristic", "mip_gap": None, "options": {}})


def test_copy_done_edges_leave_every_time_as_it_was(dram_kv_plan):
    """Edges from a copy to the first GPU stage that starts after it ends are added, and the
    fluid replay without them gives the same times."""
    sched = dram_kv_plan.schedule["prefill"]
    kinds = {t.id: t for t in sched.tasks}
    plain = [(s, d) for s, d in sched.edges
             if not (kinds[s].kind in ("act_down", "kv_down") and kinds[d].resource == "gpu")]
    assert len(sched.edges) - len(plain) >= 1
    for src, dst in set(sched.edges) - set(plain):
        assert kinds[dst].start_s >= kinds[src].end_s
    times = fluid_times(list(sched.tasks), plain, capacities(dram_kv_plan.hardware))
    for t in sched.tasks:
        assert times[t.id] == pytest.approx((t.start_s, t.end_s), abs=1e-15)
    check_plan(dram_kv_plan)


def test_kv_down_holds_the_prompts_rows_in_the_activation_dtype(dram_kv_plan):
    """fp16 model, fp16 KV: batch 1 * 512 tokens * (2 * 2 KV heads * 64) elements * 2 bytes per
    layer's copy; copies of consecutive layers overlap on the timeline only if one is still
    running when the next attention ends."""
    rows = 1 * 512 * (2 * 2 * 64) * 2
    sched = dram_kv_plan.schedule["prefill"]
    windows = [w for w in held_windows(sched.tasks, sched.edges, 1.0) if w[3].startswith("kv_down")]
    assert len(windows) == 4 and all(w[2] == rows for w in windows)
    overlap = max(sum(1 for w in windows if w[0] <= t < w[1]) for t in (w[0] for w in windows))
    held = dram_kv_plan.memory["breakdown"]["gpu"]["copies_out"]
    assert held >= overlap * rows
    assert held == pytest.approx(max(simulate(dram_kv_plan).waiting_bytes.values()), rel=1e-12)


def test_a_plan_that_under_reports_its_waiting_copies_is_refused(deepseek_plan):
    m = deepseek_plan.memory
    gpu = dict(m["breakdown"]["gpu"], copies_out=0.0)
    bad = dataclasses.replace(deepseek_plan, memory=dict(m, breakdown=dict(m["breakdown"], gpu=gpu)))
    with pytest.raises(PlanInvalid, match="copies_out"):
        check_plan(bad)
    assert simulate(bad).waiting_bytes == simulate(deepseek_plan).waiting_bytes


@pytest.mark.parametrize("gpu_mib", [48, 64])
def test_the_milp_reserves_what_a_copy_of_the_prompt_kv_holds_so_one_solve_fits(gpu_mib):
    """A plan whose prefill attention runs on the GPU with its cache in DRAM holds the prompt's
    K/V rows in HBM until each copy ends. The MILP reserves the largest such copy, so its plan
    fits at the first solve (no HBM held back for a second), its copies hold exactly that, and it
    is at least as fast as the plan solved with that HBM held back from the start."""
    from hetplan.compiler import decide
    from hetplan.evaluate import kv_down_source_bytes, objective_s, plan_within_budget

    problem = build_problem(tiny_spec(n_layers=8), tiny_node(gpu_mib / 1024),
                            Workload(batch=8, prompt_len=1024, gen_len=64, objective="latency", prefill_chunk=1024))
    req = CompileRequest(model="tiny", hw="tiny")
    held = []

    def solve(p):
        held.append(p.gpu_held_back_bytes)
        return decide(p, "ilp", None, req)
    plan, _, _ = plan_within_budget(problem, solve)
    copies = [p for p in plan.placement if p["kind"] == "attn" and p["exec"]["prefill"] != "cpu" and p["kv"] == "cpu"]
    src = kv_down_source_bytes(problem, problem.graph.block("attn_0"))
    gpu = plan.memory["breakdown"]["gpu"]
    assert copies and held == [0.0]
    assert gpu["copies_out"] == src
    assert plan.memory["gpu_bytes"] <= plan.memory["gpu_budget_bytes"]
    assert plan.memory["gpu_bytes"] - gpu["copies_out"] <= problem.gpu_budget_bytes - src
    before, _, _ = plan_within_budget(problem.held_back(src), solve)
    assert plan.solver["objective_s"] <= objective_s(problem, before.predicted) * (1 + 1e-9)
