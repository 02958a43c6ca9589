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

- ``key(k, a, b)``: stages with equal keys cost the same (equal GPUs, equal layers), so a price
  learnt for one serves them all;
- with ``monotone=True`` (a stage's price never decreases as it takes more layers, which an
  exact single-device solve satisfies: a plan for more layers, less one, still runs), every
  stage costs at least the dearest priced stage it contains on the same GPU.

Ties (costs within ``TIE``) go to fewer stages, then to the smaller slowest stage or link.

A ``refine`` bound (tighter than ``lower``, cheaper than a price) is taken for a stage of the
optimistic optimum before it is priced: the DP runs again, and only a stage still in the optimum
at its refined bound is priced. Where refining rarely tightens a bound (more than
``REFINE_SLACK`` wasted refinements beyond the useful ones), the search stops refining.

With a ``gap`` (relative), the search stops as soon as a split it priced (an optimistic optimum
of an earlier round) costs at most ``1 + gap`` times the optimistic optimum: no split is cheaper
by more than that. It returns the best split of priced stages (ties broken as below). Stage
prices that are MILPs solved to a relative gap are only that exact, and where many splits cost
the same (layers beyond HBM, each adding the same seconds wherever it goes) but their bounds lie
a hair below their prices, an exact search would price every one of them.

With a ``ceiling``, the search stops as soon as the optimistic optimum exceeds it: every split
costs more, and the caller (weighing several searches) has one at least that good already.

``split_lower_bound`` runs the same DP on the lower bounds alone, pricing nothing: every split
costs at least its cost at the bounds, so the cheapest split at the bounds bounds them all. A
caller comparing several searches (e.g. replica counts) skips one whose bound cannot win.
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
    """How many stages the search priced (called ``stage`` on; one per key)."""

    @property
    def outclassed(self) -> bool:
        """No stages: the search stopped at its ``ceiling``; every split costs at least
        ``cost_s``, which is above it."""
        return not self.stages


def best_split(n_layers: int, n_gpus: int, stage: Callable, link: Callable, objective: str = "sum",
               lower: Callable | None = None, key: Callable | None = None,
               monotone: bool = True, ceiling: float = math.inf, refine: Callable | None = None,
               learnt: Callable | None = None, prepare: Callable | None = None, gap: float = 0.0) -> Split | None:
    """The cheapest split of ``n_layers`` layers over GPUs ``0..n_gpus-1``; None when none fits;
    an ``outclassed`` Split when every split costs more than ``ceiling`` (module docstring).
    ``refine(k, a, b)``: a tighter lower bound than ``lower``, dearer than it and cheaper than
    ``stage`` (or None: none); a stage of the optimistic optimum is refined before it is priced.
    ``lower(k, a, b)``: a cheap lower bound on ``stage(k, a, b)`` (default 0); ``key(k, a, b)``:
    stages with equal keys cost the same (equal GPUs, equal layers), so one is priced for all;
    ``monotone``: prices never decrease as a stage takes more layers (module docstring);
    ``learnt(key)``: a lower bound on the stages of ``key`` that refinements of other stages
    teach (it may rise as ``refine`` runs, and as stages are priced), asked again for every key
    after each round of refinements or prices; ``prepare(stages, refining)``: called
    with the stages (one per key) about to be refined (``refining``) or priced, before they are,
    so that the caller may compute them together (side by side) and answer the calls that follow
    from what it kept; ``gap``: a split of priced stages within this relative gap of the
    optimistic optimum is returned (module docstring; 0: only the optimum)."""
    if objective not in ("sum", "max"):
        raise ValueError(f"objective must be 'sum' or 'max', got {objective!r}")
    L, K = n_layers, n_gpus
    keys, bound = {}, {}   # stage -> its key, its lower bound
    for k in range(K):
        for a in range(L):
            for b in range(a + 1, L + 1):
                keys[k, a, b] = key(k, a, b) if key else (k, a, b)
                bound[k, a, b] = lower(k, a, b) if lower else 0.0
    links = {(j, k): link(j, k) for k in range(K) for j in range(k)}
    stages_of: dict = {}  # key -> its stages
    for s, x in keys.items():
        stages_of.setdefault(x, []).append(s)
    price: dict = {}  # key -> seconds
    refined: dict = {}  # key -> the tighter lower bound (``refine``)
    useful = {True: 0, False: 0}  # refinements that raised a bound by more than REFINED, and not
    taught: dict = {}  # key -> ``learnt``'s bound
    # the optimistic cost of every stage, opt[k][a][b]: its price where known, else the best of its
    # bounds; known[k][a][b], that cost where its key was priced or refined (else -inf), which
    # raises the stages containing it (``monotone``); both changed only where a key's value does
    opt = [[[math.inf] * (L + 1) for _ in range(L + 1)] for _ in range(K)]
    known = [[[-math.inf] * (L + 1) for _ in range(L + 1)] for _ in range(K)]
    for (k, a, b), v in bound.items():
        opt[k][a][b] = v
    level: dict = {}  # key -> (value, priced) its stages were last set at
    settled = (math.inf, ())   # the cheapest optimistic optimum priced so far, at its price (``gap``)
    exact = [[[math.inf] * (L + 1) for _ in range(L + 1)] for _ in range(K)]   # priced stages alone

    def lift(changed) -> None:   # the stages of keys whose price or bounds may have changed
        for x in changed:
            now = (price[x], True) if x in price else (max(refined.get(x, -math.inf), taught.get(x, -math.inf)), False)
            if level.get(x, (-math.inf, False)) != now:
                level[x] = now
                v, priced = now
                for k, a, b in stages_of[x]:
                    opt[k][a][b] = v if priced else max(bound[k, a, b], v)
                    if priced:
                        exact[k][a][b] = v
            if x in price or x in refined:
                for k, a, b in stages_of[x]:
                    known[k][a][b] = opt[k][a][b]

    def relearn(changed) -> None:   # after refining or pricing the keys ``changed``
        nonlocal taught
        if learnt is not None:   # every key may have learnt from them
            taught = {x: learnt(x) for x in stages_of}
            changed = stages_of
        lift(changed)

    while True:
        cost, stages = _cheapest(_raised(opt, known, L, K) if monotone else opt, links, L, K, objective)
        if not stages:
            return None
        if cost > ceiling:
            return Split((), cost, len(price))
        unpriced = [s for s in stages if keys[s] not in price]
        if not unpriced:
            return Split(stages, cost, len(price))
        if settled[1] and settled[0] <= cost * (1 + gap):   # the best split of priced stages, ties as ever
            done, stages = _cheapest(exact, links, L, K, objective)
            return Split(stages, done, len(price))
        rough = _one_per_key([s for s in unpriced if refine is not None and keys[s] not in refined], keys)
        if rough:
            if prepare is not None:
                prepare(rough, True)
            for s in rough:
                if keys[s] not in refined:
                    tighter = refine(*s)
                    refined[keys[s]] = -math.inf if tighter is None else tighter
                    if tighter != math.inf:   # (what does not fit costs no solve either)
                        useful[tighter is not None and tighter > bound[s] * REFINED] += 1
            if useful[False] > useful[True] + REFINE_SLACK:   # it rarely tightens here: price instead
                refine = None
            relearn({keys[s] for s in rough})
            continue
        if prepare is not None:
            prepare(_one_per_key(unpriced, keys), False)
        for s in unpriced:
            if keys[s] not in price:
                price[keys[s]] = stage(*s)
        relearn({keys[s] for s in unpriced})   # what the prices taught (``prepare`` may learn from them too)
        if gap > 0:
            done = _priced_cost(stages, price, keys, links, objective)
            if done < settled[0]:
                settled = (done, stages)


def _priced_cost(stages: tuple, price: dict, keys: dict, links: dict, objective: str) -> float:
    """The cost of the split ``stages``, every one of them priced."""
    gpus = [k for k, _, _ in stages]
    parts = [price[keys[s]] for s in stages] + [links[j, k] for j, k in zip(gpus, gpus[1:])]
    return sum(parts) if objective == "sum" else max(parts)


def _one_per_key(stages: list, keys: dict) -> list:
    """``stages`` less those whose key an earlier one has."""
    first: dict = {}
    for s in stages:
        first.setdefault(keys[s], s)
    return list(first.values())


def split_lower_bound(n_layers: int, n_gpus: int, link: Callable, objective: str, lower: Callable,
                      key: Callable | None = None) -> float:
    """A lower bound on the cost of every split of ``n_layers`` layers over GPUs
    ``0..n_gpus-1`` (``best_split``'s, for any ``stage`` that ``lower`` bounds), with no stage
    priced: the DP's optimum over ``lower``'s values; ``math.inf`` when every bound is.
    ``key``: as ``best_split``'s; ``lower`` is asked once per key."""
    if objective not in ("sum", "max"):
        raise ValueError(f"objective must be 'sum' or 'max', got {objective!r}")
    L, K = n_layers, n_gpus
    by_key: dict = {}
    cost = [[[math.inf] * (L + 1) for _ in range(L + 1)] for _ in range(K)]
    for k in range(K):
        for a in range(L):
            for b in range(a + 1, L + 1):
                x = key(k, a, b) if key else (k, a, b)
                if x not in by_key:
                    by_key[x] = lower(k, a, b)
                cost[k][a][b] = by_key[x]
    links = {(j, k): link(j, k) for k in range(K) for j in range(k)}
    return _cheapest(cost, links, L, K, objective)[0]


def _raised(cost: list, known: list, L: int, K: int) -> list:
    """``cost`` (``cost[k][a][b]``) with each stage raised to the dearest ``known`` stage it
    contains on the same GPU, ``m(a, b) = max(known(a, b), m(a+1, b), m(a, b-1))``, shortest
    stages first; a GPU with no known stage is ``cost``'s own rows (not copied)."""
    out = []
    for k in range(K):
        kk = known[k]
        if all(v == -math.inf for row in kk for v in row):
            out.append(cost[k])
            continue
        rows = [list(row) for row in cost[k]]
        inner = [list(row) for row in kk]   # inner[a][b] = m(a, b)
        for n in range(2, L + 1):
            for a in range(L - n + 1):
                b = a + n
                m = max(inner[a][b], inner[a + 1][b], inner[a][b - 1])
                inner[a][b] = m
                if m > rows[a][b]:
                    rows[a][b] = m
        out.append(rows)
    return out


def _cheapest(cost: list, links: dict, L: int, K: int, objective: str) -> tuple:
    """The DP of the module docstring over ``cost`` (``cost[k][a][b]``) -> (seconds, stages);
    (inf, ()) when every split costs inf. ``into[a][k]`` is the bracket: the cheapest way to hand
    layer ``a`` to GPU ``k`` from an earlier GPU. Costs within ``TIE`` of each other tie; ties go
    to fewer stages, then to the smaller slowest part (balanced stages: the same latency, a faster
    pipeline)."""
    inf = math.inf
    none = (inf, 0, inf, ())
    best = [[none] * K for _ in range(L + 1)]  # best[b][k]: (seconds, n stages, slowest part, stages)
    into = [[none] * K for _ in range(L + 1)]
    total = objective == "sum"
    for b in range(1, L + 1):
        for k in range(K):
            ck = cost[k]
            c = ck[0][b]
            top = (c, 1, c, ((k, 0, b),))
            for a in range(1, b):
                c = ck[a][b]
                t, n, m, st = into[a][k]
                if t == inf or c == inf:
                    continue
                x = t + c if total else (t if t >= c else c)
                if 0 <= top[0] < inf and x > top[0] * (1 + TIE):   # worse beyond a tie (``_better``)
                    continue
                cand = (x, n + 1, m if m >= c else c, st + ((k, a, b),))
                if _better(cand, top):
                    top = cand
            best[b][k] = top
        for k in range(1, K):
            here = none
            for j in range(k):
                t, n, m, st = best[b][j]
                if t == inf:
                    continue
                hop = links[j, k]
                cand = (t + hop if total else max(t, hop), n, max(m, hop), st)
                if _better(cand, here):
                    here = cand
            into[b][k] = here
    top = none
    for k in range(K):
        if _better(best[L][k], top):
            top = best[L][k]
    return (top[0], top[3]) if top[0] < inf else (inf, ())


REFINED = 1.05
"""A refinement that raises a stage's bound by less than this factor counts as wasted."""
REFINE_SLACK = 3
"""Wasted refinements beyond the useful ones after which a search stops refining (it prices
instead: the same split, found with fewer cheap bounds where they do not tighten)."""

TIE = 1e-12
"""Relative difference below which two costs are equal (sums in another order round apart)."""


def _better(x: tuple, y: tuple) -> bool:
    """``x`` (seconds, stages used, slowest part, ...) before ``y``: cheaper beyond ``TIE``, else
    fewer stages, else a smaller slowest part."""
    if x[0] < y[0] * (1 - TIE) or y[0] == math.inf:
        return x[0] < y[0]
    if x[0] > y[0] * (1 + TIE):
        return False
    return x[1:3] < y[1:3]
