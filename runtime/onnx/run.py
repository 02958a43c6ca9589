"""Run ONNX nodes with torch: the interpreter behind the ONNX backend and its tests.

``run_nodes(nodes, env, device, opset)`` executes nodes in order, reading inputs from and writing
outputs to ``env`` (value name -> tensor). Inputs of one node that sit on different devices are
brought to ``device`` (shape arguments excepted: they are read on the host). Shape arithmetic
stays on the host when all its inputs are there. Knows nothing about blocks, plans or weights'
origin.
"""

from __future__ import annotations

import torch

from hetplan.runtime.onnx.ops import HOST_PARAMS, OPS


class NodeError(RuntimeError):
    """A torch error inside one ONNX node, with the node named."""


def _place(node, ins: list, device: torch.device) -> list:
    params = HOST_PARAMS.get(node.op, ())
    data = [t for i, t in enumerate(ins) if t is not None and i not in params]
    if all(t.device == device for t in data) or all(t.device.type == "cpu" for t in data):
        return ins
    return [t.to(device) if t is not None and i not in params and t.device != device else t
            for i, t in enumerate(ins)]


def run_nodes(nodes, env: dict, device: torch.device, opset: int) -> None:
    """Execute ``nodes`` (``hetplan.frontends.onnx.ir.Node``) in order on ``device``, updating ``env``."""
    for node in nodes:
        ins = _place(node, [env[i] if i else None for i in node.inputs], device)
        try:
            outs = OPS[node.op](node, ins, opset)
        except (RuntimeError, ValueError, IndexError) as e:
            shapes = [None if t is None else tuple(t.shape) for t in ins]
            raise NodeError(f"ONNX node {node.name!r} ({node.op}) on inputs {shapes}: {e}") from e
        for name, t in zip(node.outputs, outs):
            if name:
                env[name] = t
