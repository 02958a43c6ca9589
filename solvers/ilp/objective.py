"""What the placement MILPs minimise, the block-time formulas they share, and how HiGHS runs.

Both MILPs (``ilp``: one variable set per block; ``layers``: counts of identical layers)
weigh the two phases the same way, price a block's duration the same way and read HiGHS's
status the same way; this module holds those pieces once.
"""

from __future__ import annotations

import contextlib
import os
import sys

import highspy
import pulp

from hetplan import progress

from hetplan.graph import PHASES

MS = 1e3          # model time unit: milliseconds


def block_costs(problem, p) -> dict:
    """block -> its stage costs in phase p, in order."""
    by_block = {}
    for c in problem.stages[p]:
        by_block.setdefault(c.stage.block, []).append(c)
    return by_block


def duration_ms(costs, g, k, upto=None):
    """Time from the start of a block's first stage to the end of its stage ``upto`` (default:
    the last), for GPU indicator ``g`` and KV indicator ``k`` (numbers or expressions): stage
    times on their devices plus the copies inside the block, which happen exactly when
    g - k = 1 (attention on the GPU, its cache in DRAM)."""
    total = 0
    prev = None
    for c in costs[: upto]:
        dev = k if c.stage.follows == "kv" else g
        total += MS * c.cpu_s + MS * (c.gpu_s - c.cpu_s) * dev
        if prev is not None and prev.stage.follows != c.stage.follows:
            total += MS * (c.down_s if c.stage.follows == "kv" else c.up_s) * (g - k)
        prev = c
    return total


def bus_bytes(costs, g, k, load_bytes=0.0, kv_down_bytes=0.0) -> dict:
    """Bytes a block moves over each bus in one phase (``hetplan.buses``), for GPU indicator
    ``g`` and KV indicator ``k`` (numbers or expressions):
        dram = sum_st B_st (1 - d_st) + X (g - k) + L + K (g - k)
        hbm  = sum_st B_st d_st       + X (g - k) + L + K (g - k)
    with d_st = k for a stage beside the KV cache and g otherwise, B_st the stage's bytes, X the
    inputs of its stages copied inside the block (attention on the GPU beside a DRAM cache),
    L = ``load_bytes`` (its weights streamed in, a copy out of DRAM into HBM) and K =
    ``kv_down_bytes`` (the prompt's KV copied to DRAM). Activation copies between blocks are
    left out: the sum bounds the traffic from below."""
    dram = hbm = 0
    prev = None
    for c in costs:
        dev = k if c.stage.follows == "kv" else g
        dram += c.stage.work.bytes * (1 - dev)
        hbm += c.stage.work.bytes * dev
        if prev is not None and prev.stage.follows != c.stage.follows:
            dram += c.stage.in_bytes * (g - k)
            hbm += c.stage.in_bytes * (g - k)
        prev = c
    both = load_bytes + kv_down_bytes * (g - k)
    return {"dram": dram + both, "hbm": hbm + both}


def copy_s(first_stage_cost, on_gpu: bool, prev_on_gpu: bool) -> float:
    """Copy time of a block's input when it runs on the GPU or not after a block that did or
    did not."""
    if on_gpu and not prev_on_gpu:
        return first_stage_cost.up_s
    if prev_on_gpu and not on_gpu:
        return first_stage_cost.down_s
    return 0.0


class Weights:
    """The weighted objective ``w_prefill T_prefill + w_decode T_decode`` (ms) and its link to
    the objective the workload states."""

    def __init__(self, problem, slowest_s=None):
        """``slowest_s(p, stage_cost)``: a stage's longest time over every way it can run
        (default: the slower device)."""
        self.problem = problem
        slowest_s = slowest_s or (lambda p, c: max(c.gpu_s, c.cpu_s))
        self.ub = {p: (sum(slowest_s(p, c) + c.up_s + c.down_s for c in problem.stages[p])
                       + sum(problem.load_s.get(b.name, 0.0) for b in problem.blocks)
                       + (sum(problem.kv_down_s.values()) if p == "prefill" else 0.0)) for p in PHASES}
        """No phase can take longer than every task of it back to back at its slowest."""
        self.w = self._weights()

    def _weights(self) -> tuple:
        """(w_prefill, w_decode). ``latency``: 1 and gen_len. ``ttft``/``tpot``: 1 on the stated
        phase and a tie-break eps on the other, small enough that no amount of the other phase can
        buy back more than 1e-7 of the stated one: eps = 1e-7 * lb(stated) / ub(other), where lb
        sums each stage's faster device time and ub every task's slowest time."""
        wl = self.problem.workload
        if wl.objective in ("latency", "throughput"):
            return 1.0, float(wl.gen_len)
        lb = {p: sum(min(c.gpu_s, c.cpu_s) for c in self.problem.stages[p]) for p in PHASES}
        if wl.objective == "ttft":
            return 1.0, 1e-7 * lb["prefill"] / self.ub["decode"]
        return 1e-7 * lb["decode"] / self.ub["prefill"], 1.0

    def weighted_ms(self, t_ms: dict):
        return self.w[0] * t_ms["prefill"] + self.w[1] * t_ms["decode"]

    def stated_s(self, t_ms: dict) -> float:
        """Objective in seconds as the workload states it (without the other phase's tie-break)."""
        obj = self.problem.workload.objective
        if obj == "ttft":
            return t_ms["prefill"] / MS
        if obj == "tpot":
            return t_ms["decode"] / MS
        return self.weighted_ms(t_ms) / MS

    def stated_bound_s(self, weighted_bound_ms: float) -> float:
        """A lower bound on the stated objective from one on the weighted one."""
        obj = self.problem.workload.objective
        if obj == "ttft":
            return (weighted_bound_ms - self.w[1] * MS * self.ub["decode"]) / MS
        if obj == "tpot":
            return (weighted_bound_ms - self.w[0] * MS * self.ub["prefill"]) / MS
        return weighted_bound_ms / MS

    def read(self, T: dict, status: str, info) -> tuple[float, float]:
        """(stated objective s, a proven lower bound on it s) of a solved MILP whose phase
        makespans are the variables ``T``; (inf, HiGHS's dual bound) when it found no plan."""
        if info.primal_solution_status != 2:
            return float("inf"), float("inf") if status == "infeasible" else info.mip_dual_bound / MS
        t_ms = {p: T[p].value() for p in PHASES}
        weighted = self.weighted_ms(t_ms)
        weighted_bound = weighted * (1 - max(0.0, info.mip_gap)) if status == "optimal" else \
            min(weighted, info.mip_dual_bound)
        obj = self.stated_s(t_ms)
        return obj, min(obj, self.stated_bound_s(weighted_bound))

    def cutoff_ms(self, stated_s: float) -> float:
        """A weighted objective no solution with stated objective < ``stated_s`` can exceed."""
        obj = self.problem.workload.objective
        if obj == "ttft":
            return stated_s * MS + self.w[1] * MS * self.ub["decode"]
        if obj == "tpot":
            return stated_s * MS + self.w[0] * MS * self.ub["prefill"]
        return stated_s * MS


STATUS = {"Optimal": "optimal", "Time limit reached": "time_limit", "Infeasible": "infeasible",
          "Objective bound": "objective_bound", "Target for objective reached": "objective_target",
          "Solution limit reached": "node_limit", "Primal infeasible or unbounded": "infeasible"}


def highs_solver(opts, cutoff_ms: float | None = None, **extra):
    """PuLP's HiGHS adapter with the options every MILP here is solved with."""
    if cutoff_ms is not None:
        extra["objective_bound"] = cutoff_ms
    return pulp.HiGHS(msg=False, timeLimit=opts.time_limit_s, gapRel=opts.mip_rel_gap,
                      threads=opts.threads, random_seed=0, **extra)


def run_highs(prob: pulp.LpProblem, solver) -> tuple[str, object]:
    """Build and run the HiGHS model through PuLP's adapter, read the column values back
    ourselves (PuLP's own status table has no entry for HiGHS's node limit) -> (status, HiGHS
    info)."""
    with stdout_silenced():
        solver.createAndConfigureSolver(prob)
        solver.buildSolverModel(prob)
        with progress.interruptible() as flag:
            _watch(prob.solverModel, prob.name, flag)
            solver.callSolver(prob)
    h = prob.solverModel
    if h.getInfo().primal_solution_status == 2:
        values = h.getSolution().col_value
        for v in prob.variables():
            v.varValue = values[v.index]
    text = h.modelStatusToString(h.getModelStatus())
    return STATUS.get(text, text.lower().replace(" ", "_")), h.getInfo()


def _watch(h, label: str, flag) -> None:
    """Subscribe HiGHS's interrupt callbacks: stop when Ctrl-C was pressed (``flag``), and every
    few seconds of a long MILP note its nodes, incumbent and bound (``hetplan.progress``)."""
    ticker = progress.Ticker()

    def poll(e):
        if flag.requested:
            e.interrupt()
        elif e.callback_type == highspy.cb.HighsCallbackType.kCallbackMipInterrupt and ticker.due():
            d = e.data_out
            inc = f"{d.mip_primal_bound:.6g} ms" if abs(d.mip_primal_bound) < 1e300 else "none yet"
            progress.note(f"MILP {label}: {ticker.elapsed_s:.0f} s, {int(d.mip_node_count)} nodes, "
                          f"incumbent {inc}, bound {d.mip_dual_bound:.6g} ms")

    for event in (h.cbMipInterrupt, h.cbSimplexInterrupt, h.cbIpmInterrupt):
        event.subscribe(poll)


@contextlib.contextmanager
def stdout_silenced():
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


def gap(obj: float, bound: float) -> float:
    return max(0.0, (obj - bound) / obj) if obj > 0 else 0.0
