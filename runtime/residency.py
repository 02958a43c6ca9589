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
- split MoE blocks (weights ``gpu`` with cold experts, ``hetplan.experts``): two buffers, the
  block's tensors less its cold experts' in GPU memory, the cold experts' in host memory
  (plain, unpinned: only the CPU reads them). Stages on the GPU see the first part, the CPU's
  ``moe_cold`` the second; which tensors belong to an expert the backend says (``expert_of``).
- KV caches: ``[B, T, ...]`` tensors per attention block in the tier of its ``kv`` (pinned host
  memory when a GPU copies the prompt's KV into it).

A plan with a quantised weight dtype (``hetplan.runtime.quant``) stores each block as bytes: its
linear weights packed, then its other tensors (fp16 embedding tables; norms and biases in the
compute dtype). Slots and loads move those bytes. A stage's weights are then a ``PackedView``:
``materialise()`` dequantises each linear, when a stage looks it up, into a preallocated buffer of the compute dtype on the
stage's tier (one per tier, as large as the largest block's linears) and views the rest in place.
The planner does not count these buffers; the emulated GPU's budget grows by its buffer. A split
block's parts are packed separately and dequantise into the buffer of the tier they compute on.

Everything is allocated here, through ``Devices`` (which counts it); nothing during a step.
Knows nothing about the schedule beyond which slot a block uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.plan import Plan
from hetplan.runtime import quant
from hetplan.runtime.devices import Devices


@dataclass(frozen=True)
class BlockWeights:
    name: str
    kind: str
    layer: int | None
    tier: str
    """``gpu`` (resident) or ``cpu`` (host memory; streamed, CPU-computed, or cold experts)."""
    flat: torch.Tensor
    """The buffer holding every tensor of the block, in ``layout`` order."""
    layout: tuple
    """((local name, offset in elements, shape), ...) inside ``flat`` and inside a slot."""
    tensors: dict
    """local name -> view into ``flat`` (a ``PackedView`` of it for a quantised block)."""


def check_placement(plan: Plan) -> None:
    """Refuse placements the schedule has no tasks for: execution on the GPU of weights that are
    not resident there, streaming of resident weights, a GPU KV cache beside a CPU block, cold
    experts that are not valid expert ids or that no ``moe_cold`` task computes."""
    for p in plan.placement:
        for phase in PHASES:
            ex = p["exec"][phase]
            bad = (ex == "gpu") != (p["weights"] == "gpu") or (p["kv"] == "gpu" and ex == "cpu")
            if bad:
                raise HetplanError(f"plan placement of block {p['block']}: weights {p['weights']}, "
                                   f"{phase} exec {ex}, kv {p['kv']} cannot be executed (no task moves "
                                   f"those weights or caches); recompile the plan with `hetplan compile`")
        _check_experts(plan, p)


def _check_experts(plan: Plan, p: dict) -> None:
    hot, n_e = p.get("gpu_experts"), plan.model.n_experts
    if p["weights"] != "gpu" or hot is None:
        return
    if len(set(hot)) != len(hot) or len(hot) != p.get("experts_on_gpu") or not all(0 <= e < n_e for e in hot):
        raise HetplanError(f"plan placement of block {p['block']}: gpu_experts {hot} are not "
                           f"experts_on_gpu = {p.get('experts_on_gpu')} distinct expert ids in 0..{n_e - 1}; "
                           f"recompile the plan with `hetplan compile`")
    for phase in PHASES:
        split = any(t.kind == "moe_cold" and t.block == p["block"] for t in plan.schedule[phase].tasks)
        if split != bool(cold_experts(p, n_e)):
            raise HetplanError(f"plan placement of block {p['block']}: {n_e - len(hot)} experts in DRAM, "
                               f"but the {phase} schedule {'has a' if split else 'has no'} moe_cold task for "
                               f"the block; recompile the plan with `hetplan compile`")


def cold_experts(p: dict, n_experts: int) -> frozenset:
    """The routed experts of placement entry ``p`` kept in DRAM beside its GPU-resident weights;
    empty unless ``p`` is a split MoE block."""
    hot = p.get("gpu_experts")
    if p["weights"] != "gpu" or hot is None:
        return frozenset()
    return frozenset(range(n_experts)) - frozenset(hot)


class Residency:
    """Every block's weights and KV cache, placed; the staging ring; loads into it."""

    def __init__(self, plan: Plan, backend, source, devices: Devices, dtype: torch.dtype,
                 kv_dtype: torch.dtype, batch: int, max_tokens: int, progress=None):
        """``dtype``: the weights' dtype, or the compute dtype of a quantised plan."""
        check_placement(plan)
        self.devices = devices
        self.fused = backend.fused() if hasattr(backend, "fused") else {}
        self.blocks: dict[str, BlockWeights] = {}
        self.cold: dict[str, BlockWeights] = {}
        """Split MoE block -> its cold experts' weights, in host memory."""
        entries = list(plan.placement)
        specs = {p["block"]: backend.block_tensors(p["block"], p["kind"], p["layer"]) for p in entries}
        self.fmt = plan.model.weight_dtype if quant.is_quantised(plan.model.weight_dtype) else None
        for p in entries:  # check every tensor before placing any
            for t in specs[p["block"]]:
                source.check(t, None if self.fmt else dtype, f"block {p['block']}")
        parts = {p["block"]: _split(p, specs[p["block"]], backend, plan.model.n_experts) for p in entries}
        streamed = {p["block"] for p in entries if any(p["exec"][ph] == "stream" for ph in PHASES)}
        self.buffers = {}
        if self.fmt:
            self._allocate_buffers(entries, parts, dtype)
        place = self._place_packed if self.fmt else self._place
        for i, p in enumerate(entries):
            if progress:
                progress("loading", i, len(entries))
            tier = "gpu" if p["weights"] == "gpu" else "cpu"
            main, cold = parts[p["block"]]
            self.blocks[p["block"]] = place(p, main, source, dtype, tier, pinned=p["block"] in streamed,
                                            what=f"weights of {p['block']}")
            if cold:
                self.cold[p["block"]] = place(p, cold, source, dtype, "cpu", pinned=False,
                                              what=f"cold experts of {p['block']}")
        if progress:
            progress("loading", len(entries), len(entries))
        slot_numel = max((self.blocks[b].flat.numel() for b in streamed), default=0)
        slot_dtype = torch.uint8 if self.fmt else dtype
        self.slots = [devices.empty("gpu", (slot_numel,), slot_dtype, f"staging slot {s}")
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

    def _place(self, p, specs, source, dtype, tier: str, pinned: bool, what: str) -> BlockWeights:
        layout, offset = [], 0
        for t in specs:
            layout.append((t.local, offset, tuple(t.shape)))
            offset += _numel(t.shape)
        flat = self.devices.empty(tier, (offset,), dtype, what, pinned=pinned)
        tensors = _views(flat, layout, self.fused)
        for t in specs:
            source.fill(t, tensors[t.local])
        return BlockWeights(p["block"], p["kind"], p["layer"], tier, flat, tuple(layout), tensors)

    def _allocate_buffers(self, entries, parts, dtype: torch.dtype) -> None:
        """One dequantisation buffer per tier that computes with quantised blocks, as large as
        the largest linear weights one block computes with there (a split block: its GPU part
        on the GPU, its cold experts on the CPU)."""
        for tier in ("gpu", "cpu"):
            computes = ("gpu", "stream") if tier == "gpu" else ("cpu",)
            used = []
            for p in entries:
                main, cold = parts[p["block"]]
                used.append((main if any(p["exec"][ph] in computes for ph in PHASES) else [])
                            + (cold if tier == "cpu" else []))
            numel = max((sum(_numel(t.shape) for t in specs if quant.quantises(t.local, t.shape))
                         for specs in used), default=0)
            if numel:
                ledger = self.devices.ledgers[tier]
                if ledger.budget_bytes is not None:
                    ledger.budget_bytes += numel * torch.empty((), dtype=dtype).element_size()
                self.buffers[tier] = self.devices.empty(tier, (numel,), dtype, f"{tier} dequantisation buffer")

    def _place_packed(self, p, specs, source, dtype, tier: str, pinned: bool, what: str) -> BlockWeights:
        """The block as bytes: packed linears (each 16-byte aligned), then its other tensors in
        one run of ``raw_dtype`` (fp16 for an embedding block, else the compute dtype)."""
        linears = [t for t in specs if quant.quantises(t.local, t.shape)]
        others = [t for t in specs if not quant.quantises(t.local, t.shape)]
        raw_dtype = torch.float16 if others and all(t.local in quant.EMBEDDINGS for t in others) else dtype
        packed, offset = [], 0
        for t in linears:
            n = quant.nbytes(self.fmt, quant.stored_shape(t.local, t.shape))
            packed.append((t.local, offset, tuple(t.shape), n))
            offset += -(-n // 16) * 16
        raw_offset, raw_layout, numel = offset, [], 0
        for t in others:
            raw_layout.append((t.local, numel, tuple(t.shape)))
            numel += _numel(t.shape)
        elem = torch.empty((), dtype=raw_dtype).element_size()
        flat = self.devices.empty(tier, (raw_offset + numel * elem,), torch.uint8, what, pinned=pinned)
        for (local, off, shape, n), t in zip(packed, linears):
            w = source.view(t, None)
            w = w.t() if local.endswith("_t") else w
            flat[off:off + n].copy_(quant.quantise(self.fmt, w.to(flat.device)))
        raw = flat[raw_offset:].view(raw_dtype)
        for (local, off, shape), t in zip(raw_layout, others):
            raw[off:off + _numel(shape)].view(shape).copy_(source.view(t, None))
        layout = (tuple(packed), raw_offset, raw_dtype, tuple(raw_layout))
        return BlockWeights(p["block"], p["kind"], p["layer"], tier, flat, layout,
                            PackedView(self.fmt, flat, layout, self.buffers.get(tier), self.fused))

    # -- what a task touches ------------------------------------------------------------------
    def weights(self, block: str, device: str, slot: int | None) -> dict:
        """The tensors a stage of ``block`` computes with on ``device`` (``gpu``/``cpu``):
        resident tensors, views into staging slot ``slot``, host tensors, a split block's cold
        experts (on the CPU), or none (an attention core beside its KV cache, away from its
        block's weights, reads none)."""
        bw = self.blocks[block]
        if device == bw.tier:
            return bw.tensors
        if device == "cpu" and block in self.cold:
            return self.cold[block].tensors
        if slot is None or not self.slots:
            return {}
        key = (block, slot)
        if key not in self._views:
            self._views[key] = PackedView(self.fmt, self.slots[slot], bw.layout, self.buffers["gpu"], self.fused) \
                if self.fmt else _views(self.slots[slot], bw.layout, self.fused)
        return self._views[key]

    def load(self, block: str, slot: int) -> None:
        """Copy a streamed block's weights into staging slot ``slot`` (asynchronously on CUDA:
        the caller is on the ``h2d`` stream)."""
        flat = self.blocks[block].flat
        self.slots[slot][:flat.numel()].copy_(flat, non_blocking=self.devices.cuda)


@dataclass(frozen=True)
class PackedView:
    """A quantised block's bytes (resident, host or a staging slot) and the buffer its stages
    dequantise into."""
    fmt: str
    flat: torch.Tensor
    """uint8: packed linears, then the other tensors."""
    layout: tuple
    """(((local, byte offset, shape, nbytes), ...), raw byte offset, raw dtype, ((local, offset, shape), ...))."""
    buffer: torch.Tensor | None
    """The tier's dequantisation buffer (compute dtype)."""
    fused: dict

    def materialise(self) -> "Dequantised":
        """The block's tensors for one stage: linears dequantised into ``buffer`` when first
        looked up (laid back to back in block order, so fused groups stay adjacent), the rest
        viewed in place."""
        return Dequantised(self)


class Dequantised(Mapping):
    """local (or fused) name -> tensor for one stage; a linear is dequantised on first lookup."""

    def __init__(self, view: PackedView):
        packed, raw_offset, raw_dtype, raw_layout = view.layout
        self._view, self._packed = view, {local: (off, shape, n) for local, off, shape, n in packed}
        dense, offset = [], 0
        for local, _, shape, _ in packed:
            dense.append((local, offset, shape))
            offset += _numel(shape)
        self._dense = _views(view.buffer, dense, view.fused) if packed else {}
        self._parts = {name: view.fused.get(name, (name,)) for name in self._dense}
        nbytes = sum(_numel(shape) for _, _, shape in raw_layout) * torch.empty((), dtype=raw_dtype).element_size()
        self._raw = _views(view.flat[raw_offset:raw_offset + nbytes].view(raw_dtype), raw_layout, view.fused)
        self._done = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._raw:
            return self._raw[name]
        for local in self._parts[name]:
            if local not in self._done:
                off, shape, n = self._packed[local]
                target = self._dense[local].t() if local.endswith("_t") else self._dense[local]
                quant.dequantise(self._view.fmt, self._view.flat[off:off + n], quant.stored_shape(local, shape), target)
                self._done.add(local)
        return self._dense[name]

    def __contains__(self, name) -> bool:
        return name in self._raw or name in self._dense

    def __iter__(self):
        return iter((*self._dense, *self._raw))

    def __len__(self) -> int:
        return len(self._dense) + len(self._raw)


def _split(p: dict, specs: list, backend, n_experts: int) -> tuple[list, list]:
    """(tensors placed in the block's tier, tensors of its cold experts placed in DRAM)."""
    cold = cold_experts(p, n_experts)
    if not cold:
        return list(specs), []
    expert_of = getattr(backend, "expert_of", None)
    if expert_of is None:
        raise HetplanError(f"plan placement of block {p['block']}: keeps {len(cold)} experts in DRAM, but "
                           f"the runtime's backend for this model cannot tell expert tensors apart")
    return ([t for t in specs if expert_of(t.local) not in cold], [t for t in specs if expert_of(t.local) in cold])


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
