"""Synthetic routing statistics: skewed, per-layer-different profiles in the ``hetplan.routing``
format, for planning before a real run has been recorded and for benchmarking the solver.

Layer l's expert of Zipf rank r (1 = hottest) gets weight r^-s; the weights are scaled so that
the layer's fractions sum to top-k, a fraction above 1 (an expert every token would choose) is
capped at 1 and the excess shared among the others in proportion to their weights (repeated
until none exceeds 1). Each layer assigns ranks to expert ids by its own permutation, drawn
from ``numpy.random.default_rng(seed)``, so layers differ and the same seed writes the same
file. ``s = 0`` is uniform routing.

    python -m hetplan.routing_gen mixtral-8x7b -o stats.json --skew 1.0 --seed 0
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from hetplan.errors import HetplanError
from hetplan.model import ModelSpec
from hetplan.routing import RoutingStats, check_stats, routing_fingerprint, write_routing


def zipf_fractions(n_experts: int, top_k: int, skew: float) -> np.ndarray:
    """Fractions by rank (hottest first), proportional to r^-skew, capped at 1, summing to k."""
    w = np.arange(1, n_experts + 1, dtype=float) ** -skew
    f = np.zeros(n_experts)
    free = np.ones(n_experts, dtype=bool)
    for _ in range(n_experts):
        f[free] = w[free] * (top_k - f[~free].sum()) / w[free].sum()
        over = free & (f > 1.0)
        if not over.any():
            break
        f[over], free[over] = 1.0, False
    return f


def skewed_profile(spec: ModelSpec, skew: float = 1.0, seed: int = 0) -> RoutingStats:
    """Routing statistics for every MoE layer of ``spec``: Zipf(``skew``) fractions, ranks
    permuted per layer by a generator seeded with ``seed``."""
    if not spec.is_moe:
        raise HetplanError(f"model {spec.name!r} has no experts; routing statistics apply to MoE models only")
    if skew < 0:
        raise HetplanError(f"--skew {skew}: must be >= 0 (0 is uniform routing)")
    rng = np.random.default_rng(seed)
    by_rank = zipf_fractions(spec.n_experts, spec.experts_per_token, skew)
    layers = {}
    for l in range(spec.n_layers):
        if not spec.is_moe_layer(l):
            continue
        f = np.empty(spec.n_experts)
        f[rng.permutation(spec.n_experts)] = by_rank
        layers[l] = tuple(float(x) for x in f)
    stats = RoutingStats(routing_fingerprint(spec), layers)
    check_stats(stats, spec, source="generated routing")
    return stats


def main(argv=None) -> int:
    from hetplan.frontends import load_model

    ap = argparse.ArgumentParser(prog="python -m hetplan.routing_gen", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a preset name or a config.json")
    ap.add_argument("-o", "--output", required=True, help="where to write the statistics (JSON)")
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent (0 = uniform; default 1.0)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-layer permutations (default 0)")
    args = ap.parse_args(argv)
    try:
        write_routing(args.output, skewed_profile(load_model(args.model), args.skew, args.seed))
    except HetplanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
