"""A cheap lower bound on a stage's seconds, so that the stage DP prices (solves) few stages.

A stage of layers ``[a, b)`` on a device reads the bytes and computes the FLOPs of its blocks
(the embedding when ``a == 0``, the head when ``b == n_layers``) in each phase. Whatever its
placement, it cannot beat the physical bound of ``hetplan.bounds.work_lower_bound_s`` on
those totals with the device's whole GPU budget as the resident cap (the stage's workspace and
KV left out: a larger cap only weakens the bound). Nor can it beat its *chain* bound: a
decode step (and a prompt prefilled in one chunk) is a chain, each stage of a block starting
after the one before it ends, so it takes at least the sum over its stages of the faster of
the stage's GPU and CPU times (an MoE stage, which may split its experts between the two
devices and run both halves at once, at least the least of its split times, the expected
durations the planner prices each split at; its physical bound where it has none). A prompt in several
chunks may overlap chunks on the two devices, so its prefill keeps the physical bound alone.
And a decode step of an MoE stage reads its routed experts' expected bytes (``wbytes``): HBM
holds at most ``cap / expert_bytes`` experts, so at least the expected bytes of all the others
(the coldest, when the hottest are resident) come from DRAM through the CPU or over the link,
``t >= cold / (bw_cpu + bw_h2d)`` (every MoE layer routed alike, as without a routing profile);
the MoE stages of the chain take at least that together, the other stages their own times
besides: ``t >= chain_dense + max(chain_moe, cold / (bw_cpu + bw_h2d))``.
Last, the bytes read that exist before the step (weights, a decode's cached keys and values:
``transient_bytes`` left out) beyond what HBM can hold of them are each either copied over the
link or read by the CPU while it computes with them (what a step writes and reads again, its
activations, may stay in HBM). HBM holds at most ``cap' = cap - workspace`` of them (a plan
that uses the GPU at all reserves the workspace; one that does not runs every stage on the CPU,
which costs at least as much as any choice below). So ``O = held - cap'`` bytes are off HBM,
``x`` of them read by the CPU and ``O - x`` over the link (``(O - x) / bw_h2d`` seconds); the
CPU reads stage ``i``'s ``h_i`` held bytes by running it, ``c_i`` seconds. In a chain phase
that time adds to the chain: ``t >= chain + sum c_i`` with ``c_i`` what the CPU costs beyond
the stage's fastest device (0 for an MoE stage, whose least split time the chain already
takes, and for a stage the CPU runs fastest); in a prefill of several chunks the CPU is one
resource, ``t >= sum c_i`` with ``c_i`` its CPU time (an MoE stage's, at least its held bytes
over the DRAM bandwidth). Relaxed to fractions of stages, the least ``t`` is a fractional
knapsack: the CPU takes stages by most held bytes per second first (``offload_s``; the rates
rounded up to a geometric grid, ``RATE_GRID``, which only lowers the bound, so that a range sums a
few classes of prefix sums). And each of
those ``O`` bytes is read out of DRAM, by the CPU or by the copy, so ``t >= O / C_dram``. Cruder but
sure for MoE stages (which the knapsack lets the CPU read free): ``t >= O / (bw_h2d + r)``, ``r``
the highest bytes-per-CPU-second of any stage in the range (a dense stage's ``bytes / cpu_s``; an
MoE stage's ``min(bw_cpu, peak_cpu * max(bytes / flops))`` over its experts, shared experts and
router, any of which may go to the CPU).
A step takes at least its chain and at least its link's busy time, so at least any weighted
mean of the two, ``t >= (1 - w) chain + w link`` (``w = LINK_WEIGHT``); charged to each block's
cheapest way of running, a streamed MoE block then costs its GPU time plus ``w / (1 - w)``
times its weights' load over the link, so that the least expert-split time (resident) is what
an MoE stage costs in the chain (the plain chain bound must allow it streamed at its GPU time).
A stage that cannot fit at all (``hetplan.diagnose.fits_at_all``: its weights, one KV cache
and the workspaces beyond the GPU and CPU budgets together) is bounded by ``inf``: no plan of it
exists. The totals come from prefix sums over one whole-model problem per kind of device, so a
bound costs a few additions. Knows nothing about how stages are chosen or solved.
"""

from __future__ import annotations

import math
from itertools import accumulate

from hetplan.bounds import work_lower_bound_s
from hetplan.cost import activation_bytes_per_elem
from hetplan.diagnose import room_bytes
from hetplan.hardware import HardwareSpec
from hetplan.model import ModelSpec
from hetplan.problem import build_problem
from hetplan.workload import Workload

PHASES = ("prefill", "decode")
LINK_WEIGHT = 0.01
"""``w`` of the weighted bound ``t >= (1 - w) chain + w link`` (module docstring)."""
RATE_GRID = 1.02
"""Ratio between neighbouring CPU rates (held bytes per second) the offload bound rounds up to."""
FIT_SLACK = 1e-9
"""Relative slack before a stage's bytes rule it out: they are summed in another order than
``fits_at_all`` sums them, which may round a few ulps apart."""
FREE = math.inf
"""The class of held bytes the CPU reads at no cost to the bound (an MoE stage in a chain, or a
stage the CPU runs fastest)."""


def transient_bytes(work, spec: ModelSpec) -> float:
    """Of the bytes ``work`` reads (``hetplan.cost``'s formulas), those its step writes first
    (activations in and out; all of a prefill attention's, which writes the prompt's keys and
    values; all of an embedding's, whose rows may repeat): the rest are weights and cached keys
    and values, which exist before the step and so take room in HBM or come from DRAM."""
    if work.op in ("attention_prefill", "embed"):
        return work.bytes
    if work.op == "attention_decode":
        return 0.0
    return min(work.bytes, 2.0 * work.tokens * spec.hidden * activation_bytes_per_elem(spec))


class StageBound:
    """``bound(a, b)`` -> (prefill seconds, decode seconds), each a lower bound for any plan of
    layers ``[a, b)`` on ``hw`` (a single-device machine)."""

    def __init__(self, spec: ModelSpec, hw: HardwareSpec, wl: Workload):
        problem = build_problem(spec, hw, wl)
        L = spec.n_layers
        position = {b.name: (0 if b.kind == "embed" else L + 1 if b.kind == "head" else b.layer + 1)
                    for b in problem.graph.blocks}
        self.spec, self.hw, self.n_layers = spec, hw, L
        self.cap = problem.gpu_budget_bytes
        self.room = room_bytes(problem)   # a stage's workspaces are the whole model's: by width, not layers
        self.resident = max(0.0, problem.gpu_budget_bytes - problem.gpu_workspace_bytes)
        self._seconds, self._least, self._rate = {}, {}, {}
        stored = [0.0] * (L + 2)   # weights and one KV cache per position
        for b in problem.blocks:
            stored[position[b.name]] += b.weight_bytes + b.kv_bytes
        self.stored = list(accumulate(stored, initial=0.0))
        self.prefix, self.offload, self.rate = {}, {}, {}
        cpu_bw = hw.cpu.mem_bytes_per_s * hw.efficiency["cpu_mem"]
        for phase in PHASES:
            nbytes, flops, chain, moe, priced, held = ([0.0] * (L + 2) for _ in range(6))
            chained = phase == "decode" or wl.n_chunks == 1
            by_rate: dict = {}   # rate class -> held bytes per position
            rate = [0.0] * (L + 2)
            for sc in problem.stages[phase]:
                st, at = sc.stage, position[sc.stage.block]
                h = st.work.bytes - transient_bytes(st.work, spec)
                nbytes[at] += st.work.bytes
                held[at] += h
                flops[at] += st.work.flops
                fastest = self._chain_s(sc, problem, phase)
                (moe if st.kind == "moe" else chain)[at] += fastest
                priced[at] += self._chain_s(sc, problem, phase, streamed_s=problem.load_s.get(st.block))
                rate[at] = max(rate[at], self._cpu_rate(sc, problem, phase))
                if h > 0:
                    cost = (0.0 if st.kind == "moe" else sc.cpu_s - fastest) if chained else \
                        (h / cpu_bw if st.kind == "moe" else sc.cpu_s)
                    by_rate.setdefault(_rate_class(h, cost), [0.0] * (L + 2))[at] += h
            self.rate[phase] = _range_max(rate)
            if not chained:
                chain, moe, priced = [0.0] * (L + 2), [0.0] * (L + 2), [0.0] * (L + 2)
            self.prefix[phase] = tuple(list(accumulate(x, initial=0.0))
                                       for x in (nbytes, flops, chain, moe, priced, held))
            self.offload[phase] = [(rate, list(accumulate(by_rate[rate], initial=0.0)))
                                   for rate in sorted(by_rate, reverse=True)]

        layers = problem.experts.get("decode", {})
        alike = len({(e.wbytes, e.expert_bytes) for e in layers.values()}) == 1
        self.moe = [0] * (L + 2)
        for name in layers if alike else ():
            self.moe[position[name]] += 1
        self.moe = list(accumulate(self.moe, initial=0))
        self.experts = next(iter(layers.values())) if alike else None
        self._cold: dict = {}

    def _chain_s(self, sc, problem, phase: str, streamed_s: float | None = None) -> float:
        """The least time stage ``sc`` can take on this device: the faster of GPU and CPU (the
        CPU alone on a machine without a GPU); an MoE stage with its experts split between the
        two at least its least split time (``ExpertLayer.split_times``, what the planner prices a
        resident MoE block at), else at least its physical bound."""
        fastest = min(sc.gpu_s, sc.cpu_s) if problem.has_gpu else sc.cpu_s
        if sc.stage.kind == "moe":
            layer = problem.experts.get(phase, {}).get(sc.stage.block)
            if layer is not None:  # its experts split between the devices: the least split time
                if streamed_s is not None:  # streamed, it computes on the GPU and loads over the link
                    fastest = min(sc.cpu_s, sc.gpu_s + LINK_WEIGHT / (1 - LINK_WEIGHT) * streamed_s)
                if id(layer) not in self._least:   # layers routed alike share one ExpertLayer
                    self._least[id(layer)] = min(layer.split_times)
                return min(fastest, self._least[id(layer)])
            work = sc.stage.work
            fastest = min(fastest, work_lower_bound_s(self.hw, self.spec, work.bytes, work.flops, self.cap,
                                                      work.bytes - transient_bytes(work, self.spec)))
        return fastest

    def _cpu_rate(self, sc, problem, phase: str) -> float:
        """The most bytes a second the CPU reads running (any part of) stage ``sc``."""
        st = sc.stage
        layer = problem.experts.get(phase, {}).get(st.block) if st.kind == "moe" else None
        if layer is None:
            return st.work.bytes / sc.cpu_s if sc.cpu_s > 0 else math.inf
        if id(layer) not in self._rate:   # layers routed alike share one ExpertLayer
            parts = [(w + 2 * r, f) for w, r, f in zip(layer.wbytes, layer.rows, layer.flops)]
            parts += [(layer.shared_bytes, layer.shared_flops), (layer.route_bytes, layer.route_flops)]
            ratio = max((b / f if f > 0 else math.inf) for b, f in parts if b > 0)
            self._rate[id(layer)] = min(layer.cpu.bytes_per_s, layer.cpu.flops_per_s * ratio)
        return self._rate[id(layer)]

    def overflow_s(self, phase: str, first: int, end: int, nbytes: float) -> float:
        """The held bytes beyond HBM's room over the link and the CPU together, the CPU at the range's
        highest rate ``r`` (module docstring)."""
        hw = self.hw
        if hw.gpu is None or nbytes <= self.resident:
            return 0.0
        return (nbytes - self.resident) / (hw.h2d_bytes_per_s * hw.efficiency["link"] + self.rate[phase][first][end])

    def offload_s(self, phase: str, first: int, end: int, base: float) -> float:
        """The least seconds a step of positions ``[first, end)`` takes with the held bytes beyond
        HBM's room read by the CPU or copied over the link (module docstring); ``base``: the
        chain's seconds with every stage on its fastest device (0 outside a chain)."""
        hw = self.hw
        held = self.prefix[phase][5]
        over = held[end] - held[first] - self.resident
        if hw.gpu is None or over <= 0:
            return 0.0
        classes = [(rate, sums[end] - sums[first]) for rate, sums in self.offload[phase]]
        dram = hw.cpu.mem_bytes_per_s * hw.efficiency["cpu_mem"]   # every such byte is read from DRAM
        return max(offload_s(over, hw.h2d_bytes_per_s * hw.efficiency["link"], base, classes), over / dram)

    def phase_s(self, phase: str, a: int, b: int) -> float:
        """Positions ``a+1 .. b`` are layers ``a .. b-1``; position 0 the embedding, L+1 the head."""
        first, end = (0 if a == 0 else a + 1), (b + 2 if b == self.n_layers else b + 1)
        nbytes, flops, chain, moe, priced, held = self.prefix[phase]
        cold = self.cold_experts_s(first, end) if phase == "decode" else 0.0
        weights = held[end] - held[first]
        return max(chain[end] - chain[first] + max(moe[end] - moe[first], cold),
                   (1 - LINK_WEIGHT) * (priced[end] - priced[first]),
                   work_lower_bound_s(self.hw, self.spec, nbytes[end] - nbytes[first], flops[end] - flops[first],
                                      self.cap, weights),
                   self.overflow_s(phase, first, end, weights),
                   self.offload_s(phase, first, end, chain[end] - chain[first] + moe[end] - moe[first]))

    def cold_experts_s(self, first: int, end: int) -> float:
        """Decode: the expected bytes of the experts HBM cannot hold, over DRAM and the link."""
        e, hw = self.experts, self.hw
        if e is None or hw.gpu is None:
            return 0.0
        eff = hw.efficiency
        return self._cold_bytes(self.moe[end] - self.moe[first]) / (hw.cpu.mem_bytes_per_s * eff["cpu_mem"]
                                                                    + hw.h2d_bytes_per_s * eff["link"])

    def _cold_bytes(self, n_moe: int) -> float:
        """Expected bytes of the experts ``n_moe`` alike layers leave out of HBM when it holds the
        hottest rank of each layer first, then the next, ... (cached per ``n_moe``)."""
        if n_moe in self._cold:
            return self._cold[n_moe]
        e = self.experts
        cold, left = 0.0, int(self.cap // e.expert_bytes) if e.expert_bytes > 0 else 0
        for w in sorted(e.wbytes, reverse=True):
            resident = min(n_moe, left)
            left -= resident
            cold += (n_moe - resident) * w
        self._cold[n_moe] = cold
        return cold

    def __call__(self, a: int, b: int) -> tuple:
        """(prefill, decode) seconds of layers ``[a, b)``, each computed once (the stage DP asks
        for every range on every device of a kind)."""
        key = (a, b)
        if key not in self._seconds:
            first, end = (0 if a == 0 else a + 1), (b + 2 if b == self.n_layers else b + 1)
            if self.stored[end] - self.stored[first] > self.room + FIT_SLACK * abs(self.room):
                self._seconds[key] = math.inf, math.inf
            else:
                self._seconds[key] = self.phase_s("prefill", a, b), self.phase_s("decode", a, b)
        return self._seconds[key]


def _rate_class(nbytes: float, seconds: float) -> float:
    """``nbytes / seconds`` rounded up to the next power of ``RATE_GRID`` (``FREE`` at no cost)."""
    if seconds <= 0:
        return FREE
    return RATE_GRID ** math.ceil(math.log(nbytes / seconds, RATE_GRID))


def offload_s(over: float, link: float, base: float, classes: list) -> float:
    """The least ``t >= base`` at which ``over`` bytes leave HBM: the link carries ``link * t``
    and the CPU, with ``t - base`` seconds, reads ``classes`` ((bytes per second, bytes), in
    decreasing rate, ``FREE`` first) whole or in part in that order. The bytes placed by ``t``
    rise piecewise linearly; the answer is where they reach ``over``."""
    room = over - sum(nbytes for rate, nbytes in classes if rate == FREE)
    spent = 0.0   # CPU seconds of the classes taken whole so far
    if room <= link * base:
        return base
    for rate, nbytes in classes:
        if rate == FREE or nbytes <= 0:
            continue
        if link * (base + spent + nbytes / rate) + nbytes >= room:   # reached within this class
            return (room + rate * (base + spent)) / (link + rate)
        room -= nbytes
        spent += nbytes / rate
    return max(base + spent, room / link)


def _range_max(values: list) -> list:
    """``out[i][j]`` = max of ``values[i:j]`` (0 when empty), every ``i <= j``."""
    out = []
    for i in range(len(values) + 1):
        row, m = [0.0] * (len(values) + 1), 0.0
        for j in range(i, len(values)):
            m = max(m, values[j])
            row[j + 1] = m
        out.append(row)
    return out
