"""FlexGen's CPU decode attention copies the KV cache before it reads it, and its baseline plan
prices those copies (``Decision.cpu_attention_bytes_per_cache_byte``).

Worked out by hand from FlexLLMGen ``flex_opt.py`` (004ffef) with ``--cpu-cache-compute``:
``load_cache`` (path 1) copies the fp16 cache into an fp32 workspace (read 2 bytes, write 4 per
element); ``mha_gen`` permutes K and V and reshapes them into contiguous tensors (read 4, write
4); ``bmm`` reads those (4). Per element 2 + 16 = 18 bytes move where reading in place moves 2:
9 bytes per byte of cache (an fp32 cache: (4 + 16) / 4 = 5).

The tiny llama of ``tests/test_baselines.py`` (4 layers, 4 heads of 64, 2 KV heads, fp16 cache:
512 B per token and layer) with prompt 32 and 16 new tokens: a decode step attends over
32 + 17 / 2 = 40.5 cached tokens, so reads 40.5 x 512 = 20 736 B of cache per layer, and
FlexGen's moves 9 x 20 736 = 186 624 B. On the tiny CPU (50 GB/s, cpu_mem 0.7; 1 TFLOPS,
cpu_flops 0.5; 20 us per task) its 4 x 4 x 64 x 40.5 = 41 472 FLOPs take 0.083 us and the bytes
186 624 / 35e9 = 5.332 us: the task takes 5.332 + 20 = 25.332 us.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from hetplan.errors import HetplanError
from hetplan.plan import Plan
from hetplan.plan.simulate import simulate
from hetplan.schedule import build_schedule
from hetplan.solvers import baselines
from tests.test_baselines import KV_PER_TOKEN, MLP, plan_of, problem

CACHE_READ_BYTES = 40.5 * KV_PER_TOKEN                 # one layer's decode step, read in place
FLEXGEN_BYTES = 9 * CACHE_READ_BYTES                   # 186 624
FLEXGEN_SECONDS = FLEXGEN_BYTES / (50e9 * 0.7) + 20e-6


def kv_in_dram():
    """The tiny llama, prompt 32, 16 new tokens, on a GPU one byte short of the caches."""
    kv = 4 * 48 * KV_PER_TOKEN
    ws = problem(prompt_len=32).gpu_workspace_bytes
    return problem(prompt_len=32, gpu_bytes=ws + 2 * MLP + kv - 1)


def cpu_cores(sched) -> list:
    return [t for t in sched["decode"].tasks if t.kind == "attn_core" and t.resource == "cpu"]


def test_flexgens_factor_is_c_plus_16_over_c():
    p = kv_in_dram()
    assert baselines.flexgen_attention_bytes_per_cache_byte(p.model) == 9.0
    assert baselines.flexgen_attention_bytes_per_cache_byte(dataclasses.replace(p.model, kv_dtype="fp32")) == 5.0
    dec = baselines.flexgen(p, 0)
    assert set(dec.kv.values()) == {"cpu"}
    assert dec.cpu_attention_bytes_per_cache_byte == 9.0


def test_the_cpu_attention_task_moves_nine_times_the_cache_and_takes_the_time_of_those_bytes():
    p = kv_in_dram()
    dec = baselines.flexgen(p, 0)
    cores = cpu_cores(build_schedule(p, dec))
    assert len(cores) == 4
    for t in cores:
        assert t.bytes == pytest.approx(FLEXGEN_BYTES, rel=1e-12)
        assert t.duration_s == pytest.approx(FLEXGEN_SECONDS, rel=1e-12)
        assert t.flops == pytest.approx(4 * 4 * 64 * 40.5, rel=1e-12)
    in_place = build_schedule(p, dataclasses.replace(dec, cpu_attention_bytes_per_cache_byte=1.0))
    for t in cpu_cores(in_place):
        assert t.bytes == pytest.approx(CACHE_READ_BYTES, rel=1e-12)
    # only the cache read is scaled: the q, k, v and output copies around it are not
    moved = {t.id: t.bytes for t in build_schedule(p, dec)["decode"].tasks if t.kind != "attn_core"}
    assert moved == {t.id: t.bytes for t in in_place["decode"].tasks if t.kind != "attn_core"}
    # prefill attention runs on the GPU and reads no cache: unchanged
    assert ([(t.id, t.bytes, t.duration_s) for t in build_schedule(p, dec)["prefill"].tasks]
            == [(t.id, t.bytes, t.duration_s) for t in in_place["prefill"].tasks])


def test_the_factor_round_trips_through_plan_json_and_the_strict_schema():
    p = kv_in_dram()
    plan = plan_of(p, baselines.flexgen(p, 0), "flexgen")
    d = json.loads(plan.to_json())
    assert d["cpu_attention_bytes_per_cache_byte"] == 9.0
    back = Plan.from_json(plan.to_json())
    assert back.decision().cpu_attention_bytes_per_cache_byte == 9.0
    assert [t.bytes for t in cpu_cores(build_schedule(p, back.decision()))] == pytest.approx([FLEXGEN_BYTES] * 4)
    for bad in (0.5, 65.0, "nine", None):
        with pytest.raises(HetplanError, match="cpu_attention_bytes_per_cache_byte"):
            Plan.from_dict({**d, "cpu_attention_bytes_per_cache_byte": bad}, verify=False)


def test_show_says_the_plan_prices_a_copying_cpu_attention():
    from hetplan.plan.report import render_show
    p = kv_in_dram()
    assert "cpu attention: moves 9 bytes per byte of KV cache" in render_show(plan_of(p, baselines.flexgen(p, 0)))
    assert "cpu attention:" not in render_show(plan_of(p, baselines.ngl_nkvo(p)))


def test_plans_that_read_the_cache_in_place_do_not_carry_the_key():
    p = kv_in_dram()
    for name, dec in (("ngl-nkvo", baselines.ngl_nkvo(p)), ("all-gpu", baselines.all_gpu(p)),
                      ("stream", baselines.stream(p))):
        assert "cpu_attention_bytes_per_cache_byte" not in json.loads(plan_of(p, dec, name).to_json()), name
    roomy = problem(prompt_len=32)
    dec = baselines.flexgen(roomy, 0)
    assert set(dec.kv.values()) == {"gpu"} and dec.cpu_attention_bytes_per_cache_byte == 1.0
    assert "cpu_attention_bytes_per_cache_byte" not in json.loads(plan_of(roomy, dec, "flexgen").to_json())


def test_the_simulator_replays_the_plan_to_its_predictions():
    p = kv_in_dram()
    plan = Plan.from_json(plan_of(p, baselines.flexgen(p, 0), "flexgen").to_json())
    sim = simulate(plan)
    assert sim.makespan_s["prefill"] == pytest.approx(plan.predicted["ttft_s"], rel=1e-6)
    assert sim.makespan_s["decode"] == pytest.approx(plan.predicted["tpot_s"], rel=1e-6)
