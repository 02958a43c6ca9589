"""Stage processes on real GPUs (skipped without CUDA): a CUDA stage beside a CPU-only stage
(gloo, messages through host memory), with one micro-batch and with two, two CUDA stages
(NCCL), and a stage on a GPU this machine does not have, refused before any process starts."""

from __future__ import annotations

import pytest
import torch

from hetplan.errors import HetplanError
from hetplan.runtime.distributed.launch import message_backend, run_pipeline
from hetplan.runtime.session import RunOptions
from hetplan.workload import Workload
from tests.distributed.pipelines import NODE, pipeline_plan

PROMPT_LEN, GEN_LEN, TOL = 8, 12, 1e-4
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WL = Workload(1, PROMPT_LEN, GEN_LEN, prefill_chunk=PROMPT_LEN)


@pytest.fixture(scope="module")
def llama(llama_files, tmp_path_factory):
    model_dir, _, model = llama_files
    node = tmp_path_factory.mktemp("cuda-node") / "node.yaml"
    node.write_text(NODE.replace("64MiB", "1GiB"))   # room for the CUDA context's own allocations
    ids = torch.randint(0, 128, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=GEN_LEN, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    return model_dir, node, ids, torch.stack(out.logits), out.sequences[:, PROMPT_LEN:].tolist()


def greedy(model, ids: torch.Tensor) -> tuple:
    """transformers' decode logits [G, B, V] and greedy tokens for ``ids`` alone."""
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=GEN_LEN, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    return torch.stack(out.logits), out.sequences[:, PROMPT_LEN:].tolist()


def run(plan, model_dir, ids):
    opts = RunOptions(weights=str(model_dir), prompt_ids=tuple(ids.tolist()), keep_logits=True)
    return run_pipeline(plan, opts, timeout_s=120)


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_a_cuda_stage_and_a_cpu_stage_match_transformers_over_gloo_cuda(llama, tmp_path):
    model_dir, node, ids, steps, tokens = llama
    plan = pipeline_plan(model_dir, node, [0, 2, 4], ["all-gpu", "ngl:0"], WL, tmp_path / "plan.json")
    assert message_backend(plan, None) == "gloo"
    result = run(plan, model_dir, ids)
    assert result.modes == ["cuda", "cpu"]
    assert result.tokens == tokens
    assert (torch.stack(result.logits) - steps).abs().max() <= TOL * steps.abs().max()


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_two_micro_batches_through_a_cuda_stage_and_a_cpu_stage_match_transformers_cuda(llama, llama_files,
                                                                                        tmp_path, capfd):
    model_dir, node, ids, steps, tokens = llama
    other = torch.randint(0, 128, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(8))
    other_steps, other_tokens = greedy(llama_files[2], other)
    plan = pipeline_plan(model_dir, node, [0, 2, 4], ["all-gpu", "ngl:0"], WL, tmp_path / "plan.json")
    opts = RunOptions(weights=str(model_dir), prompt_ids=(tuple(ids[0].tolist()), tuple(other[0].tolist())),
                      keep_logits=True)
    result = run_pipeline(plan, opts, timeout_s=120, micro_batches=2)
    assert result.micro_batches == 2 and result.modes == ["cuda", "cpu"]
    assert result.tokens == tokens + other_tokens
    got = torch.stack(result.logits)                       # [G, 2, V]: micro-batch 0, then 1
    for i, want in enumerate((steps, other_steps)):
        assert (got[:, i:i + 1] - want).abs().max() <= TOL * want.abs().max()
    # the plan's GPU is named "g": the CUDA stage runs, and says this GPU is another
    assert "hetplan: warning: stage 0: the plan was made for" in capfd.readouterr().err


@pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")
def test_two_cuda_stages_match_transformers_over_nccl_cuda(llama, tmp_path):
    model_dir, node, ids, steps, tokens = llama
    plan = pipeline_plan(model_dir, node, [0, 2, 4], ["all-gpu", "stream"], WL, tmp_path / "plan.json")
    assert message_backend(plan, None) == "nccl"
    result = run(plan, model_dir, ids)
    assert result.modes == ["cuda", "cuda"]
    assert result.tokens == tokens
    assert (torch.stack(result.logits) - steps).abs().max() <= TOL * steps.abs().max()


@pytest.mark.skipif(not 1 <= GPUS < 4, reason="needs a machine with one to three CUDA GPUs")
def test_a_stage_on_a_gpu_this_machine_lacks_is_refused_before_any_process_starts_cuda(llama, tmp_path):
    model_dir, node, ids, _, _ = llama
    plan = pipeline_plan(model_dir, node, [0, 1, 2, 3, 4], ["all-gpu"] * 4, WL, tmp_path / "plan.json")
    with pytest.raises(HetplanError, match=rf"stage {GPUS}: the plan runs it on GPU {GPUS}, but this machine has "
                                           rf"{GPUS} CUDA device"):
        run(plan, model_dir, ids)
