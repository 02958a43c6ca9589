"""MoE models built from the runtime's pieces match transformers on the same weights.

Tiny random mixtral, qwen3_moe, deepseek_v3 (and a deepseek_v2 checkpoint, read through the
same family) are written with ``save_pretrained``; the reference driver reads them through the
checkpoint-name mapping and runs with each MoE layer's experts split into two subsets, as a
plan splits them between GPU and CPU. Oracles: transformers' logits, generate() and router
modules.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from hetplan.errors import HetplanError  # noqa: E402
from hetplan.graph import block_graph  # noqa: E402
from hetplan.frontends.resolve import load_model  # noqa: E402
from hetplan.routing import load_routing  # noqa: E402
from hetplan.runtime.models.moe.layer import Router, RoutingRecorder, experts_forward, route  # noqa: E402
from hetplan.runtime.models.moe.reference import ReferenceModel  # noqa: E402
from hetplan.runtime.models.moe.weights import (block_tensors, group_by_block, moe_layer_from_tensors,  # noqa: E402
                                         weight_key)
from hetplan.workload import Workload  # noqa: E402
from tests.tiny_models import MOE_FAMILIES, saved_moe_model

VOCAB = 128
_DEEPSEEK = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB, n_routed_experts=16,
                 num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                 first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=16)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
FAMILIES = {
    **MOE_FAMILIES,
    "qwen3_moe_unnormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=False)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", _DEEPSEEK),
    # No q compression, rope on halves instead of interleaved pairs, yarn scaling with mscale.
    "deepseek_v3_yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _DEEPSEEK, q_lora_rank=None, rope_interleave=False, max_position_embeddings=256,
        rope_parameters=_YARN)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _DEEPSEEK, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy",
        routed_scaling_factor=1.5)),
}
MLA_FAMILIES = [f for f in FAMILIES if f.startswith("deepseek")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (transformers model, ModelSpec, checkpoint dir); built once per family."""
    built = {}

    def get(family):
        if family not in built:
            model, path = saved_moe_model(FAMILIES, family, tmp_path_factory)
            built[family] = (model, load_model(str(path)), path)
        return built[family]

    return get


def _split(spec):
    """Two expert subsets, interleaved (e % 3 == 0 on one side), like a GPU/CPU split."""
    return [range(0, spec.n_experts, 3), [e for e in range(spec.n_experts) if e % 3]]


def _blocks(path, spec):
    """The saved checkpoint's tensors, grouped by block through the name mapping."""
    return group_by_block(load_file(path / "model.safetensors"), spec)


def _reference(model_spec_path, absorbed=True, recorder=None):
    _, spec, path = model_spec_path
    return ReferenceModel(spec, _blocks(path, spec), _split(spec), absorbed=absorbed, recorder=recorder)


def _prompt(batch: int, length: int, seed: int = 3):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


PATHS = [(f, True) for f in FAMILIES] + [(f, False) for f in MLA_FAMILIES]
"""(family, absorbed): every family, and MLA families also with the decompressed path."""


@pytest.mark.parametrize("family,absorbed", PATHS)
def test_prefill_logits_match_transformers_with_experts_split_in_two(tiny, family, absorbed):
    model, spec, _ = tiny(family)
    ref = _reference(tiny(family), absorbed)
    ids = _prompt(2, 12)
    ref.start(2, 12)
    got = ref.forward(ids)
    with torch.no_grad():
        want = model(ids).logits
    assert got.shape == want.shape == (2, 12, VOCAB)
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family,absorbed", PATHS)
def test_greedy_decoding_matches_transformers_for_32_tokens(tiny, family, absorbed):
    model, _, _ = tiny(family)
    prompt = _prompt(1, 9, seed=5)
    got = _reference(tiny(family), absorbed).greedy(prompt, 32)
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert got.tolist() == want[:, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_prefill_in_chunks_then_decode_gives_the_one_pass_logits(tiny, family):
    model, _, _ = tiny(family)
    ids = _prompt(2, 14)
    with torch.no_grad():
        want = model(ids).logits
    ref = _reference(tiny(family))
    ref.start(2, 14)
    got = torch.cat([ref.forward(ids[:, :5]), ref.forward(ids[:, 5:12]), ref.forward(ids[:, 12:13]),
                     ref.forward(ids[:, 13:])], dim=1)
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_route_chooses_the_experts_and_weights_of_transformers_router(tiny, family):
    model, spec, path = tiny(family)
    l = spec.first_dense_layers  # the first MoE layer
    hidden = torch.randn(64, spec.hidden, generator=torch.Generator().manual_seed(7))
    layer = moe_layer_from_tensors(_blocks(path, spec)[f"moe_{l}"], spec)
    ids, weights = route(hidden, layer.router, spec)
    with torch.no_grad():
        _, want_weights, want_ids = model.model.layers[l].mlp.gate(hidden)
    order, want_order = ids.argsort(dim=1), want_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order).float(),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_expert_subsets_add_up_to_transformers_experts(tiny, family):
    model, spec, path = tiny(family)
    l = spec.first_dense_layers  # the first MoE layer
    hidden = torch.randn(40, spec.hidden, generator=torch.Generator().manual_seed(11))
    mlp = model.model.layers[l].mlp
    with torch.no_grad():
        _, weights, ids = mlp.gate(hidden)
        want = mlp.experts(hidden, ids, weights)
    experts = moe_layer_from_tensors(_blocks(path, spec)[f"moe_{l}"], spec).experts
    side_a, side_b = _split(spec)
    part_a = experts_forward(hidden, ids, weights, experts, side_a)
    part_b = experts_forward(hidden, ids, weights, {e: experts[e] for e in side_b}, side_b)
    assert (part_a + part_b - want).abs().max().item() <= 1e-5
    assert (part_a - want).abs().max().item() > 1e-2, "each side must carry part of the layer"
    assert torch.count_nonzero(experts_forward(hidden, ids, weights, experts, [])) == 0


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_recorder_counts_equal_the_choices_of_transformers_routers(tiny, family):
    model, spec, _ = tiny(family)
    want = {}

    def hook(l):
        def count(module, args, output):
            ids = output[2]  # (router_logits, weights, ids)
            counts = torch.bincount(ids.reshape(-1), minlength=spec.n_experts).tolist()
            want[l] = [a + b for a, b in zip(want.get(l, [0] * spec.n_experts), counts)]
        return count

    handles = [model.model.layers[l].mlp.gate.register_forward_hook(hook(l))
               for l in range(spec.n_layers) if spec.is_moe_layer(l)]
    prompt = _prompt(2, 10, seed=13)
    try:
        with torch.no_grad():
            model(prompt)
    finally:
        for h in handles:
            h.remove()
    recorder = RoutingRecorder(spec)
    ref = _reference(tiny(family), recorder=recorder)
    ref.start(2, 10)
    ref.forward(prompt)
    assert recorder.counts() == want
    assert all(sum(c) == 20 * spec.experts_per_token for c in want.values())


def test_recorded_statistics_round_trip_through_stats_json(tiny, tmp_path):
    _, spec, _ = tiny("deepseek_v3")
    recorder = RoutingRecorder(spec)
    _reference(tiny("deepseek_v3"), recorder=recorder).greedy(_prompt(1, 6), 10)
    recorder.write(tmp_path / "stats.json")
    stats = load_routing(tmp_path / "stats.json", spec)
    tokens = 6 + 9  # the prompt, then one token per decode step after the first
    assert stats.tokens == tokens
    assert sorted(stats.layers) == [l for l in range(spec.n_layers) if spec.is_moe_layer(l)]
    for l, counts in recorder.counts().items():
        assert stats.layers[l] == pytest.approx([c / tokens for c in counts], abs=1e-8)
        assert sum(stats.layers[l]) == pytest.approx(spec.experts_per_token)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_fused_state_dict_gives_the_logits_of_the_per_expert_checkpoint(tiny, family):
    model, spec, path = tiny(family)
    state = model.state_dict()
    assert any(k.endswith("experts.gate_up_proj") for k in state), "transformers holds experts fused"
    ids = _prompt(1, 8)
    logits = []
    for tensors in (state, load_file(path / "model.safetensors")):
        ref = ReferenceModel(spec, group_by_block(tensors, spec), _split(spec))
        ref.start(1, 8)
        logits.append(ref.forward(ids))
    assert (logits[0] - logits[1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_block_tensors_name_every_checkpoint_tensor_with_its_shape(tiny, family):
    _, spec, path = tiny(family)
    with safe_open(path / "model.safetensors", "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    listed = {}
    for block in block_graph(spec, Workload(batch=1, prompt_len=8, gen_len=8)).blocks:
        for t in block_tensors(spec, block.kind, block.layer):
            listed[t.checkpoint] = t.shape
            key = weight_key(t.checkpoint, spec)
            if not (block.kind == "head" and t.checkpoint == "model.embed_tokens.weight"):
                assert (key.block, key.tensor) == (block.name, t.local)
    assert listed == saved


def test_weight_key_names_the_expert_of_each_layout(tiny):
    _, mixtral, _ = tiny("mixtral")
    _, deepseek, _ = tiny("deepseek_v3")
    key = weight_key("model.layers.1.block_sparse_moe.experts.3.w2.weight", mixtral)
    assert (key.block, key.tensor, key.expert) == ("moe_1", "experts.3.down", 3)
    key = weight_key("model.layers.2.mlp.experts.gate_up_proj", deepseek)
    assert (key.block, key.tensor, key.expert) == ("moe_2", "experts.gate_up", None)
    assert weight_key("model.layers.0.mlp.gate_proj.weight", deepseek).block == "mlp_0"
    assert weight_key("model.layers.1.mlp.gate.e_score_correction_bias", deepseek).tensor == "router_bias"
    assert weight_key("model.layers.3.mlp.experts.0.up_proj.weight", deepseek) is None  # next-token layer


@pytest.mark.parametrize("name,message", [
    ("model.layers.1.mlp.experts.16.up_proj.weight", "expert 16 does not exist"),
    ("model.layers.0.mlp.experts.0.up_proj.weight", "not a tensor of a deepseek_v3 model"),
    ("model.layers.1.self_attn.q_a_proj.weight_scale_inv", "block-quantised"),
    ("model.vision_tower.weight", "not a tensor"),
])
def test_weight_key_refuses_names_the_model_does_not_have(tiny, name, message):
    _, spec, _ = tiny("deepseek_v3")
    with pytest.raises(HetplanError, match=message):
        weight_key(name, spec)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family,absorbed", [("mixtral", True), ("deepseek_v3", True),
                                             ("deepseek_v3", False)])
def test_on_cuda_the_pieces_match_transformers_on_cpu(tiny, family, absorbed):
    model, spec, path = tiny(family)
    tensors = {k: v.cuda() for k, v in load_file(path / "model.safetensors").items()}
    ref = ReferenceModel(spec, group_by_block(tensors, spec), _split(spec), absorbed=absorbed)
    ids = _prompt(2, 12)
    ref.start(2, 12)
    got = ref.forward(ids.cuda()).cpu()
    with torch.no_grad():
        want = model(ids).logits
    assert (got - want).abs().max().item() <= 1e-4
    prompt = _prompt(1, 9, seed=5)
    with torch.no_grad():
        want_tokens = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert ref.greedy(prompt.cuda(), 32).cpu().tolist() == want_tokens[:, 9:].tolist()


@pytest.mark.parametrize("extra,message", [
    (dict(scoring_func="softmax"), "scoring_func: 'softmax' with topk_method 'noaux_tc'"),
    (dict(n_group=16), "at least 2 per group"),
    (dict(topk_group=0), "keeping 0, is not a valid noaux_tc routing"),
    (dict(n_group=8, topk_group=1), "must hold at least num_experts_per_tok = 3"),
    (dict(topk_method="random"), "topk_method: 'random' is not supported"),
])
def test_impossible_deepseek_routing_settings_are_refused(tiny, extra, message):
    _, spec, _ = tiny("deepseek_v3")  # 16 experts, 3 per token
    spec = dataclasses.replace(spec, extra=dict(spec.extra, **extra))
    router = Router(torch.zeros(spec.n_experts, spec.hidden))
    with pytest.raises(HetplanError, match=message):
        route(torch.zeros(2, spec.hidden), router, spec)
