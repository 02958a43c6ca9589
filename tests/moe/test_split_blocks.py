"""`hetplan exec` runs MoE blocks whose routed experts are split between HBM and DRAM.

For the tiny Mixtral, Qwen3-MoE and DeepSeek-V3 models of `test_exec_moe`, every block on the
(emulated) GPU with n of its E routed experts resident there (n = 0, E/2, E; the rest run on the
CPU as `moe_cold` tasks): prefill logits at every prompt position match transformers' within
1e-4 and 32 greedy tokens are transformers' `generate`'s. With a skewed routing profile the GPU
holds the experts the profile ranks hottest, not the first ids. The GPU part of a split block
holds no cold expert and the CPU part nothing else; the emulated GPU's ledger counts exactly the
hot experts' bytes, the CPU's the cold ones'. Routing is still recorded for every token, a
quantised split plan computes what the unsplit one does, and placements whose cold experts do
not match the schedule are refused.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tests.moe.test_whole_blocks import _check, _run, family_model, node  # noqa: F401 - fixtures

from hetplan.cli import main
from hetplan.errors import HetplanError
from hetplan.evaluate import make_plan
from hetplan.hardware import load_node
from hetplan.frontends.resolve import load_model
from hetplan.problem import build_problem
from hetplan.routing import RoutingStats, load_routing, routing_fingerprint
from hetplan.runtime.models.moe import split as moe_split
from hetplan.runtime.backend import backend_for
from hetplan.runtime.devices import Devices
from hetplan.runtime.residency import Residency, check_placement
from hetplan.runtime.session import RunOptions, run_plan
from hetplan.runtime.weights import Checkpoint
from hetplan.solvers import baselines
from hetplan.workload import Workload

PROMPT_LEN, GEN_LEN = 8, 32
HOT = {"none": lambda e: 0, "half": lambda e: e // 2, "all": lambda e: e}
"""How many of a block's E routed experts a split plan keeps on the GPU."""
STRIDE = 5
"""Skewed profile: expert e of layer l has rank (STRIDE * e + l) mod E from the coldest (STRIDE is
coprime to every E here, so each layer ranks its experts in another order)."""


def _split_plan(model_dir: str, node_path: str, hot: int | None = None, routing=None, weight_dtype="fp32"):
    """Everything resident on the GPU, each MoE block with ``hot`` routed experts there (None:
    all, as all-gpu decides)."""
    spec = load_model(model_dir, weight_dtype, "fp32")
    problem = build_problem(spec, load_node(node_path), Workload(1, PROMPT_LEN, GEN_LEN), routing=routing)
    dec = baselines.all_gpu(problem)
    if hot is not None:
        dec = dataclasses.replace(dec, experts={b.name: hot for b in problem.blocks if b.kind == "moe"})
    return make_plan(problem, dec, {"strategy": "test", "status": "heuristic"})


def _skewed(spec) -> RoutingStats:
    e, k = spec.n_experts, spec.experts_per_token
    weight = {l: [(STRIDE * j + l) % e + 1 for j in range(e)] for l in range(spec.n_layers) if spec.is_moe_layer(l)}
    return RoutingStats(routing_fingerprint(spec), {l: tuple(k * w / sum(ws) for w in ws) for l, ws in weight.items()})


def _moe_entries(plan) -> list:
    return [p for p in plan.placement if p["kind"] == "moe"]


def _experts_in(weights) -> set:
    return {int(name.split(".")[1]) for name in weights if name.startswith("experts.")}


def _residency(plan, model_dir: str, devices: Devices) -> Residency:
    return Residency(plan, backend_for(plan.model), Checkpoint(model_dir), devices, torch.float32, torch.float32,
                     batch=1, max_tokens=PROMPT_LEN + GEN_LEN)


@pytest.mark.parametrize("hot", list(HOT))
def test_split_plan_matches_transformers(family_model, node, hot):
    family, model_dir, ids, ref = family_model
    spec = load_model(model_dir, "fp32")
    n = HOT[hot](spec.n_experts)
    plan = _split_plan(model_dir, node, n)
    for p in _moe_entries(plan):
        assert p["weights"] == "gpu" and p["experts_on_gpu"] == n
    cold_tasks = [t for ph in ("prefill", "decode") for t in plan.schedule[ph].tasks if t.kind == "moe_cold"]
    assert all(t.resource == "cpu" for t in cold_tasks)
    assert len(cold_tasks) == (0 if n == spec.n_experts else 2 * len(_moe_entries(plan)))
    _check(_run(plan, model_dir, ids), ref)


def test_skewed_profile_keeps_the_hottest_experts_on_the_gpu(family_model, node, monkeypatch):
    family, model_dir, ids, ref = family_model
    spec = load_model(model_dir, "fp32")
    e, n = spec.n_experts, spec.n_experts // 2
    plan = _split_plan(model_dir, node, n, routing=_skewed(spec))
    for p in _moe_entries(plan):
        hottest = {j for j in range(e) if (STRIDE * j + p["layer"]) % e >= e - n}
        assert set(p["gpu_experts"]) == hottest
    assert any(p["gpu_experts"] != list(range(n)) for p in _moe_entries(plan))

    cold_calls = []
    cold_stage = moe_split.cold_stage

    def spy(c, s):
        # id e marks the padding rows a sync-free route sends after the cold pairs
        cold_calls.append((c.block, c.device.type, _experts_in(c.weights), set(c.inputs["cold_ids"].tolist()) - {e}))
        return cold_stage(c, s)

    monkeypatch.setattr(moe_split, "cold_stage", spy)
    _check(_run(plan, model_dir, ids), ref)
    gpu_experts = {p["block"]: set(p["gpu_experts"]) for p in _moe_entries(plan)}
    assert cold_calls and any(chosen for *_, chosen in cold_calls), "no token chose a cold expert"
    for block, device, held, chosen in cold_calls:
        assert device == "cpu"
        assert held == set(range(e)) - gpu_experts[block]
        assert chosen <= held


def test_gpu_part_holds_no_cold_expert_and_the_cpu_part_nothing_else(family_model, node):
    family, model_dir, ids, ref = family_model
    spec = load_model(model_dir, "fp32")
    plan = _split_plan(model_dir, node, spec.n_experts // 2, routing=_skewed(spec))
    residency = _residency(plan, model_dir, Devices("emulated", plan.memory["gpu_budget_bytes"]))
    for p in _moe_entries(plan):
        gpu, cpu = residency.weights(p["block"], "gpu", None), residency.weights(p["block"], "cpu", None)
        assert residency.blocks[p["block"]].tier == "gpu" and residency.cold[p["block"]].tier == "cpu"
        assert _experts_in(gpu) == set(p["gpu_experts"])
        assert {"norm", "router"} <= set(gpu)
        assert _experts_in(cpu) == set(range(spec.n_experts)) - set(p["gpu_experts"])
        assert all(name.startswith("experts.") for name in cpu)


def test_emulated_gpu_ledger_counts_the_hot_experts_and_not_the_cold_ones(family_model, node):
    family, model_dir, ids, ref = family_model
    spec = load_model(model_dir, "fp32")
    expert_bytes = 3 * spec.moe_intermediate * spec.hidden * 4         # gate, up, down; fp32
    used = {}
    for n in (spec.n_experts, spec.n_experts // 2):
        plan = _split_plan(model_dir, node, n)
        devices = Devices("emulated", plan.memory["gpu_budget_bytes"])
        residency = _residency(plan, model_dir, devices)
        used[n] = {tier: devices.ledgers[tier].used_bytes for tier in ("gpu", "cpu")}
        for p in _moe_entries(plan):
            cold = residency.cold[p["block"]].flat.numel() * 4 if p["block"] in residency.cold else 0
            assert cold == p["cold_expert_bytes"] == (spec.n_experts - n) * expert_bytes
    moved = (spec.n_experts - spec.n_experts // 2) * len(_moe_entries(plan)) * expert_bytes
    assert used[spec.n_experts]["gpu"] - used[spec.n_experts // 2]["gpu"] == moved
    assert used[spec.n_experts // 2]["cpu"] - used[spec.n_experts]["cpu"] == moved


def test_exec_of_a_split_plan_records_every_tokens_routing(family_model, node, tmp_path, capsys):
    family, model_dir, ids, ref = family_model
    spec = load_model(model_dir, "fp32")
    plan_path, stats_path = tmp_path / "plan.json", tmp_path / "stats.json"
    plan_path.write_text(_split_plan(model_dir, node, spec.n_experts // 2).to_json())
    prompt = ",".join(str(i) for i in ids[0].tolist())
    rc = main(["exec", str(plan_path), "--weights", model_dir, "--prompt-ids", prompt, "--gen-len", str(GEN_LEN),
               "--emulate", "--json", "--record-routing", str(stats_path)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["tokens"] == ref["tokens"]
    stats = load_routing(stats_path, spec)
    assert stats.tokens == PROMPT_LEN + GEN_LEN - 1
    assert set(stats.layers) == set(ref["routing"])
    for l, fractions in ref["routing"].items():
        assert list(stats.layers[l]) == pytest.approx(fractions, abs=1e-8)


def test_quantised_split_plan_computes_what_the_unsplit_plan_does(family_model, node):
    """Each expert is quantised on its own, so where it lives must not change the numbers."""
    family, model_dir, ids, ref = family_model
    spec = load_model(model_dir, "fp32")
    logits = {}
    for n in (spec.n_experts, spec.n_experts // 2):
        plan = _split_plan(model_dir, node, n, weight_dtype="q8_0")
        result = run_plan(plan, RunOptions(weights=model_dir, prompt_ids=tuple(map(tuple, ids.tolist())),
                                           gen_len=4, emulate=True, keep_logits=True))
        logits[n] = torch.stack(result.logits)
    assert (logits[spec.n_experts] - logits[spec.n_experts // 2]).abs().max().item() <= 1e-4


def test_cold_experts_without_a_cold_task_are_refused(family_model, node):
    family, model_dir, ids, ref = family_model
    spec = load_model(model_dir, "fp32")
    plan = _split_plan(model_dir, node)                                  # every expert hot: no moe_cold
    first = _moe_entries(plan)[0]
    edited = [dict(p, experts_on_gpu=1, gpu_experts=[0]) if p is first else p for p in plan.placement]
    with pytest.raises(HetplanError, match=f"block {first['block']}: {spec.n_experts - 1} experts in DRAM.*moe_cold"):
        check_placement(dataclasses.replace(plan, placement=tuple(edited)))
    wrong = [dict(p, gpu_experts=[spec.n_experts] + p["gpu_experts"][1:]) if p is first else p
             for p in plan.placement]
    with pytest.raises(HetplanError, match="gpu_experts"):
        check_placement(dataclasses.replace(plan, placement=tuple(wrong)))
