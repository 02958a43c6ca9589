"""The cost model against arithmetic written out by hand for a small layer.

Spec used throughout: hidden d = 64, 4 query heads and 2 KV heads of 16 dims, SwiGLU width 96,
vocab 100, fp16. Machine (``tiny_node``): GPU 500 GB/s, 50 TFLOPS fp16, 10 TFLOPS fp32;
CPU 50 GB/s, 1 TFLOPS; links 16 GB/s; efficiencies gpu_mem 0.85, gpu_flops 0.7, cpu_mem 0.7,
cpu_flops 0.5, link 0.9; fixed latencies 20 us per compute task and 10 us per copy.
"""

import itertools

import pytest
from tests.conftest import tiny_node, tiny_spec

from hetplan import cost
from hetplan.cost import Work
from hetplan.dtypes import bytes_per_element
from hetplan.graph import block_graph
from hetplan.presets.models import model_preset
from hetplan.problem import build_problem
from hetplan.workload import Workload


def small(**kw):
    return tiny_spec(n_layers=1, hidden=64, intermediate=96, n_heads=4, n_kv_heads=2, head_dim=16,
                     vocab=100, **kw)


@pytest.mark.parametrize("dtype,nbytes", [
    ("fp32", 4.0), ("fp16", 2.0), ("bf16", 2.0), ("int8", 1.0),
    ("q8_0", 34 / 32),     # 32 int8 weights + one fp16 scale per block of 32
    ("q4_0", 18 / 32),     # 32 nibbles (16 bytes) + one fp16 scale: 4.5 bits
    ("q4_k_m", 156 / 256),  # super-blocks of 256: fp32 min scale + 8 fp16 scales + 8 mins + 128 B of nibbles
])
def test_bytes_per_weight_include_quantisation_scales(dtype, nbytes):
    assert bytes_per_element(dtype) == pytest.approx(nbytes, rel=1e-12)


def test_attention_and_mlp_parameters_counted_by_hand():
    spec = small()
    q, k, v, o, norm = 64 * 64, 64 * 32, 64 * 32, 64 * 64, 64
    assert spec.attn_params() == q + k + v + o + norm == 12352
    assert spec.mlp_params(0) == 3 * 64 * 96 + norm == 18496


def test_block_weight_bytes_are_params_times_bytes_per_weight():
    spec = small(weight_dtype="fp16")
    g = block_graph(spec, Workload(batch=1, prompt_len=8, gen_len=8))
    assert g.block("attn_0").weight_bytes == 12352 * 2
    assert g.block("mlp_0").weight_bytes == 18496 * 2


def test_quantised_block_bytes_are_packed_linears_and_fp32_norms():
    """q4_k_m: each output row on its own, 156 B per 256 weights or part of 256 (a 64- or
    96-wide row is one padded super-block), the norm 64 x 4 B."""
    g = block_graph(small(weight_dtype="q4_k_m"), Workload(batch=1, prompt_len=8, gen_len=8))
    q, kv = 64 * 156, 32 * 156                                    # rows x one super-block each
    assert g.block("attn_0").weight_bytes == 2 * q + 2 * kv + 64 * 4
    assert g.block("mlp_0").weight_bytes == 2 * (96 * 156) + 64 * 156 + 64 * 4  # gate, up [96, 64]; down [64, 96]
    i8 = block_graph(small(weight_dtype="int8"), Workload(batch=1, prompt_len=8, gen_len=8))
    rows = lambda r, c: -(-(r * (c + 4)) // 16) * 16  # noqa: E731 - an fp32 scale per row, aligned
    assert i8.block("attn_0").weight_bytes == rows(64, 64) * 2 + rows(32, 64) * 2 + 64 * 4


def test_linear_is_two_flops_per_weight_per_token_and_reads_weights_once():
    # 5 tokens through 1000 weights: 2*5*1000 FLOPs; bytes = weights + activations in and out.
    w = cost.linear_work(5, 1000, small())
    assert w.flops == 10_000
    assert w.bytes == 1000 * 2 + 2 * 5 * 64 * 2
    w4 = cost.linear_work(5, 1000, small(weight_dtype="q4_0"))
    assert w4.bytes == pytest.approx(1000 * 0.5625 + 2 * 5 * 64 * 2)


def test_activations_are_fp32_only_for_fp32_weights():
    assert cost.activation_bytes_per_elem(small(weight_dtype="fp32")) == 4
    for dtype in ("fp16", "bf16", "q8_0", "q4_0"):
        assert cost.activation_bytes_per_elem(small(weight_dtype=dtype)) == 2


def test_gpu_time_is_the_slower_of_compute_and_memory_plus_latency():
    hw, spec = tiny_node(), small()
    compute_bound = Work(flops=7e12, bytes=1e6)        # 7e12 / (50e12 * 0.7) = 0.2 s
    assert cost.gpu_seconds(compute_bound, spec, hw) == pytest.approx(0.2 + 20e-6, rel=1e-12)
    memory_bound = Work(flops=1e6, bytes=8.5e9)        # 8.5e9 / (500e9 * 0.85) = 0.02 s
    assert cost.gpu_seconds(memory_bound, spec, hw) == pytest.approx(0.02 + 20e-6, rel=1e-12)


def test_gpu_peak_follows_the_compute_dtype():
    hw = tiny_node()
    work = Work(flops=7e12, bytes=0.0)
    assert cost.gpu_seconds(work, small(weight_dtype="fp32"), hw) == pytest.approx(1.0 + 20e-6)  # 10 TFLOPS
    assert cost.gpu_seconds(work, small(weight_dtype="q4_0"), hw) == pytest.approx(0.2 + 20e-6)  # dequantised to fp16


def test_cpu_time_uses_dram_bandwidth_and_cpu_peak():
    hw, spec = tiny_node(), small()
    # memory: 3.5e9 / (50e9 * 0.7) = 0.1 s; compute: 1e9 / (1e12 * 0.5) = 0.002 s
    assert cost.cpu_seconds(Work(flops=1e9, bytes=3.5e9), spec, hw) == pytest.approx(0.1 + 20e-6)
    # compute: 1e12 / (1e12 * 0.5) = 2 s
    assert cost.cpu_seconds(Work(flops=1e12, bytes=1e3), spec, hw) == pytest.approx(2.0 + 20e-6)


def test_transfer_is_bytes_over_effective_link_plus_latency():
    hw = tiny_node()
    # 1.44e9 / (16e9 * 0.9) = 0.1 s
    assert cost.h2d_seconds(1.44e9, hw) == pytest.approx(0.1 + 10e-6, rel=1e-12)
    assert cost.d2h_seconds(1.44e9, hw) == pytest.approx(0.1 + 10e-6, rel=1e-12)


@pytest.mark.parametrize("kv_dtype,expected", [("fp16", 2 * 2 * 16 * 2), ("fp32", 2 * 2 * 16 * 4),
                                               ("q8_0", 2 * 2 * 16 * 34 / 32)])
def test_kv_bytes_per_token_are_k_and_v_for_every_kv_head(kv_dtype, expected):
    assert small(kv_dtype=kv_dtype).kv_bytes_per_token() == pytest.approx(expected)


def test_kv_cache_of_a_block_holds_the_full_context_of_every_sequence():
    g = block_graph(small(), Workload(batch=3, prompt_len=20, gen_len=12))
    assert g.block("attn_0").kv_bytes == 3 * (20 + 12) * 128


def test_mla_caches_only_the_latent_and_the_rope_key():
    spec = model_preset("deepseek-v3")
    # kv_lora_rank 512 + qk_rope_head_dim 64, bf16; far less than 2 * 128 heads * 192 dims
    assert spec.kv_bytes_per_token() == (512 + 64) * 2
    w = cost.attention_decode_work(2, 100, spec)
    assert w.flops == 4 * 2 * 128 * (512 + 64) * 100
    assert w.bytes == 2 * 100 * (512 + 64) * 2


def test_prefill_attention_counts_the_causal_half():
    # QK^T and PV over P(P+1)/2 pairs: 4 * batch * heads * head_dim * 55 for P = 10
    w = cost.attention_prefill_work(2, 10, small())
    assert w.flops == 4 * 2 * 4 * 16 * 55
    # writes the prompt's KV, reads q, writes the output
    assert w.bytes == 2 * 10 * (128 + (64 + 64) * 2)


def test_decode_attention_reads_the_whole_cache():
    w = cost.attention_decode_work(2, 100, small())
    assert w.flops == 4 * 2 * 4 * 16 * 100
    assert w.bytes == 2 * 100 * 128


def test_decode_at_the_mean_context_sums_to_every_step():
    wl = Workload(batch=1, prompt_len=30, gen_len=9)
    per_step = sum(cost.attention_decode_work(1, wl.prompt_len + i, small()).bytes for i in range(1, 10))
    mean = cost.attention_decode_work(1, wl.decode_context_len, small()).bytes
    assert wl.gen_len * mean == pytest.approx(per_step, rel=1e-12)


def test_expected_distinct_experts_matches_enumeration():
    n, k = 8, 2
    choices = list(itertools.combinations(range(n), k))
    for tokens in (1, 2, 3):
        union = [len(set().union(*pick)) for pick in itertools.product(choices, repeat=tokens)]
        assert cost.expected_distinct_experts(n, k, tokens) == pytest.approx(sum(union) / len(union))
    assert cost.expected_distinct_experts(n, k, 2) == pytest.approx(3.5)   # 8 * (1 - (6/8)^2)
    assert cost.expected_distinct_experts(n, k, 10_000) == pytest.approx(n)


def test_moe_reads_shared_weights_and_the_experts_the_batch_touches():
    spec = small(arch="mixtral", n_experts=4, experts_per_token=2, moe_intermediate=32)
    shared = 64 * 4 + 64                 # router + norm
    expert = 3 * 64 * 32                 # gate, up, down
    distinct = 4 * (1 - 0.5 ** 3)        # 3 tokens, top-2 of 4
    w = cost.moe_work(3, spec)
    assert w.flops == pytest.approx(2 * 3 * (shared + 2 * expert))
    assert w.bytes == pytest.approx((shared + distinct * expert) * 2 + 2 * 3 * 64 * 2)


def test_embedding_is_a_gather_without_flops():
    w = cost.embed_work(7, small())
    assert w.flops == 0
    assert w.bytes == 7 * 64 * (2 + 2)


def test_problem_prices_loads_kv_copies_and_activation_copies():
    spec, hw = small(), tiny_node()
    wl = Workload(batch=2, prompt_len=16, gen_len=4)
    p = build_problem(spec, hw, wl)
    link = 16e9 * 0.9
    assert p.load_s["mlp_0"] == pytest.approx(18496 * 2 / link + 10e-6, rel=1e-12)
    assert p.kv_down_s["attn_0"] == pytest.approx(2 * 16 * 128 / link + 10e-6, rel=1e-12)
    attn_in = next(sc for sc in p.stages["prefill"] if sc.stage.kind == "attn_in")
    assert attn_in.up_s == pytest.approx(2 * 16 * 64 * 2 / link + 10e-6, rel=1e-12)
    decode_mlp = next(sc for sc in p.stages["decode"] if sc.stage.kind == "mlp")
    # one token per sequence: 2 * 2 * 18496 FLOPs; bytes 18496 * 2 + 2 * 2 * 64 * 2, memory-bound
    assert decode_mlp.gpu_s == pytest.approx((18496 * 2 + 512) / (500e9 * 0.85) + 20e-6, rel=1e-12)
    assert decode_mlp.cpu_s == pytest.approx((18496 * 2 + 512) / (50e9 * 0.7) + 20e-6, rel=1e-12)
