"""A lower bound on the count MILP of *every* layer count from one LP relaxation (weak duality).

The count MILP of ``n`` alike layers (``layers.LayerModel``) depends on ``n`` in three places
only: the right-hand side of ``sum_o n_o = n``, the upper bounds ``n_o <= n`` and ``y <= n - 1``
(the arcs between consecutive layers), and the coefficient of each binary that says whether any
layer does something (``LayerModel.scaled``: ``gpu_used``, ``n gpu_used >= the layers that use
the GPU``). Solve its LP
relaxation at ``n``; HiGHS's optimal duals (row duals ``y``, reduced costs ``d = c - A^T y``) stay
feasible for the dual of the relaxation at any other count ``m``: no column's cost changes, and
the coefficients that do sit in those binaries' columns, whose bounds are finite, where any
reduced cost is feasible. So by weak duality, for every ``m``

    LP(m) >= offset + sum_r y_r side_r(m) + sum_j d_j(m) bound_j(m)

(``side_r``: row ``r``'s lower bound where ``y_r > 0``, its upper where ``y_r < 0``; ``bound_j``:
column ``j``'s lower bound where ``d_j > 0``, its upper where ``d_j < 0``), which is

    base + per_layer m + sum over those binaries of min(0, d_j - (m - n) y_row(j))

a line in ``m`` and concave pieces; at ``m = n`` it is the LP's value (strong duality, checked
to ``DUALITY_TOLERANCE``; a certificate that fails the check bounds ``n`` alone). The arcs
between layers exist only from two layers on, so a certificate from ``n >= 2`` bounds every
``m >= 2`` and one from ``n = 1`` bounds ``m = 1`` alone. Each LP relaxation is a lower bound on
its MILP, so one LP per staging configuration bounds that configuration at every layer count
of the same stage kind: the pipeline search (``hetplan.pipeline.plan``) learns the bound of
every stage length from the few it refines.

The LP's bound lies below the MILP's by its integrality gap (the layers HBM holds, a fraction
in the LP). ``count_line`` closes it for every count at once: the count MILP of one configuration
with the count a variable ``m`` in ``[lo, hi]`` and ``slope m`` taken off its objective has an
optimum (bound) ``W <= MILP(m) - slope m`` for each ``m``, so

    MILP(m) >= W + slope m

a line, for any slope; exact wherever the MILP is a line of that slope (beyond a device's HBM
each layer more adds the same seconds, and the LP, a line there too, gives the slope), below it
elsewhere. Where the MILP steps up (the first layer HBM cannot hold starts the streaming and
its staging), a line over the whole range touches it below the step only and lies under every
count beyond it. So the line is raised in steps: the MILP's plan at the count ``m*`` where it
meets the line, and the same MILP solved again over ``[m* + 1, hi]``, whose bound ``W' >= W``
holds there, up to ``LINE_STEPS`` MILPs; beyond the last step, the line of slope ``slope``
through the MILP's first count there. The pipeline search prices the stages of one kind at
many counts; with the line of each of their configurations, a count MILP stops at the first
plan that reaches the line (``LayerModel.solve``'s ``floor_ms``) and a configuration whose line
lies above the plan found is not solved.

Only for the objectives whose weights do not depend on the layer count (``latency``,
``throughput``: 1 and ``gen_len``; ``ttft``/``tpot`` weigh the other phase by the problem's
own times).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hetplan.solvers.ilp.layers import LayerModel
from hetplan.solvers.ilp.objective import MS

DUALITY_TOLERANCE = 1e-7
"""Relative difference allowed between the LP's value and its dual objective at ``n``."""
WEIGHTS_FIXED = ("latency", "throughput")
"""Objectives whose phase weights are the same for every layer count (``Weights``)."""


@dataclass(frozen=True)
class CountBound:
    """The LP relaxation of one configuration's count MILP solved at ``n`` layers, as a lower
    bound on the relaxation (so on the stage's price) at any count ``m`` (module docstring)."""
    n: int
    value_s: float
    """The LP's value at ``n`` (stated seconds; inf: infeasible)."""
    base: float = -math.inf
    """Weighted ms: the dual objective's part that does not move with ``m`` (-inf: bounds ``n`` alone)."""
    per_layer: float = 0.0
    scaled: tuple = ()
    """(reduced cost, its row's dual) of each binary whose coefficient in its row is the layer
    count (``LayerModel.scaled``)."""
    margin_s: float = 0.0
    """Subtracted from every bound but ``n``'s: the duality gap the check allowed, and rounding."""
    solved: bool = True
    """False: the LP was not solved, ``value_s`` a lower bound on it that other counts taught
    (``per_block.count_bounds``'s ``known``)."""

    def slope(self) -> float | None:
        """Weighted ms per layer from this certificate's count to the next: the LP's slope there
        where the LP is a line (the certificate is exact along it); None where it says nothing of
        other counts."""
        if self.base == -math.inf or self.n < 2:
            return None
        return (self.at(self.n + 1) + self.margin_s - self.value_s) * MS

    def at(self, m: int) -> float:
        """A lower bound (stated seconds) on the LP relaxation at ``m`` layers; -inf where this
        certificate says nothing."""
        if m == self.n:
            return self.value_s
        if self.base == -math.inf or m < 2 or self.n < 2:
            return -math.inf
        moved = sum(min(0.0, d - (m - self.n) * y) for d, y in self.scaled)
        return (self.base + self.per_layer * m + moved) / MS - self.margin_s


@dataclass(frozen=True)
class LineBound:
    """A lower bound on the count MILP of one configuration at every count of ``[lo, hi]``: a
    line of ``slope``, raised in steps (module docstring)."""
    hi: int
    slope: float
    """Weighted ms per layer."""
    steps: tuple
    """((lo, value, at), ...) in increasing ``lo``: over ``[lo, hi]`` the MILP is at least
    ``value + slope m`` (weighted ms; inf: infeasible at every count there); ``at``: the count
    of the plan that MILP with the count free found (where the line meets the MILP when that
    plan is optimal), or None."""

    @property
    def lo(self) -> int:
        return self.steps[0][0]

    def at_ms(self, m: int) -> float:
        """The bound at ``m`` layers (weighted ms), less ``LINE_MARGIN``; -inf outside the range."""
        if not self.lo <= m <= self.hi:
            return -math.inf
        value = max(v for lo, v, _ in self.steps if lo <= m)
        if value == math.inf:
            return math.inf
        line = value + self.slope * m
        return line - LINE_MARGIN * abs(line)


LINE_GAP = 1e-12
"""Relative gap to which ``count_line``'s MILPs are solved: the line is as tight as their bounds."""
LINE_MARGIN = 1e-10
"""Relative slack a line's bound gives up (HiGHS's tolerances)."""
LINE_STEPS = 2
"""MILPs with the count free one line is made of at most (module docstring)."""


def count_line(model: LayerModel, slope: float, opts) -> LineBound:
    """The line of ``model`` (a count MILP with the count free, ``LayerModel(count_range=...)``)
    of ``slope`` weighted ms per layer, in up to ``LINE_STEPS`` steps (module docstring).
    ``opts``: the MILP's options; a bound found at the node limit is still a bound."""
    from hetplan.solvers.ilp.per_block import IlpOptions

    model.prob.setObjective(model.weights.weighted_ms(model.T) - slope * model.count)
    line_opts = IlpOptions(**{**opts.__dict__, "mip_rel_gap": LINE_GAP})
    lo, hi = int(model.count.lowBound), int(model.count.upBound)
    steps, start = [], lo
    try:
        while start <= hi and len(steps) < LINE_STEPS:
            model.count.lowBound = start
            status, info, walk, _ = model.solve(line_opts, None)
            if status == "infeasible":
                steps.append((start, math.inf, None))
                break
            at = int(round(model.count.varValue)) if walk is not None else None
            steps.append((start, info.mip_dual_bound, at))
            if at is None:
                break
            start = at + 1
    finally:
        model.count.lowBound = lo
    return LineBound(hi, slope, tuple(steps))


def count_bound(model: LayerModel, opts) -> CountBound:
    """The LP relaxation of ``model`` at its layer count, with its duals read as a
    ``CountBound``."""
    status, info = model.solve_relaxation(opts)
    if status != "optimal":
        return CountBound(model.L, math.inf)
    value = info.objective_function_value
    stated = model.weights.stated_bound_s(value)
    h = model.prob.solverModel
    sol, lp = h.getSolution(), h.getLp()
    if model.problem.workload.objective not in WEIGHTS_FIXED or not sol.dual_valid:
        return CountBound(model.L, stated)
    y, d = list(sol.row_dual), list(sol.col_dual)
    dual = lp.offset_ + _paired(y, lp.row_lower_, lp.row_upper_) + _paired(d, lp.col_lower_, lp.col_upper_)
    if not abs(dual - value) <= DUALITY_TOLERANCE * max(1.0, abs(value)):
        return CountBound(model.L, stated)
    rows, n = model.prob.constraints, model.L
    counts = [v.index for v in model.n.values()]
    between = [v.index for k, (v, _) in model.arcs.items() if k[0] == "M" and k[2] == "A"]
    per_layer = y[rows["every_layer"].index] + sum(min(0.0, d[j]) for j in counts + between)
    scaled = tuple((d[v.index], y[rows[row].index]) for v, row in model.scaled)
    base = dual - per_layer * n - sum(min(0.0, dv) for dv, _ in scaled)
    margin = (abs(dual - value) + 1e-9 * abs(value)) / MS
    return CountBound(n, stated, base, per_layer, scaled, margin)


def _paired(duals, lower, upper) -> float:
    """``sum_i dual_i x bound_i``, the bound the dual's sign selects (lower where positive, upper
    where negative); -inf where a dual that is not zero meets an infinite bound (no certificate)."""
    total = 0.0
    for v, lo, hi in zip(duals, lower, upper):
        side = lo if v > 0 else hi if v < 0 else 0.0
        if math.isinf(side):
            return -math.inf
        total += v * side
    return total


class Envelope:
    """The bound a kind of stage's refinements teach each of its lengths: at ``m`` layers, the
    least over configurations of the best ``CountBound`` of each (-inf while one has none), or,
    for a configuration whose count MILPs have lines (``count_lines``, one per KV mode), the
    least of those where higher; kept up to date as certificates and lines are added."""

    def __init__(self):
        self.certs: dict = {}   # (depth, slot) -> its CountBounds
        self.lines: dict | None = None   # count MILP configuration -> its LineBound, once learnt
        self._best: dict = {}   # (depth, slot) -> {m: the best of its CountBounds at m}
        self._at: dict = {}     # m -> the envelope there

    def add(self, config, cert: CountBound) -> None:
        self.certs.setdefault(config, []).append(cert)
        best = self._best.setdefault(config, {})
        for m in best:
            best[m] = max(best[m], cert.at(m))
        self._at.clear()

    def add_lines(self, lines: dict) -> None:
        """``count_lines``' lines (possibly none): the kind of stage has its lines now."""
        self.lines = dict(lines)
        self._at.clear()

    def at(self, m: int) -> float:
        if m not in self._at:
            self._at[m] = min((max(self.config_at(config, m), self._line_at(config, m)) for config in self.certs),
                              default=-math.inf)
        return self._at[m]

    def _line_at(self, config, m: int) -> float:
        """The least over KV modes of (depth, slot) ``config``'s lines at ``m`` (stated seconds);
        -inf without lines."""
        modes = [line.at_ms(m) / MS for c, line in (self.lines or {}).items() if c[:2] == config]
        return min(modes, default=-math.inf)

    def config_at(self, config, m: int) -> float:
        """The best certificate of ``config`` at ``m`` layers (stated seconds)."""
        best = self._best[config]
        if m not in best:
            best[m] = max(c.at(m) for c in self.certs[config])
        return best[m]
