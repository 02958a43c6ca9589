"""The paged KV pool's bytes: arrays per tier, and the copies that swap blocks between tiers.

Tier ``t`` holds ``kv[t]``, a tuple of arrays allocated once through ``Devices`` (so the emulated
GPU's budget counts them), each ``[N_t, L, 2, BT, ...]`` (blocks, attention layers, key/value,
positions in a block, then one token's row):

- a plain KV dtype (fp32, fp16, bf16): one array, its row ``[KVH, hd]``;
- a quantised one (``hetplan.runtime.kernels.quant``: q8_0, q4_0, int8, int4, q4_k_m): the
  arrays of ``quant.row_parts`` for a row of KVH * hd values, each row ``[count]``, as ``hetplan
  exec``'s caches hold them (``runtime/kv_cache.py``): ``write`` quantises each new token's key
  row and value row on its own, ``gather`` dequantises the rows it returns.

A request's cache is the blocks its ``BlockTable`` lists; ``gather`` returns its first ``end``
positions of one layer as [1, end, KVH, hd] keys and values (fp32 when dequantised), and
``write`` stores new positions. Swapping copies whole blocks of every array (``copy_blocks``):
the stored bytes move unchanged, so a round trip leaves them identical. Knows nothing about
scheduling.
"""

from __future__ import annotations

import torch

from hetplan.runtime.kernels import quant
from hetplan.runtime.serve.blocks import TIERS, BlockAllocator


class KVPool:
    def __init__(self, devices, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype | str,
                 block_tokens: int, n_blocks: dict):
        """``dtype``: the KV dtype, a torch dtype or a quantised format's name (``kv_cache.storage``)."""
        self.devices = devices
        self.alloc = BlockAllocator(block_tokens, n_blocks)
        self.block_tokens = block_tokens
        self.fmt = dtype if isinstance(dtype, str) else None
        self.row_shape = (n_kv_heads, head_dim)
        rows = (((dtype, self.row_shape),) if self.fmt is None else
                tuple((d, (count,)) for d, count in quant.row_parts(self.fmt, n_kv_heads * head_dim)))
        self.kv = {}
        for tier in TIERS:
            # a plan without a GPU keeps both tiers in host memory: ``gpu`` is the running tier
            where = tier if devices.mode != "cpu" else "cpu"
            self.kv[tier] = tuple(
                devices.empty(where, (self.alloc.n_blocks[tier], n_layers, 2, block_tokens, *row), d,
                              f"KV pool ({tier} tier{'' if self.fmt is None else f', array {i}'})").zero_()
                for i, (d, row) in enumerate(rows))

    def device(self, tier: str) -> torch.device:
        """Where ``tier``'s blocks are."""
        return self.kv[tier][0].device

    def nbytes(self, tier: str) -> int:
        """Bytes ``tier``'s arrays hold."""
        return sum(a.numel() * a.element_size() for a in self.kv[tier])

    def _rows(self, x: torch.Tensor) -> tuple:
        """x [n, KVH, hd] -> its rows as stored, one tensor per array ([n, KVH, hd], or [n, count]
        each quantised row on its own)."""
        if self.fmt is None:
            return (x,)
        return quant.quantise_rows(self.fmt, x.reshape(x.shape[0], -1))

    def write(self, rid, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, KVH, hd] at positions [start, start + n) of ``rid``'s cache in ``layer``."""
        t = self.alloc.table(rid)
        bt, n = self.block_tokens, k.shape[0]
        for store, k_rows, v_rows in zip(self.kv[t.tier], self._rows(k), self._rows(v)):
            pos = 0
            while pos < n:
                p = start + pos
                b, off = t.blocks[p // bt], p % bt
                m = min(bt - off, n - pos)
                store[b, layer, 0, off:off + m] = k_rows[pos:pos + m]
                store[b, layer, 1, off:off + m] = v_rows[pos:pos + m]
                pos += m

    def gather(self, rid, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end) of ``rid`` in ``layer``: each [1, end, KVH, hd]."""
        t = self.alloc.table(rid)
        n = -(-end // self.block_tokens)
        idx = torch.tensor(t.blocks[:n], dtype=torch.int64, device=self.device(t.tier))
        parts = []
        for store in self.kv[t.tier]:
            kv = store[:, layer].index_select(0, idx)          # [n, 2, BT, *row]: this layer only
            parts.append(kv.transpose(0, 1).reshape(2, n * self.block_tokens, *kv.shape[3:])[:, :end])
        if self.fmt is None:
            kv = parts[0]
        else:                                                  # [2, end, KVH * hd] fp32
            kv = quant.dequantise_rows(self.fmt, tuple(parts), self.row_shape[0] * self.row_shape[1])
            kv = kv.view(2, end, *self.row_shape)
        return kv[0:1], kv[1:2]

    def move(self, rid, tier: str) -> int:
        """Swap ``rid``'s blocks to ``tier`` (copies, then the old blocks are free): -> blocks moved."""
        src = self.alloc.table(rid).tier
        pairs = self.alloc.move(rid, tier)
        self.copy(src, tier, pairs)
        return len(pairs)

    def copy(self, src: str, dst: str, pairs: list) -> None:
        """Block ``new`` of tier ``dst`` = block ``old`` of tier ``src`` for each (old, new), in
        every array (a swap's copies, replayed as they were made)."""
        for a, b in zip(self.kv[src], self.kv[dst]):
            copy_blocks(a, b, pairs)

    def block_bytes(self, rid) -> torch.Tensor:
        """A CPU copy of the bytes of ``rid``'s blocks, uint8 [n, bytes of a block], in table order
        (every array's bytes of a block side by side; tests, checks)."""
        t = self.alloc.table(rid)
        idx = torch.tensor(t.blocks, dtype=torch.int64)
        return torch.cat([a[idx.to(a.device)].cpu().reshape(len(t.blocks), -1).view(torch.uint8)
                          for a in self.kv[t.tier]], dim=1)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list) -> None:
    """dst[new] = src[old] for each (old, new): one gathered copy across tiers."""
    if not pairs:
        return
    old = torch.tensor([a for a, _ in pairs], dtype=torch.int64, device=src.device)
    new = torch.tensor([b for _, b in pairs], dtype=torch.int64, device=dst.device)
    dst.index_copy_(0, new, src.index_select(0, old).to(dst.device))
