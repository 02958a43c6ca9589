"""Build a serving engine from a plan and weights: devices, weights placed, KV pool, tokenizer.

``load_part`` places the model and the pool of one plan on this machine: the whole model's, or
one pipeline stage's part (``hetplan.runtime.distributed.part``), whose pool holds its own
attention layers only. Knows nothing about HTTP; ``hetplan serve`` and the tests call
``load_engine``, and the pipeline's stage processes ``load_part``.
"""

from __future__ import annotations

from hetplan.runtime import kv_cache
from hetplan.runtime.devices import Devices, check_pinned_memory, host_available_bytes
from hetplan.runtime.residency import pinned_need_bytes
from hetplan.runtime.prompt import load_tokenizer
from hetplan.runtime.serve.engine import Engine
from hetplan.runtime.serve.model import PagedModel
from hetplan.runtime.serve.pool import KVPool
from hetplan.runtime.serve.settings import ServeSettings
from hetplan.runtime.session import choose_mode
from hetplan.runtime.weights import weight_source


def load_engine(plan, weights: str, settings: ServeSettings, emulate: bool | None = None, seed: int = 0) -> Engine:
    mode = choose_mode(plan, emulate)
    model, pool, tokenizer = load_part(plan, weights, settings, mode, seed)
    return Engine(model, pool, settings, tokenizer=tokenizer, mode=mode)


def load_part(plan, weights: str, settings: ServeSettings, mode: str, seed: int = 0, blocks: dict | None = None):
    """-> (PagedModel, KVPool, tokenizer or None) of ``plan`` (the whole model, or a stage's part)
    in ``mode``; the pool holds ``blocks`` per tier (default: the settings' ``gpu_blocks`` and
    ``cpu_blocks``) of the plan's attention layers."""
    spec = plan.model
    if mode == "cuda":  # streamed blocks' weights are page-locked where they lie
        check_pinned_memory(pinned_need_bytes(plan, caches=False), host_available_bytes())
    # the emulated GPU counts what is placed in it against the plan's budget
    devices = Devices(mode, plan.memory["gpu_budget_bytes"])
    source = weight_source(weights, seed, spec)
    model = PagedModel(plan, source, devices, settings.max_context)
    tokenizer = load_tokenizer(source)
    if hasattr(source, "close"):
        source.close()
    blocks = blocks or {"gpu": settings.gpu_blocks, "cpu": settings.cpu_blocks}
    pool = KVPool(devices, len(model.kv_index), spec.n_kv_heads, spec.head_dim, kv_cache.storage(spec.kv_dtype),
                  settings.block_tokens, blocks)
    return model, pool, tokenizer
