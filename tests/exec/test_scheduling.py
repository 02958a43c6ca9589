"""The executor keeps the plan's promises: weights arrive before a streamed block computes,
a staging slot is not overwritten while a block still reads it, activations cross PCIe exactly
as the task semantics say, and the emulated GPU's memory budget is a hard limit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.errors import HetplanError
from hetplan.evaluate import make_plan
from hetplan.hardware import load_node
from hetplan.frontends.resolve import load_model
from hetplan.plan import Decision, PhaseSchedule
from hetplan.problem import build_problem
from hetplan.runtime.dataflow import build_program
from hetplan.runtime.models.dense import DenseBackend
from hetplan.runtime.devices import Ledger, check_free_memory
from hetplan.runtime.session import RunOptions, run_plan
from hetplan.workload import Workload
from tests.tiny_models import TINY_GPU_NODE

NODE = TINY_GPU_NODE
PROMPT_LEN, GEN_LEN = 8, 6


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")
    (root / "node.yaml").write_text(NODE)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
    cfg.save_pretrained(root)
    return str(root), str(root / "node.yaml")


def compiled(env, strategy, gpu_mem=None):
    model, node = env
    return compile_plan(CompileRequest(model=model, hw=node, strategy=strategy, weight_dtype="fp32",
                                       gpu_mem=gpu_mem, prompt_len=PROMPT_LEN, gen_len=GEN_LEN))[0]


def hand_plan(env, weights, exec_, kv, depth):
    model, node = env
    problem = build_problem(load_model(model, "fp32"), load_node(node), Workload(1, PROMPT_LEN, GEN_LEN))
    dec = Decision(weights=weights, exec=exec_, kv=kv, depth=depth)
    return make_plan(problem, dec, {"strategy": "hand", "status": "heuristic", "mip_gap": None, "options": {}})


def cpu_kv_plan(env):
    """Attention resident on the GPU, its KV cache in DRAM; everything else streamed."""
    blocks = ["embed"] + [f"{k}_{l}" for l in range(3) for k in ("attn", "mlp")] + ["head"]
    weights = {b: "gpu" if b.startswith("attn") else ("cpu" if b == "embed" else "stream") for b in blocks}
    return hand_plan(env, weights, {"prefill": dict(weights), "decode": dict(weights)},
                     {f"attn_{l}": "cpu" for l in range(3)}, depth=2)


def measured_steps(plan, result):
    """[(phase, {task id: (start_s, end_s)})] per run of a phase, from the measured trace."""
    out = []
    for pid, phase in ((3, "prefill"), (4, "decode")):
        n = len(plan.schedule[phase].tasks)
        events = [e for e in result.trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]
        assert len(events) % n == 0
        for k in range(0, len(events), n):
            out.append((phase, {e["args"]["id"]: (e["ts"], e["ts"] + e["dur"]) for e in events[k:k + n]}))
    return out


MODES = ["emulated", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a CUDA device"))]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", ["stream", "greedy", "cpu-kv"])
def test_streamed_block_never_starts_before_its_weights_arrived(env, strategy, mode):
    plan = cpu_kv_plan(env) if strategy == "cpu-kv" else compiled(env, strategy, "200KiB")
    result = run_plan(plan, RunOptions(weights="random", gen_len=GEN_LEN, trace=True, emulate=mode == "emulated"))
    checked = 0
    for phase, times in measured_steps(plan, result):
        for t in plan.schedule[phase].tasks:
            if t.kind == "load":
                first = next(s for s in plan.schedule[phase].tasks if s.block == t.block and s.kind not in
                             ("load", "act_up", "act_down", "kv_down"))
                assert times[t.id][1] <= times[first.id][0], (phase, t.id, first.id)
                checked += 1
    assert checked >= GEN_LEN


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("strategy", ["stream", "cpu-kv"])
def test_staging_slot_is_not_overwritten_while_a_block_reads_it(env, strategy, mode):
    plan = cpu_kv_plan(env) if strategy == "cpu-kv" else compiled(env, strategy, "200KiB")
    depth = plan.staging["depth"]
    result = run_plan(plan, RunOptions(weights="random", gen_len=GEN_LEN, trace=True, emulate=mode == "emulated"))
    checked = 0
    for phase, times in measured_steps(plan, result):
        tasks = plan.schedule[phase].tasks
        loads = [t for t in tasks if t.kind == "load"]
        for j, load in enumerate(loads[depth:], start=depth):
            previous = loads[j - depth]
            assert previous.slot == load.slot
            readers = [t for t in tasks if t.block == previous.block and t.slot == previous.slot and t.kind != "load"]
            assert readers
            assert all(times[r.id][1] <= times[load.id][0] for r in readers), (phase, load.id)
            checked += 1
    assert checked > 0


def test_cpu_side_kv_moves_q_k_v_down_and_the_attention_output_up(env):
    plan = cpu_kv_plan(env)
    backend = DenseBackend(plan.model)
    prog = build_program("decode", plan.schedule["decode"], backend.reads, backend.writes)
    moved = {op.task.id: op.writes for op in prog.ops if op.task.kind in ("act_up", "act_down")}
    assert moved["act_down/attn_core/attn_1"] == ("q", "k", "v")
    assert moved["act_up/attn_out/attn_1"] == ("o",)
    prefill = build_program("prefill", plan.schedule["prefill"], backend.reads, backend.writes)
    kv_down = next(op for op in prefill.ops if op.task.id == "kv_down/attn_1")
    core = next(op for op in prefill.ops if op.task.id == "attn_core/attn_1")
    assert kv_down.reads == tuple(r for r in core.reads if r[1] in ("k", "v"))


def test_schedule_missing_an_activation_copy_is_refused(env):
    plan = cpu_kv_plan(env)
    sched = plan.schedule["decode"]
    gone = "act_up/attn_out/attn_1"
    broken = PhaseSchedule(tuple(t for t in sched.tasks if t.id != gone),
                           tuple(e for e in sched.edges if gone not in e))
    backend = DenseBackend(plan.model)
    with pytest.raises(HetplanError, match=r"attn_out/attn_1 on gpu reads 'o', which is only on cpu"):
        build_program("decode", broken, backend.reads, backend.writes)


def test_emulated_gpu_budget_is_enforced_with_the_bytes_named(env):
    plan = compiled(env, "all-gpu")
    weights = sum(p["weight_bytes"] for p in plan.placement)
    tight = dataclasses.replace(plan, memory={**plan.memory, "gpu_budget_bytes": weights / 2})
    with pytest.raises(HetplanError, match=r"emulated GPU memory budget exceeded: .* B\) of .*\(\d+ B\) already"):
        run_plan(tight, RunOptions(weights="random", gen_len=2, emulate=True))


def test_ledger_refuses_one_byte_over_budget():
    ledger = Ledger("gpu", budget_bytes=1000, emulated=True)
    ledger.reserve(600, "a")
    ledger.release(100)
    ledger.reserve(500, "b")
    assert ledger.peak_bytes == 1000
    with pytest.raises(HetplanError, match="c needs 1 B"):
        ledger.reserve(1, "c")


def test_decode_steps_do_not_grow_memory(env):
    plan = compiled(env, "all-gpu")
    short = run_plan(plan, RunOptions(weights="random", gen_len=2, emulate=True))
    long = run_plan(plan, RunOptions(weights="random", gen_len=GEN_LEN, emulate=True))
    assert long.peak_bytes == short.peak_bytes
    assert short.peak_bytes["gpu"] <= plan.memory["gpu_bytes"]


def test_plan_needing_more_memory_than_is_free_is_refused_with_numbers():
    memory = {"gpu_bytes": 3 << 30, "cpu_bytes": 1 << 30}
    with pytest.raises(HetplanError, match=r"3\.00 GiB of GPU memory but only 2\.00 GiB is free"):
        check_free_memory(memory, "cuda", free_gpu_bytes=2 << 30, free_cpu_bytes=8 << 30)
    with pytest.raises(HetplanError, match=r"4\.00 GiB of CPU memory \(CPU tier \+ emulated GPU\) but only 3\.00 GiB"):
        check_free_memory(memory, "emulated", free_gpu_bytes=None, free_cpu_bytes=3 << 30)
    check_free_memory(memory, "cuda", free_gpu_bytes=3 << 30, free_cpu_bytes=1 << 30)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_plan_without_a_gpu_needs_emulation(env):
    with pytest.raises(HetplanError, match="no CUDA device.*--emulate"):
        run_plan(compiled(env, "all-gpu"), RunOptions(weights="random", gen_len=2, emulate=False))


def test_schedule_whose_order_contradicts_its_edges_is_refused(env):
    plan = compiled(env, "stream", "200KiB")
    sched = plan.schedule["decode"]
    first, last = sched.tasks[0].id, next(t.id for t in reversed(sched.tasks) if t.resource == sched.tasks[0].resource)
    broken = PhaseSchedule(sched.tasks, sched.edges + ((last, first),))
    backend = DenseBackend(plan.model)
    with pytest.raises(HetplanError, match="form a cycle"):
        build_program("decode", broken, backend.reads, backend.writes)
