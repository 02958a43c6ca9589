"""``hetplan serve`` on a GGUF file: an unquantised (F32) llama file serves as a checkpoint does,
each request's greedy output equal to transformers' on the same file (its own GGUF loading), with
requests batched and swapped; a quantised one (Q8_0, Q4_0) as ``hetplan exec`` runs it alone."""

from __future__ import annotations

import pytest
import torch
import transformers

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.runtime.serve.sampling import SamplingParams
from tests.gguf.files import write_model
from tests.serve.fixtures import engine_for
from tests.tiny_models import TINY_GPU_NODE

QUANTISED = ("token_embd.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
             "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "output.weight")
"""The tensors ``write_model`` writes in Q8_0 unless told otherwise (norms are F32)."""


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-gguf")
    path = d / "m.gguf"
    write_model(path, "llama", {k: "F32" for k in QUANTISED}, seed=3)
    node = d / "node.yaml"
    node.write_text(TINY_GPU_NODE)
    req = CompileRequest(model=str(path), hw=str(node), strategy="all-gpu", prompt_len=16, gen_len=16, kv_dtype="fp32")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return path, compile_plan(req)[0], model, node


def greedy(model, prompt: list, n: int) -> list:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def test_requests_on_a_gguf_file_match_transformers_batched_and_swapped(gguf):
    path, plan, model, _ = gguf
    engine = engine_for(plan, str(path), gpu_blocks=6, cpu_blocks=32, block_tokens=4)
    prompts = [[5, 9, 17, 3], [40, 2, 8, 8, 1, 30, 7], [11] * 3]
    reqs = [engine.submit(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for p in prompts]
    engine.run_until_idle()
    assert engine.scheduler.swaps_out + engine.scheduler.recomputes > 0
    for p, r in zip(prompts, reqs):
        assert r.generated == greedy(model, p, 10)
    alloc = engine.pool.alloc
    assert alloc.free_blocks("gpu") == alloc.n_blocks["gpu"] and not alloc.tables


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_requests_on_a_quantised_gguf_file_match_hetplan_exec_alone(gguf, tmp_path, kind):
    """Quantised weights stay packed as ``hetplan exec`` holds them (its logits are tested against
    transformers in tests/gguf): each request's greedy output, batched and swapped, equals exec's
    for its prompt alone."""
    from hetplan.runtime.session import RunOptions, run_plan
    _, _, _, node = gguf
    path = tmp_path / "q.gguf"
    write_model(path, "llama", {k: kind for k in QUANTISED}, seed=3)
    plan = compile_plan(CompileRequest(model=str(path), hw=str(node), strategy="all-gpu", prompt_len=16,
                                       gen_len=16))[0]
    assert plan.model.weight_dtype == kind.lower()
    engine = engine_for(plan, str(path), gpu_blocks=6, cpu_blocks=32, block_tokens=4)
    prompts = [[5, 9, 17, 3], [40, 2, 8, 8, 1, 30, 7], [11] * 3]
    reqs = [engine.submit(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for p in prompts]
    engine.run_until_idle()
    assert engine.scheduler.swaps_out + engine.scheduler.recomputes > 0
    for p, r in zip(prompts, reqs):
        alone = run_plan(plan, RunOptions(weights=str(path), prompt_ids=(tuple(p),), gen_len=10, emulate=True,
                                          warmup=False))
        assert r.generated == alone.tokens[0]
