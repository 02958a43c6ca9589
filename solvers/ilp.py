"""The placement MILP: exact for the plan's task model, solved by HiGHS through PuLP.

Steps: (1) variables, (2) the objective, (3) constraint families (``ilp_constraints``, one
function each with its math), (4) solve with a time limit, (5) read the decision and the true
status and gap. The model is a pure function of the Problem; ``dump_lp`` writes it.

It knows the task rules of ``hetplan.schedule`` (which tasks exist, queue order, edges) and
encodes them as constraints in its own code; it does not call the schedule builder.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import pulp

from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.plan import Decision
from hetplan.problem import Problem
from hetplan.solvers import ilp_constraints as C
from hetplan.solvers.ilp_constraints import MODES
from hetplan.solvers.ilp_experts import ExpertVars

MS = 1e3          # model time unit: milliseconds


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
    """Branch-and-bound nodes per MILP solved: the deterministic limit (same plan on every machine)."""
    mip_rel_gap: float = 1e-4
    threads: int = 1
    stream_cold: bool = False
    """Also consider streaming a resident MoE block's cold experts per phase (exact, but it
    makes MoE models several times slower to solve)."""
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
        C.add_memory(self.prob, resident, self.r, self.s, self.k, self.sigma, blocks, PHASES, depth,
                     problem.gpu_budget_bytes, problem.cpu_budget_bytes,
                     problem.gpu_workspace_bytes, problem.cpu_workspace_bytes, unit)
        for p in PHASES:
            self._timeline(p)
        # (2) objective ----------------------------------------------------------------------
        self.weights = self._objective_weights()
        w_pre, w_dec = self.weights
        self.prob += w_pre * self.T["prefill"] + w_dec * self.T["decode"], "objective_ms"

    def _objective_weights(self) -> tuple:
        """(w_prefill, w_decode). ``latency``: 1 and gen_len. ``ttft``/``tpot``: 1 on the stated
        phase and a tie-break eps on the other, small enough that no amount of the other phase can
        buy back more than 1e-7 of the stated one: eps = 1e-7 * lb(stated) / ub(other), where lb
        sums each stage's faster device time and ub every task's slowest time."""
        wl = self.problem.workload
        if wl.objective in ("latency", "throughput"):
            return 1.0, float(wl.gen_len)
        lb = {p: sum(min(c.gpu_s, c.cpu_s) for c in self.problem.stages[p]) for p in PHASES}
        ub = {p: self._phase_upper_bound_s(p) for p in PHASES}
        if wl.objective == "ttft":
            return 1.0, 1e-7 * lb["prefill"] / ub["decode"]
        return 1e-7 * lb["decode"] / ub["prefill"], 1.0

    def _phase_upper_bound_s(self, p) -> float:
        """No phase can take longer than every task of it back to back at its slowest."""
        pr = self.problem
        return (sum(self._slowest_s(p, c) + c.up_s + c.down_s for c in pr.stages[p])
                + sum(pr.load_s.get(b.name, 0.0) for b in pr.blocks)
                + (sum(pr.kv_down_s.values()) if p == "prefill" else 0.0))

    def _slowest_s(self, p, c) -> float:
        """A stage's longest time over its devices (and, for an MoE block, every expert split)."""
        slowest = max(c.gpu_s, c.cpu_s)
        if c.stage.block in self.xv.layers:
            slowest = max(slowest, self.xv.max_split_s(p, c.stage.block))
        return slowest

    def _stated(self, weighted_ms: float) -> float:
        """Objective in seconds as the workload states it (without the other phase's tie-break)."""
        obj = self.problem.workload.objective
        if obj == "ttft":
            return self.T["prefill"].value() / MS
        if obj == "tpot":
            return self.T["decode"].value() / MS
        return weighted_ms / MS

    def _stated_bound(self, weighted_bound_ms: float) -> float:
        """A lower bound on the stated objective from one on the weighted one."""
        obj = self.problem.workload.objective
        if obj == "ttft":
            return (weighted_bound_ms - self.weights[1] * MS * self._phase_upper_bound_s("decode")) / MS
        if obj == "tpot":
            return (weighted_bound_ms - self.weights[0] * MS * self._phase_upper_bound_s("prefill")) / MS
        return weighted_bound_ms / MS

    def _weighted_cutoff_ms(self, stated_s: float) -> float:
        """A weighted objective no solution with stated objective < ``stated_s`` can exceed."""
        obj = self.problem.workload.objective
        if obj == "ttft":
            return stated_s * MS + self.weights[1] * MS * self._phase_upper_bound_s("decode")
        if obj == "tpot":
            return stated_s * MS + self.weights[0] * MS * self._phase_upper_bound_s("prefill")
        return stated_s * MS

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

    def _block_costs(self, p):
        """block -> its stages in phase p, in order."""
        by_block = {}
        for c in self.problem.stages[p]:
            by_block.setdefault(c.stage.block, []).append(c)
        return by_block

    def _duration(self, p, name, costs, g, k, upto=None):
        """Time from the start of block ``name``'s first stage to the end of its stage ``upto``
        (default: the last), for GPU indicator ``g`` and KV indicator ``k`` (numbers or
        expressions): stage times on their devices plus the copies inside the block, which happen
        exactly when g - k = 1 (attention on the GPU, its cache in DRAM)."""
        total = 0
        prev = None
        for c in costs[: upto]:
            dev = k if c.stage.follows == "kv" else g
            total += MS * c.cpu_s + MS * (c.gpu_s - c.cpu_s) * dev
            if prev is not None and prev.stage.follows != c.stage.follows:
                total += MS * (c.down_s if c.stage.follows == "kv" else c.up_s) * (g - k)
            prev = c
        return total

    def _min_duration(self, p, name, costs, m):
        """Least block duration in mode ``m`` over the KV choices that mode allows (a number)."""
        g = 1 if m in ("G", "S") else 0
        if m == "G" and name in self.xv.layers:
            return MS * self.xv.min_split_s(p, name)
        ks = (0, 1) if g and self.has_core.get(name) else ((g,) if name in self.k else (0,))
        return min(self._duration(p, name, costs, g, k) for k in ks)

    def _timeline(self, p):
        pr, prob = self.problem, self.prob
        names = [b.name for b in pr.blocks]
        costs = self._block_costs(p)
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
                E[n] = S[n] + self._duration(p, n, costs[n], g, k)
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
        # weight loads on h2d, in block order, windowed by the staging depth
        streamed = [n for n in names if (n, p) in self.s or self.xv.streamed(n, p)]
        L = {n: pulp.LpVariable(f"L_{p}_{n}", lowBound=0) for n in streamed}
        EL = {n: L[n] + (MS * pr.load_s[n] * self.s[n, p] if (n, p) in self.s else 0)
              + (self.xv.load_ms(p, n) if self.xv.streamed(n, p) else 0) for n in streamed}
        index = {n: i for i, n in enumerate(names)}
        windows = {n: names[index[n] - self.depth] if index[n] >= self.depth else None for n in streamed}
        C.add_load_edges(prob, S, E, L, EL, windows, p)
        C.add_queue_order(prob, L, EL, streamed, "h2d", p)
        if self.depth in (1, 2):
            C.add_window_pair_cuts(prob, S, E, y, self._pair_gaps(p, names, costs, streamed), p)
        # the prompt's KV copied down (prefill, attention on the GPU, cache in DRAM)
        ends = [E[names[-1]]]
        if p == "prefill":
            cores = [n for n in names if n in self.k and self.has_core[n]]
            SK = {n: pulp.LpVariable(f"SK_{p}_{n}", lowBound=0) for n in cores}
            EK, core_end = {}, {}
            for n in cores:
                g = self.r[n] + self.s.get((n, p), 0)
                upto = 1 + next(i for i, c in enumerate(costs[n]) if c.stage.kind == "attn_core")
                core_end[n] = S[n] + self._duration(p, n, costs[n], g, g, upto)
                EK[n] = SK[n] + MS * pr.kv_down_s[n] * (g - self.k[n])
            C.add_kv_down_edges(prob, SK, EK, core_end, p)
            C.add_queue_order(prob, SK, EK, cores, "d2h", p)
            ends += [EK[cores[-1]]] if cores else []
        C.add_makespan(prob, self.T[p], ends, p)

    @staticmethod
    def _copy_s(first_stage_cost, m, n_):
        """Copy time of a block's input when it runs in mode m after a block in mode n_."""
        on_gpu, prev_on_gpu = m in ("G", "S"), n_ in ("G", "S")
        if on_gpu and not prev_on_gpu:
            return first_stage_cost.up_s
        if prev_on_gpu and not on_gpu:
            return first_stage_cost.down_s
        return 0.0

    def _pair_gaps(self, p, names, costs, streamed):
        """(block, window block) -> {(m, n): least S_b - E_w in that pair of modes}."""
        keys = set(self._modes(p))
        gaps = {}
        for i, cur in enumerate(names):
            if i < max(1, self.depth) or cur not in streamed:
                continue
            prev, w = names[i - 1], names[i - self.depth]
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
            gaps[cur, w] = table
        return gaps

    def start_values(self, dec: Decision) -> dict | None:
        """Values of the placement variables that encode ``dec`` (HiGHS completes the rest), or
        None when this configuration cannot express it (a block streamed that it cannot stream)."""
        values = {}
        for b in self.problem.blocks:
            values[self.r[b.name]] = 1.0 if dec.weights[b.name] == "gpu" else 0.0
            for p in PHASES:
                streamed = dec.exec[p][b.name] == "stream"
                if dec.weights[b.name] == "gpu" and streamed:  # a resident MoE block's cold experts
                    if not self.xv.streamed(b.name, p):
                        return None
                    values[self.xv.u[b.name, p]] = 1.0
                    streamed = False
                elif self.xv.streamed(b.name, p):
                    values[self.xv.u[b.name, p]] = 0.0
                if (b.name, p) in self.s:
                    values[self.s[b.name, p]] = float(streamed)
                elif streamed:
                    return None
            if b.name in self.k:
                values[self.k[b.name]] = 1.0 if dec.kv[b.name] == "gpu" else 0.0
        for b, x in self.xv.layers.items():
            n = dec.hot_experts(b, x.n_experts)
            for i, (_, size) in enumerate(self.xv.classes[b]):
                values[self.xv.m[b, i]] = float(min(size, n))
                n -= min(size, n)
            values[self.xv.cold[b]] = float(dec.weights[b] == "gpu" and dec.hot_experts(b, x.n_experts) < x.n_experts)
        return values

    # (4) solve -------------------------------------------------------------------------------
    def solve(self, opts: IlpOptions, cutoff_s: float | None = None, start: Decision | None = None) -> IlpResult:
        """``start``: a placement handed to HiGHS as its first incumbent (when it fits this
        configuration), so that the search prunes against it from the root."""
        if opts.dump_lp:
            self.prob.writeLP(opts.dump_lp)
        extra = {"objective_bound": self._weighted_cutoff_ms(cutoff_s)} if cutoff_s is not None else {}
        solver = pulp.HiGHS(msg=False, timeLimit=opts.time_limit_s, gapRel=opts.mip_rel_gap,
                            threads=opts.threads, random_seed=0, mip_max_nodes=opts.max_nodes,
                            mip_heuristic_effort=0.01, **extra)
        t0 = time.perf_counter()
        with _stdout_silenced():
            _run_highs(self.prob, solver, self.start_values(start) if start is not None else None)
        elapsed = time.perf_counter() - t0
        h = self.prob.solverModel
        status = _STATUS.get(h.modelStatusToString(h.getModelStatus()),
                             h.modelStatusToString(h.getModelStatus()).lower().replace(" ", "_"))
        info = h.getInfo()
        n_bin = sum(1 for v in self.prob.variables() if v.cat == "Integer")
        size = (n_bin, len(self.prob.constraints))
        if info.primal_solution_status != 2:  # no feasible solution
            bound = float("inf") if status == "infeasible" else info.mip_dual_bound / MS
            return IlpResult(None, status, float("inf"), float("inf"), bound, elapsed, *size)
        weighted = self.weights[0] * self.T["prefill"].value() + self.weights[1] * self.T["decode"].value()
        weighted_bound = weighted * (1 - max(0.0, info.mip_gap)) if status == "optimal" else \
            min(weighted, info.mip_dual_bound)
        obj, bound = self._stated(weighted), min(self._stated(weighted), self._stated_bound(weighted_bound))
        return IlpResult(self.decision(), status, _gap(obj, bound), obj, bound, elapsed, *size)

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


@contextlib.contextmanager
def _stdout_silenced():
    """HiGHS prints a banner on C-level stdout when a solver object is created, whatever its
    options; keep it out of our stdout (which may carry JSON)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def _run_highs(prob: pulp.LpProblem, solver, start: dict | None = None) -> None:
    """Build and run the HiGHS model through PuLP's adapter (with ``start``, variable -> value,
    as a partial MIP start that HiGHS completes), then read the column values back ourselves:
    PuLP's own status table has no entry for HiGHS's node (solution) limit."""
    solver.createAndConfigureSolver(prob)
    solver.buildSolverModel(prob)
    if start:
        index = np.array([v.index for v in start], dtype=np.int32)
        prob.solverModel.setSolution(len(index), index, np.array(list(start.values()), dtype=np.float64))
    solver.callSolver(prob)
    h = prob.solverModel
    if h.getInfo().primal_solution_status == 2:
        values = h.getSolution().col_value
        for v in prob.variables():
            v.varValue = values[v.index]


def _gap(obj: float, bound: float) -> float:
    return max(0.0, (obj - bound) / obj) if obj > 0 else 0.0


_STATUS = {"Optimal": "optimal", "Time limit reached": "time_limit", "Infeasible": "infeasible",
           "Objective bound": "objective_bound",
           "Solution limit reached": "node_limit", "Primal infeasible or unbounded": "infeasible"}


def configurations(problem: Problem, depths) -> list:
    """(staging depth, slot bytes or None) of every MILP solved; the best over them is the
    optimum, and each one's bound is valid, so the least bound bounds the optimum.

    Dense models: one MILP per depth, its slot sized by the model (``add_slot_size``). MoE
    models: for each depth, one MILP per size a slot can take (the distinct sizes of streamable
    blocks, smallest first), then one without streaming (slot 0). Every placement belongs to
    one of these (its depth and its largest streamed block). With the slot fixed, its memory
    stays out of the LP relaxation, where a fractionally streamed block would pay only that
    fraction of a slot: in MoE models the HBM freed that way buys hot experts and the bound
    is weak (DeepSeek-V3 on a 24 GB GPU: proven optimal in about 4 s this way, a 0.1% gap left
    at the node limit the other). On dense models the many MILPs cost more than they prove
    (bench/RESULTS.md)."""
    if not problem.experts:
        return [(d, None) for d in depths]
    sizes = sorted({b.weight_bytes for b in problem.blocks if b.streamable})
    return [(d, w) for d in depths for w in sizes] + [(1, 0.0)]


def solve(problem: Problem, opts: IlpOptions | None = None, start: Decision | None = None) -> IlpResult:
    """Solve the MILP of every configuration (``configurations``: staging depths of
    ``opts.depths``, and for MoE models slot sizes); return the best decision, with the bound
    and gap over all of them (the optimum is >= the least configuration bound). ``start``:
    HiGHS's first incumbent in each configuration that can express it (default: the best
    baseline that fits)."""
    opts = opts or IlpOptions()
    if not problem.has_gpu:
        from hetplan.solvers.baselines import all_cpu
        return IlpResult(all_cpu(problem), "optimal", 0.0, None, None, 0.0, 0, 0)
    if start is None:
        from hetplan.solvers.baselines import best_fitting
        start = best_fitting(problem)[1]
    results = []
    for depth, slot in configurations(problem, opts.depths):
        tag = f".depth{depth}" if slot is None else f".depth{depth}.slot{int(slot)}"
        dump = f"{opts.dump_lp.removesuffix('.lp')}{tag}.lp" if opts.dump_lp else None
        found = [r.objective_s for r in results if r.decision is not None]
        res = _Model(problem, depth, slot, stream_cold=opts.stream_cold).solve(
            IlpOptions(**{**opts.__dict__, "dump_lp": dump}),
                                                 cutoff_s=min(found) if found else None, start=start)
        if res.decision is None and found and res.status in ("infeasible", "objective_bound"):
            # nothing better than the cutoff exists at this depth: the cutoff is its bound
            res = IlpResult(None, "optimal", 0.0, float("inf"), min(found), res.solve_seconds,
                            res.n_binaries, res.n_constraints)
        results.append(res)
    if not results:
        raise HetplanError("the ILP was given no staging depth to try")
    total = sum(r.solve_seconds for r in results)
    feasible = [r for r in results if r.decision is not None]
    bound = min(r.bound_s for r in results)
    if not feasible:
        status = "infeasible" if all(r.status == "infeasible" for r in results) else results[0].status
        return IlpResult(None, status, float("inf"), float("inf"), bound, total,
                         results[0].n_binaries, results[0].n_constraints)
    best = min(feasible, key=lambda r: r.objective_s)
    gap = _gap(best.objective_s, bound)
    # Every configuration's bound is valid whether or not its search finished, so the least
    # of them bounds the optimum: within the gap tolerance of it, the plan is proven optimal.
    status = "optimal" if gap <= opts.mip_rel_gap * (1 + 1e-9) else \
        next((r.status for r in results if r.status not in ("optimal", "infeasible", "objective_bound")),
             "optimal")
    return IlpResult(best.decision, status, gap, best.objective_s, bound, total, best.n_binaries, best.n_constraints)
