"""The weights of an ONNX model, by value name: initializers and the constants computed from them.

``OnnxWeights`` is a weight source for ``hetplan.runtime.residency`` (``check``, ``view``,
``fill``, ``tokenizer_dir``), like a safetensors checkpoint. An initializer stored as external
data is a zero-copy CPU tensor over the memory-mapped file; an embedded one is read from the
graph file. A value computed from constants alone (an exporter's ``Transpose`` or ``Identity`` of
a weight) is folded once on the host, from the values it depends on. Knows nothing about plans.
"""

from __future__ import annotations

import mmap

import torch

from hetplan.errors import HetplanError
from hetplan.frontends.onnx.importer import OnnxModel
from hetplan.frontends.onnx.load import external_entries, read_model
from hetplan.runtime.onnx.ops import TORCH_OF_ONNX
from hetplan.runtime.onnx.run import run_nodes


class OnnxWeights:
    def __init__(self, model: OnnxModel):
        self.model = model
        proto = read_model(model.path)
        self._tensors = {t.name: t for t in proto.graph.initializer}
        self._producer = {o: n for n in model.graph.nodes if n.index in model.blocks.constant_nodes
                          for o in n.outputs}
        self._maps = {}
        self._folded = {}
        self.directory = model.path.parent

    # -- the weight-source interface ----------------------------------------------------------------
    def check(self, expected, dtype: torch.dtype, where: str) -> None:
        name = expected.checkpoint
        t = self._tensors.get(name)
        got = TORCH_OF_ONNX.get(t.data_type) if t is not None else self.value(name).dtype
        if got != dtype:
            raise HetplanError(f"{self.model.path}: {expected.checkpoint!r} ({where}) is {got}, the plan "
                               f"computes in {dtype}; compile the plan with the graph's own weight dtype")

    def view(self, expected, dtype: torch.dtype) -> torch.Tensor:
        return self.value(expected.checkpoint)

    def fill(self, expected, out: torch.Tensor) -> None:
        out.copy_(self.value(expected.checkpoint))

    def release(self, expected) -> None:
        """Nothing to let go: the initializers live in the loaded graph."""
        return None

    def tokenizer_dir(self):
        d = self.directory
        return d if (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file() else None

    # -- values -----------------------------------------------------------------------------------------
    def value(self, name: str) -> torch.Tensor:
        """The host tensor of constant value ``name``."""
        if name in self._tensors:
            return self._initializer(self._tensors[name])
        if name not in self._folded:
            node = self._producer[name]
            env = {i: self.value(i) for i in node.inputs if i}
            run_nodes([node], env, torch.device("cpu"), self.model.graph.opset)
            for o in node.outputs:
                if o:
                    self._folded[o] = env[o]
        return self._folded[name]

    def _initializer(self, t) -> torch.Tensor:
        dtype = TORCH_OF_ONNX.get(t.data_type)
        if dtype is None:
            raise HetplanError(f"{self.model.path}: initializer {t.name!r} has ONNX element type "
                               f"{t.data_type}, which the runtime cannot read")
        shape = tuple(int(d) for d in t.dims)
        if t.data_location == 1:  # external data: a view over the mapped file
            ext = external_entries(t)
            path = self.model.path.parent / ext["location"]
            if path not in self._maps:
                with open(path, "rb") as fh:
                    self._maps[path] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            count = 1
            for d in shape:
                count *= d
            if count == 0:
                return torch.empty(shape, dtype=dtype)
            flat = torch.frombuffer(self._maps[path], dtype=dtype, count=count,
                                    offset=int(ext.get("offset", 0)))
            return flat.view(shape)
        if t.raw_data and len(t.raw_data):
            return torch.frombuffer(bytearray(t.raw_data), dtype=dtype).view(shape)
        from onnx import numpy_helper
        return torch.from_numpy(numpy_helper.to_array(t).copy()).to(dtype).view(shape)
