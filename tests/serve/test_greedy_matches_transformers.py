"""Every request's greedy output equals transformers' greedy generate for its prompt alone,
whatever else runs beside it: batched with others, prefilled in chunks between decodes,
swapped out to DRAM and back, or preempted and recomputed.
"""

from __future__ import annotations

import pytest

from hetplan.runtime.serve.sampling import SamplingParams
from tests.serve.fixtures import engine_for, greedy_alone, random_prompt, tiny_llama

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory)


@pytest.fixture(scope="module")
def workload(tiny):
    """(prompt, max_tokens, transformers' tokens) for requests of mixed lengths."""
    model = tiny[0]
    shapes = [(5, 12), (17, 9), (3, 20), (30, 6), (11, 14), (1, 10)]
    out = []
    for i, (plen, gen) in enumerate(shapes):
        p = random_prompt(100 + i, plen)
        out.append((p, gen, greedy_alone(model, p, gen)))
    return out


def run_all(engine, workload, priorities=None, stagger: int = 0):
    """Submit every request (``stagger`` steps apart), step until idle -> generated tokens."""
    reqs = []
    for i, (prompt, gen, _) in enumerate(workload):
        prio = priorities[i] if priorities else "interactive"
        reqs.append(engine.submit(prompt, SamplingParams(max_tokens=gen, **GREEDY), priority=prio))
        for _ in range(stagger):
            engine.step()
    engine.run_until_idle()
    return reqs


def assert_all_match(reqs, workload, engine):
    for req, (_, gen, ref) in zip(reqs, workload):
        assert req.generated == ref, f"{req.rid} (prompt {len(req.prompt)} tokens)"
        assert req.finish_reason == "length"
    alloc = engine.pool.alloc
    assert alloc.free_blocks("gpu") == alloc.n_blocks["gpu"] and alloc.free_blocks("cpu") == alloc.n_blocks["cpu"]
    assert not alloc.tables


def test_one_request_alone_matches_transformers(tiny, workload):
    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=64, block_tokens=4)
    reqs = run_all(engine, workload[:1])
    assert_all_match(reqs, workload[:1], engine)


@pytest.mark.parametrize("chunk", (4, 7, 64))
def test_batched_requests_with_chunked_prefill_match_transformers(tiny, workload, chunk):
    """All at once, and arriving two steps apart (newcomers prefill in chunks between decodes)."""
    _, directory, plan = tiny
    for stagger in (0, 2):
        engine = engine_for(plan, directory, gpu_blocks=64, block_tokens=4, prefill_chunk=chunk)
        reqs = run_all(engine, workload, stagger=stagger)
        assert_all_match(reqs, workload, engine)


def test_requests_swapped_to_dram_match_transformers(tiny, workload):
    """A GPU tier of 12 blocks of 4 tokens cannot hold every request's growing cache: the
    scheduler swaps requests out and back in, and nothing changes in what they generate."""
    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=12, cpu_blocks=64, block_tokens=4, prefill_chunk=8)
    reqs = run_all(engine, workload)
    assert engine.scheduler.swaps_out > 0 and engine.scheduler.swaps_in == engine.scheduler.swaps_out
    assert_all_match(reqs, workload, engine)


def test_requests_recomputed_without_dram_match_transformers(tiny, workload):
    """No DRAM tier: preempted requests drop their blocks and recompute their context."""
    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=12, cpu_blocks=0, block_tokens=4, prefill_chunk=8)
    reqs = run_all(engine, workload)
    assert engine.scheduler.recomputes > 0 and engine.scheduler.swaps_out == 0
    assert_all_match(reqs, workload, engine)


def test_batch_requests_are_preempted_before_interactive_ones(tiny, workload):
    """A GPU tier of 20 blocks of 4 tokens holds the three interactive requests at their
    longest (6 + 9 + 3 blocks) but not the batch ones beside them (5 + 7 + 7 more): batch
    requests give way, the interactive ones are never preempted, and every output matches."""
    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=20, cpu_blocks=64, block_tokens=4, prefill_chunk=8)
    prios = ["batch", "batch", "interactive", "interactive", "batch", "interactive"]
    reqs = run_all(engine, workload, priorities=prios, stagger=1)
    assert all(r.swaps == 0 and r.recomputes == 0 for r, p in zip(reqs, prios) if p == "interactive")
    assert sum(r.swaps + r.recomputes for r, p in zip(reqs, prios) if p == "batch") > 0
    assert_all_match(reqs, workload, engine)


def test_a_request_swapped_out_holding_every_gpu_block_comes_back(tiny):
    """A batch request grown to all 6 GPU blocks (24 positions) is swapped out for an
    interactive one; once that finishes, it returns and finishes: both outputs match."""
    model, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=6, cpu_blocks=8, block_tokens=4, prefill_chunk=8)
    long_prompt, short_prompt = random_prompt(50, 10), random_prompt(51, 3)
    long_req = engine.submit(long_prompt, SamplingParams(max_tokens=14, temperature=0.0), priority="batch")
    engine.step()
    while len(engine.pool.alloc.table(long_req.rid).blocks) < 6:
        engine.step()
    assert long_req.finish_reason is None
    short_req = engine.submit(short_prompt, SamplingParams(max_tokens=3, temperature=0.0))
    engine.run_until_idle()
    assert long_req.swaps == 1 and short_req.swaps == 0
    assert long_req.generated == greedy_alone(model, long_prompt, 14)
    assert short_req.generated == greedy_alone(model, short_prompt, 3)


def test_a_plan_without_a_gpu_serves_from_host_memory_and_matches(tmp_path_factory, workload):
    """Both tiers in host memory (the running tier stands where the GPU's would be): swaps still
    copy blocks between them, and outputs still match. The workload's reference tokens come from
    the same seeded weights (``save_tiny_model`` seeds them)."""
    _, directory, plan = tiny_llama(tmp_path_factory, gpu=False)
    assert {t.resource for s in plan.schedule.values() for t in s.tasks} == {"cpu"}
    engine = engine_for(plan, directory, gpu_blocks=12, cpu_blocks=64, block_tokens=4, prefill_chunk=8)
    assert engine.mode == "cpu"
    reqs = run_all(engine, workload)
    assert engine.scheduler.swaps_out > 0
    assert_all_match(reqs, workload, engine)


def test_swapped_requests_decoding_with_cpu_attention_match_transformers(tiny, workload):
    """With --cpu-attention, swapped requests keep decoding from their blocks in DRAM (attention
    on the CPU, beside the running batch, their blocks growing in DRAM): outputs still match."""
    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=12, cpu_blocks=64, block_tokens=4, prefill_chunk=8,
                        cpu_attention=True)
    reqs = run_all(engine, workload)
    assert engine.scheduler.swaps_out > 0 and engine.scheduler.cpu_attention_tokens > 0
    assert_all_match(reqs, workload, engine)


def test_cpu_attention_runs_on_its_lane_at_the_same_time_as_the_gpu_lane(tiny, workload, monkeypatch):
    """One request decoding on the GPU and one from DRAM: in every layer the two attentions are
    in progress together (each waits at a two-party barrier for the other, so lanes run one
    after the other would time out), the DRAM one on the CPU lane's thread."""
    import threading

    import torch

    from hetplan.runtime.serve import model as paged

    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=32, cpu_blocks=32, block_tokens=4, cpu_attention=True)
    a, b = (engine.submit(p, SamplingParams(max_tokens=4, **GREEDY)) for p, _, _ in workload[:2])
    while not (a.generated and b.generated):
        engine.step()
    engine.pool.move(b.rid, "cpu")
    barrier, seen, real = threading.Barrier(2, timeout=20), [], paged.attention

    def attention(q, k, v, start, scale):
        seen.append((threading.current_thread().name, q.device.type))
        barrier.wait()
        return real(q, k, v, start, scale=scale)

    monkeypatch.setattr(paged, "attention", attention)
    segments = [(r.rid, r.context[r.computed:r.computed + 1], r.computed) for r in (a, b)]
    with torch.inference_mode():
        logits = engine.model.forward(engine.pool, segments)
    assert logits.shape[0] == 2
    lanes = [name.startswith("hetplan-serve-cpu-attention") for name, _ in seen]
    assert len(seen) == 2 * plan.model.n_layers and sum(lanes) == plan.model.n_layers
