"""Model sources: what a MODEL argument names, read into a ``ModelSpec``.

``load_model`` resolves a preset name, a Hugging Face ``config.json`` (or a directory holding
one), an ``.onnx`` decoder export or a ``.gguf`` file; ``hf_config`` knows each family's config
keys, ``onnx`` reads ONNX graphs (blocks and stage costs from their nodes) and ``gguf`` reads
GGUF headers (each block priced by its tensors' own types). Knows nothing about
machines, costs, solvers or torch: a frontend only says what the model is.
"""

from __future__ import annotations

__all__ = ["load_model"]


def __getattr__(name: str):
    # Lazy, so that a frontend module (hf_config, which the presets import) can be imported
    # first without this package importing the presets back.
    if name == "load_model":
        from hetplan.frontends.resolve import load_model
        return load_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
