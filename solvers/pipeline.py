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
``best(lo, j) (+) link (+) stage(k, hi, b)``, and an interval whose bound is no better than
the best found is dropped unpriced. This is exact when a stage's price is monotone in its layer
count, which an exact single-device solve is (a plan for more layers, less one, still runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable


@dataclass(frozen=True)
class Split:
    stages: tuple
    """(gpu, first_layer, end_layer) per used GPU, in pipeline order."""
    cost_s: float


def combine(objective: str, *parts: float) -> float:
    return sum(parts) if objective == "sum" else max(parts)


def best_split(n_layers: int, n_gpus: int, stage: Callable, link: Callable, objective: str = "sum") -> Split | None:
    """The cheapest split of ``n_layers`` layers over GPUs ``0..n_gpus-1``; None when none fits."""
    if objective not in ("sum", "max"):
        raise ValueError(f"objective must be 'sum' or 'max', got {objective!r}")

    @lru_cache(maxsize=None)
    def best(b: int, k: int) -> tuple:
        """(cost, stages) of layers [0, b) ending on GPU k."""
        top = (stage(k, 0, b), ((k, 0, b),))
        for j in range(k):
            top = min(top, _after(b, k, j, top), key=lambda c: c[0])
        return top

    def _after(b, k, j, top) -> tuple:
        """The best of ``best(a, j) (+) link(j, k) (+) stage(k, a, b)`` over 0 < a < b that
        beats ``top`` (else ``top``)."""
        l = link(j, k)

        def cost(a):
            return combine(objective, best(a, j)[0], l, stage(k, a, b))

        def bound(lo, hi):
            return combine(objective, best(lo, j)[0], l, stage(k, hi, b))

        def consider(a, top):
            c = cost(a)
            return (c, best(a, j)[1] + ((k, a, b),)) if c < top[0] else top

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

    cost, stages = min((best(n_layers, k) for k in range(n_gpus)), key=lambda c: c[0])
    return Split(stages, cost) if cost < math.inf else None
