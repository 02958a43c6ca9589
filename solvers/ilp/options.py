"""Every way one block can run in one configuration (staging depth, slot size), with what each
costs: the table the chain DP (``chain``) searches.

A block's *option* fixes every decision the per-block MILP takes for it (``per_block``, whose
notation this follows): residence r_b, streaming s_bp per phase, the KV cache k_b, and for a MoE
block its hot count n and whether its cold experts are streamed (v_bnp). The MILP's rows on one
block are then numbers: per phase its mode (G, S, C), duration D_bp, weight load t_load, bytes
over each bus, and the block's HBM bytes. Options the MILP's rows exclude (r + s > 1, a KV cache
on the GPU beside CPU attention, a block larger than the slot streamed) are never listed.

Knows the MILP's formulas (``objective``, ``experts``); knows nothing about how they are searched.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import numpy as np

from hetplan.graph import PHASES
from hetplan.solvers.ilp.experts import split_bus_bytes, stream_can_pay
from hetplan.solvers.ilp.objective import MS, block_costs, bus_bytes, duration_ms

MODE_INDEX = {"G": 0, "S": 1, "C": 2}


@dataclass(frozen=True)
class Option:
    """One way block b runs: the MILP's variables on it, as numbers."""
    r: int
    s: tuple
    """s_bp per phase (PHASES order)."""
    k: int | None
    """k_b (attention blocks), else None."""
    n: int | None = None
    """Hot experts of a resident MoE block, else None."""
    v: tuple = (0, 0)
    """v_bnp per phase: the cold experts streamed (resident MoE blocks)."""

    def mode(self, i: int) -> str:
        return "G" if self.r else ("S" if self.s[i] else "C")


@dataclass(frozen=True)
class BlockTable:
    """The options of one block and, per phase, their costs as arrays over the options."""
    name: str
    options: tuple
    mode: dict
    """phase -> int array: 0 G, 1 S, 2 C."""
    duration_ms: dict
    """phase -> D_bp (first stage's start to last stage's end)."""
    load_ms: dict
    """phase -> h2d time of the weights it streams (whole block or cold experts)."""
    loaded_bytes: dict
    """phase -> bytes of the whole-block weight load (the MILP's bus rows leave cold experts out)."""
    moved_bytes: dict
    """phase -> bus -> bytes its stages move (``objective.bus_bytes``)."""
    gpu_bytes: np.ndarray
    """HBM bytes of its resident weights and KV cache."""
    candidate: dict
    """phase -> whether the MILP has a load row for it (some option streams in that phase)."""
    up_ms: dict
    """phase -> h2d time of its input when it runs on the GPU after a block that did not."""
    down_ms: dict
    """phase -> d2h time of its input when it runs off the GPU after a block on it."""


def has_core_stage(problem) -> dict:
    """Attention block -> whether decode attention is a stage of its own (beside the cache)."""
    out = {b.name: False for b in problem.blocks if b.kind == "attn"}
    for st in problem.graph.stages["decode"]:
        if st.follows == "kv":
            out[st.block] = True
    return out


def _cold_counts(problem, name, slot_bytes, stream_cold, depth) -> dict:
    """phase -> hot counts n whose cold experts may be streamed (the MILP's v_bnp)."""
    x = problem.experts["decode"][name]
    fit = int((slot_bytes or 0.0) // x.expert_bytes) if stream_cold else 0
    out = {p: () for p in PHASES}
    if fit and slot_bytes:
        fit = min(fit, x.n_experts)
        for p in PHASES:
            if stream_can_pay(problem, p, name, fit, depth):
                out[p] = tuple(range(max(0, x.n_experts - fit), x.n_experts))
    return out


def _options(problem, b, slot_bytes, stream_cold, depth, has_core) -> list:
    """Every option of block b the MILP of this configuration allows, in a fixed order."""
    streams = b.streamable and (slot_bytes is None or b.weight_bytes <= slot_bytes)
    s_ways = [(0, 0), (0, 1), (1, 0), (1, 1)] if streams else [(0, 0)]
    attn = b.kind == "attn"
    out = []
    if b.name in problem.experts.get("decode", {}):
        colds = _cold_counts(problem, b.name, slot_bytes, stream_cold, depth)
        for n in range(problem.experts["decode"][b.name].n_experts + 1):
            for vp in ((0, 1) if n in colds["prefill"] else (0,)):
                for vd in ((0, 1) if n in colds["decode"] else (0,)):
                    out.append(Option(1, (0, 0), None, n, (vp, vd)))
    else:
        for k in ((1, 0) if attn and has_core.get(b.name) else (1,) if attn else (None,)):
            out.append(Option(1, (0, 0), k))
    for s in s_ways:
        if not attn:
            out.append(Option(0, s, None))
            continue
        on_both = all(s)
        if has_core.get(b.name):
            out += [Option(0, s, k) for k in ((1, 0) if on_both else (0,))]
        elif s[0] == s[1]:  # the cache lives where attention runs, in both phases
            out.append(Option(0, s, s[0]))
    return out


def block_table(problem, b, slot_bytes, stream_cold, depth, has_core, costs, split_memo=None) -> BlockTable:
    """The option table of block b; ``costs``: phase -> ``objective.block_costs``; ``split_memo``:
    a dict keeping each MoE block's split bytes per phase across its tables."""
    opts = _options(problem, b, slot_bytes, stream_cold, depth, has_core)
    moe = b.name in problem.experts.get("decode", {})
    r = np.array([o.r for o in opts])
    s_ = {p: np.array([o.s[i] for o in opts]) for i, p in enumerate(PHASES)}
    mode, dur, load, loaded, moved, cand, up, down = {}, {}, {}, {}, {}, {}, {}, {}
    for i, p in enumerate(PHASES):
        c, s = costs[p][b.name], s_[p]
        mode[p] = np.where(r == 1, 0, np.where(s == 1, 1, 2)).astype(np.int8)
        if moe:
            dur[p], load[p], moved[p] = _moe_costs(problem, p, b.name, c, opts, r, s, i,
                                                   {} if split_memo is None else split_memo)
        else:
            d, mv = [], {"dram": [], "hbm": []}
            for o in opts:
                g, k = o.r + o.s[i], o.k or 0
                d.append(duration_ms(c, g, k))
                part = bus_bytes(c, g, k)
                mv["dram"].append(part["dram"])
                mv["hbm"].append(part["hbm"])
            dur[p] = np.array(d)
            load[p] = MS * problem.load_s.get(b.name, 0.0) * s
            moved[p] = {x: np.array(v) for x, v in mv.items()}
        loaded[p] = b.weight_bytes * s
        cand[p] = any(o.s[i] or o.v[i] for o in opts)
        up[p], down[p] = MS * c[0].up_s, MS * c[0].down_s
    if moe:
        x = problem.experts["decode"][b.name]
        n = np.array([o.n if o.r else 0 for o in opts])
        gpu = np.where(r == 1, x.dense_bytes + x.expert_bytes * n, 0.0)
    else:
        gpu = b.weight_bytes * r + b.kv_bytes * np.array([o.k or 0 for o in opts])
    return BlockTable(b.name, tuple(opts), mode, dur, load, loaded, moved, gpu.astype(float), cand, up, down)


def _moe_costs(problem, p, name, c, opts, r, s, i, split_memo) -> tuple:
    """(D, t_load, bus bytes) over the options of MoE block ``name`` in phase p: resident, the
    split's expected time at its hot count (every expert on the GPU when its cold ones are
    streamed, their load then its h2d time); else the whole block on the GPU (streamed) or the
    CPU. Its bus bytes: the whole block's stage on its device, or the split's tasks at its hot
    count (``experts.split_bus_bytes``; all E on the GPU when its cold experts are streamed)."""
    x = problem.experts[p][name]
    e = x.n_experts
    split = MS * np.asarray(x.split_times, dtype=float)
    cold_load = MS * np.array([x.h2d.seconds(0.0, (e - k) * x.expert_bytes) for k in range(e + 1)])
    n = np.array([o.n if o.r else 0 for o in opts])
    v = np.array([o.v[i] for o in opts])
    whole = np.where(s == 1, MS * c[0].gpu_s, MS * c[0].cpu_s)
    dur = np.where(r == 1, split[np.where(v == 1, e, n)], whole)
    load = np.where(r == 1, np.where(v == 1, cold_load[n], 0.0), MS * problem.load_s[name] * s)
    nbytes = c[0].stage.work.bytes
    if (p, name) not in split_memo:
        split_memo[p, name] = [split_bus_bytes(x, k) for k in range(e + 1)]
    split_bytes = split_memo[p, name]
    whole_bytes = {"dram": nbytes * (1 - s), "hbm": nbytes * s * 1.0}
    return dur, load, {bus: np.where(r == 1, [split_bytes[k][bus] for k in np.where(v == 1, e, n)], whole_bytes[bus])
                       for bus in whole_bytes}


def tables(problem, slot_bytes, stream_cold: bool, depth: int, cache: dict | None = None) -> list:
    """The option table of every block, in chain order. ``cache``: a dict shared by the
    configurations of one problem (a block's table depends on the configuration only through
    whether it may stream and which cold-expert counts may be)."""
    cache = {} if cache is None else cache
    if "costs" not in cache:
        cache["costs"] = {p: block_costs(problem, p) for p in PHASES}
        cache["core"] = has_core_stage(problem)
    out = []
    for b in problem.blocks:
        streams = b.streamable and (slot_bytes is None or b.weight_bytes <= slot_bytes)
        colds = _cold_counts(problem, b.name, slot_bytes, stream_cold, depth) \
            if b.name in problem.experts.get("decode", {}) else None
        key = (b.name, streams, None if colds is None else tuple(colds.items()))
        if key not in cache:
            alike = (_signature(problem, b, cache), streams, key[2])   # blocks that cost alike share a table
            if alike not in cache:
                cache[alike] = block_table(problem, b, slot_bytes, stream_cold, depth, cache["core"],
                                           cache["costs"], cache.setdefault("split_bytes", {}))
            cache[key] = dataclasses.replace(cache[alike], name=b.name)
        out.append(cache[key])
    return out


def _signature(problem, b, cache: dict) -> tuple:
    """What ``block_table`` reads of block ``b`` besides its name: two blocks with equal
    signatures have equal tables (the layers of a model, routed alike)."""
    costs = cache["costs"]
    split = tuple(id(x) for x in (problem.experts.get(p, {}).get(b.name) for p in PHASES) if x is not None)
    return ("block", b.kind, b.weight_bytes, b.kv_bytes, b.streamable, problem.load_s.get(b.name),
            cache["core"].get(b.name), split,
            tuple((c.stage.kind, c.stage.follows, c.stage.work.bytes, c.gpu_s, c.cpu_s, c.up_s, c.down_s)
                  for p in PHASES for c in costs[p][b.name]))
