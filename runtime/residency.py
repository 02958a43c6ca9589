"""Put every block's weights and every KV cache in the tier the plan chose, once, before running.

- ``gpu`` blocks: each tensor copied straight from its source into GPU memory.
- blocks streamed in some phase: all their tensors packed into one flat host buffer (pinned on a
  real GPU), so a ``load`` task is one copy of ``weight_bytes`` into a staging slot; the GPU holds
  a ring of ``depth`` preallocated slots, each as large as the largest streamed block, and a
  streamed stage computes with views into its slot. CPU stages of such a block use views of the
  flat host buffer.
- ``cpu`` blocks: the source's tensors as they are (memory-mapped checkpoint pages).
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
    tensors: dict
    """local name -> tensor in ``tier``."""
    flat: torch.Tensor | None = None
    """The host buffer holding every tensor of a streamed block, in ``layout`` order."""
    layout: tuple = ()
    """((local name, offset in elements, shape), ...) inside ``flat`` and inside a slot."""


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
            if p["weights"] == "gpu":
                bw = self._resident(p, specs[p["block"]], source, dtype)
            elif p["block"] in streamed:
                bw = self._packed(p, specs[p["block"]], source, dtype)
            else:
                bw = self._host(p, specs[p["block"]], source, dtype)
            self.blocks[p["block"]] = bw
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

    def _resident(self, p, specs, source, dtype) -> BlockWeights:
        tensors = {}
        for t in specs:
            out = self.devices.empty("gpu", t.shape, dtype, f"weight {t.checkpoint} of {p['block']}")
            source.fill(t, out)
            tensors[t.local] = out
        return BlockWeights(p["block"], p["kind"], p["layer"], "gpu", tensors)

    def _packed(self, p, specs, source, dtype) -> BlockWeights:
        layout, offset = [], 0
        for t in specs:
            layout.append((t.local, offset, tuple(t.shape)))
            offset += _numel(t.shape)
        flat = self.devices.empty("cpu", (offset,), dtype, f"streamed weights of {p['block']}", pinned=True)
        tensors = _views(flat, layout)
        for t in specs:
            source.fill(t, tensors[t.local])
        return BlockWeights(p["block"], p["kind"], p["layer"], "cpu", tensors, flat, tuple(layout))

    def _host(self, p, specs, source, dtype) -> BlockWeights:
        tensors = {}
        for t in specs:
            tensors[t.local] = source.view(t, dtype)
            self.devices.count("cpu", tensors[t.local], f"weight {t.checkpoint} of {p['block']}")
        return BlockWeights(p["block"], p["kind"], p["layer"], "cpu", tensors)

    # -- what a task touches ------------------------------------------------------------------
    def weights(self, block: str, device: str, slot: int | None) -> dict:
        """The tensors a stage of ``block`` computes with on ``device`` (``gpu``/``cpu``):
        resident tensors, views into staging slot ``slot``, host tensors, or none (an attention
        core beside its KV cache, away from its block's weights, reads none)."""
        bw = self.blocks[block]
        if device == bw.tier:
            return bw.tensors
        if slot is None or bw.flat is None:
            return {}
        key = (block, slot)
        if key not in self._views:
            self._views[key] = _views(self.slots[slot], bw.layout)
        return self._views[key]

    def load(self, block: str, slot: int) -> None:
        """Copy a streamed block's weights into staging slot ``slot`` (asynchronously on CUDA:
        the caller is on the ``h2d`` stream)."""
        flat = self.blocks[block].flat
        self.slots[slot][:flat.numel()].copy_(flat, non_blocking=self.devices.cuda)


def _views(buf: torch.Tensor, layout) -> dict:
    return {name: buf[off:off + _numel(shape)].view(shape) for name, off, shape in layout}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
