"""The gathered expert path: a decode step's GPU experts read T k experts' weights, not all.

A block's dense experts, laid out as the residency lays them (one buffer, every expert's
tensors back to back), are viewed as one stack per weight without a copy; gathering the
chosen experts from it by device-side indices equals the counting path (``experts_forward``)
and reads nothing back to the host, and what it gathers is T k experts, whatever the subset's
size. Split plans of the tiny Mixtral, Qwen3-MoE and DeepSeek-V3 models whose GPU stages take
the gathered path (by the rule, or everywhere) still match transformers with no host sync on the
GPU lane. The cost model prices the gathered GPU side at 3 T k expert reads (hand-derived).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests.conftest import tiny_node, tiny_spec
from tests.moe.test_no_host_sync import SYNCS, HostSync, no_sync_on  # noqa: F401 - fixture
from tests.moe.test_split_blocks import _split_plan
from tests.moe.test_whole_blocks import _check, _run, family_model, node  # noqa: F401 - fixtures

from hetplan.evaluate import make_plan
from hetplan.frontends.resolve import load_model
from hetplan.plan import Decision
from hetplan.problem import build_problem
from hetplan.runtime.kernels.packed import views
from hetplan.runtime.models.moe import stacked
from hetplan.runtime.models.moe.layer import Expert, experts_forward
from hetplan.runtime.models.moe.stacked import gathered_experts_forward, stack_experts, sync_free_experts_forward
from hetplan.runtime.models.moe.weights import BlockExperts
from hetplan.workload import Workload

D, I = 16, 12


def _block(held, n_experts: int, dtype=torch.float32, seed: int = 0):
    """(buffer, in-block views) of an MoE block holding experts ``held``, laid out as the
    residency lays a block out: norm, then each expert's gate, up, down back to back, with the
    fused gate_up view the MoE backend asks for."""
    layout, off = [("norm", 0, (D,))], D
    for e in held:
        for part, shape in (("gate", (I, D)), ("up", (I, D)), ("down", (D, I))):
            layout.append((f"experts.{e}.{part}", off, shape))
            off += I * D
    flat = torch.randn(off, generator=torch.Generator().manual_seed(seed)).to(dtype)
    fused = {f"experts.{e}.gate_up": (f"experts.{e}.gate", f"experts.{e}.up") for e in range(n_experts)}
    return flat, views(flat, layout, fused)


def _routing(t: int, k: int, n_experts: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, D, generator=g)
    ids = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(t)])  # distinct per token
    return hidden, ids, torch.rand(t, k, generator=g)


def _no_syncs(monkeypatch):
    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, lambda *a, name=name, **kw: (_ for _ in ()).throw(HostSync(name)))


@pytest.mark.parametrize("held", ["whole block", "gpu part"])
def test_the_stack_views_the_block_buffer_in_place(held):
    n_e, subset = 8, (1, 2, 5, 6, 7)
    flat, w = _block(range(n_e) if held == "whole block" else subset, n_e)
    stack = stack_experts(BlockExperts(w, subset), subset, n_e)
    assert stack is not None and stack.ids == subset
    assert stack.gate_up.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert stack.slot.tolist() == ([-1, 0, 1, -1, -1, 4, 5, 6] if held == "whole block" else [-1, 0, 1, -1, -1, 2, 3, 4])
    for e in subset:
        s = stack.slot[e]
        assert stack.gate_up[s].equal(torch.cat([w[f"experts.{e}.gate"], w[f"experts.{e}.up"]]))
        assert stack.down[s].equal(w[f"experts.{e}.down"])
    flat.zero_()  # a view, not a copy
    assert stack.down.abs().sum() == 0


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_gathered_experts_equal_the_counting_path_and_read_nothing_back(monkeypatch, dtype, tol):
    n_e, k, t, subset = 8, 2, 5, (0, 2, 3, 5, 6)
    _, w = _block(subset, n_e, dtype)
    experts = BlockExperts(w, subset)
    hidden, ids, weights = _routing(t, k, n_e)
    hidden = hidden.to(dtype)
    want = experts_forward(hidden, ids, weights, experts, subset)
    stack = stack_experts(experts, subset, n_e)
    _no_syncs(monkeypatch)
    got = gathered_experts_forward(hidden, ids, weights, stack)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    outside = [tok for tok in range(t) if not set(ids[tok].numpy()) & set(subset)]
    assert outside, "the fixture has a token whose experts are all outside the subset"
    assert all(torch.count_nonzero(got[tok]) == 0 for tok in outside)


def test_a_decode_step_gathers_t_k_experts_not_the_whole_subset(monkeypatch):
    """T = 1, k = 2, 7 experts held: 3 T k = 6 < 7, so the step gathers, and index_select returns
    exactly T k experts' weights (2 (2I D + D I) elements), where the masked path would read all
    7 experts. T = 2 (3 T k = 12 >= 7) runs the masked path, gathering nothing."""
    n_e, k, subset = 8, 2, (0, 1, 2, 3, 4, 5, 6)
    _, w = _block(subset, n_e)
    experts = BlockExperts(w, subset)
    stack = stack_experts(experts, subset, n_e)
    gathered = []
    select = torch.Tensor.index_select

    def counted(self, *args, **kwargs):
        out = select(self, *args, **kwargs)
        gathered.append(out.numel())
        return out

    monkeypatch.setattr(torch.Tensor, "index_select", counted)
    for t, expect in ((1, 1 * k * (2 * I * D + D * I)), (2, 0)):
        gathered.clear()
        hidden, ids, weights = _routing(t, k, n_e, seed=t)
        got = sync_free_experts_forward(hidden, ids, weights, experts, subset, stack=stack)
        assert sum(gathered) == expect
        assert torch.allclose(got, experts_forward(hidden, ids, weights, experts, subset), rtol=1e-5, atol=1e-6)


def test_experts_that_do_not_share_a_buffer_run_masked():
    g = torch.Generator().manual_seed(0)
    n_e, subset = 8, (1, 3, 4, 5, 6, 7)
    experts = {e: Expert(torch.randn(2 * I, D, generator=g), torch.randn(D, I, generator=g)) for e in subset}
    assert stack_experts(experts, subset, n_e) is None
    hidden, ids, weights = _routing(1, 2, n_e)
    assert torch.allclose(sync_free_experts_forward(hidden, ids, weights, experts, subset),
                          experts_forward(hidden, ids, weights, experts, subset), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", ["gathers", "always"])
def test_split_plans_taking_the_gathered_path_match_transformers(family_model, node, rule, monkeypatch, no_sync_on):
    family, model_dir, ids, ref = family_model
    spec = load_model(model_dir, "fp32")
    hot = spec.n_experts - 1                                                  # one cold expert: a split block
    if rule == "gathers" and not 3 * spec.experts_per_token < hot:
        pytest.skip(f"{family}: a decode step of batch 1 never gathers ({hot} hot experts, k = "
                    f"{spec.experts_per_token})")
    if rule == "always":
        monkeypatch.setattr(stacked, "gathers", lambda t, k, n: True)
    calls = []
    gather = stacked.gathered_experts_forward
    monkeypatch.setattr(stacked, "gathered_experts_forward", lambda *a, **kw: calls.append(a[0].shape[0]) or gather(*a, **kw))
    plan = _split_plan(model_dir, node, hot=hot)
    _check(_run(plan, model_dir, ids), ref)
    assert "moe_experts" in no_sync_on
    assert 1 in calls, "decode steps gathered"
    assert (8 in calls) == (rule == "always"), "the prompt (8 tokens) gathers only when forced"


# -- pricing -------------------------------------------------------------------------------------
E, K = 16, 2
SPEC = tiny_spec(arch="mixtral", n_layers=1, hidden=1024, n_heads=8, n_kv_heads=4, head_dim=128, vocab=8000,
                 intermediate=2048, n_experts=E, experts_per_token=K, moe_intermediate=2048)


def _hot_task(spec, n: int):
    hw = tiny_node(64, 64)
    problem = build_problem(spec, hw, Workload(batch=1, prompt_len=256, gen_len=64))
    dec = Decision(weights={b.name: "gpu" for b in problem.blocks},
                   exec={ph: {b.name: "gpu" for b in problem.blocks} for ph in ("prefill", "decode")},
                   kv={"attn_0": "gpu"}, depth=1, experts={"moe_0": n})
    tasks = make_plan(problem, dec, {"strategy": "hand"}).schedule["decode"].tasks
    return hw, next(t for t in tasks if t.id == "moe_experts/moe_0")


@pytest.mark.parametrize("n, gathered", [(8, True), (7, True), (6, False), (4, False)])
def test_the_gpu_side_is_priced_at_3_t_k_expert_reads_when_it_gathers(n, gathered):
    """Hand-derived: decode, batch 1, fp16, uniform routing (every expert chosen with probability
    k / E = 1/8), n hot experts on tiny_node (GPU 500 GB/s). Gathered (3 * 1 * 2 = 6 < n): the
    weights read are 3 T k experts whichever are hit; masked: the expected hits, n / 8 experts.
    Either way each hit pair reads and writes its row, and the block its input and output."""
    hw, task = _hot_task(SPEC, n)
    expert = 3 * 1024 * 2048 * 2                  # bytes of one expert, fp16
    row = 1024 * 2                                # one token's hidden state
    hits = n * K / E                              # expected hot pairs = hits at one token
    weights = 3 * 1 * K * expert if gathered else hits * expert
    nbytes = weights + 2 * row + 2 * hits * row
    assert task.bytes == pytest.approx(nbytes, rel=1e-12)
    gpu_bw = 500e9 * hw.efficiency["gpu_mem"]
    assert task.duration_s == pytest.approx(nbytes / gpu_bw + hw.latency_s["gpu_task"], rel=1e-9)


def test_packed_experts_are_priced_by_their_hits():
    """q4_0 experts keep the masked path, so 8 hot experts at batch 1 still cost their expected hits."""
    spec = dataclasses.replace(SPEC, weight_dtype="q4_0")
    _, task = _hot_task(spec, 8)
    row = 1024 * 2
    expert = spec.expert_read_bytes()
    assert task.bytes == pytest.approx(1.0 * expert + 2 * row + 2 * 1.0 * row, rel=1e-12)
