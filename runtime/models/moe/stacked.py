"""The GPU's experts as one stack per weight, and the gathered (decode) expert computation.

A block's dense (16/32-bit) experts are laid out one after the other in its buffer
(``runtime/residency.py``: every tensor of an expert back to back, the experts in id order), so
the ``gate_up`` matrices of the experts a device holds lie one expert's size apart in one
storage, and so do the ``down`` matrices. ``stack_experts`` views them as one tensor each,
``gate_up`` [m, 2I, D] and ``down`` [m, D, I] (no copy; ``experts[e]`` stay views into the
same memory; m = n when the n experts lie back to back, more when others lie between them),
plus ``slot`` [E] on the device: expert id -> its index in the stack, -1 for the experts the
subset lacks. Experts that are not so laid out (packed experts, a streamed phase's
hot experts in HBM beside cold ones in a staging slot) have no stack.

``gathered_experts_forward``: for T tokens choosing k experts each, every (token, choice) pair
gathers its expert's weights by a device-side index and the T k products run as one ``bmm``::

    slot   = stack.slot[ids]                        [T, k]   (-1: expert not in the subset)
    gate   = weights where slot >= 0, else 0        [T, k]
    W      = stack.gate_up[clamp(slot, 0)], stack.down[...]   T k experts' weights
    out[t] = sum over j of gate[t, j] * down_j(act(gate_j h_t) * up_j h_t)

A pair whose expert is not in the subset multiplies a valid slot's result by 0. No shape
depends on the routing and nothing is read back to the host. The gather moves T k experts'
weights (read, written, read again by the ``bmm``: ``hetplan.experts.GATHER_PASSES``), the
masked path (``layer.masked_experts_forward``) reads all n; ``sync_free_experts_forward`` picks
by ``hetplan.experts.gathers``, the rule the cost model prices. (torch's ``grouped_mm`` over
device-side offsets would read each hit expert once; it is not used here.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from hetplan.experts import gathers
from hetplan.runtime.models.moe.layer import activation, masked_experts_forward
from hetplan.runtime.models.moe.weights import BlockExperts

DENSE = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ExpertStack:
    """The experts of one subset as one tensor per weight."""
    ids: tuple
    """The subset's expert ids, ascending."""
    gate_up: torch.Tensor
    """[m, 2I, D], m >= len(ids): expert e's at index slot[e]."""
    down: torch.Tensor
    """[m, D, I]"""
    slot: torch.Tensor
    """int64 [E] on the stack's device: expert id -> stack index, -1 where not in ``ids``."""


def stack_experts(experts: Mapping, ids: Iterable[int], n_experts: int) -> ExpertStack | None:
    """The experts ``ids`` of ``experts`` as one stack, viewed in place; None when their weights
    are not dense contiguous tensors of one storage at equally spaced places (the same places,
    in the stack, for ``gate_up`` and ``down``)."""
    ids = tuple(sorted(ids))
    if not ids:
        return None
    parts = [experts[e] for e in ids]
    gate_up, down = _stacked([p.gate_up for p in parts]), _stacked([p.down for p in parts])
    if gate_up is None or down is None or gate_up[1] != down[1]:
        return None
    slot = torch.full((n_experts,), -1, dtype=torch.int64)
    slot[list(ids)] = torch.tensor(gate_up[1], dtype=torch.int64)
    return ExpertStack(ids, gate_up[0], down[0], slot.to(gate_up[0].device))


def weights_stack(weights: Mapping, ids: Iterable[int], n_experts: int) -> ExpertStack | None:
    """``stack_experts`` over a block's in-block tensors (``weights.BlockExperts``); None for a
    quantised block (its experts are dequantised one at a time when looked up)."""
    if not isinstance(weights, dict):
        return None
    ids = tuple(ids)
    return stack_experts(BlockExperts(weights, ids), ids, n_experts)


def stack_key(weights: Mapping, ids: tuple):
    """What identifies the memory of a block's experts ``ids`` across calls (a resident block's
    buffer, or the staging slot a streamed one is in): the address of the first expert's ``down``;
    None when there is nothing to stack."""
    first = weights.get(f"experts.{ids[0]}.down") if ids and isinstance(weights, dict) else None
    return first.data_ptr() if isinstance(first, torch.Tensor) else None


def _stacked(mats: list) -> tuple[torch.Tensor, tuple] | None:
    """(view [m, *shape] over one storage with a matrix every ``step`` elements from the first
    of ``mats`` on, index of each of ``mats`` in it), or None. The view may hold other tensors
    (another device's experts, say) between them: no index points there."""
    first = mats[0]
    if not isinstance(first, torch.Tensor) or first.dtype not in DENSE or not first.is_contiguous():
        return None
    storage = first.untyped_storage().data_ptr()
    offsets = []
    for m in mats:
        if not isinstance(m, torch.Tensor) or m.dtype != first.dtype or m.shape != first.shape \
                or not m.is_contiguous() or m.untyped_storage().data_ptr() != storage:
            return None
        offsets.append(m.storage_offset())
    base = min(offsets)
    step = min((b - a for a, b in zip(sorted(offsets), sorted(offsets)[1:])), default=first.numel())
    if step < first.numel() or any((o - base) % step for o in offsets):
        return None
    index = tuple((o - base) // step for o in offsets)
    view = first.as_strided((max(index) + 1, *first.shape), (step, *first.stride()), base)
    return view, index


def gathered_experts_forward(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                             stack: ExpertStack, act: str = "silu") -> torch.Tensor:
    """The contribution of ``stack``'s experts (module docstring). hidden: [T, D]; ids, weights:
    [T, k] -> [T, D] in hidden's dtype, equal to ``layer.experts_forward`` over the stack's ids
    up to the order of the sums."""
    t, k = ids.shape
    slot = stack.slot[ids]                                                   # [T, k]
    gate = torch.where(slot >= 0, weights, torch.zeros_like(weights))        # [T, k]
    rows = slot.clamp(min=0).reshape(-1)                                     # [T * k]
    gate_up = stack.gate_up.index_select(0, rows)                            # [T k, 2I, D]
    down = stack.down.index_select(0, rows)                                  # [T k, D, I]
    x = hidden.unsqueeze(1).expand(t, k, hidden.shape[1]).reshape(t * k, 1, -1)  # [T k, 1, D]
    g, u = torch.bmm(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)            # [T k, 1, I] each
    y = torch.bmm(activation(act)(g) * u, down.transpose(1, 2)).view(t, k, -1)  # [T, k, D]
    return (y * gate[..., None]).to(hidden.dtype).sum(dim=1)


def sync_free_experts_forward(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                              experts: Mapping, subset: Iterable[int], act: str = "silu",
                              stack: ExpertStack | None = None) -> torch.Tensor:
    """``layer.experts_forward`` without a host sync: gathered when the subset has a ``stack``
    and ``gathers(T, k, |subset|)`` (GATHER_PASSES T k < |subset|: a decode step over many
    experts), else masked (every expert of the subset on all T tokens; packed experts always)."""
    subset = tuple(sorted(subset))
    if stack is not None and stack.ids == subset and gathers(ids.shape[0], ids.shape[1], len(subset)):
        return gathered_experts_forward(hidden, ids, weights, stack, act)
    return masked_experts_forward(hidden, ids, weights, experts, subset, act)
