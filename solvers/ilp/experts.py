"""Expert-level decisions of the placement MILP: how many routed experts of each MoE block live
in HBM, and what the split costs in time and memory (``hetplan.experts`` states the formulas).

The split's duration is an expectation over the routing distribution (``hetplan.expected_split``),
a nonlinear function of the hot count, so the MILP indexes it as a table. Per MoE block b with
E routed experts (hottest first) and its residence binary r_b:
  y_bn     binary, n = 0 .. E: block b resident with exactly its n hottest experts in HBM
               sum_n y_bn = r_b                                    (one hot count when resident)
  v_bnp    binary, n in [E - fit, E - 1] (where ``stream_can_pay``): in phase p its E - n cold
           experts are streamed into the staging slot and run on the GPU,   v_bnp <= y_bn
The block's end time in phase p, HBM bytes and streamed load are then linear:
  E_b = S_b + base_bp + MS (sum_n t_split(n) (y_bn - v_bnp) + sum_n t_all v_bnp)
  HBM_b = D_b r_b + W_e sum_n n y_bn,        load_bp = MS sum_n t_h2d((E - n) W_e) v_bnp
where base_bp is the whole-block time in the other modes (t_cpu c_bp + t_gpu s_bp), t_split(n)
the expected split time with n hot experts and t_all = t_route + E[GPU part with all E]. The
table is exact at every integral point, and its LP relaxation is the convex hull of each
block's (time, bytes) points.
"""

from __future__ import annotations

import pulp

from hetplan.solvers.ilp.objective import MS


class ExpertVars:
    """The hot-count variables of every MoE block and their linking constraints."""

    def __init__(self, prob, problem, r, slot_bytes: float | None = None, depth: int = 1):
        """``slot_bytes``: the configuration's fixed staging slot; cold experts that fit in it
        may be streamed (a phase's ``v``) where that can pay (``stream_can_pay``), none when
        None. ``depth``: the configuration's staging depth."""
        self.prob, self.problem, self.r, self.depth = prob, problem, r, depth
        self.layers = problem.experts.get("decode", {})
        self.y, self.v = {}, {}
        for b, x in self.layers.items():
            e = x.n_experts
            for n in range(e + 1):
                self.y[b, n] = pulp.LpVariable(f"y_hot_{b}_{n}", cat="Binary")
            prob += pulp.lpSum(self.y[b, n] for n in range(e + 1)) == r[b], f"one_hot_count_{b}"
            fit = int((slot_bytes or 0.0) // x.expert_bytes)
            if fit and slot_bytes:
                self._streamed_cold(b, x, min(fit, e))

    def _streamed_cold(self, b, x, fit: int):
        """v_bnp: block b's E - n cold experts (all of them, at most ``fit``) streamed into the
        slot in phase p, then computed on the GPU:   v_bnp <= y_bn."""
        for p in ("prefill", "decode"):
            if not stream_can_pay(self.problem, p, b, fit, self.depth):
                continue
            for n in range(max(0, x.n_experts - fit), x.n_experts):
                v = pulp.LpVariable(f"v_cold_{b}_{n}_{p}", cat="Binary")
                self.v[b, n, p] = v
                self.prob += v <= self.y[b, n], f"stream_needs_count_{b}_{n}_{p}"

    def _streams(self, b, p) -> list:
        """[(n, v_bnp)] of block b in phase p (none for a block that is not MoE)."""
        if b not in self.layers:
            return []
        return [(n, self.v[b, n, p]) for n in range(self.layers[b].n_experts) if (b, n, p) in self.v]

    def streamed(self, b, p) -> bool:
        return bool(self._streams(b, p))

    def load_ms(self, p, b):
        """h2d time (ms) of block b's streamed cold experts in phase p: sum_n t_h2d((E - n) W_e) v_bnp."""
        x = self.problem.experts[p][b]
        return MS * pulp.lpSum(x.h2d.seconds(0.0, (x.n_experts - n) * x.expert_bytes) * v
                               for n, v in self._streams(b, p))

    def n(self, b):
        return pulp.lpSum(n * self.y[b, n] for n in range(self.layers[b].n_experts + 1))

    def resident_units(self, b, unit: float):
        """HBM bytes (in ``unit``) of MoE block b's weights: dense part if resident + hot experts."""
        x = self.layers[b]
        return (x.dense_bytes / unit) * self.r[b] + (x.expert_bytes / unit) * self.n(b)

    def end(self, p, b, start, base):
        """E_b of MoE block b in phase p (an affine expression), given its start and its time
        ``base`` in the whole-block modes (an affine expression in ms)."""
        x = self.problem.experts[p][b]
        split = x.split_times
        streams = self._streams(b, p)
        every = split[x.n_experts]  # all experts on the GPU: the streamed phase's time
        return start + base + MS * (pulp.lpSum(split[n] * self.y[b, n] for n in range(x.n_experts + 1))
                                    + pulp.lpSum((every - split[n]) * v for n, v in streams))

    def bus_bytes(self, p, b) -> dict:
        """bus -> bytes (an affine expression) the expert split of block b moves in phase p:
        sum_n B_x(n) (y_bn - v_bnp) + B_x(E) sum_n v_bnp (``split_bus_bytes``; 0 when not
        resident)."""
        x = self.problem.experts[p][b]
        e = x.n_experts
        every = split_bus_bytes(x, e)
        streams = self._streams(b, p)
        out = {}
        for bus in ("dram", "hbm"):
            terms = [(self.y[b, n], split_bus_bytes(x, n)[bus]) for n in range(e + 1)]
            terms += [(v, every[bus] - split_bus_bytes(x, n)[bus]) for n, v in streams]
            out[bus] = pulp.LpAffineExpression([(v, c) for v, c in terms if c])
        return out

    def min_split_s(self, p, b) -> float:
        """Least duration of block b resident on the GPU over every expert count."""
        return min(self.problem.experts[p][b].split_times)

    def max_split_s(self, p, b) -> float:
        return max(self.problem.experts[p][b].split_times)

    def streams_cold(self, b, p) -> bool:
        return any((v.value() or 0.0) > 0.5 for _, v in self._streams(b, p))

    def hot_count(self, b) -> int:
        return next((n for n in range(self.layers[b].n_experts + 1) if (self.y[b, n].value() or 0.0) > 0.5), 0)


def split_bus_bytes(x, n: int) -> dict:
    """bus -> bytes the expert split of ``x`` (an ``ExpertLayer``) with ``n`` experts on the
    GPU moves over it (``schedule._split_tasks``' tasks by resource, ``hetplan.buses``): the
    router, the hot experts and the merge on HBM, the cold experts on DRAM, their rows copied
    down and up over both:
        hbm  = B_route + B_hot(n) + [n < E] (B_merge(n) + rows_down(n) + rows_up(n))
        dram = [n < E] (B_cold(n) + rows_down(n) + rows_up(n))
    (n = E: every expert on the GPU, also the split of a block whose cold experts are streamed).
    All three formulations (per-block MILP, chain DP, count MILP) count these bytes in their
    bus rows, so they are one model."""
    hbm = x.route_work()[1] + x.hot_work(n)[1]
    if n >= x.n_experts:
        return {"dram": 0.0, "hbm": hbm}
    rows = x.down_bytes(n) + x.up_bytes(n)
    return {"dram": x.cold_work(n)[1] + rows, "hbm": hbm + x.merge_bytes(n) + rows}


def stream_can_pay(problem, p, b, fit: int, depth: int) -> bool:
    """False when streaming block b's cold experts in phase p is dominated for every count
    it could stream: the load is issued when block b - 1 starts (depth 2) or ends (depth 1),
    so with depth 2 it hides at most behind block b - 1 (every stage at its slower device,
    plus its copies) and with depth 1 behind nothing; if for each n in [E - fit, E - 1]
        t_load(E - n) + t_route + t_hot(E)  >=  hide + t_split(n),
    running the cold experts on the CPU ends block b no later, adds no load to the h2d
    queue and needs no more memory, so no plan is lost by leaving the option out."""
    x = problem.experts[p][b]
    names = [blk.name for blk in problem.blocks]
    hide = 0.0
    if depth >= 2:
        prev = names[names.index(b) - 1]
        hide = sum(max(c.gpu_s, c.cpu_s) + c.up_s + c.down_s
                   for c in problem.stages[p] if c.stage.block == prev)
    split = x.split_times
    streamed = x.route_s() + x.hot_s(x.n_experts)
    e = x.n_experts
    return any(x.h2d.seconds(0.0, (e - n) * x.expert_bytes) + streamed < hide + split[n]
               for n in range(max(0, e - fit), e))
