"""Sampling: nucleus filtering keeps exactly the tokens inside top_p, a seeded request draws
the same tokens whatever else runs, stop strings end a request and its text, and the engine's
pool is whole again after random arrivals and cancellations.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hetplan.errors import HetplanError
from hetplan.runtime.serve.sampling import SamplingParams, cut_at_stop, next_token, safe_prefix
from tests.serve.fixtures import engine_for, greedy_alone, random_prompt, tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory)


def test_top_p_draws_only_from_the_smallest_set_reaching_p():
    """probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8); 0.5 keeps {0}."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    draws = {next_token(logits, SamplingParams(temperature=1.0, top_p=0.7), torch.Generator().manual_seed(s))
             for s in range(200)}
    assert draws == {0, 1}
    assert {next_token(logits, SamplingParams(temperature=1.0, top_p=0.5), torch.Generator().manual_seed(s))
            for s in range(50)} == {0}


def test_bad_sampling_settings_are_refused_naming_the_field():
    for kw, word in ((dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                     (dict(top_p=0), "top_p"), (dict(stop=("",)), "stop")):
        with pytest.raises(HetplanError, match=word):
            SamplingParams(**kw)


def test_stop_strings_cut_text_and_hold_back_a_possible_start():
    assert cut_at_stop("a b STOP c", ("STOP",)) == ("a b ", True)
    assert cut_at_stop("abc", ("x",)) == ("abc", False)
    assert safe_prefix("hello ST", ("STOP",)) == "hello "
    assert safe_prefix("hello", ("STOP",)) == "hello"


def test_a_seeded_request_draws_the_same_tokens_beside_others(tiny):
    _, directory, plan = tiny
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    prompt = random_prompt(1, 9)
    alone = engine_for(plan, directory, gpu_blocks=32, block_tokens=4)
    a = alone.submit(prompt, params)
    alone.run_until_idle()
    busy = engine_for(plan, directory, gpu_blocks=32, block_tokens=4)
    busy.submit(random_prompt(2, 20), SamplingParams(max_tokens=8, temperature=1.0, seed=3))
    busy.step()
    b = busy.submit(prompt, params)
    busy.submit(random_prompt(3, 5), SamplingParams(max_tokens=15, temperature=0.0))
    busy.run_until_idle()
    assert a.generated == b.generated and len(a.generated) == 12


def test_a_stop_string_ends_the_request_before_max_tokens(tiny):
    model, directory, plan = tiny
    prompt = random_prompt(4, 6)
    ref = greedy_alone(model, prompt, 10)
    stop = f" {ref[2]} {ref[3]}"
    assert stop not in "".join(f" {t}" for t in ref[:3])   # the stop string first appears at token 3
    engine = engine_for(plan, directory, gpu_blocks=32, block_tokens=4)
    req = engine.submit(prompt, SamplingParams(max_tokens=10, temperature=0.0, stop=(stop,)))
    engine.run_until_idle()
    assert req.finish_reason == "stop" and req.generated == ref[:4]
    assert engine.text(req) == "".join(f" {t}" for t in ref[:2])


events = st.lists(st.tuples(st.sampled_from(("submit", "cancel", "step")), st.integers(0, 20), st.integers(1, 12)),
                  min_size=1, max_size=40)


@settings(max_examples=25, deadline=None)
@given(events)
def test_random_arrivals_and_cancellations_leave_no_block_behind(tiny, events):
    _, directory, plan = tiny
    engine = _small_engine(plan, directory)
    live = []
    for op, a, b in events:
        if op == "submit":
            live.append(engine.submit(random_prompt(a, a + 1), SamplingParams(max_tokens=b, temperature=0.0),
                                      priority="batch" if a % 2 else "interactive").rid)
        elif op == "cancel" and live:
            engine.cancel(live.pop(a % len(live)))
        else:
            engine.step()
    engine.run_until_idle()
    alloc = engine.pool.alloc
    assert not alloc.tables and alloc.free_blocks("gpu") == 10 and alloc.free_blocks("cpu") == 4


_ENGINES = {}


def _small_engine(plan, directory):
    """A fresh engine (10 GPU blocks, 4 DRAM blocks of 4 tokens) sharing one loaded model; a
    prompt of at most 21 tokens with 12 to generate fits the GPU tier alone (9 blocks)."""
    from hetplan.runtime.devices import Devices
    from hetplan.runtime.serve.engine import Engine
    from hetplan.runtime.serve.pool import KVPool
    if "model" not in _ENGINES:
        _ENGINES["model"] = engine_for(plan, directory, gpu_blocks=10, cpu_blocks=4, block_tokens=4, prefill_chunk=8)
    base = _ENGINES["model"]
    s = base.settings
    spec = base.model.spec
    pool = KVPool(Devices("emulated"), spec.n_layers, spec.n_kv_heads, spec.head_dim, torch.float32, 4,
                  {"gpu": s.gpu_blocks, "cpu": s.cpu_blocks})
    return Engine(base.model, pool, s)
