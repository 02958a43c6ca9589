"""A real (very short) ``hetplan profile`` run on this machine: it stays within its budget,
writes a node.yaml that ``load_node`` reads, and a table the cost model then uses."""

import json

import pytest
import torch

from hetplan.cli import main
from hetplan.compiler import CompileRequest, compile_plan
from hetplan.hardware import load_node
from hetplan.profile.table import load_profile
from hetplan.runtime.profiler import kernels as profile_kernels
from hetplan.runtime.profiler import measure

BUDGET_S = 15.0
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, torch_dtype="float32")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("profile")
    (tmp / "tiny").mkdir()
    (tmp / "tiny" / "config.json").write_text(json.dumps(TINY))
    mp = pytest.MonkeyPatch()
    # A tiny grid, so that a 5 s budget reaches the model's stages on a slow machine too.
    mp.setattr(profile_kernels, "TOKEN_GRID", (1, 4))
    mp.setattr(profile_kernels, "DECODE_CONTEXTS", (16, 64))
    mp.setattr(profile_kernels, "PREFILL_PROMPTS", (8,))
    mp.setattr(profile_kernels, "LINEAR_GRID", ((64, 256),))
    mp.setattr(profile_kernels, "LINEAR_TOKENS", (1, 8))
    # 3 repeats a point: the run takes what its points need, and the budget is only the deadline
    # a loaded machine may hit (the grid also times every quantised format)
    mp.setattr(measure, "MAX_REPEATS", measure.MIN_REPEATS)
    try:
        rc = main(["profile", "--budget", f"{BUDGET_S:g}s", "--out", str(tmp / "node.yaml"),
                   "--model", str(tmp / "tiny")])
    finally:
        mp.undo()
    assert rc == 0
    return tmp


def test_profile_writes_a_node_yaml_that_load_node_reads(profiled):
    hw = load_node(str(profiled / "node.yaml"))
    assert (hw.gpu is not None) == torch.cuda.is_available()
    assert hw.cpu.mem_bytes_per_s > 0 and hw.cpu.flops_per_s["fp32"] > 0
    assert hw.latency_s["cpu_task"] > 0
    assert hw.efficiency["cpu_mem"] == 1.0
    assert hw.profile == str(profiled / "node.profile.json")


def test_profile_stays_within_its_budget_and_records_how_it_measured(profiled):
    table = load_profile(profiled / "node.profile.json")
    info = table.info
    assert info["elapsed_s"] <= BUDGET_S
    assert info["threads"] >= 1 and info["budget_s"] == BUDGET_S
    for e in table.entries.values():
        for p in e.points:
            assert p.repeats >= 3 and p.spread_s >= 0 and p.seconds > 0


def test_profile_times_the_models_stages_and_plans_use_them(profiled):
    table = load_profile(profiled / "node.profile.json")
    ops = {op for (device, op, dtype, _) in table.entries if device == "cpu" and dtype == "fp32"}
    assert {"attn_in", "attn_out", "mlp", "embed", "head"} <= ops, sorted(ops)
    plan, _ = compile_plan(CompileRequest(model=str(profiled / "tiny"), hw=str(profiled / "node.yaml"),
                                          prompt_len=4, gen_len=2, weight_dtype="fp32"))
    decode = plan.schedule["decode"].tasks
    assert {t.cost_source for t in decode if t.kind in ("attn_in", "attn_out", "mlp")} == {"profile"}


def test_runtime_task_overhead_is_measured_or_reported_as_skipped(profiled):
    table = load_profile(profiled / "node.profile.json")
    hw = load_node(str(profiled / "node.yaml"))
    overhead = table.info["task_overhead_s"]["cpu"]
    if overhead > 0:
        assert hw.latency_s["cpu_task"] == pytest.approx(overhead, rel=1e-3)
    else:
        assert any(s.startswith("runtime task overhead") for s in table.info["skipped"])


def test_the_written_profile_passes_its_schema(profiled):
    from hetplan.schema.profile import ProfileFile
    ProfileFile.model_validate(json.loads((profiled / "node.profile.json").read_text()))
