"""The placement MILPs: exact for the task chain at exclusive bandwidths, a lower bound once tasks
share a bus (``hetplan.buses``), solved by HiGHS through PuLP.

``solve`` runs one MILP per configuration (staging depth, slot size): the count MILP of
``layers`` when the model's layers are all alike, else the per-block MILP below, which for a MoE
model the chain DP (``chain``) solves instead wherever it proves the optimum. For the
per-block MILP, steps: (1) variables, (2) the objective, (3) constraint families (``constraints``, one
function each with its math), (4) solve with a time limit, (5) read the decision and the true
status and gap. The model is a pure function of the Problem; ``dump_lp`` writes it.

It knows the task rules of ``hetplan.schedule`` (which tasks exist, queue order, edges) and
encodes them as constraints in its own code; it does not call the schedule builder.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pulp

from hetplan import progress
from hetplan.buses import capacities
from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.plan import Decision
from hetplan.problem import Problem
from hetplan.solvers.ilp import constraints as C
from hetplan.solvers.ilp.chain.dp import Chain
from hetplan.solvers.ilp.chain.plan import solve_config
from hetplan.solvers.ilp.constraints import MODES
from hetplan.solvers.ilp.experts import ExpertVars
from hetplan.solvers.ilp.layers import LayerModel, layered
from hetplan.solvers.ilp.objective import (MS, Weights, block_costs, bus_bytes, copy_s, duration_ms,
                                           highs_solver, run_highs)
from hetplan.solvers.ilp.objective import gap as gap_of


COUNT_NODES_PER_NODE = 100
STATES_PER_NODE = 100_000
"""States the chain DP (``chain``) may keep per branch-and-bound node of ``max_nodes``: its
deterministic limit, raised with ``--max-nodes`` as the MILPs' is. 3 M states at the default
30 nodes (about 16 bytes each kept for the path back): the fronts of Qwen3-235B-A22B on h200-128g
and of Qwen3-30B-A3B throughput on laptop-8g close within 1.2-2.3 M."""


def memory_unit(problem: Problem) -> float:
    """Bytes per unit of the model's memory rows: GiB, or KiB when a budget is under a GiB
    (HiGHS accepts rows violated by up to about 1e-6 units, which must stay small beside the
    budget)."""
    return float(1 << 30) if min(problem.gpu_budget_bytes, problem.cpu_budget_bytes) >= 1 << 30 else 1024.0


@dataclass(frozen=True)
class IlpOptions:
    depths: tuple = (2, 1)
    """Staging depths tried, in order; the best plan over them wins (each later depth is cut off
    at the best objective found so far)."""
    time_limit_s: float = 120.0
    """Wall-clock safety net per MILP solved. A plan stopped by it may differ between machines."""
    max_nodes: int = 30
    """Branch-and-bound nodes per MILP solved: the deterministic limit (same plan on every
    machine). A count MILP (``layers``) gets ``COUNT_NODES_PER_NODE`` times as many: its
    nodes are LPs of a few dozen rows."""
    mip_rel_gap: float = 1e-4
    threads: int = 1
    stream_cold: bool = False
    """Also consider streaming a resident MoE block's cold experts per phase (exact, but it
    makes MoE models several times slower to solve)."""
    count_layers: bool = True
    """Solve a model of identical layers with the count MILP (``layers``); False forces the
    per-block MILP (a cross-check: both are exact)."""
    chain_dp: bool = True
    """Solve a MoE model's per-block configurations with the chain DP (``chain``) where it
    proves the optimum; False forces the per-block MILP (a cross-check: both are exact)."""
    dump_lp: str | None = None


@dataclass(frozen=True)
class IlpResult:
    decision: Decision | None
    status: str
    """``optimal`` (within ``mip_rel_gap``), ``node_limit`` or ``time_limit`` (best found, not
    proven: see ``mip_gap``), ``infeasible``."""
    mip_gap: float
    objective_s: float
    bound_s: float
    """A proven lower bound on the objective over every placement and depth tried."""
    solve_seconds: float
    n_binaries: int
    n_constraints: int
    formulation: str = "milp"
    """What proved it: ``milp``, ``chain-dp`` (every configuration by the chain DP), or
    ``chain-dp+milp``."""


class _Model:
    """The MILP for one staging depth, with handles on the variables the decision is read from."""

    def __init__(self, problem: Problem, depth: int, slot_bytes: float | None = None, tag: str = "",
                 stream_cold: bool = False):
        """``slot_bytes``: a fixed staging slot size (only blocks no larger are streamed; the
        slots cost ``depth * slot_bytes`` of HBM), or None for a slot sized by the model."""
        self.problem, self.depth, self.slot_bytes = problem, depth, slot_bytes
        blocks = problem.blocks
        self.prob = pulp.LpProblem(f"hetplan_placement_depth{depth}{tag}", pulp.LpMinimize)
        # (1) variables -------------------------------------------------------------------
        self.r = {b.name: pulp.LpVariable(f"r_{b.name}", cat="Binary") for b in blocks}
        self.s = {(b.name, p): pulp.LpVariable(f"s_{b.name}_{p}", cat="Binary")
                  for b in blocks if b.streamable and (slot_bytes is None or b.weight_bytes <= slot_bytes)
                  for p in PHASES}
        self.k = {b.name: pulp.LpVariable(f"k_{b.name}", cat="Binary") for b in blocks if b.kind == "attn"}
        unit = memory_unit(problem)
        self.sigma = pulp.LpVariable("slot_units", lowBound=0) if slot_bytes is None else slot_bytes / unit
        self.T = {p: pulp.LpVariable(f"T_{p}", lowBound=0) for p in PHASES}
        self.has_core = {b.name: False for b in blocks if b.kind == "attn"}
        for st in problem.graph.stages["decode"]:
            if st.follows == "kv":
                self.has_core[st.block] = True
        self.xv = ExpertVars(self.prob, problem, self.r, slot_bytes if stream_cold else None, depth)
        resident = {b.name: (b.weight_bytes / unit) * self.r[b.name] for b in blocks}
        resident.update({b: self.xv.resident_units(b, unit) for b in self.xv.layers})
        # (3) constraint families on placement and memory ----------------------------------
        C.add_exec_choice(self.prob, self.r, self.s, blocks, PHASES)
        C.add_kv_beside_compute(self.prob, self.r, self.s, self.k, blocks, PHASES, self.has_core)
        if slot_bytes is None:
            C.add_slot_size(self.prob, self.s, self.sigma, blocks, PHASES, unit)
        held = None
        if not problem.experts:   # (the MoE chain DP leaves it to the compiler's rounds, as this MILP then does)
            from hetplan.evaluate import kv_down_source_bytes

            source = {b.name: kv_down_source_bytes(problem, b) for b in blocks if b.kind == "attn"}
            held = C.add_kv_copy_held(self.prob, self.r, self.s, self.k, blocks, self.has_core, source,
                                      problem.gpu_held_back_bytes, unit)
        C.add_memory(self.prob, resident, self.r, self.s, self.k, self.sigma, blocks, PHASES, depth,
                     problem.gpu_budget_bytes, problem.cpu_budget_bytes,
                     problem.gpu_workspace_bytes, problem.cpu_workspace_bytes, unit,
                     held, problem.gpu_held_back_bytes)
        for p in PHASES:
            self._timeline(p)
        # (2) objective ----------------------------------------------------------------------
        self.weights = Weights(problem, slowest_stage_s(problem))
        self.prob += self.weights.weighted_ms(self.T), "objective_ms"

    def _modes(self, p):
        """(block, mode) -> indicator expression of block b executing in mode G, S or C in phase p."""
        mode = {}
        for b in self.problem.blocks:
            r, s = self.r[b.name], self.s.get((b.name, p))
            mode[b.name, "G"] = r
            if s is not None:
                mode[b.name, "S"] = s
            mode[b.name, "C"] = 1 - r - (s if s is not None else 0)
        return mode

    def _min_duration(self, p, name, costs, m):
        """Least block duration in mode ``m`` over the KV choices that mode allows (a number)."""
        g = 1 if m in ("G", "S") else 0
        if m == "G" and name in self.xv.layers:
            return MS * self.xv.min_split_s(p, name)
        ks = (0, 1) if g and self.has_core.get(name) else ((g,) if name in self.k else (0,))
        return min(duration_ms(costs, g, k) for k in ks)

    def _timeline(self, p):
        pr, prob = self.problem, self.prob
        names = [b.name for b in pr.blocks]
        costs = block_costs(pr, p)
        mode = self._modes(p)
        S = {n: pulp.LpVariable(f"S_{p}_{n}", lowBound=0) for n in names}
        E = {}
        for n in names:
            g = self.r[n] + self.s.get((n, p), 0)
            k = self.k.get(n, g if n in self.k else 0)
            if n in self.xv.layers:  # resident: the expert split; else one whole-block stage
                c, s = costs[n][0], self.s.get((n, p), 0)
                base = MS * c.cpu_s * (1 - self.r[n] - s) + MS * c.gpu_s * s
                E[n] = self.xv.end(p, n, S[n], base)
            else:
                E[n] = S[n] + duration_ms(costs[n], g, k)
        # pair variables and activation copies between blocks
        pairs = list(zip(names, names[1:]))
        y, xfer = {}, {}
        for prev, cur in pairs:
            for m in MODES:
                for n_ in MODES:
                    if (cur, m) in mode and (prev, n_) in mode:
                        y[cur, m, n_] = pulp.LpVariable(f"y_{p}_{cur}_{m}{n_}", lowBound=0, upBound=1)
            first = costs[cur][0]
            xfer[cur] = pulp.lpSum(MS * self._copy_s(first, m, n_) * y[cur, m, n_]
                                   for m in MODES for n_ in MODES if (cur, m, n_) in y)
        C.add_pair_consistency(prob, y, mode, pairs, p)
        C.add_chain(prob, S, E, pairs, xfer, p)
        # weight loads, issued when the block before ends (depth 1) or starts (depth 2)
        streamed = [n for n in names if (n, p) in self.s or self.xv.streamed(n, p)]
        load = {n: (MS * pr.load_s[n] * self.s[n, p] if (n, p) in self.s else 0)
                + (self.xv.load_ms(p, n) if self.xv.streamed(n, p) else 0) for n in streamed}
        issue = {cur: (E if self.depth == 1 else S)[prev] for prev, cur in pairs}
        C.add_load_edges(prob, S, issue, load, p)
        C.add_window_pair_cuts(prob, S, issue, y, self._pair_gaps(p, names, costs, streamed), p)
        # the prompt's KV copied down (prefill, attention on the GPU, cache in DRAM)
        ends = [E[names[-1]]]
        if p == "prefill":
            cores = [n for n in names if n in self.k and self.has_core[n]]
            SK = {n: pulp.LpVariable(f"SK_{p}_{n}", lowBound=0) for n in cores}
            EK, core_end = {}, {}
            for n in cores:
                g = self.r[n] + self.s.get((n, p), 0)
                upto = 1 + next(i for i, c in enumerate(costs[n]) if c.stage.kind == "attn_core")
                core_end[n] = S[n] + duration_ms(costs[n], g, g, upto)
                EK[n] = SK[n] + MS * pr.kv_down_s[n] * (g - self.k[n])
            C.add_kv_down_edges(prob, SK, EK, core_end, p)
            C.add_queue_order(prob, SK, EK, cores, "d2h", p)
            ends += [EK[cores[-1]]] if cores else []
        C.add_makespan(prob, self.T[p], ends, p)
        caps, moved, kv_down = capacities(pr.hw), self._bus_bytes(p, costs), self._kv_down_bytes(p)
        loaded = {n: pr.graph.block(n).weight_bytes * self.s[n, p] if (n, p) in self.s else 0 for n in names}
        total = {x: pulp.lpSum(moved[n][x] + loaded[n] for n in names) + kv_down for x in ("dram", "hbm")}
        C.add_bus_bounds(prob, self.T[p], total, caps, p)
        window = {cur: {x: loaded[cur] + (moved[prev][x] if self.depth == 2 else 0) for x in ("dram", "hbm")}
                  for prev, cur in pairs if cur in load}
        C.add_bus_windows(prob, S, issue, window, caps, p)

    def _bus_bytes(self, p, costs) -> dict:
        """block -> bus -> bytes its stages move over the bus in phase p (its weight load and
        the prompt's KV copies aside), affine in the placement (``objective.bus_bytes``; a
        resident MoE block's expert split by its tasks' bytes, ``ExpertVars.bus_bytes``)."""
        pr = self.problem
        out = {}
        for b in pr.blocks:
            n, s = b.name, self.s.get((b.name, p), 0)
            if n in self.xv.layers:
                nbytes = costs[n][0].stage.work.bytes
                split = self.xv.bus_bytes(p, n)
                part = {"dram": nbytes * (1 - self.r[n] - s) + split["dram"], "hbm": nbytes * s + split["hbm"]}
            else:
                part = bus_bytes(costs[n], self.r[n] + s, self.k.get(n, 0))
            out[n] = part
        return out

    def _kv_down_bytes(self, p):
        """Bytes of the prompt's KV copied from HBM to DRAM in phase p (over both buses):
        sum_b batch * P * kv_bytes_per_token * (g_b - k_b), for attention on the GPU beside a
        DRAM cache."""
        if p != "prefill":
            return 0
        wl = self.problem.workload
        return pulp.lpSum(wl.batch * wl.prompt_len * b.kv_bytes_per_token
                          * (self.r[b.name] + self.s.get((b.name, p), 0) - self.k[b.name])
                          for b in self.problem.blocks if b.name in self.k and self.has_core[b.name])

    @staticmethod
    def _copy_s(first_stage_cost, m, n_):
        """Copy time of a block's input when it runs in mode m after a block in mode n_."""
        return copy_s(first_stage_cost, m in ("G", "S"), n_ in ("G", "S"))

    def _pair_gaps(self, p, names, costs, streamed):
        """block -> {(m, n): least time from its load's issue (the end of block b-1 at depth 1,
        its start at depth 2) to S_b, in that pair of modes}."""
        keys = set(self._modes(p))
        gaps = {}
        for i, cur in enumerate(names):
            if i < 1 or cur not in streamed:
                continue
            prev = names[i - 1]
            first = costs[cur][0]
            table = {}
            for m in MODES:
                for n_ in MODES:
                    if (cur, m) not in keys or (prev, n_) not in keys:
                        continue
                    chain = MS * self._copy_s(first, m, n_)
                    if self.depth == 2:
                        chain += self._min_duration(p, prev, costs[prev], n_)
                    load = MS * self.problem.load_s[cur] if m == "S" else 0.0
                    table[m, n_] = max(load, chain)
            gaps[cur] = table
        return gaps

    # (4) solve -------------------------------------------------------------------------------
    def solve(self, opts: IlpOptions, cutoff_s: float | None = None) -> IlpResult:
        if opts.dump_lp:
            self.prob.writeLP(opts.dump_lp)
        solver = highs_solver(opts, self.weights.cutoff_ms(cutoff_s) if cutoff_s is not None else None,
                              mip_max_nodes=opts.max_nodes, mip_heuristic_effort=0.01)
        t0 = time.perf_counter()
        status, info = run_highs(self.prob, solver)
        elapsed = time.perf_counter() - t0
        size = (sum(1 for v in self.prob.variables() if v.cat == "Integer"), len(self.prob.constraints))
        obj, bound = self.weights.read(self.T, status, info)
        if obj == float("inf"):  # no feasible solution
            return IlpResult(None, status, float("inf"), float("inf"), bound, elapsed, *size)
        return IlpResult(self.decision(), status, gap_of(obj, bound), obj, bound, elapsed, *size)

    # (5) read the decision ----------------------------------------------------------------------
    def decision(self) -> Decision:
        on = lambda v: v is not None and (v.value() or 0) > 0.5  # noqa: E731
        weights, exec_, kv = {}, {p: {} for p in PHASES}, {}
        for b in self.problem.blocks:
            streamed = {p: on(self.s.get((b.name, p))) for p in PHASES}
            if on(self.r[b.name]):
                weights[b.name] = "gpu"
            else:
                weights[b.name] = "stream" if any(streamed.values()) else "cpu"
            for p in PHASES:
                if weights[b.name] == "gpu":
                    exec_[p][b.name] = "stream" if self.xv.streams_cold(b.name, p) else "gpu"
                else:
                    exec_[p][b.name] = "stream" if streamed[p] else "cpu"
            if b.name in self.k:
                kv[b.name] = "gpu" if on(self.k[b.name]) else "cpu"
        experts = {b: self.xv.hot_count(b) for b in self.xv.layers if weights[b] == "gpu"}
        return Decision(weights, exec_, kv, depth=self.depth, experts=experts)


def slowest_stage_s(problem: Problem):
    """(phase, stage cost) -> the stage's longest time over its devices (and, for an MoE
    block, every expert split): what ``Weights`` bounds a phase with."""
    moe = problem.experts.get("decode", {})

    def slowest(p, c) -> float:
        t = max(c.gpu_s, c.cpu_s)
        if c.stage.block in moe:
            t = max(t, max(problem.experts[p][c.stage.block].split_times))
        return t
    return slowest


def _chains(problem: Problem, configs: list, opts: IlpOptions) -> tuple[dict, Weights]:
    """The chain DP of every configuration of a MoE model (``chain``), each with its
    Lagrangian dual bound solved, or none when ``opts.chain_dp`` is off."""
    weights = Weights(problem, slowest_stage_s(problem))
    if not (opts.chain_dp and problem.experts):
        return {}, weights
    cache = {}
    chains = {c: Chain(problem, c[0], c[1], opts.stream_cold, weights.w, cache) for c in configs if c[1] is not None}
    return chains, weights


def _solve_chain(chain: Chain, weights: Weights, opts: IlpOptions, cutoff_s: float | None) -> IlpResult | None:
    """One configuration by the chain DP (``chain.solve_config``), or None: the MILP decides."""
    t0 = time.perf_counter()
    res = solve_config(chain, weights, cutoff_s, opts.mip_rel_gap, opts.max_nodes * STATES_PER_NODE)
    if res is None:
        return None
    # a cut-off configuration holds nothing better than the plan found (within the gap), the
    # DP's state limit is deterministic as HiGHS's node limit is, and reported as one
    status = {"cut_off": "optimal", "state_limit": "node_limit"}.get(res.status, res.status)
    gap = gap_of(res.objective_s, res.bound_s) if res.decision is not None else \
        (0.0 if status == "optimal" else float("inf"))
    return IlpResult(res.decision, status, gap, res.objective_s, res.bound_s, time.perf_counter() - t0, 0, 0,
                     "chain-dp")


def configurations(problem: Problem, depths, by_slot: bool) -> list:
    """(staging depth, slot bytes or None) of every MILP solved; the best over them is the
    optimum, and each one's bound is valid, so the least bound bounds the optimum.

    ``by_slot`` False: one MILP per depth, its slot sized by the model (``add_slot_size``).
    True (MoE models, and models of identical layers, which the count MILP solves): for each
    depth, one MILP per size a slot can take (the distinct sizes of streamable blocks, smallest
    first), then one without streaming (slot 0). Every placement belongs to one of these (its
    depth and its largest streamed block). With the slot fixed, its memory stays out of the LP
    relaxation, where a fractionally streamed block would pay only that fraction of a slot and
    the HBM freed that way buys resident weights or hot experts: the bound is weak (DeepSeek-V3
    on a 24 GB GPU: proven optimal in about 4 s this way, a 0.1% gap left at the node limit the
    other). The per-block MILP of a dense model with layers that differ keeps one model per
    depth, because its extra MILPs cost more time than they prove (bench/RESULTS.md)."""
    if not by_slot:
        return [(d, None) for d in depths]
    sizes = sorted({b.weight_bytes for b in problem.blocks if b.streamable})
    return list(dict.fromkeys([(d, w) for d in depths for w in sizes] + [(1, 0.0)]))   # (1, 0) once


def _solve_layers(problem: Problem, model: LayerModel, opts: IlpOptions,
                  cutoff_s: float | None, floor_ms: float | None = None) -> IlpResult | None:
    """The count MILP of one configuration (``layers``; ``floor_ms``: ``LayerModel.solve``'s),
    or None when the plan it finds, timed
    with every task at its nominal duration (the timeline both MILPs' chains model), takes
    longer than the MILP's value (the prompt's KV copies, which it leaves out, end after the
    chain): the per-block MILP must then decide this configuration."""
    from hetplan.evaluate import objective_s, predictions
    from hetplan.schedule import build_schedule

    cutoff_ms = model.weights.cutoff_ms(cutoff_s) if cutoff_s is not None else None
    dec, status, obj, bound, secs, size = model.result(*model.solve(opts, cutoff_ms, floor_ms), floor_ms)
    if dec is None:
        return IlpResult(None, status, float("inf"), float("inf"), bound, secs, *size)
    replayed = objective_s(problem, predictions(problem, build_schedule(problem, dec, shared_buses=False)))
    if replayed > obj * (1 + 1e-9) + 1e-12:
        return None
    return IlpResult(dec, status, gap_of(obj, bound), obj, bound, secs, *size)


def _count_shape(problem: Problem, opts: IlpOptions):
    """The model as embed, alike layers, head (``layers.layered``) where the count MILP decides
    it, else None (no GPU, options that turn the count MILP off, layers that differ)."""
    return layered(problem) if problem.has_gpu and opts.count_layers and not opts.stream_cold else None


def _layer_model(problem: Problem, shape, config: tuple, unit: float) -> LayerModel:
    """The count MILP of ``config`` (``count_configurations``; KV mode None: both modes'
    relaxation)."""
    return LayerModel(problem, shape, config[0], config[1], unit, kv_copies=config[2])


def _kv_copies(config: tuple):
    """A count MILP configuration's ``kv_copies`` (``count_configurations``); None for another."""
    return config[2] if len(config) > 2 else None


def _say_configuration(i: int, configs: list, results: list) -> None:
    """The progress activity before configuration ``i``: which one, and the previous one's
    status, incumbent and bound."""
    depth, slot = configs[i][:2]
    copies = {True: ", prompt KV copied down", False: ", prompt KV kept"}.get(_kv_copies(configs[i]), "")
    what = f"MILP {i + 1} of {len(configs)} (staging depth {depth}" + (
        f", slot {slot / 2**20:.0f} MiB" if slot is not None else "") + f"{copies})"
    last = ""
    if results:
        r = results[-1]
        inc = f"{r.objective_s * 1e3:.6g} ms" if r.decision is not None else "none"
        last = f"; MILP {i} {r.status}, incumbent {inc}, bound {r.bound_s * 1e3:.6g} ms"
    progress.activity(f"{what}{last}")


def lp_bound_s(problem: Problem, opts: IlpOptions | None = None, floor: float = -float("inf")) -> float | None:
    """A cheap lower bound on ``solve``'s bound, so on the replay of any plan of ``problem``:
    the least LP relaxation of the count MILPs over every configuration (each a relaxation of its
    configuration's MILP); None for a problem the count MILP does not take (``layered``) or one
    without a GPU. ``floor``: a bound known already; the configurations stop as soon as one's LP
    is at or below it (the least cannot beat it then), and that one is returned."""
    opts = opts or IlpOptions()
    shape = _count_shape(problem, opts)
    if shape is None:
        return None
    unit = memory_unit(problem)
    least = float("inf")
    for depth, slot in configurations(problem, opts.depths, True):
        least = min(least, LayerModel(problem, shape, depth, slot, unit).lp_bound_s(opts))
        if least <= floor:
            break
    return least


def count_configurations(problem: Problem, depths) -> list:
    """(depth, slot, kv_copies) of every count MILP: ``configurations``, each solved twice
    where the prompt's KV may be copied down to DRAM caches (``kv_copies`` True: the HBM the
    largest copy holds is reserved; False: no layer copies its KV down, ``layers.LayerModel``),
    which keeps a binary with a big coefficient (``L used >= the layers that copy``) out of the
    MILP; else once (None)."""
    from hetplan.solvers.ilp.layers import copies_kv

    modes = (True, False) if copies_kv(problem) else (None,)
    return [(d, w, c) for d, w in configurations(problem, depths, True) for c in modes]


def count_bounds(problem: Problem, opts: IlpOptions | None = None, known: dict | None = None) -> dict | None:
    """{configuration: ``counts.CountBound``}: the LP relaxation of the count MILP of every
    configuration (both KV modes at once: the model that reserves nothing for copies of the
    prompt's KV relaxes both), each read as a lower bound on that configuration at every layer
    count of the same kind of stage (``counts``); the least over configurations at this
    problem's count is ``lp_bound_s`` (without a floor). None where ``lp_bound_s`` is.
    ``known``: {configuration: a lower bound on its LP here} (what other counts taught): the
    configurations are taken in order of it, and one whose bound is at least the least LP solved
    so far is not solved (it cannot be the least); its entry bounds this count alone, by it."""
    from hetplan.solvers.ilp.counts import CountBound, count_bound

    opts = opts or IlpOptions()
    shape = _count_shape(problem, opts)
    if shape is None:
        return None
    unit = memory_unit(problem)
    known = known or {}
    configs = configurations(problem, opts.depths, True)
    out, least = {}, math.inf
    for c in sorted(configs, key=lambda c: (known.get(c, -math.inf), configs.index(c))):
        if known.get(c, -math.inf) >= least:
            out[c] = CountBound(len(shape.layers), known[c], solved=False)
            continue
        out[c] = count_bound(LayerModel(problem, shape, *c, unit), opts)
        least = min(least, out[c].value_s)
    return {c: out[c] for c in configs}


def count_lines(problem: Problem, slopes: dict, hi: int, opts: IlpOptions | None = None) -> dict:
    """{count MILP configuration (``count_configurations``'s): ``counts.LineBound``} over the
    counts 2 to ``hi`` of the stages of ``problem``'s kind, for the configurations whose
    (depth, slot) ``slopes`` maps to a slope (weighted ms per layer); {} where ``count_bounds``
    is None."""
    from hetplan.solvers.ilp.counts import count_line

    opts = opts or IlpOptions()
    shape = _count_shape(problem, opts)
    if shape is None or hi < 2:
        return {}
    unit = memory_unit(problem)
    line_opts = IlpOptions(**{**opts.__dict__, "max_nodes": opts.max_nodes * COUNT_NODES_PER_NODE})
    return {c: count_line(LayerModel(problem, shape, c[0], c[1], unit, kv_copies=_kv_copies(c), count_range=(2, hi)),
                          slopes[c[:2]], line_opts)
            for c in count_configurations(problem, opts.depths) if c[:2] in slopes}


def solve(problem: Problem, opts: IlpOptions | None = None, lp_bounds: dict | None = None,
          floors: dict | None = None) -> IlpResult:
    """Solve the MILP of every configuration (``configurations``: staging depths of
    ``opts.depths``, and for MoE models and models of identical layers slot sizes); return the
    best decision, with the bound and gap over all of them (the optimum is >= the least
    configuration bound). A model of identical layers is solved by the count MILP
    (``layers``), any other by the per-block MILP; for a MoE model each configuration goes
    first to the chain DP (``chain``, configurations in order of their Lagrangian bounds), and
    to the per-block MILP only where the DP's plan meets a bus-total or prompt-KV row it left out. No MIP start is handed to HiGHS: with a
    partial start (the placement binaries of a baseline) HiGHS 1.16 declared worse plans optimal
    on small dense models at depth 2 (``tests/test_ilp_layers.py`` cross-checks both MILPs).
    ``lp_bounds``: {configuration: LP relaxation value} of this very problem's count MILPs where
    known already (``count_bounds``' ``value_s``), not computed again; ``floors``: {count MILP
    configuration (``count_configurations``'s): a proven lower bound on its MILP here, weighted
    ms} (``count_line``'s), which rules a configuration out as its LP would, and at which its
    MILP stops (``LayerModel.solve``'s ``floor_ms``)."""
    opts = opts or IlpOptions()
    if not problem.has_gpu:
        from hetplan.solvers.baselines import all_cpu
        return IlpResult(all_cpu(problem), "optimal", 0.0, None, None, 0.0, 0, 0)
    shape = _count_shape(problem, opts)
    results = []
    configs = count_configurations(problem, opts.depths) if shape is not None else \
        configurations(problem, opts.depths, bool(problem.experts))
    layer_models = {}   # built when needed: a configuration its LP bound cuts off needs none
    if shape is not None:  # the count MILPs, in order of the LP bounds of their (depth, slot)
        unit = memory_unit(problem)

        def layer_model(c):
            if c not in layer_models:
                layer_models[c] = _layer_model(problem, shape, c, unit)
            return layer_models[c]
        known = lp_bounds or {}
        relaxed = {c[:2]: known[c[:2]] if c[:2] in known else layer_model(c[:2] + (None,)).lp_bound_s(opts)
                   for c in configs}   # (both KV modes' relaxation)
        floors = floors or {}
        stated = Weights(problem).stated_bound_s if floors else None
        lp = {c: max(relaxed[c[:2]], stated(floors[c]) if c in floors else -math.inf) for c in configs}
        configs = sorted(configs, key=lambda c: (lp[c], configs.index(c)))
    t_setup = time.perf_counter()
    chains, weights = _chains(problem, configs, opts) if shape is None else ({}, None)
    if chains:  # in order of their Lagrangian bounds: the best plan is found early, cutting off the rest
        dual = {c: ch.lagrangian()[2] for c, ch in chains.items()}
        configs = sorted(configs, key=lambda c: (dual.get(c, float("-inf")), configs.index(c)))
    t_setup = time.perf_counter() - t_setup
    for i, config in enumerate(configs):
        depth, slot = config[:2]
        _say_configuration(i, configs, results)
        tag = (f".depth{depth}" if slot is None else f".depth{depth}.slot{int(slot)}") + \
            {True: ".kvdown", False: ".kvkept"}.get(_kv_copies(config), "")
        dump = f"{opts.dump_lp.removesuffix('.lp')}{tag}.lp" if opts.dump_lp else None
        found = [r.objective_s for r in results if r.decision is not None]
        cutoff = min(found) if found else None
        config_opts = IlpOptions(**{**opts.__dict__, "dump_lp": dump})
        res = None
        if shape is not None:
            config_opts = IlpOptions(**{**config_opts.__dict__, "max_nodes": opts.max_nodes * COUNT_NODES_PER_NODE})
            beaten = cutoff is not None and lp[config] >= cutoff * (1 - opts.mip_rel_gap)
            if cutoff is not None and _kv_copies(config) is not None and not beaten:
                lp[config] = max(lp[config], layer_model(config).lp_bound_s(opts))   # this KV mode's own
            if cutoff is not None and lp[config] >= cutoff * (1 - opts.mip_rel_gap):
                # its LP bound proves it cannot beat the plan found (within the gap tolerance)
                size = layer_models[config].size() if config in layer_models else (0, 0)
                results.append(IlpResult(None, "optimal", 0.0, float("inf"), min(lp[config], cutoff),
                                         0.0, *size))
                continue
            res = _solve_layers(problem, layer_model(config), config_opts, cutoff, floors.get(config))
        if res is None and (depth, slot) in chains:
            res = _solve_chain(chains[depth, slot], weights, config_opts, cutoff)
        if res is None:
            res = _Model(problem, depth, slot, stream_cold=opts.stream_cold).solve(config_opts, cutoff_s=cutoff)
        if res.decision is None and found and res.status in ("infeasible", "objective_bound"):
            # nothing better than the cutoff exists at this depth: the cutoff is its bound
            res = IlpResult(None, "optimal", 0.0, float("inf"), min(found), res.solve_seconds,
                            res.n_binaries, res.n_constraints)
        results.append(res)
    if not results:
        raise HetplanError("the ILP was given no staging depth to try")
    total = t_setup + sum(r.solve_seconds for r in results)
    feasible = [r for r in results if r.decision is not None]
    bound = min(r.bound_s for r in results)
    if not feasible:
        status = "infeasible" if all(r.status == "infeasible" for r in results) else results[0].status
        return IlpResult(None, status, float("inf"), float("inf"), bound, total,
                         results[0].n_binaries, results[0].n_constraints)
    best = min(feasible, key=lambda r: r.objective_s)
    gap = gap_of(best.objective_s, bound)
    # Every configuration's bound is valid whether or not its search finished, so the least
    # of them bounds the optimum: within the gap tolerance of it, the plan is proven optimal.
    status = "optimal" if gap <= opts.mip_rel_gap * (1 + 1e-9) else \
        next((r.status for r in results if r.status not in ("optimal", "infeasible", "objective_bound")),
             "optimal")
    formulation = "+".join(f for f in ("chain-dp", "milp") if any(r.formulation == f for r in results))
    return IlpResult(best.decision, status, gap, best.objective_s, bound, total, best.n_binaries, best.n_constraints,
                     formulation)
