"""Pipeline stages: which GPU runs which contiguous range of layers, by dynamic programming.

A pure function of callables: ``stage(k, a, b)`` prices layers ``[a, b)`` on GPU ``k`` (the
single-device plan of that range, solved elsewhere; ``math.inf`` when it does not fit),
``link(j, k)`` prices handing the activations from GPU ``j``'s stage to GPU ``k``'s, and
``lower(k, a, b)`` is a cheap lower bound on ``stage(k, a, b)``. Knows nothing about models or
plans.

Stages run on GPUs in index order; a GPU may be left idle. Two objectives:

- ``sum`` (one sequence, batch-1 latency): a token crosses every stage in turn, so
  ``T = sum_stages stage_s + sum_links link_s``;
- ``max`` (throughput with at least as many micro-batches in flight as stages): the pipeline
  runs at its slowest stage or link, ``T = max(stage_s, link_s)``.

The recurrence, over ``best(b, k)`` = the cheapest way to run layers ``[0, b)`` with GPU ``k``
the last one used (``(+)`` is ``+`` or ``max``)::

    best(b, k) = min( stage(k, 0, b),
                      min_{0 < a < b} [ min_{j < k} best(a, j) (+) link(j, k) ] (+) stage(k, a, b) )

Pricing a stage is a solve, so the search is lazy: the DP runs on *optimistic* prices, a
stage's price where it is known and its lower bound where not. Every split costs at least its
optimistic cost (``(+)`` never decreases when a part grows), so when the optimistic optimum
is made of priced stages only, its cost is its true cost and no split is cheaper: it is the
optimum. Otherwise its unpriced stages are priced and the DP runs again. Exact for any valid
``lower``; the tighter it is, the fewer stages are priced. Two things tighten it for free:

- ``known(k, a, b)``: a stage's price when it costs nothing to know (the caller's cache: equal
  GPUs share prices), so that a price learnt on one GPU serves all of its kind;
- with ``monotone=True`` (a stage's price never decreases as it takes more layers, which an
  exact single-device solve satisfies: a plan for more layers, less one, still runs), every
  stage costs at least the dearest priced stage it contains on the same GPU.

Ties go to fewer stages.
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
    priced: int = 0
    """How many stages the search priced (called ``stage`` on)."""


def combine(objective: str, *parts: float) -> float:
    return sum(parts) if objective == "sum" else max(parts)


def best_split(n_layers: int, n_gpus: int, stage: Callable, link: Callable, objective: str = "sum",
               lower: Callable | None = None, known: Callable | None = None,
               monotone: bool = True) -> Split | None:
    """The cheapest split of ``n_layers`` layers over GPUs ``0..n_gpus-1``; None when none fits.
    ``lower(k, a, b)``: a cheap lower bound on ``stage(k, a, b)`` (default 0); ``known(k, a, b)``:
    the stage's price when the caller already holds it, else None; ``monotone``: prices never
    decrease as a stage takes more layers (see the module docstring)."""
    if objective not in ("sum", "max"):
        raise ValueError(f"objective must be 'sum' or 'max', got {objective!r}")
    L, K = n_layers, n_gpus
    bound = {(k, a, b): (lower(k, a, b) if lower else 0.0)
             for k in range(K) for a in range(L) for b in range(a + 1, L + 1)}
    links = {(j, k): link(j, k) for k in range(K) for j in range(k)}
    price: dict = {}
    calls = 0
    while True:
        if known is not None:
            for s in bound:
                if s not in price:
                    got = known(*s)
                    if got is not None:
                        price[s] = got
        optimistic = _optimistic(bound, price, L, K, monotone)
        cost, stages = _cheapest(optimistic, links, L, K, objective)
        if not stages:
            return None
        unpriced = [s for s in stages if s not in price]
        if not unpriced:
            return Split(stages, cost, calls)
        for s in unpriced:
            price[s] = stage(*s)
            calls += 1


def _optimistic(bound: dict, price: dict, L: int, K: int, monotone: bool) -> dict:
    """Each stage's price where known, else its lower bound, raised (``monotone``) to the
    dearest priced stage it contains on the same GPU: ``m(a, b) = max(price(a, b), m(a+1, b),
    m(a, b-1))`` over the priced ones, shortest stages first."""
    out = {s: price.get(s, v) for s, v in bound.items()}
    if not monotone:
        return out
    for k in range(K):
        inner: dict = {}
        for n in range(1, L + 1):
            for a in range(L - n + 1):
                b = a + n
                m = price.get((k, a, b), -math.inf)
                if n > 1:
                    m = max(m, inner[a + 1, b], inner[a, b - 1])
                inner[a, b] = m
                if m > out[k, a, b]:
                    out[k, a, b] = m
    return out


def _cheapest(cost: dict, links: dict, L: int, K: int, objective: str) -> tuple:
    """The DP of the module docstring over ``cost`` -> (seconds, stages); (inf, ()) when every
    split costs inf. Ties go to fewer stages, then to the first found."""
    inf = (math.inf, 0, ())
    best = [[inf] * K for _ in range(L + 1)]  # best[b][k]: (seconds, n stages, stages)
    for b in range(1, L + 1):
        for k in range(K):
            top = (cost[k, 0, b], 1, ((k, 0, b),))
            for a in range(1, b):
                c = cost[k, a, b]
                if c == math.inf:
                    continue
                before = inf
                for j in range(k):
                    t, n, st = best[a][j]
                    if t == math.inf:
                        continue
                    cand = (combine(objective, t, links[j, k]), n, st)
                    if cand[:2] < before[:2]:
                        before = cand
                if before[0] == math.inf:
                    continue
                cand = (combine(objective, before[0], c), before[1] + 1, before[2] + ((k, a, b),))
                if cand[:2] < top[:2]:
                    top = cand
            best[b][k] = top
    t, _, stages = min((best[L][k] for k in range(K)), key=lambda x: x[:2])
    return (t, stages) if t < math.inf else (math.inf, ())
