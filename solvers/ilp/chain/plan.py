"""Reading a chain DP's plan (``chain``): its ``Decision``, its phase makespans under every row
of the per-block MILP (the chain, the prompt-KV lane and the bus totals, which the search left
out), and one configuration's result as the solver reports it.

Knows the MILP's rows (``constraints``) and the plan's decision format; knows nothing about how
the plan was searched.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetplan.graph import PHASES
from hetplan.plan import Decision
from hetplan.solvers.ilp.chain.dp import MAX_STATES, Chain
from hetplan.solvers.ilp.objective import MS, block_costs, duration_ms
from hetplan.solvers.ilp.options import has_core_stage


def options_of(chain, chosen) -> list:
    """The ``options.Option`` of every block, from the indices ``chosen``."""
    return [t.options[j] for t, j in zip(chain.blocks, chosen)]


def decision(chain, chosen) -> Decision:
    """The plan's decision (as ``per_block._Model.decision`` reads the MILP's variables)."""
    weights, exec_, kv, experts = {}, {p: {} for p in PHASES}, {}, {}
    for b, o in zip(chain.problem.blocks, options_of(chain, chosen)):
        weights[b.name] = "gpu" if o.r else ("stream" if any(o.s) else "cpu")
        for i, p in enumerate(PHASES):
            if o.r:
                exec_[p][b.name] = "stream" if o.v[i] else "gpu"
            else:
                exec_[p][b.name] = "stream" if o.s[i] else "cpu"
        if b.kind == "attn":
            kv[b.name] = "gpu" if o.k else "cpu"
        if o.r and o.n is not None:
            experts[b.name] = o.n
    return Decision(weights, exec_, kv, depth=chain.depth, experts=experts)


def phase_ms(chain, chosen) -> dict:
    """Phase makespans (ms) of the plan under every row of the MILP: the chain, the
    prompt-KV lane (prefill) and the bus totals."""
    out = {}
    for i, p in enumerate(PHASES):
        starts = _starts(chain, chosen, p)
        j_last = chosen[-1]
        t = starts[-1] + chain.blocks[-1].duration_ms[p][j_last]
        t = max(t, _kv_lane_end(chain, chosen, p, starts), *_bus_ms(chain, chosen, p).values())
        out[p] = t
    return out


def _starts(chain, chosen, p) -> list:
    """S_b of every block in phase p (ms), by the pair recursion of ``chain``."""
    first = chain.blocks[0]
    s = [first.load_ms[p][chosen[0]] if first.candidate[p] else 0.0]
    for i, (prev, cur) in enumerate(zip(chain.blocks, chain.blocks[1:])):
        s.append(s[-1] + _single(chain, prev, cur, p, chosen[i], chosen[i + 1]))
    return s


def _single(chain, prev, cur, p, a, b) -> float:
    """S_b - S_(b-1) in phase p for options a (block b-1) and b (block b)."""
    on_prev, on_cur = prev.mode[p][a] != 2, cur.mode[p][b] != 2
    copy = cur.up_ms[p] if on_cur and not on_prev else (cur.down_ms[p] if on_prev and not on_cur else 0.0)
    d_prev = prev.duration_ms[p][a]
    if not cur.candidate[p]:
        return d_prev + copy
    win = 0.0
    for x, cap in chain.caps.items():
        nbytes = cur.loaded_bytes[p][b] + (prev.moved_bytes[p][x][a] if chain.depth == 2 else 0.0)
        win = max(win, (1e3 / cap) * nbytes)
    lead = max(cur.load_ms[p][b], win)
    return max(d_prev + copy, lead) if chain.depth == 2 else d_prev + max(copy, lead)


def _kv_lane_end(chain, chosen, p, starts) -> float:
    """End of the last prompt-KV copy to DRAM (``constraints.add_kv_down_edges``), 0 if none."""
    if p != "prefill":
        return 0.0
    pr = chain.problem
    costs = block_costs(pr, p)
    core = has_core_stage(pr)
    end = 0.0
    for j, (b, o) in enumerate(zip(pr.blocks, options_of(chain, chosen))):
        if b.kind != "attn" or not core[b.name]:
            continue
        g = o.r + o.s[PHASES.index(p)]
        upto = 1 + next(i for i, c in enumerate(costs[b.name]) if c.stage.kind == "attn_core")
        ready = starts[j] + duration_ms(costs[b.name], g, g, upto)
        end = max(end, ready) + MS * pr.kv_down_s[b.name] * (g - o.k)
    return end


def _bus_ms(chain, chosen, p) -> dict:
    """bus -> least phase time its bytes allow (``constraints.add_bus_bounds``)."""
    pr = chain.problem
    i = PHASES.index(p)
    kv_down = 0.0
    if p == "prefill":
        wl, core = pr.workload, has_core_stage(pr)
        for b, o in zip(pr.blocks, options_of(chain, chosen)):
            if b.kind == "attn" and core[b.name]:
                kv_down += wl.batch * wl.prompt_len * b.kv_bytes_per_token * (o.r + o.s[i] - o.k)
    out = {}
    for x, cap in chain.caps.items():
        nbytes = sum(t.moved_bytes[p][x][j] + t.loaded_bytes[p][j] for t, j in zip(chain.blocks, chosen))
        out[x] = (1e3 / cap) * (nbytes + kv_down)
    return out


def all_cpu(chain) -> list:
    """The option index of every block on the CPU in both phases (nothing on the GPU)."""
    return [next(j for j, o in enumerate(t.options) if not o.r and not any(o.s)) for t in chain.blocks]


@dataclass(frozen=True)
class ConfigResult:
    decision: Decision | None
    status: str
    """``optimal`` (within the gap tolerance); ``state_limit`` (the DP outgrew its states: the
    best plan found and the Lagrangian bound); ``infeasible``; ``cut_off`` (nothing beats the
    cutoff by more than the gap tolerance)."""
    objective_s: float
    bound_s: float
    states: int


def solve_config(chain: Chain, weights, cutoff_s: float | None, rel_gap: float,
                 max_states: int = MAX_STATES) -> ConfigResult | None:
    """One configuration by the chain DP, or None when the bus totals or the prompt-KV lane (the
    rows it leaves out) bind on its plan by more than ``rel_gap``: only the MILP can then say
    by how much, and the caller solves it. ``weights``: ``objective.Weights``."""
    problem, depth, slot_bytes = chain.problem, chain.depth, chain.slot
    cutoff_ms = weights.cutoff_ms(cutoff_s) if cutoff_s is not None else None
    res = chain.search(cutoff_ms, max_states, rel_gap)
    if res.chosen is None and not chain.any_fits() and depth * slot_bytes <= problem.gpu_budget_bytes \
            and chain.lower <= 0:
        # no room for the GPU's workspace: only the plan that leaves the GPU idle fits
        chosen = all_cpu(chain)
        t_ms = phase_ms(chain, chosen)
        if cutoff_ms is None or weights.weighted_ms(t_ms) <= cutoff_ms:
            obj = weights.stated_s(t_ms)
            return ConfigResult(decision(chain, chosen), "optimal", obj, obj, 0)
        return ConfigResult(None, "cut_off", float("inf"), cutoff_s, 0)
    if res.chosen is None:
        if res.bound_ms == float("inf") and res.proven:
            return ConfigResult(None, "infeasible", float("inf"), float("inf"), res.states)
        bound = weights.stated_bound_s(res.bound_ms)
        return ConfigResult(None, "cut_off" if res.proven else "state_limit", float("inf"),
                            min(bound, cutoff_s) if cutoff_s is not None else bound, res.states)
    t_ms = phase_ms(chain, res.chosen)
    weighted = weights.weighted_ms(t_ms)
    if weighted > res.relaxed_ms + rel_gap * weighted:
        return None  # the rows left out bind
    obj = weights.stated_s(t_ms)
    bound = min(obj, weights.stated_bound_s(res.bound_ms))
    return ConfigResult(decision(chain, res.chosen), "optimal" if res.proven else "state_limit", obj, bound,
                        res.states)
