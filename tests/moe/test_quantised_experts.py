"""Quantised plans dequantise into the buffer the planner reserves, MoE plans included.

The runtime's dequantisation buffer per tier holds at most ``dequant_buffer_elems(spec)``
elements (the widest block, an MoE layer's routed experts counted as one) for dense, MoE and
latent-attention models under resident, CPU, streamed and split placements; the emulated GPU
charges it at bf16 size against the plan's own budget. Quantised Mixtral and DeepSeek-V3 plans
(q8_0, q4_0), whose experts take turns in one region of that buffer, compute what transformers
computes with the dequantised weights (logits within 1e-4, the same greedy tokens), and the
emulated GPU holds no more than the plan plus emulation's fp32 activations and fp32 norms.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import safetensors.torch
import torch
import transformers
from tests.moe.test_whole_blocks import FAMILIES
from tests.exec.test_numerics import tiny_config
from tests.exec.test_quant import activation_allowance
from tests.tiny_models import TINY_GPU_NODE, saved_moe_model

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.evaluate import make_plan
from hetplan.graph import dequant_buffer_elems
from hetplan.hardware import load_node
from hetplan.frontends.resolve import load_model
from hetplan.problem import build_problem
from hetplan.runtime import kv_cache
from hetplan.runtime.kernels import quant
from hetplan.runtime.backend import backend_for
from hetplan.runtime.devices import Devices
from hetplan.runtime.residency import Residency
from hetplan.runtime.session import RunOptions, run_plan
from hetplan.runtime.weights import RandomWeights
from hetplan.solvers import baselines
from hetplan.workload import Workload

PROMPT_LEN, GEN_LEN, TOL = 8, 8, 1e-4
PROMPT_SEED = 3
CONFIGS = ("llama", "gpt2", "mixtral", "qwen3_moe", "deepseek_v3")
"""Dense (GQA; GPT-2's Conv1D), MoE, and MoE with latent attention."""
PLACEMENTS = ("all-gpu", "ngl:1", "stream", "split")


def _config(family: str):
    if family in FAMILIES:
        config_cls, _, kw = FAMILIES[family]
        return getattr(transformers, config_cls)(**kw)
    return tiny_config(family)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    path = tmp_path_factory.mktemp("node") / "node.yaml"
    path.write_text(TINY_GPU_NODE)
    return str(path)


@pytest.fixture(scope="module")
def config_dirs(tmp_path_factory):
    """family -> a directory holding only its config.json (weights are ``RandomWeights``)."""
    out = {}
    for family in CONFIGS:
        out[family] = tmp_path_factory.mktemp(f"{family}_config")
        _config(family).save_pretrained(out[family])
    return out


def _plan(model_dir, node: str, placement: str, fmt: str):
    if placement != "split":
        req = CompileRequest(model=str(model_dir), hw=node, strategy=placement, weight_dtype=fmt, kv_dtype="fp32",
                             prompt_len=PROMPT_LEN, gen_len=GEN_LEN)
        return compile_plan(req)[0]
    spec = load_model(str(model_dir), fmt, "fp32")   # resident, half of every MoE block's experts in DRAM
    problem = build_problem(spec, load_node(node), Workload(1, PROMPT_LEN, GEN_LEN))
    dec = baselines.all_gpu(problem)
    dec = dataclasses.replace(dec, experts={b.name: spec.n_experts // 2 for b in problem.blocks if b.kind == "moe"})
    return make_plan(problem, dec, {"strategy": "test"})


def _residency(plan, devices: Devices) -> Residency:
    return Residency(plan, backend_for(plan.model), RandomWeights(0), devices, torch.float32, torch.float32,
                     batch=1, max_tokens=PROMPT_LEN + GEN_LEN)


@pytest.mark.parametrize("family,placement", [(f, p) for f in CONFIGS for p in PLACEMENTS
                                              if p != "split" or f in FAMILIES])  # only MoE blocks split
def test_dequantisation_buffer_is_at_most_what_the_plan_reserves(config_dirs, node, family, placement):
    plan = _plan(config_dirs[family], node, placement, "q8_0")
    residency = _residency(plan, Devices("emulated", plan.memory["gpu_budget_bytes"]))
    assert residency.buffers, "a quantised plan dequantises somewhere"
    for tier, buffer in residency.buffers.items():
        assert buffer.numel() <= dequant_buffer_elems(plan.model), tier


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_emulated_gpu_charges_the_buffer_at_bf16_size_within_the_plans_budget(config_dirs, node, family):
    plan = _plan(config_dirs[family], node, "stream", "q4_0")
    devices = Devices("emulated", plan.memory["gpu_budget_bytes"])
    residency = _residency(plan, devices)
    gpu = devices.ledgers["gpu"]
    assert gpu.budget_bytes == plan.memory["gpu_budget_bytes"]
    placed = (sum(b.flat.numel() for b in residency.blocks.values() if b.tier == "gpu")
              + sum(s.numel() for s in residency.slots)
              + sum(kv_cache.nbytes(v) for block, values in residency.kv.items() for v in values.values()
                    if residency.kv_tier[block] == "gpu"))
    assert residency.buffers["gpu"].dtype == torch.float32                  # emulation computes in fp32 ...
    assert gpu.used_bytes == placed + 2 * residency.buffers["gpu"].numel()  # ... charged as bf16


# -- quantised MoE plans against transformers --------------------------------------------------------
def dequantised_checkpoint(src, dst, spec, blocks, fmt: str) -> None:
    """Copy the checkpoint in ``src`` to ``dst`` holding what the runtime computes with: each
    linear quantised and dequantised, embedding tables rounded to fp16, the rest untouched."""
    backend = backend_for(spec)
    local = {t.checkpoint: t.local for name, kind, layer in blocks for t in backend.block_tensors(name, kind, layer)}
    tensors = safetensors.torch.load_file(src / "model.safetensors")
    for name, w in tensors.items():
        if local.get(name) in quant.EMBEDDINGS:
            tensors[name] = w.half().float()
        elif name in local and quant.quantises(local[name], w.shape):
            tensors[name] = quant.dequantise(fmt, quant.quantise(fmt, w), w.shape, torch.empty(w.shape))
    dst.mkdir()
    safetensors.torch.save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")


@pytest.fixture(scope="module", params=["mixtral", "deepseek_v3"])
def moe_model(request, tmp_path_factory):
    _, directory = saved_moe_model(FAMILIES, request.param, tmp_path_factory)
    return request.param, directory


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_quantised_moe_plan_matches_transformers_with_dequantised_weights_within_its_memory(
        monkeypatch, moe_model, node, tmp_path, fmt):
    monkeypatch.setenv("HETPLAN_INT8_DECODE", "0")   # x in fp32: held to 1e-4 (int8 x: test_int8_kernels)
    monkeypatch.setenv("HETPLAN_INT8_PREFILL", "0")
    family, model_dir = moe_model
    plan = _plan(model_dir, node, "all-gpu", fmt)
    assert any(p["kind"] == "moe" and p["weights"] == "gpu" for p in plan.placement)
    ids = torch.randint(0, 128, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(PROMPT_SEED))
    result = run_plan(plan, RunOptions(weights=str(model_dir), prompt_ids=tuple(map(tuple, ids.tolist())),
                                       gen_len=GEN_LEN, keep_logits=True, emulate=True))
    blocks = [(p["block"], p["kind"], p["layer"]) for p in plan.placement]
    dequantised_checkpoint(model_dir, tmp_path / "dequantised", plan.model, blocks, fmt)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dequantised").eval()
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = None, 0
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=GEN_LEN, min_new_tokens=GEN_LEN, do_sample=False, output_logits=True,
                           return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    steps = torch.stack(out.logits)                                           # [G, B, V]
    top2 = steps.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3, "fixture too close to a greedy tie"
    assert (torch.stack(result.logits) - steps).abs().max().item() <= TOL
    assert result.tokens == out.sequences[:, PROMPT_LEN:].tolist()
    assert result.peak_bytes["gpu"] <= plan.memory["gpu_bytes"] + activation_allowance(plan)
