"""The MoE stages that run on the GPU never read a value back to the host.

A host sync inside a GPU stage (``tolist``, ``item``, ``nonzero``, ``cpu()``) stalls the lane
that issues the GPU's work until the device catches up. Here those methods raise whenever the
emulated GPU's lane calls them, and every family's plan with experts split between HBM and
DRAM still matches transformers, with its routing statistics (counted on the device, read once
at the end) equal to transformers' router choices. The sync-free expert computation equals the
counting one on the CPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

from hetplan.runtime.models.moe.layer import Expert, experts_forward, masked_experts_forward
from tests.moe.test_whole_blocks import FAMILIES, VOCAB, PROMPT_LEN, _check, _compile, _reference, _run
from tests.tiny_models import TINY_GPU_NODE, saved_moe_model

SYNCS = ("tolist", "item", "nonzero", "cpu")


class HostSync(AssertionError):
    pass


@pytest.fixture
def no_sync_on(monkeypatch):
    """-> a set that collects the GPU-lane calls; the methods in ``SYNCS`` raise HostSync when
    called from the thread named ``thread``."""
    calls = []

    def guard(name, original):
        def wrapped(*args, **kwargs):
            if threading.current_thread().name == "hetplan-gpu":
                raise HostSync(f"Tensor.{name} called in a GPU stage")
            return original(*args, **kwargs)
        return wrapped

    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "nonzero", guard("nonzero", torch.nonzero))
    from hetplan.runtime.executor import Executor
    execute = Executor._execute

    def counted(self, run, op, stream):
        if threading.current_thread().name == "hetplan-gpu":
            calls.append(op.task.kind)
        return execute(self, run, op, stream)

    monkeypatch.setattr(Executor, "_execute", counted)
    return calls


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    path = tmp_path_factory.mktemp("node") / "node.yaml"
    path.write_text(TINY_GPU_NODE)
    return str(path)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_split_moe_plan_runs_without_host_syncs_on_the_gpu_lane(family, node, tmp_path_factory, no_sync_on):
    model, directory = saved_moe_model(FAMILIES, family, tmp_path_factory)
    ids = torch.randint(0, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))
    ref = _reference(model, ids)
    plan = _compile(str(directory), node, "ilp", "300KiB")
    kinds = {t.kind for s in plan.schedule.values() for t in s.tasks if t.resource == "gpu"}
    assert {"moe_route", "moe_experts", "moe_merge"} <= kinds and "moe" not in kinds
    result = _run(plan, str(directory), ids, record=True)
    assert {"moe_route", "moe_experts", "moe_merge", "attn_core"} <= set(no_sync_on)
    _check(result, ref)
    for l, fractions in ref["routing"].items():
        assert list(result.routing.layers[l]) == pytest.approx(fractions, abs=1e-12)


def test_masked_experts_equal_the_counting_path_and_read_nothing_back(monkeypatch):
    g = torch.Generator().manual_seed(0)
    t, d, i, n_e, k = 7, 16, 12, 6, 2
    experts = {e: Expert(torch.randn(2 * i, d, generator=g), torch.randn(d, i, generator=g)) for e in range(n_e)}
    hidden = torch.randn(t, d, generator=g)
    ids = torch.stack([torch.randperm(n_e, generator=g)[:k] for _ in range(t)])     # [T, k], distinct per token
    weights = torch.rand(t, k, generator=g)
    subset = (0, 2, 3, 5)
    want = experts_forward(hidden, ids, weights, experts, subset)
    for name in SYNCS:
        monkeypatch.setattr(torch.Tensor, name, lambda *a, name=name, **kw: (_ for _ in ()).throw(HostSync(name)))
    got = masked_experts_forward(hidden, ids, weights, experts, subset)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert experts_forward(hidden, ids, weights, experts, subset, sync_free=True).equal(got)
    # a token whose experts are all outside the subset gets exactly 0
    outside = [tok for tok in range(t) if not set(ids[tok].numpy()) & set(subset)]
    assert all(torch.count_nonzero(got[tok]) == 0 for tok in outside)
