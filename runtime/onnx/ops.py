"""Torch implementations of the ONNX operators in ``hetplan.frontends.onnx.opset.SUPPORTED_OPS``.

``OPS[op_type](node, inputs, opset) -> [outputs]`` with ``inputs`` a list of tensors (None for
an omitted optional input) and ``node`` a ``hetplan.frontends.onnx.ir.Node``. Semantics follow the ONNX
operator specification for opsets 13..23 (integer division truncates, ``Mod`` follows ``fmod``,
``Pow`` keeps the base's type, ``Expand`` broadcasts both ways). Shape-like inputs (a Reshape
target, Slice bounds, axes) are read as Python integers. ``Shape`` and ``Size`` answer with host
tensors, so shape arithmetic never waits on a device. Knows nothing about blocks or plans.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TORCH_OF_ONNX = {1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32,
                 7: torch.int64, 9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16}
"""ONNX TensorProto element type -> torch dtype."""

HOST_PARAMS = {"Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Unsqueeze": (1,),
               "Squeeze": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
               "Split": (1,), "ReduceMean": (1,), "ReduceSum": (1,), "ReduceMax": (1,),
               "CumSum": (1,), "Trilu": (1,)}
"""Inputs each op reads as Python numbers: they may stay on the host."""


def constant_tensor(node) -> torch.Tensor:
    """The value of a Constant node, as a host tensor."""
    a = node.attrs
    if "value" in a:
        return torch.from_numpy(a["value"].copy())
    for key, dtype in (("value_int", torch.int64), ("value_ints", torch.int64),
                       ("value_float", torch.float32), ("value_floats", torch.float32)):
        if key in a:
            return torch.tensor(a[key], dtype=dtype)
    raise ValueError(f"Constant node {node.name!r}: unsupported attribute {sorted(a)}")


def _ints(t) -> list:
    return [int(v) for v in t.reshape(-1).tolist()]


def _axis(a: int, rank: int) -> int:
    return a + rank if a < 0 else a


# -- element-wise -----------------------------------------------------------------------------------

def _div(node, x, opset):
    a, b = x
    if not a.is_floating_point():
        return [torch.div(a, b, rounding_mode="trunc")]
    return [a / b]


def _pow(node, x, opset):
    return [torch.pow(x[0], x[1]).to(x[0].dtype)]


def _mod(node, x, opset):
    return [torch.fmod(x[0], x[1]) if node.attrs.get("fmod", 0) else torch.remainder(x[0], x[1])]


def _variadic(f):
    def op(node, x, opset):
        out = x[0]
        for t in x[1:]:
            out = f(out, t)
        return [out]
    return op


def _clip(node, x, opset):
    lo = x[1] if len(x) > 1 and x[1] is not None else None
    hi = x[2] if len(x) > 2 and x[2] is not None else None
    return [torch.clamp(x[0], lo, hi)]


def _gelu(node, x, opset):
    approx = node.attrs.get("approximate", b"none")
    approx = approx.decode() if isinstance(approx, bytes) else approx
    return [F.gelu(x[0], approximate=approx)]


def _unary(f):
    return lambda node, x, opset: [f(x[0])]


def _binary(f):
    return lambda node, x, opset: [f(x[0], x[1])]


def _where(node, x, opset):
    return [torch.where(x[0], x[1], x[2])]


# -- normalisation and reductions --------------------------------------------------------------------

def _softmax(node, x, opset):
    return [torch.softmax(x[0], dim=node.attrs.get("axis", -1))]


def _layer_norm(node, x, opset):
    t, scale = x[0], x[1]
    bias = x[2] if len(x) > 2 else None
    axis = _axis(node.attrs.get("axis", -1), t.dim())
    eps = node.attrs.get("epsilon", 1e-5)
    dims = tuple(range(axis, t.dim()))
    xf = t.float()
    mean = xf.mean(dim=dims, keepdim=True)
    inv_std = torch.rsqrt((xf - mean).pow(2).mean(dim=dims, keepdim=True) + eps)
    y = ((xf - mean) * inv_std).to(t.dtype) * scale
    if bias is not None:
        y = y + bias
    return [y, mean, inv_std][:len(node.outputs)]


def _simplified_layer_norm(node, x, opset):
    t, scale = x[0], x[1]
    axis = _axis(node.attrs.get("axis", -1), t.dim())
    eps = node.attrs.get("epsilon", 1e-5)
    dims = tuple(range(axis, t.dim()))
    xf = t.float()
    inv_std = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + eps)
    return [(xf * inv_std).to(t.dtype) * scale, inv_std][:len(node.outputs)]


def _reduce_axes(node, x, opset, attr_before: int):
    if opset < attr_before:
        return node.attrs.get("axes")
    return _ints(x[1]) if len(x) > 1 and x[1] is not None else None


def _reduce(f, attr_before: int):
    def op(node, x, opset):
        t = x[0]
        axes = _reduce_axes(node, x, opset, attr_before)
        if not axes:
            if node.attrs.get("noop_with_empty_axes", 0):
                return [t]
            axes = list(range(t.dim()))
        keep = bool(node.attrs.get("keepdims", 1))
        return [f(t, dim=tuple(_axis(a, t.dim()) for a in axes), keepdim=keep)]
    return op


def _cumsum(node, x, opset):
    t, axis = x[0], _axis(_ints(x[1])[0], x[0].dim())
    if node.attrs.get("reverse", 0):
        t = t.flip(axis)
    out = torch.cumsum(t, dim=axis)
    if node.attrs.get("exclusive", 0):
        out = out - t
    if node.attrs.get("reverse", 0):
        out = out.flip(axis)
    return [out]


# -- linear algebra --------------------------------------------------------------------------------

def _gemm(node, x, opset):
    a, b = x[0], x[1]
    if node.attrs.get("transA", 0):
        a = a.t()
    if node.attrs.get("transB", 0):
        b = b.t()
    y = node.attrs.get("alpha", 1.0) * (a @ b)
    if len(x) > 2 and x[2] is not None:
        y = y + node.attrs.get("beta", 1.0) * x[2]
    return [y]


# -- shapes and data movement ----------------------------------------------------------------------

def _reshape(node, x, opset):
    t, target = x[0], _ints(x[1])
    if not node.attrs.get("allowzero", 0):
        target = [t.shape[i] if d == 0 else d for i, d in enumerate(target)]
    return [t.reshape(target)]


def _flatten(node, x, opset):
    t = x[0]
    axis = _axis(node.attrs.get("axis", 1), t.dim())
    return [t.reshape(int(torch.tensor(t.shape[:axis]).prod()), -1)]


def _transpose(node, x, opset):
    perm = node.attrs.get("perm") or tuple(reversed(range(x[0].dim())))
    return [x[0].permute(*perm)]


def _concat(node, x, opset):
    parts = [t for t in x if t is not None]
    return [torch.cat(parts, dim=node.attrs["axis"])]


def _gather(node, x, opset):
    data, idx = x
    axis = _axis(node.attrs.get("axis", 0), data.dim())
    idx = idx.to(data.device, torch.int64)
    idx = torch.where(idx < 0, idx + data.shape[axis], idx)
    out = data.index_select(axis, idx.reshape(-1))
    return [out.reshape(data.shape[:axis] + idx.shape + data.shape[axis + 1:])]


def _index_tuples(data, idx, k: int) -> tuple:
    """The coordinate tensors of ``idx``'s last axis ([..., k]), negative ones wrapped."""
    idx = idx.to(data.device, torch.int64)
    sizes = torch.tensor(data.shape[:k], dtype=torch.int64, device=data.device)
    idx = torch.where(idx < 0, idx + sizes, idx)
    return tuple(idx[..., j] for j in range(k))


def _gather_nd(node, x, opset):
    data, idx = x
    b = node.attrs.get("batch_dims", 0)
    k = idx.shape[-1]
    n_batch = int(torch.tensor(data.shape[:b]).prod())
    flat = data.reshape((n_batch,) + data.shape[b:])                     # [B, d_b, ...]
    flat_idx = idx.reshape(n_batch, -1, k)                               # [B, N, k]
    rows = torch.arange(n_batch, device=data.device).unsqueeze(1).expand(flat_idx.shape[:2])
    out = flat[(rows,) + _index_tuples(flat[0], flat_idx, k)]            # [B, N, d_{b+k}, ...]
    return [out.reshape(idx.shape[:-1] + data.shape[b + k:])]


SCATTER_REDUCE = {"mul": torch.mul, "max": torch.maximum, "min": torch.minimum}


def _scatter_nd(node, x, opset):
    """Rows of ``data`` at ``indices`` replaced by (or reduced with) ``updates``, in index order."""
    data, idx, upd = x
    k = idx.shape[-1]
    reduction = node.attrs.get("reduction", b"none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    coords = _index_tuples(data, idx, k)
    out = data.clone()
    upd = upd.to(data.dtype)
    if reduction in ("none", "add"):
        return [out.index_put_(coords, upd, accumulate=reduction == "add")]
    rows = zip(*(c.reshape(-1).tolist() for c in coords))       # each a k-tuple into data
    for at, u in zip(rows, upd.reshape((-1,) + data.shape[k:])):
        out[at] = SCATTER_REDUCE[reduction](out[at], u)
    return [out]


def _slice(node, x, opset):
    t = x[0]
    starts, ends = _ints(x[1]), _ints(x[2])
    axes = _ints(x[3]) if len(x) > 3 and x[3] is not None else list(range(len(starts)))
    steps = _ints(x[4]) if len(x) > 4 and x[4] is not None else [1] * len(starts)
    for s, e, a, st in zip(starts, ends, axes, steps):
        a = _axis(a, t.dim())
        idx = range(*slice(s, e, st).indices(t.shape[a]))
        if st > 0:
            t = t.narrow(a, idx.start, len(idx)) if st == 1 else t.index_select(
                a, torch.tensor(list(idx), dtype=torch.int64, device=t.device))
        else:
            t = t.index_select(a, torch.tensor(list(idx), dtype=torch.int64, device=t.device))
    return [t]


def _split(node, x, opset):
    from hetplan.frontends.onnx.shapes import split_sizes
    t = x[0]
    axis = _axis(node.attrs.get("axis", 0), t.dim())
    given = _ints(x[1]) if len(x) > 1 and x[1] is not None else node.attrs.get("split")
    sizes = split_sizes(node, t.shape[axis], given, len(node.outputs))
    return list(torch.split(t, sizes, dim=axis))


def _unsqueeze(node, x, opset):
    t, axes = x[0], _ints(x[1])
    rank = t.dim() + len(axes)
    for a in sorted(_axis(a, rank) for a in axes):
        t = t.unsqueeze(a)
    return [t]


def _squeeze(node, x, opset):
    t = x[0]
    if len(x) > 1 and x[1] is not None:
        axes = [_axis(a, t.dim()) for a in _ints(x[1])]
    else:
        axes = [i for i, d in enumerate(t.shape) if d == 1]
    return [t.squeeze(tuple(axes)) if axes else t]


def _expand(node, x, opset):
    t = x[0]
    shape = torch.broadcast_shapes(t.shape, tuple(_ints(x[1])))
    return [t.expand(shape)]


def _tile(node, x, opset):
    return [x[0].repeat(*_ints(x[1]))]


def _shape(node, x, opset):
    shape = list(x[0].shape)
    start, end = node.attrs.get("start", 0), node.attrs.get("end", len(shape))
    return [torch.tensor(shape[start:end], dtype=torch.int64)]


def _size(node, x, opset):
    return [torch.tensor(x[0].numel(), dtype=torch.int64)]


def _cast(node, x, opset):
    return [x[0].to(TORCH_OF_ONNX[node.attrs["to"]])]


def _range(node, x, opset):
    start, limit, delta = (t.item() for t in x)
    return [torch.arange(start, limit, delta, dtype=x[0].dtype, device=x[0].device)]


def _trilu(node, x, opset):
    k = _ints(x[1])[0] if len(x) > 1 and x[1] is not None else 0
    return [torch.triu(x[0], k) if node.attrs.get("upper", 1) else torch.tril(x[0], k)]


def _constant(node, x, opset):
    return [constant_tensor(node)]


def _constant_of_shape(node, x, opset):
    fill = node.attrs.get("value")
    value = torch.from_numpy(fill.copy()).reshape(-1)[0] if fill is not None else torch.tensor(0.0)
    return [torch.full(_ints(x[0]), value.item(), dtype=value.dtype)]


OPS = {
    "MatMul": _binary(torch.matmul), "Gemm": _gemm,
    "Add": _binary(torch.add), "Sub": _binary(torch.sub), "Mul": _binary(torch.mul), "Div": _div,
    "Pow": _pow, "Sqrt": _unary(torch.sqrt), "Reciprocal": _unary(torch.reciprocal),
    "Neg": _unary(torch.neg), "Abs": _unary(torch.abs), "Exp": _unary(torch.exp), "Log": _unary(torch.log),
    "Max": _variadic(torch.maximum), "Min": _variadic(torch.minimum), "Mod": _mod,
    "Floor": _unary(torch.floor), "Ceil": _unary(torch.ceil), "Clip": _clip,
    "Sigmoid": _unary(torch.sigmoid), "Tanh": _unary(torch.tanh), "Erf": _unary(torch.erf), "Gelu": _gelu,
    "Relu": _unary(torch.relu), "Softmax": _softmax, "Cos": _unary(torch.cos), "Sin": _unary(torch.sin),
    "LayerNormalization": _layer_norm, "SimplifiedLayerNormalization": _simplified_layer_norm,
    "ReduceMean": _reduce(torch.mean, 18), "ReduceSum": _reduce(torch.sum, 13),
    "ReduceMax": _reduce(torch.amax, 18), "CumSum": _cumsum,
    "Equal": _binary(torch.eq), "Less": _binary(torch.lt), "LessOrEqual": _binary(torch.le),
    "Greater": _binary(torch.gt), "GreaterOrEqual": _binary(torch.ge),
    "And": _binary(torch.logical_and), "Or": _binary(torch.logical_or), "Not": _unary(torch.logical_not),
    "IsNaN": _unary(torch.isnan), "Where": _where,
    "Transpose": _transpose, "Reshape": _reshape, "Flatten": _flatten, "Concat": _concat,
    "Gather": _gather, "GatherND": _gather_nd, "ScatterND": _scatter_nd, "Slice": _slice,
    "Split": _split, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze,
    "Expand": _expand, "Tile": _tile, "Shape": _shape, "Size": _size, "Cast": _cast,
    "Identity": _unary(lambda t: t), "Range": _range, "Trilu": _trilu, "Constant": _constant,
    "ConstantOfShape": _constant_of_shape,
}
