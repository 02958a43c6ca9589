"""``compile --serve``: the curve against load from hand-derived costs, the SLO choice and its
errors, pools and CPU attention from their stated formulas, the schema, ``show``, and the
engine's settings taken from the plan.

The model is the tiny llama of ``tests.exec.test_numerics`` (hidden 64, 2 layers, 4 heads of 16
over 2 KV heads, fp32). On a CPU with effectively unlimited FLOP/s every task is bound by its
bytes, so a decode step at batch b costs, by the cost model's stated formulas (``hetplan.cost``):

    tpot(b) = (W + b * per_token) / (bw * eff) + (2 + 4 L) * latency

with W the weights read (every parameter but the embedding table, 4 bytes each: transformers
counts them) and per_token the bytes that grow with each sequence: its embedding row (H * (4 +
4)), per layer the activations in and out of attn_in, attn_out and mlp (3 * 2 * H * 4) and its
cache read at the mean context P + (G + 1) / 2 (ctx * 2 * KVH * hd * 4), and the head's
activations (2 * H * 4). A prefill of one chunk likewise costs

    ttft(b) = (W + b * (P * (H * 8 + L * (3 * 2 * H * 4 + 2 * KVH * hd * 4 + (q + o) * 4)) + 2 * H * 4))
              / (bw * eff) + (2 + 4 L) * latency.
"""

from __future__ import annotations

import json
import re

import pytest
from hetplan.compiler import CompileRequest
from hetplan.errors import HetplanError
from hetplan.plan import load_plan
from hetplan.plan.format import Plan
from hetplan.serving import ServingRequest, compile_serving
from hetplan.serving.pools import cpu_attention_seconds
from tests.exec.test_numerics import save_tiny_model
from tests.test_cli import hetplan, user_error

BW, EFF, LAT = 10e9, 0.5, 2e-6
H, L, KVH, HD, Q, V = 64, 2, 2, 16, 64, 128
P, G = 32, 16
CPU_NODE = f"""
name: serve-cpu
cpu: {{name: cpu, cores: 2, memory: 4GiB, mem_bandwidth: 10GB/s, flops: {{fp32: 10PFLOPS}}}}
reserve: {{cpu: 1KiB}}
efficiency: {{cpu_mem: {EFF}, cpu_flops: 1.0}}
latency: {{cpu_task: {LAT}}}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("serving-llama")
    model = save_tiny_model("llama", d)
    node = d / "node.yaml"
    node.write_text(CPU_NODE)
    weights = 4 * (sum(p.numel() for p in model.parameters()) - V * H)
    return str(d), str(node), weights


def request(tiny, **kw):
    d, node, _ = tiny
    return CompileRequest(model=d, hw=node, weight_dtype="fp32", prompt_len=P, gen_len=G, **kw)


def hand_tpot(weights: float, b: int) -> float:
    ctx = P + (G + 1) / 2
    per_token = H * 8 + L * (3 * 2 * H * 4 + ctx * 2 * KVH * HD * 4) + 2 * H * 4
    return (weights + b * per_token) / (BW * EFF) + (2 + 4 * L) * LAT


def hand_ttft(weights: float, b: int) -> float:
    per_seq = P * (H * 8 + L * (3 * 2 * H * 4 + 2 * KVH * HD * 4 + (Q + Q) * 4)) + 2 * H * 4
    return (weights + b * per_seq) / (BW * EFF) + (2 + 4 * L) * LAT


def test_curve_points_are_the_hand_derived_costs_at_each_batch(tiny):
    plan, _ = compile_serving(request(tiny), ServingRequest(max_batch=8))
    w = tiny[2]
    curve = plan.serving["curve"]
    assert [p["batch"] for p in curve] == [1, 2, 4, 8]
    for p in curve:
        b, tpot, ttft = p["batch"], hand_tpot(w, p["batch"]), hand_ttft(w, p["batch"])
        assert p["tpot_s"] == pytest.approx(tpot, rel=1e-9)
        assert p["ttft_s"] == pytest.approx(ttft, rel=1e-9)
        assert p["decode_tokens_per_s"] == pytest.approx(b / tpot, rel=1e-9)
        assert p["throughput_tokens_per_s"] == pytest.approx(b * G / (ttft + G * tpot), rel=1e-9)
        assert p["arrival_rate_per_s"] == pytest.approx(b / (ttft + G * tpot), rel=1e-9)
        assert p["fits"] and p["meets_slo"]
    # memory-bound: every larger batch has more throughput, so the largest is chosen
    assert plan.serving["batch"] == 8 and plan.workload.batch == 8


def test_tpot_slo_keeps_the_largest_batch_within_it(tiny):
    w = tiny[2]
    slo = (hand_tpot(w, 2) + hand_tpot(w, 4)) / 2       # batch 2 meets it, batch 4 does not
    plan, _ = compile_serving(request(tiny), ServingRequest(max_batch=8, slo_tpot_s=slo))
    assert plan.serving["batch"] == 2
    assert [p["meets_slo"] for p in plan.serving["curve"]] == [True, True, False, False]


def test_ttft_slo_keeps_the_largest_batch_within_it(tiny):
    w = tiny[2]
    slo = (hand_ttft(w, 1) + hand_ttft(w, 2)) / 2
    plan, _ = compile_serving(request(tiny), ServingRequest(max_batch=8, slo_ttft_s=slo))
    assert plan.serving["batch"] == 1


def test_unmeetable_tpot_slo_is_one_line_naming_the_slo_and_what_meets_it(tiny, tmp_path):
    d, node, w = tiny
    out = tmp_path / "plan.json"
    line = user_error("compile", d, "--hw", node, "--weight-dtype", "fp32", "--prompt-len", P, "--gen-len", G,
                      "--serve", "--max-batch", "4", "--slo-tpot", "0.001", "-o", out)
    assert "--slo-tpot 0.001 ms" in line
    fastest_ms = float(re.search(r"pass --slo-tpot ([0-9.]+) or more", line).group(1))
    assert fastest_ms == pytest.approx(hand_tpot(w, 1) * 1e3, rel=1e-3)
    assert not out.exists()


def test_unmeetable_ttft_slo_names_the_fastest_prefill(tiny, tmp_path):
    d, node, w = tiny
    with pytest.raises(HetplanError, match=r"--slo-ttft .* pass --slo-ttft ([0-9.]+) or more") as e:
        compile_serving(request(tiny), ServingRequest(max_batch=4, slo_ttft_s=hand_ttft(w, 1) / 2))
    assert float(re.search(r"pass --slo-ttft ([0-9.]+)", str(e.value)).group(1)) == pytest.approx(
        hand_ttft(w, 1) * 1e3, rel=1e-3)


@pytest.mark.parametrize("args, flag", [(["--max-batch", "4"], "--max-batch"), (["--slo-tpot", "5"], "--slo-tpot"),
                                        (["--serve", "--batch", "4"], "--batch"),
                                        (["--serve", "--slo-ttft", "-1"], "--slo-ttft"),
                                        (["--serve", "--prompt-len", "32", "--gen-len", "16", "--max-context", "4096"],
                                         "--max-context 4096: model"),
                                        (["--serve", "--prompt-len", "32", "--gen-len", "16", "--max-context", "40"],
                                         "--max-context 40: less than")])
def test_serving_options_out_of_place_are_one_line_errors(tiny, tmp_path, args, flag):
    d, node, _ = tiny
    assert flag in user_error("compile", d, "--hw", node, "-o", tmp_path / "p.json", *args)


def test_pools_on_a_node_without_gpu_follow_their_formula(tiny):
    plan, _ = compile_serving(request(tiny), ServingRequest(max_batch=4, max_context=64))
    s = plan.serving
    # DRAM holds far more than 4 contexts of 64 tokens: the running pool is the cap, N x C tokens,
    # in blocks of 16 (4 x 15 wasted positions is more than 256 / 32); no DRAM swap tier.
    assert (s["block_tokens"], s["gpu_blocks"], s["cpu_blocks"]) == (16, 4 * 64 // 16, 0)
    assert s["block_bytes"] == 16 * L * 2 * KVH * HD * 4
    assert s["cpu_attention"] is False and s["cpu_attention_s"] is None


def gpu_node(cpu_bandwidth: str) -> str:
    return f"""
name: serve-gpu
gpus: [{{name: g, memory: 1GiB, mem_bandwidth: 100GB/s, flops: {{fp32: 10PFLOPS}}}}]
cpu: {{name: c, cores: 2, memory: 4GiB, mem_bandwidth: {cpu_bandwidth}, flops: {{fp32: 10PFLOPS}}}}
links: {{h2d: 10GB/s, d2h: 10GB/s}}
reserve: {{gpu: 1KiB, cpu: 1KiB}}
efficiency: {{gpu_mem: 1.0, cpu_mem: 1.0, link: 1.0, gpu_flops: 1.0, cpu_flops: 1.0}}
latency: {{gpu_task: 1.0e-6, cpu_task: 1.0e-6, link_task: 1.0e-6}}
"""


@pytest.mark.parametrize("cpu_bandwidth, hides", [("100GB/s", True), ("0.01GB/s", False)])
def test_cpu_attention_is_on_when_one_dram_request_hides_behind_the_gpu_step(tiny, tmp_path, cpu_bandwidth, hides):
    node = tmp_path / "gpu.yaml"
    node.write_text(gpu_node(cpu_bandwidth))
    req = CompileRequest(model=tiny[0], hw=str(node), weight_dtype="fp32", prompt_len=P, gen_len=G)
    plan, _ = compile_serving(req, ServingRequest(max_batch=2))
    bw = float(cpu_bandwidth.removesuffix("GB/s")) * 1e9
    ctx = P + (G + 1) / 2
    per_layer = ctx * 2 * KVH * HD * 4 / bw + 1e-6 + ((Q + 2 * KVH * HD) * 4 / 10e9 + 1e-6) + (Q * 4 / 10e9 + 1e-6)
    a = L * per_layer
    s = plan.serving
    assert s["cpu_attention_s"] == pytest.approx(a, rel=1e-9)
    assert cpu_attention_seconds(plan.model, plan.hardware, ctx) == pytest.approx(a, rel=1e-9)
    assert s["cpu_attention"] is hides
    assert s["cpu_attention_requests"] == int(plan.predicted["tpot_s"] // a)
    assert s["cpu_blocks"] > 0


def test_serving_plan_round_trips_and_show_draws_its_curve(tiny, tmp_path):
    d, node, _ = tiny
    out = tmp_path / "plan.json"
    r = hetplan("compile", d, "--hw", node, "--weight-dtype", "fp32", "--prompt-len", P, "--gen-len", G,
                "--serve", "--max-batch", "4", "-o", out)
    assert r.returncode == 0, r.stderr
    plan = load_plan(str(out))
    assert [p["batch"] for p in plan.serving["curve"]] == [1, 2, 4]
    shown = hetplan("show", out).stdout
    rows = [l for l in shown.splitlines() if re.match(r"^\s+[124]\s+[0-9.]", l)]
    assert len(rows) == 3 and rows[-1].endswith("<- chosen") and "#" in rows[0]
    doc = json.loads(out.read_text())
    doc["serving"]["surprise"] = 1
    with pytest.raises(HetplanError, match="serving"):
        Plan.from_dict(doc, verify=False)


def test_a_plan_without_serve_has_no_serving_key(tiny, tmp_path):
    d, node, _ = tiny
    out = tmp_path / "plan.json"
    r = hetplan("compile", d, "--hw", node, "--weight-dtype", "fp32", "--prompt-len", P, "--gen-len", G, "-o", out)
    assert r.returncode == 0, r.stderr
    assert "serving" not in json.loads(out.read_text())


def test_serve_settings_come_from_the_serving_plan_and_flags_override_them(tiny):
    from hetplan.runtime.serve.settings import settings_for
    plan, _ = compile_serving(request(tiny), ServingRequest(max_batch=4, max_context=64))
    s = plan.serving
    got = settings_for(plan)
    assert (got.block_tokens, got.gpu_blocks, got.cpu_blocks, got.max_batch, got.max_context, got.cpu_attention) == (
        s["block_tokens"], s["gpu_blocks"], s["cpu_blocks"], s["batch"], s["max_context"], s["cpu_attention"])
    over = settings_for(plan, block_tokens=8, max_batch=2)
    assert (over.block_tokens, over.gpu_blocks, over.max_batch) == (8, s["gpu_blocks"] * 2, 2)


def test_check_recompiles_a_serving_plan_with_its_serving_options(tiny, tmp_path):
    d, node, _ = tiny
    out = tmp_path / "plan.json"
    r = hetplan("compile", d, "--hw", node, "--weight-dtype", "fp32", "--prompt-len", P, "--gen-len", G,
                "--serve", "--max-batch", "4", "--max-context", "48", "-o", out)
    assert r.returncode == 0, r.stderr
    r = hetplan("check", out)
    assert r.returncode == 0, r.stderr
    assert "identical" in r.stdout
    doc = json.loads(out.read_text())
    doc["serving"]["gpu_blocks"] += 1  # a serving part the inputs no longer give
    out.write_text(json.dumps(doc, indent=1, sort_keys=True))
    assert "identical" not in hetplan("check", out).stdout
