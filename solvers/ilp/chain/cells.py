"""Plans for the chain DP (``chain.dp``) from a shortest path over (block, option, HBM cells).

Where keeping part of a block resident does not pay until most of it is (a MoE block whose split
runs its cold experts on a slow CPU, beside streaming the whole block), the Lagrangian's paths
spread memory over every block, and the plan it leaves (the path that fits, improved one option
at a time) can sit several percent above the optimum: too far for the forward DP's fronts to
close the gap within their limit. This search sees the memory row through whole blocks: on a
grid of q = U / ``CELLS`` bytes each option weighs w(o) = floor(Y(o) / q) cells and leaves a
residue r(o) = Y(o) - q w(o) < q, and

    g[b][o, u] = min over completions after block b (in option o) using exactly u cells of
                 their cost + lam * (their residues, per GiB),

solved backwards like ``Chain.cost_to_go``. The path of least g with u cells in all holds
q u + its residues bytes: near the top of the grid, the residues priced by lam, those paths are
plans that fill the GPU with whole blocks. Only plans come out of it (each checked against the
row with its true bytes), never a bound.

Knows the chain's pair terms and memory (``chain.Chain``); knows nothing about the search.
"""

from __future__ import annotations

import numpy as np

CELLS = 1024
"""Cells of the HBM grid."""
TOPS = 64
"""Cell totals tried, from the top of the grid down."""


def cell_plans(chain, lam: float, cells: int = CELLS, tops: int = TOPS) -> list:
    """[(options, cost)] of the least paths with u cells for the ``tops`` largest u, those that
    fit; lam: the memory row's multiplier (per GiB)."""
    if chain.upper <= 0:
        return []
    q = chain.upper / cells
    weight = [np.floor(y / q).astype(int) for y in chain.y]
    price = [(lam / (1 << 30)) * (y - q * w) for y, w in zip(chain.y, weight)]
    u = np.arange(cells + 1)

    def entering(g, i):
        """[o, u] -> g[i][o, u - w_i(o)] + lam r_i(o): block i in option o, u cells from it on."""
        idx = u[None, :] - weight[i][:, None]
        inside = np.take_along_axis(g, np.clip(idx, 0, None), axis=1)
        return np.where(idx >= 0, inside, np.inf) + price[i][:, None]

    g = np.full((len(chain.y[-1]), cells + 1), np.inf)  # g[b] of the last block
    g[:, 0] = chain.final
    into = [None] * len(chain.y)
    for i in range(len(chain.y) - 1, 0, -1):
        into[i] = entering(g, i)
        g = (chain.delta[i - 1][:, :, None] + into[i][None, :, :]).min(axis=1)
    first = chain.init[:, None] + entering(g, 0)
    out = []
    for total in range(cells, max(-1, cells - tops), -1):
        if not np.isfinite(first[:, total]).any():
            continue
        path = [int(np.argmin(first[:, total]))]
        left = total - weight[0][path[0]]
        for i in range(1, len(chain.y)):
            row = chain.delta[i - 1][path[-1]] + into[i][:, left]
            path.append(int(np.argmin(row)))
            left -= weight[i][path[-1]]
        if chain.fits(chain.nbytes(path)):
            out.append((path, chain.cost(path)))
    return out
