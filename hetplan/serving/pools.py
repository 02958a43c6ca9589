"""How large the serving engine's KV pool is, in which blocks, and where DRAM requests attend.

A request keeps its whole cache in one tier: the running tier (GPU; the DRAM of a node without
one) or the DRAM tier that swapped-out requests occupy. With ``t = n_layers * kv_bytes_per_token``
(every layer's K and V for one position), ``N = --max-batch`` and ``C = --max-context``:

- running pool tokens: ``min((budget - used + kv) // t, N * C)`` of the running tier, where
  ``used`` is what the plan puts there (weights, staging, workspace, its KV for the batch) and
  ``kv`` that KV: everything the plan leaves free goes to the pool, and never more than the
  ``N`` longest requests can fill;
- DRAM pool tokens (a node with a GPU): the same over the CPU budget (its ``1 / r`` share for
  each of ``r`` replicas on one node), room to swap every running request out; none without a GPU (the running tier already is DRAM: a preempted
  request's cache is recomputed);
- block size: the largest of 16, 32, 64, 128 positions whose worst waste, ``N * (block - 1)``
  positions in the last, partly filled block of each running request, is at most 1/32 of the
  running pool (16 when none is): big blocks make fewer, larger copies and gathers;
- CPU attention (a node with a GPU): one DRAM request's decode attention costs
  ``a = sum over attention layers of cpu_seconds(attention_decode_work(1, mean context))`` plus
  its q, k, v down and output up over the link; it runs beside the GPU's step when ``a <=
  tpot_s``, and then ``floor(tpot_s / a)`` such requests hide behind one step.
"""

from __future__ import annotations

import math

from hetplan import cost
from hetplan.errors import HetplanError
from hetplan.units import format_bytes

BLOCK_CHOICES = (16, 32, 64, 128)
WASTE_SHARE = 1 / 32


def pool_tokens(budget_bytes: float, used_bytes: float, kv_bytes: float, kv_bytes_per_token: float,
                cap_tokens: int) -> int:
    """``min((budget - used + kv) // t, cap)``: the tier's free bytes plus the plan's own KV, in tokens."""
    return max(0, min(int((budget_bytes - used_bytes + kv_bytes) // kv_bytes_per_token), cap_tokens))


def block_tokens_for(running_tokens: int, max_batch: int) -> int:
    """The largest block in ``BLOCK_CHOICES`` wasting at most ``WASTE_SHARE`` of the pool (16 if none)."""
    ok = [bt for bt in BLOCK_CHOICES if max_batch * (bt - 1) <= running_tokens * WASTE_SHARE]
    return max(ok) if ok else BLOCK_CHOICES[0]


def cpu_attention_seconds(spec, hw, context: float) -> float:
    """One DRAM request's decode attention per step: per attention layer, the CPU roofline of
    ``attention_decode_work(1, context)``, q, k and v copied down and the output copied up."""
    act = cost.activation_bytes_per_elem(spec)
    down = (spec.q_dim + spec.kv_elems_per_token()) * act
    up = spec.attn_out_dim * act
    per_layer = (cost.cpu_seconds(cost.attention_decode_work(1, context, spec), spec, hw)
                 + cost.d2h_seconds(down, hw) + cost.h2d_seconds(up, hw))
    return spec.n_layers * per_layer


def size_pools(plan, max_batch: int, max_context: int, dram_sharers: int = 1) -> dict:
    """The pools, block size and CPU-attention choice around ``plan`` (see the module doc), for
    one of ``dram_sharers`` replicas sharing the node's DRAM: each gets ``budget / dram_sharers``
    of it (the replicas' plans together fit: ``replicas_fit_dram``)."""
    spec, hw, m = plan.model, plan.hardware, plan.memory
    t = spec.n_layers * spec.kv_bytes_per_token()
    cap = max_batch * max_context
    bd = m["breakdown"]
    cpu_tokens = pool_tokens(m["cpu_budget_bytes"] / dram_sharers, m["cpu_bytes"], bd["cpu"]["kv"], t, cap)
    if hw.gpus:
        running = pool_tokens(m["gpu_budget_bytes"], m["gpu_bytes"], bd["gpu"]["kv"], t, cap)
        tier = "GPU"
    else:
        running, cpu_tokens, tier = cpu_tokens, 0, "DRAM"
    if running < max_context:
        raise HetplanError(f"--max-context {max_context}: one request's KV ({format_bytes(max_context * t)}) "
                           f"does not fit in the {tier} memory the plan leaves ({format_bytes(running * t)}); "
                           f"lower --max-context to at most {running}, or give the machine more memory")
    bt = block_tokens_for(running, max_batch)
    out = {"block_tokens": bt, "block_bytes": bt * t, "gpu_blocks": running // bt, "cpu_blocks": cpu_tokens // bt,
           "cpu_attention": False, "cpu_attention_s": None, "cpu_attention_requests": 0}
    if hw.gpus and out["cpu_blocks"]:
        a = cpu_attention_seconds(spec, hw, plan.workload.decode_context_len)
        hidden = math.floor(plan.predicted["tpot_s"] / a) if a > 0 else 0
        out.update(cpu_attention=hidden >= 1, cpu_attention_s=a, cpu_attention_requests=hidden)
    return out
