"""Tiny llama- and gpt2-style transformers models exported to ONNX in the test run itself.

``export(family, with_past, exporter="torchscript", **sizes)`` builds a randomly initialised
transformers model (norm scales and biases drawn too, so that none is zero and an exporter cannot
fold one away), exports it and returns the path, the model's config dict and the model's
parameters by name (read before the export, which may rewrite the module). Exporters:

- ``torchscript``: ``torch.onnx.export(..., dynamo=False)``, opset 17;
- ``dynamo``: ``torch.onnx.export(..., dynamo=True)`` with ``torch.export.Dim`` dynamic shapes
  (the default exporter of torch 2.9+, opset 18+; needs onnxscript);
- ``optimum``: the graph signature of ``optimum-cli export onnx --task text-generation[-with-past]``
  (inputs ``input_ids``, ``attention_mask``, ``position_ids`` and the past key/values; outputs
  ``logits`` and ``present.*``), made with the TorchScript exporter at optimum's opset 14.
  optimum's exporters cannot share an environment with the transformers (5.x) the rest of the
  suite tests against (every optimum-onnx release, 0.0.1 .. 0.1.0, requires
  ``transformers<4.58``), so this layout is reproduced here, with the model's parameters at hand
  for the import tests; files made by optimum-cli itself (0.1.0, in its own environment) are
  kept in ``tests/onnx/optimum/`` and run by ``test_optimum.py``.

With ``with_past`` the graph takes ``past_key_values.{l}.key/value`` ([batch, kv_heads, past,
head_dim]) and an attention mask, and returns ``present.*`` beside the logits, as
decoder-with-past exports do. Exports are cached per process in one temporary directory, removed
when the process exits.
"""

from __future__ import annotations

import functools
import tempfile
import warnings
from pathlib import Path

import torch

SMALL = {"llama": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
         "gpt2": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=96)}
EXPORTERS = ("torchscript", "dynamo", "optimum")
OPTIMUM_OPSET = 14
"""optimum's default opset for llama, and the first with scaled_dot_product_attention (which
transformers' gpt2 now calls too)."""


class _NoPast(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask=None, positions=None):
        mask = torch.ones_like(ids) if mask is None else mask
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits


class _WithPast(torch.nn.Module):
    def __init__(self, model, with_positions: bool):
        super().__init__()
        self.model = model
        self.with_positions = with_positions

    def forward(self, ids, mask, *rest):
        from transformers.cache_utils import DynamicCache
        positions, past = (rest[0], rest[1:]) if self.with_positions else (None, rest)
        cache = DynamicCache(config=self.model.config)
        for l, layer in enumerate(cache.layers):
            layer.lazy_initialization(past[2 * l], past[2 * l + 1])
            layer.keys, layer.values = past[2 * l], past[2 * l + 1]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True)
        res = [out.logits]
        for layer in out.past_key_values.layers:
            res += [layer.keys, layer.values]
        return tuple(res)


def _model(family: str, sizes: dict):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if family == "llama":
        cfg = LlamaConfig(**sizes, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg).eval()
    else:
        cfg = GPT2Config(**sizes, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm scales (init 1) and biases (init 0)
                p.normal_(1.0 if "weight" in name else 0.0, 0.1)
    return cfg, model


@functools.cache
def _workdir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="hetplan-onnx-")


def _export_call(module, args, path, inputs, outputs, axes, exporter, opset, n_fixed):
    """torch.onnx.export with ``axes`` ({input or output: {axis: dim name}}) as dynamic axes, or
    for the dynamo exporter as ``torch.export.Dim`` shapes of the inputs (the ``n_fixed`` first
    are positional parameters of ``forward``, the rest its ``*rest``)."""
    if exporter != "dynamo":
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=axes, dynamo=False, opset_version=opset)
        return
    dims = {}
    shapes = [{a: dims.setdefault(n, torch.export.Dim(n)) for a, n in axes[i].items()} for i in inputs]
    if len(shapes) > n_fixed:
        shapes = shapes[:n_fixed] + [tuple(shapes[n_fixed:])]
    torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs,
                      dynamic_shapes=tuple(shapes), dynamo=True)


@functools.lru_cache(maxsize=None)
def _export(family: str, with_past: bool, exporter: str, frozen_sizes: tuple) -> tuple:
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter {exporter!r}: one of {EXPORTERS}")
    if exporter == "dynamo":
        import pytest
        pytest.importorskip("onnxscript")
    sizes = dict(frozen_sizes)
    cfg, model = _model(family, sizes)
    params = {k: tuple(v.shape) for k, v in model.named_parameters()}
    tag = "_".join(f"{k}{v}" for k, v in frozen_sizes)
    out = Path(_workdir().name) / f"{family}_{exporter}{'_past' if with_past else ''}_{tag}.onnx"
    n_layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    positioned = exporter == "optimum"
    opset = OPTIMUM_OPSET if positioned else 17
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    inputs, axes = ["input_ids"], {"input_ids": {0: "batch", 1: "seq"}, "logits": {0: "batch", 1: "seq"}}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if not with_past:
            args = (ids,)
            if positioned:
                args = (ids, torch.ones_like(ids), torch.arange(5).expand(2, 5))
                inputs += ["attention_mask", "position_ids"]
                axes.update({k: {0: "batch", 1: "seq"} for k in inputs[1:]})
            _export_call(_NoPast(model), args, out, inputs, ["logits"], axes, exporter, opset, len(args))
        else:
            past = [torch.randn(2, kv_heads, 3, head_dim) for _ in range(2 * n_layers)]
            names = [f"past_key_values.{l}.{kv}" for l in range(n_layers) for kv in ("key", "value")]
            outs = ["logits"] + [n.replace("past_key_values", "present") for n in names]
            inputs.append("attention_mask")
            axes["attention_mask"] = {0: "batch", 1: "total"}
            args = (ids, torch.ones(2, 8, dtype=torch.int64))
            if positioned:
                inputs.append("position_ids")
                axes["position_ids"] = {0: "batch", 1: "seq"}
                args += (torch.arange(3, 8).expand(2, 5),)
            axes.update({n: {0: "batch", 2: "past"} for n in names})
            axes.update({n: {0: "batch", 2: "total"} for n in outs[1:]})
            _export_call(_WithPast(model, positioned), args + tuple(past), out, inputs + names, outs, axes,
                         exporter, opset, 2)
    return out, cfg.to_dict(), params


def export(family: str, with_past: bool, exporter: str = "torchscript", **sizes) -> tuple:
    """-> (path of the .onnx, HF config dict, {parameter name: shape})."""
    merged = {**SMALL[family], **sizes}
    return _export(family, with_past, exporter, tuple(sorted(merged.items())))
