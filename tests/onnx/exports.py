"""Tiny llama- and gpt2-style transformers models exported to ONNX in the test run itself.

``export(family, with_past, **sizes)`` builds a randomly initialised transformers model, exports
it with ``torch.onnx.export`` (the TorchScript exporter, opset 17) and returns the path, the
model's config dict and the model's parameters by name (read before the export, which may
rewrite the module). With ``with_past`` the graph takes ``past_key_values.{l}.key/value``
([batch, kv_heads, past, head_dim]) and an attention mask, and returns ``present.*`` beside the
logits, as decoder-with-past exports do. Exports are cached per process.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

SMALL = {"llama": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
         "gpt2": dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=96)}


class _NoPast(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits


class _WithPast(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask, *past):
        from transformers.cache_utils import DynamicCache
        cache = DynamicCache(config=self.model.config)
        for l, layer in enumerate(cache.layers):
            layer.lazy_initialization(past[2 * l], past[2 * l + 1])
            layer.keys, layer.values = past[2 * l], past[2 * l + 1]
        out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        res = [out.logits]
        for layer in out.past_key_values.layers:
            res += [layer.keys, layer.values]
        return tuple(res)


def _model(family: str, sizes: dict):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if family == "llama":
        cfg = LlamaConfig(**sizes, tie_word_embeddings=False)
        return cfg, LlamaForCausalLM(cfg).eval()
    cfg = GPT2Config(**sizes, bos_token_id=0, eos_token_id=0)
    return cfg, GPT2LMHeadModel(cfg).eval()


@functools.lru_cache(maxsize=None)
def _export(family: str, with_past: bool, frozen_sizes: tuple) -> tuple:
    sizes = dict(frozen_sizes)
    cfg, model = _model(family, sizes)
    params = {k: tuple(v.shape) for k, v in model.named_parameters()}
    folder = tempfile.mkdtemp(prefix=f"hetplan-onnx-{family}-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the suite leaves no temp folders behind
    out = Path(folder) / f"{family}{'_past' if with_past else ''}.onnx"
    n_layers = cfg.num_hidden_layers
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if not with_past:
            torch.onnx.export(_NoPast(model), (ids,), str(out), input_names=["input_ids"],
                              output_names=["logits"], dynamic_axes={"input_ids": {0: "batch", 1: "seq"}},
                              dynamo=False, opset_version=17)
        else:
            past = [torch.randn(2, kv_heads, 3, head_dim) for _ in range(2 * n_layers)]
            names = [f"past_key_values.{l}.{kv}" for l in range(n_layers) for kv in ("key", "value")]
            outs = ["logits"] + [n.replace("past_key_values", "present") for n in names]
            dyn = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "total"}}
            dyn.update({n: {0: "batch", 2: "past"} for n in names})
            dyn.update({n: {0: "batch", 2: "total"} for n in outs[1:]})
            torch.onnx.export(_WithPast(model), (ids, torch.ones(2, 8, dtype=torch.int64), *past), str(out),
                              input_names=["input_ids", "attention_mask"] + names, output_names=outs,
                              dynamic_axes=dyn, dynamo=False, opset_version=17)
    return out, cfg.to_dict(), params


def export(family: str, with_past: bool, **sizes) -> tuple:
    """-> (path of the .onnx, HF config dict, {parameter name: shape})."""
    merged = {**SMALL[family], **sizes}
    return _export(family, with_past, tuple(sorted(merged.items())))
