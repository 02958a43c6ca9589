"""Group an ONNX decoder's nodes into hetplan's blocks by following its residual stream.

A decoder-only transformer keeps one hidden-state tensor that every sublayer adds to:
``h = embed(ids); h = h + attn(norm(h)); h = h + mlp(norm(h)); ...; logits = head(norm(h))``.
In the graph that is a chain of ``Add`` nodes, each adding to the previous one's output a branch
that itself depends on it. Found from the token-embedding ``Gather``, the chain cuts the graph
into segments: segment 2l is layer l's attention (it holds a Softmax), 2l+1 its MLP, and what
follows the last residual add is the head. Every node then belongs to the segment of its latest
input (graph inputs and constants belong to the embedding, which also computes the shared
prologue: position ids, the attention mask, rotary tables). This needs neither node nor
initializer names, so it works for any exporter; names are only read back for messages.

Knows nothing about shapes, costs or devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.errors import HetplanError
from hetplan.frontends.onnx.ir import OnnxGraph

ATTENTION_OPS = ("Softmax",)
EMBED = -1


@dataclass(frozen=True)
class Blocks:
    names: tuple
    """Block names in execution order: ``embed``, ``attn_0``, ``mlp_0``, ..., ``head``."""
    kinds: tuple
    """``embed``, ``attn``, ``mlp`` or ``head`` per block."""
    layers: tuple
    """Layer index per block (None for the embedding and the head)."""
    node_block: tuple
    """Block index of every node, in graph order."""
    token_embedding: str
    """Initializer name of the token embedding table."""
    token_ids: str
    """Graph input holding the token ids."""
    position_embedding: str | None
    """Initializer name of a learned position table added to the token embedding (gpt2)."""
    constant_nodes: frozenset
    """Nodes computed from initializers and constants alone (folded once when weights load)."""

    @property
    def n_layers(self) -> int:
        return (len(self.names) - 2) // 2

    def nodes_of(self, b: int) -> list:
        return [i for i, nb in enumerate(self.node_block) if nb == b]


def _table_gathers(graph: OnnxGraph) -> list:
    """Gather nodes that read rows of a rank-2 float initializer (embedding lookups)."""
    out = []
    for n in graph.nodes:
        if n.op == "Gather" and n.attrs.get("axis", 0) == 0:
            t = graph.initializers.get(n.inputs[0])
            if t is not None and len(t.dims) == 2 and t.dtype in (1, 10, 11, 16):
                out.append(n)
    return out


def _token_gather(graph: OnnxGraph, gathers: list) -> tuple:
    """The embedding lookup of the token ids and the graph input it reads: the one reading
    ``input_ids`` if there is such an input, else the largest table."""
    if not gathers:
        raise HetplanError("no token embedding found (a Gather from a [vocab, hidden] initializer): "
                           "this does not look like a decoder-only language model export")
    producers = graph.producers()
    by_input = {}
    for n in gathers:
        v = n.inputs[1]
        while v in producers and graph.nodes[producers[v]].op in ("Cast", "Reshape", "Identity", "Unsqueeze"):
            v = graph.nodes[producers[v]].inputs[0]
        by_input[v] = n
    if "input_ids" in by_input:
        return by_input["input_ids"], "input_ids"
    tok = max(gathers, key=lambda n: graph.initializers[n.inputs[0]].dims[0])
    ids = next(v for v, n in by_input.items() if n is tok)
    if ids not in {i.name for i in graph.inputs}:
        raise HetplanError(f"the token embedding {tok.name!r} does not read a graph input; "
                           f"hetplan plans exports whose first input is the token ids")
    return tok, ids


def _depends_on(graph: OnnxGraph, producers: dict, value: str, target: str, floor: int) -> bool:
    """True when ``value`` is computed from ``target`` (whose producer is node ``floor``)."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v == target:
            return True
        i = producers.get(v)
        if i is None or i <= floor or i in seen:
            continue
        seen.add(i)
        stack.extend(x for x in graph.nodes[i].inputs if x)
    return False


def _aliases(graph: OnnxGraph, consumers: dict, value: str) -> list:
    """``value`` and what Cast/Identity nodes copy it to (tracing exporters route the residual
    through the norm's dtype cast)."""
    out, stack = [], [value]
    while stack:
        v = stack.pop()
        out.append(v)
        stack += [graph.nodes[i].outputs[0] for i in consumers.get(v, [])
                  if graph.nodes[i].op in ("Cast", "Identity")]
    return out


def _residual_chain(graph: OnnxGraph, start: str) -> list:
    """Indices of the residual Add nodes, following the hidden state from ``start``."""
    producers, consumers = graph.producers(), graph.consumers()
    chain, h = [], start
    while True:
        floor = producers.get(h, -1)
        adds = []
        for alias in _aliases(graph, consumers, h):
            for i in consumers.get(alias, []):
                n = graph.nodes[i]
                if n.op != "Add" or len(n.inputs) != 2:
                    continue
                other = n.inputs[1] if n.inputs[0] == alias else n.inputs[0]
                if other != alias and _depends_on(graph, producers, other, h, floor):
                    adds.append(i)
        if not adds:
            return chain
        if len(adds) > 1:
            names = ", ".join(repr(graph.nodes[i].name) for i in adds)
            raise HetplanError(f"the hidden state {h!r} feeds several residual additions ({names}); "
                               f"hetplan plans sequential decoder layers (attention then MLP)")
        chain.append(adds[0])
        h = graph.nodes[adds[0]].outputs[0]


def group_blocks(graph: OnnxGraph) -> Blocks:
    """Assign every node of ``graph`` to a block; refuse graphs without decoder layers."""
    gathers = _table_gathers(graph)
    tok, ids = _token_gather(graph, gathers)
    hidden = tok.outputs[0]
    pos_table = None
    pinned = {tok.index}
    consumers = graph.consumers()
    producers = graph.producers()
    gather_out = {g.outputs[0]: g for g in gathers if g is not tok}
    for alias in _aliases(graph, consumers, hidden):
        for i in consumers.get(alias, []):
            n = graph.nodes[i]
            other = [x for x in n.inputs if x != alias]
            if n.op != "Add" or len(other) != 1:
                continue
            v = other[0]
            while v in producers and graph.nodes[producers[v]].op in ("Cast", "Identity"):
                v = graph.nodes[producers[v]].inputs[0]
            if v in gather_out:
                pos_table = gather_out[v].inputs[0]
                pinned |= {n.index, gather_out[v].index}
                hidden = n.outputs[0]
                break
        if pos_table:
            break
    chain = _residual_chain(graph, hidden)
    if len(chain) < 2 or len(chain) % 2:
        raise HetplanError(f"no recognisable decoder layers: found {len(chain)} residual addition(s) "
                           f"after the token embedding, expected two per layer (attention, then MLP); "
                           f"hetplan plans llama- and gpt2-style decoder exports")
    # Segment of each value: -1 (embedding/prologue) .. len(chain) (head).
    seg = {}
    residual = {i: k for k, i in enumerate(chain)}
    node_block = []
    constant = set(graph.initializers)
    constant_nodes = set()
    for n in graph.nodes:
        if all(x in constant for x in n.inputs if x):
            constant.update(n.outputs)
            constant_nodes.add(n.index)
        s = max((seg.get(x, EMBED) for x in n.inputs if x), default=EMBED)
        node_block.append(s + 1)
        out_seg = residual[n.index] + 1 if n.index in residual else s
        for o in n.outputs:
            seg[o] = out_seg
        if hidden in n.outputs:
            seg[hidden] = 0
    _sink(graph, consumers, node_block, pinned | constant_nodes)
    n_layers = len(chain) // 2
    names, kinds, layers = ["embed"], ["embed"], [None]
    for l in range(n_layers):
        names += [f"attn_{l}", f"mlp_{l}"]
        kinds += ["attn", "mlp"]
        layers += [l, l]
    names.append("head")
    kinds.append("head")
    layers.append(None)
    blocks = Blocks(tuple(names), tuple(kinds), tuple(layers), tuple(node_block),
                    tok.inputs[0], ids, pos_table, frozenset(constant_nodes))
    _check_kinds(graph, blocks)
    return blocks


def _sink(graph: OnnxGraph, consumers: dict, node_block: list, pinned: set) -> None:
    """Move prologue nodes read by a single later block into that block (in place): a rotary
    table unsqueezed for one layer, a past cache reshaped before its layer's attention. Visiting
    nodes last to first settles every consumer before its producers; moving a node later never
    breaks the order, since all its readers are in that block."""
    outputs = set(graph.outputs)
    for n in reversed(graph.nodes):
        if node_block[n.index] != 0 or n.index in pinned or outputs.intersection(n.outputs):
            continue
        readers = {node_block[j] for o in n.outputs for j in consumers.get(o, [])}
        if len(readers) == 1 and min(readers) > 0:
            node_block[n.index] = min(readers)


def _check_kinds(graph: OnnxGraph, blocks: Blocks) -> None:
    """Attention segments hold the attention; MLP segments do not."""
    has_attn = [False] * len(blocks.names)
    for n in graph.nodes:
        if n.op in ATTENTION_OPS:
            has_attn[blocks.node_block[n.index]] = True
    for b, kind in enumerate(blocks.kinds):
        if kind in ("attn", "mlp") and has_attn[b] != (kind == "attn"):
            raise HetplanError(f"no recognisable decoder layers: residual segment {blocks.names[b]!r} "
                               f"{'lacks' if kind == 'attn' else 'holds'} an attention Softmax; "
                               f"hetplan plans decoders whose layers are attention then MLP")
