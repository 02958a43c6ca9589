"""A pipeline plan run as one process per stage (gloo, emulated GPUs) computes what transformers
computes: the prefill logits at every prompt position and the logits of every decode step within
1e-4 of the logits' scale (fp32), and the same greedy tokens, with two and four stage processes
and stages that stream their blocks or compute them on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hetplan.runtime.distributed.launch import run_pipeline
from hetplan.runtime.session import RunOptions
from hetplan.workload import Workload
from tests.distributed.pipelines import pipeline_plan, reference, tiers

PROMPT_LEN, GEN_LEN, TOL = 8, 12, 1e-4


@pytest.fixture(scope="module")
def llama(llama_files):
    d, node, model = llama_files
    ids = torch.randint(0, 128, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(7))
    return d, node, ids, reference(model, ids, GEN_LEN)


CASES = {
    # name: (layer cuts, strategy per stage, weights tiers the stages' plans must hold)
    "two-stream-cpu": ([0, 2, 4], ["stream", "ngl:0"], {"stream", "cpu"}),
    "four-mixed": ([0, 1, 2, 3, 4], ["all-gpu", "stream", "ngl:0", "ngl:0"], {"gpu", "stream", "cpu"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stage_processes_compute_what_transformers_computes(llama, case, tmp_path):
    model_dir, node, ids, ref = llama
    cuts, strategies, held = CASES[case]
    plan = pipeline_plan(model_dir, node, cuts, strategies, Workload(1, PROMPT_LEN, GEN_LEN, prefill_chunk=PROMPT_LEN),
                         tmp_path / "plan.json")
    assert len(plan.pipeline["stages"]) == len(cuts) - 1
    assert held <= tiers(plan)
    opts = RunOptions(weights=str(model_dir), prompt_ids=tuple(ids.tolist()), all_logits=True, keep_logits=True,
                      emulate=True)
    result = run_pipeline(plan, opts, timeout_s=60)
    assert result.tokens == ref["tokens"]
    # a stage whose blocks are all on the CPU runs without an emulated GPU
    assert result.modes == ["cpu" if s == "ngl:0" else "emulated" for s in strategies]
    prefill, steps = result.logits[0], torch.stack(result.logits[1:])
    scale = ref["prefill"].abs().max()
    assert (prefill - ref["prefill"]).abs().max() <= TOL * scale
    assert (steps - ref["steps"][1:]).abs().max() <= TOL * ref["steps"].abs().max()
    assert [s["layers"] for s in result.stages] == [[a, b] for a, b in zip(cuts, cuts[1:])]
    assert all(s["busy_decode_s"] > 0 for s in result.stages)
    # each process holds its own blocks only: at most its stage's planned bytes, in each tier
    model_weights = sum(p["weight_bytes"] for st in plan.pipeline["stages"] for p in st["plan"]["placement"])
    for s in result.stages:
        assert s["peak_bytes"]["gpu"] <= s["planned_bytes"]["gpu"]
        assert s["peak_bytes"]["cpu"] <= s["planned_bytes"]["cpu"]
        assert s["peak_bytes"]["gpu"] + s["peak_bytes"]["cpu"] < model_weights


def test_a_pipeline_of_one_stage_runs_in_this_process(llama, tmp_path):
    """A pipeline can use one GPU only (not GPU 0: here GPU 1 is never used, stage 0 runs on GPU 0
    with streamed blocks); it runs without a process group."""
    model_dir, node, ids, ref = llama
    plan = pipeline_plan(model_dir, node, [0, 4], ["stream"], Workload(1, PROMPT_LEN, GEN_LEN, prefill_chunk=PROMPT_LEN),
                         tmp_path / "plan.json")
    opts = RunOptions(weights=str(model_dir), prompt_ids=tuple(ids.tolist()), keep_logits=True, emulate=True)
    result = run_pipeline(plan, opts, timeout_s=60)
    assert result.tokens == ref["tokens"]
    assert (torch.stack(result.logits) - ref["steps"]).abs().max() <= TOL * ref["steps"].abs().max()


def test_hetplan_exec_runs_the_pipeline_and_reports_each_stage(llama, tmp_path):
    model_dir, node, ids, ref = llama
    plan_path = tmp_path / "plan.json"
    pipeline_plan(model_dir, node, [0, 3, 4], ["ngl:1", "stream"], Workload(1, PROMPT_LEN, GEN_LEN, prefill_chunk=PROMPT_LEN),
                  plan_path)
    out = subprocess.run([sys.executable, "-m", "hetplan", "exec", str(plan_path), "--weights", str(model_dir),
                          "--prompt-ids", ",".join(map(str, ids[0].tolist())), "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["tokens"] == ref["tokens"]
    assert [s["layers"] for s in got["stages"]] == [[0, 3], [3, 4]]
    assert got["modes"] == ["emulated", "emulated"] and got["comparable"] is False
