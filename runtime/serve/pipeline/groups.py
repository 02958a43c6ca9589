"""The groups of requests a served pipeline keeps in flight at once ("virtual engines").

With ``S`` stages, the running requests and the KV blocks are split into ``S`` groups, each
with its own scheduler (``serve.scheduler``: continuous batching, preemption, swaps) over its
own share of the pool: ``gpu_blocks // S`` and ``cpu_blocks // S`` blocks, block ids
``[g x share, (g + 1) x share)`` of every stage's pool (``Partition``). A new request joins the
group with the least work (requests, then their tokens). A group's step is in flight (in some
stage) until its logits come back; one request is in one group, so never in two steps at once.
``GroupPool`` is a group's view of the pool: the shared arrays, its own allocator, and a record
of the block copies its swaps made, which every other stage replays before the group's next
step. Knows nothing about messages or processes.
"""

from __future__ import annotations

import itertools

from hetplan.errors import HetplanError
from hetplan.runtime.serve.blocks import TIERS, BlockAllocator
from hetplan.runtime.serve.pool import KVPool
from hetplan.runtime.serve.scheduler import Request, Scheduler


def pool_blocks(settings, groups: int) -> dict:
    """Blocks per tier of every stage's pool: the settings' counts, rounded down to ``groups``
    equal shares (refused when the GPU tier cannot give each group a block)."""
    if settings.gpu_blocks < groups:
        raise HetplanError(f"--gpu-blocks {settings.gpu_blocks}: a pipeline of {groups} stages serves {groups} "
                           f"groups of requests at once, each with its own share of the GPU tier's blocks; give "
                           f"at least {groups}")
    return {"gpu": settings.gpu_blocks // groups * groups, "cpu": settings.cpu_blocks // groups * groups}


class Partition:
    """The allocators of the groups, and the whole pool's block accounting over them (what
    ``/metrics`` and the tests read as the pool's ``alloc``)."""

    def __init__(self, block_tokens: int, n_blocks: dict, groups: int):
        share = {t: n_blocks[t] // groups for t in TIERS}
        self.parts = [BlockAllocator(block_tokens, share, first={t: g * share[t] for t in TIERS})
                      for g in range(groups)]
        self.block_tokens = block_tokens
        self.n_blocks = {t: share[t] * groups for t in TIERS}

    def free_blocks(self, tier: str) -> int:
        return sum(a.free_blocks(tier) for a in self.parts)

    def used_blocks(self, tier: str) -> int:
        return sum(a.used_blocks(tier) for a in self.parts)

    @property
    def tables(self) -> dict:
        return {rid: t for a in self.parts for rid, t in a.tables.items()}

    def table(self, rid):
        return self.tables.get(rid)


class GroupPool(KVPool):
    """A group's view of a pool: the same arrays, the group's allocator; ``copies`` records the
    block copies of its swaps until ``take_copies``."""

    def __init__(self, pool: KVPool, alloc: BlockAllocator):
        self.__dict__.update(vars(pool))    # the pool's arrays, devices and row layout, not allocated again
        self.alloc = alloc
        self.copies = []

    def move(self, rid, tier: str) -> int:
        src = self.alloc.table(rid).tier
        pairs = self.alloc.move(rid, tier)
        self.copy(src, tier, pairs)
        self.copies.append((src, tier, tuple(pairs)))
        return len(pairs)

    def take_copies(self) -> tuple:
        out, self.copies = tuple(self.copies), []
        return out


class Groups:
    """The engine's scheduler of a served pipeline: one ``Scheduler`` per group; ``add`` and
    ``remove`` route a request to its group, and the queues and counters read as the groups'
    together (``/metrics``). ``in_flight[g]``: group ``g``'s step not yet back, or None."""

    def __init__(self, pool: KVPool, partition: Partition, settings):
        n = len(partition.parts)
        batch = max(1, settings.max_batch // n)
        self.pools = [GroupPool(pool, a) for a in partition.parts]
        self.schedulers = [Scheduler(p, batch, settings.prefill_chunk, settings.step_tokens,
                                     cpu_attention=settings.cpu_attention) for p in self.pools]
        self.in_flight = [None] * n
        self._group = {}
        """rid -> its group."""

    def __len__(self) -> int:
        return len(self.schedulers)

    def add(self, req: Request) -> None:
        g = min(range(len(self)), key=lambda i: _work(self.schedulers[i]) + (i,))
        self._group[req.rid] = g
        self.schedulers[g].add(req)

    def remove(self, req: Request) -> None:
        g = self._group.pop(req.rid, None)
        if g is not None:
            self.schedulers[g].remove(req)

    def idle(self) -> bool:
        return all(s.idle() for s in self.schedulers) and not any(self.in_flight)

    @property
    def running(self) -> list:
        return [r for s in self.schedulers for r in s.running]

    @property
    def waiting(self) -> list:
        return [r for s in self.schedulers for r in s.waiting]

    @property
    def swapped(self) -> list:
        return [r for s in self.schedulers for r in s.swapped]

    @property
    def swaps_out(self) -> int:
        return sum(s.swaps_out for s in self.schedulers)

    @property
    def swaps_in(self) -> int:
        return sum(s.swaps_in for s in self.schedulers)

    @property
    def recomputes(self) -> int:
        return sum(s.recomputes for s in self.schedulers)

    @property
    def cpu_attention_tokens(self) -> int:
        return sum(s.cpu_attention_tokens for s in self.schedulers)


def _work(s: Scheduler) -> tuple:
    """(requests, their tokens: context and what is left to generate) of a group."""
    reqs = list(itertools.chain(s.running, s.waiting, s.swapped))
    return len(reqs), sum(len(r.context) + r.params.max_tokens - len(r.generated) for r in reqs)
