"""Choosing pipeline stages: the DP against brute force over every split, on costs built by
hand and on tiny two-GPU problems solved by the single-GPU planner."""

import itertools
import math
import random

import pytest

from hetplan.solvers.pipeline import best_split, split_lower_bound
from hetplan.pipeline import pipeline_makespan_s


def brute_force(L, K, stage, link, objective):
    """Every ordered choice of GPUs (in index order) and every cut of [0, L) among them."""
    best = math.inf
    for m in range(1, min(K, L) + 1):
        for gpus in itertools.combinations(range(K), m):
            for cuts in itertools.combinations(range(1, L), m - 1):
                bounds = (0,) + cuts + (L,)
                parts = [stage(g, a, b) for g, a, b in zip(gpus, bounds, bounds[1:])]
                parts += [link(j, k) for j, k in zip(gpus, gpus[1:])]
                best = min(best, sum(parts) if objective == "sum" else max(parts))
    return best


def monotone_costs(rng, L, K):
    """Per layer seconds per GPU, a layer capacity per GPU, a fixed cost for holding the
    embedding (first stage) and the head (last stage): monotone in the layer count."""
    layer = [[rng.uniform(0.5, 2.0) for _ in range(L)] for _ in range(K)]
    cap = [rng.randint(1, L) for _ in range(K)]
    ends = [(rng.uniform(0, 1), rng.uniform(0, 1)) for _ in range(K)]
    links = {(j, k): rng.uniform(0, 1.5) for j in range(K) for k in range(K)}

    def stage(k, a, b):
        if b - a > cap[k]:
            return math.inf
        return sum(layer[k][a:b]) + (ends[k][0] if a == 0 else 0) + (ends[k][1] if b == L else 0)

    return stage, lambda j, k: links[j, k]


def random_case(seed: int, least_layers: int = 1) -> tuple:
    """(L, K, stage, link, the brute-force optimum) of a random monotone case."""
    rng = random.Random(seed)
    L, K = rng.randint(least_layers, 7), rng.randint(1, 4)
    stage, link = monotone_costs(rng, L, K)
    return L, K, stage, link, brute_force(L, K, stage, link, "sum"), brute_force(L, K, stage, link, "max")


@pytest.mark.parametrize("objective", ["sum", "max"])
@pytest.mark.parametrize("seed", range(40))
def test_the_dp_finds_the_cheapest_split_that_brute_force_finds(seed, objective):
    L, K, stage, link, *wants = random_case(seed)
    want = wants[objective == "max"]
    split = best_split(L, K, stage, link, objective)
    if want == math.inf:
        assert split is None
        return
    assert split.cost_s == pytest.approx(want, rel=1e-12)
    # the stages it names cover the layers in order and cost what it says
    bounds = [(a, b) for _, a, b in split.stages]
    assert bounds[0][0] == 0 and bounds[-1][1] == L and all(x[1] == y[0] for x, y in zip(bounds, bounds[1:]))
    gpus = [k for k, _, _ in split.stages]
    assert gpus == sorted(set(gpus))
    parts = [stage(*s) for s in split.stages] + [link(j, k) for j, k in zip(gpus, gpus[1:])]
    assert (sum(parts) if objective == "sum" else max(parts)) == pytest.approx(want, rel=1e-12)


def test_a_small_fast_gpu_takes_what_it_holds_and_the_slow_one_the_rest():
    # GPU 0: 1 s a layer, holds 2 layers; GPU 1: 2 s a layer, holds all 4; link 0.5 s.
    # Splits: GPU 1 alone 8 s; [0,1)+[1,4) 1+0.5+6 = 7.5 s; [0,2)+[2,4) 2+0.5+4 = 6.5 s.
    def stage(k, a, b):
        return math.inf if k == 0 and b - a > 2 else (b - a) * (1.0 if k == 0 else 2.0)

    split = best_split(4, 2, stage, lambda j, k: 0.5, "sum")
    assert split.stages == ((0, 0, 2), (1, 2, 4)) and split.cost_s == pytest.approx(6.5)
    # throughput: the slowest stage; [0,2)+[2,4) is max(2, 0.5, 4) = 4, GPU 1 alone 8
    assert best_split(4, 2, stage, lambda j, k: 0.5, "max").cost_s == pytest.approx(4.0)


@pytest.mark.parametrize("objective", ["sum", "max"])
@pytest.mark.parametrize("seed", range(20))
def test_a_ceiling_below_the_brute_force_optimum_stops_the_search_and_one_above_changes_nothing(seed, objective):
    L, K, stage, link, *wants = random_case(seed, 2)
    want = wants[objective == "max"]
    if want == math.inf:
        return
    lower = lambda k, a, b: 0.5 * stage(k, a, b)   # noqa: E731  a valid, loose bound: stages get priced
    free = best_split(L, K, stage, link, objective, lower)
    assert best_split(L, K, stage, link, objective, lower, ceiling=want * 1.001) == free
    stopped = best_split(L, K, stage, link, objective, lower, ceiling=want * 0.999)
    assert stopped.outclassed and want * 0.999 < stopped.cost_s <= want * (1 + 1e-12)
    assert stopped.priced <= free.priced


@pytest.mark.parametrize("objective", ["sum", "max"])
@pytest.mark.parametrize("seed", range(20))
def test_refined_bounds_find_the_brute_force_optimum_pricing_no_more_stages(seed, objective):
    L, K, stage, link, *wants = random_case(seed, 2)
    want = wants[objective == "max"]
    lower = lambda k, a, b: 0.5 * stage(k, a, b)   # noqa: E731
    free = best_split(L, K, stage, link, objective, lower)
    for refine in (lambda k, a, b: 0.99 * stage(k, a, b), lambda k, a, b: None, lambda k, a, b: 0.1):
        got = best_split(L, K, stage, link, objective, lower, refine=refine)
        if want == math.inf:
            assert got is None
            continue
        assert got.cost_s == pytest.approx(want, rel=1e-12)
        assert got.priced <= free.priced


@pytest.mark.parametrize("objective", ["sum", "max"])
@pytest.mark.parametrize("seed", range(20))
def test_bounds_learnt_from_refinements_and_prepared_batches_leave_the_dp_exact(seed, objective):
    """``learnt(key)`` rises as stages are refined (once a stage on GPU k was refined, every
    stage on k learns 0.9 x its price), and ``prepare`` sees every stage, one per key, before it
    is refined or priced: the optimum is brute force's."""
    L, K, stage, link, *wants = random_case(seed, 2)
    want = wants[objective == "max"]
    taught, prepared = set(), {True: set(), False: set()}

    def refine(k, a, b):
        assert (k, a, b) in prepared[True]
        taught.add(k)
        return 0.8 * stage(k, a, b)

    def priced(k, a, b):
        assert (k, a, b) in prepared[False]
        return stage(k, a, b)

    def prepare(stages, refining):
        assert len(set(stages)) == len(stages)
        prepared[refining].update(stages)

    def learnt(key):
        k, a, b = key
        return 0.9 * stage(k, a, b) if k in taught else -math.inf
    got = best_split(L, K, priced, link, objective, lambda k, a, b: 0.5 * stage(k, a, b), refine=refine,
                     learnt=learnt, prepare=prepare)
    if want == math.inf:
        assert got is None
        return
    assert got.cost_s == pytest.approx(want, rel=1e-12)
    assert prepared[True] and (taught or not prepared[False])


def test_learnt_bounds_spare_prices():
    """Over many cases, a search that learns (every stage on a refined stage's GPU bounded by
    0.99 x its price) prices fewer stages than one that only refines."""
    spent = {False: 0, True: 0}
    for seed in range(40):
        L, K, stage, link, *_ = random_case(seed, 3)
        for learns in (False, True):
            taught = set()

            def refine(k, a, b):
                taught.add(k)
                return 0.6 * stage(k, a, b)
            learnt = (lambda key: 0.99 * stage(*key) if key[0] in taught else -math.inf) if learns else None
            got = best_split(L, K, stage, link, "sum", lambda k, a, b: 0.5 * stage(k, a, b), refine=refine,
                             learnt=learnt)
            spent[learns] += got.priced if got else 0
    assert spent[True] < spent[False]


def test_nothing_fits_gives_no_split():
    assert best_split(3, 2, lambda k, a, b: math.inf, lambda j, k: 0.0) is None


def test_a_two_stage_pipeline_replays_to_its_hand_derived_makespan():
    # stage 2 s, link 0.5 s, stage 3 s; 4 micro-batches: the first takes 2 + 0.5 + 3 = 5.5 s,
    # each later one leaves the slowest resource (3 s) after the one before: 5.5 + 3 x 3 = 14.5 s
    assert pipeline_makespan_s([2.0, 0.5, 3.0], 4) == pytest.approx(14.5)
    # the bottleneck first: stage 3 s, then 2 s: 3 + 0.5 + 2 = 5.5 s, then +3 s each
    assert pipeline_makespan_s([3.0, 0.5, 2.0], 4) == pytest.approx(14.5)
    assert pipeline_makespan_s([1.0, 0.1, 1.0], 1) == pytest.approx(2.1)


def test_the_lazy_search_leaves_splits_unpriced_and_still_finds_the_best():
    # 40 equal layers, two equal GPUs holding 25 layers each: every split from 15/25 to 25/15
    # costs the same, the rest do not fit; with a bound of half a second a layer the search
    # prices fewer stages than the 2 x 39 + 1 of a full scan of every one-cut split
    priced = set()

    def stage(k, a, b):
        priced.add((k, a, b))
        return math.inf if b - a > 25 else float(b - a)

    split = best_split(40, 2, stage, lambda j, k: 0.25, "sum", lambda k, a, b: 0.5 * (b - a))
    assert len(priced) == split.priced < 2 * 39 + 1
    assert split.cost_s == pytest.approx(brute_force(40, 2, stage, lambda j, k: 0.25, "sum"))
    assert split.cost_s == pytest.approx(40.25)


@pytest.mark.parametrize("objective", ["sum", "max"])
@pytest.mark.parametrize("seed", range(30))
def test_a_cheap_lower_bound_and_stages_sharing_a_price_leave_the_dp_exact(seed, objective):
    # GPUs of two kinds; a stage's price depends on its GPU's kind, its layer count and which
    # ends it holds (what a caller's cache keys on), and each key is priced once
    rng = random.Random(1000 + seed)
    L, K = rng.randint(1, 7), rng.randint(1, 4)
    kind = [rng.randint(0, 1) for _ in range(K)]
    per_layer = [rng.uniform(0.5, 2.0) for _ in range(2)]
    cap = [rng.randint(1, L) for _ in range(2)]
    links = {(j, k): rng.uniform(0, 1.5) for j in range(K) for k in range(K)}

    def key(k, a, b):
        return kind[k], b - a, a == 0, b == L

    def stage(k, a, b):
        priced.append(key(k, a, b))
        _, n, embed, head = key(k, a, b)
        return math.inf if n > cap[kind[k]] else n * per_layer[kind[k]] + 0.3 * embed + 0.7 * head

    shrink, priced = {}, []

    def lower(k, a, b):  # any value <= the stage's price, fixed per stage (inf x 0 is no bound)
        f = shrink.setdefault((k, a, b), rng.choice([0.0, 0.5, 0.9, 1.0]))
        return 0.0 if f == 0.0 else stage(k, a, b) * f

    bounds = {(k, a, b): lower(k, a, b) for k in range(K) for a in range(L) for b in range(a + 1, L + 1)}
    priced = []
    split = best_split(L, K, stage, lambda j, k: links[j, k], objective, lambda *s: bounds[s], key)
    assert len(priced) == len(set(priced))
    want = brute_force(L, K, lambda *s: stage(*s), lambda j, k: links[j, k], objective)
    if want == math.inf:
        assert split is None
        return
    assert split.cost_s == pytest.approx(want, rel=1e-12)


def cheapest_splits(L, K, stage, link, objective):
    """(the least cost, every split costing that, ties to fewer stages), by enumeration."""
    every = {}
    for m in range(1, min(K, L) + 1):
        for gpus in itertools.combinations(range(K), m):
            for cuts in itertools.combinations(range(1, L), m - 1):
                bounds = (0,) + cuts + (L,)
                stages = tuple(zip(gpus, bounds, bounds[1:]))
                parts = [stage(*s) for s in stages] + [link(j, k) for j, k in zip(gpus, gpus[1:])]
                every[stages] = sum(parts) if objective == "sum" else max(parts)
    least = min(every.values())
    tied = [s for s, c in every.items() if c <= least * (1 + 1e-12)]
    fewest = min(len(s) for s in tied)
    return least, {s for s in tied if len(s) == fewest}


@pytest.mark.parametrize("objective", ["sum", "max"])
@pytest.mark.parametrize("seed", range(40))
def test_the_lazy_search_returns_the_split_the_exhaustive_one_returns(seed, objective):
    # random stage prices with no structure at all (not monotone in the layer count, some stages
    # not fitting) and a bound anywhere below each: without the monotone shortcut the search
    # must still name a split that enumerating every split finds cheapest
    rng = random.Random(5000 + seed)
    L, K = rng.randint(1, 8), rng.randint(1, 4)
    price = {(k, a, b): (math.inf if rng.random() < 0.15 else rng.uniform(0.1, 5.0))
             for k in range(K) for a in range(L) for b in range(a + 1, L + 1)}
    links = {(j, k): rng.uniform(0, 1.0) for j in range(K) for k in range(K)}
    shrink = {s: rng.uniform(0, 1) for s in price}
    priced = []

    def stage(k, a, b):
        priced.append((k, a, b))
        return price[k, a, b]

    split = best_split(L, K, stage, lambda j, k: links[j, k], objective,
                       lambda k, a, b: price[k, a, b] * shrink[k, a, b] if price[k, a, b] < math.inf else 0.0,
                       monotone=False)
    cost, splits = cheapest_splits(L, K, lambda *s: price[s], lambda j, k: links[j, k], objective)
    if cost == math.inf:
        assert split is None
        return
    # the same split (one of them where several cost the same: common under "max")
    assert split.stages in splits and split.cost_s == pytest.approx(cost, rel=1e-12)
    assert len(set(priced)) == len(priced)  # no stage priced twice


def test_llama_cpp_splits_layer_slots_by_cumulative_free_memory():
    from hetplan.solvers.split_mode import layer_stages, tensor_split

    assert tensor_split([1, 3]) == [0.25, 1.0]
    # 4 layers + the output slot = 5 slots; slot il goes to the first device with split > il / 5:
    # 0/5 and 1/5 < 0.25 -> device 0; 2/5, 3/5 (and the output, 4/5) -> device 1
    assert layer_stages(4, [1, 3]) == ((0, 0, 2), (1, 2, 4))
    # two equal cards, 80 layers: 81 slots, il / 81 < 0.5 for il <= 40 -> 41 layers on the first
    assert layer_stages(80, [23, 23]) == ((0, 0, 41), (1, 41, 80))
    # slot 0 (0 / 3) goes to the first device with any share; one with none gets no stage
    assert layer_stages(2, [1, 100, 1]) == ((0, 0, 1), (1, 1, 2))
    assert layer_stages(2, [0, 1]) == ((1, 0, 2),)


@pytest.mark.parametrize("objective", ["sum", "max"])
@pytest.mark.parametrize("seed", range(30))
def test_the_split_lower_bound_is_brute_force_over_the_bounds(seed, objective):
    # the cheapest split at the lower bounds: brute force over every split priced at the bounds,
    # at most the cheapest split at the true prices, and equal to it when the bounds are exact
    rng = random.Random(2000 + seed)
    L, K = rng.randint(1, 7), rng.randint(1, 4)
    stage, link = monotone_costs(rng, L, K)
    shrink = {(k, a, b): rng.choice([0.0, 0.5, 0.9, 1.0]) for k in range(K) for a in range(L)
              for b in range(a + 1, L + 1)}

    def lower(k, a, b):
        f = shrink[k, a, b]
        return 0.0 if f == 0.0 else stage(k, a, b) * f

    got = split_lower_bound(L, K, link, objective, lower)
    assert got == pytest.approx(brute_force(L, K, lower, link, objective), rel=1e-12)
    assert got <= brute_force(L, K, stage, link, objective) * (1 + 1e-12)
    assert split_lower_bound(L, K, link, objective, stage) == pytest.approx(brute_force(L, K, stage, link, objective),
                                                                            rel=1e-12)


def test_a_refined_bound_raises_the_stages_that_contain_it():
    """Refined to its price, a stage bounds every stage containing it on the same GPU (prices
    never fall as a stage grows): the search refines fewer stages than without that (``monotone``
    off), and prices only the optimum's. The flat case of the test before: every split from
    15/25 to 25/15 costs the same."""
    def stage(k, a, b):
        return math.inf if b - a > 25 else float(b - a)

    counts = {}
    for monotone in (True, False):
        refined = []

        def refine(k, a, b):
            refined.append((k, a, b))
            return stage(k, a, b)
        split = best_split(40, 2, stage, lambda j, k: 0.25, "sum", lambda k, a, b: 0.5 * (b - a),
                           monotone=monotone, refine=refine)
        assert split.cost_s == pytest.approx(40.25) and split.priced == len(split.stages)
        counts[monotone] = len(refined)
    assert counts[True] < counts[False]


@pytest.mark.parametrize("objective", ["sum", "max"])
@pytest.mark.parametrize("seed", range(30))
def test_a_gap_returns_a_split_of_priced_stages_within_it_of_brute_force(seed, objective):
    """``gap``: the split returned costs what it says (its stages priced) and at most ``1 + gap``
    times brute force's optimum, with bounds a hair below the prices and a learnt bound that
    rises as stages are priced."""
    L, K, stage, link, *wants = random_case(seed, 2)
    want = wants[objective == "max"]
    gap, priced_gpus = 0.05, set()

    def priced(k, a, b):
        priced_gpus.add(k)
        return stage(k, a, b)

    def learnt(key):   # once a stage on GPU k was priced, each stage on k is known to 0.98 of its price
        return 0.98 * stage(*key) if key[0] in priced_gpus else -math.inf
    got = best_split(L, K, priced, link, objective, lambda k, a, b: 0.5 * stage(k, a, b), learnt=learnt, gap=gap)
    if want == math.inf:
        assert got is None
        return
    gpus = [k for k, _, _ in got.stages]
    parts = [stage(*s) for s in got.stages] + [link(j, k) for j, k in zip(gpus, gpus[1:])]
    assert (sum(parts) if objective == "sum" else max(parts)) == pytest.approx(got.cost_s, rel=1e-12)
    assert want * (1 - 1e-12) <= got.cost_s <= want * (1 + gap)


def test_where_every_split_costs_the_same_a_gap_prices_one_and_an_exact_search_them_all():
    """40 equal layers over two equal GPUs of 25 layers each: every split from 15/25 to 25/15
    costs the same. Once a stage is priced every stage of its GPU is known to 1e-6 of its price
    (a line through the count MILPs, learnt from that price): within a gap of 1e-4, the first
    split priced is returned; an exact search prices every split the bounds leave open."""
    def stage(k, a, b):
        return math.inf if b - a > 25 else float(b - a)

    def search(gap):
        seen = set()

        def priced(k, a, b):
            seen.add(k)
            return stage(k, a, b)

        def learnt(key):
            return (1 - 1e-6) * stage(*key) if key[0] in seen else -math.inf
        return best_split(40, 2, priced, lambda j, k: 0.25, "sum", lambda k, a, b: 0.5 * (b - a),
                          learnt=learnt, gap=gap)
    loose, exact = search(1e-4), search(0.0)
    # both first price each GPU alone (40 layers at half a second a layer, no link: cheapest
    # at the bounds; they do not fit), then one split of two stages; the exact search every one
    assert loose.priced == 2 + 2 and len(loose.stages) == 2
    assert exact.priced == 2 + 2 * 11
    assert loose.cost_s == exact.cost_s == pytest.approx(40.25)
