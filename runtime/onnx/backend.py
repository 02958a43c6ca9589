"""The ONNX backend: each block of a plan runs its own nodes of the ONNX graph, with torch.

The graph's nodes are grouped into the plan's blocks (``hetplan.frontends.onnx.blocks``); a stage of block
``b`` executes block b's nodes (``hetplan.runtime.onnx.run``) on the stage's device with the
block's weights as the executor placed them. Between blocks one value travels, ``state``: every
tensor produced so far that a later block reads (the residual stream, the attention mask, rotary
tables ...), packed into one flat byte tensor, so the executor's activation copies move exactly
what the next device needs. Its layout (names, dtypes, shapes, offsets) is recorded at packing.

The rest of the graph's inputs are made here: the attention mask (all ones), position ids and,
for a decoder-with-past export, the past keys and values as views of the block's KV cache
(``[B, T, heads, head_dim]``, allocated by the runtime in the plan's tier); each step's new keys
and values are copied from the ``present`` outputs into the cache. A graph without past inputs
recomputes the whole sequence every step (the backend keeps the token history).

Weights are initializers or constants folded from them (``hetplan.runtime.onnx.weights``): float
tensors in the graph's dtype are block weights, placed by the plan; other constants (shape
arithmetic, scalars) are made once per device in ``setup``. Knows nothing about queues or tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetplan.errors import HetplanError
from hetplan.model import ModelSpec
from hetplan.frontends.onnx.importer import open_onnx
from hetplan.runtime.backend import StageCall, TensorSpec
from hetplan.runtime.onnx.ops import TORCH_OF_ONNX
from hetplan.runtime.onnx.run import run_nodes
from hetplan.runtime.onnx.weights import OnnxWeights

METADATA_OPS = ("Shape", "Size")
ALIGN = 8


@dataclass(frozen=True)
class Packed:
    name: str
    dtype: torch.dtype
    shape: tuple
    offset: int
    nbytes: int


class OnnxBackend:
    """Executes the embed, attn, mlp and head stages of a plan compiled from an ONNX graph."""

    kinds = frozenset({"embed", "attn", "mlp", "head"})

    def __init__(self, spec: ModelSpec):
        m = open_onnx(spec.extra["onnx_path"])
        if m.sha256 != spec.extra.get("onnx_sha256"):
            raise HetplanError(f"{m.path} is not the ONNX file the plan was compiled from (sha256 "
                               f"differs); pass the plan's model with --model or recompile")
        native = spec.extra.get("native_dtype")
        for what, dtype in (("--weight-dtype", spec.weight_dtype), ("--kv-dtype", spec.kv_dtype)):
            if dtype != native:
                raise HetplanError(f"{m.path}: the graph computes in {native}, the plan was compiled "
                                   f"with {what} {dtype}; recompile it with {what} {native}")
        self.m, self.spec = m, spec
        self.source = OnnxWeights(m)
        g, blocks = m.graph, m.blocks
        self.index = {name: i for i, name in enumerate(blocks.names)}
        env = m.shapes(1, 2, 1 if m.with_past else 0)
        const = m.constant_values()
        native_torch = TORCH_OF_ONNX[{"fp32": 1, "fp16": 10, "bf16": 16}[native]]
        n = len(blocks.names)
        self._nodes = [[] for _ in range(n)]
        self._weights = [dict() for _ in range(n)]
        small, reads, produced_in = set(), [set() for _ in range(n)], {}
        for node in g.nodes:
            if node.index in blocks.constant_nodes:
                continue
            b = blocks.node_block[node.index]
            self._nodes[b].append(node)
            for o in node.outputs:
                produced_in[o] = b
            for x in node.inputs:
                if not x:
                    continue
                if x in const:
                    v = env[x]
                    if TORCH_OF_ONNX.get(v.dtype) == native_torch and v.numel > 1:
                        self._weights[b][x] = TensorSpec(x, x, v.shape)
                    else:
                        small.add(x)
                else:
                    reads[b].add((x, node.op in METADATA_OPS))
        self._small = sorted(small)
        inputs = {i.name for i in g.inputs} - {blocks.token_ids}  # the ids travel in the state
        self._live = m.live_values()
        self._graph_inputs = [sorted({x for x, _ in reads[b] if x in inputs}) for b in range(n)]
        self._past = [[p for p in m.past_inputs if (p, False) in reads[b]] for b in range(n)]
        for b in range(n):
            if self._past[b] and blocks.kinds[b] != "attn":
                raise HetplanError(f"{m.path}: block {blocks.names[b]} reads the past key/value cache "
                                   f"{self._past[b][0]!r}; the runtime gives caches to attention blocks only")
        outputs = list(g.outputs)
        self._present = [[o for o in outputs if produced_in.get(o) == b] if blocks.kinds[b] == "attn" else []
                         for b in range(n)]
        for b in range(n):  # present i is past i with this step appended (both in graph order)
            if len(self._present[b]) != len(self._past[b]):
                raise HetplanError(f"{m.path}: block {blocks.names[b]} reads {len(self._past[b])} past and "
                                   f"writes {len(self._present[b])} present key/value tensors; they must pair up")
        head = n - 1
        self._logits = next((o for o in outputs if produced_in.get(o) == head), None)
        if self._logits is None:
            raise HetplanError(f"{m.path}: no graph output comes from the head block (the logits)")
        past_dims = {i.name: i.dims for i in g.inputs if i.name in m.past_inputs}
        self._cache_dims = tuple(past_dims[m.past_inputs[0]]) if m.past_inputs else None
        self._consts = {}
        self._layouts = {}
        self._history = None

    # -- the backend interface ------------------------------------------------------------------
    def block_tensors(self, block: str, kind: str, layer: int | None) -> list[TensorSpec]:
        return list(self._weights[self.index[block]].values())

    def reads(self, kind: str) -> tuple:
        return ("ids",) if kind == "embed" else ("state",)

    def writes(self, kind: str) -> tuple:
        return ("logits",) if kind == "head" else ("state",)

    def kv_shapes(self, batch: int, max_tokens: int) -> dict:
        """Per attention block, one ``[B, T, heads, head_dim]`` cache per past input (key, value)."""
        if self._cache_dims is None:
            return {}
        _, heads, _, head_dim = self._cache_dims
        return {str(i): (batch, max_tokens, heads, head_dim) for i in range(max(map(len, self._past)))}

    def setup(self, device: torch.device, max_tokens: int | None = None) -> None:
        """Small constants on ``device``: floating ones there, integer ones on the host (they
        feed shape arithmetic)."""
        self._consts[device] = {name: (v.to(device) if v.is_floating_point() else v)
                                for name in self._small for v in (self.source.value(name),)}

    def own_weights(self) -> OnnxWeights:
        """The weight source: this graph's initializers (no checkpoint is read)."""
        return self.source

    def run(self, call: StageCall) -> dict:
        b = self.index[call.block]
        dev, step = call.device, call.step
        env = dict(self._consts[dev])
        env.update(call.weights)
        if call.kind == "embed":
            ids = call.inputs["ids"]
            if not self.m.with_past:
                previous = [] if step.start == 0 else [self._history.to(ids.device)]
                self._history = torch.cat(previous + [ids], 1)
                ids = self._history
            env[self.m.blocks.token_ids] = ids
        else:
            env.update(self._unpack(call.inputs["state"], b))
        past = step.start if self.m.with_past else 0
        seq = step.new_tokens if self.m.with_past else self._history.shape[1]
        env.update(self._graph_inputs_for(b, call, past, seq))
        run_nodes(self._nodes[b], env, dev, self.m.graph.opset)
        for i, name in enumerate(self._present[b]):
            call.kv[str(i)][:, past:past + seq].copy_(env[name][:, :, past:past + seq].transpose(1, 2))
        if call.kind == "head":
            logits = env[self._logits]
            return {"logits": logits if step.all_logits else logits[:, -1]}
        return {"state": self._pack(env, b + 1, dev)}

    # -- graph inputs and the travelling state --------------------------------------------------------
    def _graph_inputs_for(self, b: int, call: StageCall, past: int, seq: int) -> dict:
        out, dev, batch = {}, call.device, call.step.batch
        dims = {i.name: i for i in self.m.graph.inputs}
        for name in self._graph_inputs[b]:
            low = name.lower()
            dtype = TORCH_OF_ONNX[dims[name].dtype]
            if name in self.m.past_inputs:
                if name in self._past[b]:
                    cache = call.kv[str(self._past[b].index(name))]
                    out[name] = cache[:, :past].transpose(1, 2)
                else:  # read for its shape only
                    _, heads, _, head_dim = dims[name].dims
                    out[name] = torch.empty((), dtype=dtype, device=dev).expand(batch, heads, past, head_dim)
            elif "position_ids" in low:
                out[name] = torch.arange(past, past + seq, device=dev).to(dtype).expand(batch, seq)
            elif "cache_position" in low:
                out[name] = torch.arange(past, past + seq, device=dev).to(dtype)
            else:  # the attention mask: every token attends
                out[name] = torch.ones(batch, past + seq, dtype=dtype, device=dev)
        return out

    def _pack(self, env: dict, b: int, dev: torch.device) -> torch.Tensor:
        parts, layout, offset = [], [], 0
        for name in self._live[b]:
            t = env[name]
            raw = t.to(dev).contiguous().reshape(-1).view(torch.uint8)
            pad = -offset % ALIGN
            if pad:
                parts.append(torch.zeros(pad, dtype=torch.uint8, device=dev))
                offset += pad
            layout.append(Packed(name, t.dtype, tuple(t.shape), offset, raw.numel()))
            parts.append(raw)
            offset += raw.numel()
        self._layouts[b] = tuple(layout)
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=dev)

    def _unpack(self, state: torch.Tensor, b: int) -> dict:
        return {p.name: state[p.offset:p.offset + p.nbytes].view(p.dtype).view(p.shape)
                for p in self._layouts[b]}
