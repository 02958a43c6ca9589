"""Build a serving engine from a plan and weights: devices, weights placed, KV pool, tokenizer.

Knows nothing about HTTP; ``hetplan serve`` and the tests call ``load_engine``.
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
    spec = plan.model
    mode = choose_mode(plan, emulate)
    if mode == "cuda":  # streamed blocks' weights are page-locked where they lie
        check_pinned_memory(pinned_need_bytes(plan, caches=False), host_available_bytes())
    # the emulated GPU counts what is placed in it against the plan's budget
    devices = Devices(mode, plan.memory["gpu_budget_bytes"])
    source = weight_source(weights, seed, spec)
    model = PagedModel(plan, source, devices, settings.max_context)
    tokenizer = load_tokenizer(source)
    if hasattr(source, "close"):
        source.close()
    pool = KVPool(devices, spec.n_layers, spec.n_kv_heads, spec.head_dim, kv_cache.storage(spec.kv_dtype),
                  settings.block_tokens, {"gpu": settings.gpu_blocks, "cpu": settings.cpu_blocks})
    return Engine(model, pool, settings, tokenizer=tokenizer, mode=mode)
