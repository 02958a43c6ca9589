"""The pieces of a served pipeline that need no process: a step's message comes back as it was
sent; the groups' allocators hand out disjoint block ids, their swaps' copies are recorded in
order and replay to the same bytes in another pool; a new request joins the group with the least
work; a pipeline plan's GPU blocks are the positions every stage's KV budget holds."""

from __future__ import annotations

import torch

from hetplan.runtime.devices import Devices
from hetplan.runtime.serve.pipeline.groups import Groups, Partition, pool_blocks
from hetplan.runtime.serve.pipeline.messages import Segment, StepMessage, decode, encode
from hetplan.runtime.serve.pool import KVPool
from hetplan.runtime.serve.sampling import SamplingParams
from hetplan.runtime.serve.scheduler import Request
from hetplan.runtime.serve.settings import ServeSettings, settings_for
from hetplan.workload import Workload
from tests.distributed.pipelines import pipeline_plan


def test_a_step_message_decodes_to_what_was_encoded():
    msg = StepMessage((Segment(7, 0, (5, 6, 7), "gpu", (4, 5)), Segment(2, 31, (9,), "cpu", (0, 3, 8, 1))),
                      (("gpu", "cpu", ((4, 0), (5, 3))), ("cpu", "gpu", ((1, 9),))))
    body = encode(msg)
    assert body.dtype == torch.int64
    # [segments, copies] + 5 + blocks + ids per segment + 3 + 2 per pair per copy
    assert body.numel() == 2 + (5 + 2 + 3) + (5 + 4 + 1) + (3 + 4) + (3 + 2)
    assert decode(body) == msg
    assert decode(encode(StepMessage(()))) == StepMessage(())


def pool(n_blocks: dict) -> KVPool:
    return KVPool(Devices("cpu", 0), 2, 2, 4, torch.float32, 4, n_blocks)


def test_groups_hold_disjoint_blocks_and_their_copies_replay_to_the_same_bytes():
    settings = ServeSettings(block_tokens=4, gpu_blocks=9, cpu_blocks=9, max_batch=4, max_context=64,
                             prefill_chunk=8, step_tokens=16)
    n = pool_blocks(settings, 2)
    assert n == {"gpu": 8, "cpu": 8}              # 9 // 2 x 2 each
    here = pool(n)
    part = Partition(4, here.alloc.n_blocks, 2)
    here.alloc = part
    a, b = Groups(here, part, settings).pools
    assert a.alloc.grow("x", 13) == [0, 1, 2, 3] and b.alloc.grow("y", 5) == [4, 5]   # ids [4g, 4g + 4)
    assert part.used_blocks("gpu") == 6 and part.free_blocks("gpu") == 2 and set(part.tables) == {"x", "y"}
    for rid, p in (("x", a), ("y", b)):
        rows = len(p.alloc.table(rid).blocks) * 4
        for j in range(2):
            p.write(rid, j, 0, torch.randn(rows, 2, 4), torch.randn(rows, 2, 4))
    there = pool(n)                               # another stage's pool, as it was before the swaps
    for t in ("gpu", "cpu"):
        there.kv[t][0].copy_(here.kv[t][0])
    a.move("x", "cpu")
    b.move("y", "cpu")
    b.move("y", "gpu")
    assert a.take_copies() == (("gpu", "cpu", ((0, 0), (1, 1), (2, 2), (3, 3))),) and a.take_copies() == ()
    copies = b.take_copies()
    # freed blocks are handed out again first (the free list is a stack): y goes back to 4, 5
    assert copies == (("gpu", "cpu", ((4, 4), (5, 5))), ("cpu", "gpu", ((4, 4), (5, 5))))
    for src, dst, pairs in copies:
        there.copy(src, dst, list(pairs))
    there.copy("gpu", "cpu", [(0, 0), (1, 1), (2, 2), (3, 3)])
    for t in ("gpu", "cpu"):
        assert torch.equal(there.kv[t][0], here.kv[t][0])


def test_a_new_request_joins_the_group_with_the_least_work():
    settings = ServeSettings(block_tokens=4, gpu_blocks=8, cpu_blocks=0, max_batch=4, max_context=64,
                             prefill_chunk=8, step_tokens=16)
    base = pool(pool_blocks(settings, 2))
    part = Partition(4, base.alloc.n_blocks, 2)
    groups = Groups(base, part, settings)

    def req(rid, prompt, max_tokens):
        return Request(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens))
    r1, r2, r3 = req("a", 10, 5), req("b", 3, 2), req("c", 4, 4)
    for r in (r1, r2, r3):
        groups.add(r)
    # a -> 0 (both empty, lowest first); b -> 1 (no requests); c -> 1 (one request each, 5 tokens < 15)
    assert [r in s.waiting for s in groups.schedulers for r in (r1, r2, r3)] == [True, False, False,
                                                                                 False, True, True]
    groups.remove(r2)
    assert groups.schedulers[1].waiting == [r3] and r2.state == "finished"


def test_a_pipeline_plans_gpu_blocks_are_the_positions_its_stages_budget(llama_files, tmp_path):
    """Each stage's plan holds KV for batch x context positions of its own layers (one cache:
    the latency objective), so every stage's pool holds batch x context / block_tokens blocks."""
    model_dir, node, _ = llama_files
    wl = Workload(2, 16, 24, prefill_chunk=8)
    plan = pipeline_plan(model_dir, node, [0, 1, 4], ["all-gpu", "stream"], wl, tmp_path / "plan.json")
    s = settings_for(plan, block_tokens=4)
    assert s.gpu_blocks == 2 * 40 // 4 and s.cpu_blocks == s.gpu_blocks
    assert s.max_context == 40 and s.prefill_chunk == 8
