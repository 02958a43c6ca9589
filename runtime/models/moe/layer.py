"""Mixture-of-experts layers, split the way plans split them.

An MoE layer is three pieces: the *router* picks ``k`` experts per token and their weights,
the *routed experts* (each a SwiGLU MLP of width ``moe_intermediate``) run on the tokens that
chose them, and optional *shared experts* run on every token. A plan keeps some experts on the
GPU and the rest on the CPU, so ``experts_forward`` computes the contribution of any subset of
experts; the contributions of a partition of the experts add up to the full layer::

    out = shared(x) + sum over subsets S of experts_forward(x, ids, weights, experts, S)

Routing per family (``route``), exactly as each family's reference implementation does it:

- mixtral: p = softmax(logits); top-k of p; weights renormalised to sum to 1.
- qwen3_moe: p = softmax(logits); top-k of p; renormalised when ``norm_topk_prob``.
- deepseek_v3 (``topk_method`` noaux_tc): s = sigmoid(logits); choice = s +
  ``e_score_correction_bias``; experts split into ``n_group`` groups scored by the sum of their
  two best choices; only the best ``topk_group`` groups compete; top-k of choice; weights = s
  of the chosen experts, divided by their sum (+1e-20) when ``norm_topk_prob``, times
  ``routed_scaling_factor``.
- deepseek_v2 checkpoints (``topk_method`` greedy | group_limited_greedy): p = softmax(logits);
  group_limited_greedy keeps the ``topk_group`` groups with the highest max; top-k of p;
  weights renormalised when ``norm_topk_prob`` (and k > 1), else times ``routed_scaling_factor``.

Router logits and weights are computed in fp32. ``RoutingRecorder`` counts the experts chosen
per layer and writes the ``hetplan.routing`` statistics format.

This module knows tensors and the routing rules; it knows nothing about plans, devices,
streams or checkpoints (``runtime/models/moe/weights.py`` maps checkpoint names to these pieces).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hetplan.runtime.kernels.linear import PackedLinear, linear
from hetplan.errors import HetplanError
from hetplan.model import ModelSpec
from hetplan.routing import RoutingStats, stats_from_counts, write_routing

ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}

_V3_ROUTING = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
                   scoring_func="sigmoid")
_V2_ROUTING = dict(n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                   scoring_func="softmax")
DEEPSEEK_DEFAULTS = {"noaux_tc": _V3_ROUTING, "greedy": _V2_ROUTING, "group_limited_greedy": _V2_ROUTING}
"""topk_method -> the routing settings a config.json may leave out, with the defaults of
transformers' DeepseekV3Config (noaux_tc) and DeepseekV2Config (greedy, group_limited_greedy)."""


@dataclass(frozen=True)
class Expert:
    """One SwiGLU MLP: y = down(act(gate x) * up x); gate and up stacked in one matrix."""
    gate_up: torch.Tensor
    """[2 * I, D]: the gate projection's rows, then the up projection's."""
    down: torch.Tensor
    """[D, I]"""

    @classmethod
    def from_parts(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> "Expert":
        if isinstance(gate, PackedLinear):
            return cls(PackedLinear.cat([gate, up]), down)
        return cls(torch.cat([gate, up], dim=0), down)


@dataclass(frozen=True)
class Router:
    weight: torch.Tensor
    """[E, D] router (``gate``) projection."""
    correction_bias: torch.Tensor | None = None
    """[E] deepseek_v3's ``e_score_correction_bias``: steers the choice, not the weights."""


@dataclass(frozen=True)
class MoeLayer:
    router: Router
    experts: Mapping
    """expert id -> Expert; may hold only the experts of one device."""
    shared: Expert | None = None
    """The shared experts of deepseek, fused into one MLP of width n_shared * moe_intermediate."""


def swiglu(x: torch.Tensor, expert: Expert, act: str = "silu") -> torch.Tensor:
    """down(act(x gate^T) * (x up^T)); x: [T, D] -> [T, D]."""
    gate, up = linear(x, expert.gate_up).chunk(2, dim=-1)  # [T, I] each
    return linear(activation(act)(gate) * up, expert.down)


def activation(name: str):
    if name not in ACTIVATIONS:
        raise HetplanError(f"hidden_act: activation {name!r} is not supported for expert MLPs; "
                           f"supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


# -- routing -------------------------------------------------------------------------------------
def route(hidden: torch.Tensor, router: Router, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose ``k`` experts per token. hidden: [T, D] -> (ids [T, k] int64, weights [T, k]);
    weights are fp32, except qwen3_moe's, which its reference casts to the hidden dtype."""
    if spec.arch == "mixtral":
        return _softmax_topk(linear(hidden, router.weight), spec.experts_per_token, renormalise=True)
    if spec.arch == "qwen3_moe":
        logits = linear(hidden, router.weight)
        ids, weights = _softmax_topk(logits, spec.experts_per_token,
                                     renormalise=bool(spec.extra.get("norm_topk_prob", True)))
        return ids, weights.to(logits.dtype)
    if spec.arch == "deepseek_v3":
        return _deepseek(hidden, router, spec)
    raise HetplanError(f"model_type {spec.arch!r} has no experts to route")


def _softmax_topk(logits: torch.Tensor, k: int, renormalise: bool):
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def deepseek_settings(spec: ModelSpec) -> dict:
    """The deepseek routing settings of ``spec``, defaults filled in and checked."""
    method = spec.extra.get("topk_method", "noaux_tc")
    if method not in DEEPSEEK_DEFAULTS:
        raise HetplanError(f"topk_method: {method!r} is not supported; supported: "
                           f"{', '.join(DEEPSEEK_DEFAULTS)}")
    s = dict(DEEPSEEK_DEFAULTS[method], topk_method=method)
    s.update({k: v for k, v in spec.extra.items() if k in s and v is not None})
    if s["scoring_func"] != DEEPSEEK_DEFAULTS[method]["scoring_func"]:
        raise HetplanError(f"scoring_func: {s['scoring_func']!r} with topk_method {method!r} is "
                           f"not a deepseek configuration hetplan knows; expected "
                           f"{DEEPSEEK_DEFAULTS[method]['scoring_func']!r}")
    if method != "greedy":
        g, tg = s["n_group"], s["topk_group"]
        per_group = spec.n_experts // g if g > 0 and spec.n_experts % g == 0 else 0
        if per_group < (2 if method == "noaux_tc" else 1) or not 0 < tg <= g \
                or spec.experts_per_token > tg * per_group:
            least = ", at least 2 per group," if method == "noaux_tc" else ""
            raise HetplanError(f"n_group/topk_group: {spec.n_experts} experts in {g} groups, keeping "
                               f"{tg}, is not a valid {method} routing: groups must split the "
                               f"experts evenly{least} and the kept groups must hold at least "
                               f"num_experts_per_tok = {spec.experts_per_token} experts")
    return s


def _deepseek(hidden: torch.Tensor, router: Router, spec: ModelSpec):
    s = deepseek_settings(spec)
    k, n_e = spec.experts_per_token, spec.n_experts
    weight = router.weight if isinstance(router.weight, PackedLinear) else router.weight.float()
    logits = linear(hidden.float(), weight)  # [T, E]
    if s["topk_method"] == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores if router.correction_bias is None else scores + router.correction_bias.float()
        group_scores = choice.view(-1, s["n_group"], n_e // s["n_group"]).topk(2, dim=-1)[0].sum(-1)
        masked = _keep_groups(choice, group_scores, s, float("-inf"))
        ids = torch.topk(masked, k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if s["norm_topk_prob"]:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * s["routed_scaling_factor"]
    scores = logits.softmax(dim=-1)
    if s["topk_method"] == "group_limited_greedy":
        group_scores = scores.view(-1, s["n_group"], n_e // s["n_group"]).max(dim=-1).values
        scores = _keep_groups(scores, group_scores, s, 0.0)
    weights, ids = torch.topk(scores, k, dim=-1)
    if k > 1 and s["norm_topk_prob"]:
        return ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * s["routed_scaling_factor"]


def _keep_groups(scores: torch.Tensor, group_scores: torch.Tensor, s: dict, fill: float):
    """Replace the scores of experts outside the ``topk_group`` best groups by ``fill``."""
    n_t, n_g = group_scores.shape
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, torch.topk(group_scores, s["topk_group"], dim=-1)[1], True)  # [T, G]
    keep = keep.unsqueeze(-1).expand(n_t, n_g, scores.shape[-1] // n_g).reshape(n_t, -1)
    return scores.masked_fill(~keep, fill)


# -- experts -------------------------------------------------------------------------------------
def experts_forward(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    experts: Mapping, subset: Iterable[int], act: str = "silu",
                    sync_free: bool = False) -> torch.Tensor:
    """The routed experts' contribution of the experts in ``subset`` only:

        out[t] = sum over j with ids[t, j] in subset of weights[t, j] * expert_{ids[t, j]}(hidden[t])

    hidden: [T, D]; ids, weights: [T, k]; ``experts`` must hold every id of ``subset`` (and may
    hold only those). All tensors on one device. Returns [T, D] in hidden's dtype.

    By default (the CPU's way): one read of the per-expert token counts (a host sync on a GPU),
    then one gather, SwiGLU and scatter-add per expert hit; each expert is looked up only when
    used, and used before the next is looked up. ``sync_free`` (a GPU stage): no value goes to
    the host; every expert of ``subset`` runs on all T tokens, masked by its gate per token
    (``masked_experts_forward``).
    """
    if sync_free:
        return masked_experts_forward(hidden, ids, weights, experts, subset, act)
    out = torch.zeros_like(hidden)
    k = ids.shape[1]
    flat_ids = ids.reshape(-1)  # [T * k]
    flat_weights = weights.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    for e in sorted(subset):
        if e >= len(counts) or counts[e] == 0:
            continue
        rows = order[starts[e]:starts[e + 1]]  # positions in [T * k] that chose e
        tokens = rows // k
        y = swiglu(hidden[tokens], experts[e], act) * flat_weights[rows, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def masked_experts_forward(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           experts: Mapping, subset: Iterable[int], act: str = "silu") -> torch.Tensor:
    """``experts_forward`` without a host sync: shapes never depend on the routing.

        g_e[t] = sum over j of weights[t, j] * [ids[t, j] == e]     (0 when t did not choose e)
        out    = sum over e in subset, ascending, of g_e[:, None] * expert_e(hidden)

    Each expert is used once, in the same order as the counting path, and a token that did not
    choose it adds an exact 0, so the sums agree with it up to the GEMMs' row blocking. The cost
    is every expert of ``subset`` on all T tokens: T * |subset| expert rows instead of the T * k
    the tokens chose, and every expert's weights read. A decode step over many experts gathers the
    chosen ones instead (``stacked.sync_free_experts_forward``); packed (quantised) experts, and
    experts not laid out as one stack, always run here."""
    out = torch.zeros_like(hidden)                                            # [T, D]
    for e in sorted(subset):
        gate = (weights * (ids == e)).sum(dim=-1)                             # [T]
        y = swiglu(hidden, experts[e], act) * gate[:, None]                  # as the counting path multiplies
        out.add_(y.to(out.dtype))
    return out


def moe_forward(hidden: torch.Tensor, layer: MoeLayer, spec: ModelSpec,
                subsets: Iterable[Iterable[int]], recorder: "RoutingRecorder | None" = None,
                l: int | None = None) -> torch.Tensor:
    """A whole MoE layer (no norm, no residual): route, every subset's experts, shared experts.

    ``subsets`` must partition the experts (e.g. those on the GPU and those on the CPU); here
    they run one after the other on ``hidden``'s device, which is what an executor overlaps.
    hidden: [T, D] -> [T, D].
    """
    subsets = [frozenset(s) for s in subsets]
    if sum(len(s) for s in subsets) != spec.n_experts or frozenset().union(*subsets) != frozenset(
            range(spec.n_experts)):
        raise ValueError(f"expert subsets {[sorted(s) for s in subsets]} do not partition "
                         f"0..{spec.n_experts - 1}")
    ids, weights = route(hidden, layer.router, spec)
    if recorder is not None:
        recorder.record(l, ids)
    out = sum(experts_forward(hidden, ids, weights, layer.experts, s, spec.act) for s in subsets)
    if layer.shared is not None:
        out = out + swiglu(hidden, layer.shared, spec.act)
    return out


# -- routing statistics --------------------------------------------------------------------------
class RoutingRecorder:
    """Counts, per MoE layer and expert, the tokens that chose the expert.

    Counts accumulate on the device of the ids they come from (no host sync per call);
    ``stats()`` reads them once.
    """

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self._counts: dict[int, torch.Tensor] = {}
        self._tokens: dict[int, int] = {}

    def record(self, l: int, ids: torch.Tensor) -> None:
        """Add the choices ``ids`` ([T, k]) made in layer ``l``."""
        if not self.spec.is_moe_layer(l):
            raise ValueError(f"layer {l} is not an MoE layer of {self.spec.name!r}")
        c = torch.bincount(ids.reshape(-1), minlength=self.spec.n_experts)
        self._counts[l] = c if l not in self._counts else self._counts[l] + c
        self._tokens[l] = self._tokens.get(l, 0) + ids.shape[0]

    def counts(self) -> dict:
        """layer -> list of per-expert token counts."""
        return {l: c.tolist() for l, c in sorted(self._counts.items())}

    def stats(self) -> RoutingStats:
        tokens = set(self._tokens.values())
        if len(tokens) > 1:
            raise ValueError(f"layers routed different numbers of tokens: {self._tokens}")
        return stats_from_counts(self.spec, self.counts(), tokens.pop() if tokens else 0)

    def write(self, path) -> None:
        write_routing(path, self.stats())
