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

import pulp

from hetplan.errors import HetplanError
from hetplan.graph import PHASES
from hetplan.plan import Decision
from hetplan.problem import Problem
from hetplan.solvers import ilp_constraints as C

MS = 1e3          # model time unit: milliseconds
GIB = float(1 << 30)  # model memory unit


@dataclass(frozen=True)
class IlpOptions:
    depths: tuple = (1, 2)
    """Staging depths tried; the best plan over them wins."""
    time_limit_s: float = 60.0
    mip_rel_gap: float = 1e-6
    threads: int = 1
    dump_lp: str | None = None


@dataclass(frozen=True)
class IlpResult:
    decision: Decision | None
    status: str
    """HiGHS's model status name: ``optimal``, ``time_limit`` (best found, not proven), ``infeasible``."""
    mip_gap: float
    objective_s: float
    solve_seconds: float
    n_binaries: int
    n_constraints: int


class _Model:
    """The MILP for one staging depth, with handles on the variables the decision is read from."""

    def __init__(self, problem: Problem, depth: int, tag: str = ""):
        self.problem, self.depth = problem, depth
        blocks = problem.blocks
        self.prob = pulp.LpProblem(f"hetplan_placement_depth{depth}{tag}", pulp.LpMinimize)
        # (1) variables -------------------------------------------------------------------
        self.r = {b.name: pulp.LpVariable(f"r_{b.name}", cat="Binary") for b in blocks}
        self.s = {(b.name, p): pulp.LpVariable(f"s_{b.name}_{p}", cat="Binary")
                  for b in blocks if b.streamable for p in PHASES}
        self.k = {b.name: pulp.LpVariable(f"k_{b.name}", cat="Binary") for b in blocks if b.kind == "attn"}
        self.sigma = pulp.LpVariable("slot_gib", lowBound=0)
        self.T = {p: pulp.LpVariable(f"T_{p}", lowBound=0) for p in PHASES}
        has_core = {b.name: False for b in blocks if b.kind == "attn"}
        for st in problem.graph.stages["decode"]:
            if st.follows == "kv":
                has_core[st.block] = True
        # (3) constraint families on placement and memory ----------------------------------
        C.add_exec_choice(self.prob, self.r, self.s, None, blocks, PHASES)
        C.add_kv_beside_compute(self.prob, self.r, self.s, self.k, blocks, PHASES, has_core)
        C.add_memory(self.prob, self.r, self.s, self.k, self.sigma, blocks, PHASES, depth,
                     problem.gpu_budget_bytes, problem.cpu_budget_bytes,
                     problem.gpu_workspace_bytes, problem.cpu_workspace_bytes, GIB)
        for p in PHASES:
            self._timeline(p)
        # (2) objective ----------------------------------------------------------------------
        wl = problem.workload
        w_pre, w_dec = {"latency": (1.0, wl.gen_len), "throughput": (1.0, wl.gen_len),
                        "ttft": (1.0, 1e-4), "tpot": (1e-4, 1.0)}[wl.objective]
        self.weights = (w_pre, w_dec)
        self.prob += w_pre * self.T["prefill"] + w_dec * self.T["decode"], "objective_ms"

    def g(self, p, st):
        """1 when stage ``st`` runs on the GPU in phase ``p`` (an affine expression)."""
        if st.follows == "kv":
            return self.k[st.block]
        return self.r[st.block] + self.s.get((st.block, p), 0)

    def _timeline(self, p):
        pr, prob = self.problem, self.prob
        costs = pr.stages[p]
        names = [b.name for b in pr.blocks]
        S, E, delays = {}, {}, {}
        stage_ids, first, last, kv_down, d2h_queue = [], {}, {}, {}, []
        prev = None
        for c in costs:
            st = c.stage
            sid = st.id
            S[sid] = pulp.LpVariable(f"S_{p}_{sid}", lowBound=0)
            g = self.g(p, st)
            E[sid] = S[sid] + MS * c.cpu_s + MS * (c.gpu_s - c.cpu_s) * g
            first.setdefault(st.block, sid)
            last[st.block] = sid
            if prev is not None and (prev.block, prev.follows) != (st.block, st.follows):
                delays[sid] = self._transfer_delay(p, prev, c)
            stage_ids.append(sid)
            prev = st
            if p == "prefill" and st.kind == "attn_core":
                kid = f"kv_down/{st.block}"
                S[kid] = pulp.LpVariable(f"S_{p}_{kid}", lowBound=0)
                E[kid] = S[kid] + MS * pr.kv_down_s[st.block] * (g - self.k[st.block])
                kv_down[kid] = sid
                d2h_queue.append(kid)
        loads = {}

        def load(j):
            name = names[j]
            lid = f"load/{name}"
            S[lid] = pulp.LpVariable(f"S_{p}_{lid}", lowBound=0)
            E[lid] = S[lid] + MS * pr.load_s[name] * self.s[name, p]
            loads[lid] = (first[name], last[names[j - self.depth]] if j >= self.depth else None)
            return lid

        d = self.depth
        h2d_queue = [load(j) for j in range(min(d, len(names))) if (names[j], p) in self.s]
        h2d_queue += [load(j + d) for j in range(len(names) - d) if (names[j + d], p) in self.s]
        C.add_chain(prob, S, E, stage_ids, delays, p)
        C.add_load_edges(prob, S, E, loads, p)
        C.add_kv_down_edges(prob, S, E, kv_down, p)
        C.add_queue_order(prob, S, E, h2d_queue, "h2d", p)
        C.add_queue_order(prob, S, E, d2h_queue, "d2h", p)
        C.add_makespan(prob, self.T[p], E, [stage_ids[-1]] + d2h_queue[-1:], p)

    def _transfer_delay(self, p, prev_st, c):
        """Copy time into stage ``c`` when it runs on another device than ``prev_st``:
        t_up u + t_down w with u >= g_c - g_prev, w >= g_prev - g_c, u, w in [0, 1]."""
        st = c.stage
        g_prev, g_cur = self.g(p, prev_st), self.g(p, st)
        u = pulp.LpVariable(f"u_{p}_{st.id}", lowBound=0, upBound=1)
        w = pulp.LpVariable(f"w_{p}_{st.id}", lowBound=0, upBound=1)
        self.prob += u >= g_cur - g_prev, f"act_up_on_{p}_{st.id}"
        self.prob += w >= g_prev - g_cur, f"act_down_on_{p}_{st.id}"
        return MS * c.up_s * u + MS * c.down_s * w

    # (4) solve -------------------------------------------------------------------------------
    def solve(self, opts: IlpOptions) -> IlpResult:
        if opts.dump_lp:
            self.prob.writeLP(opts.dump_lp)
        solver = pulp.HiGHS(msg=False, timeLimit=opts.time_limit_s, gapRel=opts.mip_rel_gap,
                            threads=opts.threads, random_seed=0)
        t0 = time.perf_counter()
        with _stdout_silenced():
            self.prob.solve(solver)
        elapsed = time.perf_counter() - t0
        h = self.prob.solverModel
        status = h.modelStatusToString(h.getModelStatus()).lower().replace(" ", "_")
        info = h.getInfo()
        n_bin = sum(1 for v in self.prob.variables() if v.cat == "Integer")
        has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
        if not has_solution:
            return IlpResult(None, status, float("inf"), float("inf"), elapsed, n_bin, len(self.prob.constraints))
        gap = max(0.0, float(info.mip_gap)) if info.mip_gap == info.mip_gap else 0.0
        obj = self.weights[0] * self.T["prefill"].value() + self.weights[1] * self.T["decode"].value()
        return IlpResult(self.decision(), status, gap, obj / MS, elapsed, n_bin, len(self.prob.constraints))

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
                exec_[p][b.name] = "gpu" if weights[b.name] == "gpu" else ("stream" if streamed[p] else "cpu")
            if b.name in self.k:
                kv[b.name] = "gpu" if on(self.k[b.name]) else "cpu"
        return Decision(weights, exec_, kv, depth=self.depth)


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


def solve(problem: Problem, opts: IlpOptions | None = None) -> IlpResult:
    """Solve the MILP for every staging depth in ``opts.depths``; return the best result."""
    opts = opts or IlpOptions()
    if not problem.has_gpu:
        from hetplan.solvers.baselines import all_cpu
        return IlpResult(all_cpu(problem), "optimal", 0.0, float("nan"), 0.0, 0, 0)
    best = None
    total = 0.0
    for depth in opts.depths:
        dump = f"{opts.dump_lp.removesuffix('.lp')}.depth{depth}.lp" if opts.dump_lp and len(opts.depths) > 1 \
            else opts.dump_lp
        res = _Model(problem, depth).solve(IlpOptions(**{**opts.__dict__, "dump_lp": dump}))
        total += res.solve_seconds
        if res.decision is not None and (best is None or res.objective_s < best.objective_s - 1e-12):
            best = res
        elif best is None:
            best = res
    if best is None:
        raise HetplanError("the ILP was given no staging depth to try")
    return IlpResult(**{**best.__dict__, "solve_seconds": total})
