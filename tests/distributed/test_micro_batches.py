"""Micro-batches through the stage processes: M groups of the plan's batch, interleaved, each
with its own KV caches in every stage and one copy of the weights, compute what transformers
computes on each group alone (greedy tokens, and logits within 1e-4 of their scale, fp32), with
two and four processes; a throughput plan runs one micro-batch per stage unless told otherwise;
the rate M micro-batches should reach follows from the plan's stage times; what does not fit
(prompts, KV caches) is refused in one line."""

from __future__ import annotations

import subprocess
import sys

from types import SimpleNamespace

import pytest
import torch
import transformers

from hetplan.errors import HetplanError
from hetplan.runtime.distributed.launch import run_pipeline
from hetplan.runtime.distributed.node import check_micro_batches
from hetplan.runtime.distributed.worker import _for_micro_batches, expected_rate
from hetplan.runtime.session import RunOptions
from hetplan.workload import Workload
from tests.distributed.pipelines import pipeline_plan
from tests.distributed.pipelines import reference as transformers_run

PROMPT_LEN, GEN_LEN, TOL = 8, 10, 1e-4
KV_BYTES_PER_LAYER_TOKEN = 2 * 2 * 16 * 4
"""k and v, 2 KV heads of head_dim 64 / 4 = 16, fp32: one sequence's cache per layer and token."""


def reference(model, ids: torch.Tensor) -> dict:
    """transformers on one group alone (``pipelines.reference``)."""
    return transformers_run(model, ids, GEN_LEN)


CASES = {
    # name: (layer cuts, strategy per stage, batch, micro-batches (None: the plan's default), objective)
    "two-stages-2-micro-default-of-a-throughput-plan": ([0, 2, 4], ["stream", "ngl:0"], 1, None, "max"),
    "two-stages-3-micro-of-2": ([0, 2, 4], ["all-gpu", "ngl:0"], 2, 3, "sum"),
    "four-stages-2-micro": ([0, 1, 2, 3, 4], ["all-gpu", "stream", "ngl:0", "ngl:0"], 1, 2, "sum"),
    "four-stages-3-micro": ([0, 1, 2, 3, 4], ["ngl:0", "all-gpu", "stream", "all-gpu"], 1, 3, "sum"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_micro_batch_computes_what_transformers_computes_on_it_alone(llama_files, case, tmp_path):
    model_dir, node, model = llama_files
    cuts, strategies, batch, micro, objective = CASES[case]
    wl = Workload(batch, PROMPT_LEN, GEN_LEN, prefill_chunk=PROMPT_LEN)
    plan = pipeline_plan(model_dir, node, cuts, strategies, wl, tmp_path / "plan.json", objective)
    m = micro or len(cuts) - 1                    # a throughput plan: one micro-batch per stage
    ids = torch.randint(0, 128, (m * batch, PROMPT_LEN), generator=torch.Generator().manual_seed(11))
    opts = RunOptions(weights=str(model_dir), prompt_ids=tuple(map(tuple, ids.tolist())), all_logits=True,
                      keep_logits=True, emulate=True)
    result = run_pipeline(plan, opts, timeout_s=60, micro_batches=micro)
    assert result.micro_batches == m
    assert len(result.tokens) == m * batch and len(result.logits) == GEN_LEN
    for i in range(m):
        rows = slice(i * batch, (i + 1) * batch)
        ref = reference(model, ids[rows])
        assert result.tokens[rows] == ref["tokens"], f"micro-batch {i}"
        prefill, steps = result.logits[0][rows], torch.stack([lg[rows] for lg in result.logits[1:]])
        assert (prefill - ref["prefill"]).abs().max() <= TOL * ref["prefill"].abs().max()
        assert (steps - ref["steps"][1:]).abs().max() <= TOL * ref["steps"].abs().max()
    # one copy of the weights, a KV cache per micro-batch: a stage's plan holds the caches of the
    # micro-batches the plan keeps in flight (a throughput plan: one per stage; else one); its
    # planned bytes are its plan's and a cache more per further micro-batch, and its peak stays
    # within them in each tier
    context = PROMPT_LEN + GEN_LEN
    planned = len(cuts) - 1 if objective == "max" else 1
    assert plan.pipeline["micro_batches"] == planned
    for s, st in zip(result.stages, plan.pipeline["stages"]):
        a, b = s["layers"]
        one = (b - a) * KV_BYTES_PER_LAYER_TOKEN * context * batch
        own = st["plan"]["memory"]
        assert own["breakdown"]["gpu"]["kv"] + own["breakdown"]["cpu"]["kv"] == planned * one
        extra = max(0, m - planned) * one
        assert s["planned_bytes"]["gpu"] + s["planned_bytes"]["cpu"] == own["gpu_bytes"] + own["cpu_bytes"] + extra
        assert s["peak_bytes"]["gpu"] <= s["planned_bytes"]["gpu"]
        assert s["peak_bytes"]["cpu"] <= s["planned_bytes"]["cpu"]
        assert s["busy_s"]["decode"] > 0 and s["idle_s"]["decode"] >= 0
    assert result.measured["decode_tokens_per_s"] == pytest.approx(m * batch / result.measured["tpot_s"])


def test_a_latency_plan_runs_one_micro_batch_unless_told(llama_files, tmp_path):
    model_dir, node, model = llama_files
    plan = pipeline_plan(model_dir, node, [0, 2, 4], ["all-gpu", "all-gpu"], Workload(1, PROMPT_LEN, 3),
                         tmp_path / "plan.json")
    ids = torch.randint(0, 128, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(5))
    result = run_pipeline(plan, RunOptions(weights=str(model_dir), prompt_ids=(tuple(ids[0].tolist()),), emulate=True),
                          timeout_s=60)
    assert result.micro_batches == 1 and len(result.tokens) == 1


def test_the_rate_of_m_micro_batches_is_bounded_by_the_ring_and_by_the_slowest_stage():
    """Stages and links adding up to 0.4 s a step, the slowest 0.1 s (batch 2: 20 tok/s
    pipelined): one micro-batch 2 / 0.4; three 6 / max(0.4, 0.3); eight 16 / max(0.4, 0.8)."""
    pred = {"tpot_s": 0.4, "pipelined_decode_tokens_per_s": 20.0}
    assert expected_rate(pred, 2, 1) == pytest.approx(5.0)
    assert expected_rate(pred, 2, 3) == pytest.approx(15.0)
    assert expected_rate(pred, 2, 8) == pytest.approx(20.0)


def test_prompts_must_be_one_or_one_per_sequence_of_every_micro_batch():
    wl = Workload(2, 3, 4)
    assert _for_micro_batches(RunOptions(prompt_ids=((1, 2, 3),)), wl, 3).batch == 6
    assert _for_micro_batches(RunOptions(prompt_ids=((1, 2, 3),) * 6), wl, 3).batch == 6
    with pytest.raises(HetplanError, match=r"--prompt-ids: 2 sequences, but 3 micro-batches of the plan's batch 2 "
                                           r"take 6; give one sequence \(repeated\) or 6"):
        _for_micro_batches(RunOptions(prompt_ids=((1, 2, 3),) * 2), wl, 3)


def test_micro_batches_whose_kv_caches_overflow_the_gpu_budget_are_refused_naming_how_many_fit():
    """A stage of 60 MiB whose plan holds 2 micro-batches' KV caches of 10 MiB each, on a 100 MiB
    budget: 6 micro-batches need 4 more caches, 100 MiB; 7 need 110 MiB; at most 6 fit."""
    MiB = 2**20
    stage = SimpleNamespace(placement=[{"block": "attn_0", "kv": "gpu", "kv_bytes": 12 * MiB},
                                       {"block": "attn_1", "kv": "gpu", "kv_bytes": 8 * MiB},
                                       {"block": "mlp_0", "kv": None, "kv_bytes": 0}],
                            memory={"gpu_bytes": 60 * MiB, "gpu_budget_bytes": 100 * MiB})
    check_micro_batches(stage, "stage 1", "emulated", 6, planned=2)
    with pytest.raises(HetplanError, match=r"^stage 1: --micro-batches 7: the plan sized the stage's KV caches for 2 "
                                           r"micro-batch\(es\); .* takes 110.00 MiB .* budget of 100.00 MiB; "
                                           r"run at most 6 "):
        check_micro_batches(stage, "stage 1", "emulated", 7, planned=2)
    check_micro_batches(stage, "stage 1", "cpu", 7, planned=2)   # no GPU: the host check counts DRAM


def test_more_micro_batches_than_a_stage_holds_are_refused_before_any_weight_is_read(llama_files, tmp_path):
    """A throughput plan of two all-GPU stages (64 MiB GPUs) for 1000 decoded tokens: each stage's
    two layers' cache of one micro-batch is 2 x 256 bytes x 1008 tokens; 300 micro-batches
    overflow the budget. The weights given lack layer 3, which stage 1 would read: the refusal
    comes first, one line, before any process starts."""
    model_dir, node, _ = llama_files
    wl = Workload(1, PROMPT_LEN, 1000, prefill_chunk=PROMPT_LEN)
    plan = pipeline_plan(model_dir, node, [0, 2, 4], ["all-gpu", "all-gpu"], wl, tmp_path / "plan.json", "max")
    own = plan.pipeline["stages"][0]["plan"]["memory"]
    one = 2 * KV_BYTES_PER_LAYER_TOKEN * (PROMPT_LEN + 1000)
    assert own["breakdown"]["gpu"]["kv"] == 2 * one     # both micro-batches' caches, in HBM
    fit = 2 + int((own["gpu_budget_bytes"] - own["gpu_bytes"]) // one)
    assert fit < 300
    short = tmp_path / "three-layers"
    config = transformers.AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = 3
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(short, safe_serialization=True)
    out = subprocess.run([sys.executable, "-m", "hetplan", "exec", str(tmp_path / "plan.json"), "--weights", str(short),
                          "--emulate", "--micro-batches", "300"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    (line,) = [l for l in out.stderr.splitlines() if l.startswith("hetplan: error:")]
    assert line.startswith("hetplan: error: stage 0: --micro-batches 300: the plan sized the stage's KV caches for 2 ")
    assert f"run at most {fit} micro-batch(es)" in line
    assert "Traceback" not in out.stderr


def test_hetplan_exec_micro_batches_reports_busy_and_idle_time_per_stage(llama_files, tmp_path):
    model_dir, node, model = llama_files
    plan_path = tmp_path / "plan.json"
    wl = Workload(1, PROMPT_LEN, GEN_LEN, prefill_chunk=PROMPT_LEN)
    pipeline_plan(model_dir, node, [0, 3, 4], ["ngl:1", "stream"], wl, plan_path)
    ids = torch.randint(0, 128, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(9))
    out = subprocess.run([sys.executable, "-m", "hetplan", "exec", str(plan_path), "--weights", str(model_dir),
                          "--prompt-ids", ";".join(",".join(map(str, r)) for r in ids.tolist()),
                          "--micro-batches", "2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "2 micro-batch(es) of 1 sequence(s)" in lines[0]
    for i in range(2):
        want = reference(model, ids[i:i + 1])["tokens"][0]
        assert f"sequence {i}: {' '.join(map(str, want))}" in lines
    assert any(l.startswith("  pipelined (every stage busy)") for l in lines)
    header = next(l for l in lines if l.startswith("stage"))
    assert header.split()[-5:] == ["busy", "idle", "peak", "GPU", "mem"]
    assert sum(l.startswith(("0 ", "1 ")) for l in lines) == 2
    assert "times not comparable with the plan" in lines[-1]


def test_micro_batches_on_a_plan_without_a_pipeline_are_refused(tmp_path):
    from hetplan.compiler import CompileRequest, compile_plan
    plan, _ = compile_plan(CompileRequest(model="llama-3.2-1b", hw="rtx4090-64g", prompt_len=16, gen_len=4))
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    out = subprocess.run([sys.executable, "-m", "hetplan", "exec", str(path), "--weights", "random",
                          "--micro-batches", "2"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("hetplan: error: --micro-batches: only for a plan with a "
                                                          "pipeline")
