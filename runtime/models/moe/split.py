"""An MoE block split between HBM and DRAM, as four stages (``hetplan.experts``).

A block resident on the GPU keeps there its norm, router (+ deepseek's correction bias), shared
experts and its *hot* routed experts; its *cold* experts stay in DRAM and run on the CPU. The
GPU part's weights define the split: an expert is hot exactly when the GPU part holds its
tensors (``HotSet``), so the pairs the router sends to the CPU are those of the experts the CPU
part holds. With T = B * S tokens, k experts per token, C cold experts and P (token, cold expert)
pairs, the route sends a fixed N = T * min(k, C) >= P rows (no host sync to learn P: the first P
are the cold pairs, the rest padding marked with expert id E and gate 0)::

    moe_route   gpu  x -> h [T, D] (normed), ids [T, k], gates [T, k] (routing weights), and the
                     cold pairs grouped by expert (ascending, stable), then padding:
                     cold_x [N, D] (rows of h), cold_pos [N] (token), cold_ids [N] (expert, E for
                     padding), cold_gates [N] (0 for padding)
    moe_experts gpu  x, h, ids, gates -> x + shared(h) + sum over hot pairs of gate * expert(h)
    moe_cold    cpu  cold_x, cold_ids, cold_gates -> cold_y [N, D] = gate * expert(cold_x), one
                     SwiGLU per cold expert over its contiguous rows, 0 on padding rows
    moe_merge   gpu  x, cold_y, cold_pos -> x with cold_y added at rows cold_pos

Only the cold pairs' rows cross to the CPU and only their outputs come back. In a phase that
streams the cold experts into a staging slot, the GPU stages' weights hold them too: the HotSet
is complete, ``moe_route`` sends no pair and ``moe_experts`` computes every expert. Every stage
computes as the whole-block ``moe`` stage does (``runtime/models/moe/layer.py``), so a split block's output
equals the unsplit one's up to the order of the sums.

Host syncs: none in the GPU stages. ``moe_route`` and ``moe_merge`` have fixed shapes (N rows
cross instead of P, equal when every cold pair of a token is cold, at most T * min(k, C));
``moe_experts`` runs sync-free whatever the device (it is a GPU stage in every plan): gathering
the chosen hot experts' weights from their stack in a decode step over many hot experts, else
each hot expert on every token masked by its gate (``stacked.sync_free_experts_forward``).
``moe_cold`` reads its counts on the CPU, where the copy has already landed.
Knows nothing about plans, queues or tiers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hetplan.model import ModelSpec
from hetplan.runtime.backend import StageCall
from hetplan.runtime.models.dense import _rms_norm
from hetplan.runtime.models.moe.layer import Router, route, swiglu
from hetplan.runtime.models.moe.stacked import ExpertStack, sync_free_experts_forward
from hetplan.runtime.models.moe.weights import BlockExperts, block_expert

READS = {"moe_route": ("x",), "moe_experts": ("x", "h", "ids", "gates"),
         "moe_cold": ("cold_x", "cold_ids", "cold_gates"), "moe_merge": ("x", "cold_y", "cold_pos")}
WRITES = {"moe_route": ("h", "ids", "gates", "cold_x", "cold_pos", "cold_ids", "cold_gates"),
          "moe_experts": ("x",), "moe_cold": ("cold_y",), "moe_merge": ("x",)}


@dataclass(frozen=True)
class HotSet:
    """The routed experts a split block's GPU part holds."""
    ids: tuple
    """Hot expert ids, ascending."""
    mask: torch.Tensor
    """bool [E] on the GPU part's device: mask[e] when expert e is hot."""
    complete: bool
    """Every expert is hot: no pair goes to the CPU."""

    @classmethod
    def of(cls, weights: Mapping, n_experts: int, device: torch.device) -> "HotSet":
        ids = tuple(e for e in range(n_experts) if f"experts.{e}.down" in weights)
        mask = torch.tensor([e in ids for e in range(n_experts)], dtype=torch.bool)
        return cls(ids, mask.to(device), len(ids) == n_experts)


def route_stage(c: StageCall, spec: ModelSpec, hot: HotSet) -> dict:
    w, x = c.weights, c.inputs["x"]
    h = _rms_norm(x, w["norm"], spec.norm_eps).reshape(-1, spec.hidden)      # [T, D], T = B * S
    ids, gates = route(h, Router(w["router"], w.get("router_bias")), spec)  # [T, k] each
    flat_ids, flat_gates = ids.reshape(-1), gates.reshape(-1)                 # [T * k]
    n_e, k = spec.n_experts, ids.shape[1]
    if hot.complete:
        rows = flat_ids.new_empty((0,))
        cold_ids, cold_gates = flat_ids[rows], flat_gates[rows]
    else:
        n_rows = h.shape[0] * min(k, n_e - len(hot.ids))                      # N >= P
        key = torch.where(hot.mask[flat_ids], n_e, flat_ids)                  # hot pairs sort last
        rows = torch.argsort(key, stable=True)[:n_rows]                       # [N] cold pairs by expert, token-major
        cold_ids = key[rows]                                                  # [N] E marks padding
        cold_gates = torch.where(cold_ids < n_e, flat_gates[rows], torch.zeros_like(flat_gates[rows]))
    pos = rows // k                                                           # [N] token of each pair
    return {"h": h, "ids": ids, "gates": gates, "cold_x": h[pos], "cold_pos": pos,
            "cold_ids": cold_ids, "cold_gates": cold_gates}


def experts_stage(c: StageCall, spec: ModelSpec, hot: HotSet, stack: ExpertStack | None = None) -> dict:
    w, x, h = c.weights, c.inputs["x"], c.inputs["h"]
    if hot.ids:
        y = sync_free_experts_forward(h, c.inputs["ids"], c.inputs["gates"], BlockExperts(w, hot.ids), hot.ids,
                                      spec.act, stack)                        # no host sync
    else:
        y = torch.zeros_like(h)                                               # [T, D]
    if spec.n_shared_experts:
        y += swiglu(h, block_expert(w, "shared"), spec.act)
    return {"x": y.view_as(x).add_(x)}


def cold_stage(c: StageCall, spec: ModelSpec) -> dict:
    """The cold pairs arrive grouped by expert (``route_stage``), so each expert's rows are one
    contiguous slice, padding (expert id E) last; experts are looked up one at a time, each used
    before the next; padding rows stay 0."""
    x, ids, gates = c.inputs["cold_x"], c.inputs["cold_ids"], c.inputs["cold_gates"]  # [N, D], [N], [N]
    y = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(torch.bincount(ids, minlength=spec.n_experts + 1)[:spec.n_experts].tolist()):
        if n:
            rows = slice(start, start + n)
            out = swiglu(x[rows], block_expert(c.weights, f"experts.{e}"), spec.act) * gates[rows, None]
            y[rows] = out.to(y.dtype)
            start += n
    return {"cold_y": y}


def merge_stage(c: StageCall) -> dict:
    x = c.inputs["x"]                                                         # [B, S, D]
    y = x.reshape(-1, x.shape[-1]).index_add(0, c.inputs["cold_pos"], c.inputs["cold_y"])
    return {"x": y.view_as(x)}
