"""Shapes of every value of an ONNX graph for concrete input sizes, by abstract interpretation.

Each value is an ``AVal``: a shape and a dtype, plus the data itself for small tensors (the
shape arithmetic exporters emit: ``Shape -> Gather -> Concat -> Reshape``, ``Range`` over a
sequence length). Nodes are visited in graph order and each operator has a rule; a rule that
needs a value that depends on the data (a Reshape target computed from token ids) is an error
naming the node. Only the operators of ``hetplan.frontends.onnx.opset.SUPPORTED_OPS`` have rules.
Knows nothing about blocks, costs or devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hetplan.errors import HetplanError
from hetplan.frontends.onnx.ir import SMALL_ELEMS, OnnxGraph

BOOL, INT64, FLOAT = 9, 7, 1
NP_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 5: np.int16, 6: np.int32, 7: np.int64,
             9: np.bool_, 10: np.float16, 11: np.float64, 12: np.uint32, 13: np.uint64}
ONNX_TYPES = {v: k for k, v in NP_DTYPES.items()}


@dataclass(frozen=True, eq=False)
class AVal:
    shape: tuple
    dtype: int
    """ONNX TensorProto element type."""
    value: np.ndarray | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _known(x: AVal | None) -> bool:
    return x is not None and x.value is not None


def _val(x: AVal | None, node, what: str) -> np.ndarray:
    if not _known(x):
        raise HetplanError(f"node {node.name!r} ({node.op}): its {what} depends on the input data, "
                           f"so its shape cannot be planned; hetplan needs static shape arithmetic")
    return x.value


def _make(shape, dtype, value=None) -> AVal:
    shape = tuple(int(d) for d in shape)
    if value is not None and value.size > SMALL_ELEMS:
        value = None
    return AVal(shape, dtype, value)


def _from_value(v: np.ndarray, dtype: int) -> AVal:
    return _make(v.shape, dtype, v)


# -- rules ----------------------------------------------------------------------------------------

def _np_div(a, b):
    if np.issubdtype(a.dtype, np.integer):
        return (np.abs(a) // np.abs(b)) * np.sign(a) * np.sign(b)
    return a / b


_BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": _np_div, "Pow": np.power,
           "Mod": np.fmod, "Equal": np.equal, "Less": np.less, "LessOrEqual": np.less_equal,
           "Greater": np.greater, "GreaterOrEqual": np.greater_equal, "And": np.logical_and,
           "Or": np.logical_or, "Max": np.maximum, "Min": np.minimum}
_COMPARE = {"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or"}
_UNARY = {"Neg": np.negative, "Abs": np.abs, "Not": np.logical_not, "Identity": lambda x: x,
          "Floor": np.floor, "Ceil": np.ceil, "Sqrt": np.sqrt, "Reciprocal": np.reciprocal,
          "Exp": np.exp, "Log": np.log, "Relu": lambda x: np.maximum(x, 0), "Cos": np.cos,
          "Sin": np.sin, "Tanh": np.tanh, "IsNaN": np.isnan}
_SAME_SHAPE = {"Sigmoid", "Erf", "Gelu", "Softmax", "CumSum", "Trilu", "Clip"}


def _elementwise(node, ins, opset):
    shape = np.broadcast_shapes(*[x.shape for x in ins])
    dtype = BOOL if node.op in _COMPARE else ins[0].dtype
    value = None
    if all(_known(x) for x in ins) and math.prod(shape) <= SMALL_ELEMS:
        f = _BINARY[node.op]
        value = ins[0].value
        for x in ins[1:]:
            value = f(value, x.value)
        value = np.asarray(value).astype(NP_DTYPES.get(dtype, value.dtype))
    return [_make(shape, dtype, value)]


def _unary(node, ins, opset):
    x = ins[0]
    dtype = BOOL if node.op in ("Not", "IsNaN") else x.dtype
    value = _UNARY[node.op](x.value) if node.op in _UNARY and _known(x) else None
    return [_make(x.shape, dtype, None if value is None else np.asarray(value))]


def _where(node, ins, opset):
    shape = np.broadcast_shapes(*[x.shape for x in ins])
    value = np.where(ins[0].value, ins[1].value, ins[2].value) if all(_known(x) for x in ins) else None
    return [_make(shape, ins[1].dtype, value)]


def _matmul(node, ins, opset):
    a, b = ins[0].shape, ins[1].shape
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise HetplanError(f"node {node.name!r} (MatMul): inner dimensions differ: {a} x {b}")
    out = tuple(np.broadcast_shapes(a2[:-2], b2[:-2])) + (a2[-2], b2[-1])
    if len(b) == 1:
        out = out[:-1]
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    return [_make(out, ins[0].dtype)]


def _gemm(node, ins, opset):
    a, b = ins[0].shape, ins[1].shape
    m = a[1] if node.attrs.get("transA", 0) else a[0]
    n = b[0] if node.attrs.get("transB", 0) else b[1]
    return [_make((m, n), ins[0].dtype)]


def _reshape(node, ins, opset):
    x, target = ins[0], [int(d) for d in _val(ins[1], node, "target shape")]
    allowzero = node.attrs.get("allowzero", 0)
    out = [x.shape[i] if d == 0 and not allowzero else d for i, d in enumerate(target)]
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        out[out.index(-1)] = x.numel // known if known else 0
    if math.prod(out) != x.numel:
        raise HetplanError(f"node {node.name!r} (Reshape): cannot reshape {x.shape} to {tuple(target)}")
    return [_make(out, x.dtype, None if x.value is None else x.value.reshape(out))]


def _transpose(node, ins, opset):
    x = ins[0]
    perm = node.attrs.get("perm") or tuple(reversed(range(len(x.shape))))
    return [_make([x.shape[p] for p in perm], x.dtype,
                  None if x.value is None else np.transpose(x.value, perm))]


def _axis(a, rank):
    return a + rank if a < 0 else a


def _concat(node, ins, opset):
    ins = [x for x in ins if x is not None]
    axis = _axis(node.attrs["axis"], len(ins[0].shape))
    shape = list(ins[0].shape)
    shape[axis] = sum(x.shape[axis] for x in ins)
    value = np.concatenate([x.value for x in ins], axis) if all(_known(x) for x in ins) else None
    return [_make(shape, ins[0].dtype, value)]


def _gather(node, ins, opset):
    data, idx = ins
    axis = _axis(node.attrs.get("axis", 0), len(data.shape))
    shape = data.shape[:axis] + idx.shape + data.shape[axis + 1:]
    value = np.take(data.value, idx.value, axis=axis) if _known(data) and _known(idx) else None
    return [_make(shape, data.dtype, value)]


def gather_nd_shape(data: tuple, indices: tuple, batch_dims: int) -> tuple:
    """GatherND's output shape: the index tuples' shape (batch dims included), then what each
    tuple of ``indices[-1]`` coordinates leaves of ``data`` after the batch dims."""
    return tuple(indices[:-1]) + tuple(data[batch_dims + indices[-1]:])


def _gather_nd(node, ins, opset):
    data, idx = ins
    b = node.attrs.get("batch_dims", 0)
    if idx.shape[-1] > len(data.shape) - b or tuple(data.shape[:b]) != tuple(idx.shape[:b]):
        raise HetplanError(f"node {node.name!r} (GatherND): indices {idx.shape} do not index data "
                           f"{data.shape} with batch_dims={b}")
    value = None
    if _known(data) and _known(idx) and b == 0:
        value = data.value[tuple(np.moveaxis(idx.value, -1, 0))]
    return [_make(gather_nd_shape(data.shape, idx.shape, b), data.dtype, value)]


def _scatter_nd(node, ins, opset):
    data, idx, upd = ins
    want = tuple(idx.shape[:-1]) + tuple(data.shape[idx.shape[-1]:])
    if tuple(upd.shape) != want:
        raise HetplanError(f"node {node.name!r} (ScatterND): updates of shape {upd.shape} do not fit "
                           f"data {data.shape} indexed by {idx.shape} (expected {want})")
    return [_make(data.shape, data.dtype)]


def _slices(node, ins, rank_shape):
    starts = _val(ins[1], node, "starts")
    ends = _val(ins[2], node, "ends")
    axes = _val(ins[3], node, "axes") if len(ins) > 3 and ins[3] is not None else range(len(starts))
    steps = _val(ins[4], node, "steps") if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    index = [slice(None)] * len(rank_shape)
    for s, e, a, st in zip(starts, ends, axes, steps):
        index[_axis(int(a), len(rank_shape))] = slice(int(s), int(e), int(st))
    return tuple(index)


def _slice(node, ins, opset):
    x = ins[0]
    index = _slices(node, ins, x.shape)
    shape = [len(range(*sl.indices(d))) for sl, d in zip(index, x.shape)]
    return [_make(shape, x.dtype, None if x.value is None else x.value[index])]


def split_sizes(node, dim: int, split: np.ndarray | None, n_out: int) -> list:
    """Sizes of a Split's outputs: the ``split`` input, else equal parts (the last smaller)."""
    if split is not None:
        return [int(s) for s in split]
    n = node.attrs.get("num_outputs", n_out)
    part = -(-dim // n)
    return [min(part, dim - i * part) for i in range(n)]


def _split(node, ins, opset):
    x = ins[0]
    axis = _axis(node.attrs.get("axis", 0), len(x.shape))
    split = _val(ins[1], node, "split sizes") if len(ins) > 1 and ins[1] is not None else node.attrs.get("split")
    sizes = split_sizes(node, x.shape[axis], None if split is None else np.asarray(split), len(node.outputs))
    outs = []
    for s in sizes:
        shape = list(x.shape)
        shape[axis] = s
        outs.append(_make(shape, x.dtype))
    return outs


def _axes_input(node, ins, opset, attr_before: int):
    """Axes given as attribute (opsets before ``attr_before``) or as the second input."""
    if opset < attr_before:
        return node.attrs.get("axes")
    if len(ins) > 1 and ins[1] is not None:
        return [int(a) for a in _val(ins[1], node, "axes")]
    return None


def _unsqueeze(node, ins, opset):
    x = ins[0]
    axes = _axes_input(node, ins, opset, 13)
    rank = len(x.shape) + len(axes)
    axes = sorted(_axis(a, rank) for a in axes)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return [_make(shape, x.dtype, None if x.value is None else x.value.reshape(shape))]


def _squeeze(node, ins, opset):
    x = ins[0]
    axes = _axes_input(node, ins, opset, 13)
    axes = {_axis(a, len(x.shape)) for a in axes} if axes else {i for i, d in enumerate(x.shape) if d == 1}
    shape = [d for i, d in enumerate(x.shape) if i not in axes]
    return [_make(shape, x.dtype, None if x.value is None else x.value.reshape(shape))]


def _expand(node, ins, opset):
    x, target = ins[0], [int(d) for d in _val(ins[1], node, "target shape")]
    shape = np.broadcast_shapes(x.shape, tuple(target))
    value = np.broadcast_to(x.value, shape) if _known(x) and math.prod(shape) <= SMALL_ELEMS else None
    return [_make(shape, x.dtype, value)]


def _tile(node, ins, opset):
    x, reps = ins[0], _val(ins[1], node, "repeats")
    return [_make([d * int(r) for d, r in zip(x.shape, reps)], x.dtype,
                  None if x.value is None else np.tile(x.value, reps))]


def _shape(node, ins, opset):
    shape = ins[0].shape
    start, end = node.attrs.get("start", 0), node.attrs.get("end", len(shape))
    return [_from_value(np.asarray(shape[start:end], dtype=np.int64), INT64)]


def _size(node, ins, opset):
    return [_from_value(np.asarray(ins[0].numel, dtype=np.int64), INT64)]


def _cast(node, ins, opset):
    x, to = ins[0], node.attrs["to"]
    value = x.value.astype(NP_DTYPES[to]) if _known(x) and to in NP_DTYPES else None
    return [_make(x.shape, to, value)]


def _constant(node, ins, opset):
    a = node.attrs
    if "value" in a:
        v = a["value"]
    elif "value_int" in a:
        v = np.asarray(a["value_int"], dtype=np.int64)
    elif "value_ints" in a:
        v = np.asarray(a["value_ints"], dtype=np.int64)
    elif "value_float" in a:
        v = np.asarray(a["value_float"], dtype=np.float32)
    elif "value_floats" in a:
        v = np.asarray(a["value_floats"], dtype=np.float32)
    else:
        raise HetplanError(f"node {node.name!r} (Constant): unsupported constant attribute {sorted(a)}")
    return [_make(v.shape, ONNX_TYPES.get(v.dtype.type, FLOAT), v)]


def _constant_of_shape(node, ins, opset):
    shape = [int(d) for d in _val(ins[0], node, "shape")]
    fill = node.attrs.get("value", np.zeros(1, dtype=np.float32))
    dtype = ONNX_TYPES.get(fill.dtype.type, FLOAT)
    value = np.full(shape, fill.reshape(-1)[0], dtype=fill.dtype) if math.prod(shape) <= SMALL_ELEMS else None
    return [_make(shape, dtype, value)]


def _range(node, ins, opset):
    start, limit, delta = (_val(x, node, "bounds").item() for x in ins)
    n = max(math.ceil((limit - start) / delta), 0)
    value = np.arange(start, limit, delta, dtype=NP_DTYPES[ins[0].dtype]) if n <= SMALL_ELEMS else None
    return [_make((n,), ins[0].dtype, value)]


def _reduce(node, ins, opset):
    x = ins[0]
    attr_before = 13 if node.op == "ReduceSum" else 18
    axes = _axes_input(node, ins, opset, attr_before)
    if not axes:
        if node.attrs.get("noop_with_empty_axes", 0):
            return [x]
        axes = range(len(x.shape))
    axes = {_axis(a, len(x.shape)) for a in axes}
    keep = node.attrs.get("keepdims", 1)
    shape = [1 if i in axes else d for i, d in enumerate(x.shape) if keep or i not in axes]
    return [_make(shape, x.dtype)]


def _flatten(node, ins, opset):
    x = ins[0]
    axis = _axis(node.attrs.get("axis", 1), len(x.shape))
    return [_make((math.prod(x.shape[:axis]), math.prod(x.shape[axis:])), x.dtype)]


def _layer_norm(node, ins, opset):
    x = ins[0]
    axis = _axis(node.attrs.get("axis", -1), len(x.shape))
    stat = x.shape[:axis] + (1,) * (len(x.shape) - axis)
    return [_make(x.shape, x.dtype)] + [_make(stat, FLOAT) for _ in node.outputs[1:]]


def _same(node, ins, opset):
    return [_make(ins[0].shape, ins[0].dtype)]


RULES = {
    **{op: _elementwise for op in _BINARY}, **{op: _unary for op in _UNARY},
    **{op: _same for op in _SAME_SHAPE},
    "Where": _where, "MatMul": _matmul, "Gemm": _gemm, "Reshape": _reshape, "Transpose": _transpose,
    "Concat": _concat, "Gather": _gather, "GatherND": _gather_nd, "ScatterND": _scatter_nd,
    "Slice": _slice, "Split": _split, "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze, "Expand": _expand, "Tile": _tile, "Shape": _shape, "Size": _size,
    "Cast": _cast, "Constant": _constant, "ConstantOfShape": _constant_of_shape, "Range": _range,
    "ReduceMean": _reduce, "ReduceSum": _reduce, "ReduceMax": _reduce, "Flatten": _flatten,
    "LayerNormalization": _layer_norm, "SimplifiedLayerNormalization": _layer_norm,
}


def infer(graph: OnnxGraph, input_shapes: dict) -> dict:
    """value name -> AVal for every value of ``graph``, given each graph input's shape."""
    env = {}
    for name, init in graph.initializers.items():
        env[name] = AVal(init.dims, init.dtype, init.value)
    for inp in graph.inputs:
        env[inp.name] = AVal(tuple(input_shapes[inp.name]), inp.dtype)
    for node in graph.nodes:
        ins = [env[i] if i else None for i in node.inputs]
        try:
            outs = RULES[node.op](node, ins, graph.opset)
        except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError) as e:
            shapes = [None if x is None else x.shape for x in ins]
            raise HetplanError(f"node {node.name!r} ({node.op}): inputs of shapes {shapes} do not fit "
                               f"the operator ({type(e).__name__}: {e})") from None
        for name, val in zip(node.outputs, outs):
            if name:
                env[name] = val
    return env
