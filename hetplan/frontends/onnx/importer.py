"""An ONNX decoder export -> an ``OnnxModel`` (graph, blocks, inputs) and its ``ModelSpec``.

``open_onnx`` reads the graph without its weights (``hetplan.frontends.onnx.load``), refuses operators
outside ``hetplan.frontends.onnx.opset``, groups nodes into blocks (``hetplan.frontends.onnx.blocks``) and finds
the past key/value inputs of a decoder-with-past export. ``spec_from_onnx`` reads the model's
sizes off the graph: vocab and hidden from the embedding table, layers from the residual
stream, projection widths from the weights, heads from the attention's shapes; the family is
guessed from the structure (LayerNorm + learned positions: gpt2, else llama). The spec's
``extra`` carries the file's path and hash, which pull the block graph from the ONNX nodes
(``hetplan.frontends.onnx.graph``) instead of the analytic formulas. Knows nothing about costs or torch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

from hetplan.errors import HetplanError
from hetplan.model import ModelSpec
from hetplan.frontends.onnx.blocks import Blocks, group_blocks
from hetplan.frontends.onnx.ir import OnnxGraph, from_proto
from hetplan.frontends.onnx.load import FLOAT_TYPES, check_external_data, external_files, file_sha256, read_model
from hetplan.frontends.onnx.opset import check_supported
from hetplan.frontends.onnx.shapes import infer

NO_POSITION_LIMIT = 2**31 - 1
"""max_positions of a rotary graph: the export itself fixes no limit."""


@dataclass(frozen=True)
class OnnxModel:
    path: Path
    sha256: str
    graph: OnnxGraph
    blocks: Blocks
    past_inputs: tuple
    """Names of the past key/value inputs (empty when the graph has no KV cache)."""
    external: dict
    """External-data file -> (bytes needed, an initializer stored there)."""

    @property
    def with_past(self) -> bool:
        return bool(self.past_inputs)

    def constant_values(self) -> set:
        """Initializers and the outputs of nodes computed from constants alone."""
        const = set(self.graph.initializers)
        for i in self.blocks.constant_nodes:
            const.update(self.graph.nodes[i].outputs)
        return const

    def live_values(self) -> list:
        """Per block b, the values that enter it from earlier blocks (sorted names): produced
        before b (the token ids count as the embedding's) and read by b or a later block. They
        are what moves when block b runs on another device than block b - 1."""
        blocks, const = self.blocks, self.constant_values()
        produced_in = {self.blocks.token_ids: 0}
        last_reader = {}
        for n in self.graph.nodes:
            if n.index in blocks.constant_nodes:
                continue
            b = blocks.node_block[n.index]
            for x in n.inputs:
                if x and x not in const:
                    last_reader[x] = max(last_reader.get(x, 0), b)
            for o in n.outputs:
                produced_in[o] = b
        live = [[] for _ in blocks.names]
        for x, last in last_reader.items():
            if x in produced_in:
                for b in range(produced_in[x] + 1, last + 1):
                    live[b].append(x)
        return [sorted(v) for v in live]

    def shapes(self, batch: int, seq: int, past: int) -> dict:
        """Every value's AVal (shape, dtype, small values) for these sizes (``input_shapes``)."""
        try:
            return infer(self.graph, self.input_shapes(batch, seq, past))
        except HetplanError as e:
            msg = str(e)
            raise HetplanError(msg if msg.startswith(str(self.path)) else f"{self.path}: {msg}") from None

    def input_shapes(self, batch: int, seq: int, past: int) -> dict:
        """Every graph input's shape for ``batch`` sequences of ``seq`` new tokens after ``past``
        cached ones; an input whose fixed size disagrees is an error saying how to re-export."""
        shapes = {}
        for inp in self.graph.inputs:
            low = inp.name.lower()
            if inp.name in self.past_inputs:
                want = tuple(batch if a == 0 else past if a == 2 else d for a, d in enumerate(inp.dims))
            elif inp.name == self.blocks.token_ids or "position_ids" in low:
                want = (batch, seq)
            elif "cache_position" in low:
                want = (seq,)
            elif "mask" in low:
                want = (batch, past + seq)
            else:
                raise HetplanError(f"{self.path}: graph input {inp.name!r} is none of the token ids, "
                                   f"position ids, attention mask or past key/values; hetplan cannot "
                                   f"size it")
            if len(want) != len(inp.dims):
                raise HetplanError(f"{self.path}: graph input {inp.name!r} has rank {len(inp.dims)}, "
                                   f"expected {len(want)}")
            for a, (d, w) in enumerate(zip(inp.dims, want)):
                if isinstance(d, int) and d != w:
                    raise HetplanError(f"{self.path}: graph input {inp.name!r} has a fixed size {d} on "
                                       f"axis {a}, the workload needs {w}; export with dynamic axes")
                if not isinstance(w, int):
                    raise HetplanError(f"{self.path}: past input {inp.name!r} has a symbolic size on axis "
                                       f"{a}; hetplan needs the head count and head size fixed")
            shapes[inp.name] = want
        return shapes


def _past_inputs(graph: OnnxGraph, path: Path) -> tuple:
    past = tuple(i.name for i in graph.inputs if "past" in i.name.lower())
    for name in past:
        dims = next(i.dims for i in graph.inputs if i.name == name)
        if len(dims) != 4:
            raise HetplanError(f"{path}: past input {name!r} has rank {len(dims)}; hetplan reads "
                               f"per-layer key and value caches of shape [batch, heads, past, head_dim]")
    return past


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> OnnxModel:
    p = Path(path)
    proto = read_model(p)
    opset = check_supported(proto, str(p))
    graph = from_proto(proto, opset)
    try:
        blocks = group_blocks(graph)
    except HetplanError as e:
        raise HetplanError(f"{p}: {e}") from None
    return OnnxModel(p, file_sha256(p), graph, blocks, _past_inputs(graph, p), external_files(proto, p))


def open_onnx(path: str | Path) -> OnnxModel:
    """Read, check and group ``path`` (cached per file version: compile reads it several times)."""
    p = Path(path).resolve()
    if not p.is_file():
        raise HetplanError(f"{path}: no such ONNX file")
    st = p.stat()
    m = _open(str(p), st.st_mtime_ns, st.st_size)
    check_external_data(p, m.external)
    return m


# -- the spec --------------------------------------------------------------------------------------

def _linears(m: OnnxModel, env: dict, const: set, b: int) -> list:
    """(node, output width, has bias) of block ``b``'s products with a constant matrix, in order."""
    consumers = m.graph.consumers()
    out = []
    for i in m.blocks.nodes_of(b):
        n = m.graph.nodes[i]
        if n.op not in ("MatMul", "Gemm") or n.inputs[1] not in const or len(env[n.inputs[1]].shape) != 2:
            continue
        bias = len(n.inputs) > 2 and bool(n.inputs[2])
        for j in consumers.get(n.outputs[0], []):
            c = m.graph.nodes[j]
            if c.op == "Add" and any(x in const and len(env[x].shape) == 1 for x in c.inputs):
                bias = True
        out.append((n, env[n.outputs[0]].shape[-1], bias))
    return out


def _ops_of(m: OnnxModel, b: int) -> set:
    return {m.graph.nodes[i].op for i in m.blocks.nodes_of(b)}


def _heads(m: OnnxModel, env: dict, const: set, q_dim: int) -> tuple:
    """(heads, head_dim) from layer 0's attention scores: the first product of two activations
    reads q as [..., heads, seq, head_dim]."""
    for i in m.blocks.nodes_of(1):
        n = m.graph.nodes[i]
        if n.op == "MatMul" and not any(x in const for x in n.inputs):
            shape = env[n.inputs[0]].shape
            if len(shape) >= 3 and shape[-3] * shape[-1] == q_dim:
                return shape[-3], shape[-1]
    raise HetplanError(f"{m.path}: could not find the attention heads of layer 0 (a product of q "
                       f"[batch, heads, seq, head_dim] with the keys)")


def spec_from_onnx(path: str | Path, weight_dtype: str | None = None,
                   kv_dtype: str | None = None) -> ModelSpec:
    """The ModelSpec of an ONNX decoder export; sizes read off the graph."""
    m = open_onnx(path)
    g, blocks = m.graph, m.blocks
    env = m.shapes(1, 2, 1 if m.with_past else 0)
    const = m.constant_values()
    table = g.initializers[blocks.token_embedding]
    vocab, hidden = table.dims
    native = FLOAT_TYPES.get(table.dtype)
    if native not in ("fp32", "fp16", "bf16"):
        raise HetplanError(f"{m.path}: embedding weights of ONNX type {table.dtype} are not supported "
                           f"(fp32, fp16, bf16 are)")
    attn, mlp = _linears(m, env, const, 1), _linears(m, env, const, 2)
    if len(attn) not in (2, 4) or len(mlp) not in (2, 3):
        raise HetplanError(f"{m.path}: layer 0 has {len(attn)} attention and {len(mlp)} MLP weight "
                           f"products; hetplan reads q/k/v/o (or fused qkv/o) and gate/up/down "
                           f"(or up/down) projections")
    if m.with_past:
        kv_shape = next(i.dims for i in g.inputs if i.name == m.past_inputs[0])
        n_kv, head_dim = kv_shape[1], kv_shape[3]
        kv_dim = n_kv * head_dim
        q_dim = attn[0][1] if len(attn) == 4 else attn[0][1] - 2 * kv_dim
        n_heads = q_dim // head_dim
    else:
        q_dim = attn[0][1] if len(attn) == 4 else attn[0][1] // 3
        kv_dim = attn[1][1] if len(attn) == 4 else q_dim
        n_heads, head_dim = _heads(m, env, const, q_dim)
        n_kv = kv_dim // head_dim
    ops = set().union(*(_ops_of(m, b) for b in range(1, len(blocks.names))))
    layernorm = "LayerNormalization" in ops or "Sub" in _ops_of(m, 1)
    learned = blocks.position_embedding is not None
    mlp_ops = _ops_of(m, 2)
    act = ("silu" if "Sigmoid" in mlp_ops else "gelu_new" if "Tanh" in mlp_ops
           else "gelu" if mlp_ops & {"Erf", "Gelu"} else "relu")
    head_consts = {x for i in blocks.nodes_of(len(blocks.names) - 1) for x in g.nodes[i].inputs}
    # float32 attributes, read at float32 precision (a plan stores floats to 10 digits)
    eps = [n.attrs["epsilon"] for n in g.nodes if n.op in ("LayerNormalization", "SimplifiedLayerNormalization")
           and "epsilon" in n.attrs]
    past_dtype = next((i.dtype for i in g.inputs if i.name in m.past_inputs), table.dtype)
    native_kv = FLOAT_TYPES.get(past_dtype, native)
    try:
        return ModelSpec(
            name=m.path.stem, arch="gpt2" if layernorm and learned else "llama",
            n_layers=blocks.n_layers, hidden=int(hidden), intermediate=int(mlp[0][1]),
            n_heads=int(n_heads), n_kv_heads=int(n_kv), head_dim=int(head_dim), vocab=int(vocab),
            max_positions=(g.initializers[blocks.position_embedding].dims[0] if learned
                           else NO_POSITION_LIMIT),
            tie_embeddings=blocks.token_embedding in head_consts,
            norm="layernorm" if layernorm else "rmsnorm", norm_eps=float(f"{eps[0]:.6g}") if eps else 1e-6,
            act=act, gated_mlp=len(mlp) == 3, pos="learned" if learned else "rope",
            attn_bias=attn[0][2], attn_out_bias=attn[-1][2], mlp_bias=mlp[0][2],
            weight_dtype=weight_dtype or native, kv_dtype=kv_dtype or native_kv,
            extra={"source": "onnx", "onnx_path": str(m.path), "onnx_sha256": m.sha256,
                   "with_past": m.with_past, "opset": g.opset, "native_dtype": native})
    except HetplanError as e:
        raise HetplanError(f"{m.path}: {e}") from None


def with_onnx_file(plan, path: str | Path):
    """``plan`` (compiled from an ONNX model) reading its graph from ``path``: the same file,
    moved or copied (its sha256 must match the one the plan was compiled from)."""
    extra = plan.model.extra
    if extra.get("source") != "onnx":
        source = plan.inputs.get("model_source", plan.model.name)
        raise HetplanError(f"--model {path}: the plan was compiled from {source!r}, not an ONNX graph; "
                           f"--model applies to plans of .onnx models")
    m = open_onnx(path)
    if m.sha256 != extra.get("onnx_sha256"):
        raise HetplanError(f"--model {path}: not the ONNX file the plan was compiled from (sha256 "
                           f"{m.sha256[:12]}..., the plan's {str(extra.get('onnx_sha256'))[:12]}...); "
                           f"recompile the plan for this file")
    spec = dataclasses.replace(plan.model, extra={**extra, "onnx_path": str(m.path)})
    return dataclasses.replace(plan, model=spec)
