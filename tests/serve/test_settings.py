"""The engine's sizes derived from a plan, flags over them, and the metrics' histograms."""

from __future__ import annotations

import pytest

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import HetplanError
from hetplan.runtime.serve.metrics import Histogram
from hetplan.runtime.serve.settings import block_bytes, settings_for
from tests.exec.test_numerics import save_tiny_model
from tests.serve.fixtures import CONTEXT, tiny_llama
from tests.tiny_models import TINY_GPU_NODE


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    return tiny_llama(tmp_path_factory)[2]


def test_defaults_hold_the_tokens_the_plan_budgeted_for_its_caches(plan):
    """Batch 1 x context 96 tokens cached by the plan = 96 / 16 = 6 blocks of 16 tokens in the
    GPU tier, as many in DRAM; a batch of at most 6 (one block each); the plan's context."""
    assert plan.workload.batch == 1 and plan.workload.context_len == CONTEXT == 96
    s = settings_for(plan)
    assert (s.block_tokens, s.gpu_blocks, s.cpu_blocks, s.max_batch, s.max_context) == (16, 6, 6, 6, 96)
    assert s.step_tokens == s.prefill_chunk + 6
    s8 = settings_for(plan, block_tokens=8)
    assert s8.gpu_blocks == 12 and s8.max_batch == 12


def test_flags_override_the_plan_and_are_checked_by_name(plan):
    s = settings_for(plan, gpu_blocks=100, max_batch=3, cpu_blocks=0, max_waiting=7, prefill_chunk=5)
    assert (s.gpu_blocks, s.max_batch, s.cpu_blocks, s.max_waiting, s.step_tokens) == (100, 3, 0, 7, 8)
    with pytest.raises(HetplanError, match="--max-waiting 0: must be at least 1"):
        settings_for(plan, max_waiting=0)
    with pytest.raises(HetplanError, match="--max-context 5000: model .* has 128 positions"):
        settings_for(plan, max_context=5000)


def test_a_quantised_kv_plan_holds_the_tokens_it_budgeted_in_blocks_of_stored_bytes(tmp_path_factory):
    """q8_0 keys and values: a row of 2 x 16 values is 2 scale bytes + 32 = 34 bytes, so the plan's
    96 tokens x 2 layers x (34 + 34) bytes make 6 blocks of 16 x 2 x 68 bytes, as in fp32."""
    d = tmp_path_factory.mktemp("kv-q8")
    save_tiny_model("llama", d)
    (d / "node.yaml").write_text(TINY_GPU_NODE)
    q8 = compile_plan(CompileRequest(model=str(d), hw=str(d / "node.yaml"), strategy="all-gpu", weight_dtype="fp32",
                                     kv_dtype="q8_0", prompt_len=CONTEXT // 2, gen_len=CONTEXT // 2))[0]
    assert sum(p["kv_bytes"] for p in q8.placement if p.get("kv")) == CONTEXT * 2 * 68
    assert block_bytes(q8.model, 16) == 16 * 2 * 68
    assert settings_for(q8).gpu_blocks == 6


def test_histogram_buckets_are_cumulative_with_sum_and_count():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.lines("x") == ["# TYPE x histogram", 'x_bucket{le="0.1"} 2', 'x_bucket{le="1.0"} 3',
                            'x_bucket{le="+Inf"} 4', "x_sum 3.65", "x_count 4"]
