"""`hetplan compile model.gguf`: the spec read from the metadata, each block priced as the file
and the runtime hold it.

Expected values come from outside the frontend: the file's bytes per block are summed from
``gguf.GGUFReader``'s own tensor list, grouped by the llama.cpp names here; the held bytes
from the conversion rule written out below as arithmetic on each tensor's shape and type.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import gguf
from gguf import GGUFReader

from hetplan.compiler import CompileRequest, compile_plan
from hetplan.frontends.gguf import spec_from_gguf
from hetplan.frontends.resolve import load_model
from hetplan.plan import Plan
from tests.gguf.files import Dims, llama31_8b_q4_k_m_types, write_deepseek2, write_header_only, write_model

MIXED = {"token_embd.weight": "F16", "attn_q.weight": "Q4_K", "attn_k.weight": "Q4_0", "attn_v.weight": "Q6_K",
         "attn_output.weight": "Q8_0", "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q4_K",
         "ffn_down.weight": "Q6_K", "output.weight": "Q6_K", "blk.1.attn_output.weight": "F16",
         "ffn_gate_exps.weight": "Q4_K", "ffn_up_exps.weight": "Q4_K", "ffn_down_exps.weight": "Q6_K",
         "ffn_gate_inp.weight": "F32"}
"""Every type per tensor: K-quants, Q8_0, Q4_0, F16 linears and F32 norms and router."""

HELD = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_K": (256, 156), "Q6_K": (32, 34)}
"""ggml type -> (values, bytes) per block of the runtime format it is held in: q8_0, q4_0,
q4_k_m (fp32 dmin + 8 fp16 scales + 8 mins + 128 nibble bytes per 256), and q8_0 for Q6_K."""


def block_of(name: str, layers: int, moe) -> str | None:
    """llama.cpp name -> block; ``moe``: True (every layer routed), False, or the routed layers."""
    if name == "token_embd.weight":
        return "embed"
    if name.startswith("output"):
        return "head"
    parts = name.split(".")
    if parts[0] != "blk":
        return None
    routed = moe if isinstance(moe, bool) else int(parts[1]) in moe
    kind = "attn" if parts[2].startswith("attn") else ("moe" if routed else "mlp")
    return f"{kind}_{parts[1]}"


def file_bytes(path, layers: int, moe: bool) -> dict:
    out = Counter()
    for t in GGUFReader(str(path)).tensors:
        if (b := block_of(t.name, layers, moe)) is not None:
            out[b] += int(t.n_bytes)
    return dict(out)


def held_bytes(path, layers: int, moe: bool, tied: bool = False) -> dict:
    """The conversion rule: linears packed per matrix (rows * blocks * bytes, 16-byte aligned;
    stacked experts one matrix each), unquantised linears and norms at 4 bytes, the embedding
    table at 2 bytes; a tied head holds the embedding again as a linear."""
    out = Counter()

    def linear(t) -> int:
        cols, rows = int(t.shape[0]), int(t.shape[1])
        count = int(t.shape[2]) if len(t.shape) > 2 else 1
        if t.tensor_type.name not in HELD:
            return int(t.n_elements) * 4
        values, size = HELD[t.tensor_type.name]
        return count * (-(-rows * (cols // values) * size // 16) * 16)

    for t in GGUFReader(str(path)).tensors:
        b = block_of(t.name, layers, moe)
        if b is None:
            continue
        if t.name == "token_embd.weight":
            out[b] += int(t.n_elements) * 2
            if tied:
                out["head"] += linear(t)
        else:
            out[b] += linear(t) if len(t.shape) > 1 else int(t.n_elements) * 4
    return dict(out)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen3moe", False)])
def test_block_bytes_are_the_files_and_the_held_bytes_follow_the_rule(tmp_path, node, arch, tied):
    path = tmp_path / "m.gguf"
    write_model(path, arch, MIXED, tied=tied)
    moe = arch == "qwen3moe"
    plan, _ = compile_plan(CompileRequest(model=str(path), hw=node, strategy="all-gpu", prompt_len=8, gen_len=4))
    d = json.loads(plan.to_json())
    placed = {p["block"]: p["weight_bytes"] for p in plan.placement}
    assert placed == pytest.approx(held_bytes(path, 2, moe, tied), rel=0, abs=0)
    assert plan.model.extra["gguf"]["file_bytes"] == file_bytes(path, 2, moe)
    assert plan.model.weight_dtype in ("q8_0", "q4_k_m")
    assert d["model"]["block_bytes"]["attn_0"] == placed["attn_0"]  # carried into plan.json
    assert Plan.from_json(plan.to_json()).model == plan.model


def test_q8_0_and_q4_0_linears_are_held_in_their_file_bytes(tmp_path):
    """Repacked blocks keep their size: a block of Q8_0/Q4_0 linears and F32 norms holds the
    file's bytes, each linear rounded up to 16."""
    path = tmp_path / "m.gguf"
    write_model(path, "llama", {"attn_q.weight": "Q4_0", "attn_k.weight": "Q8_0", "attn_v.weight": "Q4_0",
                                "attn_output.weight": "Q8_0"})
    spec = load_model(str(path))
    reader = GGUFReader(str(path))
    want = sum(-(-int(t.n_bytes) // 16) * 16 for t in reader.tensors if t.name.startswith("blk.0.attn"))
    assert spec.block_bytes["attn_0"] == want


def test_metadata_maps_to_the_spec(tmp_path):
    path = tmp_path / "m.gguf"
    dims = Dims(layers=3, hidden=256, ffn=512, heads=8, kv_heads=2, head_dim=32, vocab=300, experts=4,
                experts_used=2, expert_ffn=256, context=777)
    write_model(path, "qwen3moe", dims=dims)
    s = load_model(str(path))
    assert (s.arch, s.n_layers, s.hidden, s.n_heads, s.n_kv_heads, s.head_dim, s.vocab, s.max_positions) == \
        ("qwen3_moe", 3, 256, 8, 2, 32, 300, 777)
    assert (s.n_experts, s.experts_per_token, s.moe_intermediate, s.qk_norm, s.norm_eps, s.rope_theta) == \
        (4, 2, 256, True, pytest.approx(1e-5), 10000.0)
    write_model(path, "llama", dims=dims, tied=True)
    s = load_model(str(path))
    assert (s.arch, s.intermediate, s.tie_embeddings, s.qk_norm, s.attn_bias) == ("llama", 512, True, False, False)


def test_weight_dtype_other_than_the_files_plans_requantised(tmp_path):
    path = tmp_path / "m.gguf"
    write_model(path, "llama", {"attn_q.weight": "Q4_K"})
    s = load_model(str(path), weight_dtype="q4_0")
    assert s.weight_dtype == "q4_0" and s.block_bytes == {}


LLAMA_31_8B = Dims(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, context=131072)


def test_llama_3_1_8b_q4_k_m_layout_prices_the_files_bytes(tmp_path, node):
    """The real shapes and Q4_K_M types of Llama 3.1 8B, tensor data a sparse hole: the plan's
    file bytes per block are the reader's, and the held bytes follow the rule."""
    path = tmp_path / "llama-3.1-8b-q4_k_m.gguf"
    size = write_header_only(path, LLAMA_31_8B, llama31_8b_q4_k_m_types())
    spec = load_model(str(path))
    assert spec.extra["gguf"]["file_bytes"] == file_bytes(path, 32, False)
    assert sum(spec.extra["gguf"]["file_bytes"].values()) < size
    held = held_bytes(path, 32, False)
    assert {k: v for k, v in spec.block_bytes.items()} == held
    assert spec.weight_dtype == "q4_k_m" and spec.extra["gguf"]["types"] == {"F32": 66, "Q4_K": 193, "Q6_K": 33}


def test_deepseek2_maps_mla_and_shared_experts(tmp_path, node):
    path = tmp_path / "ds.gguf"
    dims = Dims(layers=3, hidden=256, ffn=512, heads=4, vocab=256, experts=4, experts_used=2, expert_ffn=64)
    want = write_deepseek2(path, dims, {"ffn_down_exps.weight": "Q4_0", "attn_kv_b.weight": "F16"})
    spec = load_model(str(path))
    assert {k: getattr(spec, k) for k in want} == want
    assert spec.extra["scoring_func"] == "sigmoid" and spec.extra["routed_scaling_factor"] == 2.5
    assert spec.extra["norm_topk_prob"] is True
    plan, _ = compile_plan(CompileRequest(model=str(path), hw=node, strategy="all-gpu", prompt_len=8, gen_len=4))
    placed = {p["block"]: p["weight_bytes"] for p in plan.placement}
    assert set(placed) == {"embed", "attn_0", "mlp_0", "attn_1", "moe_1", "attn_2", "moe_2", "head"}
    assert placed == held_bytes(path, 3, {1, 2})
    assert plan.model.extra["gguf"]["file_bytes"] == file_bytes(path, 3, {1, 2})
    # one routed expert: gate and up [64, 256] in Q8_0 (34 B per 32), down [256, 64] in Q4_0 (18 B per 32)
    assert spec.expert_bytes() == 2 * 64 * (256 // 32) * 34 + 256 * (64 // 32) * 18


def test_llama_with_experts_is_mixtral(tmp_path, node):
    path = tmp_path / "mx.gguf"
    write_model(path, "llama", {"ffn_down_exps.weight": "Q6_K"}, moe=True)
    spec = load_model(str(path))
    assert (spec.arch, spec.n_experts, spec.experts_per_token, spec.moe_intermediate) == ("mixtral", 4, 2, 512)
    plan, _ = compile_plan(CompileRequest(model=str(path), hw=node, strategy="all-gpu", prompt_len=8, gen_len=4))
    assert {p["block"]: p["weight_bytes"] for p in plan.placement} == held_bytes(path, 2, True)
    # one routed expert: gate and up [512, 256] in Q8_0, down [256, 512] in Q6_K (held as q8_0)
    assert spec.expert_bytes() == 2 * 512 * (256 // 32) * 34 + 256 * (512 // 32) * 34


def test_dense_stages_read_the_bytes_their_block_holds(tmp_path, node):
    """Decode reads each dense block's held bytes once (plus the activations in and out, 2 x
    hidden x 2 bytes per stage at batch 1): a Q6_K tensor held as q8_0 costs its q8_0 bytes."""
    path = tmp_path / "m.gguf"
    write_model(path, "llama", MIXED)
    plan, _ = compile_plan(CompileRequest(model=str(path), hw=node, strategy="all-gpu", prompt_len=8, gen_len=4))
    placed = {p["block"]: p["weight_bytes"] for p in plan.placement}
    act = 2 * 256 * 2
    read = Counter()
    stages = Counter()
    for t in plan.schedule["decode"].tasks:
        if t.kind in ("attn_in", "attn_out", "mlp", "head"):
            read[t.block] += t.bytes
            stages[t.block] += 1
    for block in ("attn_0", "attn_1", "mlp_0", "mlp_1", "head"):
        assert read[block] == pytest.approx(placed[block] + stages[block] * act, rel=1e-9), block


def test_one_experts_bytes_are_its_three_tensors_each_in_its_own_type(tmp_path):
    """A routed expert of a Q4_K gate/up, Q6_K down file is priced per tensor type (two q4_k_m
    matrices and one q8_0 matrix, ``HELD``), not at one bytes-per-weight for the block."""
    path = tmp_path / "m.gguf"
    dims = Dims()
    write_model(path, "qwen3moe", MIXED, dims=dims)
    spec = spec_from_gguf(path)

    def matrix(kind, rows, cols):
        values, size = HELD[kind]
        return -(-rows * (cols // values) * size // 16) * 16

    d, i = dims.hidden, dims.expert_ffn
    want = 2 * matrix("Q4_K", i, d) + matrix("Q6_K", d, i)
    assert spec.expert_bytes() == want
    assert want != 3 * matrix("Q4_K", i, d) and want != 3 * matrix("Q6_K", i, d)


def test_deepseek2_yarn_scaling_reads_back_what_the_converter_wrote(tmp_path):
    """llama.cpp's converter writes DeepSeek-V3's yarn as type, factor, original context and
    ``yarn_log_multiplier = 0.1 * mscale_all_dim`` (config: factor 40, 4096, mscale 1.0)."""
    from gguf import GGUFWriter
    src = tmp_path / "ds.gguf"
    write_deepseek2(src, Dims(layers=2, hidden=256, heads=4, experts=4, expert_ffn=64))
    reader = GGUFReader(str(src))
    path = tmp_path / "yarn.gguf"
    w = GGUFWriter(str(path), "deepseek2")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(40.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_rope_scaling_yarn_log_mul(0.1 * 1.0)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    scaling = load_model(str(path)).rope_scaling
    assert scaling == {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                       "mscale": pytest.approx(1.0), "mscale_all_dim": pytest.approx(1.0)}


def test_moe_stages_read_each_expert_at_its_held_bytes(tmp_path, node):
    """At batch 1 under uniform routing each of the 4 experts is touched with probability 1/2:
    the decode step's expert task reads 2 experts at their held bytes (two q4_k_m matrices and
    one q8_0, not the plan dtype's bytes per parameter), plus the hidden state in and out
    (2 d a, no shared experts) and each expert's rows there and back (2 x 4 x d a / 2)."""
    path = tmp_path / "m.gguf"
    dims = Dims()
    write_model(path, "qwen3moe", MIXED, dims=dims)
    plan, _ = compile_plan(CompileRequest(model=str(path), hw=node, strategy="all-gpu", prompt_len=8, gen_len=4))
    spec = plan.model

    def matrix(kind, rows, cols):
        values, size = HELD[kind]
        return -(-rows * (cols // values) * size // 16) * 16

    d, i, a = dims.hidden, dims.expert_ffn, 2           # fp16 activations
    expert = 2 * matrix("Q4_K", i, d) + matrix("Q6_K", d, i)
    tasks = [t for t in plan.schedule["decode"].tasks if t.block == "moe_1" and t.kind == "moe_experts"]
    assert len(tasks) == 1
    assert tasks[0].bytes == pytest.approx(2 * expert + 2 * d * a + 4 * d * a, rel=1e-9)
    assert expert != spec.expert_params() * spec.weight_bytes_per_param
