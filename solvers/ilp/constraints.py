"""Constraint families of the placement MILP, one function each, the math in its docstring.

Notation (per phase p; times in milliseconds inside the model, memory in GiB):
  r_b        binary: block b's weights resident in HBM                      (mode G)
  s_bp       binary: block b streamed to the GPU in phase p                  (mode S)
  c_bp       = 1 - r_b - s_bp: block b computed on the CPU in phase p        (mode C)
  k_b        binary: attention block b's KV cache in HBM
  y_bp[m,n]  continuous in [0, 1]: block b in mode m and block b-1 in mode n (pair variables;
             equal to the product of the two mode indicators at every integral placement)
  S_b, E_b   start of block b's first stage and end of its last stage; E_b = S_b + D_b, where D_b
             is affine in (r_b, s_bp, k_b): stage times on the chosen devices plus the copies
             inside the block (decode attention beside a DRAM cache: q/k/v down and the output up,
             each exactly when g_b - k_b = 1)
  T_p        makespan of phase p
A block's stages run back to back (no other task waits on them in between except the prompt-KV
copy, which is given its own start time), so the stage chain of ``hetplan.schedule`` is modelled
exactly per block. Tasks a placement does not create have zero length and provably delay nothing
(a load is issued when the block before it ends or starts, see ``add_load_edges``), so there is
no big-M.
"""

from __future__ import annotations

import pulp

MODES = ("G", "S", "C")
"""Resident on the GPU, streamed to the GPU, computed on the CPU."""


def add_exec_choice(prob, r, s, blocks, phases):
    """Each block executes in one way per phase:  r_b + s_bp <= 1  (else on the CPU)."""
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


def add_kv_copy_held(prob, r, s, k, blocks, has_core, source_bytes, held_back, unit):
    """The HBM copies of the prompt's K/V to DRAM caches hold (``hetplan.plan.pending``): a
    block whose prefill attention runs on the GPU (``r_b + s_b,prefill``) with its cache in DRAM
    (``1 - k_b``) copies it down after the attention, and the source rows wait in HBM until the
    copy ends; so the plan's GPU peak holds at least the largest such copy, and at least the HBM
    the problem holds back already for what its copies hold (``Problem.held_back``):
        H >= held_back,   H >= src_b (r_b + s_b,prefill - k_b)   (attention blocks with a core)
    -> H (in units), which ``add_memory`` counts against the budget plus what is held back."""
    held = pulp.LpVariable("kv_copy_held", lowBound=held_back / unit)
    for b in blocks:
        if has_core.get(b.name) and source_bytes.get(b.name, 0.0) > 0:
            on_gpu = r[b.name] + s.get((b.name, "prefill"), 0)
            prob += held >= (source_bytes[b.name] / unit) * (on_gpu - k[b.name]), f"kv_copy_held_{b.name}"
    return held


def add_memory(prob, resident, r, s, k, slot, blocks, phases, depth, gpu_budget, cpu_budget, gpu_ws, cpu_ws,
               unit, held=None, held_back: float = 0.0):
    """Memory per tier (in units of ``unit`` bytes). The staging slot holds the largest streamed
    block; with size classes W_1 > W_2 > ... of streamable blocks and binaries z_c (some block of
    size >= W_c is streamed in some phase):
        s_bp <= z_c(b)      z_c >= z_(c-1)      slot = sum_c (W_c - W_(c+1)) z_c
    The GPU needs its activation workspace only when it computes at all (binary v):
        v >= r_b,  v >= s_bp
        GPU:  sum_b R_b + sum_b KV_b k_b + depth*slot + ws_gpu v <= budget_gpu
        CPU:  sum_b (W_b - R_b) + sum_b KV_b (1 - k_b) + ws_cpu <= budget_cpu
    where R_b, the block's resident bytes, is W_b r_b (an MoE block: its dense part r_b plus its
    hot experts, ``experts``). ``held``: the HBM copies to the host hold (``add_kv_copy_held``),
    added to the GPU's bytes against its budget plus ``held_back`` (which ``held`` covers)."""
    gpu = pulp.lpSum(resident[b.name] for b in blocks)
    gpu += pulp.lpSum((b.kv_bytes / unit) * k[b.name] for b in blocks if b.name in k)
    used = pulp.LpVariable("gpu_used", cat="Binary")
    for b in blocks:
        prob += used >= r[b.name], f"gpu_used_{b.name}"
        for p in phases:
            if (b.name, p) in s:
                prob += used >= s[b.name, p], f"gpu_used_{b.name}_{p}"
    if held is not None:
        gpu += held
        gpu_budget += held_back
    prob += gpu + depth * slot + (gpu_ws / unit) * used <= gpu_budget / unit, "gpu_mem"
    cpu = pulp.lpSum(b.weight_bytes / unit - resident[b.name] for b in blocks)
    cpu += pulp.lpSum((b.kv_bytes / unit) * (1 - k[b.name]) for b in blocks if b.name in k)
    prob += cpu + cpu_ws / unit <= cpu_budget / unit, "cpu_mem"


def add_slot_size(prob, s, slot, blocks, phases, unit):
    """See ``add_memory``: the slot size as a staircase over the streamable blocks' size classes."""
    sizes = sorted({b.weight_bytes for b in blocks if b.streamable}, reverse=True)
    z = {w: pulp.LpVariable(f"z_slot_{i}", cat="Binary") for i, w in enumerate(sizes)}
    for b in blocks:
        for p in phases:
            if (b.name, p) in s:
                # a block of size W needs every class of size <= W switched on
                prob += s[b.name, p] <= z[b.weight_bytes], f"slot_class_{b.name}_{p}"
    for bigger, smaller in zip(sizes, sizes[1:]):
        prob += z[smaller] >= z[bigger], f"slot_stair_{len(z)}_{int(smaller)}"
    steps = list(zip(sizes, sizes[1:] + [0.0]))
    prob += slot == pulp.lpSum(((w - nxt) / unit) * z[w] for w, nxt in steps), "slot_size"
    return z


def add_pair_consistency(prob, y, mode, pairs, p):
    """Pair variables are the products of consecutive blocks' mode indicators:
        sum_n y_bp[m,n] = x_bp[m]     sum_m y_bp[m,n] = x_(b-1)p[n]     y >= 0
    (at integral x the only solution is y[m,n] = x_b[m] x_(b-1)[n])."""
    for prev, cur in pairs:
        for m in MODES:
            if (cur, m) in mode:
                prob += pulp.lpSum(y[cur, m, n] for n in MODES if (cur, m, n) in y) == mode[cur, m], \
                    f"pair_row_{p}_{cur}_{m}"
        for n in MODES:
            if (prev, n) in mode:
                prob += pulp.lpSum(y[cur, m, n] for m in MODES if (cur, m, n) in y) == mode[prev, n], \
                    f"pair_col_{p}_{cur}_{n}"


def add_chain(prob, S, E, pairs, xfer, p):
    """Activations flow block to block; a device change adds the copy of the block's input (on
    its own activation lane, never queued behind weight loads):
        S_b >= E_(b-1) + t_up(b) (y[G,C] + y[S,C]) + t_down(b) (y[C,G] + y[C,S])."""
    for prev, cur in pairs:
        prob += S[cur] >= E[prev] + xfer[cur], f"chain_{p}_{cur}"


def add_load_edges(prob, S, issue, load, p):
    """A streamed block's weights are copied when the block before it ends (depth 1: one slot)
    or starts (depth 2: the other slot's last user, block b-2, has finished by then), and
    arrive before its first stage:
        S_b >= W_b + t_load(b) s_bp,     W_b = E_(b-1) (depth 1) or S_(b-1) (depth 2).
    The h2d queue never delays a load: the previous load ended before its own block started,
    which is no later than W_b. The first block's load is issued at 0."""
    for b, t_load in load.items():
        prob += S[b] >= issue.get(b, 0) + t_load, f"load_before_{p}_{b}"


def add_window_pair_cuts(prob, S, issue, y, pair_gap, p):
    """Valid inequalities that convexify the overlap of a load with the block before it:
        S_b - W_b >= sum_(m,n) y_bp[m,n] * gap_b(m, n)
    where gap_b(m, n) = max(t_load(b) [m = S], least time from W_b to S_b along the chain when b
    is in mode m and b-1 in mode n). Both terms are lower bounds of S_b - W_b at every integral
    placement, so the cut is valid; it is what lets the LP see stalls."""
    for cur, gaps in pair_gap.items():
        prob += S[cur] - issue[cur] >= pulp.lpSum(g * y[cur, m, n] for (m, n), g in gaps.items() if g > 0), \
            f"window_cut_{p}_{cur}"


def add_kv_down_edges(prob, SK, EK, core_end, p):
    """The prompt's KV leaves the GPU after the attention that produced it, when the cache lives
    in DRAM:  SK_b >= E_core(b),  EK_b = SK_b + t_kv(b) (g_b - k_b)."""
    for b, end in core_end.items():
        prob += SK[b] >= end, f"kv_down_after_{p}_{b}"


def add_queue_order(prob, start, end, queue, name, p):
    """Tasks of one copy engine run in the fixed queue order:  start_(q[i+1]) >= end_(q[i])."""
    for prev, cur in zip(queue, queue[1:]):
        prob += start[cur] >= end[prev], f"{name}_order_{p}_{cur}"


def add_makespan(prob, T, ends, p):
    """The phase ends when its last block and every copy have ended:  T_p >= E_x."""
    for i, e in enumerate(ends):
        prob += T >= e, f"makespan_{p}_{i}"


def add_bus_bounds(prob, T, bus_bytes, caps, p):
    """One DRAM bus and one HBM: whatever overlaps, no bus moves more than its effective
    capacity C_x (``hetplan.buses``), so the phase lasts at least the bytes crossing it:
        T_p >= MS * sum_b bytes_bpx / C_x      for x in (dram, hbm),
    where bytes_bpx is affine in the placement (``objective.bus_bytes``). Alongside the chain,
    which times every task at its exclusive rate, T_p is a lower bound on the replay in which
    tasks that overlap divide a bus; it is that replay exactly when no bus is oversubscribed."""
    for x, nbytes in bus_bytes.items():
        if x in caps:
            prob += T >= (1e3 / caps[x]) * nbytes, f"bus_{x}_{p}"


def add_bus_windows(prob, S, issue, window_bytes, caps, p):
    """A streamed block's load shares the buses with what runs beside it. Between the load's
    issue W_b and the start of block b, the load (L_b s_bp bytes over DRAM and HBM) and, at
    depth 2 (W_b = S_(b-1)), every task of block b-1 (its bytes B_(b-1)px, ``objective.bus_bytes``)
    move their bytes, none faster than the bus's capacity:
        S_b - W_b >= MS * (L_b s_bp + [depth 2] B_(b-1)px) / C_x      for x in (dram, hbm).
    Valid for the fluid replay (its S_b and W_b are no earlier than the MILP's), and exact for
    the window of a bandwidth-bound block beside a load that keeps its link rate."""
    for b, nbytes in window_bytes.items():
        for x, expr in nbytes.items():
            if x in caps:
                prob += S[b] - issue.get(b, 0) >= (1e3 / caps[x]) * expr, f"bus_window_{x}_{p}_{b}"
