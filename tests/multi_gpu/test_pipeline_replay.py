"""The simulator replays pipeline plans: each stage's own plan replayed, each link restated from
its legs, the pipeline's predictions restated from those (figures derived by hand), and a
tampered plan caught."""

import copy
import json

import pytest

from hetplan.compiler import CompileRequest
from hetplan.pipeline.compile import compile_pipeline
from hetplan.pipeline.record import stage_plan
from hetplan.plan import Plan
from hetplan.plan.simulate import PlanInvalid
from hetplan.plan.simulate_pipeline import check_pipeline, micro_batch_ends_s, restated_predictions
from hetplan.workload import Workload
from tests.conftest import tiny_spec
from tests.multi_gpu.test_pipeline import two_gpus

REQ = dict(model="tiny", hw="tiny", prompt_len=64, gen_len=16, weight_dtype="fp16")


@pytest.fixture(scope="module")
def plan_dict():
    """A tiny model split over two ~3 MiB GPUs joined by PCIe at 8 GB/s (neither holds it alone)."""
    plan, _ = compile_pipeline(tiny_spec(n_layers=4), two_gpus(3 / 1024), CompileRequest(**REQ))
    d = json.loads(plan.to_json())
    assert len(d["pipeline"]["stages"]) == 2
    return d


def load(d: dict) -> Plan:
    return Plan.from_dict(copy.deepcopy(d), verify=False)


def test_a_two_stage_pipeline_replays_to_its_hand_derived_times(plan_dict):
    plan = load(plan_dict)
    replay = check_pipeline(plan)
    stages = [stage_plan(plan, i).predicted for i in range(2)]
    # the hidden state over PCIe peer-to-peer: bytes / (8 GB/s x 0.9) + 10 us, hidden 256 in fp16
    link = {"prefill": 64 * 256 * 2 / (8e9 * 0.9) + 10e-6, "decode": 256 * 2 / (8e9 * 0.9) + 10e-6}
    assert replay.links[0]["prefill"] == pytest.approx(link["prefill"], rel=1e-9)
    assert replay.links[0]["decode"] == pytest.approx(link["decode"], rel=1e-9)
    ttft = stages[0]["ttft_s"] + link["prefill"] + stages[1]["ttft_s"]
    tpot = stages[0]["tpot_s"] + link["decode"] + stages[1]["tpot_s"]
    assert replay.predicted["ttft_s"] == pytest.approx(ttft, rel=1e-9)
    assert replay.predicted["latency_s"] == pytest.approx(ttft + 16 * tpot, rel=1e-9)
    slowest = max(stages[0]["tpot_s"], link["decode"], stages[1]["tpot_s"])
    assert replay.predicted["pipelined_decode_tokens_per_s"] == pytest.approx(1 / slowest, rel=1e-9)


def test_micro_batches_leave_a_chain_one_slowest_resource_apart():
    # stage 2 s, link 0.5 s, stage 3 s: the first leaves at 5.5 s, each later one 3 s after
    assert micro_batch_ends_s([2.0, 0.5, 3.0], 4) == pytest.approx([5.5, 8.5, 11.5, 14.5])
    # the slow stage first: 3 + 0.5 + 2 = 5.5 s, then 3 s apart all the same
    assert micro_batch_ends_s([3.0, 0.5, 2.0], 3) == pytest.approx([5.5, 8.5, 11.5])
    # replicas multiply every rate; a sequence's times are one replica's
    wl = Workload(batch=2, prompt_len=10, gen_len=4, objective="throughput", prefill_chunk=10)
    p = restated_predictions([{"prefill": 1.0, "decode": 0.2}, {"prefill": 2.0, "decode": 0.3}],
                             [{"prefill": 0.5, "decode": 0.1}], wl, replicas=3)
    assert p["ttft_s"] == pytest.approx(3.5) and p["tpot_s"] == pytest.approx(0.6)
    assert p["latency_s"] == pytest.approx(3.5 + 4 * 0.6)
    assert p["decode_tokens_per_s"] == pytest.approx(3 * 2 / 0.6)
    assert p["prefill_tokens_per_s"] == pytest.approx(3 * 2 * 10 / 3.5)
    assert p["pipelined_decode_tokens_per_s"] == pytest.approx(3 * 2 / 0.3)


def tampered(d: dict, path: tuple, factor: float) -> dict:
    d = copy.deepcopy(d)
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] *= factor
    return d


@pytest.mark.parametrize("path, says", [
    (("pipeline", "stages", 1, "tpot_s"), r"pipeline.stages\[1\].tpot_s"),
    (("pipeline", "stages", 0, "ttft_s"), r"pipeline.stages\[0\].ttft_s"),
    (("pipeline", "stages", 1, "plan", "predicted", "tpot_s"), r"pipeline.stages\[1\].plan: predicted.tpot_s"),
    (("pipeline", "links", 0, "decode_s"), r"pipeline.links\[0\].decode_s"),
    (("pipeline", "links", 0, "legs", 0, "bytes_per_s"), r"pipeline.links\[0\].prefill_s"),
    (("pipeline", "predicted", "tpot_s"), r"pipeline.predicted.tpot_s"),
    (("pipeline", "predicted", "pipelined_decode_tokens_per_s"), r"pipeline.predicted.pipelined_decode"),
])
def test_a_tampered_pipeline_is_caught(plan_dict, path, says):
    check_pipeline(load(plan_dict))  # the plan as compiled replays
    with pytest.raises(PlanInvalid, match=says):
        check_pipeline(load(tampered(plan_dict, path, 1.01)))


def test_stages_that_do_not_cut_the_model_in_order_are_caught(plan_dict):
    d = copy.deepcopy(plan_dict)
    d["pipeline"]["stages"][1]["layers"] = [2, 4]
    with pytest.raises(PlanInvalid, match=r"stages\[1\].layers"):
        check_pipeline(load(d))


def test_a_pipeline_through_the_host_restates_both_copies():
    # no peer link: d2h then h2d, each bytes / (16 GB/s x 0.9) + 10 us
    plan, _ = compile_pipeline(tiny_spec(n_layers=4), two_gpus(3 / 1024, link=None), CompileRequest(**REQ))
    replay = check_pipeline(Plan.from_json(plan.to_json()))
    assert replay.links[0]["decode"] == pytest.approx(2 * (256 * 2 / (16e9 * 0.9) + 10e-6), rel=1e-9)
    assert [leg["via"] for leg in plan.pipeline["links"][0]["legs"]] == ["d2h", "h2d"]


def test_a_plan_with_replicas_replays_their_rates():
    from tests.multi_gpu.test_replicas import gpus

    hw = gpus(1, 1, 1, 1)
    req = CompileRequest(**dict(REQ, objective="throughput", batch=1))
    plan, _ = compile_pipeline(tiny_spec(n_layers=4), hw, req)
    assert plan.pipeline["replicas"] == 4
    replay = check_pipeline(Plan.from_json(plan.to_json()))
    assert replay.predicted["decode_tokens_per_s"] == pytest.approx(4 / stage_plan(plan, 0).predicted["tpot_s"],
                                                                      rel=1e-9)


def test_check_fails_a_hand_edited_pipeline_plan_before_recompiling_it(tmp_path):
    from pathlib import Path

    from hetplan.plan.check import check_plan

    golden = Path(__file__).resolve().parents[2] / "plans" / "llama-3.1-70b--2x3090-128g.json"
    d = tampered(json.loads(golden.read_text()), ("pipeline", "links", 0, "decode_s"), 1.5)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    (failure,) = check_plan(path).failures
    assert failure.startswith("the pipeline does not replay as recorded: pipeline.links[0].decode_s")
