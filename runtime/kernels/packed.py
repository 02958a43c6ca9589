"""Quantised blocks as bytes, and the weights their stages compute with.

With a quantised weight dtype (``hetplan.runtime.kernels.quant``) a block is one uint8 buffer (resident,
in host memory, or in a staging slot): its linear weights packed in the plan's format (or each
in its own, ``PackedLayout.formats``: a GGUF file's mixed types), each 16-byte aligned, then
its other tensors in one run of ``raw_dtype`` (fp16 embedding tables; norms and biases in the
compute dtype). ``PackedLayout`` says where each tensor lies, in those
bytes and in the dequantisation buffer of the tier a stage computes on.

A stage's weights are ``PackedView.materialise()``: a mapping that hands each linear to the
stage packed (``kernels.linear.PackedLinear``, views of the bytes made once per block: the
kernels multiply with them, nothing is dequantised whole) and views the other tensors in place.
The dequantisation buffer is where a stage that needs a linear's matrix itself (MLA's absorbed
``kv_b``, ``MATRIX_LINEARS``) dequantises it (``PackedLinear.dense()``); it holds only those
linears, what the planner reserves (``hetplan.graph.dequant_buffer_elems``). A split block whose cold experts are
streamed computes with two packed parts (``PackedParts``: its resident bytes and its cold
experts' bytes in a staging slot); the cold part's experts are laid in the resident part's
expert region (``sharing_experts``).

Knows nothing about tiers, plans or schedules.
"""

from __future__ import annotations

import dataclasses
from collections import ChainMap
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hetplan.runtime.kernels import quant
from hetplan.runtime.kernels.linear import PackedLinear

ALIGN = 16
"""Byte alignment of each packed linear inside a block."""


@dataclass(frozen=True)
class PackedLayout:
    """Where a quantised block's tensors lie."""
    packed: tuple
    """((local, byte offset, shape, nbytes), ...) of the packed linears."""
    raw_offset: int
    """Byte offset of the other tensors, one run of ``raw_dtype``."""
    raw_dtype: torch.dtype
    raw: tuple
    """((local, element offset, shape), ...) of the other tensors inside that run."""
    dense: tuple
    """((local, element offset, shape), ...) of each linear, dequantised, inside the buffer."""
    experts: frozenset
    """Linears in the shared expert region: dequantised again on every lookup."""
    formats: tuple = ()
    """((local, format), ...) of each packed linear, where linears differ in format (a GGUF
    file's mixed types); empty: every linear in the block's format."""

    def format_of(self, local: str, default: str) -> str:
        return dict(self.formats).get(local, default)

    @property
    def nbytes(self) -> int:
        elem = torch.empty((), dtype=self.raw_dtype).element_size()
        return self.raw_offset + sum(numel(shape) for _, _, shape in self.raw) * elem

    @property
    def buffer_numel(self) -> int:
        """Elements of the dequantisation buffer the block needs: its ``MATRIX_LINEARS``."""
        return max((off + numel(shape) for _, off, shape in self.dense), default=0)


MATRIX_LINEARS = ("kv_b",)
"""Linears some stage needs as a matrix rather than multiplied from their bytes: MLA's absorbed
``kv_b`` (split per head into W_UK and W_UV). Only these get room in the dequantisation buffer."""


def needs_matrix(local: str) -> bool:
    return local.split(".")[0] in MATRIX_LINEARS


def packed_layout(fmt: str, specs, dtype: torch.dtype, expert_of=None, formats=None) -> PackedLayout:
    """The layout of a block's tensors ``specs`` (``TensorSpec``) in format ``fmt``, computing in
    ``dtype``; ``expert_of(local)`` names the routed expert of a tensor (None: not an expert);
    ``formats(spec)``, where given, is each linear's own format (None: kept unquantised, with
    the norms and biases)."""
    expert_of = expert_of or (lambda local: None)
    own = {t.local: formats(t) for t in specs if quant.quantises(t.local, t.shape)} if formats else {}
    linears = [t for t in specs if quant.quantises(t.local, t.shape) and own.get(t.local, fmt) is not None]
    others = [t for t in specs if t not in linears]
    packed, offset = [], 0
    for t in linears:
        n = quant.nbytes(own.get(t.local, fmt), quant.stored_shape(t.local, t.shape))
        packed.append((t.local, offset, tuple(t.shape), n))
        offset += -(-n // ALIGN) * ALIGN
    raw, count = [], 0
    for t in others:
        raw.append((t.local, count, tuple(t.shape)))
        count += numel(t.shape)
    raw_dtype = quant.TABLE_DTYPE if others and all(t.local in quant.EMBEDDINGS for t in others) else dtype
    dense, end = [], 0
    for t in linears:                       # only the linears a stage needs as a matrix
        if expert_of(t.local) is None and needs_matrix(t.local):
            dense.append((t.local, end, tuple(t.shape)))
            end += numel(t.shape)
    experts = frozenset(t.local for t in linears if expert_of(t.local) is not None)
    kinds = tuple((t.local, own[t.local]) for t in linears) if formats else ()
    return PackedLayout(tuple(packed), offset, raw_dtype, tuple(raw), tuple(dense), experts, kinds)


def sharing_experts(layout: PackedLayout, other: PackedLayout) -> PackedLayout:
    """``layout``, of routed experts only (a split block's cold part), with its experts
    dequantised into ``other``'s expert region (after ``other``'s other linears) instead of from
    offset 0, so that a stage computing with both parts holds one expert at a time."""
    if any(local not in layout.experts for local, _, _ in layout.dense):
        raise ValueError("sharing_experts: the layout holds linears other than routed experts")
    start = sum(numel(shape) for local, _, shape in other.dense if local not in other.experts)
    return dataclasses.replace(layout, dense=tuple((local, off + start, shape) for local, off, shape in layout.dense))


class PackedView:
    """A quantised block's bytes (resident, host or a staging slot) and the buffer its stages
    dequantise into (None where no stage computes with these bytes: a streamed block's host
    copy), with the views over both made once."""

    def __init__(self, fmt: str, flat: torch.Tensor, layout: PackedLayout, buffer: torch.Tensor | None,
                 fused: dict):
        self.fmt, self.flat, self.layout = fmt, flat, layout
        self.packed = {local: (off, shape, n) for local, off, shape, n in layout.packed}
        # a buffer smaller than the layout needs belongs to a tier that never computes with these
        # bytes (a streamed block's host copy): no dense views there
        fits = buffer is not None and buffer.numel() >= layout.buffer_numel
        self.dense = views(buffer, layout.dense, fused) if fits else {}
        names = [local for local, _, _, _ in layout.packed]
        self.format = {name: layout.format_of(name, fmt) for name in names}
        self.parts = {name: (name,) for name in names} | {
            name: parts for name, parts in fused.items()
            if all(p in self.packed for p in parts) and len({self.format[p] for p in parts}) == 1}
        self.raw = views(flat[layout.raw_offset:layout.nbytes].view(layout.raw_dtype), layout.raw, fused)
        self.linears = packed_linears(self) if buffer is not None else {}

    def materialise(self) -> "Dequantised":
        """The block's tensors for one stage."""
        return Dequantised(self)


class PackedParts:
    """A block's weights held as several ``PackedView`` (a split block's resident part and its
    cold experts in a staging slot), seen by a stage as one mapping."""

    def __init__(self, parts: tuple):
        self.parts = parts

    def materialise(self) -> ChainMap:
        """The parts' tensors for one stage (no name is in two parts)."""
        return ChainMap(*(part.materialise() for part in self.parts))


class Dequantised(Mapping):
    """local (or fused) name -> what a stage computes with: a linear as a ``PackedLinear`` over
    the packed bytes (the kernels of ``hetplan.runtime.kernels.linear`` multiply with it, and
    ``dense()`` dequantises it into its place in the buffer for a stage that needs the matrix),
    the other tensors viewed in place."""

    def __init__(self, view: PackedView):
        self._view = view

    def __getitem__(self, name: str):
        v = self._view
        if name in v.raw:
            return v.raw[name]
        return v.linears[name]

    def __contains__(self, name) -> bool:
        return name in self._view.raw or name in self._view.linears

    def __iter__(self):
        return iter((*self._view.linears, *self._view.raw))

    def __len__(self) -> int:
        return len(self._view.linears) + len(self._view.raw)


def packed_linears(v: PackedView) -> dict:
    """name -> ``PackedLinear`` for each linear of ``v`` and each fused group of them (``parts``):
    views of the packed bytes, made once per block."""
    out = {}
    for name, parts in v.parts.items():
        segments = []
        for local in parts:
            off, shape, n = v.packed[local]
            segments.append(quant.split(v.format[local], v.flat[off:off + n], quant.stored_shape(local, shape)))
        cols = quant.stored_shape(parts[0], v.packed[parts[0]][1])[1]
        target = None if name.endswith("_t") or name in v.layout.experts else v.dense.get(name)
        out[name] = PackedLinear(v.format[parts[0]], cols, tuple(segments), target)
    return out


def views(buf: torch.Tensor, layout, fused: dict) -> dict:
    """local name -> view of ``buf`` per ((local, element offset, shape), ...); plus, for each
    ``fused`` name whose parts lie back to back with equal trailing dims, one view over their
    concatenation along the first dim."""
    out = {name: buf[off:off + numel(shape)].view(shape) for name, off, shape in layout}
    where = {name: (off, shape) for name, off, shape in layout}
    for name, parts in fused.items():
        if not all(p in where for p in parts):
            continue
        spans = [where[p] for p in parts]
        adjacent = all(off + numel(shape) == spans[i + 1][0] for i, (off, shape) in enumerate(spans[:-1]))
        if adjacent and len({shape[1:] for _, shape in spans}) == 1:
            shape = (sum(s[0] for _, s in spans),) + spans[0][1][1:]
            out[name] = buf[spans[0][0]:spans[0][0] + numel(shape)].view(shape)
    return out


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
