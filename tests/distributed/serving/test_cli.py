"""`hetplan serve` on a pipeline plan, as a user starts it: spawned here (one process per later
stage) or under torchrun (one command per stage, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT). It
says it serves a pipeline, answers, and Ctrl-C stops every process; a stage process killed while
idle or with a request in flight ends the requests with an error, and the server says one line
and exits 2 within seconds, every other process with it; a GPU tier without a block for each
group of requests is refused in one line. (Replicas: ``test_replicas``.)"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from hetplan.runtime.serve.api.server import free_port
from hetplan.workload import Workload
from tests.distributed.pipelines import VOCAB, lines_of, pipeline_plan, reference

WORKLOAD = Workload(2, 16, 24, prefill_chunk=8)


@pytest.fixture(scope="module")
def two_stages(llama_files, tmp_path_factory):
    model_dir, node, model = llama_files
    path = tmp_path_factory.mktemp("plans") / "two.json"
    pipeline_plan(model_dir, node, [0, 2, 4], ["stream", "ngl:0"], WORKLOAD, path)
    return path, str(model_dir), model


def serve(plan_path, directory, port: int, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hetplan", "serve", str(plan_path), "--weights", directory,
                             "--port", str(port), "--emulate", "--block-tokens", "4", "--dist-timeout", "60"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def started(lines: queue.Queue, seen: list) -> str:
    """Wait for the server's startup line -> it."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = lines.get(timeout=deadline - time.monotonic())
        assert line is not None, "the server ended before it started: " + "".join(seen)
        seen.append(line)
        if line.startswith("hetplan serve: "):
            return line
    raise AssertionError("the server did not start: " + "".join(seen))


def listening(port: int) -> None:
    """Wait until the server answers /health (it prints its startup line just before it listens)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError(f"nothing answers on port {port}")


def rest(lines: queue.Queue, seen: list) -> str:
    return "".join(seen) + "".join(iter(lambda: lines.get(timeout=60) or "", ""))


def stage_processes(pid: int) -> list:
    """The spawned stage processes of process ``pid`` (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def errors(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("hetplan: error:")]


def test_hetplan_serve_runs_a_pipeline_plan_and_ctrl_c_stops_every_process(two_stages):
    plan_path, directory, model = two_stages
    port = free_port()
    proc = serve(plan_path, directory, port)
    lines, seen = lines_of(proc), []
    try:
        line = started(lines, seen)
        assert "as a pipeline of 2 stages, one process each" in line and "2 groups in flight" in line
        listening(port)
        (stage_1,) = stage_processes(proc.pid)
        p = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(3)).tolist()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": p, "max_tokens": 8, "temperature": 0}, timeout=60)
        ref = reference(model, torch.tensor([p]), 8)["tokens"][0]
        assert [int(t) for t in r.json()["choices"][0]["text"].split()] == ref
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    err = rest(lines, seen)
    assert "Traceback" not in err and not errors(err), err
    assert proc.returncode in (0, 130), err
    deadline = time.monotonic() + 15
    while not gone(stage_1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(stage_1)


def after_killing(proc, victim) -> tuple:
    """Once the server ``proc`` has started, SIGKILL the process ``victim()`` names -> (its exit
    status, seconds from the kill to its exit, its stderr)."""
    lines, seen = lines_of(proc), []
    try:
        started(lines, seen)
        os.kill(victim(), signal.SIGKILL)
        killed = time.monotonic()
        rc = proc.wait(timeout=60)
        took = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, took, rest(lines, seen)


def test_a_stage_killed_while_idle_stops_the_server_in_one_line(two_stages):
    """The server process watches the stage processes it started."""
    plan_path, directory, _ = two_stages
    proc = serve(plan_path, directory, free_port())

    def stage_1():
        (pid,) = stage_processes(proc.pid)
        return pid
    rc, took, err = after_killing(proc, stage_1)
    assert rc == 2 and took < 15, (rc, took, err)
    (line,) = errors(err)
    assert line.startswith("hetplan: error: stage 1 was killed by SIGKILL; the pipeline cannot serve without it")
    assert "Traceback" not in err


def test_under_torchrun_a_stage_killed_mid_request_ends_it_with_an_error_and_every_process_exits(two_stages):
    """Stage 1 stopped (SIGSTOP) holds a request's step; killed, its connections close: stage 0
    ends the request (HTTP 500), says one line and exits 2 within seconds."""
    plan_path, directory, _ = two_stages
    port, master = free_port(), free_port()
    env = [dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master), OMP_NUM_THREADS="1") for r in range(2)]
    procs = [serve(plan_path, directory, port, env[r]) for r in range(2)]
    lines, seen = lines_of(procs[0]), []
    try:
        line = started(lines, seen)
        assert "as a pipeline of 2 stages" in line
        listening(port)
        procs[1].send_signal(signal.SIGSTOP)
        answer = {}

        def ask():
            answer["r"] = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                                     json={"prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0}, timeout=60)
        asking = threading.Thread(target=ask)
        asking.start()
        time.sleep(2)
        assert asking.is_alive()  # its first step waits in stage 1
        procs[1].kill()
        killed = time.monotonic()
        rc = procs[0].wait(timeout=60)
        took = time.monotonic() - killed
        asking.join(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    err = rest(lines, seen)
    assert rc == 2 and took < 15, (rc, took, err)
    assert answer["r"].status_code == 500 and "the engine failed on this request" in answer["r"].text
    (line,) = errors(err)
    assert line.startswith("hetplan: error: stage 0: receiving the logits from stage 1 failed: ")
    assert line.endswith("the requests in flight were ended")


def test_a_gpu_tier_without_a_block_for_each_group_is_refused_in_one_line(two_stages):
    plan_path, directory, _ = two_stages
    out = subprocess.run([sys.executable, "-m", "hetplan", "serve", str(plan_path), "--weights", directory,
                          "--port", "0", "--emulate", "--gpu-blocks", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    (line,) = errors(out.stderr)
    assert line == ("hetplan: error: --gpu-blocks 1: a pipeline of 2 stages serves 2 groups of requests at once, each "
                    "with its own share of the GPU tier's blocks; give at least 2")
    assert "Traceback" not in out.stderr
