"""The KV pool's accounting and copies: no block leaks under random arrivals, growth, swaps and
cancellations, a block never belongs to two requests, and a swap out and back in leaves every
byte of a request's cache as it was.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from hetplan.runtime.devices import Devices
from hetplan.runtime.serve.blocks import BlockAllocator, blocks_for
from hetplan.runtime.serve.pool import KVPool

N_BLOCKS = {"gpu": 10, "cpu": 6}

ops = st.lists(st.tuples(st.sampled_from(("grow", "free", "swap_out", "swap_in")), st.integers(0, 5),
                         st.integers(1, 40)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_requests_never_leak_or_share_a_block(ops):
    alloc = BlockAllocator(4, N_BLOCKS)
    tokens = {}
    for op, rid, n in ops:
        t = alloc.table(rid)
        if op == "grow" and alloc.can_hold(rid, tokens.get(rid, 0) + n):
            tokens[rid] = tokens.get(rid, 0) + n
            alloc.grow(rid, tokens[rid])
        elif op == "free":
            alloc.free(rid)
            tokens.pop(rid, None)
        elif op in ("swap_out", "swap_in") and t is not None:
            dst = "cpu" if op == "swap_out" else "gpu"
            if t.tier != dst and len(t.blocks) <= alloc.free_blocks(dst):
                alloc.move(rid, dst)
        for tier in N_BLOCKS:  # every block is free or held by exactly one request
            held = [b for r in alloc.tables.values() if r.tier == tier for b in r.blocks]
            assert len(held) == len(set(held))
            assert len(held) + alloc.free_blocks(tier) == N_BLOCKS[tier]
            assert all(0 <= b < N_BLOCKS[tier] for b in held)
        for r, table in alloc.tables.items():
            assert len(table.blocks) == blocks_for(tokens[r], 4)
    for rid in list(alloc.tables):  # cancelling everything returns the pool to its start
        alloc.free(rid)
    assert {t: alloc.free_blocks(t) for t in N_BLOCKS} == N_BLOCKS


def test_a_request_too_large_for_the_free_blocks_is_refused_whole():
    alloc = BlockAllocator(4, {"gpu": 2, "cpu": 0})
    assert not alloc.can_hold("a", 9)
    alloc.grow("a", 8)
    assert alloc.free_blocks("gpu") == 0 and not alloc.can_hold("b", 1)


def test_swap_out_and_in_leaves_the_cache_bytes_identical():
    torch.manual_seed(0)
    pool = KVPool(Devices("emulated"), n_layers=2, n_kv_heads=2, head_dim=8, dtype=torch.float16,
                  block_tokens=4, n_blocks={"gpu": 6, "cpu": 6})
    pool.alloc.grow("other", 5)            # so that the swapped request comes back to other blocks
    pool.alloc.grow("r", 10)
    for layer in range(2):
        pool.write("r", layer, 0, torch.randn(10, 2, 8).half(), torch.randn(10, 2, 8).half())
    before = pool.block_bytes("r")
    k_before, v_before = pool.gather("r", 1, 10)
    gpu_blocks = list(pool.alloc.table("r").blocks)
    assert pool.move("r", "cpu") == 3
    pool.alloc.free("other")
    pool.alloc.grow("third", 4)            # takes a block "r" used to hold
    pool.move("r", "gpu")
    assert pool.alloc.table("r").blocks != gpu_blocks
    after = pool.block_bytes("r")
    assert torch.equal(before.view(torch.int16), after.view(torch.int16))
    k_after, v_after = pool.gather("r", 1, 10)
    assert torch.equal(k_before, k_after) and torch.equal(v_before, v_after)


def test_gather_returns_the_positions_written_in_order():
    pool = KVPool(Devices("emulated"), n_layers=1, n_kv_heads=1, head_dim=1, dtype=torch.float32,
                  block_tokens=3, n_blocks={"gpu": 8, "cpu": 0})
    pool.alloc.grow("x", 2)
    pool.alloc.grow("r", 7)                # r's blocks do not start at block 0
    pos = torch.arange(7, dtype=torch.float32).view(7, 1, 1)
    pool.write("r", 0, 0, pos[:5], -pos[:5])
    pool.write("r", 0, 5, pos[5:], -pos[5:])
    k, v = pool.gather("r", 0, 7)
    assert k.flatten().tolist() == list(range(7)) and v.flatten().tolist() == [-i for i in range(7)]
