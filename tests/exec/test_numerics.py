"""`hetplan exec` computes what transformers computes, under every kind of plan.

For a tiny random model of each dense family (fp32, saved with `save_pretrained`), the prefill
logits at every prompt position and the logits of 31 decode steps match transformers' model
with the same weights (max abs diff <= 1e-4), and greedy decoding yields the same 32 tokens,
under plans of every strategy: all on the (emulated) GPU, llama.cpp-style `ngl`, FlexGen-style
streaming, the ILP's mixed plans, a hand-made plan with CPU-side KV caches and per-phase
execution modes, and a machine without a GPU. On a machine with CUDA the same runs use it.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.evaluate import make_plan
from hetplan.hardware import load_node
from hetplan.frontends.resolve import load_model
from hetplan.plan import Decision
from hetplan.problem import build_problem
from hetplan.runtime.session import RunOptions, run_plan
from hetplan.workload import Workload
from tests.tiny_models import TINY_GPU_NODE, greedy_reference

PROMPT_LEN, GEN_LEN, TOL = 8, 32, 1e-4
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "opt", "gpt2")

GPU_NODE = TINY_GPU_NODE.replace("mem_bandwidth: 0.2GB/s", "mem_bandwidth: 20GB/s")
"""The tiny node with a DRAM fast enough to feed its link: streaming out of DRAM (which shares
the DRAM bus with the CPU, ``hetplan.buses``) then pays beside the slow CPU, so the ILP's plans
mix streaming, CPU compute and KV in DRAM."""
CPU_NODE = """
name: tiny-cpu-node
cpu: {name: cpu, cores: 2, memory: 4GiB, mem_bandwidth: 10GB/s, flops: {fp32: 100GFLOPS}}
reserve: {cpu: 1KiB}
"""


def tiny_config(family: str):
    """hidden 64, 2 layers, 4 heads (2 KV heads where the family has GQA), vocab 128; weights
    drawn wide (std 0.2) so that greedy choices are far from ties."""
    common = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
    if family in ("llama", "mistral", "qwen2", "qwen3"):
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
        extra = {"head_dim": 16} if family == "qwen3" else {}
        if family == "llama":  # llama 3.1-style rope scaling
            extra["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        return cls(hidden_size=64, intermediate_size=96, num_key_value_heads=2, initializer_range=0.2,
                   **common, **extra)
    if family == "opt":
        return transformers.OPTConfig(hidden_size=64, ffn_dim=96, word_embed_proj_dim=64, init_std=0.2,
                                      bos_token_id=0, eos_token_id=1, pad_token_id=1, **common)
    return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=128,
                                   initializer_range=0.2, bos_token_id=0, eos_token_id=1)


def save_tiny_model(family: str, directory) -> transformers.PreTrainedModel:
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def reference(model, ids: torch.Tensor) -> dict:
    """transformers' prefill logits [B, P, V], per-step generate logits and greedy tokens."""
    return greedy_reference(model, ids, GEN_LEN)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    d = tmp_path_factory.mktemp("nodes")
    (d / "gpu.yaml").write_text(GPU_NODE)
    (d / "cpu.yaml").write_text(CPU_NODE)
    return {"gpu": str(d / "gpu.yaml"), "cpu": str(d / "cpu.yaml")}


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(request.param, directory)
    ids = torch.randint(0, 128, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    return request.param, str(directory), ids, reference(model, ids)


def cpu_kv_plan(model_dir: str, node: str, prompt_len: int = PROMPT_LEN, prefill_chunk: int | None = None):
    """A hand-made decision exercising what strategies rarely combine: attention resident on the
    GPU with its KV cache in DRAM (decode attention on the CPU; prefill KV copied down), a block
    streamed in prefill but computed on the CPU in decode, a streamed block with CPU-side KV,
    and a two-slot staging ring."""
    spec = load_model(model_dir, "fp32")
    problem = build_problem(spec, load_node(node), Workload(1, prompt_len, GEN_LEN, prefill_chunk=prefill_chunk))
    weights = {"embed": "cpu", "attn_0": "gpu", "mlp_0": "stream", "attn_1": "stream", "mlp_1": "cpu",
               "head": "stream"}
    exec_ = {"prefill": dict(weights), "decode": dict(weights, mlp_0="cpu")}
    dec = Decision(weights=weights, exec=exec_, kv={"attn_0": "cpu", "attn_1": "cpu"}, depth=2)
    return make_plan(problem, dec, {"strategy": "hand", "status": "heuristic", "mip_gap": None, "options": {}})


STRATEGIES = {
    # name: (strategy, what the plan must contain)
    "all-gpu": ("all-gpu", {"gpu"}),
    "ngl": ("ngl:1", {"gpu", "cpu"}),
    "stream": ("stream", {"stream"}),
    "ilp-stream-cpu-kv": ("ilp", {"stream", "cpu", "kv:cpu"}),
    "ilp-mixed": ("ilp", {"gpu", "stream", "cpu"}),
}
ILP_BUDGETS_KIB = (60, 80, 100, 120, 150, 200, 250, 300)
"""GPU budgets tried, smallest first, until the ILP's plan holds the mixture a case needs."""


def compiled(name: str, model_dir: str, nodes: dict):
    if name == "cpu-kv":
        return cpu_kv_plan(model_dir, nodes["gpu"])
    if name == "cpu-node":
        req = CompileRequest(model=model_dir, hw=nodes["cpu"], strategy="ilp", weight_dtype="fp32",
                             prompt_len=PROMPT_LEN, gen_len=GEN_LEN)
        return compile_plan(req)[0]
    strategy, needs = STRATEGIES[name]
    for kib in ILP_BUDGETS_KIB if strategy == "ilp" else (None,):
        req = CompileRequest(model=model_dir, hw=nodes["gpu"], strategy=strategy, weight_dtype="fp32",
                             gpu_mem=f"{kib}KiB" if kib else None, prompt_len=PROMPT_LEN, gen_len=GEN_LEN)
        plan = compile_plan(req)[0]
        if needs <= contents(plan):
            return plan
    raise AssertionError(f"no {strategy} plan holds {needs}; the last one held {contents(plan)}")


def contents(plan) -> set:
    """What a plan places: execution modes of its blocks and the tiers of its KV caches."""
    out = {p["exec"][ph] for p in plan.placement for ph in ("prefill", "decode")}
    return out | {f"kv:{p['kv']}" for p in plan.placement if p["kv"]}


MODES = ["emulated", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a CUDA device"))]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plan_name", [*STRATEGIES, "cpu-kv", "cpu-node"])
def test_logits_and_greedy_tokens_match_transformers(family_model, nodes, plan_name, mode):
    family, model_dir, ids, ref = family_model
    plan = compiled(plan_name, model_dir, nodes)
    if plan_name == "cpu-node" and mode == "cuda":
        pytest.skip("a CPU-only plan never uses the GPU")
    result = run_plan(plan, RunOptions(weights=model_dir, prompt_ids=(tuple(ids[0].tolist()),), gen_len=GEN_LEN,
                                       all_logits=True, keep_logits=True, emulate=mode == "emulated"))
    assert result.mode == ("cpu" if plan_name == "cpu-node" else mode)
    prefill = result.logits[0]
    assert prefill.shape == ref["prefill"].shape
    assert (prefill - ref["prefill"]).abs().max().item() <= TOL
    steps = torch.stack([result.logits[0][:, -1]] + result.logits[1:])
    assert steps.shape == ref["steps"].shape
    assert (steps - ref["steps"]).abs().max().item() <= TOL
    assert result.tokens == ref["tokens"]
