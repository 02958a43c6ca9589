"""A bound and a plan for the chain DP (``chain.dp``) from the memory row rounded onto a grid.

The chain's only coupling is the GPU row sum_b Y(o_b) <= U. Measured from a reference plan, each
option deviates by a non-negative amount, and the row becomes a knapsack row on those amounts:
    deficit (from every block at its largest Y):  d(o) = Ymax_b - Y(o),  sum_b d(o_b) >= N = sum Ymax - U
    surplus (from every block at its smallest Y): s(o) = Y(o) - Ymin_b,  sum_b s(o_b) <= R = U - sum Ymin
(the one with the smaller right-hand side is used: few blocks then deviate, and a block at its
reference costs no rounding). On a grid of q = (N or R) / cells bytes, a shortest path over
(block, option, cells so far) is exact for the rounded row:
- rounding every deviation towards the row's loose side (a deficit up, a surplus down) keeps
  every plan that fits (sum ceil(d/q) >= sum d/q >= N/q, so >= ceil(N/q) cells; likewise
  sum floor(s/q) <= floor(R/q)): its least cost is a lower bound of the chain's optimum;
- rounding towards the tight side (a deficit down, a surplus up) keeps only plans that fit: its
  least cost is a plan's, an incumbent.
The two meet as q shrinks (each block off its reference loses less than q), so ``grid`` refines
the cells until they are within the gap. The deficit's cell counter saturates at ceil(N/q)
(every plan past it meets the row), the surplus's drops a state past floor(R/q). The CPU row
(sum Y >= L) is left out of the bound (a relaxation) and checked on the plan.

Tables are kept per block for the path back, except a block with many options (a MoE block's
hot counts) after one that is kept: its table is recomputed from its predecessor's when the
path reaches it, so the memory held is about (options of the small blocks) x cells.

Knows the chain's pair terms and memory (``dp.Chain``); knows nothing about the search.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CELLS = (2048, 8192)
"""Grid sizes tried in turn, until the bound and the plan are within the gap."""
KEPT_OPTIONS = 16
"""A block with more options than this is not kept when its predecessor is (recomputed)."""


@dataclass(frozen=True)
class GridResult:
    bound_ms: float
    """A lower bound of the chain's optimum (memory rows included, bus totals left out)."""
    plan: tuple | None
    """(options, cost) of the best plan found that meets both memory rows, or None."""
    cells: int


class _Rounded:
    """The grid of one orientation and size: each option's cells, rounded one way."""

    def __init__(self, chain, cells: int, tight: bool):
        from hetplan.solvers.ilp.chain.dp import REL_TOL

        self.chain, self.cells = chain, cells
        ymax, ymin = sum(y.max() for y in chain.y), sum(y.min() for y in chain.y)
        need, room = ymax - chain.upper, chain.upper - ymin
        self.deficit = need <= room
        slack = 0.0 if tight else REL_TOL * abs(chain.upper)  # the slack ``Chain.fits`` allows
        q = ((need - slack) if self.deficit else (room + slack)) / cells
        dev = [(y.max() - y) if self.deficit else (y - y.min()) for y in chain.y]
        if tight:   # plans: a deficit rounded down, a surplus up
            w = [np.floor(d / q) if self.deficit else np.ceil(d / q) for d in dev]
        else:       # the bound: a deficit rounded up, a surplus down, each a little further
            w = [np.where(d > 0, np.ceil(d / q + 1e-6), 0.0) if self.deficit else np.floor(d / q - 1e-6) for d in dev]
        self.w = [np.clip(x, 0, cells + 1).astype(int) for x in w]

    def enter(self, m: np.ndarray, i: int) -> np.ndarray:
        """[o, c] -> the table after block i in option o with c cells: m[o, c - w_i(o)]; the
        deficit's last cell takes every c >= cells - w (saturated), the surplus drops c > cells."""
        k = self.w[i][:, None]
        c = np.arange(self.cells + 1)[None, :]
        out = np.where(c >= k, np.take_along_axis(m, np.clip(c - k, 0, None), axis=1), np.inf)
        if self.deficit:
            tail = np.minimum.accumulate(m[:, ::-1], axis=1)[:, ::-1]  # tail[o, j] = min m[o, j:]
            out[:, -1] = np.take_along_axis(tail, np.clip(self.cells - k, 0, self.cells), axis=1)[:, 0]
        return out

    def through(self, t: np.ndarray, i: int) -> np.ndarray:
        """The table of block i + 1 from block i's: min over o' of t[o', c] + Delta_i[o', o], entered."""
        d = self.chain.delta[i]
        if d.shape[0] <= d.shape[1]:
            m = np.full((d.shape[1], t.shape[1]), np.inf)
            for a in range(d.shape[0]):
                m = np.minimum(m, t[a][None, :] + d[a][:, None])
        else:
            m = np.stack([(t + d[:, b][:, None]).min(axis=0) for b in range(d.shape[1])])
        return self.enter(m, i + 1)

    def solve(self, with_path: bool) -> tuple:
        """(least cost over plans ending within the row, their options or None)."""
        ch = self.chain
        t = np.full((len(ch.y[0]), self.cells + 1), np.inf)
        t[:, 0] = ch.init
        t = self.enter(t, 0)
        kept = [t]
        for i in range(len(ch.delta)):
            t = self.through(t, i)
            if with_path:
                kept.append(None if t.shape[0] > KEPT_OPTIONS and kept[-1] is not None else t)
        last = t + ch.final[:, None]
        cols = last[:, -1:] if self.deficit else last
        best = float(cols.min())
        if not with_path or not np.isfinite(best):
            return best, None
        o, c = np.unravel_index(int(np.argmin(cols)), cols.shape)
        path, c = [int(o)], int(c) + (self.cells if self.deficit else 0)
        for i in range(len(ch.delta) - 1, -1, -1):
            prev = kept[i] if kept[i] is not None else self.through(kept[i - 1], i - 1)
            k = int(self.w[i + 1][path[-1]])
            if self.deficit and c == self.cells:
                lo = max(self.cells - k, 0)
                cand = prev[:, lo:] + ch.delta[i][:, path[-1]][:, None]
                a, j = np.unravel_index(int(np.argmin(cand)), cand.shape)
                path.append(int(a))
                c = lo + int(j)
            else:
                c -= k
                path.append(int(np.argmin(prev[:, c] + ch.delta[i][:, path[-1]])))
        path.reverse()
        return best, path


def grid(chain, rel_gap: float, incumbent: tuple | None, cells=CELLS) -> GridResult | None:
    """The grid's bound and plan (the incumbent kept where better), refined through ``cells``
    until they are within ``rel_gap``; None when the row cannot bind (every block at its
    largest fits) or no plan fits."""
    if not chain.any_fits() or sum(y.max() for y in chain.y) <= chain.upper:
        return None
    out = None
    for n in cells:
        bound, _ = _Rounded(chain, n, tight=False).solve(with_path=False)
        _, path = _Rounded(chain, n, tight=True).solve(with_path=True)
        if path is not None and chain.fits(chain.nbytes(path)):
            plan = chain.improve(path, chain.cost(path))
            if incumbent is None or plan[1] < incumbent[1]:
                incumbent = plan
        out = GridResult(bound, incumbent, n)
        if incumbent is not None and bound >= incumbent[1] - rel_gap * abs(incumbent[1]):
            break
    return out
