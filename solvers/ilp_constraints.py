"""Constraint families of the placement MILP, one function each, the math in its docstring.

Notation (per phase p; times in milliseconds inside the model):
  r_b        binary, block b's weights resident in HBM
  s_bp       binary, block b streamed to the GPU in phase p (weights in pinned DRAM)
  k_b        binary, attention block b's KV cache in HBM
  g_sp       affine, 1 when stage s runs on the GPU: r_b + s_bp (follows exec) or k_b (follows kv)
  S_x        continuous start time of task x; E_x = S_x + duration_x (an affine expression)
  T_p        makespan of phase p
Stages of a phase form a chain; the order of tasks on h2d (weight loads) and d2h (prompt KV) is
fixed (see ``hetplan.schedule``), so there are no ordering disjunctions, and no big-M: a task a
placement does not create has zero length and provably delays nothing.
"""

from __future__ import annotations

import pulp


def add_exec_choice(prob, r, s, c_vars, blocks, phases):
    """Each block executes in one way per phase:  r_b + s_bp <= 1  (else computed on the CPU);
    a block that is not streamable (the embedding) has s_bp = 0."""
    for b in blocks:
        for p in phases:
            if (b.name, p) in s:
                prob += r[b.name] + s[b.name, p] <= 1, f"one_exec_{b.name}_{p}"


def add_kv_beside_compute(prob, r, s, k, blocks, phases, has_core_stage):
    """A KV cache on the GPU needs its attention block on the GPU:  k_b <= r_b + s_bp  for every
    phase. Blocks whose attention is a single stage (no separate core) keep the cache where they
    compute:  k_b = r_b + s_bp."""
    for b in blocks:
        if b.name not in k:
            continue
        for p in phases:
            on_gpu = r[b.name] + s.get((b.name, p), 0)
            prob += k[b.name] <= on_gpu, f"kv_needs_gpu_{b.name}_{p}"
            if not has_core_stage[b.name]:
                prob += k[b.name] >= on_gpu, f"kv_with_block_{b.name}_{p}"


def add_memory(prob, r, s, k, sigma, blocks, phases, depth, gpu_budget, cpu_budget, gpu_ws, cpu_ws, unit):
    """Memory per tier (in units of ``unit`` bytes):
        sigma >= W_b s_bp                                   (staging slot size)
        GPU:  sum_b W_b r_b + sum_b KV_b k_b + depth*sigma + ws_gpu <= budget_gpu
        CPU:  sum_b W_b (1 - r_b) + sum_b KV_b (1 - k_b) + ws_cpu <= budget_cpu"""
    for b in blocks:
        for p in phases:
            if (b.name, p) in s:
                prob += sigma >= (b.weight_bytes / unit) * s[b.name, p], f"slot_size_{b.name}_{p}"
    gpu = pulp.lpSum((b.weight_bytes / unit) * r[b.name] for b in blocks)
    gpu += pulp.lpSum((b.kv_bytes / unit) * k[b.name] for b in blocks if b.name in k)
    prob += gpu + depth * sigma + gpu_ws / unit <= gpu_budget / unit, "gpu_mem"
    cpu = pulp.lpSum((b.weight_bytes / unit) * (1 - r[b.name]) for b in blocks)
    cpu += pulp.lpSum((b.kv_bytes / unit) * (1 - k[b.name]) for b in blocks if b.name in k)
    prob += cpu + cpu_ws / unit <= cpu_budget / unit, "cpu_mem"


def add_chain(prob, S, E, stage_ids, delays, p):
    """Activations flow stage to stage; a device change on the way adds the copy of the stage's
    input (on its own activation lane, never queued behind weight loads):
        S_s >= E_{s-1} + t_up(s) u_s + t_down(s) w_s,   u_s >= g_s - g_{s-1},  w_s >= g_{s-1} - g_s,
    with u, w in [0, 1] (integral at every integral placement: nothing rewards a larger value)."""
    for prev, cur in zip(stage_ids, stage_ids[1:]):
        prob += S[cur] >= E[prev] + delays.get(cur, 0), f"chain_{p}_{cur}"


def add_load_edges(prob, S, E, loads, p):
    """A streamed block's weights arrive before its first stage, and are copied no more than
    ``depth`` blocks ahead (the staging slot it reuses is free once block b - depth finished):
        S_first(b) >= E_load(b)        S_load(b) >= E_last(b - depth),
    with E_load(b) = S_load(b) + t_load(b) s_bp. No big-M is needed: loads sit on h2d in block
    order and windows are monotone in b, so the zero-length load of a block that is not streamed
    only ever waits for things its block (and every later load) waits for anyway."""
    for load_id, (first, window_last) in loads.items():
        prob += S[first] >= E[load_id], f"load_before_{p}_{load_id}"
        if window_last is not None:
            prob += S[load_id] >= E[window_last], f"slot_free_{p}_{load_id}"


def add_kv_down_edges(prob, S, E, kv_down, p):
    """The prompt's KV leaves the GPU after the attention that produced it, when the cache lives
    in DRAM:  S_kv(b) >= E_core(b),  E_kv(b) = S_kv(b) + t_kv(b) z_b,  z_b = g_core(b) - k_b >= 0.
    (Zero-length when the cache is on the GPU; in stage order on d2h, so never a false wait.)"""
    for kv_id, core in kv_down.items():
        prob += S[kv_id] >= E[core], f"kv_down_after_{p}_{kv_id}"


def add_queue_order(prob, S, E, queue, name, p):
    """Tasks of one copy engine run in the fixed queue order:  S_{q[i+1]} >= E_{q[i]}."""
    for prev, cur in zip(queue, queue[1:]):
        prob += S[cur] >= E[prev], f"{name}_order_{p}_{cur}"


def add_makespan(prob, T, E, last_ids, p):
    """The phase ends when its last stage and every copy have ended:  T_p >= E_x."""
    for x in last_ids:
        prob += T >= E[x], f"makespan_{p}_{x}"
