"""``hetplan serve`` over a pipeline plan, its engine in this process (stage 0) and one spawned
process per later stage (gloo, emulated GPUs): concurrent requests of different lengths (more
than the stages, so several groups' steps are in flight at once; prompts longer than the prefill
chunk) get transformers' greedy tokens each, with two and three stages, stages streaming their
blocks or computing them on the CPU; with a GPU tier too small for them all, swaps keep them
equal; a request cancelled mid-generation frees its blocks, which serve the next request as they
should; the OpenAI API answers over the pipeline."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import torch

from hetplan.runtime.serve.api.server import running
from hetplan.runtime.serve.pipeline.launch import start_engine
from hetplan.runtime.serve.sampling import SamplingParams
from hetplan.runtime.serve.settings import settings_for
from hetplan.workload import Workload
from tests.distributed.pipelines import VOCAB, pipeline_plan, reference

WORKLOAD = Workload(2, 16, 24, prefill_chunk=8)
"""Context 40; prompts longer than 8 tokens are computed in several chunks."""
LENGTHS = (3, 12, 5, 20, 9)
MAX_TOKENS = 10


def prompt(seed: int, length: int) -> list:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def prompts(llama_files):
    """(prompt, transformers' greedy tokens for it alone) for each of ``LENGTHS``."""
    model = llama_files[2]
    out = []
    for i, n in enumerate(LENGTHS):
        p = prompt(100 + i, n)
        out.append((p, reference(model, torch.tensor([p]), MAX_TOKENS)["tokens"][0]))
    return out


def plan_of(llama_files, tmp_path, cuts, strategies):
    model_dir, node, _ = llama_files
    plan = pipeline_plan(model_dir, node, cuts, strategies, WORKLOAD, tmp_path / "plan.json")
    return str(model_dir), plan


def engine_of(llama_files, tmp_path, cuts, strategies, computes=None, **given):
    directory, plan = plan_of(llama_files, tmp_path, cuts, strategies)
    if computes is not None:
        assert computed_on(plan) == computes
    engine = start_engine(plan, directory, settings_for(plan, block_tokens=4, **given), emulate=True, timeout_s=60)
    return plan, engine


def served(engine, items: list) -> list:
    """Submit every prompt at once, step until all are done -> each one's generated tokens."""
    reqs = [engine.submit(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0)) for p, _ in items]
    engine.start()
    deadline = time.monotonic() + 120
    while any(r.finish_reason is None for r in reqs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.broken is None, engine.broken
    assert [r.finish_reason for r in reqs] == ["length"] * len(reqs)
    return [r.generated for r in reqs]


def pool_is_whole(engine) -> bool:
    """Every block free, once the stepping thread is through with the requests' last turn (a
    request reads as finished just before its blocks are freed)."""
    a = engine.pool.alloc
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not a.tables and all(a.free_blocks(t) == a.n_blocks[t] for t in a.n_blocks):
            return True
        time.sleep(0.01)
    return False


CASES = {
    # name: (layer cuts, strategy per stage, where the stages' plans compute their layers' blocks)
    "two-stream-cpu": ([0, 2, 4], ["stream", "ngl:0"], {"stream", "cpu"}),
    "three-mixed": ([0, 1, 3, 4], ["all-gpu", "ngl:0", "stream"], {"gpu", "stream", "cpu"}),
}


def computed_on(plan) -> set:
    """Where the stages' plans compute their layers' blocks, in either phase (``ngl:0``: streamed
    to the GPU for prefill, on the CPU for decode)."""
    return {ex for st in plan.pipeline["stages"] for p in st["plan"]["placement"] if p["layer"] is not None
            for ex in p["exec"].values()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_concurrent_requests_through_the_stages_get_transformers_greedy_tokens(llama_files, prompts, case, tmp_path):
    cuts, strategies, held = CASES[case]
    plan, engine = engine_of(llama_files, tmp_path, cuts, strategies, held, gpu_blocks=60)
    try:
        assert served(engine, prompts) == [ref for _, ref in prompts]
        assert engine.scheduler.swaps_out == 0
        # one group per stage, each with requests, their steps in flight at once
        assert len(engine.scheduler) == len(cuts) - 1
        assert all(s.swaps_out == 0 and s.running == [] for s in engine.scheduler.schedulers)
        assert engine.overlapped_steps > 0
        assert pool_is_whole(engine)
    finally:
        engine.stop()
    assert engine.broken is None, engine.broken
    assert len(engine.stage_busy_s) == len(cuts) - 1 and all(b > 0 for b in engine.stage_busy_s)


def test_swaps_in_a_small_gpu_tier_keep_every_stage_tokens_equal(llama_files, prompts, tmp_path):
    """8 GPU blocks of 4 positions per group: the group's requests (up to 30 positions each) do
    not all fit, so the scheduler swaps some out to DRAM and back; every stage copies the same
    blocks."""
    _, engine = engine_of(llama_files, tmp_path, [0, 2, 4], ["stream", "ngl:0"], gpu_blocks=16, cpu_blocks=40,
                          max_batch=8)
    more = prompts + [(p, ref) for p, ref in prompts[:3]]
    try:
        assert served(engine, more) == [ref for _, ref in more]
        assert engine.scheduler.swaps_out > 0 and engine.scheduler.swaps_in > 0
        assert pool_is_whole(engine)
    finally:
        engine.stop()
    assert engine.broken is None, engine.broken


def test_a_request_cancelled_mid_generation_frees_its_blocks_for_the_next(llama_files, prompts, tmp_path):
    """Only stage 0 allocates blocks (the others take each step's block tables from it): once the
    cancelled request is gone, every block is free, and a request that reuses them gets
    transformers' tokens (no stage computes over what the cancelled one left)."""
    _, engine = engine_of(llama_files, tmp_path, [0, 2, 4], ["all-gpu", "all-gpu"], gpu_blocks=20)
    long_one = engine.submit(prompts[3][0], SamplingParams(max_tokens=20, temperature=0))
    others = [engine.submit(p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0)) for p, _ in prompts[:3]]
    engine.start()
    try:
        deadline = time.monotonic() + 120
        while len(long_one.generated) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.cancel(long_one.rid)
        while any(r.finish_reason is None for r in [long_one, *others]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert long_one.finish_reason == "cancelled" and 3 <= len(long_one.generated) < 20
        assert [r.generated for r in others] == [ref for _, ref in prompts[:3]]
        assert pool_is_whole(engine)
        assert engine.stats.cancelled == 1
        again = engine.submit(prompts[4][0], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        while again.finish_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert again.generated == prompts[4][1]
    finally:
        engine.stop()
    assert engine.broken is None, engine.broken


def test_the_openai_api_answers_over_a_pipeline(llama_files, prompts, tmp_path):
    _, engine = engine_of(llama_files, tmp_path, [0, 2, 4], ["stream", "ngl:0"], gpu_blocks=60)
    with running(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        results = [None] * len(prompts)

        def ask(i):
            r = client.completions.create(model="tiny", prompt=prompts[i][0], max_tokens=MAX_TOKENS, temperature=0)
            results[i] = ([int(t) for t in r.choices[0].text.split()], r.choices[0].finish_reason)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [(ref, "length") for _, ref in prompts]
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        metrics = httpx.get(f"{url}/metrics").text
        assert "hetplan_requests_completed_total 5" in metrics
        assert 'hetplan_kv_blocks{tier="gpu"} 60' in metrics
    assert engine.broken is None, engine.broken
