"""The paged KV pool's bytes: one tensor per tier, and the copies that swap blocks between tiers.

Tier ``t`` holds ``kv[t]``: [N_t, L, 2, BT, KVH, hd] (blocks, attention layers, key/value,
positions in a block, key/value heads, head dim) in the KV dtype, allocated once through
``Devices`` (so the emulated GPU's budget counts it). A request's cache is the blocks its
``BlockTable`` lists; ``gather`` returns its first ``end`` positions of one layer as [1, end,
KVH, hd] keys and values, and ``write`` stores new positions. Swapping copies whole blocks
(``copy_blocks``), so a round trip leaves the bytes identical. Knows nothing about scheduling.
"""

from __future__ import annotations

import torch

from hetplan.runtime.serve.blocks import TIERS, BlockAllocator


class KVPool:
    def __init__(self, devices, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 block_tokens: int, n_blocks: dict):
        self.devices = devices
        self.alloc = BlockAllocator(block_tokens, n_blocks)
        self.block_tokens = block_tokens
        self.kv = {}
        for tier in TIERS:
            # a plan without a GPU keeps both tiers in host memory: ``gpu`` is the running tier
            where = tier if devices.mode != "cpu" else "cpu"
            shape = (self.alloc.n_blocks[tier], n_layers, 2, block_tokens, n_kv_heads, head_dim)
            self.kv[tier] = devices.empty(where, shape, dtype, f"KV pool ({tier} tier)").zero_()

    def block_nbytes(self) -> int:
        t = self.kv["gpu"]
        return t[0].numel() * t.element_size() if t.shape[0] else 0

    def write(self, rid, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, KVH, hd] at positions [start, start + n) of ``rid``'s cache in ``layer``."""
        t = self.alloc.table(rid)
        store, bt, n = self.kv[t.tier], self.block_tokens, k.shape[0]
        pos = 0
        while pos < n:
            p = start + pos
            b, off = t.blocks[p // bt], p % bt
            m = min(bt - off, n - pos)
            store[b, layer, 0, off:off + m] = k[pos:pos + m]
            store[b, layer, 1, off:off + m] = v[pos:pos + m]
            pos += m

    def gather(self, rid, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end) of ``rid`` in ``layer``: each [1, end, KVH, hd]."""
        t = self.alloc.table(rid)
        n = -(-end // self.block_tokens)
        idx = torch.tensor(t.blocks[:n], dtype=torch.int64, device=self.kv[t.tier].device)
        kv = self.kv[t.tier][:, layer].index_select(0, idx)    # [n, 2, BT, KVH, hd]: this layer only
        kv = kv.transpose(0, 1).reshape(2, n * self.block_tokens, *kv.shape[-2:])[:, :end]
        return kv[0:1], kv[1:2]

    def move(self, rid, tier: str) -> int:
        """Swap ``rid``'s blocks to ``tier`` (copies, then the old blocks are free): -> blocks moved."""
        src = self.alloc.table(rid).tier
        pairs = self.alloc.move(rid, tier)
        copy_blocks(self.kv[src], self.kv[tier], pairs)
        return len(pairs)

    def block_bytes(self, rid) -> torch.Tensor:
        """A CPU copy of ``rid``'s blocks, [n, L, 2, BT, KVH, hd] in table order (tests, checks)."""
        t = self.alloc.table(rid)
        return self.kv[t.tier][torch.tensor(t.blocks, dtype=torch.int64)].cpu().clone()


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list) -> None:
    """dst[new] = src[old] for each (old, new): one gathered copy across tiers."""
    if not pairs:
        return
    old = torch.tensor([a for a, _ in pairs], dtype=torch.int64, device=src.device)
    new = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=dst.device)
    dst.index_copy_(0, new, src.index_select(0, old).to(dst.device))
