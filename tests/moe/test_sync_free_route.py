"""The split MoE route runs on the GPU without a host sync: its outputs have shapes fixed by the
token count, k and the number of cold experts, whatever the router chose; the first rows are the
cold (token, expert) pairs grouped by expert, as a loop over the pairs finds them, the rest
padding that the CPU stage leaves at 0 and the merge adds as 0."""

from __future__ import annotations

import torch
from tests.conftest import tiny_spec

from hetplan.runtime.backend import StageCall, Step
from hetplan.runtime.models.moe.split import HotSet, cold_stage, merge_stage, route_stage

E, K, D, I, T = 8, 2, 16, 12, 5
SPEC = tiny_spec(arch="mixtral", hidden=D, n_experts=E, experts_per_token=K, moe_intermediate=I,
                 weight_dtype="fp32", kv_dtype="fp32")
HOT = (0, 3, 5)


def weights(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = {"norm": torch.ones(D), "router": torch.randn(E, D, generator=g)}
    for e in range(E):
        w[f"experts.{e}.gate_up"] = torch.randn(2 * I, D, generator=g) * 0.1
        w[f"experts.{e}.down"] = torch.randn(D, I, generator=g) * 0.1
    return w


def call(kind, w, inputs) -> StageCall:
    return StageCall(kind=kind, block="moe_0", layer=0, device=torch.device("cpu"), weights=w, inputs=inputs,
                     step=Step("decode", 0, 1, T))


def routed(seed: int):
    w = weights(seed)
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(seed + 100))
    hot = HotSet.of({f"experts.{e}.down": None for e in HOT}, E, torch.device("cpu"))
    return w, x, route_stage(call("moe_route", w, {"x": x}), SPEC, hot)


def test_route_shapes_do_not_depend_on_the_routing():
    shapes = set()
    for seed in range(6):
        _, _, out = routed(seed)
        shapes.add(tuple((k, tuple(v.shape)) for k, v in sorted(out.items())))
    assert len(shapes) == 1
    n = dict(next(iter(shapes)))["cold_ids"][0]
    assert n == T * min(K, E - len(HOT))


def test_route_lists_the_cold_pairs_by_expert_then_padding():
    for seed in range(6):
        _, _, out = routed(seed)
        ids = out["ids"].tolist()
        pairs = sorted(((e, t) for t in range(T) for e in ids[t] if e not in HOT), key=lambda p: p[0])
        p = len(pairs)
        assert out["cold_ids"][:p].tolist() == [e for e, _ in pairs]
        assert out["cold_pos"][:p].tolist() == [t for _, t in pairs]
        assert out["cold_ids"][p:].tolist() == [E] * (out["cold_ids"].numel() - p)
        assert torch.all(out["cold_gates"][p:] == 0)


def test_cold_and_merge_add_exactly_the_cold_experts_contribution():
    for seed in range(3):
        w, x, out = routed(seed)
        y = cold_stage(call("moe_cold", w, {k: out[k] for k in ("cold_x", "cold_ids", "cold_gates")}), SPEC)["cold_y"]
        merged = merge_stage(call("moe_merge", w, {"x": x, "cold_y": y, "cold_pos": out["cold_pos"]}))["x"]
        # reference: a loop over tokens and their choices, cold experts only
        want = x.clone().reshape(T, D)
        h, ids, gates = out["h"], out["ids"], out["gates"]
        for t in range(T):
            for j in range(K):
                e = int(ids[t, j])
                if e in HOT:
                    continue
                gate, up = (h[t] @ w[f"experts.{e}.gate_up"].T).chunk(2)
                want[t] += gates[t, j] * (w[f"experts.{e}.down"] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(merged.reshape(T, D), want, rtol=1e-5, atol=1e-6)
