"""An ONNX graph as plain Python data: nodes with decoded attributes, initializer metadata.

Built once from a ModelProto (``hetplan.frontends.onnx.load.read_model``) and shared by the shape
interpreter, the block grouping, the cost model and the runtime. Weights are not read: an
initializer is its name, dtype, shape and where its bytes are; only small embedded ones (shape
constants) carry their values. Knows nothing about blocks, costs or devices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetplan.frontends.onnx.load import numel

SMALL_ELEMS = 4096
"""Initializers and constants up to this many elements keep their values (shape arithmetic)."""


@dataclass(frozen=True)
class Node:
    index: int
    name: str
    op: str
    inputs: tuple
    """Value names; ``""`` marks an omitted optional input."""
    outputs: tuple
    attrs: dict
    """Decoded attributes: ints, floats, bytes, lists, numpy arrays for tensors."""


@dataclass(frozen=True)
class Initializer:
    name: str
    dtype: int
    """ONNX TensorProto element type."""
    dims: tuple
    value: np.ndarray | None
    """The data when small and embedded, else None (read by the runtime when it loads weights)."""

    @property
    def numel(self) -> int:
        return int(np.prod(self.dims, dtype=np.int64)) if self.dims else 1


@dataclass(frozen=True)
class GraphInput:
    name: str
    dtype: int
    dims: tuple
    """Per axis an int (fixed) or a str (symbolic name, ``""`` when unnamed)."""


@dataclass(frozen=True)
class OnnxGraph:
    nodes: tuple
    initializers: dict
    """name -> Initializer."""
    inputs: tuple
    """GraphInput, initializers excluded."""
    outputs: tuple
    """Output value names."""
    opset: int

    def producers(self) -> dict:
        """value name -> index of the node that produces it."""
        return {o: n.index for n in self.nodes for o in n.outputs if o}

    def consumers(self) -> dict:
        """value name -> indices of the nodes that read it, in graph order."""
        out = {}
        for n in self.nodes:
            for i in n.inputs:
                if i:
                    out.setdefault(i, []).append(n.index)
        return out


def tensor_value(t) -> np.ndarray:
    from onnx import numpy_helper
    return numpy_helper.to_array(t)


def _attr(a):
    from onnx import helper
    v = helper.get_attribute_value(a)
    if a.type == a.TENSOR:
        return tensor_value(v)
    if isinstance(v, list):
        return tuple(v)
    return v


def from_proto(model, opset: int) -> OnnxGraph:
    """The IR of ``model`` (whose external initializers need not be loaded)."""
    g = model.graph
    inits = {}
    for t in g.initializer:
        small = t.data_location != 1 and numel(t) <= SMALL_ELEMS
        inits[t.name] = Initializer(t.name, int(t.data_type), tuple(int(d) for d in t.dims),
                                    tensor_value(t) if small else None)
    inputs = []
    for v in g.input:
        if v.name in inits:
            continue
        tt = v.type.tensor_type
        dims = tuple(int(d.dim_value) if d.HasField("dim_value") else d.dim_param
                     for d in tt.shape.dim)
        inputs.append(GraphInput(v.name, int(tt.elem_type), dims))
    nodes = tuple(Node(i, n.name or f"{n.op_type}_{i}", n.op_type, tuple(n.input), tuple(n.output),
                       {a.name: _attr(a) for a in n.attribute})
                  for i, n in enumerate(g.node))
    return OnnxGraph(nodes, inits, tuple(inputs), tuple(o.name for o in g.output), opset)
