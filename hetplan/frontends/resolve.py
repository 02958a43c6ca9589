"""Resolve a MODEL argument (preset name, config.json, directory, .onnx) to a ModelSpec."""

from __future__ import annotations

from pathlib import Path

from hetplan.errors import HetplanError
from hetplan.frontends.gguf.header import is_gguf
from hetplan.frontends.hf_config import read_config, spec_from_config
from hetplan.model import ModelSpec
from hetplan.presets.models import MODEL_PRESETS, model_preset


def load_model(source: str, weight_dtype: str | None = None, kv_dtype: str | None = None) -> ModelSpec:
    """A preset name, a config.json path or a directory holding one, an .onnx graph or a .gguf
    file -> ModelSpec."""
    if source in MODEL_PRESETS:
        return model_preset(source, weight_dtype, kv_dtype)
    p = Path(source)
    if p.suffix == ".onnx":
        from hetplan.frontends.onnx.importer import spec_from_onnx  # imported only for ONNX models
        return spec_from_onnx(p, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    if p.suffix.lower() == ".gguf" or (p.is_file() and is_gguf(p)):
        from hetplan.frontends.gguf.families import spec_from_gguf  # imported only for GGUF files
        return spec_from_gguf(p, weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    if not p.exists():
        raise HetplanError(f"model {source!r}: not a preset and no such file; known presets: "
                           f"{', '.join(sorted(MODEL_PRESETS))}")
    cfg, text, file = read_config(p)
    name = cfg.get("_name_or_path") or (p.name if p.is_dir() else p.parent.name) or "model"
    return spec_from_config(cfg, name=name if isinstance(name, str) else None, source=str(file),
                            weight_dtype=weight_dtype, kv_dtype=kv_dtype, text=text)
