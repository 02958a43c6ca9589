"""The expected duration of an MoE expert split over the routing distribution.

A split block with n hot experts ends, after its router, when the later of its two sides is
done (``hetplan.experts`` names the tasks)::

    M(n) = t_route + max(H, C) + merge,     H = GPU side,   C = down + cold + up (CPU side)

H and C depend on which experts the phase's T tokens hit, so the block costs E[M(n)], not M
at the expected bytes: at batch 1 the CPU side runs whole experts or nothing, and
E[max(H, C)] > max(E[H], E[C]) (Jensen). This module computes E[M(n)] for every n.

Routing model (the one the expected-byte formulas of ``hetplan.experts`` already assume):
every token chooses expert j independently with probability f_j (its routing fraction; the
fractions sum to top-k, so a token picks k experts on average). Per expert, c_j ~ Bin(T, f_j)
(its pairs) and it is *hit* when c_j > 0, with probability p_j = 1 - (1 - f_j)^T. On one side
(hot = ranks < n, cold = ranks >= n) let K = experts hit and N = pairs. Every expert has the
same size, so each side's time is a function of (K, N) only (W = one expert's weight bytes
read, P = FLOPs of one pair = 2 P_e, R = one pair's row bytes = D a, I = 8 index bytes):

    H(K, N) = roofline_gpu(F_sh + P N,  B_sh + W K + 2 R N)   (W K -> 3 T k W when the GPU side
                                                            gathers: ``hetplan.experts.gathers``)
    C(K, N) = l_d2h + N (R + I) / bw_d2h  +  roofline_cpu(P N, W K + 2 R N)  +  l_h2d + N R / bw_h2d
    merge   = l_gpu + (2 T D a + R N_c) / bw_gpu                (linear: its expectation is exact)

The sides touch disjoint experts, so (K_h, N_h) and (K_c, N_c) are independent. K per side is
Poisson-binomial over the side's p_j, computed exactly by convolution (prefix sums over the
hot ranks, suffix sums over the cold ones, for every n at once). Then

    E[max(H, C)] = sum_(a, b) P(K_h = a) P(K_c = b) max(H(a, N_h), C(b, N_c)).

* T = 1 (decode at batch 1): c_j in {0, 1}, so N = K on each side and the sum is exact.
* T > 1: N is replaced by c K, its mean per hit expert times the hits (c = E[N] / E[K] on the
  side; exact in mean, and equal to E[N | K] when the side's fractions are equal). Each side is
  Lipschitz in N with constant
  L_h = max(P / F_gpu, 2R / bw_gpu), L_c = (R + I) / bw_d2h + max(P / F_cpu, 2R / bw_cpu) + R / bw_h2d,
  so |E[M] - computed| <= L_h s_h + L_c s_c with s^2 = E[(N - c K)^2] = sum_side Var(c_j - c h_j)
  = sum_side [T f_j (1 - f_j) + c^2 p_j (1 - p_j) - 2 c T f_j (1 - p_j)]  (``error_bound_s``;
  h_j = [c_j > 0]). The bound is loose (it charges every pair at the steepest slope); the
  Monte-Carlo test in ``tests/moe/test_expected_split.py`` shows the actual error.

Pure numbers (numpy); deterministic, no sampling; the result is a function of its inputs only, so
it is memoised per distinct layer (``split_table``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class SplitExpectation:
    """Per hot count n = 0 .. E: expected seconds of the split's tasks and of the whole block."""
    hot_s: tuple
    """E[H]: the GPU side (shared + hot experts)."""
    cold_s: tuple
    """E[roofline_cpu]: the CPU side's compute task alone (0 where n = E)."""
    wait_s: tuple
    """E[max(H, C)] - max(E[H], E[C]) >= 0: how much later, on average, the later side ends than
    the later expected side (0 where n = E)."""
    split_s: tuple
    """E[M(n)]: route, both sides, merge."""
    error_bound_s: tuple
    """Bound on |E[M(n)] - split_s[n]| (0 at T = 1, where the sum is exact)."""


def hit_distributions(p) -> tuple[list, list]:
    """(prefix, suffix): prefix[n] = distribution of hits among experts 0 .. n-1, suffix[n]
    among experts n .. E-1 (arrays of length n + 1 and E - n + 1), for hit probabilities p."""
    e = len(p)
    prefix = [np.ones(1)]
    for j in range(e):
        prefix.append(np.convolve(prefix[-1], (1.0 - p[j], p[j])))
    suffix = [np.ones(1)]
    for j in reversed(range(e)):
        suffix.append(np.convolve(suffix[-1], (1.0 - p[j], p[j])))
    return prefix, suffix[::-1]


def expected_max(a_vals, a_prob, b_vals, b_prob) -> float:
    """E[max(A, B)] for independent A, B with ``b_vals`` nondecreasing:
    sum_i P(A = a_i) (a_i P(B <= a_i) + sum_(b_j > a_i) b_j P(B = b_j))."""
    cdf = np.cumsum(b_prob)
    tail = np.cumsum((b_vals * b_prob)[::-1])[::-1]  # tail[j] = sum_(j' >= j) b_j' P(b_j')
    idx = np.searchsorted(b_vals, a_vals, side="right")  # first j with b_j > a_i
    below = np.where(idx > 0, cdf[np.maximum(idx - 1, 0)], 0.0)
    above = np.where(idx < len(b_vals), tail[np.minimum(idx, len(b_vals) - 1)], 0.0)
    return float(np.sum(a_prob * (a_vals * below + above)))


def _roofline(r, flops, nbytes):
    return np.maximum(flops / r.flops_per_s, nbytes / r.bytes_per_s) + r.latency_s


class SplitTable:
    """E[M(n)] and its parts for the n asked for, computed on first use: a baseline reads one or
    two hot counts of a layer, the MILPs all of them (``split_expectation``)."""

    def __init__(self, x, index_bytes: float):
        self.x, self.index_bytes, self.memo = x, index_bytes, {}
        t, f = x.tokens, np.minimum(np.asarray(x.fraction, dtype=float), 1.0)
        p = 1.0 - (1.0 - f) ** t
        self.prefix, self.suffix = hit_distributions(p)

        def first(v):  # sums over the n hottest experts, n = 0 .. E
            return np.concatenate(([0.0], np.cumsum(v)))

        self.pairs, self.hits = first(t * f), first(p)            # E[N], E[K] of the hot side
        self.var_c, self.var_h, self.cov = first(t * f * (1.0 - f)), first(p * (1.0 - p)), first(t * f * (1.0 - p))
        g, c, dn, up, pf, r = x.gpu, x.cpu, x.d2h, x.h2d, x.pair_flops, x.row_bytes
        self.lip_h = max(pf / g.flops_per_s, 2 * r / g.bytes_per_s)
        self.lip_c = (r + index_bytes) / dn.bytes_per_s + max(pf / c.flops_per_s, 2 * r / c.bytes_per_s) + r / up.bytes_per_s
        self.route = x.route_s()

    def side(self, lo: int, hi: int) -> tuple:
        """(pairs per hit c, bound factor s) of the experts ranked lo .. hi-1."""
        n_mean, k_mean = self.pairs[hi] - self.pairs[lo], self.hits[hi] - self.hits[lo]
        per = n_mean / k_mean if k_mean > 0 else 0.0
        s2 = (self.var_c[hi] - self.var_c[lo]) + per * per * (self.var_h[hi] - self.var_h[lo]) \
            - 2 * per * (self.cov[hi] - self.cov[lo])
        return per, (0.0 if self.x.tokens == 1 else max(s2, 0.0) ** 0.5)

    def at(self, n: int) -> tuple:
        """(hot, cold, wait, split, bound) seconds at n hot experts."""
        if n not in self.memo:
            self.memo[n] = self._at(n)
        return self.memo[n]

    def _at(self, n: int) -> tuple:
        x, e = self.x, self.x.n_experts
        w, pf, r, ib = x.expert_read_bytes, x.pair_flops, x.row_bytes, self.index_bytes
        g, c, dn, up = x.gpu, x.cpu, x.d2h, x.h2d
        kh = np.arange(n + 1, dtype=float)
        per_h, s_h = self.side(0, n)
        nh = per_h * kh
        h_vals = _roofline(g, x.shared_flops + pf * nh, x.shared_bytes + x.hot_read_bytes(n, kh) + 2 * r * nh)
        e_hot = float(np.dot(self.prefix[n], h_vals))
        if n == e:
            return e_hot, 0.0, 0.0, self.route + e_hot, self.lip_h * s_h
        kc = np.arange(e - n + 1, dtype=float)
        per_c, s_c = self.side(n, e)
        nc = per_c * kc
        copies = (dn.latency_s + nc * (r + ib) / dn.bytes_per_s) + (up.latency_s + nc * r / up.bytes_per_s)
        cpu_vals = _roofline(c, pf * nc, w * kc + 2 * r * nc)
        c_vals = copies + cpu_vals
        e_cold, e_side = float(np.dot(self.suffix[n], cpu_vals)), float(np.dot(self.suffix[n], c_vals))
        both = expected_max(h_vals, self.prefix[n], c_vals, self.suffix[n])
        return (e_hot, e_cold, max(0.0, both - max(e_hot, e_side)), self.route + both + x.merge_s(n),
                self.lip_h * s_h + self.lip_c * s_c)


def split_table(x, index_bytes: float) -> SplitTable:
    """The (lazily filled) table of ``x`` (a ``hetplan.experts.ExpertLayer``).

    Memoised on the layer's value (a frozen dataclass) less the ids of its ranked experts, which
    the times do not depend on: the layers of one model with the same fractions by rank, on the
    same machine and phase (uniform routing, or a profile whose layers differ only in which
    expert ids are hot), share one table instead of recomputing it per layer."""
    return _split_table(dataclasses.replace(x, ranked=tuple(range(len(x.ranked)))), index_bytes)


@lru_cache(maxsize=256)
def _split_table(x, index_bytes: float) -> SplitTable:
    return SplitTable(x, index_bytes)


def split_expectation(x, index_bytes: float) -> SplitExpectation:
    """The expected split times of ``x`` for every n."""
    table = split_table(x, index_bytes)
    return SplitExpectation(*(tuple(col) for col in zip(*(table.at(n) for n in range(x.n_experts + 1)))))
