"""A pipeline stage holds one KV cache per micro-batch in flight: the throughput objective keeps
one micro-batch per stage in flight, a latency one a single micro-batch; each stage's plan is
sized for that many (``pipeline.micro_batches``) and the replay refuses a plan that is not.
Bytes derived by hand: layers x 2 (k and v) x kv_heads x head_dim x context x batch x bytes x M."""

import copy
import dataclasses
import json

import pytest

from hetplan.pipeline import PipelinePlan, StagePlan, plan_pipeline, stage_problem
from hetplan.plan import Plan
from hetplan.plan.simulate import PlanInvalid
from hetplan.plan.simulate_pipeline import check_pipeline
from tests.multi_gpu.test_pipeline import SOLVE, WL, two_gpus
from tests.conftest import tiny_spec

SPEC = tiny_spec(n_layers=4)   # 2 KV heads of head_dim 64, fp16 KV
HW = two_gpus(3 / 1024)        # ~3 MiB GPUs: neither holds the four layers
THROUGHPUT = dataclasses.replace(WL, objective="throughput")


def kv_bytes(layers: int, micro_batches: int, wl=WL) -> int:
    """layers x 2 (k, v) x 2 kv_heads x 64 head_dim x (prompt 64 + gen 16) x batch x 2 bytes x M."""
    return layers * 2 * 2 * 64 * (wl.prompt_len + wl.gen_len) * wl.batch * 2 * micro_batches


def stage_kv(stage: StagePlan) -> float:
    """KV bytes the stage's plan holds, in both tiers (its memory breakdown)."""
    b = stage.plan.memory["breakdown"]
    return b["gpu"]["kv"] + b["cpu"]["kv"]


def as_plan(pp: PipelinePlan) -> Plan:
    """``pp`` as plan.json holds it (the first stage's plan with the pipeline), read back."""
    return Plan.from_json(dataclasses.replace(pp.stages[0].plan, pipeline=pp.to_dict()).to_json())


@pytest.mark.parametrize("wl, objective, per_stage", [(THROUGHPUT, "max", True), (WL, "sum", False)])
def test_each_stage_holds_a_kv_cache_per_micro_batch_in_flight(wl, objective, per_stage):
    pp = plan_pipeline(SPEC, HW, wl, SOLVE, objective)
    assert len(pp.stages) == 2
    m = 2 if per_stage else 1
    assert pp.micro_batches == m and pp.to_dict()["micro_batches"] == m
    for s in pp.stages:
        assert stage_kv(s) == pytest.approx(kv_bytes(s.end_layer - s.first_layer, m), rel=1e-12)
        for p in s.plan.placement:
            if p["kv"] is not None:
                assert p["kv_bytes"] == pytest.approx(kv_bytes(1, m), rel=1e-12)
    check_pipeline(as_plan(pp))   # the replay restates the same bytes


def test_a_stage_sized_for_fewer_micro_batches_than_the_plan_keeps_in_flight_does_not_replay():
    """Two stages solved with one KV cache each, recorded as a throughput pipeline (two
    micro-batches in flight): what plans were before the count was planned."""
    pp = plan_pipeline(SPEC, HW, THROUGHPUT, SOLVE, "max")
    one = tuple(dataclasses.replace(s, plan=SOLVE(stage_problem(SPEC, HW, THROUGHPUT, s.gpu, s.first_layer,
                                                                s.end_layer)))
                for s in pp.stages)
    assert stage_kv(one[0]) == pytest.approx(kv_bytes(one[0].end_layer - one[0].first_layer, 1), rel=1e-12)
    undersized = dataclasses.replace(pp, stages=one)
    with pytest.raises(PlanInvalid, match=r"pipeline.stages\[0\].plan: block attn_0's kv_bytes = .*, but 2 "
                                          r"micro-batch\(es\) x batch 1 x 80 tokens x 512 bytes"):
        check_pipeline(as_plan(undersized))


def test_a_micro_batch_count_other_than_the_objectives_does_not_replay():
    d = json.loads(as_plan(plan_pipeline(SPEC, HW, THROUGHPUT, SOLVE, "max")).to_json())
    d = copy.deepcopy(d)
    d["pipeline"]["micro_batches"] = 3
    with pytest.raises(PlanInvalid, match=r"pipeline.micro_batches = 3, but a pipeline with objective 'max' over "
                                          r"2 stage\(s\) keeps 2 in flight"):
        check_pipeline(Plan.from_dict(d, verify=False))


def test_a_single_device_holding_the_model_keeps_one_micro_batch():
    """On two 1 GiB GPUs the throughput objective may run one stage: it then holds one cache."""
    pp = plan_pipeline(SPEC, two_gpus(1), THROUGHPUT, SOLVE, "max")
    assert pp.micro_batches == len(pp.stages)
    for s in pp.stages:
        assert stage_kv(s) == pytest.approx(kv_bytes(s.end_layer - s.first_layer, len(pp.stages)), rel=1e-12)
