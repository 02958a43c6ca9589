"""Chunked prefill of mixture-of-experts and latent-attention models matches transformers.

Tiny random Mixtral, Qwen3-MoE and DeepSeek-V3 models (fp32) planned all on the (emulated) GPU
and with the ILP on a small GPU (routed experts in DRAM), prefilled in chunks of 5 (the last
chunk shorter) and of 8 tokens of a 24-token prompt: the prefill logits at every position match
transformers' within 1e-4 and the 32 greedy tokens are transformers' `generate`'s.
"""

from __future__ import annotations

import pytest
import torch

from hetplan.compiler import CompileRequest, compile_plan
from tests.moe.test_whole_blocks import FAMILIES, GEN_LEN, VOCAB, _check, _reference, _run
from tests.tiny_models import TINY_GPU_NODE, saved_moe_model

PROMPT = 24


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    path = tmp_path_factory.mktemp("node") / "node.yaml"
    path.write_text(TINY_GPU_NODE)
    return str(path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    model, directory = saved_moe_model(FAMILIES, request.param, tmp_path_factory)
    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(11))
    return request.param, str(directory), ids, _reference(model, ids)


@pytest.mark.parametrize("strategy,gpu_mem", [("all-gpu", None), ("ilp", "200KiB")])
@pytest.mark.parametrize("chunk", (5, 8))
def test_chunked_moe_prefill_matches_transformers(family_model, node, strategy, gpu_mem, chunk):
    _, model_dir, ids, ref = family_model
    plan, _ = compile_plan(CompileRequest(model=model_dir, hw=node, strategy=strategy, weight_dtype="fp32",
                                          gpu_mem=gpu_mem, prompt_len=PROMPT, gen_len=GEN_LEN, prefill_chunk=chunk))
    assert plan.workload.n_chunks == -(-PROMPT // chunk)
    _check(_run(plan, model_dir, ids), ref)
