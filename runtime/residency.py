"""Put every block's weights and every KV cache in the tier the plan chose, once, before running.

Each block's tensors are copied, one at a time and straight from the source (a memory-mapped
checkpoint, or random values), into one flat buffer of the block's tier (exactly the block's
weight bytes), and the source lets each tensor's mapped pages go once copied (``release``); the block computes with views into it, including one view over each group of
projections the backend fuses (``fused()``: parts laid back to back). So the process holds one
copy of the weights, in anonymous memory (decode on the CPU reads it faster than file-backed
pages).

- ``gpu`` blocks: the buffer is in GPU memory.
- blocks streamed in some phase: the buffer is in host memory, pinned on a real GPU, so a
  ``load`` task is one copy of the block into a staging slot; the GPU holds a ring of ``depth``
  preallocated slots, each as large as the largest streamed block, and a streamed stage computes
  with the same views laid over its slot. CPU stages of such a block use the host buffer.
- ``cpu`` blocks: the buffer is in host memory; but a block of lookup tables only (the token
  embedding) is read from the checkpoint's file a row at a time as stages look rows up, in its
  stored dtype (``looked_up_in_place``): the process holds none of it.
- split MoE blocks (weights ``gpu`` with cold experts, ``hetplan.experts``): two buffers, the
  block's tensors less its cold experts' in GPU memory, the cold experts' in host memory
  (plain where only the CPU reads them). Stages on the GPU see the first part, the CPU's
  ``moe_cold`` the second; which tensors belong to an expert the backend says (``expert_of``).
  In a phase whose exec is ``stream`` the cold experts are streamed instead: their buffer is
  pinned, a ``load`` copies it into a staging slot (which is then as large as the largest thing
  loaded, a whole block or a cold part) and the block's GPU stages see both parts, the resident
  tensors and the cold experts' views over the slot: every expert is on the GPU.
- KV caches: ``[B, T, ...]`` values per attention block in the tier of its ``kv`` (pinned host
  memory when a GPU copies the prompt's KV into it), plain or quantised per token row in the
  plan's KV dtype (``runtime/kv_cache.py``).

A plan with a quantised weight dtype (``hetplan.runtime.kernels.quant``) stores each block as bytes
(``runtime/kernels/packed.py``); slots and loads move those bytes. A plan priced tensor by tensor
from a GGUF file (``ModelSpec.block_bytes``) holds each linear in its own format, handed over
packed by the file's source (``hetplan.runtime.gguf``) rather than quantised here. A stage's weights are then a
``PackedView`` whose linears are dequantised, when the stage looks them up, into a preallocated
buffer of the compute dtype on the stage's tier: one per tier, as large as the largest block
computing there needs, its routed experts counted as one (they take turns in one region). The
planner reserves that buffer in each device's workspace; it is charged to its tier's ledger like
any allocation. A split block's parts are packed separately and dequantise into the buffer of
the tier they compute on; streamed cold experts, in their slot, into the resident part's expert
region of the GPU's buffer (``packed.sharing_experts``).

Everything is allocated here, through ``Devices`` (which counts it); nothing during a step.
Knows nothing about the schedule beyond which slot a block uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetplan.dtypes import DEQUANT_BYTES
from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.plan import Plan
from hetplan.runtime import kv_cache
from hetplan.runtime.kernels import quant
from hetplan.runtime.devices import Devices
from hetplan.runtime.kernels.packed import PackedParts, PackedView, numel, packed_layout, sharing_experts, views


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
    """((local name, offset in elements, shape), ...) inside ``flat`` and inside a slot (a
    ``PackedLayout`` for a quantised block)."""
    tensors: dict
    """local name -> view into ``flat`` (a ``PackedView`` of it for a quantised block)."""


def check_placement(plan: Plan) -> None:
    """Refuse placements the schedule has no tasks for: execution on the GPU of weights that are
    not resident there, streaming of resident weights (but for a split MoE block's cold experts),
    a GPU KV cache beside a CPU block, cold experts that are not valid expert ids or that no
    ``moe_cold`` task computes (no ``load`` streams, in a phase whose exec is ``stream``)."""
    for p in plan.placement:
        for phase in PHASES:
            ex = p["exec"][phase]
            streams_cold = ex == "stream" and bool(cold_experts(p, plan.model.n_experts))
            bad = not streams_cold and ((ex == "gpu") != (p["weights"] == "gpu") or (p["kv"] == "gpu" and ex == "cpu"))
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
        tasks = plan.schedule[phase].tasks
        split = any(t.kind == "moe_cold" and t.block == p["block"] for t in tasks)
        if p["exec"][phase] == "stream":
            loaded = any(t.kind == "load" and t.block == p["block"] for t in tasks)
            if split or not loaded:
                raise HetplanError(f"plan placement of block {p['block']}: cold experts streamed in {phase}, but "
                                   f"the {phase} schedule {'has a moe_cold task' if split else 'has no load'} "
                                   f"for the block; recompile the plan with `hetplan compile`")
            continue
        if split != bool(cold_experts(p, n_e)):
            raise HetplanError(f"plan placement of block {p['block']}: {n_e - len(hot)} experts in DRAM, "
                               f"but the {phase} schedule {'has a' if split else 'has no'} moe_cold task for "
                               f"the block; recompile the plan with `hetplan compile`")


def pinned_need_bytes(plan: Plan, caches: bool = True) -> int:
    """Host bytes a CUDA run page-locks for its copies, from the plan: the weights of every block
    streamed in some phase (a split block's cold experts), and (``caches``) the KV caches a
    prefill on the GPU copies down (``kv_down``), each rounded to whole pages as registered.
    ``hetplan serve`` passes ``caches=False``: its paged pool holds the caches, and the plan's
    are placed one position long."""
    from hetplan.runtime.devices import page_round
    kv_down = {t.block for t in plan.schedule["prefill"].tasks if t.kind == "kv_down"} if caches else set()
    need = 0
    for p in plan.placement:
        if any(p["exec"][ph] == "stream" for ph in PHASES):
            cold = p.get("cold_expert_bytes") if p["weights"] == "gpu" else None
            need += page_round(int(cold if cold else p["weight_bytes"]))
        if p["block"] in kv_down:
            need += page_round(int(p["kv_bytes"]))
    return need


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
                 kv_dtype: torch.dtype | str, batch: int, max_tokens: int, progress=None):
        """``dtype``: the weights' dtype, or the compute dtype of a quantised plan. ``kv_dtype``:
        the caches' torch dtype, or a quantised format (``kv_cache.storage``)."""
        check_placement(plan)
        self.devices = devices
        self.fused = backend.fused() if hasattr(backend, "fused") else {}
        self.expert_of = getattr(backend, "expert_of", None)
        self.blocks: dict[str, BlockWeights] = {}
        self.cold: dict[str, BlockWeights] = {}
        """Split MoE block -> its cold experts' weights, in host memory (pinned when streamed)."""
        entries = list(plan.placement)
        specs = {p["block"]: backend.block_tensors(p["block"], p["kind"], p["layer"]) for p in entries}
        self.fmt = plan.model.weight_dtype if quant.is_quantised(plan.model.weight_dtype) else None
        # a file priced tensor by tensor (GGUF) hands each linear over in its own format, packed
        self.formats = held_formats(plan, source) if self.fmt else None
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
            if tier == "cpu" and p["block"] not in streamed and looked_up_in_place(main, source):
                self.blocks[p["block"]] = BlockWeights(p["block"], p["kind"], p["layer"], tier, torch.empty(0), (),
                                                       {t.local: source.table(t) for t in main})
                continue
            self.blocks[p["block"]] = place(p, main, source, dtype, tier, pinned=p["block"] in streamed,
                                            what=f"weights of {p['block']}")
            if cold:
                self.cold[p["block"]] = place(p, cold, source, dtype, "cpu", pinned=p["block"] in streamed,
                                              what=f"cold experts of {p['block']}")
        if progress:
            progress("loading", len(entries), len(entries))
        slot_numel = max((self._loaded(b).flat.numel() for b in streamed), default=0)
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
                name: kv_cache.allocate(devices, p["kv"], shape, kv_dtype, f"KV cache {name} of {p['block']}",
                                        pinned=p["block"] in kv_down)
                for name, shape in backend.kv_shapes(batch, max_tokens).items()}
            self.kv_tier[p["block"]] = p["kv"]

    def _place(self, p, specs, source, dtype, tier: str, pinned: bool, what: str) -> BlockWeights:
        layout, offset = [], 0
        for t in specs:
            layout.append((t.local, offset, tuple(t.shape)))
            offset += numel(t.shape)
        flat = self.devices.empty(tier, (offset,), dtype, what, pinned=pinned)
        tensors = views(flat, layout, self.fused)
        for t in specs:
            source.fill(t, tensors[t.local])
        return BlockWeights(p["block"], p["kind"], p["layer"], tier, flat, tuple(layout), tensors)

    def _allocate_buffers(self, entries, parts, dtype: torch.dtype) -> None:
        """One dequantisation buffer per tier that computes with quantised blocks, as large as the
        largest block computing there needs (``PackedLayout.buffer_numel``: a split block's GPU
        part on the GPU, with its cold experts where a phase streams them, and its cold experts on
        the CPU where a phase computes them there).

        The emulated GPU's buffer is charged at ``DEQUANT_BYTES["gpu"]`` bytes per element: the
        bf16 buffer a CUDA run allocates and the planner reserves, so that the budget checks what
        a real GPU would hold. Emulation computes, and so dequantises, in fp32: the buffer takes
        twice the charged bytes of host memory."""
        for tier in ("gpu", "cpu"):
            computes = ("gpu", "stream") if tier == "gpu" else ("cpu",)
            used = []
            for p in entries:
                main, cold = parts[p["block"]]
                cold_on = "stream" if tier == "gpu" else "gpu"      # exec of a phase computing them on ``tier``
                used.append((main if any(p["exec"][ph] in computes for ph in PHASES) else [])
                            + (cold if any(p["exec"][ph] == cold_on for ph in PHASES) else []))
            count = max((packed_layout(self.fmt, specs, dtype, self.expert_of, self.formats).buffer_numel
                         for specs in used),
                        default=0)
            if any(used):  # a tier that computes with quantised blocks has a buffer, empty if none needs room
                charged = count * DEQUANT_BYTES["gpu"] if tier == "gpu" and not self.devices.cuda else None
                self.buffers[tier] = self.devices.empty(tier, (count,), dtype, f"{tier} dequantisation buffer",
                                                        charged_bytes=charged)

    def _place_packed(self, p, specs, source, dtype, tier: str, pinned: bool, what: str) -> BlockWeights:
        """The block as bytes (``packed_layout``): packed linears, then its other tensors."""
        layout = packed_layout(self.fmt, specs, dtype, self.expert_of, self.formats)
        flat = self.devices.empty(tier, (layout.nbytes,), torch.uint8, what, pinned=pinned)
        by_local = {t.local: t for t in specs}
        for local, off, shape, n in layout.packed:
            t = by_local[local]
            if self.formats:  # already packed in the file's format, or repacked from it
                flat[off:off + n].copy_(source.packed(t, layout.format_of(local, self.fmt)))
                source.release(t)
                continue
            w = source.view(t, None)
            w = w.t() if local.endswith("_t") else w
            # rows at a time, each chunk's checkpoint pages let go once quantised (a transposed
            # tensor's rows span every page: its pages go at the end)
            rows_go = getattr(source, "release_rows", None) if not local.endswith("_t") else None
            quant.quantise_into(self.fmt, w, flat[off:off + n],
                                None if rows_go is None else (lambda r0, r1, t=t: rows_go(t, r0, r1)))
            del w
            source.release(t)
        raw = flat[layout.raw_offset:].view(layout.raw_dtype)
        for local, off, shape in layout.raw:
            source.fill(by_local[local], raw[off:off + numel(shape)].view(shape))  # chunked, pages let go
        return BlockWeights(p["block"], p["kind"], p["layer"], tier, flat, layout,
                            PackedView(self.fmt, flat, layout, self.buffers.get(tier), self.fused))

    # -- what a task touches ------------------------------------------------------------------
    def weights(self, block: str, device: str, slot: int | None) -> dict:
        """The tensors a stage of ``block`` computes with on ``device`` (``gpu``/``cpu``):
        resident tensors, views into staging slot ``slot``, host tensors, a split block's cold
        experts (on the CPU), a split block's resident tensors with its cold experts' views into
        ``slot`` (on the GPU, in a phase that streams them), or none (an attention core beside
        its KV cache, away from its block's weights, reads none)."""
        bw = self.blocks[block]
        if device == "gpu" and block in self.cold and slot is not None:
            return self._in_slot(block, slot)
        if device == bw.tier:
            return bw.tensors
        if device == "cpu" and block in self.cold:
            return self.cold[block].tensors
        if slot is None or not self.slots:
            return {}
        return self._in_slot(block, slot)

    def _in_slot(self, block: str, slot: int):
        """The views a GPU stage of a block streamed into ``slot`` computes with, made once:
        the block's own layout over the slot, or a split block's resident tensors plus its cold
        experts' layout over the slot (quantised: their experts sharing the resident part's
        expert region of the dequantisation buffer)."""
        key = (block, slot)
        if key in self._views:
            return self._views[key]
        flat, bw = self.slots[slot], self._loaded(block)
        if block not in self.cold:
            view = PackedView(self.fmt, flat, bw.layout, self.buffers["gpu"], self.fused) if self.fmt \
                else views(flat, bw.layout, self.fused)
        elif self.fmt:
            main = self.blocks[block]
            cold = PackedView(self.fmt, flat, sharing_experts(bw.layout, main.layout), self.buffers["gpu"], self.fused)
            view = PackedParts((main.tensors, cold))
        else:
            view = {**self.blocks[block].tensors, **views(flat, bw.layout, self.fused)}
        self._views[key] = view
        return view

    def _loaded(self, block: str) -> BlockWeights:
        """What a ``load`` of streamed ``block`` copies: its cold experts for a split block, else
        the whole block."""
        return self.cold.get(block) or self.blocks[block]

    def load(self, block: str, slot: int) -> None:
        """Copy a streamed block's weights (a split block's cold experts) into staging slot
        ``slot`` (asynchronously on CUDA: the caller is on the ``h2d`` stream)."""
        flat = self._loaded(block).flat
        self.slots[slot][:flat.numel()].copy_(flat, non_blocking=self.devices.cuda)


def looked_up_in_place(specs: list, source) -> bool:
    """Whether a block in DRAM is read row by row from the checkpoint's file rather than copied
    (``hetplan.runtime.lookup.FileTable``): every tensor of it a lookup table
    (``quant.EMBEDDINGS``: rows looked up, never multiplied whole) and ``source`` a checkpoint.
    Only the rows looked up are read, as llama.cpp's and transformers' mappings read only the
    pages they touch; the plan still prices the whole table."""
    return bool(specs) and hasattr(source, "table") and all(t.local in quant.EMBEDDINGS for t in specs)


def held_formats(plan: Plan, source):
    """Each linear's own format (``source.format_of``) for a plan priced tensor by tensor from the
    file ``source`` reads (``ModelSpec.block_bytes``), else None (every linear quantised to the
    plan's format)."""
    if not plan.model.block_bytes:
        return None
    if not hasattr(source, "format_of"):
        raise HetplanError("the plan prices its weights tensor by tensor from a GGUF file; run it with "
                           "--weights set to that .gguf file")
    return source.format_of


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
