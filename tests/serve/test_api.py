"""The OpenAI API on loopback, with the ``openai`` client: completions from token ids, whole
and streamed, equal transformers' greedy output; bad bodies are 400 naming the field, a prompt
beyond the context 413, a burst beyond the queue 429; a client that disconnects mid-stream
frees its blocks; /health and /metrics answer. Each test starts and stops its own server.
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from hetplan.runtime.serve.api.server import running
from hetplan.runtime.serve.sampling import SamplingParams
from tests.serve.fixtures import CONTEXT, engine_for, greedy_alone, random_prompt, tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama(tmp_path_factory)


def ids_of(text: str) -> list:
    """Generated text without a tokenizer is each id as ' <id>'."""
    return [int(t) for t in text.split()]


def pool_is_whole(engine) -> bool:
    a = engine.pool.alloc
    return not a.tables and all(a.free_blocks(t) == a.n_blocks[t] for t in a.n_blocks)


def test_completions_whole_and_streamed_match_transformers(tiny):
    model, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=64, block_tokens=4)
    prompts = [random_prompt(10 + i, 4 + 3 * i) for i in range(4)]
    refs = [greedy_alone(model, p, 12) for p in prompts]
    with running(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        results = [None] * len(prompts)

        def ask(i):  # concurrent requests: they share the running batch
            r = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=12, temperature=0)
            results[i] = (ids_of(r.choices[0].text), r.choices[0].finish_reason, r.usage.completion_tokens)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [(ref, "length", 12) for ref in refs]
        stream = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=12, temperature=0, stream=True)
        chunks = list(stream)
        assert ids_of("".join(c.choices[0].text for c in chunks)) == refs[1]
        # tokens sampled between two reads of the stream go out together; the end is its own chunk
        assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].text == ""
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1]) and len(chunks) >= 2
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
        text = httpx.get(f"{url}/metrics").text
        assert "hetplan_generated_tokens_total 60" in text
        assert "hetplan_requests_completed_total 5" in text
        assert 'hetplan_ttft_seconds_count 5' in text and 'hetplan_tpot_seconds_count 55' in text
        assert 'hetplan_kv_blocks_used{tier="gpu"} 0' in text
    assert pool_is_whole(engine)


def test_chat_without_a_chat_template_is_a_clear_400(tiny):
    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=16, block_tokens=4)
    with running(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="tokenizer"):
            client.completions.create(model="tiny", prompt="text needs a tokenizer")


def test_bad_bodies_are_400_naming_the_field(tiny):
    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=16, block_tokens=4)
    with running(engine) as url:
        post = lambda body: httpx.post(f"{url}/v1/completions", content=body,
                                       headers={"content-type": "application/json"})
        r = post(b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = post(json.dumps({"prompt": [1, 2], "max_tokns": 3}))
        assert r.status_code == 400 and "'max_tokns'" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "max_tokns"
        r = post(json.dumps({"prompt": [1, 2], "temperature": "hot"}))
        assert r.status_code == 400 and "'temperature'" in r.json()["error"]["message"]
        r = post(json.dumps({"max_tokens": 3}))
        assert r.status_code == 400 and "'prompt'" in r.json()["error"]["message"]
        r = post(json.dumps({"prompt": [1, 2], "priority": "urgent"}))
        assert r.status_code == 400 and "'priority'" in r.json()["error"]["message"]
        r = post(json.dumps([1, 2]))
        assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
        r = post(json.dumps({"prompt": [1, 999]}))
        assert r.status_code == 400 and "999" in r.json()["error"]["message"]
    assert pool_is_whole(engine)


def test_a_prompt_beyond_the_context_is_413(tiny):
    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=64, block_tokens=4)
    with running(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="tiny", prompt=[1] * (CONTEXT - 4), max_tokens=5)
        assert e.value.status_code == 413 and f"{CONTEXT}-token context" in e.value.message


def test_a_request_beyond_the_queue_is_429_and_the_queued_ones_complete(tiny):
    """A queue of 2, filled before the engine steps: one more request is refused with 429;
    once the engine steps, the queued ones and a later one complete."""
    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=64, block_tokens=4, max_batch=1, max_waiting=2)
    with running(engine, step=False) as url:
        queued = [engine.submit([3, 4, 5], SamplingParams(max_tokens=4, temperature=0)) for _ in range(2)]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 4}, timeout=60)
        assert r.status_code == 429 and "queue capacity 2" in r.json()["error"]["message"]
        engine.start()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and len(ids_of(r.json()["choices"][0]["text"])) == 4
        assert all(q.finish_reason == "length" for q in queued) and engine.stats.completed == 3
    assert pool_is_whole(engine)


def test_a_client_gone_mid_stream_frees_its_blocks(tiny):
    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=64, block_tokens=4)
    with running(engine) as url:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"prompt": [1, 2, 3], "max_tokens": 80, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert json.loads(first[5:])["choices"][0]["text"]
        # the connection is closed: the server cancels the request within a few steps
        for _ in range(500):
            if pool_is_whole(engine) and engine.stats.cancelled == 1:
                break
            threading.Event().wait(0.01)
        assert engine.stats.cancelled == 1 and engine.stats.completed == 0
    assert pool_is_whole(engine)


def test_an_engine_failure_ends_the_requests_with_500_and_the_server_stays_up(tiny, monkeypatch):
    _, directory, plan = tiny
    engine = engine_for(plan, directory, gpu_blocks=16, block_tokens=4)
    forward = engine.model.forward

    def broken(pool, segments):
        raise RuntimeError("simulated kernel failure")

    with running(engine) as url:
        monkeypatch.setattr(engine.model, "forward", broken)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}, timeout=60)
        assert r.status_code == 500 and "simulated kernel failure" in r.json()["error"]["message"]
        assert pool_is_whole(engine)
        monkeypatch.setattr(engine.model, "forward", forward)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and len(ids_of(r.json()["choices"][0]["text"])) == 3


def test_a_streamed_stop_string_never_reaches_the_client(tiny):
    """Generation stops at the stop string; the streamed text is the text before it, including
    when the stop string's start arrived in an earlier chunk (it is held back)."""
    model, directory, plan = tiny
    prompt = random_prompt(60, 7)
    ref = greedy_alone(model, prompt, 12)
    stop = f" {ref[4]} {ref[5]}"
    expected = "".join(f" {t}" for t in ref[:4])
    assert stop not in expected + f" {ref[4]}"
    engine = engine_for(plan, directory, gpu_blocks=16, block_tokens=4)
    with running(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                stop=stop, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
        assert whole.choices[0].text == expected and whole.usage.completion_tokens == 6
    assert pool_is_whole(engine)
