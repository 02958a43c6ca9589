"""The interface between the plan executor and a model implementation (a *backend*).

The executor knows tasks, queues, devices, tiers and when a tensor may be freed; a backend
knows one model family's math and tensor names. Neither knows the other's internals. They meet
in these calls, all made with plain tensors:

- ``block_tensors(block, kind, layer)`` -> the weights one block owns, as ``TensorSpec`` (local
  name, checkpoint name, shape). The runtime reads those names from a checkpoint (or makes
  seeded random ones), refuses a shape or dtype that disagrees, places each block in its tier
  and hands the weights back to ``run`` as ``{local name: tensor}`` on the stage's device.
- ``reads(kind)`` / ``writes(kind)`` -> the activation *values* a stage kind consumes and
  produces, by name. The dense families use ``ids`` (int64 [B, S]), ``x`` (residual stream
  [B, S, D]), ``q`` [B, S, H, hd], ``k``/``v`` [B, S, KVH, hd], ``o`` [B, S, H*hd] and
  ``logits`` (fp32 [B, V], or [B, S, V] with ``Step.all_logits``). When consecutive stages run
  on different devices the executor copies exactly the values the next stage reads and finds on
  the other device (``act_up``/``act_down``), and it frees each value after its last reader.
- ``kv_shapes(batch, max_tokens)`` -> ``{name: shape}`` of one attention block's KV cache,
  every shape ``[B, T, ...]``. The runtime allocates it in the tier the plan chose, in the plan's
  KV dtype. ``kv_down`` (prefill on the GPU, cache in DRAM) copies the value of the same name,
  ``[B, S, ...]``, into ``cache[name][:, 0:S]``.
- ``setup(device, max_tokens=None)`` makes per-device constants (e.g. rotary tables for
  positions below ``max_tokens``; None: the model's ``max_positions``, at most
  ``DEFAULT_MAX_TOKENS``) once, before any ``run`` on that device.
- ``run(call)`` executes one stage and returns ``{name: tensor}`` for ``writes(call.kind)`` on
  ``call.device``. It keeps no reference to inputs or outputs, allocates only on
  ``call.device``, and is safe to call from two threads at once for different stages (the
  executor runs the ``gpu`` and ``cpu`` queues concurrently).

Optionally, ``fused()`` -> ``{name: (local, ...)}`` names groups of weights that
``block_tensors`` lists back to back with equal trailing dims; the weights handed to ``run`` then
also hold ``name``, one view over their concatenation (e.g. q, k and v as one matrix). ``run``
must work with or without it.

Attention contract: ``attn_core`` receives ``call.kv``, the block's cache, when the cache lives
on ``call.device``: it writes this step's values at positions
``[step.start, step.start + step.new_tokens)`` and attends over the cache up to there (causal).
When the cache lives on the other tier (prefill only; the plan then holds a ``kv_down`` task),
``call.kv`` is None and it attends over the prompt's own k/v.

Backends are found by ``backend_for(spec)``: a plan compiled from an ONNX graph runs that graph
(``hetplan.runtime.onnx.backend``); otherwise ``BACKENDS`` maps the family to ``module:Class``, imported on use
(the mixture-of-experts families, with ``moe`` stages and DeepSeek's latent attention, to
``models.moe.backend``). A family without a row is refused; adding one is adding a row.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Mapping, Protocol

import torch

from hetplan.errors import HetplanError
from hetplan.model import ModelSpec

BACKENDS = {
    "llama": "hetplan.runtime.models.dense:DenseBackend",
    "mistral": "hetplan.runtime.models.dense:DenseBackend",
    "qwen2": "hetplan.runtime.models.dense:DenseBackend",
    "qwen3": "hetplan.runtime.models.dense:DenseBackend",
    "opt": "hetplan.runtime.models.dense:DenseBackend",
    "gpt2": "hetplan.runtime.models.dense:DenseBackend",
    "mixtral": "hetplan.runtime.models.moe.backend:MoeBackend",
    "qwen3_moe": "hetplan.runtime.models.moe.backend:MoeBackend",
    "deepseek_v3": "hetplan.runtime.models.moe.backend:MoeBackend",
}
"""Model family -> the backend class that executes it."""

DEFAULT_MAX_TOKENS = 8192
"""Positions ``setup`` prepares for when not told how many a run needs."""


@dataclass(frozen=True)
class TensorSpec:
    """One weight tensor of a block."""
    local: str
    """Name the backend's ``run`` looks it up by (``q``, ``norm``, ``gate`` ...)."""
    checkpoint: str
    """Name in a Hugging Face checkpoint (without any prefix the checkpoint may add)."""
    shape: tuple


@dataclass(frozen=True)
class Step:
    """What one forward pass computes."""
    phase: str
    """``prefill`` or ``decode``."""
    start: int
    """Position of the first new token of every sequence."""
    new_tokens: int
    """New tokens per sequence (the prompt length, or 1)."""
    batch: int
    all_logits: bool = False
    """``head`` returns logits at every new position instead of the last one only."""
    chunk: int = 0
    """Prefill chunk: token-wise stages compute ``chunk`` positions at a time and attention
    attends chunk by chunk over the growing prefix (0: all new tokens at once)."""

    def chunks(self) -> tuple:
        """((start, length), ...) of the chunks of the new tokens, relative to ``start``."""
        c = self.chunk if 0 < self.chunk < self.new_tokens else self.new_tokens
        return tuple((s, min(c, self.new_tokens - s)) for s in range(0, self.new_tokens, c))


@dataclass(frozen=True)
class StageCall:
    """One stage to run: everything a backend may look at."""
    kind: str
    block: str
    layer: int | None
    device: torch.device
    weights: Mapping[str, torch.Tensor]
    """The block's weights on ``device`` (a staging slot's views for a streamed block)."""
    inputs: Mapping[str, torch.Tensor]
    """``reads(kind)`` -> tensors on ``device``."""
    step: Step
    kv: Mapping[str, torch.Tensor] | None = None
    """The block's KV cache when it lives on ``device`` (``attn_core`` only), else None."""


class Backend(Protocol):
    kinds: frozenset
    """Stage kinds this backend executes."""

    def block_tensors(self, block: str, kind: str, layer: int | None) -> list[TensorSpec]: ...

    def reads(self, kind: str) -> tuple[str, ...]: ...

    def writes(self, kind: str) -> tuple[str, ...]: ...

    def kv_shapes(self, batch: int, max_tokens: int) -> dict[str, tuple]: ...

    def setup(self, device: torch.device, max_tokens: int | None = None) -> None: ...

    def run(self, call: StageCall) -> dict[str, torch.Tensor]: ...


def backend_for(spec: ModelSpec) -> Backend:
    """The backend for ``spec``'s family, or a HetplanError naming the capability it lacks."""
    if spec.extra.get("source") == "onnx":  # a plan compiled from an ONNX graph runs that graph
        return getattr(importlib.import_module("hetplan.runtime.onnx.backend"), "OnnxBackend")(spec)
    target = BACKENDS.get(spec.arch)
    if target is None:
        raise HetplanError(f"model family {spec.arch!r}: no runtime backend; executable families: "
                           f"{', '.join(sorted(BACKENDS))}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(spec)
