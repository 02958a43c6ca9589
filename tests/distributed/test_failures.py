"""A pipeline run never hangs: a stage process killed mid-run makes the others exit with one
line within seconds (with replicas too: the other replica's processes as well); a rendezvous that never completes ends within --dist-timeout, one line,
exit 2; a process count that does not match the stages, or a GPU plan without a GPU, is refused
at once. The processes are started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), one ``python -m hetplan exec`` each."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import transformers

from hetplan.workload import Workload
from tests.distributed.pipelines import lines_of, pipeline_plan, replicated_plan

LONG = Workload(1, 8, 4000, prefill_chunk=8)
"""Decode long enough (thousands of steps) that a run killed after its first step is mid-run."""


@pytest.fixture(scope="module")
def three_stages(llama_files, tmp_path_factory):
    model_dir, node, _ = llama_files
    path = tmp_path_factory.mktemp("plans") / "three.json"
    pipeline_plan(model_dir, node, [0, 1, 3, 4], ["all-gpu", "stream", "ngl:0"], LONG, path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(plan_path, rank: int, world: int, port: int, *extra) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "hetplan", "exec", str(plan_path), "--weights", "random",
                             "--emulate", *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def errors(stderr: str) -> list:
    return [line for line in stderr.splitlines() if line.startswith("hetplan: error:")]


@pytest.fixture(scope="module")
def two_by_two(llama_files, tmp_path_factory):
    """Two replicas of a two-stage pipeline on the four tiny GPUs (``pipelines.replicated_plan``)."""
    model_dir, node, _ = llama_files
    path = tmp_path_factory.mktemp("plans") / "two-by-two.json"
    plan = replicated_plan(model_dir, node, 2, dataclasses.replace(LONG, objective="throughput"), path, "400KiB")
    assert plan.pipeline["replicas"] == 2 and len(plan.pipeline["stages"]) == 2
    return path


def stop_mid_run(plan_path, sig, timeout_s: int, world: int = 3, victim: int = 1):
    """Start ``world`` processes, send rank ``victim`` ``sig`` once the last one decodes -> (exit
    codes of the others, seconds they took to exit after it, their stderr by rank)."""
    port = free_port()
    procs = [start(plan_path, r, world, port, "--dist-timeout", str(timeout_s)) for r in range(world)]
    others = [r for r in range(world) if r != victim]
    try:
        last = lines_of(procs[world - 1])
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:  # the last stage reports decode steps as they end
            line = last.get(timeout=deadline - time.monotonic())
            assert line is not None, f"the last stage ended before decoding: {''.join(seen)}"
            seen.append(line)
            if line.startswith("decode "):
                break
        procs[victim].send_signal(sig)
        stopped = time.monotonic()
        rcs = [procs[r].wait(timeout=timeout_s + 60) for r in others]
        took = time.monotonic() - stopped
        stderr = {r: procs[r].stderr.read() for r in others if r != world - 1}
        stderr[world - 1] = "".join(seen) + "".join(iter(lambda: last.get() or "", ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return rcs, took, stderr


def test_a_killed_stage_makes_the_others_exit_with_one_line_within_seconds(three_stages):
    rcs, took, stderr = stop_mid_run(three_stages, signal.SIGKILL, 120)
    assert rcs == [2, 2]
    assert took < 15, f"the other stages took {took:.1f} s to stop"
    for r in (0, 2):
        (line,) = errors(stderr[r])
        assert line.startswith(f"hetplan: error: stage {r}: ") and "failed" in line and "stops" in line


def test_a_hung_stage_makes_the_others_exit_with_one_line_within_the_timeout(three_stages):
    """Stage 1 stopped (SIGSTOP), its connections open: stage 2 gives up waiting for it after
    --dist-timeout, and stage 0, waiting for stage 2, as soon as stage 2 has gone."""
    rcs, took, stderr = stop_mid_run(three_stages, signal.SIGSTOP, 15)
    assert rcs == [2, 2]
    assert 15 <= took < 15 + 20, f"the other stages took {took:.1f} s to stop"
    (line,) = errors(stderr[2])
    assert line.startswith("hetplan: error: stage 2: receiving the decode hidden state from stage 1 failed: Timed out")
    (line,) = errors(stderr[0])
    assert line.startswith("hetplan: error: stage 0: ") and "stage 2 failed" in line


def test_a_killed_stage_of_one_replica_makes_every_process_of_both_exit_within_seconds(two_by_two):
    """Replica 0's stage 1 (rank 1) killed while replica 1 decodes: replica 0's stage 0 loses its
    peer; replica 1's stage 0 its heartbeat with replica 0, and its stage 1 then its peer."""
    rcs, took, stderr = stop_mid_run(two_by_two, signal.SIGKILL, 120, world=4, victim=1)
    assert rcs == [2, 2, 2]
    assert took < 15, f"the other processes took {took:.1f} s to stop"
    for r, name in ((0, "replica 0 stage 0"), (2, "replica 1 stage 0"), (3, "replica 1 stage 1")):
        (line,) = errors(stderr[r])
        assert line.startswith(f"hetplan: error: {name}: ") and "failed" in line and "stops" in line, line
    assert "hearing from the other replicas failed" in errors(stderr[2])[0]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rendezvous_that_never_completes_ends_in_one_line_within_the_timeout(three_stages, rank):
    t0 = time.monotonic()
    proc = start(three_stages, rank, 3, free_port(), "--dist-timeout", "3")
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 2
    (line,) = errors(stderr)
    assert f"stage {rank}: the rendezvous" in line and "within 3 s" in line
    assert time.monotonic() - t0 < 60


def test_a_process_count_other_than_the_stages_is_refused_at_once(three_stages):
    proc = start(three_stages, 0, 2, free_port(), "--dist-timeout", "60")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2
    (line,) = errors(stderr)
    assert "WORLD_SIZE 2" in line and "3 stage(s)" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_gpu_pipeline_without_a_gpu_is_refused_before_any_process_starts(three_stages):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "hetplan", "exec", str(three_stages), "--weights", "random",
                           "--no-emulate"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    (line,) = errors(proc.stderr)
    assert "no CUDA device" in line


def test_a_stage_that_cannot_place_its_blocks_stops_every_process_before_the_run(llama_files, tmp_path):
    """A checkpoint of three layers for a plan of four: stage 1 (layers 2-3) misses layer 3's
    tensors; stage 0 could run but says it was not started, naming stage 1 and why."""
    model_dir, node, _ = llama_files
    plan_path = tmp_path / "plan.json"
    pipeline_plan(model_dir, node, [0, 2, 4], ["all-gpu", "all-gpu"], Workload(1, 8, 4, prefill_chunk=8), plan_path)
    short = tmp_path / "three-layers"
    config = transformers.AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = 3
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(short, safe_serialization=True)
    out = subprocess.run([sys.executable, "-m", "hetplan", "exec", str(plan_path), "--weights", str(short),
                          "--emulate", "--dist-timeout", "60"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = errors(out.stderr)
    assert len(lines) == 3, out.stderr   # each stage process, and the launcher
    (own,) = [l for l in lines if l.startswith("hetplan: error: stage 1:")]
    (other,) = [l for l in lines if l.startswith("hetplan: error: stage 0:")]
    assert "model.layers.3." in own
    assert other.startswith("hetplan: error: stage 0: not started: stage 1 cannot run (") and "model.layers.3." in other
    (launcher,) = [l for l in lines if l.startswith("hetplan: error: the pipeline run stopped: ")]
    assert "stage 0 exited with status 2" in launcher and "stage 1 exited with status 2" in launcher
