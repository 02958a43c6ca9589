"""The block graph of an ONNX model: blocks and stage costs read off its nodes, not formulas.

Each block (``embed``, ``attn_l``, ``mlp_l``, ``head``; see ``hetplan.frontends.onnx.blocks``) is one
stage per phase. Its costs come from the graph with the workload's sizes bound to the inputs
(``hetplan.frontends.onnx.shapes``):

- FLOPs: matrix products only, 2 * (output elements) * (inner dimension) per MatMul or Gemm;
  element-wise ops are bandwidth-bound, their FLOPs are left out as in ``hetplan.cost``. The
  attention products are the graph's own: the full prompt x prompt square in prefill (the
  export masks it, it does not skip it), logits for every position when the export emits them.
- bytes: the weights the block reads (every float constant its nodes consume, counted once per
  block; of an embedding table, only the rows a Gather fetches) plus the tensors that cross the
  block's boundary: inputs from other blocks or the graph (past keys and values included) and
  outputs to other blocks or the graph (the present keys and values: the export rewrites the
  whole cache each step). Intermediates inside a block are not counted, as in the analytic
  model's fused stages.
- in_bytes (what crosses PCIe when the previous stage ran on the other device): every value
  produced before the block and read by it or a later block (``OnnxModel.live_values``): the
  runtime carries them together from block to block.

Prefill binds ``batch x prompt_len`` (past 0). Decode binds one token after
``decode_context_len - 1`` cached ones for a graph with past key/values; a graph without them
recomputes the whole context each step (``batch x decode_context_len`` tokens, no KV cache).
The mean context is fractional: costs are taken at the two integer lengths around it and
interpolated linearly (exact for the with-past graph, whose costs are affine in the past length).

Weight bytes follow the plan's weight dtype (the graph's own unless --weight-dtype says
otherwise); activations use ``hetplan.cost.activation_bytes_per_elem``, caches the KV dtype.
Knows nothing about machines or seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetplan import cost
from hetplan.cost import Work
from hetplan.errors import HetplanError
from hetplan.graph import PHASES, Block, BlockGraph, Stage
from hetplan.model import ModelSpec
from hetplan.frontends.onnx.importer import OnnxModel, open_onnx
from hetplan.frontends.onnx.load import FLOAT_TYPES, ITEMSIZE
from hetplan.workload import Workload

METADATA_OPS = ("Shape", "Size")
"""Operators that read only their input's shape: no bytes move for them."""
STAGE_OP = {"embed": "embed", "attn": "onnx_attention", "mlp": "mlp", "head": "head"}
"""Work.op of each block kind: profile tables key measured times by it."""


@dataclass(frozen=True)
class BlockCost:
    flops: float
    weight_params: float
    """Float constants the block holds (elements)."""
    read_params: float
    """Float constants one pass reads (elements): a Gather reads rows, not its whole table."""
    in_bytes: float
    """Values live across the boundary into the block."""
    io_bytes: float
    """Every tensor crossing the block's boundary (in from blocks and graph inputs, out)."""
    tokens: int


def node_flops(node, env: dict) -> float:
    """2 * M * N * K of a MatMul (batched: output elements * K) or Gemm; 0 for other ops."""
    if node.op == "MatMul":
        a = env[node.inputs[0]].shape
        return 2.0 * math.prod(env[node.outputs[0]].shape) * a[-1]
    if node.op == "Gemm":
        a = env[node.inputs[0]].shape
        k = a[0] if node.attrs.get("transA", 0) else a[1]
        return 2.0 * math.prod(env[node.outputs[0]].shape) * k
    return 0.0


def _elem_bytes(name: str, dtype: int, spec: ModelSpec, kv: set) -> float:
    """Bytes per element: the KV dtype for caches, the activation size for floats, else the type's."""
    if name in kv:
        return spec.kv_bytes_per_elem
    if dtype in FLOAT_TYPES:
        return cost.activation_bytes_per_elem(spec)
    return ITEMSIZE.get(dtype, 8)


def block_costs(m: OnnxModel, spec: ModelSpec, env: dict, tokens: int) -> list:
    """BlockCost of every block for the shapes in ``env``."""
    g, blocks = m.graph, m.blocks
    const = m.constant_values()
    producer_block = {o: blocks.node_block[n.index] for n in g.nodes for o in n.outputs}
    consumer_blocks = {}
    for n in g.nodes:
        if n.index in blocks.constant_nodes or n.op in METADATA_OPS:
            continue
        for x in n.inputs:
            consumer_blocks.setdefault(x, set()).add(blocks.node_block[n.index])
    graph_outputs = set(g.outputs)
    kv = set(m.past_inputs) | {o for o in g.outputs
                               if o in producer_block and blocks.kinds[producer_block[o]] == "attn"}
    n_blocks = len(blocks.names)
    flops, params, read, io_b = [0.0] * n_blocks, [0.0] * n_blocks, [0.0] * n_blocks, [0.0] * n_blocks
    in_b = [sum(env[x].numel * _elem_bytes(x, env[x].dtype, spec, kv) for x in live)
            for live in m.live_values()]
    seen = [set() for _ in range(n_blocks)]
    for n in g.nodes:
        if n.index in blocks.constant_nodes:
            continue
        b = blocks.node_block[n.index]
        flops[b] += node_flops(n, env)
        for x in n.inputs:
            if not x or x in seen[b] or n.op in METADATA_OPS:
                continue
            seen[b].add(x)
            v = env[x]
            if x in const:
                if v.dtype in FLOAT_TYPES and v.numel > 1:
                    params[b] += v.numel
                    read[b] += env[n.outputs[0]].numel if n.op == "Gather" else v.numel
            elif producer_block.get(x) != b:
                io_b[b] += v.numel * _elem_bytes(x, v.dtype, spec, kv)
        for y in n.outputs:
            if y and (y in graph_outputs or consumer_blocks.get(y, {b}) - {b}):
                v = env[y]
                io_b[b] += v.numel * _elem_bytes(y, v.dtype, spec, kv)
    return [BlockCost(flops[b], params[b], read[b], in_b[b], io_b[b], tokens) for b in range(n_blocks)]


def _phase_costs(m: OnnxModel, spec: ModelSpec, wl: Workload, phase: str) -> list:
    """Block costs of ``phase``, interpolated between integer lengths where the mean context is
    fractional."""
    b = wl.batch
    if phase == "prefill":
        return block_costs(m, spec, m.shapes(b, wl.prompt_len, 0), b * wl.prompt_len)
    length = wl.decode_context_len - 1 if m.with_past else wl.decode_context_len
    lo = math.floor(length)
    frac = length - lo

    def at(n):
        env = m.shapes(b, 1, n) if m.with_past else m.shapes(b, n, 0)
        return block_costs(m, spec, env, b * (1 if m.with_past else n))

    low = at(lo)
    if frac == 0:
        return low
    high = at(lo + 1)
    mix = lambda x, y: x + frac * (y - x)  # noqa: E731
    return [BlockCost(mix(p.flops, q.flops), p.weight_params, p.read_params, mix(p.in_bytes, q.in_bytes),
                      mix(p.io_bytes, q.io_bytes), p.tokens) for p, q in zip(low, high)]


def _cache_block(m: OnnxModel, consumers: dict, name: str) -> int:
    """The attention block that reads past input ``name``'s data, possibly through prologue
    nodes that copy it (shape reads aside)."""
    found, stack, seen = set(), [name], set()
    while stack:
        v = stack.pop()
        for i in consumers.get(v, []):
            n = m.graph.nodes[i]
            if n.op in METADATA_OPS or i in seen:
                continue
            seen.add(i)
            b = m.blocks.node_block[i]
            if b == 0:
                stack.extend(n.outputs)
            else:
                found.add(b)
    if len(found) != 1 or m.blocks.kinds[min(found)] != "attn":
        raise HetplanError(f"{m.path}: past input {name!r} is not read by exactly one attention "
                           f"block; hetplan expects one key and one value cache per layer")
    return min(found)


def kv_elems_per_token(m: OnnxModel) -> dict:
    """attention block -> cache elements per token of its past inputs ([batch, heads, past, d])."""
    consumers = m.graph.consumers()
    dims = {i.name: i.dims for i in m.graph.inputs}
    out = {}
    for name in m.past_inputs:
        b = m.blocks.names[_cache_block(m, consumers, name)]
        out[b] = out.get(b, 0) + dims[name][1] * dims[name][3]
    return out


def onnx_block_graph(spec: ModelSpec, wl: Workload) -> BlockGraph:
    """The BlockGraph of the ONNX model ``spec`` was imported from, for ``wl``."""
    m = open_onnx(spec.extra["onnx_path"])
    if m.sha256 != spec.extra.get("onnx_sha256"):
        raise HetplanError(f"{m.path} changed since the model was imported (sha256 differs); "
                           f"compile again from the current file")
    per_phase = {ph: _phase_costs(m, spec, wl, ph) for ph in PHASES}
    wb = spec.weight_bytes_per_param
    kv_elems = kv_elems_per_token(m)
    blocks = []
    for i, name in enumerate(m.blocks.names):
        kind = m.blocks.kinds[i]
        kv_tok = kv_elems.get(name, 0) * spec.kv_bytes_per_elem
        blocks.append(Block(name, kind, m.blocks.layers[i], per_phase["prefill"][i].weight_params * wb,
                            kv_bytes=wl.batch * wl.context_len * kv_tok, kv_bytes_per_token=kv_tok,
                            streamable=kind != "embed"))
    stages = {}
    for ph in PHASES:
        chain = []
        for blk, c in zip(blocks, per_phase[ph]):
            work = Work(flops=c.flops, bytes=c.read_params * wb + c.io_bytes, op=STAGE_OP[blk.kind],
                        tokens=c.tokens)
            chain.append(Stage(blk.name, blk.kind, work, c.in_bytes if chain else 0.0))
        stages[ph] = tuple(chain)
    return BlockGraph(spec, wl, tuple(blocks), stages)
