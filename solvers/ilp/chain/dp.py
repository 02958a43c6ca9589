"""The per-block MILP of one configuration solved as a dynamic programme over the block chain,
with the memory rows handled by Lagrangian bounds; exact to within the solver's gap tolerance.

Why a chain. With every block's option fixed (``options``), the per-block MILP's start times
are the earliest ones its rows allow, and each row links two consecutive blocks only:
    S_b - S_(b-1) = max(D_(b-1) + t_copy(m_b, m_(b-1)), t_load(b), window_b)          (depth 2)
    S_b - S_(b-1) = D_(b-1) + max(t_copy(m_b, m_(b-1)), t_load(b), window_b)          (depth 1)
(``constraints.add_chain``, ``add_load_edges``, ``add_bus_windows``, the load and window terms
only for a block that may stream; the window cuts are implied at integral points),
S_first = t_load(first), and the phase's chain ends at E_last = S_last + D_last. So
sum_p w_p E_last,p is a sum of pair terms Delta(o_(b-1), o_b), and memory is the only coupling:
with Y(o) the HBM bytes of option o,
    sum_b Y(o_b) <= U = budget_gpu - depth * slot - workspace_gpu
    sum_b Y(o_b) >= L = weights + KV + workspace_cpu - budget_cpu      (the CPU row, restated)
(a plan with nothing on the GPU is the one exception to U, priced apart). Two rows couple every
block: the per-phase bus totals and the prompt-KV lane (``add_bus_bounds``,
``add_kv_down_edges``). The search leaves them out, which makes its values lower bounds of the
MILP's; ``chain.plan`` prices the plan found with them, and when they bind beyond the gap
tolerance the caller solves the MILP instead.

The search, per configuration:
(1) A Lagrangian on the memory row, lambda (sum Y - U): for a fixed lambda the chain is a
    shortest path over (block, option), solved backwards in O(sum |options_b| |options_(b-1)|)
    (``cost_to_go``); a one-dimensional cutting-plane search over lambda gives the dual bound,
    and the path that fits, improved by a local search (``improve``), the incumbent.
(2) If the incumbent is within the gap tolerance of the dual bound, done. Otherwise, forward, a
    DP over (block, option, HBM bytes so far) keeping for each option the Pareto front of
    (bytes, cost); a state is dropped when a Lagrangian bound on its completions,
        C + h_lambda(b, o) - lambda (U - Y),
    exceeds a target, raised from just above the dual bound towards the incumbent (less the
    gap tolerance). The first target under which a plan completes gives the optimum; when none
    does, the incumbent is within the tolerance of every plan.
(3) If the fronts outgrow ``max_states`` (the deterministic limit, like HiGHS's node limit):
    plans that fill the GPU with whole blocks (``chain.cells``, a shortest path over HBM
    cells), improved by the local search, replace the incumbent where better, and (2) runs
    again under the lower ceiling with as many states.
(4) If it outgrows them too: the memory row rounded onto a grid of cells (``chain.grid``), a
    shortest path over (block, option, cells) that gives a bound seeing whole blocks (each
    deviation rounded to the loose side) and a plan that fits (rounded to the tight side),
    refined until they meet. Where they are still apart, the search stops with the best plan
    and the better bound, and says so (``ChainResult.proven``).

Knows the MILP's rows (through ``options``) and the schedule's chain; knows nothing about HiGHS
or the plan's format.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetplan.buses import capacities
from hetplan.graph import PHASES
from hetplan.solvers.ilp.chain.cells import cell_plans
from hetplan.solvers.ilp.chain.grid import grid
from hetplan.solvers.ilp.options import tables

MAX_STATES = 600_000
"""Default limit on the states the forward DP keeps, over every target (the solver passes its own,
``per_block.STATES_PER_NODE`` times ``max_nodes``)."""
MAX_MOVES = 2000
"""Option changes the incumbent's local search makes at most."""
REL_TOL = 1e-9
"""Relative slack of the pruning tests (float sums of the same terms in another order)."""


@dataclass(frozen=True)
class ChainResult:
    chosen: list | None
    """The option index of every block in the plan found, or None (no plan fits, or none
    beats the cutoff by more than the gap)."""
    relaxed_ms: float
    """The plan's weighted objective without the bus totals and KV lane rows (inf: no plan)."""
    bound_ms: float
    """A lower bound of the weighted objective of every plan of this configuration, those rows
    left out (inf when no plan fits)."""
    states: int
    proven: bool = True
    """False when the forward DP outgrew its state limit (``bound_ms`` is then the Lagrangian's)."""


class Chain:
    """The pair terms and memory of one configuration (staging depth, slot size)."""

    def __init__(self, problem, depth: int, slot_bytes: float, stream_cold: bool, weights, cache=None):
        """``weights``: (w_prefill, w_decode) of the objective; ``cache``: ``options.tables``'s."""
        self.problem, self.depth, self.slot = problem, depth, slot_bytes
        self.w = dict(zip(PHASES, weights))
        self.blocks = tables(problem, slot_bytes, stream_cold, depth, cache)
        self.caps = capacities(problem.hw)
        first, last = self.blocks[0], self.blocks[-1]
        self.init = sum(self.w[p] * (first.load_ms[p] if first.candidate[p] else np.zeros(len(first.options)))
                        for p in PHASES)
        """Weighted S_first per option of the first block (its load is issued at 0)."""
        self.final = sum(self.w[p] * last.duration_ms[p] for p in PHASES)
        """Weighted D_last per option of the last block."""
        self.delta = [self._pair(prev, cur) for prev, cur in zip(self.blocks, self.blocks[1:])]
        total = sum(b.weight_bytes + b.kv_bytes for b in problem.blocks)
        self.upper = problem.gpu_budget_bytes - depth * slot_bytes - problem.gpu_workspace_bytes
        self.lower = total + problem.cpu_workspace_bytes - problem.cpu_budget_bytes
        self.y = [t.gpu_bytes for t in self.blocks]
        self._lagrangian = None
        self.max_after = np.concatenate([np.cumsum([y.max() for y in self.y][::-1])[::-1][1:], [0.0]])
        self.min_after = np.concatenate([np.cumsum([y.min() for y in self.y][::-1])[::-1][1:], [0.0]])

    def _pair(self, prev, cur) -> np.ndarray:
        """Delta[o', o] = sum_p w_p (S_b - S_(b-1)) with block b-1 in option o', b in option o."""
        out = 0.0
        for p in PHASES:
            on_prev = (prev.mode[p] != 2)[:, None]
            on_cur = (cur.mode[p] != 2)[None, :]
            copy = np.where(on_cur & ~on_prev, cur.up_ms[p], 0.0) + np.where(on_prev & ~on_cur, cur.down_ms[p], 0.0)
            d_prev = prev.duration_ms[p][:, None]
            if cur.candidate[p]:
                win = np.zeros((len(prev.options), len(cur.options)))
                for x, cap in self.caps.items():
                    nbytes = cur.loaded_bytes[p][None, :] + (prev.moved_bytes[p][x][:, None] if self.depth == 2 else 0.0)
                    win = np.maximum(win, (1e3 / cap) * nbytes)
                lead = np.maximum(cur.load_ms[p][None, :], win)
                step = np.maximum(d_prev + copy, lead) if self.depth == 2 else d_prev + np.maximum(copy, lead)
            else:
                step = d_prev + copy
            out = out + self.w[p] * step
        return np.asarray(out, dtype=float) * np.ones((len(prev.options), len(cur.options)))

    # (1) the Lagrangian ------------------------------------------------------------------------
    def cost_to_go(self, lam: float) -> list:
        """h[b][o] = min over completions after block b (in option o) of their cost plus
        lam * their HBM bytes (lam per GiB)."""
        scale = lam / (1 << 30)
        h = [None] * len(self.blocks)
        h[-1] = self.final
        for i in range(len(self.blocks) - 2, -1, -1):
            h[i] = (self.delta[i] + (scale * self.y[i + 1] + h[i + 1])[None, :]).min(axis=1)
        return h

    def _path(self, lam: float, h: list) -> tuple:
        """The path of least cost + lam * bytes -> (options, cost, bytes)."""
        scale = lam / (1 << 30)
        first = self.init + scale * self.y[0] + h[0]
        o = [int(np.argmin(first))]
        cost = float(self.init[o[0]])
        for i, d in enumerate(self.delta):
            row = d[o[-1]] + scale * self.y[i + 1] + h[i + 1]
            nxt = int(np.argmin(row))
            cost += float(d[o[-1], nxt])
            o.append(nxt)
        cost += float(self.final[o[-1]])
        return o, cost, self.nbytes(o)

    def any_fits(self) -> bool:
        """False when no plan that uses the GPU can meet both memory rows (the bytes of the
        leanest plan exceed the GPU's room, or those of the fullest fall short of the CPU row)."""
        least, most = sum(y.min() for y in self.y), sum(y.max() for y in self.y)
        return 0 <= self.upper and least <= self.upper * (1 + REL_TOL) and most >= self.lower - abs(self.lower) * REL_TOL

    def fits(self, nbytes: float) -> bool:
        return nbytes <= self.upper * (1 + REL_TOL) and nbytes >= self.lower - abs(self.lower) * REL_TOL

    def lagrangian(self, iters: int = 40) -> tuple:
        """(multipliers, incumbent (options, cost) or None, dual bound), cached; multipliers:
        [(lam, its cost-to-go)] of every lam evaluated, the best first.

        Each path (cost c, bytes Y) is a line c + lam (Y - limit) in lam; the dual function is
        their lower envelope, concave and piecewise linear, maximised where a path over the
        limit meets one within it. Starting from lam = 0 (the optimum if it fits) and a lam
        large enough to fit, each step evaluates the crossing of the two paths' lines and keeps
        the new path on its side: finitely many steps reach the maximum."""
        if self._lagrangian is None:
            self._lagrangian = self._solve_dual(iters)
        return self._lagrangian

    def _solve_dual(self, iters: int) -> tuple:
        if not self.any_fits():
            return [], None, float("inf")
        seen = []  # (lam, its cost-to-go, the dual function's value there) of every lam evaluated
        path, cost, nbytes, _ = self._probe(0.0, seen, lambda lam, c, y: c)
        if self.fits(nbytes):
            return self._ranked(seen, 0.0), (path, cost), cost
        sign = 1.0 if nbytes > self.upper else -1.0
        limit = (self.upper if sign > 0 else self.lower) / (1 << 30)
        side = lambda y: sign * (y / (1 << 30) - limit)  # noqa: E731  (> 0: the row is violated)
        line = lambda lam, c, y: c + lam * (y / (1 << 30) - limit)  # noqa: E731
        out = (path, cost, nbytes)
        incumbent, inside = None, None
        lam = sign * max(1.0, abs(cost)) / max(abs(limit), 1.0)
        for _ in range(iters):   # a lam whose path fits
            path, cost, nbytes, _ = self._probe(lam, seen, line)
            if side(nbytes) <= 0:
                inside = (path, cost, nbytes)
                break
            out = (path, cost, nbytes)
            lam *= 8.0
        if inside is None:
            best = max(seen, key=lambda x: x[2])
            return self._ranked(seen, best[0]), None, best[2]
        for _ in range(iters):
            if self.fits(inside[2]) and (incumbent is None or inside[1] < incumbent[1]):
                incumbent = (inside[0], inside[1])
            slope_out, slope_in = out[2] / (1 << 30) - limit, inside[2] / (1 << 30) - limit
            if slope_out == slope_in:
                break
            lam = (inside[1] - out[1]) / (slope_out - slope_in)
            path, cost, nbytes, dual = self._probe(lam, seen, line)
            if dual >= line(lam, out[1], out[2]) - REL_TOL * abs(dual):
                break  # no path below the crossing: lam maximises the dual
            if side(nbytes) > 0:
                out = (path, cost, nbytes)
            else:
                inside = (path, cost, nbytes)
        if self.fits(inside[2]) and (incumbent is None or inside[1] < incumbent[1]):
            incumbent = (inside[0], inside[1])
        if incumbent is not None:
            incumbent = self.improve(*incumbent)
        best = max(seen, key=lambda x: x[2])
        return self._ranked(seen, best[0]), incumbent, best[2]

    def _probe(self, lam: float, seen: list, line) -> tuple:
        """One step of the dual search: the cost-to-go and least path at ``lam``, recorded in
        ``seen`` with the dual function's value there, ``line(lam, cost, bytes)`` ->
        (path, cost, bytes, dual)."""
        h = self.cost_to_go(lam)
        path, cost, nbytes = self._path(lam, h)
        dual = line(lam, cost, nbytes)
        seen.append((lam, h, dual))
        return path, cost, nbytes, dual

    def nbytes(self, path: list) -> float:
        """The GPU-resident bytes of the plan ``path`` (options): the memory rows' sum."""
        return float(sum(y[j] for y, j in zip(self.y, path)))

    def cost(self, path: list) -> float:
        """The weighted objective of the plan ``path`` (options), by its pair terms."""
        return float(self.init[path[0]] + self.final[path[-1]]
                     + sum(d[a, b] for d, a, b in zip(self.delta, path, path[1:])))

    def improve(self, path: list, cost: float) -> tuple:
        """Local search from a plan that fits: repeatedly change the one block's option that
        lowers the cost most while the plan still fits (its pair terms with both neighbours
        recomputed) -> (options, cost). Only an incumbent: the bound comes from elsewhere."""
        path = list(path)
        nbytes = self.nbytes(path)
        last = len(self.blocks) - 1
        for _ in range(MAX_MOVES):
            best = (0.0, None, None)
            for b in range(last + 1):
                local = self.init.copy() if b == 0 else self.delta[b - 1][path[b - 1]].copy()
                local += self.final if b == last else self.delta[b][:, path[b + 1]]
                grow = self.y[b] - self.y[b][path[b]]
                room = (nbytes + grow <= self.upper * (1 + REL_TOL)) & (nbytes + grow >= self.lower)
                gain = np.where(room, local[path[b]] - local, -np.inf)
                j = int(np.argmax(gain))
                if gain[j] > best[0] + REL_TOL * abs(cost):
                    best = (float(gain[j]), b, j)
            if best[1] is None:
                break
            gain, b, j = best
            nbytes += float(self.y[b][j] - self.y[b][path[b]])
            path[b] = j
            cost -= gain
        return path, cost

    @staticmethod
    def _ranked(seen, best_lam, keep: int = 4) -> list:
        """(lam, cost-to-go) of the best multiplier and of the ``keep`` - 1 others of its sign
        nearest to it (a bound mixes one memory row), best first: the bounds the forward DP
        applies."""
        same = sorted((x for x in seen if x[0] * best_lam >= 0 and x[0] != best_lam),
                      key=lambda x: abs(x[0] - best_lam))
        return [(x[0], x[1]) for x in [next(x for x in seen if x[0] == best_lam)] + same[:keep - 1]]

    # (2) the exact forward DP ---------------------------------------------------------------------
    TARGETS = (1e-6, 1e-5, 1e-4, 5e-4, 1e-3, 2e-3, 3e-3, 4.5e-3, 6e-3, 8e-3, 1e-2, 1.5e-2, 2e-2, 3e-2, 5e-2)
    """Relative slack above the dual bound of the successive forward searches."""

    def search(self, cutoff_ms: float | None = None, max_states: int = MAX_STATES,
               rel_gap: float = 0.0) -> ChainResult:
        """The optimum of the chain (memory rows included, bus totals and KV lane left out), to
        within ``rel_gap``.

        The forward DP runs with a target: states whose bound exceeds it are dropped, so it is
        small when the target is close to the dual bound. If it completes a plan within the
        target, that plan is optimal (every dropped state's completions cost more than the
        target). Otherwise the target is raised, up to the ceiling (the incumbent or the cutoff,
        less ``rel_gap``): when nothing lies under it, the incumbent is within the gap of every
        plan, or nothing beats the cutoff by more than the gap. Past ``max_states`` the search
        stops with the incumbent and the Lagrangian bound (``proven`` False)."""
        if not self.any_fits():
            return ChainResult(None, float("inf"), float("inf"), 0)
        mults, incumbent, dual = self.lagrangian()
        ceiling = min(incumbent[1] if incumbent is not None else float("inf"),
                      cutoff_ms if cutoff_ms is not None else float("inf"))
        floor = ceiling - rel_gap * abs(ceiling) if ceiling < float("inf") else float("inf")
        if dual >= floor:
            return self._settle(incumbent, cutoff_ms, dual, 0)
        res, used = self._targets(mults, dual, floor, max_states), max_states
        if res is None and mults:
            # the fronts outgrew their limit: a plan that fills the GPU with whole blocks
            # (chain.cells) may lower the ceiling enough for the search to finish
            plans = [self.improve(*p) for p in sorted(cell_plans(self, mults[0][0]), key=lambda p: p[1])[:4]]
            if plans and min(p[1] for p in plans) < ceiling:
                incumbent = min(plans, key=lambda p: p[1])
                ceiling = min(incumbent[1], ceiling)
                floor = ceiling - rel_gap * abs(ceiling)
                if dual >= floor:
                    return self._settle(incumbent, cutoff_ms, dual, used)
                res, used = self._targets(mults, dual, floor, max_states), 2 * max_states
        if res is None:
            # (4) the memory row rounded onto a grid: a bound that sees whole blocks, and a plan
            found = grid(self, rel_gap, incumbent)
            if found is not None:
                dual, incumbent = max(dual, found.bound_ms), found.plan
                ceiling = min(incumbent[1] if incumbent is not None else float("inf"), ceiling)
                floor = ceiling - rel_gap * abs(ceiling) if ceiling < float("inf") else float("inf")
            return self._settle(incumbent, cutoff_ms, dual, used, proven=dual >= floor)
        found, states = res
        return found if found is not None else self._settle(incumbent, cutoff_ms, floor, states)

    def _targets(self, mults, dual, floor, max_states):
        """The forward DP under rising targets (``search``) -> (its plan, or None when nothing
        lies under ``floor``; states), or None past ``max_states``."""
        used = 0
        for eps in self.TARGETS + (float("inf"),):
            target = min(dual + eps * abs(dual), floor) if eps < float("inf") else floor
            slack = REL_TOL * max(abs(target), 1.0) if target < float("inf") else 0.0
            res = self._forward(mults, target + slack, max_states - used)
            if res is None:
                return None
            found, states = res
            used += states
            if found is not None:
                return found, used
            if target >= floor:
                break
        return None, used

    def _settle(self, incumbent, cutoff_ms, bound_ms, states, proven=True) -> ChainResult:
        """The incumbent with a bound on every plan (or no plan, when none fits or the incumbent
        does not beat the cutoff)."""
        if incumbent is None or (cutoff_ms is not None and incumbent[1] > cutoff_ms):
            return ChainResult(None, float("inf"), bound_ms, states, proven)
        chosen, cost = incumbent
        return ChainResult(list(chosen), cost, min(bound_ms, cost), states, proven)

    def _forward(self, mults, target, max_states):
        """(ChainResult or None, states) of the forward DP keeping states whose bound is within
        ``target``; None when it outgrows ``max_states``."""
        ys = self.y[0].astype(float)
        cs = self.init.astype(float)
        os_ = np.arange(len(ys))
        keep = self._alive(0, ys, cs, os_, mults, target)
        ys, cs, os_ = ys[keep], cs[keep], os_[keep]
        history = [(os_, np.full(len(os_), -1))]
        count = len(os_)
        for i, d in enumerate(self.delta):
            if not len(os_):
                return None if count > max_states else (None, count)
            n_cur = d.shape[1]
            c = cs[:, None] + d[os_]
            y = ys[:, None] + self.y[i + 1][None, :]
            o = np.broadcast_to(np.arange(n_cur)[None, :], c.shape)
            parent = np.broadcast_to(np.arange(len(os_))[:, None], c.shape)
            c, y, o, parent = c.ravel(), y.ravel(), o.ravel(), parent.ravel()
            alive = self._alive(i + 1, y, c, o, mults, target)
            c, y, o, parent = c[alive], y[alive], o[alive], parent[alive]
            front = self._front(i + 1, y, c, o)
            cs, ys, os_ = c[front], y[front], o[front]
            history.append((os_, parent[front]))
            count += len(os_)
            if count > max_states:
                return None
        if not len(os_):
            return None, count
        total = cs + self.final[os_]
        j = int(np.argmin(total))
        if total[j] > target:
            return None, count
        chosen = []
        for os_b, parents in reversed(history):
            chosen.append(int(os_b[j]))
            j = int(parents[j])
        chosen.reverse()
        value = float(total.min())
        return ChainResult(chosen, value, value, count), count

    def _alive(self, i, y, c, o, mults, cut) -> np.ndarray:
        """States of block i that fit and whose bound does not exceed ``cut``: the best over
        the multipliers of the Lagrangian bound C + h_lam(i, o) - lam (limit - Y) (each valid
        for every completion; a state with much memory left is bounded best by a small lam)."""
        ok = y <= self.upper * (1 + REL_TOL)
        if self.lower > 0:
            ok &= y + self.max_after[i] >= self.lower * (1 - REL_TOL)
        for lam, h in mults:
            limit = self.upper if lam >= 0 else self.lower
            ok &= c + h[i][o] - (lam / (1 << 30)) * (limit - y) <= cut
        return ok

    def _front(self, i, y, c, o) -> np.ndarray:
        """Indices of the states no other state of the same option dominates: fewer or equal
        bytes at no more cost (when the CPU row may bind, only a state whose bytes already
        satisfy it for every completion dominates, besides one with the same bytes).

        Sorted by (option, bytes, cost), a state survives when its cost is below every earlier
        dominating state's of its option: a running minimum, made to restart at each option
        by shifting option g's costs down by g * span (span > the costs' range)."""
        yr = np.round(y)
        order = np.lexsort((c, yr, o))
        yr, c, o = yr[order], c[order], o[order]
        if not len(o):
            return order
        group = np.cumsum(np.r_[0, o[1:] != o[:-1]])
        span = 2.0 * (c.max() - c.min()) + 1.0
        shifted = c - group * span
        settled = yr + self.min_after[i] >= self.lower * (1 + REL_TOL) if self.lower > 0 else np.ones(len(o), bool)
        best = np.minimum.accumulate(np.where(settled, shifted, np.inf))
        prior = np.r_[np.inf, best[:-1]]
        same = np.r_[False, (o[1:] == o[:-1]) & (yr[1:] == yr[:-1])]
        return order[(shifted < prior) & ~same]
