"""Each stage process checks, before loading any weight, that this machine can hold the stage
its plan records: a GPU smaller than the stage's GPU budget, or a host with less memory than the
stage puts in DRAM, stops every process with one line (what the plan expects, what was found,
what to do); a GPU of another name is a warning line. The CUDA branch runs against mocked device
properties; the host branch end to end, with a stage record edited to need more DRAM than this
machine has."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hetplan.errors import HetplanError
from hetplan.pipeline.record import stage_plan
from hetplan.runtime.distributed import node
from hetplan.runtime.distributed.node import check_node, host_memory_bytes
from hetplan.workload import Workload
from tests.distributed.pipelines import pipeline_plan

MiB = 2**20


@pytest.fixture(scope="module")
def two_stages(llama_files, tmp_path_factory):
    """Stage 0 on GPU 0 (all-gpu), stage 1 on the CPU (ngl:0); the node's GPUs are named ``g``
    with 64 MiB."""
    model_dir, node_path, _ = llama_files
    path = tmp_path_factory.mktemp("node") / "plan.json"
    plan = pipeline_plan(model_dir, node_path, [0, 2, 4], ["all-gpu", "ngl:0"], Workload(1, 8, 4, prefill_chunk=8),
                         path)
    return plan, path, model_dir


def gpu(monkeypatch, name: str, total_bytes: int):
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(name=name, total_memory=total_bytes))


def test_a_gpu_smaller_than_the_stages_budget_is_refused_naming_both(two_stages, monkeypatch):
    plan, _, _ = two_stages
    stage = stage_plan(plan, 0)
    budget = stage.memory["gpu_budget_bytes"]
    gpu(monkeypatch, "Tiny GPU", budget - 1)
    with pytest.raises(HetplanError) as e:
        check_node(stage, 0, "cuda", 0)
    line = str(e.value)
    assert line.startswith("stage 0: the plan was made for ")
    assert "GPU (g, 64.00 MiB)" in line and "GPU 0 here (Tiny GPU)" in line
    assert "run this stage on a node with such a GPU, or recompile for this node's GPUs" in line
    assert "\n" not in line


def test_a_gpu_of_another_name_with_room_for_the_budget_is_a_warning(two_stages, monkeypatch):
    plan, _, _ = two_stages
    stage = stage_plan(plan, 0)
    gpu(monkeypatch, "NVIDIA H200", 139 * 2**30)
    (warning,) = check_node(stage, 0, "cuda", 0)
    assert warning.startswith("stage 0: the plan was made for ")
    assert "GPU 'g', but GPU 0 here is 'NVIDIA H200'" in warning
    gpu(monkeypatch, "g", stage.memory["gpu_budget_bytes"])   # the same GPU, exactly the budget: nothing to say
    assert check_node(stage, 0, "cuda", 0) == []


def test_a_host_with_less_memory_than_the_stage_puts_in_dram_is_refused(two_stages, monkeypatch):
    plan, _, _ = two_stages
    stage = stage_plan(plan, 1)
    need = stage.memory["cpu_bytes"]
    monkeypatch.setattr(node, "host_memory_bytes", lambda: need - 1)
    with pytest.raises(HetplanError, match=r"^stage 1: .* puts .* of the stage in DRAM, but this machine has "):
        check_node(stage, 1, "cpu", 0)
    monkeypatch.setattr(node, "host_memory_bytes", lambda: need)
    assert check_node(stage, 1, "cpu", 0) == []


def test_an_emulated_gpu_counts_in_host_memory(two_stages, monkeypatch):
    plan, _, _ = two_stages
    stage = stage_plan(plan, 0)
    need = stage.memory["cpu_bytes"] + stage.memory["gpu_bytes"]
    monkeypatch.setattr(node, "host_memory_bytes", lambda: need - 1)
    with pytest.raises(HetplanError, match=r"\(its CPU blocks and the emulated GPU\)"):
        check_node(stage, 0, "emulated", 0)
    monkeypatch.setattr(node, "host_memory_bytes", lambda: need)
    assert check_node(stage, 0, "emulated", 0) == []


def test_a_stage_recorded_on_a_node_with_more_dram_than_this_one_stops_every_process(two_stages, tmp_path):
    """Stage 1's record edited: planned on a node of twice this machine's memory, and putting
    1.5 times this machine's memory in DRAM. Its process refuses before loading; stage 0 says it
    was not started; the launcher says both stopped; exit 2."""
    _, path, model_dir = two_stages
    d = json.loads(path.read_text())
    d.pop("digest")
    host = host_memory_bytes()
    rec = d["pipeline"]["stages"][1]["plan"]
    rec["hardware"]["cpu"]["memory_bytes"] = 2 * host
    rec["memory"]["cpu_budget_bytes"] = 2 * host
    rec["memory"]["cpu_bytes"] = 3 * host // 2
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(d))
    out = subprocess.run([sys.executable, "-m", "hetplan", "exec", str(edited), "--weights", str(model_dir),
                          "--emulate", "--dist-timeout", "60"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = [l for l in out.stderr.splitlines() if l.startswith("hetplan: error:")]
    assert len(lines) == 3, out.stderr
    (own,) = [l for l in lines if l.startswith("hetplan: error: stage 1:")]
    assert "this machine has" in own and "run this stage on a node with at least" in own
    (other,) = [l for l in lines if l.startswith("hetplan: error: stage 0:")]
    assert other.startswith("hetplan: error: stage 0: not started: stage 1 cannot run (the plan was made for")
    (launcher,) = [l for l in lines if l.startswith("hetplan: error: the pipeline run stopped: ")]
    assert "stage 0 exited with status 2" in launcher and "stage 1 exited with status 2" in launcher
