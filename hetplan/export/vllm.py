"""A plan as vLLM arguments: ``--cpu-offload-gb`` (UVA offloading of the first layers), or the
prefetch offloader's ``--offload-group-size/--offload-num-in-group/--offload-prefetch-step``
when the plan streams a regular pattern of whole layers ahead of use; ``--max-model-len`` and
``--max-num-seqs`` from the workload.

What vLLM can say: how many bytes of the decoder layers, from the first, live in host memory
(read over PCIe by the GPU in both phases), or every K-th of N layers prefetched. It cannot
compute on the CPU, keep KV caches of running sequences in host memory (its KV offloading is a
prefix cache), place the embedding or the head off the GPU, or choose which layers UVA offloads.

The option names, their defaults and limits (``--offload-num-in-group`` at most the group size,
``--offload-prefetch-step`` at least 1) are those of vLLM's ``vllm/config/offload.py``
(vllm-project/vllm at commit 2debd782f06a5731359728ed77cd6a7299ef4e49), as
``hetplan.solvers.imported.vllm`` reads them back; a prefetch export needs a plan staged at
least two deep, so its step ``depth - 1`` is never 0.
"""

from __future__ import annotations

import math
import shlex

from hetplan.export.result import CannotExpress, Export
from hetplan.plan import Plan

GIB = 2 ** 30


def prefetch_pattern(offloaded_layers: set, n_layers: int) -> tuple | None:
    """(N, K) with layer ``i`` offloaded exactly when ``i mod N >= N - K``; None if no pair does."""
    for n in range(1, n_layers + 1):
        for k in range(1, n + 1):
            if {i for i in range(n_layers) if i % n >= n - k} == offloaded_layers:
                return n, k
    return None


def offload_gib(off: list) -> float:
    """The shortest ``--cpu-offload-gb`` that offloads the bytes of blocks ``off`` and no further
    block (UVA offloads while the total is below it): in ``(total - last block, total]``."""
    total = sum(p["weight_bytes"] for p in off)
    last = off[-1]["weight_bytes"] if off else 0.0
    for digits in range(2, 13):
        x = math.floor(total / GIB * 10 ** digits) / 10 ** digits
        if x * GIB > total - last:
            return x
    return total / GIB


def emit(plan: Plan) -> Export:
    if not plan.hardware.gpus:
        raise CannotExpress("vLLM's offloading needs a GPU and this plan's node has none: it can express no part "
                            "of this plan; nothing was written")
    spec, wl = plan.model, plan.workload
    n = spec.n_experts
    cold = [p for p in plan.placement if p["kind"] == "moe" and p["weights"] == "gpu"
            and p.get("experts_on_gpu") is not None and p["experts_on_gpu"] < n]
    off = [p for p in plan.placement if p["layer"] is not None and (p["weights"] != "gpu" or p in cold)]
    layers = {p["layer"] for p in off}
    whole = all(sum(1 for p in off if p["layer"] == l) == sum(1 for q in plan.placement if q["layer"] == l)
                for l in layers)
    pattern = prefetch_pattern(layers, spec.n_layers) if layers and whole and plan.staging["depth"] >= 2 else None
    notes = [f"routed experts in host memory ({len(cold)} layers): vLLM offloads whole layers' parameters, so "
             f"those MoE blocks are offloaded whole"] if cold else []
    if pattern:
        n, k = pattern
        words = ["--offload-group-size", str(n), "--offload-num-in-group", str(k),
                 "--offload-prefetch-step", str(plan.staging["depth"] - 1)]
    else:
        gib = offload_gib(off)
        words = ["--cpu-offload-gb", f"{gib:g}"] if off else []
        if off:
            notes.append(f"--cpu-offload-gb offloads the first {gib:g} GiB of decoder layers in order, whichever "
                         f"layers the plan chose")
    words += ["--max-model-len", str(wl.context_len), "--max-num-seqs", str(wl.batch)]
    text = shlex.join(words)
    return Export("vllm", text + "\n", f"from-vllm:{text}", tuple(notes), usage=f"vllm serve MODEL {text}")
