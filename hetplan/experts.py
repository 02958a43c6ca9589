"""Expert-level costs of an MoE layer: what the GPU part and the CPU part cost for any split.

An MoE block resident on the GPU (weights ``gpu``) keeps its router, norm and shared experts in
HBM together with its ``n`` *hot* routed experts (the most frequently chosen first, by the
routing profile; uniform without one); the other ``E - n`` *cold* experts stay in DRAM and run on
the CPU. In a phase its tasks are::

    gpu:      moe_route ─┬─ moe_experts (shared + hot experts) ──────────── moe_merge
    d2h_act:             └─ act_down ─ cpu: moe_cold ─ h2d_act: act_up ─┘

``moe_route`` computes the norm and the router and gathers the rows of the (token, cold expert)
pairs; only those rows cross PCIe, and only their gate-weighted outputs come back, where
``moe_merge`` adds them into the residual. With ``n = E`` the block runs ``moe_route`` and
``moe_experts`` only. In a phase whose exec is ``stream`` (worth it for long prefills) the cold
experts are instead loaded into a staging slot (an h2d ``load`` of their bytes) and the block
runs ``moe_route`` and ``moe_experts`` over all E experts. A block streamed whole or computed on
the CPU runs as one ``moe`` stage.

Per expert ``j`` (routing fraction ``f_j`` = share of tokens that choose it, sum = top-k) and
``T`` tokens in the phase, with every token choosing independently:

    flops_j = 2 T f_j P_e            (P_e = params of one expert)
    hit_j   = 1 - (1 - f_j)^T        (probability the batch touches expert j at all)
    wbytes_j = hit_j W_e             (W_e = bytes of one expert's weights as held: ``ModelSpec.expert_read_bytes``)
    rows_j  = T f_j D a              (the pair rows of expert j: hidden D, activation bytes a)

Expected work per task (the FLOPs and bytes a task records):

GPU part  = (F_sh + sum_hot flops_j, B_sh + sum_hot (wbytes_j + 2 rows_j)) on the GPU
CPU part  = (sum_cold flops_j, sum_cold (wbytes_j + 2 rows_j)) on the CPU
copies    = d2h of sum_cold (rows_j + 8 T f_j)  (rows, token index and gate),
            h2d of sum_cold rows_j
merge     = roofline(0, 2 T D a + sum_cold rows_j) on the GPU

The GPU side runs its n hot experts one of two sync-free ways (``runtime/models/moe/``):
*gathered* when its experts are dense (16/32-bit; packed ones are always masked) and
``gathers(T, k, n)``, i.e. GATHER_PASSES T k < n (a decode step over many hot
experts), every one of the T k (token, choice) pairs gathers its expert's weights (the pairs
of cold experts a clamped hot one, weighted 0) and multiplies them batched; otherwise *masked*,
each hot expert on all T tokens. The gather reads the T k chosen experts from the stack, writes
them and the batched product reads them again, so in the gathered regime the hot side's weight
bytes are the same whichever experts are hit:

    gathered weight bytes = GATHER_PASSES T k W_e      (in place of sum_hot wbytes_j)

Times are expectations over which experts the tokens hit (``hetplan.expected_split``): the GPU
and CPU parts are E[roofline] and the block costs E[route + max(GPU part, CPU part + copies) +
merge], which exceeds the makespan of the expected work when a side runs whole experts or
none. The merge task carries the difference (``wait_s``), so the task DAG's makespan is the
expectation. The MILPs take the block time as a table over the hot count n (``split_times``).
Pure numbers; no solver, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

from hetplan import cost
from hetplan.dtypes import QUANTISED, compute_dtype
from hetplan.expected_split import SplitExpectation, SplitTable, split_table
from hetplan.hardware import HardwareSpec
from hetplan.model import ModelSpec

INDEX_BYTES = 8
"""Per (token, cold expert) pair sent down besides its row: the token index and the gate (4 + 4)."""
GATHER_PASSES = 3
"""Times a gathered expert's weights cross HBM: read from the stack, written gathered, read by the GEMM."""


def gathers(tokens: int, k: int, n: int) -> bool:
    """The GPU side gathers the chosen experts' weights (rather than running each of its ``n``
    experts on every token) when that moves fewer weight bytes: GATHER_PASSES * T * k < n."""
    return GATHER_PASSES * tokens * k < n


@dataclass(frozen=True)
class Roofline:
    """A device's achievable rates: t = max(flops / flops_per_s, bytes / bytes_per_s) + latency."""
    flops_per_s: float
    bytes_per_s: float
    latency_s: float

    def seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s) + self.latency_s


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE block's experts in rank order (hottest first), for one phase."""
    ranked: tuple
    """Expert ids, most frequently chosen first (ties: lower id first)."""
    fraction: tuple
    """Routing fraction per ranked expert (sums to top-k)."""
    expert_bytes: float
    """Bytes of one routed expert's weights."""
    dense_bytes: float
    """Bytes of the block's other weights: norm, router, shared experts."""
    tokens: int
    top_k: int
    """Experts each token chooses (k)."""
    dense_experts: bool
    """The experts are held as 16/32-bit tensors (not packed), so the GPU side may gather them."""
    flops: tuple
    """Per ranked expert: its FLOPs in this phase."""
    wbytes: tuple
    """Per ranked expert: expected weight bytes read (hit probability * expert bytes)."""
    rows: tuple
    """Per ranked expert: bytes of its (token, expert) pair rows."""
    route_flops: float
    route_bytes: float
    shared_flops: float
    shared_bytes: float
    """Shared experts' weights plus the block's input and output activations."""
    act_bytes: float
    """T * D * a: one copy of the phase's hidden states."""
    expert_read_bytes: float
    """Weight bytes a hit expert reads (P_e * bytes per parameter)."""
    pair_flops: float
    """FLOPs of one (token, expert) pair: 2 P_e."""
    row_bytes: float
    """Bytes of one pair's row: D a."""
    gpu: Roofline
    cpu: Roofline
    d2h: Roofline
    h2d: Roofline

    @property
    def n_experts(self) -> int:
        return len(self.ranked)

    # -- task work (flops, bytes) and seconds for n hot experts -----------------------------
    @cached_property
    def _first(self) -> dict:
        """Sums over the n hottest experts, for n = 0 .. E: name -> [sum of the first n]."""
        return {name: (0.0, *accumulate(getattr(self, name)))
                for name in ("flops", "wbytes", "rows", "fraction")}

    def _hot_sum(self, name: str, n: int) -> float:
        return self._first[name][n]

    def _cold_sum(self, name: str, n: int) -> float:
        total = self._first[name]
        return total[-1] - total[n]

    def route_work(self) -> tuple[float, float]:
        return self.route_flops, self.route_bytes

    def gathered(self, n: int) -> bool:
        """The GPU side gathers its n hot experts (``gathers``; packed experts never do)."""
        return self.dense_experts and gathers(self.tokens, self.top_k, n)

    @property
    def gather_bytes(self) -> float:
        """GATHER_PASSES T k W_e: the weight bytes the gathered GPU side moves."""
        return GATHER_PASSES * self.tokens * self.top_k * self.expert_read_bytes

    def hot_read_bytes(self, n: int, hits):
        """Weight bytes the GPU side reads for its n hot experts when ``hits`` of them are hit
        (a number or an array): ``gather_bytes`` where ``gathers``, else hits W_e."""
        return self.gather_bytes if self.gathered(n) else hits * self.expert_read_bytes

    def hot_work(self, n: int) -> tuple[float, float]:
        weights = self.gather_bytes if self.gathered(n) else self._hot_sum("wbytes", n)
        return (self.shared_flops + self._hot_sum("flops", n),
                self.shared_bytes + weights + 2 * self._hot_sum("rows", n))

    def cold_work(self, n: int) -> tuple[float, float]:
        return self._cold_sum("flops", n), self._cold_sum("wbytes", n) + 2 * self._cold_sum("rows", n)

    def down_bytes(self, n: int) -> float:
        return self._cold_sum("rows", n) + INDEX_BYTES * self.tokens * self._cold_sum("fraction", n)

    def up_bytes(self, n: int) -> float:
        return self._cold_sum("rows", n)

    def merge_bytes(self, n: int) -> float:
        return 2 * self.act_bytes + self._cold_sum("rows", n)

    def route_s(self) -> float:
        return self.gpu.seconds(*self.route_work())

    @cached_property
    def table(self) -> SplitTable:
        """Expected task and block times over the routing distribution, per hot count, computed
        as asked (``hetplan.expected_split``)."""
        return split_table(self, INDEX_BYTES)

    @cached_property
    def expected(self) -> SplitExpectation:
        """The whole table, every hot count."""
        return SplitExpectation(*(tuple(col) for col in zip(*(self.table.at(n) for n in range(self.n_experts + 1)))))

    def hot_s(self, n: int) -> float:
        """E[GPU side]: the roofline of the hot experts the tokens hit, in expectation."""
        return self.table.at(n)[0]

    def cold_s(self, n: int) -> float:
        """E[CPU compute] of the cold experts the tokens hit."""
        return self.table.at(n)[1]

    def wait_s(self, n: int) -> float:
        """E[max(GPU side, CPU side)] - max of their expectations: the merge waits that much
        longer on average than the expected sides say (``hetplan.expected_split``)."""
        return self.table.at(n)[2]

    def down_s(self, n: int) -> float:
        return self.d2h.seconds(0.0, self.down_bytes(n))

    def up_s(self, n: int) -> float:
        return self.h2d.seconds(0.0, self.up_bytes(n))

    def merge_s(self, n: int) -> float:
        return self.gpu.seconds(0.0, self.merge_bytes(n))

    def split_s(self, n: int) -> float:
        """The block's expected duration with n hot experts: route, then E[max(GPU part, CPU
        part and its copies)], then the merge (none when n = E)."""
        return self.table.at(min(n, self.n_experts))[3]

    @property
    def split_times(self) -> tuple:
        """``split_s(n)`` for n = 0 .. E: the table the MILPs index by hot count."""
        return self.expected.split_s


def rooflines(spec: ModelSpec, hw: HardwareSpec) -> dict:
    """The achievable rates the expert costs use (same formulas as ``hetplan.cost``)."""
    eff, lat = hw.efficiency, hw.latency_s
    cpu_dtype = "fp32" if spec.weight_dtype == "fp32" else "bf16"
    out = {"cpu": Roofline(hw.cpu.peak_flops(cpu_dtype) * eff["cpu_flops"], hw.cpu.mem_bytes_per_s * eff["cpu_mem"],
                           lat["cpu_task"])}
    if hw.gpu is not None:
        out["gpu"] = Roofline(hw.gpu.peak_flops(compute_dtype(spec.weight_dtype)) * eff["gpu_flops"],
                              hw.gpu.mem_bytes_per_s * eff["gpu_mem"], lat["gpu_task"])
        out["h2d"] = Roofline(1.0, hw.h2d_bytes_per_s * eff["link"], lat["link_task"])
        out["d2h"] = Roofline(1.0, hw.d2h_bytes_per_s * eff["link"], lat["link_task"])
    return out


def expert_layer(spec: ModelSpec, hw: HardwareSpec, tokens: int, fractions: tuple) -> ExpertLayer:
    """The expert costs of one MoE layer in a phase of ``tokens`` tokens, for routing
    ``fractions`` (per expert id; see ``hetplan.routing``). Needs a GPU on ``hw``."""
    wb, a, d = spec.weight_bytes_per_param, cost.activation_bytes_per_elem(spec), spec.hidden
    ranked = tuple(sorted(range(len(fractions)), key=lambda e: (-fractions[e], e)))
    f = tuple(float(fractions[e]) for e in ranked)
    p_e, w_e = spec.expert_params(), spec.expert_read_bytes()
    rates = rooflines(spec, hw)
    shared_params = spec.n_shared_experts * p_e
    return ExpertLayer(
        ranked=ranked, fraction=f, expert_bytes=spec.expert_bytes(),
        dense_bytes=spec.block_weight_bytes("moe", spec.first_dense_layers) - spec.n_experts * spec.expert_bytes(),
        tokens=tokens, top_k=spec.experts_per_token,
        dense_experts=spec.weight_dtype not in QUANTISED and "expert" not in spec.block_bytes,
        flops=tuple(2.0 * tokens * x * p_e for x in f),
        wbytes=tuple((1.0 - (1.0 - min(x, 1.0)) ** tokens) * w_e for x in f),
        rows=tuple(tokens * x * d * a for x in f),
        route_flops=2.0 * tokens * d * spec.n_experts,
        route_bytes=(d * spec.n_experts + d) * wb + 2.0 * tokens * d * a,
        shared_flops=2.0 * tokens * shared_params,
        shared_bytes=shared_params * wb + 2.0 * tokens * d * a,
        act_bytes=tokens * d * a,
        expert_read_bytes=w_e, pair_flops=2.0 * p_e, row_bytes=d * a,
        gpu=rates["gpu"], cpu=rates["cpu"], d2h=rates["d2h"], h2d=rates["h2d"])


def uniform_fractions(spec: ModelSpec) -> tuple:
    return (spec.experts_per_token / spec.n_experts,) * spec.n_experts
