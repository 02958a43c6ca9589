"""Block accounting of the paged KV pool: free lists per tier and a block table per request.

A *block* holds ``block_tokens`` consecutive positions of one request's cache, every layer's
keys and values. Each tier (``gpu``, ``cpu``) has a fixed number of blocks; a request's blocks
all live in one tier at a time (``gpu`` while it runs; ``cpu`` while swapped out). Pure
bookkeeping: knows nothing about tensors (``pool`` copies the bytes) or about scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetplan.errors import HetplanError

TIERS = ("gpu", "cpu")


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Blocks that hold ``tokens`` positions: ceil(tokens / block_tokens)."""
    return -(-tokens // block_tokens)


@dataclass
class BlockTable:
    """One request's blocks, in position order, all in ``tier``."""
    tier: str
    blocks: list = field(default_factory=list)


class BlockAllocator:
    """Free blocks per tier; ``tables`` maps a request id to its ``BlockTable``."""

    def __init__(self, block_tokens: int, n_blocks: dict, first: dict | None = None):
        """``first``: per tier, the id of its first block (0 unless the allocator hands out one
        part of a larger pool: block ids ``[first, first + n_blocks)``)."""
        if block_tokens < 1:
            raise HetplanError(f"--block-tokens {block_tokens}: a block holds at least one token")
        self.block_tokens = block_tokens
        self.n_blocks = {t: n_blocks.get(t, 0) for t in TIERS}
        first = first or {}
        # lowest ids first, so that a fresh pool hands out 0, 1, 2 ...
        self._free = {t: list(range(first.get(t, 0) + self.n_blocks[t] - 1, first.get(t, 0) - 1, -1)) for t in TIERS}
        self.tables: dict = {}

    def free_blocks(self, tier: str) -> int:
        return len(self._free[tier])

    def used_blocks(self, tier: str) -> int:
        return self.n_blocks[tier] - len(self._free[tier])

    def table(self, rid) -> BlockTable | None:
        return self.tables.get(rid)

    def can_hold(self, rid, tokens: int, tier: str = "gpu") -> bool:
        """Whether ``rid``'s table (or a new one in ``tier``) can grow to ``tokens`` positions now."""
        t = self.tables.get(rid)
        have = len(t.blocks) if t else 0
        tier = t.tier if t else tier
        return blocks_for(tokens, self.block_tokens) - have <= len(self._free[tier])

    def grow(self, rid, tokens: int, tier: str = "gpu") -> list:
        """Give ``rid`` enough blocks for ``tokens`` positions (a new table in ``tier`` if it has
        none); returns the blocks added. Raises if the tier has too few free blocks (callers
        check ``can_hold`` first)."""
        t = self.tables.setdefault(rid, BlockTable(tier))
        need = blocks_for(tokens, self.block_tokens) - len(t.blocks)
        if need > len(self._free[t.tier]):
            raise HetplanError(f"KV pool: request {rid} needs {need} more {t.tier} blocks, "
                               f"{len(self._free[t.tier])} are free")
        added = [self._free[t.tier].pop() for _ in range(max(0, need))]
        t.blocks += added
        return added

    def free(self, rid) -> None:
        """Return every block of ``rid`` to its tier (nothing if it holds none)."""
        t = self.tables.pop(rid, None)
        if t is not None:
            self._free[t.tier].extend(reversed(t.blocks))

    def move(self, rid, tier: str) -> list:
        """Move ``rid``'s table to ``tier``: -> [(old block, new block), ...] for the copier;
        the old blocks are freed. Raises if ``tier`` has too few free blocks."""
        t = self.tables[rid]
        if len(t.blocks) > len(self._free[tier]):
            raise HetplanError(f"KV pool: request {rid} needs {len(t.blocks)} {tier} blocks to move, "
                               f"{len(self._free[tier])} are free")
        new = [self._free[tier].pop() for _ in t.blocks]
        pairs = list(zip(t.blocks, new))
        self._free[t.tier].extend(reversed(t.blocks))
        t.tier, t.blocks = tier, new
        return pairs
