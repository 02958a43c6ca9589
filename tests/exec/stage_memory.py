"""Measure the activation bytes a prefill allocates, op by op, independently of the planner.

``prefill_peak_bytes(spec, batch, prompt, chunk)`` runs the dense backend's prefill stage chain
(embed, per layer attn_in / attn_core / attn_out / mlp, head) sequentially on the CPU with
random weights, holding each value from the stage that writes it to the last stage that reads
it (what the runtime's dataflow does), while a dispatch mode counts the storage of every tensor
an op creates until it is freed. The peak of those live bytes is what the forward pass allocated
beyond its weights and KV cache: the planner's workspace must cover it.
"""

from __future__ import annotations

import weakref
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hetplan.runtime.backend import Step, StageCall
from hetplan.runtime.kernels import linear as klinear
from hetplan.runtime.kernels import native
from hetplan.runtime.models.dense import DenseBackend
from hetplan.runtime.models.dense_layout import FUSED


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages op outputs own (views of existing storages are not counted)."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in self.live or key in seen or st.nbytes() == 0:
                continue
            self.live[key] = st.nbytes()
            self.now += st.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(st, self._free, key)
        return out

    def _free(self, key):
        self.now -= self.live.pop(key, 0)


def _weights(backend, kind, layer, dtype, gen):
    w = {t.local: (torch.randn(t.shape, generator=gen) * 0.05).to(dtype)
         for t in backend.block_tensors("", kind, layer)}
    for name, parts in FUSED.items():
        if all(p in w for p in parts):
            w[name] = torch.cat([w.pop(p) for p in parts])
    return w


def prefill_peak_bytes(spec, batch: int, prompt: int, chunk: int, upcast: bool = False) -> int:
    """Peak live activation bytes of one prefill of ``batch`` x ``prompt`` tokens in chunks of
    ``chunk``; ``upcast``: 16-bit weights multiplied as a CPU without 16-bit GEMMs multiplies them
    (``upcast_linear``), else by torch's ops as on a GPU."""
    backend = DenseBackend(spec)
    dev, dtype = torch.device("cpu"), backend.dtype
    backend.setup(dev, prompt)
    gen = torch.Generator().manual_seed(0)
    blocks = {"embed": _weights(backend, "embed", None, dtype, gen), "head": _weights(backend, "head", None, dtype, gen)}
    for l in range(spec.n_layers):
        blocks[f"attn_{l}"] = _weights(backend, "attn", l, dtype, gen)
        blocks[f"mlp_{l}"] = _weights(backend, "mlp", l, dtype, gen)
    ids = torch.randint(0, spec.vocab, (batch, prompt), generator=gen)
    step = Step("prefill", 0, prompt, batch, chunk=chunk)

    def call(kind, block, layer, inputs):
        return backend.run(StageCall(kind, block, layer, dev, blocks[block], inputs, step))

    # The planner prices this workspace for a GPU, where the stages run torch's ops: the CPU's
    # native norms, rope and kernels (fewer temporaries) are kept out of the measurement; a CPU
    # without 16-bit GEMMs (``upcast``) adds its fp32 tiles.
    with torch.inference_mode(), mock.patch.object(native, "module", lambda: None), \
            mock.patch.object(klinear, "cpu_gemms_16bit", lambda dtype: not upcast), LiveBytes() as live:
        x = call("embed", "embed", None, {"ids": ids})["x"]
        for l in range(spec.n_layers):
            qkv = call("attn_in", f"attn_{l}", l, {"x": x})
            o = call("attn_core", f"attn_{l}", l, qkv)["o"]
            del qkv
            x = call("attn_out", f"attn_{l}", l, {"x": x, "o": o})["x"]
            del o
            x = call("mlp", f"mlp_{l}", l, {"x": x})["x"]
        logits = call("head", "head", None, {"x": x})["logits"]
        del x, logits
    return live.peak
