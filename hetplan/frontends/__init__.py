"""Model sources: what a MODEL argument names, read into a ``ModelSpec``.

``load_model`` resolves a preset name, a Hugging Face ``config.json`` (or a directory holding
one) or an ``.onnx`` decoder export; ``hf_config`` knows each family's config keys and
``onnx`` reads ONNX graphs (blocks and stage costs from their nodes). Knows nothing about
machines, costs, solvers or torch: a frontend only says what the model is.
"""

from hetplan.frontends.resolve import load_model

__all__ = ["load_model"]
