"""The baselines place a model the way the tools they name do, checked against placements worked
out by hand here from the tools' rules on small models:

- llama.cpp ``-ngl N``: layer slot ``il`` (repeating layers 0..L-1, then the output layer L) is on
  the GPU when ``il >= L + 1 - N``; token embeddings stay in DRAM; KV caches live with their
  layer, or all in DRAM with ``-nkvo``; in a prompt of 32+ tokens a DRAM-resident layer is
  computed on the GPU with its weights copied up just before use (op offload), below 32 on
  the CPU; ``--fit`` (no N) takes the most slots that leave 1 GiB of the GPU free.
- llama.cpp ``--cpu-moe`` / ``--n-cpu-moe N``: routed experts of the first N layers in DRAM.
- Accelerate ``device_map="auto"``: modules in order onto the GPU while they fit in the budget
  less the largest module not yet placed; weights only (no KV); offloaded modules copied to
  the GPU synchronously before use.
- FlexGen ``--percent W ...``: a tensor of a layer is in HBM when the mid-point of its cumulative
  size within the layer is at least 1 - W/100; the rest streamed one layer ahead; KV caches in
  DRAM when they do not fit, with decode attention on the CPU and prefill attention on the GPU.

Sizes of the tiny llama (4 layers, hidden 256, 4 heads of 64 with 2 KV heads, MLP 512, vocab
1000, fp16, RMSNorm), in bytes at 2 per parameter:
  attention  q 256x256 + k 256x128 + v 256x128 + o 256x256 + norm 256  = 196 864 params -> 393 728
  MLP        gate/up/down 3 x 256x512 + norm 256                       = 393 472 params -> 786 944
  embedding  1000 x 256                                                = 256 000 params -> 512 000
  head       1000 x 256 + final norm 256                               = 256 256 params -> 512 512
  KV cache   2 (K, V) x 2 heads x 64 x 2 B = 512 B per token and layer.
"""

from __future__ import annotations

import dataclasses

import pytest

from hetplan.evaluate import make_plan, memory_report
from hetplan.plan.compare import compare, compare_dicts
from hetplan.plan.report import compare_table
from hetplan.problem import build_problem
from hetplan.solvers import baselines
from hetplan.workload import Workload
from hetplan.compiler import CompileRequest
from tests.conftest import tiny_spec, tiny_node

GIB = 1 << 30
ATTN, MLP, EMBED, HEAD, KV_PER_TOKEN = 393_728, 786_944, 512_000, 512_512, 512
LAYER = ATTN + MLP


def problem(prompt_len=16, gen_len=16, batch=1, gpu_bytes=4 * GIB, **spec):
    node = dataclasses.replace(tiny_node(4.0), gpus=(dataclasses.replace(tiny_node(4.0).gpus[0],
                                                                          memory_bytes=int(gpu_bytes)),))
    return build_problem(tiny_spec(n_layers=4, **spec), node, Workload(batch=batch, prompt_len=prompt_len,
                                                                       gen_len=gen_len))


def placed(dec, *blocks) -> list:
    return [(dec.weights[b], dec.exec["prefill"][b], dec.exec["decode"][b]) for b in blocks]


def plan_of(p, dec, name="baseline"):
    return make_plan(p, dec, {"strategy": name, "status": "heuristic", "mip_gap": None, "options": {}})


def test_the_tiny_models_sizes_are_the_ones_worked_out_by_hand():
    p = problem()
    sizes = {b.name: b.weight_bytes for b in p.blocks}
    assert sizes == {"embed": EMBED, "head": HEAD, **{f"attn_{l}": ATTN for l in range(4)},
                     **{f"mlp_{l}": MLP for l in range(4)}}
    assert {b.kv_bytes for b in p.blocks if b.kind == "attn"} == {32 * KV_PER_TOKEN}


# -- llama.cpp -ngl -------------------------------------------------------------------------------

def test_ngl_counts_the_output_layer_as_the_last_of_the_gpu_slots():
    p = problem()  # 16-token prompt: no op offload
    one, three = baselines.ngl(p, 1), baselines.ngl(p, 3)
    # -ngl 1: slot 4 (the output layer) only; -ngl 3: slots 2, 3, 4
    assert [b for b, w in one.weights.items() if w == "gpu"] == ["head"]
    assert sorted(b for b, w in three.weights.items() if w == "gpu") == ["attn_2", "attn_3", "head", "mlp_2", "mlp_3"]
    assert three.kv == {"attn_0": "cpu", "attn_1": "cpu", "attn_2": "gpu", "attn_3": "gpu"}
    assert placed(three, "attn_1", "mlp_1") == [("cpu", "cpu", "cpu")] * 2


def test_ngl_keeps_the_token_embeddings_in_dram_even_with_every_layer_on_the_gpu():
    dec = baselines.ngl(problem(prompt_len=64), 5)
    assert placed(dec, "embed") == [("cpu", "cpu", "cpu")]
    assert all(w == "gpu" for b, w in dec.weights.items() if b != "embed")
    assert set(dec.kv.values()) == {"gpu"}


def test_prompts_of_32_tokens_compute_dram_layers_on_the_gpu_with_their_weights_copied():
    for p in (problem(prompt_len=32), problem(prompt_len=16, batch=2)):
        dec = baselines.ngl(p, 1)
        # copied up for prefill (weights stream, prefill stream), computed on the CPU in decode
        assert placed(dec, "attn_0", "mlp_3") == [("stream", "stream", "cpu")] * 2
        assert placed(dec, "embed") == [("cpu", "cpu", "cpu")]  # a lookup is never offloaded
        assert dec.kv["attn_0"] == "cpu" and dec.depth == 1
    below = baselines.ngl(problem(prompt_len=31), 1)
    assert placed(below, "attn_0", "mlp_3") == [("cpu", "cpu", "cpu")] * 2


def test_op_offload_leaves_a_dram_output_layer_on_the_cpu_for_fewer_than_32_sequences():
    # llama.cpp keeps only each sequence's last position before the output layer, so its matmul
    # has one row per sequence: a 512-token prompt of one sequence computes it on the CPU.
    one = baselines.ngl(problem(prompt_len=512), 0)
    assert placed(one, "head") == [("cpu", "cpu", "cpu")]
    assert placed(one, "attn_0") == [("stream", "stream", "cpu")]
    many = baselines.ngl(problem(prompt_len=16, batch=32), 0)
    assert placed(many, "head") == [("stream", "stream", "cpu")]


def test_op_offload_copies_each_layer_right_before_use_never_ahead():
    p = problem(prompt_len=32)
    plan = plan_of(p, baselines.ngl(p, 1))
    tasks = plan.schedule["prefill"].tasks
    loads = [t for t in tasks if t.resource == "h2d"]
    compute = [t for t in tasks if t.resource in ("gpu", "cpu")]
    assert {t.block for t in loads} == {f"{k}_{l}" for k in ("attn", "mlp") for l in range(4)}
    for load in loads:  # no copy overlaps any compute
        assert all(c.end_s <= load.start_s * (1 + 1e-12) or c.start_s >= load.end_s * (1 - 1e-12) for c in compute)
    assert not [t for t in plan.schedule["decode"].tasks if t.resource == "h2d"]
    # one staging slot of the largest copied block (the MLP) on the GPU
    assert plan.memory["breakdown"]["gpu"]["staging"] == MLP


def test_fit_takes_the_most_slots_that_leave_one_gib_free():
    ws = problem().gpu_workspace_bytes
    per_layer = LAYER + 32 * KV_PER_TOKEN  # weights and the layer's KV cache (16 + 16 tokens)
    # room for the output layer and two repeating layers, half a layer short of a third
    budget = GIB + ws + HEAD + 2 * per_layer + per_layer // 2
    dec = baselines.ngl(problem(gpu_bytes=budget))
    assert sorted(b for b, w in dec.weights.items() if w == "gpu") == ["attn_2", "attn_3", "head", "mlp_2", "mlp_3"]
    # everything fits without the margin but not with it: --fit still drops layers
    everything = ws + HEAD + 4 * per_layer
    dec = baselines.ngl(problem(gpu_bytes=everything + GIB // 2))
    assert [w for b, w in dec.weights.items() if b != "embed"].count("gpu") < 9
    # with the margin there, it is every slot
    dec = baselines.ngl(problem(gpu_bytes=everything + GIB))
    assert all(w == "gpu" for b, w in dec.weights.items() if b != "embed")


def test_nkvo_keeps_every_kv_cache_and_decode_attention_on_the_cpu():
    p = problem(prompt_len=64)
    dec = baselines.ngl_nkvo(p, 5)
    assert set(dec.kv.values()) == {"cpu"}
    assert all(w == "gpu" for b, w in dec.weights.items() if b != "embed")
    decode = {t.id: t.resource for t in plan_of(p, dec).schedule["decode"].tasks}
    assert {decode[f"attn_core/attn_{l}"] for l in range(4)} == {"cpu"}
    assert {decode[f"attn_in/attn_{l}"] for l in range(4)} == {"gpu"}
    # --fit without the KV on the GPU: 2 x 32 x 512 B more room per layer, checked by memory
    assert memory_report(p, dec)[0]["breakdown"]["gpu"]["kv"] == 0


# -- llama.cpp --cpu-moe / --n-cpu-moe ----------------------------------------------------------

MOE = dict(arch="mixtral", n_experts=4, experts_per_token=2, moe_intermediate=256)


def test_cpu_moe_keeps_the_experts_and_embeddings_in_dram_and_copies_experts_up_for_long_prompts():
    p = problem(prompt_len=32, **MOE)
    dec = baselines.cpu_moe(p)
    assert dec.experts == {f"moe_{l}": 0 for l in range(4)}
    assert placed(dec, "moe_0", "moe_3") == [("gpu", "stream", "gpu")] * 2
    assert placed(dec, "embed") == [("cpu", "cpu", "cpu")]
    assert placed(dec, "attn_0", "head") == [("gpu", "gpu", "gpu")] * 2
    short = baselines.cpu_moe(problem(prompt_len=16, **MOE))
    assert placed(short, "moe_0") == [("gpu", "gpu", "gpu")]  # the CPU computes the experts


def test_n_cpu_moe_puts_the_experts_of_the_first_n_layers_in_dram():
    dec = baselines.n_cpu_moe(problem(prompt_len=32, **MOE), 1)
    assert dec.experts == {"moe_0": 0, "moe_1": 4, "moe_2": 4, "moe_3": 4}
    assert placed(dec, "moe_0", "moe_1") == [("gpu", "stream", "gpu"), ("gpu", "gpu", "gpu")]


def test_ktransformers_computes_the_experts_on_the_cpu_in_prefill_too():
    # cpu-moe's placement; a 512-token prompt would make llama.cpp copy the experts up, not kTransformers
    dec = baselines.ktransformers(problem(prompt_len=512, **MOE))
    assert dec.experts == {f"moe_{l}": 0 for l in range(4)}
    assert placed(dec, "moe_0", "moe_3") == [("gpu", "gpu", "gpu")] * 2   # the block on the GPU, its 0 hot experts too
    assert placed(dec, "embed") == [("cpu", "cpu", "cpu")]
    assert placed(dec, "attn_0", "head") == [("gpu", "gpu", "gpu")] * 2
    assert set(dec.kv.values()) == {"gpu"}
    assert baselines.FOLLOWS["ktransformers"].startswith("kTransformers 0.2")


def test_ktransformers_prefill_computes_the_experts_on_the_cpu_and_copies_no_weights():
    from hetplan.schedule import build_schedule
    p = problem(prompt_len=512, **MOE)
    kinds = {name: {(t.resource, t.kind) for t in build_schedule(p, baselines.MOE_BASELINES[name](p))["prefill"].tasks}
             for name in ("cpu-moe", "ktransformers")}
    assert ("h2d", "load") in kinds["cpu-moe"] and ("cpu", "moe_cold") not in kinds["cpu-moe"]
    assert ("h2d", "load") not in kinds["ktransformers"] and ("cpu", "moe_cold") in kinds["ktransformers"]


# -- Accelerate device_map="auto" ---------------------------------------------------------------

def test_accelerate_reserves_room_for_the_largest_layer_and_offloads_the_rest():
    # embedding, then decoder layers (attention + MLP: the largest module) while
    # used + size <= budget - LAYER: two layers fit, a third would without the reserve
    dec = baselines.greedy(problem(gpu_bytes=EMBED + 3 * LAYER + 1000))
    gpu = sorted(b for b, w in dec.weights.items() if w == "gpu")
    assert gpu == ["attn_0", "attn_1", "embed", "mlp_0", "mlp_1"]
    assert placed(dec, "attn_2", "mlp_3", "head") == [("stream", "stream", "stream")] * 3
    assert dec.depth == 1 and set(dec.kv.values()) == {"gpu"}


def test_accelerate_shrinks_the_reserve_once_the_largest_modules_are_placed():
    # the last layer only needs room for the head (the largest module left) beside it
    full = EMBED + 4 * LAYER + HEAD
    dec = baselines.greedy(problem(gpu_bytes=full))
    assert all(w == "gpu" for w in dec.weights.values())
    dec = baselines.greedy(problem(gpu_bytes=full - 1))
    assert placed(dec, "attn_3", "mlp_3", "head") == [("stream", "stream", "stream")] * 3
    assert dec.weights["mlp_2"] == "gpu"


def test_accelerate_counts_no_kv_cache():
    budget = EMBED + 3 * LAYER + 1000
    short, long = problem(gpu_bytes=budget), problem(gpu_bytes=budget, gen_len=4000)
    assert baselines.greedy(short).weights == baselines.greedy(long).weights
    # 4016 tokens x 512 B x 4 layers of KV on the GPU beside the weights: the plan says it does not fit
    assert memory_report(long, baselines.greedy(long))[0]["gpu_bytes"] > budget


# -- FlexGen ------------------------------------------------------------------------------------

def test_flexgen_mid_point_rule_on_opt_and_llama_layers():
    # OPT attention: 4 equal matrices, mid-points 12.5, 37.5, 62.5, 87.5 %; MLP fc1, fc2 at 25, 75 %
    opt_attn, opt_mlp = [(64, 64)] * 4, [(256, 64), (64, 256)]
    assert baselines.flexgen_gpu_fraction(opt_attn, 4) == 0.0      # the paper's 30B policy: no matrix
    assert baselines.flexgen_gpu_fraction(opt_attn, 13) == 0.25     # w_out (87.5 >= 87)
    assert baselines.flexgen_gpu_fraction(opt_attn, 50) == 0.5
    assert baselines.flexgen_gpu_fraction(opt_mlp, 24) == 0.0
    assert baselines.flexgen_gpu_fraction(opt_mlp, 25) == 0.5
    # tiny llama attention q 65536, k 32768, v 32768, o 65536 params: mid-points 1/6, 5/12, 7/12, 5/6
    # of 196608; at W = 50 v and o are in HBM: 98304 / 196608. MLP three equal: 1/6, 1/2, 5/6 -> 2/3
    spec = tiny_spec(n_layers=4)
    assert baselines.flexgen_gpu_fraction(spec.linear_shapes("attn"), 50) == 0.5
    assert baselines.flexgen_gpu_fraction(spec.linear_shapes("mlp"), 50) == pytest.approx(2 / 3)


def test_flexgen_keeps_the_rules_bytes_resident_as_whole_blocks_spread_in_order():
    p = problem(prompt_len=32)
    # W = 50: targets accumulate 0.5 ATTN + 2/3 MLP per layer and 1.0 HEAD; a block is resident
    # when (resident + its half) <= target: attn_0 (196 864 <= 196 864), not mlp_0 (787 200 >
    # 721 493), attn_1, mlp_1, not attn_2, mlp_2, not attn_3, mlp_3, not the head (3 404 544 > 3 398 485)
    dec = baselines.flexgen(p, 50)
    assert sorted(b for b, w in dec.weights.items() if w == "gpu") == ["attn_0", "attn_1", "mlp_1", "mlp_2",
                                                                       "mlp_3"]
    assert placed(dec, "attn_2", "mlp_0", "head") == [("stream", "stream", "stream")] * 3
    assert placed(dec, "embed") == [("cpu", "cpu", "cpu")]          # the gather stays in DRAM
    assert dec.depth == 2                                           # layer j + 1 loads while j computes
    assert {w for b, w in baselines.flexgen(p, 4).weights.items() if b != "embed"} == {"stream"}
    assert set(baselines.flexgen(p, 100).weights.values()) == {"gpu", "cpu"}


def test_flexgen_kv_in_dram_computes_decode_attention_on_the_cpu_and_prefill_on_the_gpu():
    from hetplan.schedule import build_schedule
    kv = 4 * (32 + 4000) * KV_PER_TOKEN                              # 4 layers of 4032 tokens
    ws = problem(prompt_len=32, gen_len=4000).gpu_workspace_bytes
    fits = problem(prompt_len=32, gen_len=4000, gpu_bytes=ws + 2 * MLP + kv)
    assert set(baselines.flexgen(fits, 0).kv.values()) == {"gpu"}
    p = problem(prompt_len=32, gen_len=4000, gpu_bytes=ws + 2 * MLP + kv - 1)
    dec = baselines.flexgen(p, 0)
    assert set(dec.kv.values()) == {"cpu"}
    sched = build_schedule(p, dec)
    where = {ph: {t.resource for t in sched[ph].tasks if t.kind == "attn_core"} for ph in ("prefill", "decode")}
    assert where == {"prefill": {"gpu"}, "decode": {"cpu"}}
    assert {t.resource for t in sched["decode"].tasks if t.kind in ("attn_in", "attn_out", "mlp")} == {"gpu"}
    assert any(t.kind == "kv_down" for t in sched["prefill"].tasks)   # store_cache after prefill


def test_flexgen_without_a_percent_takes_the_largest_that_fits():
    ws = problem(prompt_len=32).gpu_workspace_bytes
    weights, kv = 4 * LAYER + HEAD, 4 * 48 * KV_PER_TOKEN          # W = 100: no staging slot
    full = baselines.flexgen(problem(prompt_len=32, gpu_bytes=ws + kv + weights))
    assert set(full.weights.values()) == {"gpu", "cpu"} and set(full.kv.values()) == {"gpu"}
    # one byte short: the weights stay, the caches go to DRAM (they are what no longer fits)
    evict = baselines.flexgen(problem(prompt_len=32, gpu_bytes=ws + kv + weights - 1))
    assert set(evict.weights.values()) == {"gpu", "cpu"} and set(evict.kv.values()) == {"cpu"}
    # short of the weights alone: some blocks stream, at the step (of 5) whose next step up does not fit
    budget = ws + weights - 1
    short = problem(prompt_len=32, gpu_bytes=budget)
    dec = baselines.flexgen(short)
    w = max(w for w in range(0, 101, 5) if baselines.flexgen(short, w).weights == dec.weights)
    assert "stream" in dec.weights.values() and memory_report(short, dec)[0]["gpu_bytes"] <= budget
    assert memory_report(short, baselines.flexgen(short, w + 5))[0]["gpu_bytes"] > budget


# -- the compare table --------------------------------------------------------------------------

def test_compare_says_which_tool_version_each_baseline_follows():
    p = problem(prompt_len=32)
    plan = plan_of(p, baselines.all_gpu(p), "hand")
    req = CompileRequest(model="tiny", hw="tiny-node", prompt_len=32, gen_len=16)
    rows = {r["strategy"].split(":")[0]: r for r in compare_dicts(compare(plan, req))}
    assert rows["hand"]["follows"] == "-"
    for name in ("ngl", "ngl-nkvo"):
        assert rows[name]["follows"].startswith("llama.cpp") and "fit.cpp" in rows[name]["follows"]
    assert rows["greedy"]["follows"].startswith("Accelerate")
    assert rows["flexgen"]["follows"].startswith("FlexLLMGen") and "flex_opt.py" in rows["flexgen"]["follows"]
    assert all(r["follows"] not in ("", None) for r in rows.values())
    assert "llama.cpp" in compare_table(list(rows.values()), "latency")


@pytest.mark.parametrize("strategy", ["ngl-nkvo", "ngl-nkvo:2"])
def test_nkvo_is_a_strategy_of_its_own(strategy, tmp_path):
    from hetplan.compiler import compile_plan
    plan, _ = compile_plan(CompileRequest(model="llama-3.2-1b", hw="laptop-8g", strategy=strategy,
                                          prompt_len=64, gen_len=8))
    assert plan.solver["strategy"] == strategy
    assert {b["kv"] for b in plan.placement if b["kind"] == "attn"} == {"cpu"}


def test_accelerate_places_a_tied_head_with_the_embedding():
    # tied parameters go together: the head (512 512 B) rides with the embedding, first in order
    dec = baselines.greedy(problem(gpu_bytes=EMBED + HEAD + 3 * LAYER + 1000, tie_embeddings=True))
    assert sorted(b for b, w in dec.weights.items() if w == "gpu") == ["attn_0", "attn_1", "embed", "head",
                                                                       "mlp_0", "mlp_1"]
    assert placed(dec, "attn_2", "mlp_3") == [("stream", "stream", "stream")] * 2


@pytest.mark.parametrize("gpu_mib", [1.2, 4.0, 64.0])
def test_baselines_are_replayed_only_where_the_milp_has_not_proven_its_plan(gpu_mib, monkeypatch):
    """Where the MILP plan's replay equals the MILP's bound (which bounds the replay of every plan
    that fits, a baseline's too), no baseline can beat it and none is replayed; the decision is
    the one replaying them all gives. A problem holding HBM back always replays them: a baseline
    fitting the whole budget may use that HBM, where the MILP's bound says nothing."""
    from hetplan import compiler

    problem = build_problem(tiny_spec(n_layers=4), tiny_node(gpu_mib / 1024),
                            Workload(batch=1, prompt_len=64, gen_len=16, objective="latency", prefill_chunk=64))
    req = CompileRequest(model="tiny", hw="tiny")
    replayed = []
    real = baselines.best_fitting
    monkeypatch.setattr(baselines, "best_fitting", lambda p: replayed.append(p) or real(p))
    dec, info, _ = compiler.decide(problem, "ilp", None, req)
    lazy = len(replayed)
    monkeypatch.setattr(compiler, "PROVEN", -1.0)   # nothing proven: every baseline replayed
    assert compiler.decide(problem, "ilp", None, req)[:2] == (dec, info)
    assert len(replayed) == lazy + 1
    if gpu_mib == 64.0:   # everything resident: the MILP's plan replays to its bound
        assert lazy == 0
    monkeypatch.setattr(compiler, "PROVEN", 1e-9)
    compiler.decide(problem.held_back(1 << 10), "ilp", None, req)
    assert len(replayed) == lazy + 2
