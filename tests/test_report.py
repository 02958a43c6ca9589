"""Specification of the readable outputs: the show summary, the Gantt chart, the trace, --compare.

Plans here are built from hand-written decisions (no solver), so every expected placement is
known before the code under test runs.
"""

import json
import xml.etree.ElementTree as ET

import pytest

from hetplan.plan.compare import compare, compare_dicts, missing_bytes, score
from hetplan.compiler import CompileRequest
from hetplan.evaluate import make_plan
from hetplan.graph import PHASES
from hetplan.hardware import load_node
from hetplan.frontends.resolve import load_model
from hetplan.plan import Decision, Task
from hetplan.problem import build_problem
from hetplan.plan.report import block_runs, compare_table, format_table, render_show
from hetplan.solvers import baselines
from hetplan.plan.timeline import (nice_ticks, plan_trace_events, render_svg, task_trace_events, trace_document,
                              write_timeline)
from hetplan.workload import Workload

GIB = 2**30
SVG = "{http://www.w3.org/2000/svg}"


def gpt2_problem(node="rtx4090-64g", **wl):
    return build_problem(load_model("gpt2"), load_node(node), Workload(**{"prompt_len": 64, "gen_len": 16, **wl}))


def split_decision(problem, first_cpu_layer: int) -> Decision:
    """Layers below ``first_cpu_layer`` (and embed) resident on the GPU; the rest computed on
    the CPU with their KV caches there; the head streamed."""
    weights, kv = {}, {}
    for b in problem.blocks:
        on_gpu = b.kind == "embed" or (b.layer is not None and b.layer < first_cpu_layer)
        weights[b.name] = "gpu" if on_gpu else ("stream" if b.kind == "head" else "cpu")
        if b.kind == "attn":
            kv[b.name] = "gpu" if on_gpu else "cpu"
    return Decision(weights=weights, exec={ph: dict(weights) for ph in PHASES}, kv=kv, depth=2)


@pytest.fixture(scope="module")
def split_plan():
    problem = gpt2_problem()
    return make_plan(problem, split_decision(problem, 4), {"strategy": "hand", "status": "heuristic",
                                                           "mip_gap": None})


def test_identical_consecutive_layers_are_merged_into_one_row(split_plan):
    runs = [(r.label, r.count, r.weights, r.kv) for r in block_runs(split_plan)]
    assert runs == [("embed", 1, "gpu", None),
                    ("attn_0..attn_3", 4, "gpu", "gpu"), ("mlp_0..mlp_3", 4, "gpu", None),
                    ("attn_4..attn_11", 8, "cpu", "cpu"), ("mlp_4..mlp_11", 8, "cpu", None),
                    ("head", 1, "stream", None)]


def test_a_run_breaks_where_placement_changes_even_for_one_layer():
    problem = gpt2_problem()
    dec = split_decision(problem, 12)
    weights = dict(dec.weights, mlp_5="cpu")
    dec = Decision(weights, {ph: dict(weights) for ph in PHASES}, dec.kv, dec.depth)
    plan = make_plan(problem, dec, {"strategy": "hand", "status": "heuristic", "mip_gap": None})
    labels = [r.label for r in block_runs(plan) if r.first.startswith("mlp")]
    assert labels == ["mlp_0..mlp_4", "mlp_5", "mlp_6..mlp_11"]


def test_run_sums_the_bytes_of_its_blocks(split_plan):
    run = next(r for r in block_runs(split_plan) if r.label == "mlp_4..mlp_11")
    # gpt2 MLP, fp32: c_fc 768x3072 + 3072 bias, c_proj 3072x768 + 768 bias, ln_2 2 x 768
    per_layer = 4 * (768 * 3072 * 2 + 3072 + 768 + 2 * 768)
    assert run.weight_bytes == pytest.approx(8 * per_layer, rel=1e-6)


def test_show_prints_budget_prediction_bound_and_bottleneck(split_plan):
    text = render_show(split_plan)
    assert "attn_4..attn_11" in text
    assert "23.00 GiB" in text  # rtx4090-64g: 24 GiB card - 1 GiB reserve
    assert "60.00 GiB" in text  # 64 GiB DRAM - 4 GiB reserve
    for word in ("TTFT", "TPOT", "lower bound", "plan / bound", "bottleneck", "staging: 2 slot(s)"):
        assert word in text


def test_an_all_gpu_plan_is_bottlenecked_on_a_fully_busy_gpu():
    problem = gpt2_problem()
    plan = make_plan(problem, baselines.all_gpu(problem), {"strategy": "all-gpu", "status": "heuristic",
                                                            "mip_gap": None})
    # one serial chain of stages on one resource: no idle time anywhere
    assert render_show(plan).count("gpu (100% busy)") == 2


def test_tokens_per_dollar_use_the_node_price():
    problem = gpt2_problem("t4-208g")
    plan = make_plan(problem, baselines.all_gpu(problem), {"strategy": "all-gpu", "status": "heuristic",
                                                            "mip_gap": None})
    p = plan.predicted
    expected = p["throughput_tokens_per_s"] * 3600 / 0.35  # t4-208g: price per_hour 0.35
    assert f"tokens per dollar: {expected:,.0f}" in render_show(plan)


def test_a_time_limited_solve_is_flagged_as_not_proven_optimal(split_plan):
    plan = make_plan(gpt2_problem(), split_plan.decision(), {"strategy": "ilp", "status": "time_limit",
                                                              "mip_gap": 0.05})
    text = render_show(plan)
    assert "MIP gap 5%" in text and "not proven optimal: raise --time-limit" in text


def test_format_table_pads_columns_and_right_aligns_numbers():
    assert format_table(["a", "bb"], [["xyz", 1], ["w", 100]], right={1}).splitlines() == [
        "a     bb", "xyz    1", "w    100"]


# -- timeline pictures and traces ----------------------------------------------------------------

def test_svg_draws_one_rectangle_per_task_with_its_name(split_plan):
    root = ET.fromstring(render_svg(split_plan))
    titled = [r for r in root.iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    tasks = [t for ph in PHASES for t in split_plan.schedule[ph].tasks]
    assert len(titled) == len(tasks)
    titles = {r.find(f"{SVG}title").text.split(":")[0] for r in titled}
    assert titles == {t.id for t in tasks}


def test_svg_has_one_labelled_row_per_resource_used_in_each_phase(split_plan):
    root = ET.fromstring(render_svg(split_plan))
    labels = [t.text for t in root.iter(f"{SVG}text") if t.get("text-anchor") == "end"]
    expected = []
    for ph in PHASES:
        used = {t.resource for t in split_plan.schedule[ph].tasks}
        expected += [r for r in ("gpu", "cpu", "h2d", "d2h", "h2d_act", "d2h_act") if r in used]
    assert labels == expected
    assert {"gpu", "cpu", "h2d", "d2h_act"} <= set(labels)  # the split plan computes on both, streams the head


def test_png_timeline_is_a_png_file(split_plan, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "t.png"
    write_timeline(split_plan, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_refuses_an_unknown_picture_format(split_plan, tmp_path):
    from hetplan.errors import HetplanError
    with pytest.raises(HetplanError, match=r"\.svg or \.png"):
        write_timeline(split_plan, tmp_path / "t.gif")


def test_nice_ticks_step_by_one_two_or_five_times_a_power_of_ten():
    assert nice_ticks(2.341) == pytest.approx([0, 0.5, 1.0, 1.5, 2.0])
    assert nice_ticks(0.0733) == pytest.approx([0, 0.01 * 1, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07])
    assert nice_ticks(0.0) == [0.0]


def test_trace_has_one_complete_event_per_task_in_microseconds(split_plan):
    doc = plan_trace_events(split_plan)
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    pid = {"prefill": 1, "decode": 2}  # predicted prefill, predicted decode
    tasks = {(pid[ph], t.id): t for ph in PHASES for t in split_plan.schedule[ph].tasks}
    assert len(spans) == len(tasks)
    for e in spans:
        t = tasks[e["pid"], e["args"]["id"]]
        assert e["ts"] == pytest.approx(t.start_s * 1e6)
        assert e["dur"] == pytest.approx((t.end_s - t.start_s) * 1e6)
    json.dumps(doc)  # serialisable as is


def test_trace_puts_each_phase_in_a_process_and_each_resource_in_a_thread(split_plan):
    events = plan_trace_events(split_plan)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(procs.values()) == ["predicted decode", "predicted prefill"]
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    for e in events:
        if e["ph"] == "X":
            phase = procs[e["pid"]].split()[1]
            task = next(t for t in split_plan.schedule[phase].tasks if t.id == e["args"]["id"])
            assert threads[e["pid"], e["tid"]] == task.resource


def test_measured_and_predicted_traces_merge_side_by_side(split_plan):
    measured = [Task(id="mlp/mlp_0", resource="gpu", block="mlp_0", kind="mlp", duration_s=2e-3,
                     start_s=1e-3, end_s=3e-3)]
    doc = trace_document(plan_trace_events(split_plan), task_trace_events({"decode": measured}, "measured"))
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values()) == ["measured decode", "predicted decode", "predicted prefill"]
    mine = [e for e in doc["traceEvents"] if e["ph"] == "X" and names[e["pid"]] == "measured decode"]
    assert [(e["ts"], e["dur"]) for e in mine] == [pytest.approx((1000.0, 2000.0))]


def test_merging_two_predicted_traces_is_refused(split_plan):
    with pytest.raises(ValueError, match="process ids"):
        trace_document(plan_trace_events(split_plan), plan_trace_events(split_plan))


# -- compare -----------------------------------------------------------------------------------

def test_compare_lists_chosen_plan_then_every_baseline_on_the_same_problem(split_plan):
    rows = compare(split_plan, CompileRequest(model="gpt2", hw="rtx4090-64g"))
    assert [r.strategy.split(":")[0] for r in rows] == ["hand", "all-gpu", "greedy", "ngl", "ngl-nkvo", "stream",
                                                         "flexgen"]
    assert rows[0].chosen and not any(r.chosen for r in rows[1:])
    assert {r.plan.workload for r in rows} == {split_plan.workload}
    table = compare_table(compare_dicts(rows), split_plan.workload.objective)
    assert "hand (chosen)" in table and "stream" in table and "x chosen (latency)" in table


def test_best_ngl_is_no_worse_than_the_most_layers_that_fit():
    problem = gpt2_problem()
    plan = make_plan(problem, baselines.all_gpu(problem), {"strategy": "all-gpu", "status": "heuristic",
                                                            "mip_gap": None})
    best = compare(plan, CompileRequest(model="gpt2", hw="rtx4090-64g"))[3]
    most = make_plan(problem, baselines.ngl(problem, None), {"strategy": "ngl", "status": "heuristic",
                                                              "mip_gap": None, "options": {}})
    assert best.fits and score(best.plan) <= score(most) * (1 + 1e-12)


def test_a_baseline_that_does_not_fit_reports_the_missing_bytes():
    spec, hw = load_model("gpt2"), load_node("rtx4090-64g").with_budgets(gpu_mem=200 * 2**20)
    problem = build_problem(spec, hw, Workload(prompt_len=64, gen_len=16))
    plan = make_plan(problem, baselines.ngl(problem, 0), {"strategy": "ngl:0", "status": "heuristic",
                                                          "mip_gap": None})
    assert not missing_bytes(plan)  # nothing on the GPU
    rows = compare(plan, CompileRequest(model="gpt2", hw="rtx4090-64g", gpu_mem="200MiB"))
    all_gpu = rows[1]
    weights = sum(b.weight_bytes for b in problem.blocks)
    # all weights (~640 MiB in fp32) cannot fit 200 MiB: short at least weights - budget
    assert not all_gpu.fits and all_gpu.missing_bytes["gpu"] >= weights - 200 * 2**20
    assert "no: GPU short" in compare_table(compare_dicts(rows), "latency")


def test_tick_labels_use_the_unit_of_the_whole_axis():
    from hetplan.plan.timeline import tick_label
    assert [tick_label(t, 2.341) for t in (0, 0.5, 2.0)] == ["0", "0.5 s", "2 s"]
    assert [tick_label(t, 0.0733) for t in (0.01, 0.07)] == ["10 ms", "70 ms"]
    assert tick_label(2e-5, 9e-5) == "20 us"
