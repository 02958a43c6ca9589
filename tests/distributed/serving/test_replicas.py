"""`hetplan serve` over a plan with replicas, as a user starts it (emulated GPUs, gloo): the
front spawns one process per replica and deals the requests among them. Six concurrent requests
of different lengths get transformers' greedy tokens each, and both replicas got some; a
streamed request comes through the front; /health and /metrics speak for every replica; Ctrl-C
stops every process; a replica killed ends the front with one line, exit 2, within 15 s, no
process left; two replicas of a two-stage pipeline (five processes) get the same tokens.
(Replicas under torchrun, over several nodes: ``test_nodes``.)

The plans: ``compile --serve`` of the tiny llama on a node of two alike GPUs, each holding it (two
replicas of one GPU); and the throughput plan of two replicas of a two-stage pipeline over four
GPUs of 400 KiB (``replicated_plan``)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from hetplan.compiler import CompileRequest
from hetplan.runtime.serve.api.server import free_port
from hetplan.serving import ServingRequest, compile_serving
from hetplan.workload import Workload
from tests.distributed.pipelines import NODE, VOCAB, lines_of, reference, replicated_plan
from tests.distributed.serving.test_cli import after_killing, errors, gone, listening, rest, started

LENGTHS = (3, 12, 5, 20, 9, 7)
MAX_TOKENS = 10
TWO_GPUS = NODE.replace("  - {name: g, memory: 64MiB, mem_bandwidth: 100GB/s, flops: {fp32: 10TFLOPS}}\n", "", 2)


@pytest.fixture(scope="module")
def two_replicas(llama_files, tmp_path_factory):
    """(plan path, model directory, transformers model): ``compile --serve`` on two alike GPUs."""
    model_dir, _, model = llama_files
    d = tmp_path_factory.mktemp("served-replicas")
    node, path = d / "node.yaml", d / "plan.json"
    node.write_text(TWO_GPUS)
    plan, _ = compile_serving(CompileRequest(model=str(model_dir), hw=str(node), weight_dtype="fp32", prompt_len=16,
                                             gen_len=24, prefill_chunk=8), ServingRequest(max_batch=4))
    assert plan.pipeline["replicas"] == 2 and len(plan.pipeline["stages"]) == 1
    path.write_text(plan.to_json())
    return path, str(model_dir), model


def prompts(model, n: int = len(LENGTHS)) -> list:
    out = []
    for i, length in enumerate(LENGTHS[:n]):
        p = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(200 + i)).tolist()
        out.append((p, reference(model, torch.tensor([p]), MAX_TOKENS)["tokens"][0]))
    return out


def serve(plan_path, directory, port: int, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hetplan", "serve", str(plan_path), "--weights", directory,
                             "--port", str(port), "--emulate", "--block-tokens", "4", "--dist-timeout", "120"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def descendants(pid: int) -> list:
    """Every process below ``pid`` (its spawned replicas, their stage processes), not
    multiprocessing's resource trackers."""
    out = []
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return out
    for c in map(int, children):
        try:
            if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text():
                out += [c] + descendants(c)
        except FileNotFoundError:
            pass
    return out


def ask_all(port: int, items: list) -> list:
    """Every prompt at once through the front -> each answer's tokens."""
    results = [None] * len(items)

    def ask(i):
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": items[i][0], "max_tokens": MAX_TOKENS, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        results[i] = [int(t) for t in r.json()["choices"][0]["text"].split()]
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def metric(text: str, sample: str) -> float:
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    assert m, f"{sample} not in /metrics"
    return float(m.group(1))


def stopped(proc: subprocess.Popen, lines, seen: list, below: list) -> str:
    """SIGINT to the front -> its stderr once every process is gone."""
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    err = rest(lines, seen)
    deadline = time.monotonic() + 15
    while not all(map(gone, below)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(gone, below)), below
    return err


def test_six_requests_through_two_replicas_get_transformers_greedy_tokens_and_both_replicas_serve(two_replicas):
    plan_path, directory, model = two_replicas
    items = prompts(model)
    port = free_port()
    proc = serve(plan_path, directory, port)
    lines, seen, below = lines_of(proc), [], []
    try:
        line = started(lines, seen)
        assert line.startswith("hetplan serve: 2 replicas of ") and "each one emulated GPU in one process" in line
        listening(port)
        below = descendants(proc.pid)
        assert len(below) == 2
        assert ask_all(port, items) == [ref for _, ref in items]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        dealt = [metric(metrics, f'hetplan_replica_requests_total{{replica="{r}"}}') for r in (0, 1)]
        assert sum(dealt) == 6 and min(dealt) >= 1, dealt
        assert metric(metrics, "hetplan_requests_completed_total") == 6
        assert [metric(metrics, f'hetplan_requests_completed_total{{replica="{r}"}}') for r in (0, 1)] == dealt
        assert metric(metrics, 'hetplan_kv_blocks{tier="gpu"}') == 2 * metric(
            metrics, 'hetplan_kv_blocks{tier="gpu",replica="0"}')
        assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]["object"] == "model"
        # a streamed request, its events relayed as the replica sends them
        p, ref = items[3]
        text, finish = "", None
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                          json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for event in r.iter_lines():
                if event.startswith("data: ") and event != "data: [DONE]":
                    choice = json.loads(event.removeprefix("data: "))["choices"][0]
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
        assert [int(t) for t in text.split()] == ref and finish == "length"
    finally:
        err = stopped(proc, lines, seen, below)
    assert "Traceback" not in err and not errors(err), err
    assert proc.returncode in (0, 130), err


def test_a_replica_killed_stops_the_front_in_one_line_and_every_process(two_replicas):
    plan_path, directory, _ = two_replicas
    port = free_port()
    proc = serve(plan_path, directory, port)
    below = []

    def replica_1():
        listening(port)
        below.extend(descendants(proc.pid))
        return below[1]
    rc, took, err = after_killing(proc, replica_1)
    assert rc == 2 and took < 15, (rc, took, err)
    (line,) = errors(err)
    assert line.startswith("hetplan: error: replica 1 was killed by SIGKILL; every replica was stopped"), line
    assert "Traceback" not in err
    assert all(map(gone, below))


def test_two_replicas_of_a_two_stage_pipeline_get_transformers_greedy_tokens(llama_files, tmp_path):
    model_dir, node, model = llama_files
    path = tmp_path / "two-by-two.json"
    wl = Workload(2, 16, 24, objective="throughput", prefill_chunk=8)
    plan = replicated_plan(model_dir, node, 2, wl, path, "400KiB")
    assert plan.pipeline["replicas"] == 2 and len(plan.pipeline["stages"]) == 2
    items = prompts(model, 4)
    port = free_port()
    proc = serve(path, str(model_dir), port)
    lines, seen, below = lines_of(proc), [], []
    try:
        line = started(lines, seen)
        assert line.startswith("hetplan serve: 2 replicas of ") and "each a pipeline of 2 stages" in line
        listening(port)
        below = descendants(proc.pid)
        assert len(below) == 4     # two replicas, each with its second stage's process
        assert ask_all(port, items) == [ref for _, ref in items]
    finally:
        err = stopped(proc, lines, seen, below)
    assert "Traceback" not in err and not errors(err), err


def test_the_front_deals_to_the_replica_with_the_fewest_in_flight_the_first_on_a_tie():
    from hetplan.runtime.serve.replicas.front import Front

    front = Front(["http://a", "http://b", "http://c"])
    front.in_flight = [2, 0, 1]
    assert front.pick() == 1
    front.in_flight = [1, 1, 1]
    assert front.pick() == 0


def test_the_replicas_metrics_are_summed_sample_by_sample_then_each_labelled():
    from hetplan.runtime.serve.replicas.front import summed_metrics

    one = ('# TYPE hetplan_requests_running gauge\nhetplan_requests_running 2\n# TYPE hetplan_ttft_seconds histogram\n'
           'hetplan_ttft_seconds_bucket{le="0.5"} 3\nhetplan_ttft_seconds_sum 0.25\n')
    two = ('# TYPE hetplan_requests_running gauge\nhetplan_requests_running 1\n# TYPE hetplan_ttft_seconds histogram\n'
           'hetplan_ttft_seconds_bucket{le="0.5"} 4\nhetplan_ttft_seconds_sum 0.5\n')
    assert summed_metrics([one, two]).splitlines() == [
        "# TYPE hetplan_requests_running gauge", "hetplan_requests_running 3",
        "# TYPE hetplan_ttft_seconds histogram", 'hetplan_ttft_seconds_bucket{le="0.5"} 7',
        "hetplan_ttft_seconds_sum 0.75",
        'hetplan_requests_running{replica="0"} 2', 'hetplan_ttft_seconds_bucket{le="0.5",replica="0"} 3',
        'hetplan_ttft_seconds_sum{replica="0"} 0.25',
        'hetplan_requests_running{replica="1"} 1', 'hetplan_ttft_seconds_bucket{le="0.5",replica="1"} 4',
        'hetplan_ttft_seconds_sum{replica="1"} 0.5']


def test_replicas_that_cannot_load_their_weights_stop_in_one_line(two_replicas, tmp_path):
    plan_path, _, _ = two_replicas
    missing = tmp_path / "no-such-checkpoint"
    out = subprocess.run([sys.executable, "-m", "hetplan", "serve", str(plan_path), "--weights", str(missing),
                          "--port", "0", "--emulate", "--dist-timeout", "120"], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 2, out.stderr
    (line,) = errors(out.stderr)
    assert re.match(r"hetplan: error: replica [01]: ", line) and str(missing) in line, line
    assert "Traceback" not in out.stderr and "hetplan serve:" not in out.stderr


@pytest.mark.parametrize("gone_at", [0, 1, None])
def test_a_relayed_stream_counts_its_request_out_once_however_the_client_leaves(gone_at):
    """A streamed answer through the front: the client gone before the first byte (``send``
    fails at once: the relaying generator never starts), gone mid-stream, or staying to the end,
    the request is counted out of its replica's in-flight number exactly once."""
    import asyncio

    from hetplan.runtime.serve.replicas.front import Front, _Relayed

    front, closes = Front(["http://127.0.0.1:1"]), []
    front.in_flight[0] = 1

    async def close():
        if not closes:
            front.in_flight[0] -= 1
        closes.append(True)

    async def chunks():
        try:
            for c in (b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"):
                yield c
        finally:
            await close()

    sent = []

    async def send(message):
        if gone_at is not None and len(sent) >= gone_at:
            raise OSError("client gone")
        sent.append(message)

    async def receive():
        await asyncio.sleep(3600)

    async def run():
        response = _Relayed(chunks(), close, media_type="text/event-stream")
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        try:
            await response(scope, receive, send)
        except Exception:  # noqa: BLE001 - the disconnect, as starlette reports it
            pass

    asyncio.run(run())
    assert front.in_flight == [0] and len(closes) >= 1
    assert (len(sent) == 5) == (gone_at is None)   # start, three chunks, the end
