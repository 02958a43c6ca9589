"""The measured profile table: log-space interpolation, nearest-shape fallback, and the cost
model preferring it (with the source of every cost recorded in the plan)."""

import json
import math

import pytest

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.cost import Work, linear_work
from hetplan.errors import HetplanError
from hetplan.evaluate import make_plan
from hetplan.graph import block_graph
from hetplan.hardware import load_node
from hetplan.model import ModelSpec
from hetplan.plan import load_plan, write_atomic
from hetplan.problem import price
from hetplan.profile.table import ProfileTable, shape_key
from hetplan.solvers import baselines
from hetplan.workload import Workload

MS = 1e-3


def tiny(**kw) -> ModelSpec:
    base = dict(name="tiny", arch="llama", n_layers=2, hidden=64, intermediate=128, n_heads=4, n_kv_heads=2,
                head_dim=16, vocab=256, max_positions=512, weight_dtype="fp32", kv_dtype="fp32")
    return ModelSpec(**{**base, **kw})


def table(*entries) -> ProfileTable:
    return ProfileTable.from_dict({"schema_version": 1, "entries": list(entries)})


def entry(op, shape, points, device="cpu", dtype="fp32"):
    return {"device": device, "op": op, "dtype": dtype, "shape": shape,
            "points": [dict(zip(("x", "seconds", "flops", "bytes"), p)) for p in points]}


def mlp_work(spec, tokens):
    return linear_work(tokens, spec.dense_mlp_params(), spec, "mlp")


def test_interpolates_log_time_over_log_rows_between_measured_points():
    spec = tiny()
    t = table(entry("mlp", shape_key("mlp", spec), [(1, 1 * MS), (4, 2 * MS), (16, 8 * MS)]))
    # x = 2 sits halfway between 1 and 4 in log space: t = exp((ln 1ms + ln 2ms) / 2) = sqrt(2) ms.
    assert t.seconds("cpu", mlp_work(spec, 2), spec) == pytest.approx(math.sqrt(2) * MS, rel=1e-12)
    # x = 8 is halfway between 4 and 16: sqrt(2 ms * 8 ms) = 4 ms.
    assert t.seconds("cpu", mlp_work(spec, 8), spec) == pytest.approx(4 * MS, rel=1e-12)
    assert t.seconds("cpu", mlp_work(spec, 4), spec) == pytest.approx(2 * MS, rel=1e-12)


def test_outside_the_measured_range_time_is_floored_below_and_proportional_above():
    spec = tiny()
    t = table(entry("mlp", shape_key("mlp", spec), [(2, 1 * MS), (4, 3 * MS)]))
    assert t.seconds("cpu", mlp_work(spec, 1), spec) == pytest.approx(1 * MS)
    assert t.seconds("cpu", mlp_work(spec, 40), spec) == pytest.approx(3 * MS * 40 / 4)


def test_decode_attention_is_interpolated_in_cached_tokens_read():
    spec = tiny()
    from hetplan.cost import attention_decode_work
    t = table(entry("attention_decode", shape_key("attention_decode", spec), [(100, 1 * MS), (10000, 100 * MS)]))
    # batch 2 x context 500 = 1000 cached tokens: halfway in log space between 100 and 10000.
    w = attention_decode_work(2, 500, spec)
    assert t.seconds("cpu", w, spec) == pytest.approx(10 * MS, rel=1e-12)


def test_prefill_attention_is_interpolated_in_causal_pairs():
    spec = tiny()
    from hetplan.cost import attention_prefill_work
    # batch 1, prompt 3: 3 * 4 / 2 = 6 pairs; batch 2 -> 12 pairs.
    t = table(entry("attention_prefill", shape_key("attention_prefill", spec), [(6, 1 * MS), (24, 4 * MS)]))
    assert t.seconds("cpu", attention_prefill_work(1, 3, spec), spec) == pytest.approx(1 * MS, rel=1e-12)
    assert t.seconds("cpu", attention_prefill_work(2, 3, spec), spec) == pytest.approx(2 * MS, rel=1e-12)


def test_unmeasured_shape_borrows_the_nearest_measured_one_scaled_by_its_binding_resource():
    spec = tiny()
    q = mlp_work(spec, 4)
    far = (4, 9 * MS, 1e3, 1e3)
    # A GEMM whose bytes at x=4 are half the query's and whose FLOPs are a quarter of them: the
    # bytes ratio is 2, the FLOPs ratio 4; the time scales by the larger, 4.
    near = (4, 1 * MS, q.flops / 4, q.bytes / 2)
    t = table(entry("linear", "10x10", [far]), entry("linear", "64x384", [near]))
    assert t.seconds("cpu", q, spec) == pytest.approx(4 * MS, rel=1e-12)


def test_own_op_is_preferred_to_plain_gemms_when_the_shape_differs():
    spec = tiny()
    q = mlp_work(spec, 1)
    t = table(entry("linear", "64x384", [(1, 5 * MS, q.flops, q.bytes)]),
              entry("mlp", "d32_f64_silu_gated", [(1, 1 * MS, q.flops / 2, q.bytes / 2)]))
    assert t.seconds("cpu", q, spec) == pytest.approx(2 * MS, rel=1e-12)


def test_nothing_relevant_measured_means_no_answer():
    spec = tiny()
    t = table(entry("mlp", shape_key("mlp", spec), [(1, 1 * MS)]))
    assert t.seconds("gpu", mlp_work(spec, 1), spec) is None
    bf16 = tiny(weight_dtype="bf16")
    assert t.seconds("cpu", mlp_work(bf16, 1), bf16) is None
    quant = tiny(weight_dtype="q4_0")
    assert t.seconds("gpu", mlp_work(quant, 1), quant) is None   # the GPU was never measured
    with pytest.raises(HetplanError, match="no measurement of q4_0 weights on the cpu"):
        t.seconds("cpu", mlp_work(quant, 1), quant)              # the CPU was, but not q4_0's kernels
    assert t.seconds("cpu", Work(flops=1.0, bytes=1.0, op="embed", tokens=1), spec) is None


def test_cost_model_uses_the_table_and_tasks_say_where_each_cost_came_from():
    spec = tiny()
    wl = Workload(batch=1, prompt_len=4, gen_len=2)
    hw = load_node("cpu-64g")
    t = table(entry("mlp", shape_key("mlp", spec), [(1, 1 * MS), (4, 3 * MS)]))
    problem = price(block_graph(spec, wl), hw, t)
    plan = make_plan(problem, baselines.all_cpu(problem), {"strategy": "test", "status": "heuristic"})
    for phase, rows in (("prefill", 4), ("decode", 1)):
        tasks = plan.schedule[phase].tasks
        mlp = [x for x in tasks if x.kind == "mlp"]
        assert len(mlp) == spec.n_layers
        assert all(x.cost_source == "profile" and x.duration_s == pytest.approx(3 * MS if rows == 4 else 1 * MS)
                   for x in mlp)
        assert all(x.cost_source == "analytic" for x in tasks if x.kind != "mlp")


def test_node_yaml_profile_key_is_read_relative_to_the_node_file_and_survives_the_plan(tmp_path):
    spec = tiny()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, torch_dtype="float32")))
    (tmp_path / "hw").mkdir()
    (tmp_path / "hw" / "t.profile.json").write_text(json.dumps(
        {"schema_version": 1, "entries": [entry("mlp", shape_key("mlp", spec), [(1, 7 * MS)])]}))
    (tmp_path / "hw" / "node.yaml").write_text(
        "name: box\ncpu: {name: c, cores: 2, memory: 16GiB, mem_bandwidth: 10GB/s, flops: {fp32: 100GFLOPS}}\n"
        "profile: t.profile.json\n")
    plan, _ = compile_plan(CompileRequest(model=str(tmp_path / "model"), hw=str(tmp_path / "hw" / "node.yaml"),
                                          prompt_len=1, gen_len=1, weight_dtype="fp32", strategy="greedy"))
    write_atomic(tmp_path / "plan.json", plan.to_json())
    again = load_plan(tmp_path / "plan.json")
    decode = again.schedule["decode"].tasks
    assert {x.cost_source for x in decode if x.kind == "mlp"} == {"profile"}
    assert all(x.duration_s == pytest.approx(7 * MS) for x in decode if x.kind == "mlp")
    assert {x.cost_source for x in decode if x.kind != "mlp"} == {"analytic"}
