"""``hetplan profile --from-trace``: a run's measured task times become table points."""

import json
from types import SimpleNamespace

import pytest

from hetplan.cli import main
from hetplan.cost import attention_decode_work, linear_work
from hetplan.errors import HetplanError
from hetplan.evaluate import make_plan
from hetplan.graph import block_graph
from hetplan.hardware import load_node
from hetplan.model import ModelSpec
from hetplan.plan import write_atomic
from hetplan.problem import price
from hetplan.profile.checks import current_machine
from hetplan.profile.table import load_profile, shape_key
from hetplan.profile.trace import fold_trace_file
from hetplan.solvers import baselines
from hetplan.plan.timeline import task_trace_events
from hetplan.workload import Workload

MS = 1e-3
SPEC = ModelSpec(name="tiny", arch="llama", n_layers=2, hidden=64, intermediate=128, n_heads=4, n_kv_heads=2,
                 head_dim=16, vocab=256, max_positions=512, weight_dtype="fp32", kv_dtype="fp32")
WL = Workload(batch=1, prompt_len=8, gen_len=4)


def all_cpu_plan():
    problem = price(block_graph(SPEC, WL), load_node("cpu-64g"))
    return make_plan(problem, baselines.all_cpu(problem), {"strategy": "all-cpu", "status": "heuristic"})


def measured_trace(plan, seconds_of):
    """A trace whose measured lanes hold every task of ``plan`` with duration ``seconds_of(phase, task)``."""
    tasks = {}
    for phase, sched in plan.schedule.items():
        t, rows = 0.0, []
        for task in sched.tasks:
            d = seconds_of(phase, task)
            rows.append(SimpleNamespace(id=task.id, resource=task.resource, block=task.block, kind=task.kind,
                                        start_s=t, end_s=t + d))
            t += d
        tasks[phase] = rows
    return {"traceEvents": task_trace_events(tasks, "measured")}


@pytest.fixture
def files(tmp_path):
    plan = all_cpu_plan()
    write_atomic(tmp_path / "plan.json", plan.to_json())
    key = shape_key("mlp", SPEC)
    (tmp_path / "node.profile.json").write_text(json.dumps({
        "schema_version": 1, "machine": current_machine(), "entries": [
            {"device": "cpu", "op": "mlp", "dtype": "fp32", "shape": key,
             "points": [{"x": 1, "seconds": 5 * MS}, {"x": 64, "seconds": 50 * MS}]}]}))
    return tmp_path, plan


def test_trace_times_replace_the_points_they_were_measured_at(files):
    tmp, plan = files
    # mlp of layer 0 took 1 ms and of layer 1 3 ms in both phases: their median is 2 ms.
    trace = measured_trace(plan, lambda ph, t: (1 * MS if t.block == "mlp_0" else 3 * MS) if t.kind == "mlp"
                           else 0.5 * MS)
    (tmp / "trace.json").write_text(json.dumps(trace))
    assert main(["profile", "--from-trace", str(tmp / "trace.json"), "--profile", str(tmp / "node.profile.json"),
                 "--plan", str(tmp / "plan.json")]) == 0
    table = load_profile(tmp / "node.profile.json")
    prefill_mlp = linear_work(WL.batch * WL.prompt_len, SPEC.dense_mlp_params(), SPEC, "mlp")
    decode_mlp = linear_work(WL.batch, SPEC.dense_mlp_params(), SPEC, "mlp")
    assert table.seconds("cpu", decode_mlp, SPEC) == pytest.approx(2 * MS)      # x = 1: was 5 ms
    assert table.seconds("cpu", prefill_mlp, SPEC) == pytest.approx(2 * MS)     # x = 8: new point
    entry = table.entries[("cpu", "mlp", "fp32", shape_key("mlp", SPEC))]
    assert [(p.x, p.source, p.repeats) for p in entry.points] == [(1, "trace", 2), (8, "trace", 2),
                                                                 (64, "measured", 1)]
    # Decode attention ran at the plan's mean context: prompt + (gen + 1) / 2 = 10.5 cached tokens.
    attn = attention_decode_work(1, WL.decode_context_len, SPEC)
    assert table.seconds("cpu", attn, SPEC) == pytest.approx(0.5 * MS)


def test_predicted_lanes_are_not_measurements(files):
    tmp, plan = files
    predicted = {"traceEvents": task_trace_events({ph: s.tasks for ph, s in plan.schedule.items()}, "predicted")}
    (tmp / "trace.json").write_text(json.dumps(predicted))
    with pytest.raises(HetplanError, match="no measured compute tasks"):
        fold_trace_file(str(tmp / "trace.json"), str(tmp / "node.profile.json"), str(tmp / "plan.json"))


def test_a_trace_of_another_plan_is_refused(files):
    tmp, plan = files
    trace = measured_trace(plan, lambda ph, t: 1 * MS)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            e["args"]["id"] = "mlp/mlp_99"
    (tmp / "trace.json").write_text(json.dumps(trace))
    with pytest.raises(HetplanError, match="none of the trace's tasks is a stage of the plan"):
        fold_trace_file(str(tmp / "trace.json"), str(tmp / "node.profile.json"), str(tmp / "plan.json"))


def test_from_trace_without_the_plan_says_what_is_missing(files, capsys):
    tmp, _ = files
    assert main(["profile", "--from-trace", "t.json", "--profile", str(tmp / "node.profile.json")]) == 2
    assert "--from-trace needs --plan" in capsys.readouterr().err
