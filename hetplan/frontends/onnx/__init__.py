"""ONNX decoder exports as a model source: the graph read without its weights, its nodes grouped
into hetplan's blocks by the residual stream, shapes inferred for concrete sizes, and each
block's bytes and FLOPs read off its nodes.

``importer.open_onnx`` / ``importer.spec_from_onnx`` are the entry points; ``load`` reads and
refuses files, ``ir`` holds the graph as plain data, ``opset`` the supported operators,
``shapes`` the abstract interpretation, ``blocks`` the grouping and ``graph`` the block graph.
Knows nothing about devices or torch; the ``onnx`` package is imported only when a file is read,
so these names load lazily.
"""

from __future__ import annotations

import importlib

_LAZY = {"open_onnx": "importer", "spec_from_onnx": "importer", "OnnxModel": "importer",
         "onnx_block_graph": "graph", "SUPPORTED_OPS": "opset", "check_supported": "opset"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
