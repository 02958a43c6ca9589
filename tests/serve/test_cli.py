"""`hetplan serve` on the command line and with a tokenizer beside the weights: a server process
that answers and stops on Ctrl-C; text prompts tokenised and chat messages rendered with the
tokenizer's chat template; the end-of-sequence token ending a request; bad flags refused in one line (exit 2).
"""

from __future__ import annotations

import copy
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from hetplan.cli import main
from hetplan.plan import write_atomic
from hetplan.runtime.serve.api.server import free_port, running
from hetplan.runtime.serve.engine import Engine
from hetplan.runtime.serve.sampling import SamplingParams
from tests.serve.fixtures import engine_for, greedy_alone, tiny_llama

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t1{% endif %}"
"""Renders [{"content": "t5 t6"}] as "t5 t6 t1": each message's words, then t1 opens the reply."""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny llama with a word-level tokenizer (word ``t<i>`` is id i) and a chat template."""
    model, directory, plan = tiny_llama(tmp_path_factory)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(128)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    plan_path = tmp_path_factory.mktemp("plan") / "plan.json"
    write_atomic(plan_path, plan.to_json())
    return model, directory, plan, plan_path, fast


def test_text_prompts_and_chat_use_the_tokenizer(served):
    model, directory, plan, _, tok = served
    engine = engine_for(plan, directory, gpu_blocks=32, block_tokens=4)
    ref = greedy_alone(model, [5, 6, 7], 6)
    chat_ref = greedy_alone(model, [9, 10, 1], 5)
    with running(engine) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="tiny", prompt="t5 t6 t7", max_tokens=6, temperature=0)
        assert r.choices[0].text == tok.decode(ref) and r.usage.prompt_tokens == 3
        c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t9 t10"}],
                                           max_tokens=5, temperature=0)
        assert c.choices[0].message.content == tok.decode(chat_ref)
        parts = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t9 t10"}],
                                               max_tokens=5, temperature=0, stream=True)
        assert "".join(p.choices[0].delta.content or "" for p in parts) == tok.decode(chat_ref)


def test_the_serve_command_answers_and_stops_on_ctrl_c(served):
    model, directory, _, plan_path, tok = served
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hetplan.cli.app", "serve", str(plan_path), "--weights",
                             str(directory), "--port", str(port), "--emulate", "--block-tokens", "4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):  # until it listens (loading takes a few seconds)
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0},
                       timeout=60)
        assert r.json()["choices"][0]["text"] == tok.decode(greedy_alone(model, [5, 6, 7], 6))
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    assert proc.returncode in (0, 130), err


@pytest.mark.parametrize("flags, words", [
    (["--max-batch", "0"], "--max-batch 0: must be at least 1"),
    (["--max-context", "100000"], "--max-context 100000"),
])
def test_bad_flags_are_one_line_errors(served, capsys, flags, words):
    _, directory, _, plan_path, _ = served
    rc = main(["serve", str(plan_path), "--weights", str(directory), "--emulate", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and words in err[0] and err[0].startswith("hetplan: error: ")


def test_the_end_of_sequence_token_ends_a_request_and_is_not_in_its_text(served):
    model, directory, plan, _, tok = served
    ref = greedy_alone(model, [5, 6, 7], 8)
    assert ref[3] not in ref[:3]
    with_eos = copy.deepcopy(tok)
    with_eos.eos_token = f"t{ref[3]}"
    base = engine_for(plan, directory, gpu_blocks=32, block_tokens=4)
    engine = Engine(base.model, base.pool, base.settings, tokenizer=with_eos)
    req = engine.submit([5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
    engine.run_until_idle()
    assert req.generated == ref[:4] and req.finish_reason == "stop"
    assert engine.text(req) == tok.decode(ref[:3])


def test_ignore_eos_generates_to_max_tokens_past_the_end_of_sequence_token(served):
    model, directory, plan, _, tok = served
    ref = greedy_alone(model, [5, 6, 7], 8)
    with_eos = copy.deepcopy(tok)
    with_eos.eos_token = f"t{ref[3]}"
    base = engine_for(plan, directory, gpu_blocks=32, block_tokens=4)
    engine = Engine(base.model, base.pool, base.settings, tokenizer=with_eos)
    req = engine.submit([5, 6, 7], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.run_until_idle()
    assert req.generated == ref and req.finish_reason == "length"
