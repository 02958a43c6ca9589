"""`hetplan exec` runs mixture-of-experts and latent-attention plans as transformers computes them.

Tiny random Mixtral, Qwen3-MoE and DeepSeek-V3 models (fp32, saved with `save_pretrained`) are
planned under several strategies: everything on the (emulated) GPU, llama.cpp-style `ngl` (MoE
blocks of some layers on the GPU, of others on the CPU), FlexGen-style streaming (every
expert of a block loaded into the staging slot), the ILP on a small GPU (attention on the GPU,
routed experts in DRAM: whole MoE blocks on the CPU, or cold experts beside GPU-resident
blocks), and a hand-made plan whose KV (DeepSeek: latent) caches live in DRAM, so
decode attention runs on the CPU. Every run's prefill logits at each prompt position match
transformers' within 1e-4 and its 32 greedy tokens are transformers' `generate`'s. The routing
statistics a run records equal the choices of transformers' routers over the same tokens,
counted with forward hooks.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from hetplan.cli import main
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.evaluate import make_plan
from hetplan.hardware import load_node
from hetplan.frontends.resolve import load_model
from hetplan.plan import Decision
from hetplan.problem import build_problem
from hetplan.routing import load_routing
from hetplan.runtime.session import RunOptions, run_plan
from hetplan.workload import Workload
from tests.tiny_models import TINY_GPU_NODE
from tests.tiny_models import MOE_FAMILIES, saved_moe_model

PROMPT_LEN, GEN_LEN, TOL, VOCAB = 8, 32, 1e-4, 128
NODE = TINY_GPU_NODE
FAMILIES = {
    **MOE_FAMILIES,
    # One dense layer, then MoE layers with a shared expert; q compressed; grouped routing.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB, n_routed_experts=16,
        num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
}
STRATEGIES = {
    # name: (strategy, gpu_mem, {(block kind, tier), ...} the plan must contain)
    "all-gpu": ("all-gpu", None, {("moe", "gpu")}),
    "ngl": ("ngl:2", None, {("moe", "gpu"), ("moe", "cpu")}),  # the output layer and the last layer
    "stream": ("stream", None, {("moe", "stream")}),
    "ilp-small-gpu": ("ilp", "200KiB", {("moe", "experts in dram"), ("attn", "on the gpu")}),
}


def _reference(model, ids: torch.Tensor) -> dict:
    """transformers' prefill logits [B, P, V], 32 greedy tokens, and per MoE layer the number
    of tokens that chose each expert while generating them (router hooks)."""
    n_experts = model.config.num_local_experts if hasattr(model.config, "num_local_experts") else \
        getattr(model.config, "num_experts", None) or model.config.n_routed_experts
    counts, hooks = {}, []
    for l, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(layer.mlp, "experts"):
            continue

        def count(module, args, output, l=l):
            chosen = torch.bincount(output[2].reshape(-1), minlength=n_experts)  # (logits, weights, ids)
            counts[l] = counts.get(l, 0) + chosen

        hooks.append(gate.register_forward_hook(count))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=GEN_LEN, min_new_tokens=GEN_LEN, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             attention_mask=torch.ones_like(ids))
        for h in hooks:
            h.remove()
        full = model(ids).logits
    steps = torch.stack(out.logits)                                            # [G, B, V]
    top2 = steps.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3, "fixture too close to a greedy tie"
    tokens = ids.shape[0] * (ids.shape[1] + GEN_LEN - 1)                      # routed per layer
    return {"prefill": full, "tokens": out.sequences[:, ids.shape[1]:].tolist(),
            "routing": {l: [c / tokens for c in cs.tolist()] for l, cs in counts.items()}}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    path = tmp_path_factory.mktemp("node") / "node.yaml"
    path.write_text(NODE)
    return str(path)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    model, directory = saved_moe_model(FAMILIES, request.param, tmp_path_factory)
    ids = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    return request.param, str(directory), ids, _reference(model, ids)


def _compile(model_dir: str, node: str, strategy: str, gpu_mem=None):
    plan, _ = compile_plan(CompileRequest(model=model_dir, hw=node, strategy=strategy, weight_dtype="fp32",
                                          gpu_mem=gpu_mem, prompt_len=PROMPT_LEN, gen_len=GEN_LEN))
    return plan


def _dram_kv_plan(model_dir: str, node: str):
    """Attention on the GPU with every KV cache in DRAM (prefill caches copied down, decode
    attention on the CPU); the first MoE block streamed in prefill and computed on the CPU in
    decode, the others resident on the GPU; dense MLPs on the CPU; a two-slot staging ring."""
    spec = load_model(model_dir, "fp32")
    problem = build_problem(spec, load_node(node), Workload(1, PROMPT_LEN, GEN_LEN))
    names = [b.name for b in problem.graph.blocks]
    first_moe = min(l for l in range(spec.n_layers) if spec.is_moe_layer(l))
    weights, decode = {}, {}
    for name in names:
        kind = name.split("_")[0]
        weights[name] = {"embed": "cpu", "head": "stream", "attn": "gpu", "mlp": "cpu",
                         "moe": "stream" if name == f"moe_{first_moe}" else "gpu"}[kind]
        decode[name] = "cpu" if name == f"moe_{first_moe}" else weights[name]
    kv = {name: "cpu" for name in names if name.startswith("attn_")}
    dec = Decision(weights=weights, exec={"prefill": dict(weights), "decode": decode}, kv=kv, depth=2)
    return make_plan(problem, dec, {"strategy": "hand", "status": "heuristic", "mip_gap": None, "options": {}})


def _tiers(plan) -> set:
    """(block kind, tier) pairs of the plan, plus (attn, kv:cpu) for a DRAM KV cache, (kind,
    on the gpu) for a block that computes on the GPU (resident or streamed) in both phases and
    (moe, experts in dram) for an MoE block whose routed experts, all or some, run from DRAM."""
    out = {(p["kind"], p["weights"]) for p in plan.placement}
    out |= {(p["kind"], "on the gpu") for p in plan.placement if "cpu" not in p["exec"].values()}
    out |= {("moe", "experts in dram") for p in plan.placement
            if p["kind"] == "moe" and (p["weights"] == "cpu" or p.get("cold_expert_bytes"))}
    return out | {("attn", "kv:cpu") for p in plan.placement if p["kv"] == "cpu"}


def _run(plan, model_dir: str, ids: torch.Tensor, record: bool = False):
    return run_plan(plan, RunOptions(weights=model_dir, prompt_ids=tuple(map(tuple, ids.tolist())),
                                     gen_len=GEN_LEN, emulate=True, all_logits=True, record_routing=record))


def _check(result, ref) -> None:
    got = result.logits[0]                                                    # [B, P, V]
    assert got.shape == ref["prefill"].shape
    assert (got - ref["prefill"]).abs().max().item() <= TOL
    assert result.tokens == ref["tokens"]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_moe_plan_matches_transformers(family_model, node, strategy):
    family, model_dir, ids, ref = family_model
    name, gpu_mem, must_have = STRATEGIES[strategy]
    plan = _compile(model_dir, node, name, gpu_mem)
    assert must_have <= _tiers(plan), f"{strategy} plan for {family} lacks {must_have - _tiers(plan)}"
    _check(_run(plan, model_dir, ids), ref)


def test_plan_with_kv_caches_in_dram_matches_transformers(family_model, node):
    family, model_dir, ids, ref = family_model
    plan = _dram_kv_plan(model_dir, node)
    assert {("attn", "kv:cpu"), ("moe", "stream"), ("moe", "gpu")} <= _tiers(plan)
    assert any(t.kind == "kv_down" for t in plan.schedule["prefill"].tasks)
    assert any(t.kind == "attn_core" and t.resource == "cpu" for t in plan.schedule["decode"].tasks)
    _check(_run(plan, model_dir, ids), ref)


def test_recorded_routing_equals_transformers_router_choices(family_model, node):
    family, model_dir, ids, ref = family_model
    result = _run(_compile(model_dir, node, "ngl:1"), model_dir, ids, record=True)
    spec = load_model(model_dir, "fp32")
    assert result.routing.tokens == PROMPT_LEN + GEN_LEN - 1
    assert set(result.routing.layers) == set(ref["routing"]) == {
        l for l in range(spec.n_layers) if spec.is_moe_layer(l)}
    for l, fractions in ref["routing"].items():
        assert list(result.routing.layers[l]) == pytest.approx(fractions, abs=1e-12)


def test_exec_record_routing_writes_a_file_that_loads(family_model, node, tmp_path, capsys):
    family, model_dir, ids, ref = family_model
    plan_path, stats_path = tmp_path / "plan.json", tmp_path / "stats.json"
    plan_path.write_text(_compile(model_dir, node, "stream").to_json())
    prompt = ",".join(str(i) for i in ids[0].tolist())
    rc = main(["exec", str(plan_path), "--weights", model_dir, "--prompt-ids", prompt, "--gen-len", str(GEN_LEN),
               "--emulate", "--record-routing", str(stats_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert f"wrote {stats_path}" in out
    assert not list(tmp_path.glob("*.tmp*")), "the statistics file is written atomically"
    stats = load_routing(stats_path, load_model(model_dir, "fp32"))
    for l, fractions in ref["routing"].items():
        assert list(stats.layers[l]) == pytest.approx(fractions, abs=1e-8)
    assert json.loads(stats_path.read_text())["tokens"] == PROMPT_LEN + GEN_LEN - 1


def test_record_routing_is_refused_for_a_model_without_experts(tmp_path, node, capsys):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB))
    model.save_pretrained(tmp_path)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(_compile(str(tmp_path), node, "all-gpu").to_json())
    rc = main(["exec", str(plan_path), "--weights", str(tmp_path), "--emulate",
               "--record-routing", str(tmp_path / "stats.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("hetplan: error: --record-routing") and "no experts" in err
    assert not (tmp_path / "stats.json").exists()
