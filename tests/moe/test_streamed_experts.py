"""`hetplan exec` streams a split MoE block's cold experts into a staging slot.

For the tiny Mixtral and DeepSeek-V3 models of `test_exec_moe`, every block resident on the
(emulated) GPU, each MoE block with half of its E routed experts in HBM and the other half in
DRAM; in a phase whose exec says `stream` a `load` copies those cold experts into a staging slot
and the block's two GPU stages compute every expert (no `moe_cold`), in the other phase the CPU
computes them. With prefill streamed and decode on the CPU, and with both phases streamed,
prefill logits at every prompt position match transformers' within 1e-4 and 32 greedy tokens are
transformers' `generate`'s; a q8_0 plan computes what transformers computes with the dequantised
weights. In a streamed phase the router sends no pair to the CPU. The cold experts are held once,
in pinned DRAM: the emulated GPU's ledger counts the staging slots and no copy of them; quantised,
they are multiplied from their bytes in the slot, as the hot experts from theirs. Streaming
is accepted only for a split MoE block whose schedule loads its cold experts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from tests.moe.test_whole_blocks import FAMILIES, PROMPT_LEN, VOCAB, _check, _reference, _run, node  # noqa: F401 - fixture
from tests.moe.test_quantised_experts import dequantised_checkpoint
from tests.tiny_models import saved_moe_model

from hetplan.runtime.kernels.linear import PackedLinear
from hetplan.errors import HetplanError
from hetplan.evaluate import make_plan
from hetplan.graph import PHASES, dequant_buffer_elems
from hetplan.hardware import load_node
from hetplan.frontends.resolve import load_model
from hetplan.plan import Decision
from hetplan.problem import build_problem
from hetplan.runtime.models.moe import split as moe_split
from hetplan.runtime.backend import backend_for
from hetplan.runtime.devices import Devices
from hetplan.runtime.residency import Residency, check_placement
from hetplan.runtime.session import RunOptions, run_plan
from hetplan.runtime.weights import Checkpoint
from hetplan.workload import Workload

GEN_LEN = 32
STREAMED = {"prefill": ("prefill",), "both": ("prefill", "decode")}
"""Phases in which the MoE blocks' cold experts are streamed (in the others they run on the CPU)."""
QUANT_GEN_LEN = 8


@pytest.fixture(scope="module", params=["mixtral", "deepseek_v3"])
def family_model(request, tmp_path_factory):
    model, directory = saved_moe_model(FAMILIES, request.param, tmp_path_factory)
    ids = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    return request.param, directory, ids, _reference(model, ids)


def _plan(model_dir, node_path: str, streamed: tuple, weight_dtype: str = "fp32", hot: int | None = None,
          gen_len: int = GEN_LEN):
    """Everything resident on the GPU, each MoE block with ``hot`` (default E/2) routed experts
    there; its cold experts streamed through a two-slot ring in the phases ``streamed``."""
    spec = load_model(str(model_dir), weight_dtype, "fp32")
    problem = build_problem(spec, load_node(node_path), Workload(1, PROMPT_LEN, gen_len))
    names = [b.name for b in problem.blocks]
    moe = [b.name for b in problem.blocks if b.kind == "moe"]
    execs = {ph: {n: "stream" if n in moe and ph in streamed else "gpu" for n in names} for ph in PHASES}
    dec = Decision(weights={n: "gpu" for n in names}, exec=execs,
                   kv={b.name: "gpu" for b in problem.blocks if b.kind == "attn"}, depth=2,
                   experts={m: spec.n_experts // 2 if hot is None else hot for m in moe})
    return make_plan(problem, dec, {"strategy": "test"})


def _moe_entries(plan) -> list:
    return [p for p in plan.placement if p["kind"] == "moe"]


def _experts_in(weights) -> set:
    return {int(name.split(".")[1]) for name in weights if name.startswith("experts.")}


def _cold_bytes(spec, hot: int) -> int:
    """Cold experts of one block: gate, up and down of each, fp32."""
    return (spec.n_experts - hot) * 3 * spec.moe_intermediate * spec.hidden * 4


@pytest.mark.parametrize("streamed", list(STREAMED))
def test_streamed_cold_experts_match_transformers(family_model, node, streamed):
    family, model_dir, ids, ref = family_model
    spec = load_model(str(model_dir), "fp32")
    plan = _plan(model_dir, node, STREAMED[streamed])
    for phase in PHASES:
        tasks = plan.schedule[phase].tasks
        for p in _moe_entries(plan):
            mine = {t.kind: t for t in tasks if t.block == p["block"]}
            if phase in STREAMED[streamed]:
                assert "moe_cold" not in mine and "moe_merge" not in mine
                assert mine["load"].bytes == p["cold_expert_bytes"] == _cold_bytes(spec, spec.n_experts // 2)
                assert mine["moe_route"].slot == mine["moe_experts"].slot == mine["load"].slot
            else:
                assert "load" not in mine and mine["moe_cold"].resource == "cpu"
    _check(_run(plan, str(model_dir), ids), ref)


def test_a_streamed_phase_sends_no_pair_to_the_cpu(family_model, node, monkeypatch):
    """Prefill streams, decode computes the cold experts on the CPU: the same block's router
    sees every expert in one phase and only the hot ones in the other."""
    family, model_dir, ids, ref = family_model
    spec = load_model(str(model_dir), "fp32")
    plan = _plan(model_dir, node, ("prefill",))
    hot = {p["block"]: set(p["gpu_experts"]) for p in _moe_entries(plan)}
    calls = []
    route_stage = moe_split.route_stage

    def spy(c, s, h):
        out = route_stage(c, s, h)
        phase = "prefill" if c.step.start == 0 else "decode"
        calls.append((phase, c.block, _experts_in(c.weights), out["cold_ids"].numel()))
        return out

    monkeypatch.setattr(moe_split, "route_stage", spy)
    _check(_run(plan, str(model_dir), ids), ref)
    assert {phase for phase, *_ in calls} == set(PHASES)
    for phase, block, held, pairs in calls:
        if phase == "prefill":
            assert held == set(range(spec.n_experts)) and pairs == 0
        else:
            assert held == hot[block]
    assert any(pairs for phase, *_, pairs in calls if phase == "decode"), "no decode token chose a cold expert"


def test_cold_experts_are_held_once_in_pinned_dram_and_the_gpu_counts_only_the_slots(family_model, node,
                                                                                    monkeypatch):
    family, model_dir, ids, ref = family_model
    spec = load_model(str(model_dir), "fp32")
    n = spec.n_experts // 2
    pinned, used, residencies = {}, {}, {}
    empty = Devices.empty

    def spy(self, tier, shape, dtype, what, **kw):
        pinned[what] = kw.get("pinned", False)
        return empty(self, tier, shape, dtype, what, **kw)

    monkeypatch.setattr(Devices, "empty", spy)
    for streamed in ((), ("prefill",)):
        plan = _plan(model_dir, node, streamed)
        devices = Devices("emulated", plan.memory["gpu_budget_bytes"])
        residencies[streamed] = Residency(plan, backend_for(plan.model), Checkpoint(str(model_dir)), devices,
                                          torch.float32, torch.float32, batch=1, max_tokens=PROMPT_LEN + GEN_LEN)
        used[streamed] = {tier: devices.ledgers[tier].used_bytes for tier in ("gpu", "cpu")}
        for p in _moe_entries(plan):
            assert pinned[f"cold experts of {p['block']}"] == bool(streamed)
    residency = residencies["prefill",]
    assert len(residency.slots) == 2 and not residencies[()].slots
    assert all(s.numel() * 4 == _cold_bytes(spec, n) for s in residency.slots)
    assert used["prefill",]["gpu"] - used[()]["gpu"] == 2 * _cold_bytes(spec, n)
    assert used["prefill",]["cpu"] == used[()]["cpu"]
    for p in _moe_entries(plan):
        block, slot = p["block"], 0
        cold = set(range(spec.n_experts)) - set(p["gpu_experts"])
        assert _experts_in(residency.weights(block, "gpu", None)) == set(p["gpu_experts"])
        assert _experts_in(residency.weights(block, "cpu", None)) == cold
        merged = residency.weights(block, "gpu", slot)
        assert _experts_in(merged) == set(range(spec.n_experts))
        start = residency.slots[slot].data_ptr()
        end = start + residency.slots[slot].numel() * 4
        for e in range(spec.n_experts):
            in_slot = start <= merged[f"experts.{e}.down"].data_ptr() < end
            assert in_slot == (e in cold)
        residency.load(block, slot)
        for e in cold:
            assert torch.equal(merged[f"experts.{e}.gate_up"], residency.cold[block].tensors[f"experts.{e}.gate_up"])


@pytest.mark.parametrize("streamed", list(STREAMED))
def test_quantised_streamed_plan_matches_transformers_with_dequantised_weights(family_model, node, tmp_path,
                                                                               streamed):
    family, model_dir, ids, ref = family_model
    plan = _plan(model_dir, node, STREAMED[streamed], weight_dtype="q8_0", gen_len=QUANT_GEN_LEN)
    devices = Devices("emulated", plan.memory["gpu_budget_bytes"])
    residency = Residency(plan, backend_for(plan.model), Checkpoint(str(model_dir)), devices, torch.float32,
                          torch.float32, batch=1, max_tokens=PROMPT_LEN + QUANT_GEN_LEN)
    assert all(buffer.numel() <= dequant_buffer_elems(plan.model) for buffer in residency.buffers.values())
    for p in _moe_entries(plan):       # hot and streamed experts are multiplied from their packed bytes
        merged = residency.weights(p["block"], "gpu", 0).materialise()
        assert all(isinstance(merged[f"experts.{e}.down"], PackedLinear) for e in range(plan.model.n_experts))
    result = run_plan(plan, RunOptions(weights=str(model_dir), prompt_ids=tuple(map(tuple, ids.tolist())),
                                       gen_len=QUANT_GEN_LEN, keep_logits=True, emulate=True))
    blocks = [(p["block"], p["kind"], p["layer"]) for p in plan.placement]
    dequantised_checkpoint(model_dir, tmp_path / "dequantised", plan.model, blocks, "q8_0")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dequantised").eval()
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = None, 0
    with torch.no_grad():
        out = ref.generate(ids, max_new_tokens=QUANT_GEN_LEN, min_new_tokens=QUANT_GEN_LEN, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
    steps = torch.stack(out.logits)                                           # [G, B, V]
    top2 = steps.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3, "fixture too close to a greedy tie"
    assert (torch.stack(result.logits) - steps).abs().max().item() <= 1e-4
    assert result.tokens == out.sequences[:, PROMPT_LEN:].tolist()


def test_streaming_is_refused_for_resident_weights_without_cold_experts_or_a_load(family_model, node):
    family, model_dir, ids, ref = family_model
    spec = load_model(str(model_dir), "fp32")
    check_placement(_plan(model_dir, node, ("prefill",)))
    split = _plan(model_dir, node, ())
    first = _moe_entries(split)[0]

    def streaming(plan, block, **fields):
        edited = [dict(p, exec=dict(p["exec"], prefill="stream"), **fields) if p["block"] == block else p
                  for p in plan.placement]
        return dataclasses.replace(plan, placement=tuple(edited))

    with pytest.raises(HetplanError, match=f"block {first['block']}: cold experts streamed in prefill.*moe_cold"):
        check_placement(streaming(split, first["block"]))
    every = list(range(spec.n_experts))
    with pytest.raises(HetplanError, match=f"block {first['block']}: weights gpu, prefill exec stream"):
        check_placement(streaming(split, first["block"], experts_on_gpu=spec.n_experts, gpu_experts=every))
    attn = next(p["block"] for p in split.placement if p["kind"] == "attn")
    with pytest.raises(HetplanError, match=f"block {attn}: weights gpu, prefill exec stream"):
        check_placement(streaming(split, attn))
