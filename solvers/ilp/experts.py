"""Expert-level decisions of the placement MILP: how many routed experts of each MoE block live
in HBM, and what the split costs in time and memory (``hetplan.experts`` states the formulas).

Notation, per MoE block b (experts ranked hottest first and cut into classes of equal routing
fraction; within a class experts are interchangeable):
  m_bc     integer in [0, |c|]: hot experts of class c            n_b = sum_c m_bc
  z_bc     binary: class c is all hot (a colder class may have hot experts only then):
               m_bc >= |c| z_bc,   m_b(c+1) <= |c+1| z_bc          (z_bc = m_bc when |c| = 1)
  q_b      binary: some expert of a GPU-resident block stays cold:
               q_b <= r_b,   n_b + q_b <= E,   n_b >= E (r_b - q_b),   m_bc <= |c| r_b
Every per-expert quantity (FLOPs, weight bytes read, pair rows) enters as sum_c v_c m_bc for the
hot side and sum_c v_c (|c| r_b - m_bc) for the cold side, so both rooflines are maxima of linear
functions and the block's end time is exact at every integral point:
  H_bp >= MS (l_g r_b + F_sh r_b + sum_c F_c m_bc),  H_bp >= MS (l_g r_b + B_sh r_b + sum_c B_c m_bc)
  K_bp >= MS (l_cold q_b + sum_c (dn_c + up_c + F'_c) cold_bc),  likewise with B'_c
  E_b  >= S_b + base_bp + MS (t_route r_b + merge_bp) + H_bp   and   ... + K_bp
where base_bp is the whole-block time in the other modes (t_cpu c_bp + t_gpu s_bp),
l_cold = the CPU task's and both copies' latencies, and merge_bp = (l_g + 2 T D a / bw_g) q_b
+ sum_c rows_c / bw_g cold_bc. The MILP minimises, so E_b, H_bp and K_bp sit on their maxima.
"""

from __future__ import annotations

import pulp

from hetplan.experts import INDEX_BYTES
from hetplan.solvers.ilp.objective import MS


class ExpertVars:
    """The expert-count variables of every MoE block and their linking constraints."""

    def __init__(self, prob, problem, r, slot_bytes: float | None = None, depth: int = 1):
        """``slot_bytes``: the configuration's fixed staging slot; cold experts that fit in it
        may be streamed (a phase's ``u``) where that can pay (``_stream_can_pay``), none when
        None. ``depth``: the configuration's staging depth."""
        self.prob, self.problem, self.r, self.depth = prob, problem, r, depth
        self.layers = problem.experts.get("decode", {})
        self.m, self.classes, self.cold = {}, {}, {}
        self.u, self.w = {}, {}
        for b, x in self.layers.items():
            classes = x.classes()
            self.classes[b] = classes
            for i, (_, size) in enumerate(classes):
                v = pulp.LpVariable(f"m_{b}_{i}", lowBound=0, upBound=size,
                                    cat="Binary" if size == 1 else "Integer")
                self.m[b, i] = v
                prob += v <= size * r[b], f"hot_needs_resident_{b}_{i}"
            for i in range(len(classes) - 1):
                size, nxt = classes[i][1], classes[i + 1][1]
                if size == 1:
                    full = self.m[b, i]
                else:
                    full = pulp.LpVariable(f"zfull_{b}_{i}", cat="Binary")
                    prob += self.m[b, i] >= size * full, f"class_full_{b}_{i}"
                prob += self.m[b, i + 1] <= nxt * full, f"hottest_first_{b}_{i}"
            q = pulp.LpVariable(f"q_cold_{b}", cat="Binary")
            self.cold[b] = q
            e = x.n_experts
            n = self.n(b)
            prob += q <= r[b], f"cold_needs_resident_{b}"
            prob += n + q <= e, f"cold_means_fewer_{b}"
            prob += n >= e * (r[b] - q), f"no_cold_means_all_{b}"
            fit = int((slot_bytes or 0.0) // x.expert_bytes)
            if fit and slot_bytes:
                self._streamed_cold(b, x, n, q, min(fit, e))

    def _streamed_cold(self, b, x, n, q, fit: int):
        """u_bp: block b's cold experts streamed into the slot in phase p (all of them, at most
        ``fit``), then computed on the GPU; w_bcp = u_bp * cold_bc (exact for binary u):
            u_bp <= q_b,   n_b >= (E - fit) u_bp,
            w_bcp <= |c| u_bp,   w_bcp <= cold_bc,   w_bcp >= cold_bc - |c| (1 - u_bp)."""
        prob = self.prob
        for p in ("prefill", "decode"):
            if not self._stream_can_pay(p, b, fit):
                continue
            u = pulp.LpVariable(f"u_cold_{b}_{p}", cat="Binary")
            self.u[b, p] = u
            prob += u <= q, f"stream_needs_cold_{b}_{p}"
            prob += n >= (x.n_experts - fit) * u, f"cold_fits_slot_{b}_{p}"
            for i, (_, size) in enumerate(self.classes[b]):
                w = pulp.LpVariable(f"w_cold_{b}_{i}_{p}", lowBound=0)
                self.w[b, i, p] = w
                prob += w <= size * u, f"w_needs_u_{b}_{i}_{p}"
                prob += w <= self._cold(b, i), f"w_at_most_cold_{b}_{i}_{p}"
                prob += w >= self._cold(b, i) - size * (1 - u), f"w_all_cold_{b}_{i}_{p}"

    def _stream_can_pay(self, p, b, fit: int) -> bool:
        """False when streaming block b's cold experts in phase p is dominated for every count
        it could stream: the load is issued when block b - 1 starts (depth 2) or ends (depth 1),
        so with depth 2 it hides at most behind block b - 1 (every stage at its slower device,
        plus its copies) and with depth 1 behind nothing; if for each n in [E - fit, E - 1]
            t_load(E - n) + t_route + t_hot(E)  >=  hide + t_split(n),
        running the cold experts on the CPU ends block b no later, adds no load to the h2d
        queue and needs no more memory, so no plan is lost by leaving the option out."""
        x = self.problem.experts[p][b]
        names = [blk.name for blk in self.problem.blocks]
        hide = 0.0
        if self.depth >= 2:
            prev = names[names.index(b) - 1]
            hide = sum(max(c.gpu_s, c.cpu_s) + c.up_s + c.down_s
                       for c in self.problem.stages[p] if c.stage.block == prev)
        split = x.split_times
        streamed = x.route_s() + x.hot_s(x.n_experts)
        e = x.n_experts
        return any(x.h2d.seconds(0.0, (e - n) * x.expert_bytes) + streamed < hide + split[n]
                   for n in range(max(0, e - fit), e))

    def streamed(self, b, p) -> bool:
        return (b, p) in self.u

    def load_ms(self, p, b):
        """h2d time (ms) of block b's streamed cold experts in phase p: l_link u + W_e / bw * sum_c w."""
        x = self.problem.experts[p][b]
        return MS * (x.h2d.latency_s * self.u[b, p] + (x.expert_bytes / x.h2d.bytes_per_s) * pulp.lpSum(
            self.w[b, i, p] for i in range(len(self.classes[b]))))

    def n(self, b):
        return pulp.lpSum(self.m[b, i] for i in range(len(self.classes[b])))

    def resident_units(self, b, unit: float):
        """HBM bytes (in ``unit``) of MoE block b's weights: dense part if resident + hot experts."""
        x = self.layers[b]
        return (x.dense_bytes / unit) * self.r[b] + (x.expert_bytes / unit) * self.n(b)

    def _cold(self, b, i):
        return self.classes[b][i][1] * self.r[b] - self.m[b, i]

    def end(self, p, b, start, base):
        """E_b of MoE block b in phase p (a variable), given its start and its time ``base`` in
        the whole-block modes (an affine expression in ms)."""
        x, r, q, prob = self.problem.experts[p][b], self.r[b], self.cold[b], self.prob
        cls = self.classes[b]
        per = lambda vals, i: vals[cls[i][0]]  # noqa: E731 - a class's per-expert value
        g, c = x.gpu, x.cpu
        # experts on the GPU in this phase: hot, plus cold ones streamed; cold ones on the CPU
        streamed = {i: self.w[b, i, p] if (b, p) in self.u else 0 for i in range(len(cls))}
        on_gpu = {i: self.m[b, i] + streamed[i] for i in range(len(cls))}
        on_cpu = {i: self._cold(b, i) - streamed[i] for i in range(len(cls))}
        cpu_side = q - self.u[b, p] if (b, p) in self.u else q
        hot = pulp.LpVariable(f"Hot_{p}_{b}", lowBound=0)
        prob += hot >= MS * (g.latency_s * r + (x.shared_flops / g.flops_per_s) * r + pulp.lpSum(
            (per(x.flops, i) / g.flops_per_s) * on_gpu[i] for i in range(len(cls)))), f"hot_flops_{p}_{b}"
        prob += hot >= MS * (g.latency_s * r + (x.shared_bytes / g.bytes_per_s) * r + pulp.lpSum(
            ((per(x.wbytes, i) + 2 * per(x.rows, i)) / g.bytes_per_s) * on_gpu[i]
            for i in range(len(cls)))), f"hot_bytes_{p}_{b}"
        copies = lambda i: (per(x.rows, i) + INDEX_BYTES * x.tokens * per(x.fraction, i)) / x.d2h.bytes_per_s \
            + per(x.rows, i) / x.h2d.bytes_per_s  # noqa: E731
        lat = c.latency_s + x.d2h.latency_s + x.h2d.latency_s
        coldt = pulp.LpVariable(f"Cold_{p}_{b}", lowBound=0)
        prob += coldt >= MS * (lat * cpu_side + pulp.lpSum(
            (copies(i) + per(x.flops, i) / c.flops_per_s) * on_cpu[i] for i in range(len(cls)))), \
            f"cold_flops_{p}_{b}"
        prob += coldt >= MS * (lat * cpu_side + pulp.lpSum(
            (copies(i) + (per(x.wbytes, i) + 2 * per(x.rows, i)) / c.bytes_per_s) * on_cpu[i]
            for i in range(len(cls)))), f"cold_bytes_{p}_{b}"
        merge = (g.latency_s + 2 * x.act_bytes / g.bytes_per_s) * cpu_side + pulp.lpSum(
            (per(x.rows, i) / g.bytes_per_s) * on_cpu[i] for i in range(len(cls)))
        end = pulp.LpVariable(f"E_{p}_{b}", lowBound=0)
        fixed = start + base + MS * (x.route_s() * r + merge)
        prob += end >= fixed + hot, f"end_gpu_side_{p}_{b}"
        prob += end >= fixed + coldt, f"end_cpu_side_{p}_{b}"
        return end

    def min_split_s(self, p, b) -> float:
        """Least duration of block b resident on the GPU over every expert count."""
        return min(self.problem.experts[p][b].split_times)

    def max_split_s(self, p, b) -> float:
        return max(self.problem.experts[p][b].split_times)

    def streams_cold(self, b, p) -> bool:
        return (b, p) in self.u and (self.u[b, p].value() or 0.0) > 0.5

    def hot_count(self, b) -> int:
        return int(round(sum((self.m[b, i].value() or 0.0) for i in range(len(self.classes[b])))))

