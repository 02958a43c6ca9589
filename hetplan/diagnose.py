"""What to say when nothing fits: which tier lacks how many bytes, and fixes that would work.

Every suggested fix is computed: a weight dtype is named only when the model fits in it, a
batch or context only when it fits at that size, memory as the amount that would be enough.
Knows budgets and byte counts; it builds problems to test candidate fixes, nothing more.
"""

from __future__ import annotations

import dataclasses

from hetplan.dtypes import BITS_PER_ELEMENT
from hetplan.problem import Problem, build_problem
from hetplan.schema.fields import BYTES_MAX
from hetplan.units import format_bytes


def fits_at_all(problem: Problem) -> bool:
    """A necessary condition for feasibility: everything fits in GPU + CPU together
    (weights + KV <= ``room_bytes``)."""
    return sum(b.weight_bytes + b.kv_bytes for b in problem.blocks) <= room_bytes(problem)


def room_bytes(problem: Problem) -> float:
    """The most weight and KV bytes ``problem``'s device can hold: GPU and CPU budgets less both
    workspaces, or the CPU's budget less its workspace where the GPU cannot even hold its own
    (all-CPU)."""
    if problem.gpu_workspace_bytes <= problem.gpu_budget_bytes:
        return (problem.gpu_budget_bytes + problem.cpu_budget_bytes - problem.gpu_workspace_bytes
                - problem.cpu_workspace_bytes)
    return problem.cpu_budget_bytes - problem.cpu_workspace_bytes


def _variant(problem: Problem, spec=None, **workload) -> Problem:
    wl = dataclasses.replace(problem.workload, **workload)
    return build_problem(spec or problem.model, problem.hw, wl, routing=problem.routing)


def fixes(problem: Problem, strategy: str = "ilp") -> list:
    """Changes that would make ``problem`` fit, each checked with ``fits_at_all``."""
    spec, wl = problem.model, problem.workload
    out = []
    if strategy != "ilp":
        out.append("--strategy ilp (it places what fits, streaming or computing the rest on the CPU)")
    if not fits_at_all(problem):
        out += _long_context_fixes(problem)
        smaller = sorted((d for d in BITS_PER_ELEMENT if BITS_PER_ELEMENT[d] < BITS_PER_ELEMENT[spec.weight_dtype]),
                         key=lambda d: -BITS_PER_ELEMENT[d])
        for dtype in smaller:
            cand = _variant(problem, spec.with_dtypes(weight_dtype=dtype, kv_dtype=spec.kv_dtype))
            if fits_at_all(cand):
                w = sum(b.weight_bytes for b in cand.blocks)
                out.append(f"--weight-dtype {dtype} (weights {format_bytes(w)})")
                break
        batch = wl.batch // 2
        while batch >= 1:
            if fits_at_all(_variant(problem, batch=batch)):
                out.append(f"--batch {batch}")
                break
            batch //= 2
        if wl.prompt_len > 16 and fits_at_all(_variant(problem, prompt_len=16, gen_len=min(wl.gen_len, 16))):
            lo, hi = 16, wl.prompt_len  # the longest prompt that fits, by bisection on the token count
            while hi - lo > max(1, wl.prompt_len // 64):
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits_at_all(_variant(problem, prompt_len=mid)) else (lo, mid)
            if lo < wl.prompt_len and fits_at_all(_variant(problem, prompt_len=lo)):
                out.append(f"--prompt-len {lo}")
    need = sum(b.weight_bytes + b.kv_bytes for b in problem.blocks) + problem.cpu_workspace_bytes \
        + problem.gpu_workspace_bytes
    more = need - problem.gpu_budget_bytes - problem.cpu_budget_bytes
    if more > 0:
        out += _more_dram(problem, more)
    return out


def _more_dram(problem: Problem, more: float) -> list:
    """The DRAM fix for ``more`` missing bytes: ``--cpu-mem`` while the node's DRAM holds the larger
    budget (its reserve shrinks), else a machine with that much DRAM (``--cpu-mem`` may not exceed
    the node's memory, so suggesting it would not work); none beyond any machine."""
    cpu = problem.hw.cpu
    budget = problem.cpu_budget_bytes + more
    if cpu is not None and -(-int(budget) // 2**30) * 2**30 <= cpu.memory_bytes:  # as rounded up
        return [f"--cpu-mem {_round_up_gib(budget)}"]
    total = (cpu.memory_bytes if cpu is not None else 0) + more
    if total > BYTES_MAX:
        return []
    return [f"a machine with {_round_up_gib(total)} of DRAM (node.yaml cpu.memory: {_round_up_gib(total)})"]


KV_DTYPES = ("q8_0", "q4_0")
"""Narrower KV-cache dtypes the diagnosis may suggest, widest first."""


def _long_context_fixes(problem: Problem) -> list:
    """For a long context: a smaller ``--prefill-chunk`` (the workspace is one chunk's), then a
    narrower ``--kv-dtype``, alone or with the smaller chunk; each only if it makes the problem
    fit, never a chunk or dtype already in use."""
    spec, wl = problem.model, problem.workload
    out, chunk = [], None
    ws = problem.gpu_workspace_bytes + problem.cpu_workspace_bytes
    if wl.chunk_len > 512:
        small = _variant(problem, prefill_chunk=512)
        ws_small = small.gpu_workspace_bytes + small.cpu_workspace_bytes
        if fits_at_all(small):
            return [f"--prefill-chunk 512 (workspace {format_bytes(ws)} -> {format_bytes(ws_small)})"]
        chunk = 512
    for dtype in KV_DTYPES:
        if BITS_PER_ELEMENT[dtype] >= BITS_PER_ELEMENT.get(spec.kv_dtype, 0):
            continue
        narrow = spec.with_dtypes(weight_dtype=spec.weight_dtype, kv_dtype=dtype)
        if fits_at_all(_variant(problem, narrow)):
            out.append(f"--kv-dtype {dtype}")
            break
        if chunk and fits_at_all(_variant(problem, narrow, prefill_chunk=chunk)):
            out.append(f"--kv-dtype {dtype} --prefill-chunk {chunk}")
            break
    return out


def _round_up_gib(n: float) -> str:
    return f"{-(-int(n) // 2**30)}GiB"


def diagnose(problem: Problem, strategy: str = "ilp") -> str:
    """Say which tier lacks how many bytes, and what would fix it."""
    weights = sum(b.weight_bytes for b in problem.blocks)
    kv = sum(b.kv_bytes for b in problem.blocks)
    ws = problem.gpu_workspace_bytes + problem.cpu_workspace_bytes
    have = problem.gpu_budget_bytes + problem.cpu_budget_bytes
    need = weights + kv + ws
    spec, wl = problem.model, problem.workload
    lines = [f"no placement fits: weights {format_bytes(weights)} ({spec.weight_dtype}) + KV cache "
             f"{format_bytes(kv)} (batch {wl.batch} x {wl.context_len} tokens) + workspace {format_bytes(ws)}"
             f" = {format_bytes(need)}, but GPU {format_bytes(problem.gpu_budget_bytes)} + CPU "
             f"{format_bytes(problem.cpu_budget_bytes)} = {format_bytes(have)} are available"]
    if need > have:
        lines.append(f"missing {format_bytes(need - have)} in total")
    elif problem.gpu_workspace_bytes > problem.gpu_budget_bytes:
        lines.append(f"the GPU budget is smaller than one forward pass's activation workspace "
                     f"({format_bytes(problem.gpu_workspace_bytes)} for batch {wl.batch} x prompt "
                     f"{wl.prompt_len}), so only an all-CPU plan is possible and the CPU lacks "
                     f"{format_bytes(weights + kv + problem.cpu_workspace_bytes - problem.cpu_budget_bytes)}")
    else:
        lines.append("the CPU tier cannot hold what the GPU cannot")
    found = fixes(problem, strategy)
    lines.append("each of these would fit: " + ", ".join(found) if found else
                 "no smaller weight dtype, batch or prompt fits: use a machine with more memory")
    return "; ".join(lines)


def over_budget(plan, problem: Problem) -> str:
    """A plan that exceeds a tier's budget: by how much, and fixes that would work."""
    m = plan.memory
    parts = []
    for tier in ("gpu", "cpu"):
        used, budget = m[f"{tier}_bytes"], m[f"{tier}_budget_bytes"]
        if used > budget:
            parts.append(f"{tier.upper()} needs {format_bytes(used - budget)} more "
                         f"({format_bytes(used)} > budget {format_bytes(budget)})")
    strategy = str(plan.solver.get("strategy", "ilp")).partition(":")[0]
    found = fixes(problem, strategy)
    if strategy != "ilp" and len(found) > 1:
        found = [found[0] + " with one of " + ", ".join(found[1:])]
    tail = (": use " + ", or ".join(found)) if found else ": give the machine more memory"
    return "; ".join(parts) + tail
