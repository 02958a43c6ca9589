"""A staging slot's reuse is proven by the graph, not by the plan's timing: a schedule missing one
edge that orders a slot's last reader before the next load into it is refused by the simulator
and by the runtime's program builder, even where the predicted times happen not to overlap."""

import dataclasses

import pytest
from tests.conftest import tiny_node, tiny_spec

from hetplan.compiler import CompileRequest, decide
from hetplan.errors import HetplanError
from hetplan.evaluate import make_plan
from hetplan.plan.simulate import PlanInvalid, check_plan, check_slot_reuse, simulate
from hetplan.problem import build_problem
from hetplan.runtime.dataflow import build_program
from hetplan.runtime.models.dense import DenseBackend
from hetplan.workload import Workload


@pytest.fixture(scope="module")
def slow_link_plan():
    """Every block streamed through two slots over a link slow enough that each load takes
    longer than the compute it overlaps: loads queue behind each other on ``h2d``, so the
    predicted times never show a slot overwritten early, edge or no edge."""
    spec = tiny_spec(n_layers=4, hidden=512, intermediate=1024, vocab=2000, weight_dtype="fp32", kv_dtype="fp32")
    problem = build_problem(spec, tiny_node(0.05, 4.0, h2d_bytes_per_s=1e9), Workload(batch=1, prompt_len=16, gen_len=4))
    dec, info, _ = decide(problem, "stream", None, CompileRequest(model="tiny", hw="tiny"))
    plan = make_plan(problem, dec, info)
    assert plan.staging["depth"] == 2
    return plan


def slot_edges(sched):
    """Edges into a load from a compute task (what frees the load's slot)."""
    return [e for e in sched.edges if e[1].startswith("load/") and not e[0].startswith("load/")]


def without(plan, phase, edge):
    s = plan.schedule[phase]
    s = dataclasses.replace(s, edges=tuple(e for e in s.edges if e != edge))
    return dataclasses.replace(plan, schedule={**plan.schedule, phase: s})


def test_the_compiled_plan_passes_the_graph_check(slow_link_plan):
    check_plan(slow_link_plan)
    backend = DenseBackend(slow_link_plan.model)
    for phase in ("prefill", "decode"):
        build_program(phase, slow_link_plan.schedule[phase], backend.reads, backend.writes)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_one_slot_reuse_edge_removed_is_refused_by_simulator_and_program_builder(slow_link_plan, phase):
    sched = slow_link_plan.schedule[phase]
    loads = [t for t in sched.tasks if t.kind == "load"]
    # the third load reuses the first load's slot (depth 2); drop the edge that waits for it
    reuse = next(e for e in slot_edges(sched) if e[1] == loads[2].id)
    broken = without(slow_link_plan, phase, reuse)
    with pytest.raises(PlanInvalid, match=rf"{phase}: {loads[2].id} may overwrite staging slot "
                                          rf"{loads[2].slot} while \S+ still reads {loads[0].block}'s weights"):
        simulate(broken)
    backend = DenseBackend(broken.model)
    with pytest.raises(HetplanError, match=rf"{phase}: {loads[2].id} may overwrite staging slot {loads[2].slot}"):
        build_program(phase, broken.schedule[phase], backend.reads, backend.writes)


def test_a_reader_ordered_through_its_queue_needs_no_edge_of_its_own():
    # r1 reads slot 0; r2 follows it on the gpu queue and the second load waits for r2 only
    from hetplan.plan import Task
    t = lambda tid, res, block, kind, slot=None: Task(id=tid, resource=res, block=block, kind=kind,  # noqa: E731
                                                        duration_s=1.0, slot=slot)
    tasks = [t("load/a", "h2d", "a", "load", 0), t("r1", "gpu", "a", "mlp", 0), t("r2", "gpu", "b", "mlp"),
             t("load/c", "h2d", "c", "load", 0), t("r3", "gpu", "c", "mlp", 0)]
    edges = [("load/a", "r1"), ("r2", "load/c"), ("load/c", "r3")]
    check_slot_reuse(tasks, edges)
    with pytest.raises(PlanInvalid, match=r"load/c may overwrite staging slot 0 while r1"):
        check_slot_reuse(tasks, [("load/a", "r1"), ("load/c", "r3")])
