"""Put every block's weights and every KV cache in the tier the plan chose, once, before running.

Each block's tensors are copied, one at a time and straight from the source (a memory-mapped
checkpoint, or random values), into one flat buffer of the block's tier (exactly the block's
weight bytes); the block computes with views into it, including one view over each group of
projections the backend fuses (``fused()``: parts laid back to back). So the process holds one
copy of the weights, in anonymous memory (decode on the CPU reads it faster than file-backed
pages).

- ``gpu`` blocks: the buffer is in GPU memory.
- blocks streamed in some phase: the buffer is in host memory, pinned on a real GPU, so a
  ``load`` task is one copy of the block into a staging slot; the GPU holds a ring of ``depth``
  preallocated slots, each as large as the largest streamed block, and a streamed stage computes
  with the same views laid over its slot. CPU stages of such a block use the host buffer.
- ``cpu`` blocks: the buffer is in host memory.
- KV caches: ``[B, T, ...]`` tensors per attention block in the tier of its ``kv`` (pinned host
  memory when a GPU copies the prompt's KV into it).

Everything is allocated here, through ``Devices`` (which counts it); nothing during a step.
Knows nothing about the schedule beyond which slot a block uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.plan import Plan
from hetplan.runtime.devices import Devices


@dataclass(frozen=True)
class BlockWeights:
    name: str
    kind: str
    layer: int | None
    tier: str
    """``gpu`` (resident) or ``cpu`` (host memory; streamed or CPU-computed)."""
    flat: torch.Tensor
    """The buffer holding every tensor of the block, in ``layout`` order."""
    layout: tuple
    """((local name, offset in elements, shape), ...) inside ``flat`` and inside a slot."""
    tensors: dict
    """local name -> view into ``flat``."""


def check_placement(plan: Plan) -> None:
    """Refuse placements the schedule has no tasks for: execution on the GPU of weights that are
    not resident there, streaming of resident weights, a GPU KV cache beside a CPU block."""
    for p in plan.placement:
        for phase in PHASES:
            ex = p["exec"][phase]
            bad = (ex == "gpu") != (p["weights"] == "gpu") or (p["kv"] == "gpu" and ex == "cpu")
            if bad:
                raise HetplanError(f"plan placement of block {p['block']}: weights {p['weights']}, "
                                   f"{phase} exec {ex}, kv {p['kv']} cannot be executed (no task moves "
                                   f"those weights or caches); recompile the plan with `hetplan compile`")


class Residency:
    """Every block's weights and KV cache, placed; the staging ring; loads into it."""

    def __init__(self, plan: Plan, backend, source, devices: Devices, dtype: torch.dtype,
                 kv_dtype: torch.dtype, batch: int, max_tokens: int, progress=None):
        check_placement(plan)
        self.devices = devices
        self.fused = backend.fused() if hasattr(backend, "fused") else {}
        self.blocks: dict[str, BlockWeights] = {}
        entries = list(plan.placement)
        specs = {p["block"]: backend.block_tensors(p["block"], p["kind"], p["layer"]) for p in entries}
        for p in entries:  # check every tensor before placing any
            for t in specs[p["block"]]:
                source.check(t, dtype, f"block {p['block']}")
        streamed = {p["block"] for p in entries if any(p["exec"][ph] == "stream" for ph in PHASES)}
        for i, p in enumerate(entries):
            if progress:
                progress("loading", i, len(entries))
            tier = "gpu" if p["weights"] == "gpu" else "cpu"
            self.blocks[p["block"]] = self._place(p, specs[p["block"]], source, dtype, tier,
                                                  pinned=p["block"] in streamed)
        if progress:
            progress("loading", len(entries), len(entries))
        slot_numel = max((self.blocks[b].flat.numel() for b in streamed), default=0)
        self.slots = [devices.empty("gpu", (slot_numel,), dtype, f"staging slot {s}")
                      for s in range(plan.staging["depth"] if streamed else 0)]
        self._views = {}
        kv_down = {t.block for t in plan.schedule["prefill"].tasks if t.kind == "kv_down"}
        self.kv, self.kv_tier = {}, {}
        for p in entries:
            if p["kv"] is None:
                continue
            self.kv[p["block"]] = {
                name: devices.empty(p["kv"], shape, kv_dtype, f"KV cache {name} of {p['block']}",
                                    pinned=p["block"] in kv_down).zero_()
                for name, shape in backend.kv_shapes(batch, max_tokens).items()}
            self.kv_tier[p["block"]] = p["kv"]

    def _place(self, p, specs, source, dtype, tier: str, pinned: bool) -> BlockWeights:
        layout, offset = [], 0
        for t in specs:
            layout.append((t.local, offset, tuple(t.shape)))
            offset += _numel(t.shape)
        flat = self.devices.empty(tier, (offset,), dtype, f"weights of {p['block']}", pinned=pinned)
        tensors = _views(flat, layout, self.fused)
        for t in specs:
            source.fill(t, tensors[t.local])
        return BlockWeights(p["block"], p["kind"], p["layer"], tier, flat, tuple(layout), tensors)

    # -- what a task touches ------------------------------------------------------------------
    def weights(self, block: str, device: str, slot: int | None) -> dict:
        """The tensors a stage of ``block`` computes with on ``device`` (``gpu``/``cpu``):
        resident tensors, views into staging slot ``slot``, host tensors, or none (an attention
        core beside its KV cache, away from its block's weights, reads none)."""
        bw = self.blocks[block]
        if device == bw.tier:
            return bw.tensors
        if slot is None or not self.slots:
            return {}
        key = (block, slot)
        if key not in self._views:
            self._views[key] = _views(self.slots[slot], bw.layout, self.fused)
        return self._views[key]

    def load(self, block: str, slot: int) -> None:
        """Copy a streamed block's weights into staging slot ``slot`` (asynchronously on CUDA:
        the caller is on the ``h2d`` stream)."""
        flat = self.blocks[block].flat
        self.slots[slot][:flat.numel()].copy_(flat, non_blocking=self.devices.cuda)


def _views(buf: torch.Tensor, layout, fused: dict) -> dict:
    """local name -> view of ``buf``; plus, for each ``fused`` name whose parts lie back to back
    with equal trailing dims, one view over their concatenation along the first dim."""
    views = {name: buf[off:off + _numel(shape)].view(shape) for name, off, shape in layout}
    where = {name: (off, shape) for name, off, shape in layout}
    for name, parts in fused.items():
        if not all(p in where for p in parts):
            continue
        spans = [where[p] for p in parts]
        adjacent = all(off + _numel(shape) == spans[i + 1][0] for i, (off, shape) in enumerate(spans[:-1]))
        if adjacent and len({shape[1:] for _, shape in spans}) == 1:
            shape = (sum(s[0] for _, s in spans),) + spans[0][1][1:]
            views[name] = buf[spans[0][0]:spans[0][0] + _numel(shape)].view(shape)
    return views


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
