"""``hetplan serve`` on a plan with quantised weights from a safetensors checkpoint (quantised at
load, as ``hetplan exec`` does): each request's greedy output, batched and preempted, equals
exec's for its prompt alone."""

from __future__ import annotations

import pytest

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.runtime.serve.sampling import SamplingParams
from hetplan.runtime.session import RunOptions, run_plan
from tests.exec.test_numerics import save_tiny_model
from tests.serve.fixtures import engine_for, random_prompt
from tests.tiny_models import TINY_GPU_NODE


@pytest.mark.parametrize("dtype", ["q8_0", "int8"])
def test_quantised_checkpoint_requests_match_hetplan_exec_alone(tmp_path, dtype):
    save_tiny_model("llama", tmp_path / "ckpt")
    node = tmp_path / "node.yaml"
    node.write_text(TINY_GPU_NODE)
    plan = compile_plan(CompileRequest(model=str(tmp_path / "ckpt"), hw=str(node), strategy="all-gpu",
                                       weight_dtype=dtype, kv_dtype="fp32", prompt_len=24, gen_len=24))[0]
    engine = engine_for(plan, str(tmp_path / "ckpt"), gpu_blocks=8, cpu_blocks=32, block_tokens=4)
    prompts = [random_prompt(40 + i, n) for i, n in enumerate((6, 13, 3))]
    reqs = [engine.submit(p, SamplingParams(max_tokens=12, temperature=0.0)) for p in prompts]
    engine.run_until_idle()
    assert engine.scheduler.swaps_out + engine.scheduler.recomputes > 0
    for p, r in zip(prompts, reqs):
        alone = run_plan(plan, RunOptions(weights=str(tmp_path / "ckpt"), prompt_ids=(tuple(p),), gen_len=12,
                                          emulate=True, warmup=False))
        assert r.generated == alone.tokens[0]
