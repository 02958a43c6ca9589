"""How large the serving engine is: block size, pool blocks per tier, batch and queue limits.

Every value can be set (``hetplan serve`` flags); what is left unset is derived from the plan:

- ``gpu_blocks``: the plan's KV bytes (every block's ``kv_bytes``, over its batch and context)
  divided by one block's bytes, ``block_tokens * n_layers * kv_bytes_per_token`` (a key row and a
  value row of ``n_kv_heads * head_dim`` values in the KV dtype, a quantised row with its scales:
  ``dtypes.row_bytes``): the running tier holds as many tokens as the plan budgeted for its caches.
  For a pipeline plan (plan.json's ``pipeline``), each stage holds a pool of its own attention
  layers with the same block count (one block: the same positions in every stage), so it is the
  least, over the stages, of that stage's KV bytes over one block of its layers;
- ``cpu_blocks``: as many again, in DRAM, as room to swap every running request out;
- ``max_batch``: min(64, gpu_blocks) (each running request holds at least one block);
- ``max_context``: the plan's context (prompt_len + gen_len);
- ``prefill_chunk``: the plan's prefill chunk, else 256 tokens; ``step_tokens`` = prefill_chunk +
  max_batch (every decode plus one chunk per step);
- ``cpu_attention``: off (whether it pays is for a serving plan to say).

A serving plan (``compile --serve``, plan.json's ``serving``) replaces those defaults by its own
decisions: ``block_tokens``, ``gpu_blocks`` and ``cpu_blocks`` (its pools, rescaled to the
positions they hold when ``--block-tokens`` differs), ``max_batch``, ``max_context`` and
``cpu_attention``. Flags still override. Knows nothing about tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from hetplan.errors import HetplanError
from hetplan.pipeline.record import stage_plan


@dataclass(frozen=True)
class ServeSettings:
    block_tokens: int = 16
    """Positions per KV block."""
    gpu_blocks: int = 0
    """Blocks in the running (``gpu``) tier."""
    cpu_blocks: int = 0
    """Blocks in the DRAM tier that swapped-out requests occupy."""
    max_batch: int = 1
    """Running requests at most."""
    max_waiting: int = 256
    """Queued requests at most; one more is refused (HTTP 429)."""
    max_context: int = 0
    """Prompt + max_tokens at most (HTTP 413 beyond)."""
    prefill_chunk: int = 256
    """Prompt tokens one request computes per step at most."""
    step_tokens: int = 0
    """Tokens one step computes at most (decodes and prefill chunks together)."""
    cpu_attention: bool = False
    """Requests swapped out to DRAM keep decoding there, their attention on the CPU."""

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool):
                continue
            if v < (0 if f.name == "cpu_blocks" else 1):
                flag = "--" + f.name.replace("_", "-")
                raise HetplanError(f"{flag} {v}: must be at least {0 if f.name == 'cpu_blocks' else 1}")


def block_bytes(spec, block_tokens: int) -> int:
    """Bytes of one block: block_tokens * n_layers * kv_bytes_per_token (k and v rows, with scales)."""
    return int(block_tokens * spec.n_layers * spec.kv_bytes_per_token())


def settings_for(plan, **given) -> ServeSettings:
    """The plan's defaults with every ``given`` value that is not None put over them."""
    spec, wl = plan.model, plan.workload
    given = {k: v for k, v in given.items() if v is not None}
    if plan.serving is not None:
        given = {**from_serving(plan.serving, given.get("block_tokens")), **given}
    bt = given.get("block_tokens", ServeSettings.block_tokens)
    gpu = given.get("gpu_blocks", max(1, min(_pool_blocks(part, bt) for part in _parts(plan))))
    batch = given.get("max_batch", min(64, gpu))
    chunk = given.get("prefill_chunk", wl.prefill_chunk or 256)
    base = ServeSettings(block_tokens=bt, gpu_blocks=gpu, cpu_blocks=given.get("cpu_blocks", gpu),
                         max_batch=batch, max_context=given.get("max_context", wl.context_len),
                         prefill_chunk=chunk, step_tokens=given.get("step_tokens", chunk + batch))
    if base.max_context > spec.max_positions:
        raise HetplanError(f"--max-context {base.max_context}: model {spec.name!r} has {spec.max_positions} "
                           f"positions; pass at most that")
    return replace(base, **{k: v for k, v in given.items() if k in ("max_waiting", "cpu_attention")})


def from_serving(serving: dict, block_tokens: int | None) -> dict:
    """The settings a serving plan decided; its pools in ``block_tokens`` blocks when given (the
    same positions, rounded down to whole blocks)."""
    bt = block_tokens or serving["block_tokens"]
    scale = serving["block_tokens"] / bt
    return {"block_tokens": bt, "gpu_blocks": max(1, int(serving["gpu_blocks"] * scale)),
            "cpu_blocks": int(serving["cpu_blocks"] * scale), "max_batch": serving["batch"],
            "max_context": serving["max_context"], "cpu_attention": serving["cpu_attention"]}


def _parts(plan) -> list:
    """The plans whose pools serve ``plan``: each stage's own plan for a pipeline, else itself."""
    stages = (plan.pipeline or {}).get("stages", [])
    return [stage_plan(plan, i) for i in range(len(stages))] if len(stages) > 1 else [plan]


def _pool_blocks(plan, block_tokens: int) -> int:
    """Blocks ``plan``'s KV bytes hold: its blocks' ``kv_bytes`` over one block of its layers."""
    kv_bytes = sum(p["kv_bytes"] for p in plan.placement if p.get("kv"))
    return int(kv_bytes // block_bytes(plan.model, block_tokens))
