"""KV blocks in a plan's quantised KV dtype: each new token's key and value rows quantised on their
own as ``hetplan exec``'s caches hold them (``runtime/kv_cache.py``), dequantised when gathered;
every request's greedy output, batched, swapped and preempted, equals exec's for its prompt alone;
a swap out and back in leaves the stored bytes identical; a block takes the bytes the planner
prices (a q8_0 row of 32 values: 2 fp16 scale bytes + 32 int8 values = 34 bytes; int8: a 4-byte
fp32 scale + 32 values = 36; q4_0: 2 + 16 = 18).
"""

from __future__ import annotations

import pytest
import torch

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.runtime import kv_cache
from hetplan.runtime.devices import Devices
from hetplan.runtime.serve.pool import KVPool
from hetplan.runtime.serve.sampling import SamplingParams
from hetplan.runtime.serve.settings import block_bytes
from hetplan.runtime.session import RunOptions, run_plan
from tests.exec.test_numerics import save_tiny_model
from tests.serve.fixtures import engine_for, random_prompt
from tests.tiny_models import TINY_GPU_NODE

ROW_BYTES = {"q8_0": 34, "int8": 36, "q4_0": 18}
"""Bytes of one stored row of 32 values (KVH 2 x hd 16), hand-derived (module doc)."""
L, KVH, HD = 2, 2, 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve-kv")
    save_tiny_model("llama", d)
    (d / "node.yaml").write_text(TINY_GPU_NODE)
    return d


@pytest.mark.parametrize("kv", sorted(ROW_BYTES))
def test_requests_on_quantised_kv_blocks_match_hetplan_exec_alone(checkpoint, kv):
    plan = compile_plan(CompileRequest(model=str(checkpoint), hw=str(checkpoint / "node.yaml"), strategy="all-gpu",
                                       weight_dtype="fp32", kv_dtype=kv, prompt_len=24, gen_len=24))[0]
    assert plan.model.kv_dtype == kv
    engine = engine_for(plan, str(checkpoint), gpu_blocks=8, cpu_blocks=32, block_tokens=4)
    assert engine.pool.nbytes("gpu") == 8 * L * 2 * 4 * ROW_BYTES[kv]
    assert block_bytes(plan.model, 4) == L * 2 * 4 * ROW_BYTES[kv]
    prompts = [random_prompt(40 + i, n) for i, n in enumerate((6, 13, 3))]
    reqs = [engine.submit(p, SamplingParams(max_tokens=12, temperature=0.0)) for p in prompts]
    engine.run_until_idle()
    assert engine.scheduler.swaps_out > 0
    for p, r in zip(prompts, reqs):
        alone = run_plan(plan, RunOptions(weights=str(checkpoint), prompt_ids=(tuple(p),), gen_len=12,
                                          emulate=True, warmup=False))
        assert r.generated == alone.tokens[0]
    alloc = engine.pool.alloc
    assert not alloc.tables and all(alloc.free_blocks(t) == alloc.n_blocks[t] for t in alloc.n_blocks)


@pytest.mark.parametrize("kv", sorted(ROW_BYTES))
def test_quantised_blocks_swap_out_and_in_byte_identical_and_read_as_exec_reads_them(kv):
    torch.manual_seed(0)
    devices = Devices("emulated")
    pool = KVPool(devices, n_layers=L, n_kv_heads=KVH, head_dim=HD, dtype=kv, block_tokens=4,
                  n_blocks={"gpu": 6, "cpu": 6})
    start = {t: pool.alloc.free_blocks(t) for t in ("gpu", "cpu")}
    k, v = torch.randn(10, KVH, HD), torch.randn(10, KVH, HD)
    pool.alloc.grow("other", 5)            # so that the swapped request comes back to other blocks
    pool.alloc.grow("r", 10)
    for layer in range(L):
        pool.write("r", layer, 0, k[:7], v[:7])   # a prefill chunk, then decodes
        for p in range(7, 10):
            pool.write("r", layer, p, k[p:p + 1], v[p:p + 1])
    # exec's cache of the same values, written at once and read back
    cache = {name: kv_cache.allocate(devices, "cpu", (1, 10, KVH, HD), kv, name, pinned=False) for name in "kv"}
    kv_cache.write(cache["k"], 0, k[None])
    kv_cache.write(cache["v"], 0, v[None])
    (_, k_exec), = kv_cache.read_blocks(cache["k"], 10, torch.float32)
    (_, v_exec), = kv_cache.read_blocks(cache["v"], 10, torch.float32)
    k_pool, v_pool = pool.gather("r", 1, 10)
    assert torch.equal(k_pool, k_exec) and torch.equal(v_pool, v_exec)
    assert not torch.equal(k_pool[0], k)   # quantised: not the values written

    before = pool.block_bytes("r")
    assert before.shape == (3, L * 2 * 4 * ROW_BYTES[kv])
    assert pool.move("r", "cpu") == 3
    pool.alloc.free("other")
    pool.alloc.grow("third", 4)            # takes a block "r" used to hold
    pool.move("r", "gpu")
    assert torch.equal(pool.block_bytes("r"), before)
    assert all(torch.equal(a, b) for a, b in zip(pool.gather("r", 1, 10), (k_pool, v_pool)))
    for rid in ("r", "third"):
        pool.alloc.free(rid)
    assert {t: pool.alloc.free_blocks(t) for t in ("gpu", "cpu")} == start
