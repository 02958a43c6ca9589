"""Pipeline stages: which GPU runs which contiguous range of layers, by dynamic programming.

A pure function of two callables: ``stage(k, a, b)`` prices layers ``[a, b)`` on GPU ``k``
(the single-device plan of that range, solved elsewhere; ``math.inf`` when it does not fit) and
``link(j, k)`` prices handing the activations from GPU ``j``'s stage to GPU ``k``'s. Knows
nothing about models or plans.

Stages run on GPUs in index order; a GPU may be left idle. Two objectives:

- ``sum`` (one sequence, batch-1 latency): a token crosses every stage in turn, so
  ``T = sum_stages stage_s + sum_links link_s``;
- ``max`` (throughput with at least as many micro-batches in flight as stages): the pipeline
  runs at its slowest stage or link, ``T = max(stage_s, link_s)``.

The recurrence, over ``best(b, k)`` = the cheapest way to run layers ``[0, b)`` with GPU ``k``
the last one used (``(+)`` is ``+`` or ``max``)::

    best(b, k) = min( stage(k, 0, b),
                      min_{j < k, 0 < a < b} best(a, j) (+) link(j, k) (+) stage(k, a, b) )

Pricing a stage is a solve, so the inner minimum over ``a`` is a branch and bound: ``best(a, j)``
never decreases as ``a`` grows (more layers before) and ``stage(k, a, b)`` never increases
(fewer layers in it), so on an interval ``[lo, hi]`` of ``a`` every candidate costs at least
``min_{j' <= j} best(lo, j') (+) link (+) stage(k, hi, b)``, and an interval whose bound is no better than
the best found is dropped unpriced. This is exact when a stage's price is monotone in its layer
count, which an exact single-device solve is (a plan for more layers, less one, still runs);
``best(lo, j)`` in that bound is the least over GPUs ``<= j`` (see ``bound``).

Pricing a stage is the expensive step, so an optional ``lower(k, a, b)`` (a cheap lower bound on
``stage(k, a, b)``, e.g. bytes over bandwidth) is tried first wherever a stage's price would
bound a candidate or an interval: ``lower(k, hi, b) <= stage(k, hi, b) <= stage(k, a, b)`` for
``a <= hi``, so a candidate or interval it rules out is dropped without a solve. The single
stage ``[0, b)`` on GPU ``k`` is priced last, only when its bound can still win. Exact for any
valid ``lower``; without one, ``stage`` bounds itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Split:
    stages: tuple
    """(gpu, first_layer, end_layer) per used GPU, in pipeline order."""
    cost_s: float


def combine(objective: str, *parts: float) -> float:
    return sum(parts) if objective == "sum" else max(parts)


def best_split(n_layers: int, n_gpus: int, stage: Callable, link: Callable, objective: str = "sum",
               lower: Callable | None = None, seed: tuple = ()) -> Split | None:
    """The cheapest split of ``n_layers`` layers over GPUs ``0..n_gpus-1``; None when none fits.
    ``lower(k, a, b)``: a cheap lower bound on ``stage(k, a, b)`` (default: ``stage`` itself).
    ``seed``: a split ((gpu, first, end) per stage) priced first, so that the search starts with
    an incumbent and prices no stage that cannot beat it."""
    if objective not in ("sum", "max"):
        raise ValueError(f"objective must be 'sum' or 'max', got {objective!r}")
    lower = lower or stage
    memo: dict = {}

    def best(b: int, k: int, cutoff: float) -> tuple:
        """(cost, stages) of layers [0, b) ending on GPU k when it costs less than ``cutoff``,
        else (inf, ()): every part of a split costs >= 0, so a prefix no cheaper than the
        incumbent cannot lead to a better split. Memoised with the cutoff it was searched under."""
        if (b, k) in memo:
            found, searched = memo[b, k]
            if found[0] < math.inf or cutoff <= searched:
                return found
        top = (cutoff, ())
        for j in range(k):
            top = _after(b, k, j, top)
        if lower(k, 0, b) <= top[0]:
            alone = stage(k, 0, b)
            if alone < math.inf and (alone <= top[0] if top[1] else alone < top[0]):  # a tie: fewer stages
                top = (alone, ((k, 0, b),))
        found = top if top[1] else (math.inf, ())
        memo[b, k] = (found, cutoff)
        return found

    def _after(b, k, j, top) -> tuple:
        """The best of ``best(a, j) (+) link(j, k) (+) stage(k, a, b)`` over 0 < a < b that
        beats ``top`` (else ``top``)."""
        l = link(j, k)

        def prefix(a):
            return best(a, j, top[0])

        def bound(lo, hi):
            """A lower bound on every candidate in [lo, hi]: the cheap one first, the stage's
            price when the cheap one cannot rule the interval out. ``best(a, j)`` itself need not
            grow with ``a`` (a one-layer last stage dropped leaves a split ending on another GPU),
            but cut at ``lo`` any split of [0, a) ending on GPU j leaves a split of [0, lo) ending
            on some GPU <= j, no dearer: ``best(a, j) >= min_{j' <= j} best(lo, j')``."""
            before = min(best(lo, i, top[0])[0] for i in range(j + 1))
            cheap = combine(objective, before, l, lower(k, hi, b))
            return cheap if cheap >= top[0] else combine(objective, before, l, stage(k, hi, b))

        def consider(a, top):
            if combine(objective, prefix(a)[0], l, lower(k, a, b)) >= top[0]:
                return top
            c = combine(objective, prefix(a)[0], l, stage(k, a, b))
            return (c, prefix(a)[1] + ((k, a, b),)) if c < top[0] else top

        pending = [(1, b - 1)] if b > 1 else []
        while pending:
            lo, hi = pending.pop()
            if bound(lo, hi) >= top[0]:
                continue
            if hi - lo <= 1:
                for a in sorted({lo, hi}):
                    top = consider(a, top)
                continue
            # the middle split is priced anyway by its halves' bounds: take it as a candidate,
            # then search the half with the lower bound first
            mid = (lo + hi) // 2
            top = consider(mid, top)
            halves = sorted([(lo, mid), (mid, hi)], key=lambda h: -bound(*h))
            pending += halves
        return top

    incumbent = (math.inf, ())
    if seed:
        parts = [stage(*s) for s in seed] + [link(j, k) for (j, _, _), (k, _, _) in zip(seed, seed[1:])]
        incumbent = (combine(objective, *parts), tuple(seed))
    for k in range(n_gpus):
        found = best(n_layers, k, incumbent[0])  # only what beats the incumbent
        if found[1] and found[0] < incumbent[0]:
            incumbent = found
    cost, stages = incumbent
    return Split(stages, cost) if cost < math.inf else None
