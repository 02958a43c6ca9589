"""A served pipeline's messages between stages, as int64 tensors (no pickle, any backend).

For each step, stage ``s`` sends stage ``s + 1`` a header ``[kind, group, body length, tokens]``
(``HEADER`` values) and, for a ``STEP``, the body and the hidden state [1, tokens, D]; the last
stage sends stage 0 the logits of each segment's last position, [segments, V] fp32. ``KEEPALIVE``
goes down the chain while stage 0 has nothing to do (so no stage waits for a message longer than
the run's timeout), ``STOP`` at the end.

The body of a step: ``[segments, copies]``, then per segment ``[key, start, n, tier, blocks,
block ids..., token ids (n)...]`` (the request's number, its first position, its tokens, and its
block table: the tier and blocks stage 0's allocator holds it in), then per copy ``[source tier,
destination tier, pairs, old, new, old, new, ...]`` (the block copies of the swaps stage 0 made
since the group's last step, in order). Tiers are ``blocks.TIERS``' indices. Knows nothing
about models or processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetplan.runtime.serve.blocks import TIERS

STEP, KEEPALIVE, STOP = 0, 1, 2
HEADER = 4
"""Values in a header."""


@dataclass(frozen=True)
class Segment:
    key: int
    """The request's number (the same in every stage)."""
    start: int
    ids: tuple
    tier: str
    blocks: tuple


@dataclass(frozen=True)
class StepMessage:
    segments: tuple
    copies: tuple = ()
    """(source tier, destination tier, ((old, new), ...)) each."""


def header(kind: int, group: int = 0, body: int = 0, tokens: int = 0) -> torch.Tensor:
    return torch.tensor([kind, group, body, tokens], dtype=torch.int64)


def encode(msg: StepMessage) -> torch.Tensor:
    """``msg`` as its body, int64 [length]."""
    out = [len(msg.segments), len(msg.copies)]
    for s in msg.segments:
        out += [s.key, s.start, len(s.ids), TIERS.index(s.tier), len(s.blocks), *s.blocks, *s.ids]
    for src, dst, pairs in msg.copies:
        out += [TIERS.index(src), TIERS.index(dst), len(pairs)]
        for old, new in pairs:
            out += [old, new]
    return torch.tensor(out, dtype=torch.int64)


def decode(body: torch.Tensor) -> StepMessage:
    """The message ``encode`` made ``body`` of."""
    v = body.tolist()
    n_seg, n_copy, i = v[0], v[1], 2
    segments, copies = [], []
    for _ in range(n_seg):
        key, start, n, tier, nb = v[i:i + 5]
        i += 5
        blocks, ids = tuple(v[i:i + nb]), tuple(v[i + nb:i + nb + n])
        i += nb + n
        segments.append(Segment(key, start, ids, TIERS[tier], blocks))
    for _ in range(n_copy):
        src, dst, n = v[i:i + 3]
        i += 3
        copies.append((TIERS[src], TIERS[dst], tuple((v[i + 2 * k], v[i + 2 * k + 1]) for k in range(n))))
        i += 2 * n
    return StepMessage(tuple(segments), tuple(copies))
