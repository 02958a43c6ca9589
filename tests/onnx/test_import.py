"""Planning ONNX exports: blocks are the model's layers, sizes are the model's, costs agree with
the analytic model of the same config."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

pytest.importorskip("onnx")
pytest.importorskip("transformers")

from tests.onnx.exports import export  # noqa: E402

from hetplan.cli import main  # noqa: E402
from hetplan.compiler import CompileRequest, compile_plan  # noqa: E402
from hetplan.graph import block_graph  # noqa: E402
from hetplan.hardware import load_node  # noqa: E402
from hetplan.frontends.hf_config import spec_from_config  # noqa: E402
from hetplan.frontends.onnx.graph import onnx_block_graph  # noqa: E402
from hetplan.frontends.onnx.importer import spec_from_onnx  # noqa: E402
from hetplan.problem import build_problem  # noqa: E402
from hetplan.solvers import baselines  # noqa: E402
from hetplan.workload import Workload  # noqa: E402

CASES = [("llama", False), ("llama", True), ("gpt2", False), ("gpt2", True)]
LAYER_PREFIX = {"llama": "model.layers.{l}.", "gpt2": "transformer.h.{l}."}
ATTN_PARTS = {"llama": ("self_attn.", "input_layernorm."), "gpt2": ("attn.", "ln_1.")}


def _numel(shape) -> int:
    return math.prod(shape)


@pytest.mark.parametrize("family,with_past", CASES)
def test_blocks_are_the_layers_and_hold_their_parameters(family, with_past):
    path, cfg, params = export(family, with_past)
    spec = spec_from_onnx(path)
    graph = onnx_block_graph(spec, Workload(batch=1, prompt_len=4, gen_len=2))
    n_layers = cfg.get("num_hidden_layers", cfg.get("n_layer"))
    expected = ["embed"] + [f"{k}_{l}" for l in range(n_layers) for k in ("attn", "mlp")] + ["head"]
    assert [b.name for b in graph.blocks] == expected
    # Each layer block holds exactly that layer's transformers parameters (fp32: 4 bytes each).
    for l in range(n_layers):
        prefix = LAYER_PREFIX[family].format(l=l)
        layer = {k: v for k, v in params.items() if k.startswith(prefix)}
        attn = sum(_numel(s) for k, s in layer.items() if k[len(prefix):].startswith(ATTN_PARTS[family]))
        mlp = sum(_numel(s) for s in layer.values()) - attn
        # llama's rotary inverse frequencies (head_dim / 2 floats) are computed once for all
        # layers and land in the first attention block; they are not parameters.
        extra = cfg["hidden_size"] // cfg["num_attention_heads"] // 2 if family == "llama" and l == 0 else 0
        assert graph.block(f"attn_{l}").weight_bytes == 4 * (attn + extra)
        assert graph.block(f"mlp_{l}").weight_bytes == 4 * mlp


@pytest.mark.parametrize("family,with_past", CASES)
def test_spec_is_read_off_the_graph(family, with_past):
    path, cfg, _ = export(family, with_past)
    spec = spec_from_onnx(path)
    hf = spec_from_config(cfg)
    for key in ("n_layers", "hidden", "intermediate", "n_heads", "n_kv_heads", "head_dim", "vocab",
                "norm", "gated_mlp", "pos", "attn_bias", "mlp_bias"):
        assert getattr(spec, key) == getattr(hf, key), key
    assert spec.arch == family and spec.weight_dtype == "fp32"
    assert spec.extra["source"] == "onnx" and spec.extra["with_past"] is with_past
    assert spec.kv_bytes_per_token() == hf.with_dtypes("fp32", "fp32").kv_bytes_per_token()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_onnx_plan_agrees_with_the_hf_config_plan(family):
    """Weights and KV per block within 1%; FLOPs per block and phase within 1%. The analytic model
    counts the causal half of the prompt's attention square and logits at the last position
    only; the export computes the whole square (a difference below (P - 1) / (3 D) of an
    attention block: 0.4% at P = 4, D = 256) and logits at every position (P times the head's)."""
    sizes = (dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512) if family == "llama" else dict(n_embd=256, n_head=4, vocab_size=512))
    path, cfg, _ = export(family, True, **sizes)
    wl = Workload(batch=2, prompt_len=4, gen_len=6)
    onnx_g = onnx_block_graph(spec_from_onnx(path), wl)
    hf_g = block_graph(spec_from_config(cfg).with_dtypes("fp32", "fp32"), wl)
    for b in hf_g.blocks:
        o = onnx_g.block(b.name)
        assert o.weight_bytes == pytest.approx(b.weight_bytes, rel=0.01), b.name
        assert o.kv_bytes == pytest.approx(b.kv_bytes, rel=0.01), b.name
    for phase in ("prefill", "decode"):
        hf_flops = {}
        for st in hf_g.stages[phase]:
            hf_flops[st.block] = hf_flops.get(st.block, 0.0) + st.work.flops
        total = sum(hf_flops.values())
        for st in onnx_g.stages[phase]:
            want = hf_flops[st.block] * (wl.prompt_len if (phase, st.kind) == ("prefill", "head") else 1)
            assert st.work.flops == pytest.approx(want, rel=0.01, abs=1e-3 * total), (phase, st.block)


def test_decode_is_planned_with_the_kv_cache_only_for_with_past_graphs():
    wl = Workload(batch=1, prompt_len=8, gen_len=8)
    with_past = onnx_block_graph(spec_from_onnx(export("llama", True)[0]), wl)
    without = onnx_block_graph(spec_from_onnx(export("llama", False)[0]), wl)
    assert with_past.block("attn_0").kv_bytes == 1 * 16 * (2 * 2 * 16) * 4
    assert without.block("attn_0").kv_bytes == 0
    # Without a cache every decode step recomputes the whole context (about 12.5 tokens here).
    ctx = wl.decode_context_len
    mlp_flops = [st.work.flops for st in without.stages["decode"] if st.block == "mlp_0"][0]
    mlp_flops_cached = [st.work.flops for st in with_past.stages["decode"] if st.block == "mlp_0"][0]
    assert mlp_flops == pytest.approx(ctx * mlp_flops_cached)


def test_compile_cli_plans_an_onnx_model(tmp_path):
    path, _, _ = export("gpt2", True)
    out = tmp_path / "plan.json"
    rc = main(["compile", str(path), "--hw", "rtx4090-64g", "-o", str(out), "--prompt-len", "8",
               "--gen-len", "4", "--gpu-mem", "150KB"])
    assert rc == 0
    plan = json.loads(out.read_text())
    assert [p["block"] for p in plan["placement"]][:3] == ["embed", "attn_0", "mlp_0"]
    assert plan["model"]["extra"]["source"] == "onnx"
    assert plan["solver"]["status"] == "optimal"


def test_stream_baseline_keeps_single_stage_attention_beside_its_cache():
    path, _, _ = export("llama", True)
    spec = spec_from_onnx(path)
    wl = Workload(batch=1, prompt_len=8, gen_len=4)
    hw = load_node("rtx4090-64g")
    graph = onnx_block_graph(spec, wl)
    kv = sum(b.kv_bytes for b in graph.blocks)
    slots = 2 * max(b.weight_bytes for b in graph.blocks if b.streamable)
    problem = build_problem(spec, hw, wl)
    # A GPU that holds the staging slots and workspace but only half the KV caches.
    problem = dataclasses.replace(problem, gpu_budget_bytes=slots + problem.gpu_workspace_bytes + kv / 2)
    dec = baselines.stream(problem)
    for b in graph.blocks:
        if b.kind == "attn":
            assert dec.kv[b.name] == dec.device("decode", b.name) == "cpu"


def test_compile_of_a_too_small_machine_names_the_missing_bytes():
    path, _, _ = export("llama", False)
    req = CompileRequest(model=str(path), hw="rtx4090-64g", prompt_len=8, gen_len=4, gpu_mem="1KB",
                         cpu_mem="1KB", weight_dtype="fp32")
    with pytest.raises(Exception, match="no placement fits"):
        compile_plan(req)
