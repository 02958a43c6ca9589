"""The count MILP: the placement MILP of a model whose layers are all alike.

A decoder is ``embed``, L identical layers (``attn_i`` and ``mlp_i`` or ``moe_i``) and ``head``.
Under the schedule's rules its makespan is a sum over consecutive blocks (``hetplan.schedule``:
a streamed block's load is issued when the block before it ends, depth 1, or starts, depth 2,
so no queue ever delays it): block b adds its duration D_b and the gap before it,

    gap_b = max(copy_b, t_load(b) s_bp - D_(b-1))   (depth 2)
    gap_b = max(copy_b, t_load(b) s_bp)             (depth 1)

which depends on b and b-1 only. A placement is then a walk through the *options* of one
layer (an option fixes, for every block of the layer, residence, per-phase streaming, the KV
tier and, for a resident MoE block, how many routed experts are in HBM), and only how many
layers take each option and how many consecutive pairs meet at each pair of block options
matter. The MILP counts them instead of deciding layer by layer: identical layers are no longer
told apart, which is what makes the per-block MILP (``ilp``) slow to prove optimality (its LP
relaxation spreads memory evenly over the layers, and branching on one layer's binaries only
moves the fraction to another).

The flow, on nodes E (embedding options), A (options of a layer's first block), O (layer
options), M (options of a layer's last block), H (head options):

    E -a_ea-> A -n_o-> O -n_o-> M -y_ma-> A,     M -z_mh-> H
    a, z binary (one each), n, y integer, flow conserved at A and M, sum_o n_o = L
    T_p >= sum over arcs of flow * (duration of what the arc enters + gap it crosses)
    T_p >= MS / C_x * sum over arcs of flow * bytes over bus x    (x = DRAM, HBM)

A gap also waits for a load no faster than the buses allow (``_Prices.gap``,
``constraints.add_bus_windows``), so the chain is exact at exclusive bandwidths and a lower
bound once tasks share a bus (``hetplan.buses``).

Memory per tier as in ``constraints.add_memory``, with the staging slot fixed per
configuration; a dense model's MILP is solved in two KV modes (``kv_copies``): with the HBM the
largest copy of a prompt's KV to a DRAM cache holds reserved (a constant: every layer is alike),
or with no layer copying its KV down (``constraints.add_kv_copy_held`` is the per-block form).
An integral flow is a path from embed to head plus, possibly, cycles the path never visits;
those are cut off (a layer in a set S of nodes is followed by a node outside S:
L * sum(arcs leaving S) >= sum_(o in S) n_o) and the model solved again.

Left out: the prompt's KV copied down in prefill (``kv_down`` on d2h) runs beside the chain;
``ilp.solve`` replays the plan and hands the configuration to the per-block MILP when that copy
ends after the chain. Streamed cold experts (``--stream-cold-experts``) are per-block only.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass

import pulp

from hetplan.buses import capacities
from hetplan.graph import PHASES
from hetplan.plan import Decision
from hetplan.problem import Problem
from hetplan.solvers.ilp.constraints import add_bus_bounds
from hetplan.solvers.ilp.experts import split_bus_bytes
from hetplan.solvers.ilp.objective import (MS, Weights, block_costs, bus_bytes, copy_s, duration_ms, highs_solver,
                                           run_highs)

MAX_CUT_ROUNDS = 50
FLOOR_SLACK = 1e-9
"""A plan within this relative distance of a proven lower bound (``LayerModel.solve``'s
``floor_ms``) is taken as optimal (the MILP's value and the bound sum the same times in another
order)."""


@dataclass(frozen=True)
class BlockOption:
    r: int
    s: tuple
    """Streamed in (prefill, decode)."""
    k: int | None
    """KV cache in HBM (attention blocks), else None."""
    hot: int | None = None
    """Routed experts in HBM of a resident MoE block (the others run on the CPU), else None."""

    def g(self, p: str) -> int:
        return self.r + self.s[PHASES.index(p)]


@dataclass(frozen=True)
class Layers:
    """The model cut into embed, identical layers, head."""
    first: object
    layers: tuple
    """Tuple of layers, each a tuple of blocks in chain order."""
    last: object


def layered(problem: Problem) -> Layers | None:
    """The model as embed, identical layers, head, when it is one, else None. MoE layers count
    as identical when their expert splits cost the same (uniform routing, or a profile that
    routes every layer alike)."""
    if not problem.has_gpu:
        return None
    blocks = problem.blocks
    if len(blocks) < 3 or blocks[0].streamable or any(b.layer is None for b in blocks[1:-1]) \
            or blocks[-1].layer is not None:
        return None
    by_layer = defaultdict(list)
    for b in blocks[1:-1]:
        by_layer[b.layer].append(b)
    layers = tuple(tuple(v) for _, v in sorted(by_layer.items()))
    if [b for layer in layers for b in layer] != list(blocks[1:-1]):
        return None
    costs = {p: block_costs(problem, p) for p in PHASES}

    def signature(b):
        split = tuple((x.fraction, x.expert_bytes, x.dense_bytes, x.split_times)
                      for x in (problem.experts.get(p, {}).get(b.name) for p in PHASES) if x is not None)
        return (b.kind, b.weight_bytes, b.kv_bytes, b.streamable, problem.load_s.get(b.name),
                problem.kv_down_s.get(b.name), split,
                tuple((c.stage.kind, c.stage.follows, c.gpu_s, c.cpu_s, c.up_s, c.down_s)
                      for p in PHASES for c in costs[p][b.name]))

    shape = [signature(b) for b in layers[0]]
    if any([signature(b) for b in layer] != shape for layer in layers[1:]):
        return None
    return Layers(blocks[0], layers, blocks[-1])


def _has_core(problem: Problem, block) -> bool:
    return any(c.stage.follows == "kv" for c in block_costs(problem, "decode")[block.name])


def block_options(problem: Problem, block, slot_bytes: float) -> list:
    """Every way ``block`` can run when the staging slot holds ``slot_bytes``: resident, or
    host-resident and per phase streamed (if it fits the slot) or computed on the CPU; an
    attention block's cache in HBM only while its attention runs on the GPU in every phase (and
    exactly then when its attention is one stage)."""
    can_stream = block.streamable and 0 < block.weight_bytes <= slot_bytes
    core = _has_core(problem, block) if block.kind == "attn" else False
    split = problem.experts.get("decode", {}).get(block.name)
    out = []
    if split is not None:  # resident: any number of its routed experts (the hottest) in HBM
        out += [BlockOption(1, (0, 0), None, n) for n in range(split.n_experts + 1)]
    for r in (0, 1) if split is None else (0,):
        for s in itertools.product((0, 1), repeat=2) if can_stream and not r else [(0, 0)]:
            g = [r + x for x in s]
            if block.kind != "attn":
                out.append(BlockOption(r, s, None))
                continue
            for k in (0, 1):
                if all(k <= x for x in g) and (core or all(k == x for x in g)):
                    out.append(BlockOption(r, s, k))
    return out


def _copies_down(blocks, opts) -> bool:
    """Whether ``blocks`` in ``opts`` copy a prompt's KV down: an attention block prefilled on
    the GPU with its cache in DRAM."""
    return any(b.kind == "attn" and o.k == 0 and o.g("prefill") > 0 for b, o in zip(blocks, opts))


def kv_copy_held_bytes(problem: Problem) -> float:
    """The most HBM one copy of a prompt's KV to a DRAM cache holds (``hetplan.plan.pending``)."""
    from hetplan.evaluate import kv_down_source_bytes

    return max((kv_down_source_bytes(problem, b) for b in problem.blocks if b.kind == "attn"), default=0.0)


def copies_kv(problem: Problem) -> bool:
    """Whether the count MILP is solved in two KV modes (``LayerModel``'s ``kv_copies``): a
    dense model whose prompt KV a copy to DRAM would hold in HBM."""
    return not problem.experts and kv_copy_held_bytes(problem) > 0


class _Prices:
    """Durations, gaps and bytes of block options in one configuration."""

    def __init__(self, problem: Problem, depth: int):
        self.problem, self.depth = problem, depth
        self.costs = {p: block_costs(problem, p) for p in PHASES}
        self.caps = capacities(problem.hw)
        self._bus_memo = {}

    def duration(self, p, block, o: BlockOption) -> float:
        if o.hot is not None:
            return MS * self.problem.experts[p][block.name].split_times[o.hot]
        return duration_ms(self.costs[p][block.name], o.g(p), o.k or 0)

    def bus_bytes(self, p, blocks, opts, copies: bool = True) -> dict:
        """bus -> bytes ``blocks`` in options ``opts`` move over it in phase p
        (``objective.bus_bytes``; a resident MoE block's expert split by its tasks' bytes,
        ``experts.split_bus_bytes``);
        ``copies`` False leaves out the block's own weight load and prompt-KV copies, which run
        before and after its stages."""
        key = (p, tuple(b.name for b in blocks), tuple(opts), copies)
        if key not in self._bus_memo:
            self._bus_memo[key] = self._bus_bytes(p, blocks, opts, copies)
        return self._bus_memo[key]

    def _bus_bytes(self, p, blocks, opts, copies: bool) -> dict:
        wl = self.problem.workload
        total = {"dram": 0.0, "hbm": 0.0}
        for b, o in zip(blocks, opts):
            if o.hot is not None:
                part = split_bus_bytes(self.problem.experts[p][b.name], o.hot)
            else:
                load = b.weight_bytes * o.s[PHASES.index(p)] if copies else 0.0
                kv = wl.batch * wl.prompt_len * b.kv_bytes_per_token \
                    if copies and p == "prefill" and o.k is not None else 0.0
                part = bus_bytes(self.costs[p][b.name], o.g(p), o.k or 0, load, kv)
            for x in total:
                total[x] += part[x]
        return total

    def gpu_bytes(self, block, o: BlockOption) -> float:
        """HBM bytes of ``block``'s weights and KV cache in option ``o``."""
        if o.hot is not None:
            x = self.problem.experts["decode"][block.name]
            return x.dense_bytes + o.hot * x.expert_bytes
        return block.weight_bytes * o.r + (block.kv_bytes * o.k if o.k is not None else 0.0)

    def gap(self, p, prev, po: BlockOption, cur, co: BlockOption) -> float:
        """Least time between the end of block ``prev`` and the start of ``cur`` (ms): the copy
        of its input, or the wait for its load, which cannot outrun the buses it shares with
        what runs beside it (``constraints.add_bus_windows``: the load's bytes, and at depth 2
        block ``prev``'s, over each bus's capacity)."""
        first = self.costs[p][cur.name][0]
        copy = MS * copy_s(first, co.g(p) > 0, po.g(p) > 0)
        streamed = co.s[PHASES.index(p)]
        load = MS * self.problem.load_s.get(cur.name, 0.0) * streamed
        window = [load]
        if streamed:
            beside = self.bus_bytes(p, (prev,), (po,), copies=False) if self.depth == 2 else {"dram": 0.0, "hbm": 0.0}
            window += [MS * (cur.weight_bytes + beside[x]) / self.caps[x] for x in beside if x in self.caps]
        if self.depth == 2:
            return max(copy, max(window) - self.duration(p, prev, po))
        return max(copy, max(window))

    def chain(self, p, blocks, opts) -> float:
        """Duration of consecutive ``blocks`` in options ``opts``, gaps between them included."""
        total = sum(self.duration(p, b, o) for b, o in zip(blocks, opts))
        return total + sum(self.gap(p, blocks[i - 1], opts[i - 1], blocks[i], opts[i]) for i in range(1, len(blocks)))


def _linear(terms) -> pulp.LpAffineExpression:
    """``sum coef * variable`` over (variable, coef) pairs, a repeated variable's coefficients
    added, in order of first appearance (``pulp.lpSum`` of the products, without an expression
    built per term)."""
    coef: dict = {}
    for v, c in terms:
        coef[v] = coef.get(v, 0.0) + c
    return pulp.LpAffineExpression(coef)


class LayerModel:
    """The count MILP for one configuration (staging depth, slot bytes): the flow of the module
    docstring. A gap depends only on the options of the two blocks it lies between, so layer
    pairs are priced on their (M, A) arc, not per pair of whole-layer options."""

    def __init__(self, problem: Problem, shape: Layers, depth: int, slot_bytes: float, unit: float,
                 kv_copies: bool | None = None, count_range: tuple | None = None):
        """``kv_copies`` (``copies_kv``): True, the HBM the largest copy of a prompt's KV to a
        DRAM cache holds is reserved (``constraints.add_kv_copy_held``, here a constant: every
        layer is alike); False, no layer takes an option that copies its KV down; None, neither
        (an MoE model, whose chain DP leaves those bytes to the compiler's rounds).
        ``count_range``: (lo, hi), the layer count a variable (``count``) in that range, lo >= 2,
        instead of the shape's: the same rows, with ``hi`` wherever the count bounds a variable or
        scales a binary, so that its integer points are those of the count MILP of each count in
        the range (``counts.count_line``)."""
        self.problem, self.shape, self.depth, self.slot_bytes = problem, shape, depth, slot_bytes
        prices = _Prices(problem, depth)
        first, last, layer = shape.first, shape.last, shape.layers[0]
        self.L = L = len(shape.layers) if count_range is None else count_range[1]
        self.count = None if count_range is None else pulp.LpVariable("layers", *count_range, cat="Integer")
        self.first_opts = block_options(problem, first, slot_bytes)
        self.last_opts = block_options(problem, last, slot_bytes)
        self.layer_opts = [opts for opts in itertools.product(*(block_options(problem, b, slot_bytes) for b in layer))
                           if kv_copies is not False or not _copies_down(layer, opts)]
        self.enter = enter = sorted({o[0] for o in self.layer_opts}, key=self._key)
        self.leave = leave = sorted({o[-1] for o in self.layer_opts}, key=self._key)
        prob = self.prob = pulp.LpProblem(f"hetplan_layers_depth{depth}_slot{int(slot_bytes)}", pulp.LpMinimize)
        self.n = {o: pulp.LpVariable(f"n_{o}", 0, L, cat="Integer") for o in range(len(self.layer_opts))}
        # arcs: (from node, to node) -> (flow variable, {phase: cost in ms})
        arcs = self.arcs = {}
        for e, eo in enumerate(self.first_opts):
            for a, ao in enumerate(enter):
                arcs["E", e, "A", a] = (pulp.LpVariable(f"a_{e}_{a}", cat="Binary"), {
                    p: prices.duration(p, first, eo) + prices.gap(p, first, eo, layer[0], ao) for p in PHASES})
        for o, opts in enumerate(self.layer_opts):
            arcs["A", enter.index(opts[0]), "O", o] = (self.n[o], {p: prices.chain(p, layer, opts) for p in PHASES})
            arcs["O", o, "M", leave.index(opts[-1])] = (self.n[o], {p: 0.0 for p in PHASES})
        if L > 1:
            for m, mo in enumerate(leave):
                for a, ao in enumerate(enter):
                    arcs["M", m, "A", a] = (pulp.LpVariable(f"y_{m}_{a}", 0, L - 1, cat="Integer"), {
                        p: prices.gap(p, layer[-1], mo, layer[0], ao) for p in PHASES})
        for m, mo in enumerate(leave):
            for h, ho in enumerate(self.last_opts):
                arcs["M", m, "H", h] = (pulp.LpVariable(f"z_{m}_{h}", cat="Binary"), {
                    p: prices.gap(p, layer[-1], mo, last, ho) + prices.duration(p, last, ho) for p in PHASES})
        into, out = defaultdict(list), defaultdict(list)  # node -> flow variables of its arcs
        for (u1, u2, v1, v2), (v, _) in arcs.items():
            out[u1, u2].append(v)
            into[v1, v2].append(v)
        prob += pulp.lpSum(v for k, (v, _) in arcs.items() if k[0] == "E") == 1, "one_first_layer"
        prob += pulp.lpSum(v for k, (v, _) in arcs.items() if k[2] == "H") == 1, "one_last_layer"
        prob += pulp.lpSum(self.n.values()) == (L if self.count is None else self.count), "every_layer"
        for kind, count in (("A", len(enter)), ("M", len(leave))):
            for i in range(count):
                prob += pulp.lpSum(into[kind, i]) == pulp.lpSum(out[kind, i]), f"flow_{kind}{i}"
        self.T = {}
        for p in PHASES:
            self.T[p] = pulp.LpVariable(f"T_{p}", lowBound=0)
            prob += self.T[p] >= _linear((v, c[p]) for v, c in arcs.values() if c[p]), f"makespan_{p}"
        # memory per tier
        def tier_bytes(blocks, opts, on_gpu):
            gpu = sum(prices.gpu_bytes(b, o) for b, o in zip(blocks, opts))
            return (gpu if on_gpu else sum(b.weight_bytes + b.kv_bytes for b in blocks) - gpu) / unit

        first_e = {e: out["E", e] for e in range(len(self.first_opts))}   # flow variables per option
        last_h = {h: into["H", h] for h in range(len(self.last_opts))}
        self._add_bus_bounds(prices, first, layer, last, out, into)
        used = self.used = pulp.LpVariable("gpu_used", cat="Binary")
        self.scaled = [(used, "gpu_used_layers")]   # binaries whose coefficient in their row is L
        for on_gpu in (True, False):
            expr = _linear([(v, tier_bytes(layer, self.layer_opts[o], on_gpu)) for o, v in self.n.items()]
                           + [(v, tier_bytes((first,), (self.first_opts[e],), on_gpu))
                              for e, vs in first_e.items() for v in vs]
                           + [(v, tier_bytes((last,), (self.last_opts[h],), on_gpu))
                              for h, vs in last_h.items() for v in vs])
            if on_gpu:
                expr += depth * slot_bytes / unit + problem.gpu_workspace_bytes / unit * used
                if kv_copies:   # what the largest copy of the prompt's KV holds, or what is held back
                    held = problem.gpu_held_back_bytes
                    expr += max(held, kv_copy_held_bytes(problem)) / unit
                    prob += expr <= (problem.gpu_budget_bytes + held) / unit, "gpu_mem"
                else:
                    prob += expr <= problem.gpu_budget_bytes / unit, "gpu_mem"
            else:
                prob += expr + problem.cpu_workspace_bytes / unit <= problem.cpu_budget_bytes / unit, "cpu_mem"
        on_gpu = lambda opts: any(o.g(p) for o in opts for p in PHASES)  # noqa: E731
        prob += L * used >= pulp.lpSum(v for o, v in self.n.items() if on_gpu(self.layer_opts[o])), "gpu_used_layers"
        for e, vs in first_e.items():
            if on_gpu((self.first_opts[e],)):
                prob += used >= pulp.lpSum(vs), f"gpu_used_first_{e}"
        for h, vs in last_h.items():
            if on_gpu((self.last_opts[h],)):
                prob += used >= pulp.lpSum(vs), f"gpu_used_last_{h}"
        self.weights = Weights(problem)
        prob += self.weights.weighted_ms(self.T), "objective_ms"
        self.n_cuts = 0

    def _add_bus_bounds(self, prices, first, layer, last, out, into) -> None:
        """``constraints.add_bus_bounds`` over the flow: the bytes of each layer option times
        how many layers take it, plus the embedding's and the head's options taken:
            T_p >= MS / C_x * (sum_o n_o bytes_opx + sum_e a_e bytes_epx + sum_h z_h bytes_hpx).
        ``out``/``into``: node -> flow variables of the arcs leaving / entering it."""
        caps = capacities(self.problem.hw)
        for p in PHASES:
            coef = {"dram": {}, "hbm": {}}  # bus -> flow variable -> bytes

            def add(nbytes, variables):
                for x in coef:
                    if nbytes[x]:
                        for v in variables:
                            coef[x][v] = coef[x].get(v, 0.0) + nbytes[x]

            for o, v in self.n.items():
                add(prices.bus_bytes(p, layer, self.layer_opts[o]), [v])
            for e, eo in enumerate(self.first_opts):
                add(prices.bus_bytes(p, (first,), (eo,)), out["E", e])
            for h, ho in enumerate(self.last_opts):
                add(prices.bus_bytes(p, (last,), (ho,)), into["H", h])
            add_bus_bounds(self.prob, self.T[p], {x: pulp.LpAffineExpression(list(c.items()))
                                                  for x, c in coef.items()}, caps, p)

    def _enter_leave(self, o: int) -> tuple:
        """(A node, M node) of layer option ``o``."""
        return self.enter.index(self.layer_opts[o][0]), self.leave.index(self.layer_opts[o][-1])

    @staticmethod
    def _key(o: BlockOption) -> tuple:
        return (o.r, o.s, -1 if o.k is None else o.k, -1 if o.hot is None else o.hot)

    def _flows(self) -> dict:
        """arc -> its integral flow in the solution."""
        return {k: int(round(v.value() or 0)) for k, (v, _) in self.arcs.items()}

    def _stray_groups(self, flows) -> list:
        """Sets of nodes carrying flow that the walk from the embedding never reaches."""
        out = defaultdict(list)
        for (u1, u2, v1, v2), f in flows.items():
            if f:
                out[u1, u2].append((v1, v2))
        start = next(k[:2] for k, f in flows.items() if f and k[0] == "E")
        seen, todo = {start}, [start]
        while todo:
            for v in out[todo.pop()]:
                if v not in seen:
                    seen.add(v)
                    todo.append(v)
        stray = {k[:2] for k, f in flows.items() if f} - seen
        groups = []
        while stray:  # the rest, split into weakly connected groups
            group, todo = set(), [min(stray)]
            while todo:
                u = todo.pop()
                if u in group:
                    continue
                group.add(u)
                todo += [v for v in out[u] if v in stray]
                todo += [w for w in stray if u in out[w]]
            groups.append(group)
            stray -= group
        return groups

    def _add_cut(self, group) -> None:
        """A layer in ``group`` is followed by one outside it, or by the head."""
        leave = pulp.lpSum(v for k, (v, _) in self.arcs.items() if k[:2] in group and k[2:] not in group)
        inside = pulp.lpSum(self.n[u[1]] for u in group if u[0] == "O")
        self.prob += self.L * leave >= inside, f"walk_{self.n_cuts}"
        self.n_cuts += 1

    def _walk(self, flows) -> tuple:
        """(embed option, layer options in order, head option) along an Euler path of the flow,
        taking the smallest next node first at every step (deterministic)."""
        out = defaultdict(list)
        for (u1, u2, v1, v2), f in sorted(flows.items()):
            out[u1, u2] += [(v1, v2)] * f
        start = next(k[:2] for k, f in flows.items() if f and k[0] == "E")
        stack, path, pos = [start], [], defaultdict(int)
        while stack:  # Hierholzer's algorithm
            u = stack[-1]
            if pos[u] < len(out[u]):
                stack.append(out[u][pos[u]])
                pos[u] += 1
            else:
                path.append(stack.pop())
        path.reverse()
        return start[1], [u[1] for u in path if u[0] == "O"], path[-1][1]

    def solve_relaxation(self, opts) -> tuple:
        """Solve the LP relaxation (every variable continuous) -> (status, HiGHS info); the
        HiGHS model, with its duals, stays in ``prob.solverModel``."""
        cats = {v.name: v.cat for v in self.prob.variables()}
        for v in self.prob.variables():
            v.cat = "Continuous"
        try:
            return run_highs(self.prob, highs_solver(opts))
        finally:
            for v in self.prob.variables():
                v.cat = cats[v.name]

    def lp_bound_s(self, opts) -> float:
        """The LP relaxation's value, a lower bound on the stated objective (inf if infeasible)."""
        status, info = self.solve_relaxation(opts)
        if status != "optimal":
            return float("inf")
        return self.weights.stated_bound_s(info.objective_function_value)

    def solve(self, opts, cutoff_ms: float | None, floor_ms: float | None = None):
        """-> (status, info, walk or None, seconds). ``floor_ms``: a proven lower bound on the
        optimum (weighted ms; ``counts.count_line``'s), at which HiGHS stops: the first plan within
        ``FLOOR_SLACK`` of it is optimal (status ``objective_target``, ``result``)."""
        t0 = time.perf_counter()
        for _ in range(MAX_CUT_ROUNDS):
            if opts.dump_lp:
                self.prob.writeLP(opts.dump_lp)
            target = {} if floor_ms is None else {"objective_target": floor_ms * (1 + FLOOR_SLACK)}
            status, info = run_highs(self.prob, highs_solver(opts, cutoff_ms, mip_max_nodes=opts.max_nodes, **target))
            if info.primal_solution_status != 2:
                return status, info, None, time.perf_counter() - t0
            flows = self._flows()
            groups = self._stray_groups(flows)
            if not groups:
                return status, info, self._walk(flows), time.perf_counter() - t0
            for group in groups:
                self._add_cut(group)
        return "time_limit", info, None, time.perf_counter() - t0

    def decision(self, walk) -> Decision:
        e, path, h = walk
        chosen = [(self.shape.first, self.first_opts[e])]
        for layer, o in zip(self.shape.layers, path):
            chosen += list(zip(layer, self.layer_opts[o]))
        chosen.append((self.shape.last, self.last_opts[h]))
        weights, exec_, kv, experts = {}, {p: {} for p in PHASES}, {}, {}
        for b, o in chosen:
            if o.hot is not None:
                experts[b.name] = o.hot
            weights[b.name] = "gpu" if o.r else ("stream" if any(o.s) else "cpu")
            for i, p in enumerate(PHASES):
                exec_[p][b.name] = "gpu" if o.r else ("stream" if o.s[i] else "cpu")
            if o.k is not None:
                kv[b.name] = "gpu" if o.k else "cpu"
        return Decision(weights, exec_, kv, depth=self.depth, experts=experts)

    def size(self) -> tuple:
        return (sum(1 for v in self.prob.variables() if v.cat == "Integer"), len(self.prob.constraints))

    def result(self, status, info, walk, seconds, floor_ms: float | None = None):
        """(decision or None, status, stated objective s, stated bound s, seconds, size); a plan
        that reached the ``floor_ms`` target ``solve`` was given is optimal, the floor its bound."""
        obj, bound = self.weights.read(self.T, status, info)
        if walk is None:
            return None, status, float("inf"), bound, seconds, self.size()
        if status == "objective_target":
            status, bound = "optimal", min(obj, max(bound, self.weights.stated_bound_s(floor_ms)))
        return self.decision(walk), status, obj, bound, seconds, self.size()

