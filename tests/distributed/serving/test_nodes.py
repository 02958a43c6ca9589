"""`hetplan serve` over a plan whose replicas sit on nodes of their own, under torchrun: one
process per stage of every replica, started as torchrun starts them on each node (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT; the nodes emulated on this machine, the rendezvous on
127.0.0.1), GPUs emulated, gloo.

Two nodes, two replicas of one stage: six concurrent requests through rank 0's front get
transformers' greedy tokens each and both replicas serve some (their own /metrics, through the
front); Ctrl-C on rank 0 stops both processes (exit 0, no error). Four nodes, two replicas of a
two-stage pipeline: transformers' tokens, then one replica's second stage killed makes the
three other processes exit 2 with one line each within 15 s. A one-node replicas plan under
torchrun is served the same way, and SIGINT to rank 1 (Ctrl-C where it runs, which torchrun
passes on) stops both processes as well (exit 0). A WORLD_SIZE other than replicas x stages is
one line, exit 2; a rendezvous that never completes, one line within --dist-timeout; such a plan
started without torchrun is refused in one line. The lifeline alone: a process gone silent
(stopped, its connections open) stops the others within its timeout.

The plans: ``compile --serve`` of the tiny llama on a cluster of two one-GPU nodes (each GPU
holds it); and the throughput plan of two replicas over four one-GPU nodes of 400 KiB of GPU
and of DRAM each (``pipeline.compile.replicated``: each replica a pipeline over two nodes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from hetplan.compiler import CompileRequest, stage_solver
from hetplan.frontends.resolve import load_model
from hetplan.pipeline.cluster import load_hardware
from hetplan.pipeline.compile import replicated, with_gpu_budgets
from hetplan.runtime.serve.api.server import free_port
from hetplan.serving import ServingRequest, compile_serving
from hetplan.workload import Workload
from tests.distributed.pipelines import NODE, _written, lines_of
from tests.distributed.serving.test_cli import errors, gone, listening, rest, started
from tests.distributed.serving.test_replicas import ask_all, metric, prompts, two_replicas  # noqa: F401 (a fixture)

ONE_GPU = NODE.replace("  - {name: g, memory: 64MiB, mem_bandwidth: 100GB/s, flops: {fp32: 10TFLOPS}}\n", "", 3)


def cluster(d, n: int) -> str:
    (d / "node.yaml").write_text(ONE_GPU)
    path = d / "cluster.yaml"
    path.write_text(f"name: lan\nnodes: [{', '.join(['node.yaml'] * n)}]\n"
                    f"network: {{bandwidth: 10Gbit/s, latency: 50us}}\n")
    return str(path)


@pytest.fixture(scope="module")
def two_nodes(llama_files, tmp_path_factory):
    """(plan path, model directory, transformers model): ``compile --serve`` on two one-GPU nodes."""
    model_dir, _, model = llama_files
    d = tmp_path_factory.mktemp("two-nodes")
    plan, _ = compile_serving(CompileRequest(model=str(model_dir), hw=cluster(d, 2), weight_dtype="fp32",
                                             prompt_len=16, gen_len=24, prefill_chunk=8), ServingRequest(max_batch=4))
    assert plan.pipeline["replicas"] == 2 and plan.pipeline["replica_step"] == {"nodes": 1}
    assert len(plan.pipeline["stages"]) == 1
    (d / "plan.json").write_text(plan.to_json())
    return d / "plan.json", str(model_dir), model


def start(plan_path, directory, world: int, port: int, *extra, ranks=None) -> list:
    """``world`` processes of ``hetplan serve`` (those of ``ranks``: all by default) as torchrun
    starts them, one per emulated node."""
    master = str(free_port())
    procs = []
    for rank in range(world) if ranks is None else ranks:
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=master, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "hetplan", "serve", str(plan_path), "--weights",
                                       directory, "--port", str(port), "--emulate", "--block-tokens", "4",
                                       "--dist-timeout", "60", *extra],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def ended(procs: list, seconds: float) -> list:
    """Each process's exit status, once every one ended (killing any left after ``seconds``)."""
    deadline = time.monotonic() + seconds
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    left = [p for p in procs if p.poll() is None]
    for p in left:
        p.kill()
        p.wait()
    assert not left, "still running: " + ", ".join(str(procs.index(p)) for p in left)
    return [p.returncode for p in procs]


@contextlib.contextmanager
def two_serving(plan_path, directory, items, port: int, says: str, stop_rank: int):
    """Two torchrun processes serving ``plan_path``: inside, rank 0 said its startup line
    (``says`` in it; the line is what is yielded) and ``items`` got transformers' tokens through
    its front; on leaving, SIGINT to ``stop_rank``, and both end with exit 0 and no error."""
    procs = start(plan_path, directory, 2, port)
    streams = [lines_of(p) for p in procs]
    seen = [[], []]
    try:
        line = started(streams[0], seen[0])
        assert says in line, line
        listening(port)
        assert ask_all(port, items) == [ref for _, ref in items]
        yield line
    finally:
        procs[stop_rank].send_signal(signal.SIGINT)
        codes = ended(procs, 60)
    errs = [rest(s, w) for s, w in zip(streams, seen)]
    assert codes == [0, 0] and not any(errors(e) or "Traceback" in e for e in errs), (codes, errs)


def test_two_replicas_on_nodes_of_their_own_answer_through_rank_0_and_ctrl_c_on_rank_0_stops_both(two_nodes):
    plan_path, directory, model = two_nodes
    port = free_port()
    with two_serving(plan_path, directory, prompts(model), port,
                     "each one emulated GPU in one process on 1 node(s) of its own", 0) as line:
        assert line.startswith("hetplan serve: 2 replicas of ") and f"http://127.0.0.1:{port}" in line
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        dealt = [metric(metrics, f'hetplan_replica_requests_total{{replica="{r}"}}') for r in (0, 1)]
        assert sum(dealt) == 6 and min(dealt) >= 1, dealt
        assert [metric(metrics, f'hetplan_requests_completed_total{{replica="{r}"}}') for r in (0, 1)] == dealt
        assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}


def test_a_killed_stage_of_one_replica_stops_every_process_of_both_in_one_line_each(llama_files, tmp_path):
    """Two replicas of a two-stage pipeline over four nodes: replica 1's second stage killed once
    they answered, the three others exit 2 within 15 s, one line each."""
    model_dir, _, model = llama_files
    topo = with_gpu_budgets(load_hardware(cluster(tmp_path, 4)), "400KiB", 400 * 1024)
    wl = Workload(2, 16, 24, objective="throughput", prefill_chunk=8)
    req = CompileRequest(model=str(model_dir), hw=str(tmp_path / "cluster.yaml"), objective="throughput")
    pp = replicated(load_model(str(model_dir), "fp32"), topo, 2, wl, stage_solver(req, moe_stages=True))
    plan = _written(pp, tmp_path / "plan.json")
    assert plan.pipeline["replica_step"] == {"nodes": 2}
    assert [s["node"] for s in plan.pipeline["stages"]] == [0, 1]   # replica 1: nodes 2 and 3
    items = prompts(model, 4)
    port = free_port()
    procs = start(tmp_path / "plan.json", str(model_dir), 4, port, "--gpu-blocks", "20")
    streams = [lines_of(p) for p in procs]
    seen = [[] for _ in procs]
    try:
        line = started(streams[0], seen[0])
        assert "each a pipeline of 2 stages, one process each on 2 node(s) of its own" in line, line
        listening(port)
        assert ask_all(port, items) == [ref for _, ref in items]
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert min(metric(metrics, f'hetplan_replica_requests_total{{replica="{r}"}}') for r in (0, 1)) >= 1
        os.kill(procs[3].pid, signal.SIGKILL)
        killed = time.monotonic()
        codes = ended(procs[:3], 15)
        took = time.monotonic() - killed
    finally:
        ended(procs, 1)
    errs = [rest(s, w) for s, w in zip(streams[:3], seen[:3])]
    assert codes == [2, 2, 2] and took < 15, (codes, took, errs)
    lines = [errors(e) for e in errs]
    assert [len(x) for x in lines] == [1, 1, 1], errs
    assert lines[0][0].startswith("hetplan: error: replica 0 stage 0: replica 1 stage ") and " stopped (" in lines[0][0]
    assert [x[0].split(":")[2].strip() for x in lines] == ["replica 0 stage 0", "replica 0 stage 1",
                                                           "replica 1 stage 0"]
    assert not any("Traceback" in e for e in errs), errs


def test_a_one_node_replicas_plan_under_torchrun_is_served_the_same_way_and_ctrl_c_on_rank_1_stops_both(
        two_replicas):
    """Two replicas side by side on one node's two GPUs (``replica_step.gpus``), one torchrun
    process each: the same tokens through rank 0's front; SIGINT to rank 1 (Ctrl-C on its node,
    as torchrun passes it on) asks rank 0 to stop both, exit 0."""
    plan_path, directory, model = two_replicas
    with two_serving(plan_path, directory, prompts(model, 2), free_port(),
                     "each one emulated GPU in one process on 1 GPU(s) of its own", 1):
        pass


def test_a_world_size_other_than_replicas_times_stages_is_one_line(two_nodes):
    plan_path, directory, _ = two_nodes
    (proc,) = start(plan_path, directory, 3, free_port(), ranks=[0])   # the others say the same
    (code,) = ended([proc], 120)
    err = proc.stderr.read()
    assert code == 2, err
    (line,) = errors(err)
    assert line == ("hetplan: error: WORLD_SIZE 3, RANK 0: the plan serves 2 replicas x 1 stage(s) = 2 processes, "
                    "one per stage of each replica; start 2 processes in all (torchrun --nnodes and "
                    "--nproc-per-node adding up to 2)")
    assert "Traceback" not in err


def test_replicas_on_nodes_of_their_own_started_without_torchrun_are_refused_in_one_line(two_nodes):
    plan_path, directory, _ = two_nodes
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "hetplan", "serve", str(plan_path), "--weights", directory,
                          "--port", "0", "--emulate"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    (line,) = errors(out.stderr)
    assert line.startswith(f"hetplan: error: {plan_path}: the plan runs 2 replicas on nodes of their own (1 "
                           f"node(s) each)") and "start it under torchrun on every node" in line, line
    assert "Traceback" not in out.stderr


def test_a_replica_is_reached_at_the_address_its_node_reaches_the_rendezvous_from():
    from hetplan.runtime.serve.replicas.torchrun import advertised, url_of

    assert advertised({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}) == "127.0.0.1"
    assert advertised({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                       "HETPLAN_SERVE_ADDRESS": "10.0.0.7"}) == "10.0.0.7"
    assert url_of("10.0.0.7", 8001) == "http://10.0.0.7:8001" and url_of("fd00::7", 8001) == "http://[fd00::7]:8001"


def test_a_rendezvous_that_never_completes_is_one_line_within_the_timeout(two_nodes):
    plan_path, directory, _ = two_nodes
    (rank_0,) = start(plan_path, directory, 2, free_port(), "--dist-timeout", "3", ranks=[0])   # rank 1 never comes
    (code,) = ended([rank_0], 90)
    err = rank_0.stderr.read()
    assert code == 2, err
    (line,) = errors(err)
    assert line.startswith("hetplan: error: replica 0 stage 0: the rendezvous at env:// with the other 1 stage "
                           "process(es) did not complete within 3 s"), line
    assert "Traceback" not in err


LIFELINE = """
import datetime, sys, time
import torch.distributed as dist
from hetplan.runtime.distributed.ranks import Ranks
from hetplan.runtime.serve.replicas.lifeline import Lifeline
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
line = Lifeline(Ranks(2, 1), rank, 3.0)
line.gather(None)
line.start(on_stop=None)
print("up", flush=True)
time.sleep(120)
"""


def test_a_process_gone_silent_stops_the_others_within_the_timeout():
    """Rank 1 stopped (SIGSTOP: its connections stay open, its pulses stop): rank 0 hears no
    pulse within the lifeline's timeout (3 s here), says one line and exits 2; rank 1, let go
    again, hears that and exits 2 too."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", LIFELINE, str(r), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["up", "up"]
        procs[1].send_signal(signal.SIGSTOP)
        assert procs[0].wait(timeout=30) == 2
    finally:
        procs[1].send_signal(signal.SIGCONT)
        codes = ended(procs, 30)
    errs = [p.stderr.read() for p in procs]
    assert codes == [2, 2], (codes, errs)
    (line,) = errors(errs[0])
    assert line.startswith("hetplan: error: replica 0 stage 0: replica 1 stage 0 stopped (") and "Timed out" in line, line
    (line,) = errors(errs[1])
    assert line.startswith("hetplan: error: replica 1 stage 0: "), line
    assert not any("Traceback" in e for e in errs), errs
