"""The ONNX operators and opsets hetplan plans and runs, and the check that refuses the rest.

One list for both ends: the planner costs exactly these operators (``hetplan.frontends.onnx.shapes``) and
the runtime implements exactly these (``hetplan.runtime.onnx.ops``), so a graph that compiles
also runs. Knows nothing about costs, shapes or torch.
"""

from __future__ import annotations

from hetplan.errors import HetplanError

OPSET_MIN = 13
"""Squeeze/Unsqueeze/ReduceSum take axes as inputs and Softmax is per-axis from opset 13 on."""
OPSET_MAX = 23

SUPPORTED_OPS = frozenset({
    # linear algebra
    "MatMul", "Gemm",
    # element-wise arithmetic
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Abs", "Exp", "Log",
    "Max", "Min", "Mod", "Floor", "Ceil", "Clip",
    # activations and normalisation
    "Sigmoid", "Tanh", "Erf", "Gelu", "Relu", "Softmax", "Cos", "Sin",
    "LayerNormalization", "SimplifiedLayerNormalization",
    # reductions and scans
    "ReduceMean", "ReduceSum", "ReduceMax", "CumSum",
    # comparisons and logic
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Not", "IsNaN",
    "Where",
    # shapes and data movement
    "Transpose", "Reshape", "Flatten", "Concat", "Gather", "GatherND", "ScatterND", "Slice", "Split",
    "Unsqueeze",
    "Squeeze", "Expand", "Tile", "Shape", "Size", "Cast", "Identity", "Range", "Trilu",
    "Constant", "ConstantOfShape",
})
"""Operators of the default domain that decoder exports use: ``torch.onnx.export`` of
transformers' llama and gpt2 by the TorchScript exporter (opset 14..17, as optimum exports them)
and by the dynamo exporter (torch 2.9+ default, opset 18..23: the attention mask is built with
GatherND), and the ScatterND that index assignment exports to."""

FUSED_OPSET_23 = frozenset({"Attention", "RotaryEmbedding", "RMSNormalization"})
"""Fused operators the dynamo exporter emits from opset 23 on (not implemented): an export at
opset 18..22 spells them out in the operators above."""

DEFAULT_DOMAINS = ("", "ai.onnx")


def default_opset(model) -> int:
    """The opset version the graph imports for the default ONNX domain."""
    for imp in model.opset_import:
        if imp.domain in DEFAULT_DOMAINS:
            return int(imp.version)
    raise HetplanError("the model imports no opset of the default ONNX domain; re-export it "
                       "with torch.onnx.export or optimum")


def check_supported(model, source: str) -> int:
    """Refuse a graph whose opset or operators hetplan does not implement; return the opset.

    The message names every unsupported operator with one node that uses it and the opset."""
    opset = default_opset(model)
    if not OPSET_MIN <= opset <= OPSET_MAX:
        raise HetplanError(f"{source}: opset {opset} is outside the supported range "
                           f"{OPSET_MIN}..{OPSET_MAX}; re-export with e.g. "
                           f"torch.onnx.export(..., opset_version=17)")
    versions = {imp.domain: int(imp.version) for imp in model.opset_import}
    bad = {}
    for node in model.graph.node:
        domain = node.domain if node.domain not in DEFAULT_DOMAINS else ""
        if domain == "" and node.op_type in SUPPORTED_OPS:
            continue
        key = (domain, node.op_type)
        bad.setdefault(key, node.name or "(unnamed)")
    if bad:
        parts = []
        for (domain, op), name in sorted(bad.items()):
            where = f"{domain}::" if domain else ""
            parts.append(f"{where}{op} (node {name!r}, opset {versions.get(domain or '', opset)})")
        hint = ""
        if any(domain == "" and op in FUSED_OPSET_23 for domain, op in bad):
            hint = (" The fused opset-23 operators are not implemented: re-export with "
                    "torch.onnx.export(..., dynamo=True, opset_version=20).")
        raise HetplanError(f"{source}: unsupported ONNX operator(s): {'; '.join(parts)}.{hint} "
                           f"hetplan implements: {', '.join(sorted(SUPPORTED_OPS))}")
    return opset
